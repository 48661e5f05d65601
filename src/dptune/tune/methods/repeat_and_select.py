"""Repeat-and-select (Papernot & Steinke 2022): a secret random number K of runs from a truncated negative
binomial family, only the best released; ``RepeatAndSelectDpEvent``, which only RDP accounts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError, config_error
from dptune.release.ledger import LedgerEntry, event_from_dict, event_to_dict
from dptune.tune import space as S
from dptune.tune import theory
from dptune.tune.builder import Builder, guarantee_scope, make_arm_id, procedures, seed_note
from dptune.tune.methods.base import TuningMethod, released_procedures, secret_draws
from dptune.tune.records import ArmPlan, StudyPlan, calibrate_nu, canonical, group_events
from dptune.tune.shapes import make_shape, snap, validate_shape
from dptune.tune.space import TRAINING_KEYS

if TYPE_CHECKING:  # types only: the study spec validates through the methods
    from dptune.tune.spec import StrategyArm, Study

# distribution → the shape η of dp_accounting's truncated negative binomial (None: given by the user)
RS_DISTRIBUTIONS = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0, "negative-binomial": None}


@dataclass(frozen=True)
class RepeatAndSelectOptions:
    mean: float | None = None  # mean number of runs; None: the number of grid candidates
    distribution: str = "poisson"
    shape: float | None = None  # η, for distribution = "negative-binomial" only

    def __post_init__(self) -> None:
        dist = self.distribution
        if dist not in RS_DISTRIBUTIONS:
            raise config_error(
                "method.distribution", f"unknown distribution {dist!r}", f"choose one of {', '.join(RS_DISTRIBUTIONS)}"
            )
        m = self.mean
        if m is not None and not (isinstance(m, int | float) and not isinstance(m, bool) and 1 <= m <= 1e4):
            raise config_error(
                "method.mean", f"the mean number of runs must lie in [1, 10⁴], got {self.mean!r}", "e.g. mean = 10"
            )
        if dist == "negative-binomial":
            s = self.shape
            if not (isinstance(s, int | float) and 0 < s < math.inf):
                raise config_error(
                    "method.shape",
                    f"the negative binomial's shape η must be in (0, ∞), got {s!r}",
                    "e.g. shape = 0.5 (or use distribution = 'poisson' / 'geometric' / 'logarithmic')",
                )
        elif self.shape is not None:
            raise config_error(
                "method.shape", f"shape is only for distribution = 'negative-binomial', not {dist!r}", "drop shape"
            )


class RepeatAndSelect(TuningMethod):
    name = "repeat-and-select"
    aliases = ("repeat_and_select", "papernot-steinke")
    Options = RepeatAndSelectOptions
    hides_run_count = True

    def check_arm(self, study: Study, arm: StrategyArm, path: str, private: bool) -> None:
        super().check_arm(study, arm, path, private)
        if study.method_for(arm).options.get("mean") is None and not S.is_finite(arm.space):
            raise config_error(
                "method.mean", "the mean number of runs is needed with continuous spaces", "set mean = 10"
            )

    def plan(self, b: Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
        study, ctx = b.ctx.study, b.ctx
        opts = study.method_for(arm).options
        arm_id = make_arm_id(arm.key, eps)
        dist = opts["distribution"]
        shape_param = float(opts["shape"]) if dist == "negative-binomial" else RS_DISTRIBUTIONS[dist]
        mean = float(opts["mean"]) if opts["mean"] is not None else float(S.size(arm.space))
        if not 1 <= mean <= 1e4:  # the default (the grid's size) as the option's bound (found in review: 10⁵ runs)
            raise ConfigError(
                f"method.mean = {mean:g} must lie in [1, 1e4] (the grid's size by default). Fix: mean = 10."
            )
        if any(k in TRAINING_KEYS for k in arm.space):
            raise ConfigError(
                f"{path}.space: repeat-and-select needs one privacy bound for every candidate; searching "
                f"{[k for k in arm.space if k in TRAINING_KEYS]} changes it. Fix: fix the run length/batch."
            )
        P, P_acc, unit = procedures(study, composite=True)
        delta = study.budget.delta
        first = S.draw(arm.space, S.rng_for(study.seed, "probe"))
        shape0 = make_shape(ctx, arm, first, f"{path}.space")
        one_bound(ctx, arm, first, shape0, f"{path}.space")
        if study.budget.accountant not in ("auto", "rdp"):  # dp_accounting: RepeatAndSelectDpEvent by RDP only
            raise ConfigError(
                f"budget.accountant: repeat-and-select is accounted by RDP only (got {study.budget.accountant!r}). "
                "Fix: accountant = 'rdp' or 'auto'."
            )
        acc = "rdp"

        def event(v: float) -> dp_event.DpEvent:
            rs = theory.repeat_and_select_event(group_events([shape0.event(v)] * unit), mean, shape_param)
            return rs if P_acc == 1 else dp_event.SelfComposedDpEvent(rs, P_acc)

        nu = calibrate_nu(event, eps, delta, acc, arm_id)
        for c in S.small_grid(arm.space):  # every candidate checked before the draw:
            validate_shape(s := make_shape(ctx, arm, c, f"{path}.space"), snap(nu, [s]), f"{path} ({arm_id})")  # review
        ks, drawn = secret_draws(b, arm, P, lambda coins: theory.sample_repetitions(mean, shape_param, coins))
        total = accounting.epsilon(event(nu), delta, acc)
        run_ids = []
        for p, j, c in drawn:
            # Each run's ν snapped for its own configuration (≥ ν, the accounted): one ν snapped over every drawn
            # candidate showed, in the winner's card, which losers were drawn, so K ≥ 2 (found in review).
            s = make_shape(ctx, arm, c, f"{path}.space")
            validate_shape(s, nu_j := snap(nu, [s]), f"{path} ({arm_id})")
            run_ids += b.add_candidate(arm, arm_id, "main", j, p, c, s, nu_j)
        guarantee = {
            "kind": self.name,
            "epsilon": total,
            "delta": delta,
            "per": guarantee_scope(study, composite=True),
            "accountant": acc,
            "mean": mean,
            "shape": shape_param,
            "distribution": dist,
            "procedures_accounted": P_acc,
            "unit_event": event_to_dict(group_events([shape0.event(nu)] * unit)),
            "event": "RepeatAndSelectDpEvent(run, mean, shape) (Papernot & Steinke 2022), RDP",
        }
        notes = seed_note(study, composite=True) + [
            f"repeat-and-select: K ~ {dist} with mean {mean:g}; runs drawn per procedure: {ks}. Only the best run "
            "may be released: the study directory is internal and must not be published.",
        ]
        if dist == "poisson":
            notes.append("Poisson K may be 0: that procedure then returns no candidate.")
        extra = {"runs_per_procedure": ks, "noise_multipliers": [nu], "public_geometry": shape0.geometry(nu)}
        return self.arm_plan(b, arm, eps, accountant=acc, guarantee=guarantee, runs=run_ids, notes=notes, extra=extra)

    def spent(self, arm: ArmPlan, plan: StudyPlan, entries: list[LedgerEntry]) -> tuple[float, float]:
        """The repeat-and-select event of each procedure with a released run (per study: all)."""
        g = arm.guarantee
        k = released_procedures(arm, plan, entries)
        rs = theory.repeat_and_select_event(canonical(event_from_dict(g["unit_event"])), g["mean"], g["shape"])
        ev = rs if k == 1 else dp_event.SelfComposedDpEvent(rs, k)
        return accounting.epsilon_cached(ev, arm.delta, "rdp"), arm.delta


def one_bound(ctx: Any, arm: StrategyArm, first: dict[str, Any], shape0: Any, path: str) -> None:
    """Refuse a space whose listed values change a run's privacy event: the bound is calibrated on one
    candidate's (``shape0``) and must hold for every one (Papernot & Steinke). E.g. ``final_step`` or
    ``average`` make the run final-evaluated, one more private score release (found in review)."""

    def key(s: Any) -> tuple[Any, ...]:
        return s.sampling_rate, s.steps, s.n_evals, s.eval_nu, s.strategy.planned_event(1.0, s.sampling_rate, s.steps)

    listed = {k: v for k, v in arm.space.items() if not isinstance(v, Mapping)}
    for combo in S.grid(listed):
        if key(make_shape(ctx, arm, {**first, **combo}, path)) != key(shape0):
            raise ConfigError(
                f"{path}: repeat-and-select needs one privacy bound for every candidate, and {combo} gives its "
                "runs another event (e.g. final_step/average: one more private evaluation). Fix: fix those keys."
            )
