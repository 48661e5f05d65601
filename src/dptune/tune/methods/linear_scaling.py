"""Linear scaling (Panda et al. 2024, Algorithms 1–3): sweeps of r = η·T, a fit of the best r against ε
(or μ), one final run; the guarantee composes all of them. One procedure per seed."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError, config_error
from dptune.metrics import better
from dptune.tune import space as S
from dptune.tune.builder import Builder, guarantee_scope, make_arm_id, procedures, seed_note
from dptune.tune.methods.base import Row, TuningMethod
from dptune.tune.records import ArmPlan, StudyPlan, calibrate_nu, choose_accountant, group_events
from dptune.tune.shapes import Shape, check_selection_budget, make_shape, snap, validate_shape

if TYPE_CHECKING:  # types only: the study spec validates through the methods
    from dptune.tune.spec import StrategyArm, Study


@dataclass(frozen=True)
class LinearScalingOptions:
    # per-run ε of each sweep, or {fraction = [f₁, f₂]}: each sweep at f_i × the target ε (Panda's ε = 1
    # split, 0.1 and 0.2, at every target: the sweeps scale with the budget they serve)
    sweep_epsilons: Any = field(default_factory=lambda: [0.1, 0.2])
    runs_per_sweep: int = 3
    fit: str = "linear"  # linear | quadratic
    fit_axis: str = "epsilon"  # epsilon | mu
    r_sampling: str = "uniform"  # uniform | log_uniform
    final_steps: Any = "max"  # "max" (T_max of the space) or an integer

    def __post_init__(self) -> None:
        se = self.sweep_epsilons
        fraction = isinstance(se, Mapping)
        if fraction:
            if set(se) != {"fraction"}:
                raise config_error(
                    "method.sweep_epsilons",
                    f"a table must be {{fraction = [...]}}, got keys {sorted(se)}",
                    "e.g. sweep_epsilons = { fraction = [0.1, 0.2] }",
                )
            se = se["fraction"]
        bad = not isinstance(se, Sequence) or isinstance(se, str) or len(se) < 2
        if bad or any(isinstance(e, bool) or not isinstance(e, int | float) or e <= 0 for e in se):
            raise config_error(
                "method.sweep_epsilons",
                f"need ≥ 2 per-run ε values > 0 (or a table {{fraction = [...]}}), got {self.sweep_epsilons!r}",
                "e.g. sweep_epsilons = [0.1, 0.2] (Panda et al.) or { fraction = [0.1, 0.2] }",
            )
        if fraction and any(e >= 1 for e in se):
            raise config_error(
                "method.sweep_epsilons",
                f"fractions of the target ε must be < 1, got {list(se)!r}",
                "e.g. sweep_epsilons = { fraction = [0.1, 0.2] }",
            )
        if len(set(se)) != len(se):
            raise config_error("method.sweep_epsilons", "values repeat", "use distinct ε values")
        if not isinstance(self.runs_per_sweep, int) or self.runs_per_sweep < 1:
            raise config_error(
                "method.runs_per_sweep", f"must be an integer ≥ 1, got {self.runs_per_sweep!r}", "e.g. 3"
            )
        if self.fit not in ("linear", "quadratic"):
            raise config_error("method.fit", f"unknown fit {self.fit!r}", "choose linear or quadratic")
        if self.fit == "quadratic" and len(se) < 3:
            raise config_error("method.fit", "a quadratic fit needs ≥ 3 sweeps", "give three sweep_epsilons")
        if self.fit_axis not in ("epsilon", "mu"):
            raise config_error("method.fit_axis", f"unknown axis {self.fit_axis!r}", "choose epsilon or mu")
        if self.r_sampling not in ("uniform", "log_uniform"):
            raise config_error(
                "method.r_sampling", f"unknown sampling {self.r_sampling!r}", "choose uniform or log_uniform"
            )
        fs = self.final_steps
        if fs != "max" and not (isinstance(fs, int) and fs >= 1):
            raise config_error(
                "method.final_steps", f"must be 'max' or an integer ≥ 1, got {fs!r}", "e.g. final_steps = 'max'"
            )


class LinearScaling(TuningMethod):
    name = "linear-scaling"
    aliases = ("linear_scaling", "panda")
    Options = LinearScalingOptions
    adaptive = True

    def check_arm(self, study: Study, arm: StrategyArm, path: str, private: bool) -> None:
        # The space is exactly (lr, steps): the generic "space is empty" check is this one.
        if not private:
            return
        if set(arm.space) != {"lr", "steps"}:
            raise config_error(
                f"{path}.space",
                f"linear-scaling searches r = η·T: it needs exactly lr and steps, got {sorted(arm.space)}",
                "use space = { lr = { log_uniform = [1e-3, 1.0] }, steps = { int_uniform = [10, 200] } }",
            )
        if study.selection.across_seeds != "per-seed":
            raise config_error(
                "selection.across_seeds",
                "linear-scaling runs one adaptive procedure per seed",
                "set across_seeds = 'per-seed'",
            )

    def plan(self, b: Builder, arm: StrategyArm, eps: float, path: str) -> ArmPlan:
        study, ctx = b.ctx.study, b.ctx
        o = study.method_for(arm).options
        arm_id = make_arm_id(arm.key, eps)
        delta = study.budget.delta
        P, P_acc, _ = procedures(study)
        se = o["sweep_epsilons"]
        # {fraction = [...]}: each sweep at that share of this arm's target ε (LinearScalingOptions)
        fractions = se["fraction"] if isinstance(se, Mapping) else None
        sweep_eps = [float(f"{float(f) * eps:.12g}") for f in fractions] if fractions else [float(e) for e in se]
        n = int(o["runs_per_sweep"])
        lr_lo, lr_hi = S.bounds(arm.space["lr"])
        t_lo, t_hi = S.bounds(arm.space["steps"])
        r_lo, r_hi = lr_lo * t_lo, lr_hi * t_hi
        if r_lo <= 0:
            raise ConfigError(f"{path}.space: linear-scaling needs lr > 0 and steps ≥ 1.")
        t_final = int(t_hi) if o["final_steps"] == "max" else int(o["final_steps"])
        probe = make_shape(ctx, arm, {"lr": lr_lo, "steps": int(t_lo)}, f"{path}.space")
        acc = choose_accountant(study.budget.accountant, probe.event(1.0), delta=study.budget.delta)
        per_run: dict[tuple[Shape, float], float] = {}

        def sweep_run(rng: np.random.Generator, e: float) -> tuple[dict[str, Any], Shape, float]:
            """One sweep run at per-run ε = e: its drawn configuration, shape and calibrated ν."""
            c = _decompose(rng, arm.space, r_lo, r_hi, lr_lo, lr_hi, o["r_sampling"])
            s = make_shape(ctx, arm, c, f"{path}.space")
            if (s, e) not in per_run:  # its private scores alone must fit first (found in review: a misleading error)
                check_selection_budget([s], e, delta, acc, f"{arm_id} (sweep run at ε = {e:g})")
                nu = calibrate_nu(s.event, e, delta, acc, f"{arm_id} (sweep run at ε = {e:g})")
                per_run[(s, e)] = snap(nu, [s])
            return c, s, per_run[(s, e)]

        rngs = (S.rng_for(study.seed, f"linear-scaling/{arm_id}/{p}") for p in range(P))
        sweeps: list[_Sweeps] = [[[sweep_run(rng, e) for _ in range(n)] for e in sweep_eps] for rng in rngs]
        final_shape = make_shape(ctx, arm, {"lr": lr_lo, "steps": t_final}, f"{path}.space")
        groups = [list(range(P))] if P_acc == P else [[p] for p in range(P)]
        final_nu = _final_multipliers(sweeps, final_shape, groups, eps, delta, acc, arm_id)
        run_ids = []
        for p in range(P):
            for i, runs in enumerate(sweeps[p]):
                for j, (c, s, nu) in enumerate(runs):
                    validate_shape(s, nu, f"{path} ({arm_id})")
                    run_ids += b.add_candidate(arm, arm_id, f"sweep{i}", j, p, c, s, nu)
            validate_shape(final_shape, final_nu[p], f"{path} ({arm_id})")
            run_ids += b.add_candidate(arm, arm_id, "final", 0, p, None, final_shape, final_nu[p])  # resolve()
        eps_final = {str(p): accounting.epsilon(final_shape.event(final_nu[p]), delta, acc) for p in range(P)}
        total = max(
            accounting.epsilon(_total_event(sweeps, final_shape, g, final_nu[g[0]]), delta, acc) for g in groups
        )
        guarantee = {
            "kind": "composition",
            "epsilon": total,
            "delta": delta,
            "accountant": acc,
            "per": guarantee_scope(study),
            "formula": "μ = √(n·μ₁² + n·μ₂² + μ_f²) (Panda et al. App. A.7)" if acc == "gdp" else "composition",
        }
        extra = {
            "sweep_epsilons": sweep_eps,
            "runs_per_sweep": n,
            "fit": o["fit"],
            "fit_axis": o["fit_axis"],
            "r_bounds": [r_lo, r_hi],
            "lr_bounds": [lr_lo, lr_hi],
            "steps_bounds": [t_lo, t_hi],
            "final_steps": t_final,
            "final_epsilon": eps_final,
            "final_noise_multiplier": {str(p): v for p, v in final_nu.items()},
        }
        if acc == "gdp":
            extra["gdp"] = {
                "sweep_mu": [accounting.gdp_mu_for_epsilon(e, delta) for e in sweep_eps],
                "final_mu": {str(p): accounting.gdp_mu_of_event(final_shape.event(final_nu[p])) for p in range(P)},
            }
        notes = seed_note(study) + [
            f"linear scaling: {n} runs at each ε ∈ {sweep_eps}, then one final run at ε_f ≈ "
            f"{min(eps_final.values()):.4g} with T_f = {t_final}; η_f = r*/T_f with r* from a {o['fit']} fit of r = η·T "
            f"against {o['fit_axis']}.",
        ]
        return self.arm_plan(b, arm, eps, accountant=acc, guarantee=guarantee, runs=run_ids, notes=notes, extra=extra)

    def select(self, arm: ArmPlan, plan: StudyPlan, runs: list[Row], across: str) -> tuple[list[Row], list[Any]]:
        """Each procedure's result is its final run (with the fit that configured it)."""
        picks = [r for r in runs if r["stage"] == "final" and r["status"] in ("done", "diverged")]
        return picks, [r["fit"] for r in picks]

    def resolve(
        self, plan: StudyPlan, arm: ArmPlan, rows: Mapping[str, Any], scores: Mapping[str, float | None]
    ) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
        """The final run of each procedure whose sweeps have all finished (``resolve_final_config``)."""
        out = {}
        for rid in arm.runs:
            run = plan.runs[rid]
            if run.stage != "final" or rows[rid]["config"] is not None:
                continue
            mine = [plan.runs[s] for s in arm.runs if plan.runs[s].procedure == run.procedure]
            if all(rows[s.run_id]["status"] in ("done", "diverged") for s in mine if s.stage.startswith("sweep")):
                out[rid] = resolve_final_config(plan, arm, run.procedure, scores)
        return out


