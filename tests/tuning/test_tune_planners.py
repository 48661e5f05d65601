"""Planners: per-run ν and the study's planned event, checked against independent dp_accounting."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from tune_helpers import make_study, planning_data

from dptune import accounting
from dptune.release.ledger import atoms
from dptune.release.sampling import steps_for_epochs
from dptune.tune import (
    SelectionSpec,
    TrainingSpec,
    plan_study,
    theory,
)
from dptune.tune.records import StudyPlan, group_events

N, DELTA = 60000, 1e-5
Q = 512 / N
T = steps_for_epochs(10, Q)
GRID = {"lr": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0], "clip": [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]}


def _study(
    method="grid",
    opts=None,
    space=None,
    strategy="dpsgd",
    eps=3.0,
    accountant="rdp",
    seeds=(0,),
    account_seeds=False,
    training=None,
    selection=None,
    across="per-seed",
):
    sel = selection or SelectionSpec(eval_every=100, across_seeds=across)
    return make_study(
        planning_data(),
        strategy=strategy,
        space=space if space is not None else GRID,
        training=training or TrainingSpec(epochs=10, expected_batch_size=512),
        eps=eps,
        delta=DELTA,
        accountant=accountant,
        account_seeds=account_seeds,
        method=method,
        opts=opts,
        selection=sel,
        seeds=seeds,
    )


def _rdp_eps(nu: float, runs: int) -> float:
    acc = rdp_privacy_accountant.RdpAccountant()
    step = dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(nu))
    acc.compose(dp_event.SelfComposedDpEvent(step, T * runs))
    return acc.get_epsilon(DELTA)


def _bisect(f, target, lo=0.3, hi=30.0):
    """Smallest ν with f(ν) ≤ target, to a relative 1e-6 (independent of dptune's calibrate)."""
    while hi / lo > 1 + 1e-6:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if f(mid) <= target else (mid, hi)
    return hi


def test_49_run_grid_rdp_matches_independent_dp_accounting():
    plan = plan_study(_study(), N, 10000, "accuracy")
    arm = plan.arms[0]
    assert len(arm.runs) == 49 and T == 1172
    nus = {plan.runs[r].noise_multiplier for r in arm.runs}
    assert len(nus) == 1  # one ν for every configuration
    nu = nus.pop()
    nu_ref = _bisect(lambda v: _rdp_eps(v, 49), 3.0)
    assert nu_ref <= nu <= nu_ref * (1 + 2e-4)  # calibrated to the target, never below it
    eps = _rdp_eps(nu, 49)
    assert 3.0 * (1 - 2e-3) < eps <= 3.0
    assert arm.guarantee["epsilon"] == pytest.approx(eps, rel=1e-9)
    # The planned release event is exactly 49 runs × T Poisson-sampled Gaussian steps.
    step = dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(nu))
    assert atoms(plan.release_event) == {step: 49 * T}


def test_49_run_grid_default_accountant_is_pld_and_matches():
    plan = plan_study(_study(accountant="auto"), N, 10000, "accuracy")
    arm = plan.arms[0]
    assert arm.accountant == "pld"
    nu = plan.runs[arm.runs[0]].noise_multiplier
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    step = dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(nu))
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.SelfComposedDpEvent(step, T), 49))
    eps = acc.get_epsilon(DELTA)
    assert 3.0 * (1 - 2e-3) < eps <= 3.0 + 1e-9
    assert arm.guarantee["epsilon"] == pytest.approx(eps, rel=1e-6)
    # PLD is tighter than RDP: less noise for the same budget.
    nu_rdp = plan_study(_study(), N, 10000, "accuracy").runs[arm.runs[0]].noise_multiplier
    assert nu < nu_rdp


def test_accounted_seeds_are_composed():
    plain = plan_study(_study(space={"lr": [0.1, 1.0]}, seeds=(0, 1, 2)), N, 10000, "accuracy")
    counted = plan_study(_study(space={"lr": [0.1, 1.0]}, seeds=(0, 1, 2), account_seeds=True), N, 10000, "accuracy")
    nu_plain = plain.runs[plain.arms[0].runs[0]].noise_multiplier
    nu_counted = counted.runs[counted.arms[0].runs[0]].noise_multiplier
    assert nu_plain == pytest.approx(_bisect(lambda v: _rdp_eps(v, 2), 3.0), rel=2e-4)
    assert nu_counted == pytest.approx(_bisect(lambda v: _rdp_eps(v, 6), 3.0), rel=2e-4)
    assert plain.arms[0].guarantee["per"] == "seed replicate" and counted.arms[0].guarantee["per"] == "study"
    # Both plans release the same number of steps (6 runs); only the accounting differs.
    assert sum(atoms(plain.release_event).values()) == sum(atoms(counted.release_event).values()) == 6 * T


