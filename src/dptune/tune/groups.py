"""Which runs of a study train together as one task (``dptune.train_many``): a pure function of
the plan, shared by the coordinator and ``results.study_status`` (whose ETA counts a group once)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from dptune.tune.records import StudyPlan


def balanced(config: Any) -> bool:
    """Whether a study's stored config asks for equal-size groups (planned since the marker; older: chunks of size)."""
    return bool((config or {}).get("_meta", {}).get("groups") == "balanced")


def plan_groups(
    plan: StudyPlan, size: int, unresolved: Collection[str] | None = None, balanced: bool = False
) -> dict[str, tuple[str, ...]]:
    """run_id → its group: the runs of one arm and stage (adaptive: of one procedure) in plan order, in chunks of
    ``size`` (``balanced``: as few, of equal sizes ± 1: 25 runs by 16 are 12 + 13, not 16 + 9, whose 16 was a straggler;
    studies planned since record it); ``unresolved``: the runs planned unconfigured, so a resumed study groups alike."""
    out: dict[str, tuple[str, ...]] = {}
    keyed: dict[tuple[Any, ...], list[str]] = {}
    for rid, r in plan.runs.items():
        adaptive = r.config is None if unresolved is None else rid in unresolved
        keyed.setdefault((r.arm, r.stage, r.procedure if adaptive else None), []).append(rid)
    for ids in keyed.values():
        n, m = len(ids), -(-len(ids) // max(1, size))  # runs, chunks
        cuts = [c * n // m for c in range(m + 1)] if balanced else [*range(0, n, max(1, size)), n]
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            if hi - lo > 1:
                for rid in (chunk := tuple(ids[lo:hi])):
                    out[rid] = chunk
    return out