_Sweeps = list[list[tuple[dict[str, Any], Shape, float]]]  # one procedure's [sweep][run]: (config, shape, ν)


def _total_event(sweeps: list[_Sweeps], final: Shape, group: list[int], nu_final: float) -> dp_event.DpEvent:
    """The accounted event of the procedures in ``group``: their sweep runs and final runs."""
    evs = [s.event(nu) for p in group for runs in sweeps[p] for (_, s, nu) in runs]
    return group_events(evs + [final.event(nu_final)] * len(group))


def _final_multipliers(
    sweeps: list[_Sweeps], final: Shape, groups: list[list[int]], eps: float, delta: float, acc: str, arm_id: str
) -> dict[int, float]:
    """Procedure → the final run's ν: calibrated so that each accounted group meets ε."""
    first = groups[0]
    shapes = [s for p in first for runs in sweeps[p] for (_, s, _) in runs] + [final] * len(first)
    check_selection_budget(shapes, eps, delta, acc, arm_id)
    final_nu: dict[int, float] = {}
    for g in groups:
        sweeps_only = group_events(s.event(nu) for p in g for runs in sweeps[p] for (_, s, nu) in runs)
        if accounting.epsilon(sweeps_only, delta, acc) >= eps:
            raise ConfigError(
                f"{arm_id}: the sweeps alone spend ε ≥ {eps:g}. Fix: lower method.sweep_epsilons "
                "or method.runs_per_sweep, or raise budget.epsilon."
            )
        nu = calibrate_nu(partial(_total_event, sweeps, final, g), eps, delta, acc, f"{arm_id} (final run)")
        v = snap(nu, [final])
        for p in g:
            final_nu[p] = v
    return final_nu


