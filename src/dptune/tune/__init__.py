"""``dptune.tune``: honest hyperparameter tuning — the privacy of the search is planned and counted.

>>> from dptune.tune import run_study, study_table
>>> run_study("study.toml", "runs/my-study", executor="local")     # doctest: +SKIP
>>> study_table("runs/my-study")                                    # doctest: +SKIP

A study (``Study`` / a TOML or YAML file) is planned in full before any training (``plan_study``);
runs execute on an executor (local, process pool, Ray), each checked against the plan and merged
into the study ledger, which must end equal to the plan. Stored in ``<dir>/study.sqlite``,
resumable after a crash (``resume_study``). See ``docs/tuning.md``.
"""

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