def test_plans_are_deterministic_and_noise_streams_distinct():
    s = _study(
        method="random", opts={"n": 5}, space={"lr": {"log_uniform": [1e-3, 1.0]}, "clip": [0.5, 1.0]}, seeds=(0, 1)
    )
    a, b = plan_study(s, N, 10000, "accuracy"), plan_study(s, N, 10000, "accuracy")
    assert a.to_dict() == b.to_dict()
    assert StudyPlan.from_dict(a.to_dict()).to_dict() == a.to_dict()
    seeds = [r.run_seed for r in a.runs.values()]
    assert len(set(seeds)) == len(seeds) == 10
    configs = [r.config["lr"] for r in a.runs.values()]
    assert all(1e-3 <= c <= 1.0 for c in configs)
    # Each seed replicate is its own tuning procedure: its own 5 draws (not one draw shared by both).
    by_proc = {p: {r.config["lr"] for r in a.runs.values() if r.procedure == p} for p in (0, 1)}
    assert len(by_proc[0]) == len(by_proc[1]) == 5 and not by_proc[0] & by_proc[1]


def test_liu_talwar_plan_follows_the_theorem():
    space = {"lr": [0.01, 0.1, 1.0], "clip": [0.5, 1.0]}
    plan = plan_study(_study(method="liu-talwar", space=space, seeds=(0, 1)), N, 10000, "accuracy")
    arm = plan.arms[0]
    g = arm.guarantee
    assert g["gamma"] == pytest.approx(1 / 6)  # γ = 1/#candidates (Mohapatra)
    p = theory.lt_solve(3.0, DELTA, 1 / 6, 0.5)
    assert (g["eps1"], g["delta1"], g["t_max"]) == (p.eps1, p.delta1, p.t_max)
    assert (g["epsilon"], g["delta"]) == theory.lt_total(p.eps1, p.delta1, 1 / 6, p.delta2)
    assert g["epsilon"] <= 3.0 and g["delta"] <= DELTA
    nu = plan.runs[arm.runs[0]].noise_multiplier
    # Each run is (ε₁, δ₁)-DP, tightly.
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(accounting.dpsgd_event(nu, Q, T))
    assert p.eps1 * (1 - 1e-3) < acc.get_epsilon(p.delta1) <= p.eps1
    ks = arm.extra["runs_per_procedure"]
    assert len(ks) == 2 and all(1 <= k <= p.t_max for k in ks) and len(arm.runs) == sum(ks)


def test_repeat_and_select_plan_equals_dp_accounting():
    plan = plan_study(
        _study(method="repeat-and-select", opts={"mean": 5, "distribution": "poisson"}, space={"lr": [0.1, 1.0]}),
        N,
        10000,
        "accuracy",
    )
    arm = plan.arms[0]
    nu = plan.runs[arm.runs[0]].noise_multiplier if arm.runs else arm.extra["noise_multipliers"][0]
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_event.RepeatAndSelectDpEvent(accounting.dpsgd_event(nu, Q, T), 5.0, math.inf))
    eps = acc.get_epsilon(DELTA)
    assert arm.guarantee["epsilon"] == pytest.approx(eps, rel=1e-9)
    assert 3.0 * (1 - 2e-3) < eps <= 3.0
    # truncated negative binomial with η = 0.5
    plan2 = plan_study(
        _study(
            method="repeat-and-select",
            opts={"mean": 5, "distribution": "negative-binomial", "shape": 0.5},
            space={"lr": [0.1, 1.0]},
        ),
        N,
        10000,
        "accuracy",
    )
    nu2 = plan2.arms[0].extra["noise_multipliers"][0]
    acc2 = rdp_privacy_accountant.RdpAccountant()
    acc2.compose(dp_event.RepeatAndSelectDpEvent(accounting.dpsgd_event(nu2, Q, T), 5.0, 0.5))
    assert plan2.arms[0].guarantee["epsilon"] == pytest.approx(acc2.get_epsilon(DELTA), rel=1e-9)