def _decompose(
    rng: np.random.Generator,
    space: Mapping[str, Any],
    r_lo: float,
    r_hi: float,
    lr_lo: float,
    lr_hi: float,
    sampling: str,
) -> dict[str, Any]:
    """Draw r in [r_min, r_max] and split it into (η, T) with η·T = r, η in range and T on the steps axis
    (Panda Alg. 1; §A.3, method 2). T by rejection first (so existing plans keep their configurations), then
    directly from the feasible T; η clamped only when no T on the axis fits."""
    r = rng.uniform(r_lo, r_hi) if sampling == "uniform" else math.exp(rng.uniform(math.log(r_lo), math.log(r_hi)))
    for _ in range(100):
        T = int(S.draw_value(space["steps"], rng))
        lr = r / T
        if lr_lo <= lr <= lr_hi:
            return {"lr": float(lr), "steps": T}
    return split_r(r, space["steps"], lr_lo, lr_hi, rng)


def split_r(r: float, steps_axis: Any, lr_lo: float, lr_hi: float, rng: np.random.Generator) -> dict[str, Any]:
    """(η, T) with η·T = r, η ∈ [η_min, η_max], T drawn from the steps axis restricted to the
    T that allow it (uniformly in T, or log-uniformly for ``int_log_uniform``); if none does,
    the axis's T nearest to the feasible interval and η clamped to its range."""
    t_min, t_max = r / lr_hi, r / lr_lo  # the real interval of T with η = r/T in range
    if isinstance(steps_axis, Mapping):
        dist = next(iter(steps_axis))
        lo, hi = S.bounds(steps_axis)
        a, b = max(math.ceil(lo), math.ceil(t_min * (1 - 1e-12))), min(math.floor(hi), math.floor(t_max * (1 + 1e-12)))
        if a <= b:
            if dist == "int_log_uniform":
                T = int(min(max(round(math.exp(rng.uniform(math.log(a), math.log(b)))), a), b))
            else:
                T = int(rng.integers(a, b + 1))
            return {"lr": float(min(max(r / T, lr_lo), lr_hi)), "steps": T}
        support = sorted(
            {
                math.ceil(lo),
                math.floor(hi),
                min(max(a, math.ceil(lo)), math.floor(hi)),
                max(min(b, math.floor(hi)), math.ceil(lo)),
            }
        )
    else:
        support = sorted({int(v) for v in steps_axis})
        ok = [T for T in support if t_min * (1 - 1e-12) <= T <= t_max * (1 + 1e-12)]
        if ok:
            T = ok[int(rng.integers(len(ok)))]
            return {"lr": float(min(max(r / T, lr_lo), lr_hi)), "steps": T}
    # No T on the axis reaches r: the one whose clamped η gives the nearest product (in log r).
    T = min(support, key=lambda t: abs(math.log(min(max(r / t, lr_lo), lr_hi) * t / r)))
    return {"lr": float(min(max(r / T, lr_lo), lr_hi)), "steps": int(T)}


