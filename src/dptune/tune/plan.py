"""``plan_study``: every run of a study, planned before any training by the arms' tuning methods (each
private arm at each ε, a non-private arm once as the baseline)."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError
from dptune.metrics import higher_is_better
from dptune.strategies import make_strategy
from dptune.tune import theory
from dptune.tune.builder import Builder, make_arm_id
from dptune.tune.methods import get_method
from dptune.tune.records import ArmPlan, StudyPlan, group_events
from dptune.tune.shapes import Context, make_shape, split_config

if TYPE_CHECKING:
    from dptune.tune.spec import StrategyArm, Study


def plan_study(
    study: Study, n_train: int, n_val: int, metric: str, coins: theory.SecretCoins | None = None
) -> StudyPlan:
    """Plan every run of ``study``: a pure function of the study and data sizes, except LT's and
    repeat-and-select's secret draws from ``coins`` (default the OS CSPRNG), kept by the store for resume."""
    study.budget.check_delta(n_train)  # δ < 1/n: where a study's δ and n first meet
    b = Builder(Context(study, n_train, n_val), coins)
    arms: list[ArmPlan] = []
    for i, arm in enumerate(study.strategies):
        path = f"strategies[{i}]"
        if not make_strategy(arm.name, **split_config(dict(arm.fixed))[0]).private:
            arms.append(_plan_nonprivate(b, arm, path))
            continue
        method = get_method(study.method_for(arm).name)
        for eps in study.budget.epsilon:
            planned = method.plan(b, arm, eps, path)
            kind = planned.guarantee.get("kind")
            if method.hides_run_count and kind != method.name:
                # outputs.hides_run_count keys on the guarantee's kind: any other kind would publish K.
                raise ConfigError(
                    f"tuning method {method.name!r} hides the number of runs, but its plan's guarantee kind is "
                    f"{kind!r}. Fix: set guarantee['kind'] = {method.name!r} in its plan()."
                )
            arms.append(planned)
    release = group_events(r.planned_event for r in b.runs.values())
    plan = StudyPlan(arms, b.runs, release, n_train, n_val, metric, higher_is_better(metric))
    sel = study.selection
    if sel.mode == "private" and (note := selection_noise_note(plan, sel.noise_multiplier)) is not None:
        warnings.warn(note, SelectionNoiseWarning, stacklevel=2)
    return plan


class SelectionNoiseWarning(UserWarning):
    """Private selection whose noise swamps the differences it is meant to find (``selection_noise_note``)."""


# The spread that matters, as a fraction of the metric's range [0, sensitivity]: 0.05 accuracy, or
# 5 % of selection.mse_clip. A released mean score is (Σ clamped scores + N(0, (ν·s)²)) / m, so its
# noise std is ν·s/m: the fraction ν/m of the range, whatever the metric (docs/tuning.md §3).
SELECTION_SPREAD = 0.05


def selection_noise_note(plan: StudyPlan, nu: float) -> str | None:
    """Why private selection (at ν = ``nu``) on this plan would pick at random, and the fixes with their
    ε cost; None when the noise on a released score is at most ``SELECTION_SPREAD`` of the metric's range."""
    private = [(i, a) for i, a in enumerate(plan.arms) if math.isfinite(a.epsilon)]
    if not plan.n_val or not private or nu / plan.n_val <= SELECTION_SPREAD:
        return None
    evals = [  # a procedure's score releases, per private arm (procedure 0: they are all alike); not for an
        # arm that keeps its number of runs secret (Liu-Talwar, repeat-and-select): the count would reveal K
        (sum(len(r.eval_steps) + r.eval_final for r in map(plan.runs.get, a.runs) if r and r.procedure == 0), i)
        for i, a in private
        if not get_method(a.method).hides_run_count
    ]
    nu_ok = SELECTION_SPREAD * plan.n_val
    if not evals:
        return _selection_text(plan, nu, f"a lower selection.noise_multiplier (≤ {nu_ok:.3g})")
    k, i = max(evals)
    arm = plan.arms[i]

    def eps(v: float) -> float:  # the k Gaussian score releases alone (exact: μ-GDP)
        return accounting.epsilon(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(v), k), arm.delta, "gdp")

    e_ok, e_now, scores = eps(nu_ok), eps(nu), f"{k} validation score{'s' if k > 1 else ''}"
    lower = (
        f"a lower selection.noise_multiplier (≤ {nu_ok:.3g}: ε = {e_ok:.3g} of the {arm.epsilon:g} of {arm.arm} "
        f"for its {scores} per procedure, now {e_now:.3g}; the rest goes to training)"
        if e_ok < arm.epsilon
        else f"fewer evaluations (selection.eval_every, checkpoint = 'final'; at ν ≤ {nu_ok:.3g}, ε = {e_ok:.3g} "
        f"≥ the {arm.epsilon:g} of {arm.arm} for its {scores} per procedure)"
    )
    return _selection_text(plan, nu, lower)


def _selection_text(plan: StudyPlan, nu: float, lower: str) -> str:
    acc = f" (±{nu / plan.n_val:.2f} accuracy)" if plan.metric == "accuracy" else ""
    return (
        f"private selection cannot select: selection.noise_multiplier = {nu:g} on m = {plan.n_val} validation "
        f"examples puts noise of std {nu / plan.n_val:.3g} of the metric's range on every released score{acc}, "
        f"more than the {SELECTION_SPREAD:g} that separates configurations: the pick is close to random. Fix: a "
        f"bigger holdout (m ≥ {math.ceil(nu / SELECTION_SPREAD)}: selection.holdout_fraction, or more data), {lower}, "
        "or public validation data (selection.mode = 'public' with split = 'test', if that split really is public)."
    )


def _plan_nonprivate(b: Builder, arm: StrategyArm, path: str) -> ArmPlan:
    """The non-private baseline: the method's configurations, every run at ν = ∞, once."""
    study, ctx = b.ctx.study, b.ctx
    configs = get_method(study.method_for(arm).name).configurations(study, arm)
    arm_id = make_arm_id(arm.key, math.inf)
    run_ids = []
    for r in range(len(study.seeds)):
        procedure = r if study.selection.across_seeds == "per-seed" else 0
        for j, c in enumerate(configs):
            s = make_shape(ctx, arm, c, f"{path}.space")
            run_ids += b.add_candidate(arm, arm_id, "main", j, procedure, c, s, math.inf, replicates=[r])
    guarantee = {"kind": "nonprivate", "epsilon": math.inf, "delta": study.budget.delta, "per": "study"}
    note = "non-private baseline: every step is a NonPrivateDpEvent (ε = ∞)."
    # Stored plans name the baseline's method "grid", whatever the arm's method, with no options.
    return get_method("grid").arm_plan(
        b, arm, math.inf, accountant="none", guarantee=guarantee, runs=run_ids, notes=[note], options={}
    )
