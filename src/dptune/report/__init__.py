"""``dptune.report``: figures, CSVs and one self-contained HTML page per study.

The report layer takes plain data (lists of small dataclasses or dicts) and writes
files; it never needs the tuner. Entry points:

* ``build_report(out_dir, results_rows, histories, ledger_rows, selection_mode=...,
  planned=(ε, δ), spent=(ε, δ), ...) -> Path`` — the whole study page;
* ``figures`` — one function per figure, each returning the saved PNG's Path;
* ``html.write_report(out_dir, title, sections) -> Path`` — a page from custom sections;
* ``render_terminal_table(rows) -> rich.table.Table`` — the results table for a terminal;
* ``cosine_vs_clip(...)`` — the (non-private) clipping diagnostic of Galli Fig. 1;
* ``report_study(study_dir)`` — the report of a study stored by ``dptune.tune``.
"""

from dptune.report import figures
from dptune.report.build import build_report, ledger_rows_from_ledger
from dptune.report.data import (
    LedgerRow,
    LinearScalingFit,
    LtMaRow,
    RunHistory,
    SummaryRow,
    TrialResult,
    best_per_strategy,
    summarize,
)
from dptune.report.diagnostics import CosineResult, cosine_vs_clip
from dptune.report.html import FigureRef, Section, Table, write_report
from dptune.report.study import report_study
from dptune.report.tables import render_terminal_table

__all__ = [
    "build_report",
    "report_study",
    "ledger_rows_from_ledger",
    "figures",
    "write_report",
    "Section",
    "FigureRef",
    "Table",
    "render_terminal_table",
    "cosine_vs_clip",
    "CosineResult",
    "TrialResult",
    "SummaryRow",
    "RunHistory",
    "LedgerRow",
    "LinearScalingFit",
    "LtMaRow",
    "summarize",
    "best_per_strategy",
]
