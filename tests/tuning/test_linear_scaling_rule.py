"""Panda et al.'s linear scaling rule (Algorithms 1–3): r = η·T decomposition, sweep budgets, the fit.

Issue 15 item 6: the rule lost to random search in the Panda text preset. These tests pin down
the pieces checked against the paper: Alg. 1's decomposition r → (η, T) within η_max and T_max,
sweeps sized as shares of the target ε (with the whole search still composing to the target),
the fit of r against ε and its extrapolation, and what the final run really trains with.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from conftest import SHARED_DATA
from tune_helpers import make_study, planning_data

from dptune import accounting
from dptune.errors import ConfigError
from dptune.tune import MethodSpec, SelectionSpec, TrainingSpec, plan_study
from dptune.tune.methods.linear_scaling import _decompose, resolve_final_config, split_r

DELTA = 1e-5


def _study(opts=None, eps=(1.0,), space=None, seeds=(0,)):
    space = space or {"lr": {"log_uniform": [0.05, 5.0]}, "steps": {"int_uniform": [10, 200]}}
    return make_study(
        planning_data(),
        strategy="dpgd",
        space=space,
        training=TrainingSpec(steps=10, full_batch=True),
        eps=eps,
        delta=DELTA,
        accountant="auto",
        method="linear-scaling",
        opts=opts,
        selection=SelectionSpec(eval_every=10),
        seeds=seeds,
    )


# ----------------------------------------------------------------------------- Alg. 1: r → (η, T)
def test_decomposition_keeps_the_drawn_r_when_feasible_steps_are_rare():
    """Alg. 1: "decompose r into η, T without exceeding T_max or η_max". With a narrow η range the
    T that give η = r/T in range are a few in a thousand: the old planner gave up after 100 draws
    and clamped η, so the run's η·T was not the r it had drawn (a different, biased r)."""
    space = {"lr": {"log_uniform": [0.5, 0.55]}, "steps": {"int_uniform": [1, 1000]}}
    r_lo, r_hi = 0.5 * 1, 0.55 * 1000
    moved = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        r = copy.deepcopy(rng).uniform(r_lo, r_hi)  # the r _decompose draws first
        c = _decompose(rng, space, r_lo, r_hi, 0.5, 0.55, "uniform")
        assert 0.5 <= c["lr"] <= 0.55 and 1 <= c["steps"] <= 1000 and isinstance(c["steps"], int)
        if math.floor(r / 0.5) >= math.ceil(r / 0.55):  # some integer T reaches r exactly
            moved += not math.isclose(c["lr"] * c["steps"], r, rel_tol=1e-9)
    assert moved == 0


@pytest.mark.parametrize(
    "axis",
    [{"int_uniform": [10, 200]}, {"int_log_uniform": [10, 200]}, [10, 25, 50, 100, 200]],
)
def test_split_r_respects_both_maxima_and_r_equals_eta_times_t(axis):
    rng = np.random.default_rng(0)
    steps = sorted(axis) if isinstance(axis, list) else None
    for r in np.geomspace(0.5, 1000, 60):
        c = split_r(float(r), axis, 0.05, 5.0, rng)
        T, lr = c["steps"], c["lr"]
        assert 0.05 <= lr <= 5.0 and 10 <= T <= 200
        if steps is not None:
            assert T in steps
        feasible = [t for t in (steps or range(10, 201)) if 0.05 <= r / t <= 5.0]
        if feasible:
            assert lr * T == pytest.approx(r, rel=1e-9)


def test_split_r_without_a_reachable_t_takes_the_nearest_product():
    # T ∈ {10, 100}, η ∈ [1, 2]: r = 50 needs T ∈ [25, 50]; T = 100 (r = 100) is nearer in log r
    # than T = 10 (r = 20).
    c = split_r(50.0, [10, 100], 1.0, 2.0, np.random.default_rng(0))
    assert c == {"lr": 1.0, "steps": 100}