def resolve_final_config(
    plan: StudyPlan, arm: ArmPlan, procedure: int, scores: Mapping[str, float | None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Panda Alg. 2: best r per sweep → fit r(x) → r* at the final x → (η_f, T_f); returns (config,
    fit record), deterministic in the stored ``scores`` (run_id → score) so a resumed study agrees."""
    ex = arm.extra
    xs, rs = [], []

    def x_of(e: float) -> float:
        return e if ex["fit_axis"] == "epsilon" else accounting.gdp_mu_for_epsilon(e, arm.delta)

    for i, e in enumerate(ex["sweep_epsilons"]):
        best = None  # the first best finite score of sweep i
        for run in (plan.runs[rid] for rid in arm.runs):
            s = scores.get(run.run_id)
            if run.stage != f"sweep{i}" or run.procedure != procedure or s is None or not math.isfinite(s):
                continue
            if best is None or better(s, best[0], plan.higher_is_better):
                best = (s, run.config["lr"] * run.config["steps"])
        if best is not None:
            xs.append(x_of(e))
            rs.append(best[1])
    x_f = x_of(float(ex["final_epsilon"][str(procedure)]))
    r_lo, r_hi = ex["r_bounds"]
    deg = 2 if ex["fit"] == "quadratic" else 1
    if len(xs) >= deg + 1:
        coef = np.polyfit(np.asarray(xs), np.asarray(rs), deg)
        r_star = float(np.polyval(coef, x_f))
        how = "fit"
    elif rs:
        coef, r_star, how = None, float(rs[-1]), "best sweep point (too few finite sweeps to fit)"
    else:
        coef, r_star, how = None, float(r_lo), "r_min (every sweep run diverged)"
    r_star = float(min(max(r_star, r_lo), r_hi))
    t_f = int(ex["final_steps"])
    lr_lo, lr_hi = ex["lr_bounds"]
    lr = float(min(max(r_star / t_f, lr_lo), lr_hi))
    final = next(
        plan.runs[r] for r in arm.runs if plan.runs[r].stage == "final" and plan.runs[r].procedure == procedure
    )
    fixed = {k: v for k, v in (plan.runs[arm.runs[0]].config or {}).items() if k not in ("lr", "steps")}
    fit = {
        "points": [[x, r] for x, r in zip(xs, rs, strict=True)],
        "coef": [float(c) for c in coef] if coef is not None else None,
        "x_final": x_f,
        "r_star": r_star,
        # What the final run trains with: T_f was fixed at planning time (its ν is calibrated for
        # it), so an r* below η_min·T_f (or above η_max·T_f) is run at the nearest reachable r.
        "r_final": lr * t_f,
        "how": how,
        "axis": ex["fit_axis"],
    }
    return {**fixed, "lr": lr, "steps": final.steps}, fit
