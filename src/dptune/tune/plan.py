"""``plan_study``: every run of a study, planned before any training by the arms' tuning methods.

Each private strategy arm is planned at each ε of the budget by its method (``tune.methods``); a
non-private arm (e.g. ``nodp``) is planned once, as the baseline.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

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
    """Plan every run of ``study``: a pure function of the study and the data sizes, except
    Liu–Talwar's and repeat-and-select's secret draws (K and the candidates' configurations),
    which come from ``coins`` (default: the OS CSPRNG; ``theory.SecretCoins(seed)`` for a
    reproducible search with a secret seed). The store keeps the plan, so resume reuses them."""
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
    return StudyPlan(arms, b.runs, release, n_train, n_val, metric, higher_is_better(metric))


def _plan_nonprivate(b: Builder, arm: StrategyArm, path: str) -> ArmPlan:
    """The non-private baseline: the configurations of the arm's method (the grid, or its random
    draws: ``TuningMethod.configurations``), every run at ν = ∞, once."""
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
    # Stored plans name the baseline's method "grid", whatever the arm's method, with no options.
    return get_method("grid").arm_plan(
        b,
        arm,
        math.inf,
        accountant="none",
        guarantee=guarantee,
        runs=run_ids,
        notes=["non-private baseline: every step is a NonPrivateDpEvent (ε = ∞)."],
        options={},
    )
