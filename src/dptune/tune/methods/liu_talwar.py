"""Liu–Talwar random stopping (Liu & Talwar 2019, Thm 3.4; Mohapatra et al.'s "LT"): candidates until a
γ-coin stops (≤ T_max), each run (ε₁, δ₁)-DP, releasing only the best. K and the candidates are secret
draws; the runs' accountant is RDP under "auto" (PLD's tails are unreliable at δ₁ ~ 1e-15)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError, config_error
from dptune.outputs import up
from dptune.release.ledger import LedgerEntry
from dptune.tune import space as S
from dptune.tune import theory
from dptune.tune.builder import Builder, guarantee_scope, make_arm_id, procedures, seed_note
from dptune.tune.methods.base import TuningMethod, released_procedures, secret_draws
from dptune.tune.records import ArmPlan, StudyPlan, calibrate_nu, choose_accountant, group_events
from dptune.tune.shapes import Shape, make_shape, snap, validate_shape

if TYPE_CHECKING:  # types only: the study spec validates through the methods
    from dptune.tune.spec import StrategyArm, Study


@dataclass(frozen=True)
class LiuTalwarOptions:
    gamma: float | None = None  # stopping probability; None: 1/(number of grid candidates)
    delta2_fraction: float = 0.5  # share of δ given to δ₂ (the T_max truncation)

    def __post_init__(self) -> None:
        g = self.gamma
        if g is not None and not (isinstance(g, int | float) and not isinstance(g, bool) and 1e-4 <= g <= 1):
            raise config_error(
                "method.gamma",
                f"stopping probability γ must lie in [1e-4, 1] (1/γ runs on average; found in review: γ = 1e-9 drew "
                f"runs for hours), got {g!r}",
                "e.g. gamma = 0.1, or omit it for γ = 1/(number of grid candidates) as Mohapatra et al.",
            )
        f = self.delta2_fraction
        if not (isinstance(f, int | float) and 0 < f < 1):
            raise config_error("method.delta2_fraction", f"must lie in (0, 1), got {f!r}", "e.g. delta2_fraction = 0.5")


def check_lt_selection_budget(shape: Shape, unit: int, lt: theory.LTParams, acc: str, what: str) -> None:
    """Private selection under LT: a candidate's noisy scores share its (ε₁, δ₁); if they alone
    spend ε₁, say so, with a score noise that leaves half of ε₁ to training."""
    if shape.eval_nu is None or shape.n_evals == 0:
        return

    def scores(sigma: float) -> dp_event.DpEvent:
        return group_events([dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), shape.n_evals)] * unit)

    acc = "rdp" if acc == "gdp" else acc
    e = accounting.epsilon(scores(shape.eval_nu), lt.delta1, acc)
    if e < lt.eps1:
        return
    need = accounting.calibrate(lt.eps1 / 2, lt.delta1, accountant=acc, make_event=scores).noise_multiplier
    raise ConfigError(
        f"{what}: Liu–Talwar gives each candidate run ε₁ = {lt.eps1:.4g} at δ₁ = {lt.delta1:.3g} (ε/3 − √(2δ₁), "
        f"Liu & Talwar 2019, Thm 3.4), and a run's {shape.n_evals} private validation scores "
        f"(selection.mode = 'private', σ = {shape.eval_nu:g}) alone spend ε = {e:.3g} of it. Fix: raise "
        f"selection.noise_multiplier to ≥ {accounting.round_up(need, 3):g} (half of ε₁ for the scores), evaluate "
        "less often (selection.eval_every, or checkpoint = 'final'), raise budget.epsilon, or select on a public "
        "split (selection.mode = 'public', split = 'test')."
    )


class LiuTalwar(TuningMethod):
    name = "liu-talwar"
    aliases = ("lt", "liu_talwar", "liutalwar")
    Options = LiuTalwarOptions
    hides_run_count = True

    def check_arm(self, study: Study, arm: StrategyArm, path: str, private: bool) -> None:
        super().check_arm(study, arm, path, private)
        if study.method_for(arm).options.get("gamma") is None and not S.is_finite(arm.space):
            raise config_error(
                "method.gamma",
                "γ is needed when the space has continuous distributions",
                "set gamma (e.g. 0.1), or make every axis a list (γ = 1/#candidates)",
            )

    def plan(self, b: Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
        study, ctx = b.ctx.study, b.ctx
        opts = study.method_for(arm).options
        arm_id = make_arm_id(arm.key, eps)
        gamma = float(opts["gamma"]) if opts["gamma"] is not None else 1.0 / S.size(arm.space)
        if gamma < 1e-4:  # the default 1/(grid size) as the option's bound (found in review: 10⁵ cells, 40k runs)
            raise config_error("method.gamma", f"γ = 1/{S.size(arm.space)} grid candidates is below 1e-4", "set gamma")
        P, P_acc, unit = procedures(study, composite=True)
        delta = study.budget.delta
        lt = theory.lt_solve(eps / P_acc, delta / P_acc, gamma, float(opts["delta2_fraction"]))
        cache: dict[Shape, float] = {}

        def nu_for(shape: Shape) -> float:
            if shape not in cache:
                acc_ = choose_accountant(study.budget.accountant, shape.event(1.0), auto="rdp")
                check_lt_selection_budget(shape, unit, lt, acc_, arm_id)
                what = f"{arm_id} (Liu–Talwar run at ε₁ = {lt.eps1:.4g}, δ₁ = {lt.delta1:.3g})"
                nu = calibrate_nu(lambda v: group_events([shape.event(v)] * unit), lt.eps1, lt.delta1, acc_, what)
                cache[shape] = snap(nu, [shape])
            return cache[shape]

        for c in S.small_grid(arm.space):
            s = make_shape(ctx, arm, c, f"{path}.space")  # every candidate checked before the draw, not the drawn:
            validate_shape(s, nu_for(s), f"{path} ({arm_id})")  # a refusal never depends on the coins (review)
        ks, drawn = secret_draws(b, arm, P, lambda coins: theory.lt_stops(gamma, lt.t_max, coins))
        run_ids = []
        for p, j, c in drawn:
            s = make_shape(ctx, arm, c, f"{path}.space")
            nu = nu_for(s)
            validate_shape(s, nu, f"{path} ({arm_id})")
            run_ids += b.add_candidate(arm, arm_id, "main", j, p, c, s, nu)
        total = (lt.total[0] * P_acc, lt.total[1] * P_acc)
        acc = choose_accountant(study.budget.accountant, next(iter(cache)).event(1.0), auto="rdp") if cache else "rdp"
        guarantee = {
            "kind": self.name,
            "epsilon": total[0],
            "delta": total[1],
            "per": guarantee_scope(study, composite=True),
            "accountant": acc,
            "eps1": lt.eps1,
            "delta1": lt.delta1,
            "gamma": gamma,
            "delta2": lt.delta2,
            "t_max": lt.t_max,
            "procedures_accounted": P_acc,
            "formula": "(3ε₁ + 3√(2δ₁), √(2δ₁)·T_max + δ₂) per procedure (Liu & Talwar 2019, Thm 3.4)",
        }
        notes = seed_note(study, composite=True) + [
            f"Liu–Talwar random stopping: γ = {gamma:.4g}, T_max = {lt.t_max}, each run ({up(lt.eps1, 4)}, "
            f"{up(lt.delta1)})-DP; runs drawn per procedure: {ks}. The guarantee covers releasing ONLY the "
            "selected candidate: the study directory (all runs, their number, their scores) is internal and must "
            "not be published.",
        ]
        extra = {"runs_per_procedure": ks, "noise_multipliers": sorted(set(cache.values()))}
        # The report's figures: the [training] geometry (public), not a secret draw's (review); none if it is invalid
        with contextlib.suppress(ConfigError):
            extra["public_geometry"] = (s0 := make_shape(ctx, arm, {}, f"{path}.fixed")).geometry(nu_for(s0))
        return self.arm_plan(b, arm, eps, accountant=acc, guarantee=guarantee, runs=run_ids, notes=notes, extra=extra)

    def spent(self, arm: ArmPlan, plan: StudyPlan, entries: list[LedgerEntry]) -> tuple[float, float]:
        """The theorem's (ε, δ) for each procedure with a released run (per study: all of them)."""
        g = arm.guarantee
        per_procedure = theory.lt_total(g["eps1"], g["delta1"], g["gamma"], g["delta2"])
        k = released_procedures(arm, plan, entries)
        return per_procedure[0] * k, per_procedure[1] * k
