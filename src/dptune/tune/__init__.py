"""``dptune.tune``: honest hyperparameter tuning. A study is planned in full before training
(``plan_study``), run on an executor, each run checked against the plan and merged into the study
ledger (stored in ``<dir>/study.sqlite``, resumable). See ``docs/tuning.md``."""

from dptune.tune.plan import plan_study
from dptune.tune.records import ArmPlan, RunSpec, StudyPlan
from dptune.tune.results import budget_rows, render, report_text, rerr_rows, study_status, study_table, write_csvs
from dptune.tune.spec import (
    BudgetSpec,
    DataSpec,
    MethodSpec,
    ModelSpec,
    SelectionSpec,
    StrategyArm,
    Study,
    TrainingSpec,
    load_study_config,
    study_from_dict,
)
from dptune.tune.study import Coordinator, StudyOutcome, load_stored_study, plan_only, resume_study, run_study
from dptune.tune.theory import LtVsMa, lt_max_runs, lt_solve, lt_total, lt_vs_ma, panda_total_epsilon, rerr

__all__ = [
    "Study",
    "DataSpec",
    "ModelSpec",
    "TrainingSpec",
    "BudgetSpec",
    "MethodSpec",
    "SelectionSpec",
    "StrategyArm",
    "load_study_config",
    "study_from_dict",
    "run_study",
    "resume_study",
    "study_status",
    "study_table",
    "budget_rows",
    "write_csvs",
    "render",
    "report_text",
    "rerr_rows",
    "plan_only",
    "plan_study",
    "StudyPlan",
    "ArmPlan",
    "RunSpec",
    "Coordinator",
    "StudyOutcome",
    "load_stored_study",
    "lt_vs_ma",
    "LtVsMa",
    "lt_solve",
    "lt_total",
    "lt_max_runs",
    "panda_total_epsilon",
    "rerr",
]