# ----------------------------------------------------------------------------- sweep budgets
@pytest.mark.parametrize("eps", [0.5, 1.0, 4.0])
def test_fraction_sweeps_scale_with_the_target_and_compose_to_it(eps):
    """sweep_epsilons = {fraction = [0.1, 0.2]}: sweeps at 0.1·ε and 0.2·ε; the 3 + 3 sweep runs
    and the final run still compose (μ-GDP, App. A.7) to the target (ε, δ), exactly."""
    plan = plan_study(_study({"sweep_epsilons": {"fraction": [0.1, 0.2]}}, eps=(eps,)), 5000, 1000, "accuracy")
    (arm,) = plan.arms
    assert arm.accountant == "gdp"
    assert arm.extra["sweep_epsilons"] == pytest.approx([0.1 * eps, 0.2 * eps], rel=1e-12)
    mus = {0: [], 1: []}
    for rid in arm.runs:
        run = plan.runs[rid]
        if run.stage.startswith("sweep"):
            mus[int(run.stage[-1])].append(accounting.gdp_mu_of_event(run.planned_event))
    for i, f in enumerate((0.1, 0.2)):
        target = accounting.gdp_mu_for_epsilon(f * eps, DELTA)
        assert len(mus[i]) == 3 and all(target * (1 - 1e-3) < m <= target * (1 + 1e-12) for m in mus[i])
    final = next(plan.runs[r] for r in arm.runs if plan.runs[r].stage == "final")
    mu = math.sqrt(sum(m * m for m in mus[0] + mus[1]) + accounting.gdp_mu_of_event(final.planned_event) ** 2)
    assert accounting.gdp_epsilon(mu, DELTA) == pytest.approx(eps, rel=2e-3)
    assert accounting.gdp_epsilon(mu, DELTA) <= eps * (1 + 1e-9)
    assert arm.guarantee["epsilon"] <= eps * (1 + 1e-9)


def test_fraction_sweeps_at_epsilon_one_are_pandas_split():
    frac = plan_study(_study({"sweep_epsilons": {"fraction": [0.1, 0.2]}}), 5000, 1000, "accuracy").arms[0]
    absolute = plan_study(_study({"sweep_epsilons": [0.1, 0.2]}), 5000, 1000, "accuracy").arms[0]
    assert frac.extra["sweep_epsilons"] == absolute.extra["sweep_epsilons"] == [0.1, 0.2]
    assert frac.extra["final_epsilon"] == absolute.extra["final_epsilon"]
    assert abs(frac.extra["final_epsilon"]["0"] - 0.88) < 0.01  # Panda App. A.7: ε_f = 0.88


@pytest.mark.parametrize(
    "value, words",
    [
        ({"fraction": [0.1, 1.2]}, "must be < 1"),
        ({"share": [0.1, 0.2]}, "{fraction = [...]}"),
        ({"fraction": [0.2]}, "need ≥ 2"),
        ({"fraction": [0.1, 0.1]}, "values repeat"),
        ("0.1, 0.2", "need ≥ 2"),
    ],
)
def test_bad_sweep_epsilons_name_the_fix(value, words):
    with pytest.raises(ConfigError) as e:
        MethodSpec("linear-scaling", {"sweep_epsilons": value})
    assert words in str(e.value) and "Fix:" in str(e.value)


# ----------------------------------------------------------------------------- Alg. 2: the fit
def _scores_peaking_at(plan, arm, r_of_eps):
    """Selection scores that make the sweep run nearest (in log r) to r_of_eps(ε_i) the best."""
    scores = {}
    for rid in arm.runs:
        run = plan.runs[rid]
        if run.stage.startswith("sweep"):
            e = arm.extra["sweep_epsilons"][int(run.stage[len("sweep") :])]
            scores[rid] = -abs(math.log(run.config["lr"] * run.config["steps"] / r_of_eps(e)))
    return scores


MANY_RUNS = {"sweep_epsilons": [0.1, 0.4], "runs_per_sweep": 100, "r_sampling": "log_uniform"}


