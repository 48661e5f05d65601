"""``dptune.report``: figures, CSVs and one self-contained HTML page per study.

The page builder takes plain data (lists of small dataclasses or dicts) and writes files; it
never needs the tuner. ``report_study(study_dir)`` reports a study stored by ``dptune.tune``;
``build_report`` builds the page from your own rows (one ``ReportInputs``); ``figures`` has one
function per figure (docs/reports.md).
"""

from dptune.report import figures
from dptune.report.build import ReportInputs, build_report, ledger_rows_from_ledger
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
    "ReportInputs",
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
