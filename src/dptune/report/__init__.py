"""``dptune.report``: figures, CSVs and one self-contained HTML page per study, from plain rows (never the
tuner): ``report_study(study_dir)``, ``build_report`` (one ``ReportInputs``), ``figures`` (docs/reports.md)."""

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