def test_linear_scaling_plan_reproduces_panda_budget_split():
    s = _study(
        method="linear-scaling",
        strategy="dpgd",
        eps=1.0,
        accountant="auto",
        space={"lr": {"log_uniform": [0.01, 1.0]}, "steps": {"int_uniform": [5, 50]}},
        training=TrainingSpec(steps=10, full_batch=True),
    )
    plan = plan_study(s, 5000, 1000, "accuracy")
    arm = plan.arms[0]
    assert arm.accountant == "gdp"
    mu1, mu2 = (accounting.gdp_mu_for_epsilon(e, DELTA) for e in (0.1, 0.2))
    sweeps = {0: [], 1: []}
    for rid in arm.runs:
        r = plan.runs[rid]
        if r.stage.startswith("sweep"):
            sweeps[int(r.stage[-1])].append(accounting.gdp_mu_of_event(r.planned_event))
    assert len(sweeps[0]) == len(sweeps[1]) == 3
    for mus, target in ((sweeps[0], mu1), (sweeps[1], mu2)):
        for m in mus:
            assert target * (1 - 1e-3) < m <= target * (1 + 1e-12)  # μ_i-GDP (target: a brentq root, xtol 1e-12)
    final = next(plan.runs[r] for r in arm.runs if plan.runs[r].stage == "final")
    assert final.config is None and final.steps == 50  # resolved after the sweeps; T_f = T_max
    mu_f = accounting.gdp_mu_of_event(final.planned_event)
    mu = math.sqrt(sum(m * m for m in sweeps[0] + sweeps[1]) + mu_f**2)  # Panda App. A.7
    assert accounting.gdp_epsilon(mu, DELTA) == pytest.approx(1.0, abs=2e-3)
    assert accounting.gdp_epsilon(mu, DELTA) <= 1.0 + 1e-9
    assert accounting.gdp_epsilon(mu_f, DELTA) == pytest.approx(0.88, abs=0.01)  # "a final run at ε = 0.88"


def test_private_selection_events_are_planned():
    sel = SelectionSpec(mode="private", split="holdout", eval_every=50, noise_multiplier=40.0)
    s = _study(space={"lr": [0.1, 1.0]}, selection=sel, training=TrainingSpec(steps=120, expected_batch_size=512))
    plan = plan_study(s, N, 10000, "accuracy")
    run = plan.runs[plan.arms[0].runs[0]]
    assert run.eval_steps == (50, 100, 120) and not run.eval_final
    a = atoms(run.planned_event)
    assert a[dp_event.GaussianDpEvent(40.0)] == 3
    assert a[dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(run.noise_multiplier))] == 120
    # The training ν is calibrated for what the selection leaves: more noise than without it.
    public = plan_study(
        _study(space={"lr": [0.1, 1.0]}, training=TrainingSpec(steps=120, expected_batch_size=512)),
        N,
        10000,
        "accuracy",
    )
    assert run.noise_multiplier > public.runs[public.arms[0].runs[0]].noise_multiplier
    assert plan.arms[0].guarantee["epsilon"] <= 3.0


@pytest.mark.parametrize("strategy", ["oso", "quantile"])
def test_split_strategies_get_a_noise_multiplier_they_release(strategy):
    # OSO and the quantile rule split ν over two queries; the gateway recomputes the joint ν from
    # the parts and refuses less noise than planned: the planner snaps ν (a few ulps up) so that
    # the parts recombine to at least it — otherwise ~1 run in 5 would be refused mid-training.
    from dptune.release.context import RunPlan

    space = {"lr": [0.1, 1.0]}
    s = make_study(
        planning_data(),
        strategy=strategy,
        space=space,
        training=TrainingSpec(steps=50, expected_batch_size=512),
        eps=(0.7, 1.0, 1.3, 2.0, 3.0, 5.0),
        delta=DELTA,
        selection=SelectionSpec(eval_every=50),
    )
    plan = plan_study(s, N, 10000, "accuracy")
    for run in plan.runs.values():
        strat = __import__("dptune").make_strategy(strategy, **run.config)
        run_plan = RunPlan(strat, N, run.sampling_rate, run.steps, run.noise_multiplier)
        # at least the planned noise is drawn, at most a rounding above it (the gateway's rule)
        assert run.noise_multiplier <= run_plan.released_multiplier() <= run.noise_multiplier * (1 + 1e-12)
    for arm in plan.arms:
        assert arm.guarantee["epsilon"] <= arm.epsilon


def test_random_search_draws_per_procedure_and_each_procedure_meets_epsilon():
    """Per-seed selection: every seed replicate is its own random search (its own draws, steps
    included), and each one's composition meets ε at its own ν; with account_seeds the union does."""
    space = {"lr": {"log_uniform": [1e-3, 1.0]}, "steps": [10, 40]}
    for account in (False, True):
        s = _study(method="random", opts={"n": 3}, space=space, seeds=(0, 1, 2), account_seeds=account)
        plan = plan_study(s, N, 10000, "accuracy")
        arm = plan.arms[0]
        runs = [plan.runs[r] for r in arm.runs]
        draws = [tuple((r.config["lr"], r.steps) for r in runs if r.procedure == p) for p in range(3)]
        assert len(set(draws)) == 3 and all(len(d) == 3 for d in draws)
        groups = [[0, 1, 2]] if account else [[0], [1], [2]]
        eps = [
            accounting.epsilon(group_events(r.planned_event for r in runs if r.procedure in g), DELTA, arm.accountant)
            for g in groups
        ]
        assert max(eps) <= 3.0 * (1 + 1e-9) and max(eps) == pytest.approx(arm.guarantee["epsilon"])
        if not account:  # calibrated per procedure: the tightest one sits at ε
            assert max(eps) == pytest.approx(3.0, rel=1e-3)
