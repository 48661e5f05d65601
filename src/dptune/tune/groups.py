"""Which runs of a study train together as one task (``dptune.train_many``).

A pure function of the plan and ``study.trials_per_group``, so the coordinator (which trains the
groups) and ``results.study_status`` (whose ETA counts a group's running members once) agree
without either importing the other.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from dptune.tune.planners import StudyPlan


def plan_groups(plan: StudyPlan, size: int, unresolved: Collection[str] | None = None) -> dict[str, tuple[str, ...]]:
    """run_id → its group of ``size`` (``Coordinator.groups``, for a model that can be stacked).

    ``unresolved``: the runs planned without a configuration (adaptive stages, grouped per
    procedure); by default those whose configuration is still None. A coordinator passes the set
    it was planned with, so that runs resolved before the groups are first asked for (a resumed
    study) are grouped as in a fresh one."""
    out: dict[str, tuple[str, ...]] = {}
    keyed: dict[tuple[Any, ...], list[str]] = {}
    for rid, r in plan.runs.items():
        adaptive = r.config is None if unresolved is None else rid in unresolved
        keyed.setdefault((r.arm, r.stage, r.procedure if adaptive else None), []).append(rid)
    for ids in keyed.values():
        for i in range(0, len(ids), max(1, size)):
            chunk = tuple(ids[i : i + size])
            if len(chunk) > 1:
                for rid in chunk:
                    out[rid] = chunk
    return out