def test_the_fit_recovers_a_known_slope_and_extrapolates_to_the_final_epsilon():
    """Sweeps whose best r lies on r(ε) = 100·ε + 10: with many runs per sweep the best draws are
    close to the line, the fit's slope and intercept come back, and r* is the line at the final
    run's own ε_f (§4.2: r(ε_f) = m·ε_f + b), run as η_f = r*/T_max."""
    plan = plan_study(_study(MANY_RUNS, eps=(8.0,)), 5000, 1000, "accuracy")
    (arm,) = plan.arms
    line = lambda e: 100.0 * e + 10.0  # noqa: E731
    config, fit = resolve_final_config(plan, arm, 0, _scores_peaking_at(plan, arm, line))
    (x1, r1), (x2, r2) = fit["points"]
    assert (x1, x2) == (0.1, 0.4)
    assert r1 == pytest.approx(line(0.1), rel=0.1) and r2 == pytest.approx(line(0.4), rel=0.1)
    slope, intercept = fit["coef"]
    assert slope == pytest.approx((r2 - r1) / 0.3, rel=1e-9) and slope == pytest.approx(100.0, rel=0.3)
    eps_f = arm.extra["final_epsilon"]["0"]
    assert fit["x_final"] == eps_f and 1.0 < eps_f < 8.0
    assert fit["r_star"] == pytest.approx(slope * eps_f + intercept, rel=1e-9)
    assert fit["r_star"] == pytest.approx(line(eps_f), rel=0.3)
    assert config["steps"] == 200 and config["lr"] == pytest.approx(fit["r_star"] / 200, rel=1e-9)
    assert fit["r_final"] == pytest.approx(fit["r_star"], rel=1e-9)


def test_a_decreasing_fit_is_clipped_and_the_final_r_is_recorded():
    """r falling with ε (noise at small budgets) extrapolates below η_min·T_f: r* is clipped to
    r_min, and the final run, whose T_f = T_max was fixed at planning, can only reach η_min·T_f —
    the fit record says so (``r_final``) rather than claiming r* was run."""
    plan = plan_study(_study(MANY_RUNS, eps=(8.0,)), 5000, 1000, "accuracy")
    (arm,) = plan.arms
    config, fit = resolve_final_config(plan, arm, 0, _scores_peaking_at(plan, arm, lambda e: 600.0 - 1000.0 * e))
    assert fit["coef"][0] < 0
    assert fit["r_star"] == pytest.approx(0.05 * 10)  # r_min = η_min·T_min
    assert config == {"lr": 0.05, "steps": 200}
    assert fit["r_final"] == pytest.approx(0.05 * 200) and fit["r_final"] > fit["r_star"]


# ----------------------------------------------------------------------------- the presets
def test_panda_small_presets_size_their_sweeps_for_small_n(monkeypatch):
    path = SHARED_DATA
    if not path.is_dir():
        pytest.skip(f"shared data directory not found at {path}")
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(path))
    monkeypatch.setenv("DPTUNE_OFFLINE", "1")
    from dptune.presets import plan_preset

    (plan,) = plan_preset("panda-linear-scaling-mnist", "small").values()
    arms = [a for a in plan.arms if a.method == "linear-scaling"]
    assert {a.epsilon for a in arms} == {2.0, 8.0}
    for arm in arms:
        assert arm.options["r_sampling"] == "log_uniform"
        assert arm.extra["sweep_epsilons"] == pytest.approx([0.1 * arm.epsilon, 0.2 * arm.epsilon])
        assert arm.guarantee["epsilon"] <= arm.epsilon * (1 + 1e-9)
        assert arm.guarantee["epsilon"] == pytest.approx(arm.epsilon, rel=2e-3)
        for rid in arm.runs:
            run = plan.runs[rid]
            if run.stage.startswith("sweep"):
                assert 0.05 <= run.config["lr"] <= 2.0 and 5 <= run.config["steps"] <= 30


def test_a_sweep_whose_private_scores_alone_exceed_its_epsilon_names_that():
    """Found in review: a sweep run at ε = 0.1 with private scores (σ = 20) said "could not reach ε ≤ 0.1 even with
    noise multiplier 5.56e+08" with two "Fix:" clauses; the scores alone cost more than 0.1: it now says that."""
    study = _study()
    study = type(study)(**{**study.__dict__, "selection": SelectionSpec(mode="private", split="holdout", eval_every=2)})
    with pytest.raises(ConfigError, match=r"sweep run at ε = .*private validation scores alone spend") as exc:
        plan_study(study, 300, 60, "accuracy")
    assert str(exc.value).count("Fix:") == 1 and ".." not in str(exc.value)
