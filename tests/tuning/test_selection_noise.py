"""Private selection that can select (issue 27, item 4): at plan time, the noise on a released
mean score (ν·s/m for a sum of scores clamped to [0, s], over m validation examples) is compared
with the spread that matters (``SELECTION_SPREAD`` of the metric's range, 0.05 accuracy); above it,
planning warns with the fixes and their ε cost. The reference values are computed here by hand."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from scipy.stats import norm
from tune_helpers import make_study, tiny_study_toml

import dptune
from dptune.tune import SelectionSpec
from dptune.tune.plan import SELECTION_SPREAD, SelectionNoiseWarning, plan_study

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
        f"(≤ 4.05: ε = {e_ok:.3g} of the 2 of dpsgd@eps=2 for its 2 validation scores per procedure, now {e_now:.3g};"
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
    assert e_ok >= 0.5 and f"at ν ≤ 4.05, ε = {e_ok:.3g} ≥ the 0.5 of dpsgd@eps=0.5 for its 2 validation scores" in msg
    assert "fewer evaluations (selection.eval_every, checkpoint = 'final'" in msg and "lower selection" not in msg


def test_public_selection_never_warns():
    assert _plan(10, mode="public")[1] == []


def test_mse_names_no_accuracy():
    _, caught = _plan(50, nu=20.0, metric="mse")
    msg = str(caught[0].message)
    assert "accuracy" not in msg and "std 0.4 of the metric's range" in msg


def test_dptune_tune_prints_the_warning_as_one_line_before_training(tmp_path):
    """On digits a 0.2 holdout has ~267 examples: std 20/267 = 0.075 > 0.05."""
    (tmp_path / "s.toml").write_text(
        tiny_study_toml("s", steps=2, selection='[selection]\nmode = "private"\nsplit = "holdout"\n')
    )
    env = {**os.environ, "PYTHONPATH": str(Path(dptune.__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "dptune", "tune", "s.toml", "-o", "d", "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    flat = " ".join(proc.stderr.splitlines())  # one warning, wrapped to the terminal's width
    assert flat.count("cannot select") == 1
    assert "warning: private selection cannot select: selection.noise_multiplier = 20 on m = " in flat
    assert "SelectionNoiseWarning" not in proc.stderr and "plan_study(" not in proc.stderr  # no source line
