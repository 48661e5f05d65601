"""Private selection that can select (issue 27, item 4): at plan time, the noise on a released
mean score (ν·s/m for a sum of scores clamped to [0, s], over m validation examples) is compared
with the spread that matters (``SELECTION_SPREAD`` of the metric's range, 0.05 accuracy); above it,
planning warns with the fixes and their ε cost. The reference values are computed here by hand."""

from __future__ import annotations

import math
import warnings

import pytest
from scipy.stats import norm

from dptune.tune import SelectionSpec
from dptune.tune.plan import SELECTION_SPREAD, SelectionNoiseWarning, plan_study
from tests.tune_helpers import make_study

N_TRAIN = 1000


def _plan(n_val: int, nu: float = 20.0, mode: str = "private", metric: str = "accuracy", eps: float = 2.0):
    # 10 steps, eval_every 5: evaluations at steps 5 and 10 → 2 private score releases per run.
    study = make_study(selection=SelectionSpec(mode=mode, noise_multiplier=nu, eval_every=5), eps=eps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_study(study, N_TRAIN, n_val, metric)
    return plan, [w for w in caught if issubclass(w.category, SelectionNoiseWarning)]


def _gaussian_eps(mu: float, delta: float) -> float:
    """ε at δ of μ-GDP (Dong, Roth & Su 2019, Cor. 2.13), by bisection: the independent reference."""
    lo, hi = 0.0, 100.0
    for _ in range(200):
        e = (lo + hi) / 2
        d = norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2)
        lo, hi = (e, hi) if d > delta else (lo, e)
    return hi


def test_the_issue_case_warns_with_the_three_fixes():
    # The issue's study: ~81 holdout examples at the default ν = 20 → noise std 20/81 = 0.247 accuracy.
    plan, caught = _plan(81)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "std 0.247" in msg and "±0.25 accuracy" in msg
    assert f"m ≥ {math.ceil(20 / SELECTION_SPREAD)}" in msg  # 400: a bigger holdout
    assert "selection.noise_multiplier (≤ 4.05" in msg  # 0.05·81: a lower ν ...
    # ... at its ε cost: the 2 releases of a run at ν = 4.05 are μ-GDP with μ = √2/4.05.
    k = sum(len(r.eval_steps) + r.eval_final for r in plan.runs.values())
    assert k == 2
    e_ok, e_now = _gaussian_eps(math.sqrt(k) / 4.05, 1e-5), _gaussian_eps(math.sqrt(k) / 20, 1e-5)
    assert (
        f"the 2 validation scores of a procedure of dpsgd@eps=2 then spend ε = {e_ok:.3g} of its 2, now {e_now:.3g}"
        in msg
    )
    assert "selection.mode = 'public'" in msg  # public validation data
    # The plan itself is unchanged by the warning: the selection ν still rounds nothing down.
    assert all(r.eval_noise_multiplier == 20.0 for r in plan.runs.values())


@pytest.mark.parametrize(("n_val", "nu"), [(400, 20.0), (5000, 20.0), (81, 4.05)])
def test_no_warning_when_the_noise_is_at_most_the_spread(n_val, nu):
    assert _plan(n_val, nu)[1] == []


def test_just_above_the_spread_warns():
    assert len(_plan(399)[1]) == 1  # 20/399 = 0.0501 > 0.05


def test_when_a_lower_nu_would_spend_the_budget_it_says_evaluate_less_often():
    # ε = 0.5: at ν = 4.05 the 2 scores alone would spend ε ≈ 1.5 ≥ 0.5, so a lower ν is no fix.
    (warning,) = _plan(81, eps=0.5)[1]
    msg = str(warning.message)
    e_ok = _gaussian_eps(math.sqrt(2) / 4.05, 1e-5)
    assert e_ok >= 0.5 and f"would spend ε = {e_ok:.3g} ≥ 0.5" in msg
    assert "fewer evaluations (selection.eval_every, checkpoint = 'final'" in msg and "then spend" not in msg


def test_public_selection_never_warns():
    assert _plan(10, mode="public")[1] == []


def test_mse_names_no_accuracy():
    _, caught = _plan(50, nu=20.0, metric="mse")
    msg = str(caught[0].message)
    assert "accuracy" not in msg and "std 0.4 of the metric's range" in msg
