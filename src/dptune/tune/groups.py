"""Which runs of a study train together as one task (``dptune.train_many``).

A pure function of the plan and ``study.trials_per_group``, so the coordinator (which trains the
groups) and ``results.study_status`` (whose ETA counts a group's running members once) agree
without either importing the other.
"""

from __future__ import annotations

from typing import Any

from dptune.tune.planners import StudyPlan


def plan_groups(plan: StudyPlan, size: int) -> dict[str, tuple[str, ...]]:
    """run_id → its group of ``size`` (``Coordinator.groups``, for a model that can be stacked)."""
    out: dict[str, tuple[str, ...]] = {}
    keyed: dict[tuple[Any, ...], list[str]] = {}
    for rid, r in plan.runs.items():
        keyed.setdefault((r.arm, r.stage, r.procedure if r.config is None else None), []).append(rid)
    for ids in keyed.values():
        for i in range(0, len(ids), max(1, size)):
            chunk = tuple(ids[i : i + size])
            if len(chunk) > 1:
                for rid in chunk:
                    out[rid] = chunk
    return out
