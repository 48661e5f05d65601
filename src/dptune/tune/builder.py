"""The run builder: each planned run's id, seed and own noise streams (runs sharing noise would not
compose as independent mechanisms), and how seeds map onto tuning procedures: seed repetitions are not
accounted by default (per-replicate guarantee, as in the papers); ``account_seeds = true`` composes them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dptune.release.sampling import stream_seed
from dptune.tune import theory
from dptune.tune.records import RunSpec
from dptune.tune.shapes import Context, Shape

if TYPE_CHECKING:  # types only: the study spec validates methods, which plan with this module
    from dptune.tune.spec import StrategyArm, Study


class Builder:
    """Collects a study's runs as the methods plan them: run ids, seeds and noise streams."""

    def __init__(self, ctx: Context, coins: theory.SecretCoins | None = None):
        self.ctx = ctx
        self.coins = coins if coins is not None else theory.SecretCoins()  # LT / RS draws: secret
        self.runs: dict[str, RunSpec] = {}
        self.run_seeds: dict[int, str] = {}  # run_seed → run_id: every run needs its own streams

    def add(
        self,
        arm_id: str,
        stage: str,
        index: int,
        procedure: int,
        replicate: int,
        config: dict[str, Any] | None,
        shape: Shape,
        nu: float,
    ) -> RunSpec:
        seed = self.ctx.study.seeds[replicate]
        run_id = f"{arm_id}/{stage}/p{procedure}/c{index:03d}/s{seed}"
        # RunSpec's fields in order; run_seed: 63 bits (SQLite's INTEGER is signed 64-bit), all reach the streams.
        ids = (run_id, arm_id, stage, index, procedure, replicate, seed, stream_seed(seed, run_id), config)
        evals = (shape.eval_steps, shape.eval_final, shape.eval_nu)
        spec = RunSpec(*ids, shape.steps, shape.sampling_rate, nu, *evals, shape.event(nu))
        if run_id in self.runs:  # pragma: no cover - ids are unique by construction
            raise RuntimeError(f"duplicate run id {run_id}")
        if spec.run_seed in self.run_seeds:  # ~N²/2⁶⁴: never seen, but shared noise would void ε
            raise RuntimeError(
                f"runs {self.run_seeds[spec.run_seed]} and {run_id} got the same run_seed "
                f"{spec.run_seed}; they would share their sampling and noise streams."
            )
        self.run_seeds[spec.run_seed] = run_id
        self.runs[run_id] = spec
        return spec

    def add_candidate(
        self,
        arm: StrategyArm,
        arm_id: str,
        stage: str,
        index: int,
        procedure: int,
        config: Mapping[str, Any] | None,
        shape: Shape,
        nu: float,
        replicates: Iterable[int] | None = None,
    ) -> list[str]:
        """Add a candidate's runs, one per seed of ``replicates``, with the arm's fixed values; their ids."""
        if replicates is None:  # the procedure's seeds (mean mode: all of them)
            mean = self.ctx.study.selection.across_seeds == "mean"
            replicates = range(len(self.ctx.study.seeds)) if mean else [procedure]
        full = None if config is None else {**dict(arm.fixed), **config}
        return [self.add(arm_id, stage, index, procedure, r, full, shape, nu).run_id for r in replicates]


def make_arm_id(label: str, eps: float) -> str:
    return f"{label}@eps={eps:g}" if math.isfinite(eps) else f"{label}@nodp"


def procedures(study: Study, composite: bool = False) -> tuple[int, int, int]:
    """(procedures P, accounted procedures P_acc, accounted runs per candidate). ``composite`` (LT,
    repeat-and-select): with ``across_seeds = "mean"`` a candidate IS its S seed runs, accounted as their
    composite whatever ``account_seeds`` says (one run would understate ε: 2 → 3.3 for S = 3)."""
    S_ = len(study.seeds)
    if study.selection.across_seeds == "mean":
        return 1, 1, (S_ if study.budget.account_seeds or composite else 1)
    return S_, (S_ if study.budget.account_seeds else 1), 1


def guarantee_scope(study: Study, composite: bool = False) -> str:
    """The guarantee's ``per``: ``"study"`` when every seed's runs are accounted (or there is one
    seed), else ``"seed replicate"`` (``procedures``: P_acc procedures of ``unit`` seed runs each)."""
    _, p_acc, unit = procedures(study, composite)
    return "study" if len(study.seeds) == 1 or p_acc * unit == len(study.seeds) else "seed replicate"


def seed_note(study: Study, composite: bool = False) -> list[str]:
    if len(study.seeds) == 1:
        return []
    if composite and study.selection.across_seeds == "mean":
        return [
            f"across_seeds = 'mean': a candidate is the composite of its {len(study.seeds)} seed runs (the "
            "selection reads their mean), calibrated as one mechanism; the guarantee is per study "
            "(account_seeds has no effect here)."
        ]
    if study.budget.account_seeds:
        return [f"all {len(study.seeds)} seed repetitions are accounted (account_seeds = true)."]
    if study.selection.across_seeds == "mean":
        return [
            f"seed repetitions are NOT accounted (the papers' convention) although the selection averages "
            f"{len(study.seeds)} seeds: the guarantee covers one seed's runs only."
        ]
    return [
        f"seed repetitions are NOT accounted (the papers' convention): each of the {len(study.seeds)} seed "
        "replicates is its own tuning procedure with this guarantee."
    ]
