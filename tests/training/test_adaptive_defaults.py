"""Defaults that adapt to the run, and one name per concept (issue 27, item 3).

The batch default is a public function of n (q = L/n is public to the accountant): a fixed 256
failed on n = 240 and gave q = 0.56 and 9 steps on n = 455, silently. Plans with q > 0.5 or
T < 20 warn (``SamplingWarning``), printed by the CLI as one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import TESTS

import dptune
from dptune.release.sampling import default_batch_size
from dptune.strategies import make_strategy
from dptune.train import SamplingWarning, plan_run


def _plan(n: int, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_run(make_strategy("dpsgd"), n, noise_multiplier=1.0, **kw)
    return plan, [w for w in caught if issubclass(w.category, SamplingWarning)]


@pytest.mark.parametrize(
    ("n", "batch", "steps"),
    [(240, 24, 50), (455, 46, 50), (4045, 256, 80), (60_000, 256, 1172)],  # T = ceil(5 / (L/n))
)
def test_the_batch_default_is_min_256_n_over_10_and_plans_without_a_warning(n, batch, steps):
    assert default_batch_size(n) == batch
    plan, caught = _plan(n, epochs=5)
    assert plan.expected_batch_size == batch and plan.sampling_rate == batch / n
    assert plan.steps == steps and caught == []


def test_the_old_fixed_256_on_n_455_warns_of_q_above_a_half_and_few_steps():
    plan, caught = _plan(455, epochs=5, expected_batch_size=256)
    assert plan.steps == 9  # q = 0.563: what the old default gave silently
    (w,) = caught
    assert "q = 0.563" in str(w.message) and "T = 9" in str(w.message) and "Fix:" in str(w.message)


@pytest.mark.parametrize(
    ("kw", "warns"), [({"steps": 19}, True), ({"steps": 20}, False), ({"full_batch": True, "steps": 25}, False)]
)
def test_few_steps_warn_and_full_batch_by_choice_does_not(kw, warns):
    kw.setdefault("expected_batch_size", None if kw.get("full_batch") else 100)
    _, caught = _plan(10_000, **kw)
    assert bool(caught) == warns


def test_a_non_private_run_plans_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_run(make_strategy("nodp"), 455, expected_batch_size=256, epochs=1)


def test_dptune_train_on_n_240_adapts_the_batch_and_prints_the_warning_as_one_line(tmp_path: Path):
    """The issue's case: `dptune train` with no --batch-size on the user's 240 examples failed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dptune.__file__).parents[1]), str(TESTS)])}
    args = ["train", "--data", "own_factories:load_data", "--model", "own_factories:make_model", "--epochs", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "dptune", *args, "--no-progress", "--out", "r.json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    release = json.loads((tmp_path / "r.json").read_text())
    assert release["expected_batch_size"] == 24 and release["steps"] == 10
    (line,) = [ln for ln in proc.stderr.splitlines() if "samples q =" in ln]
    assert line.startswith("warning: the run samples q = 0.1 of the data per step for T = 10 steps")
    assert "SamplingWarning" not in proc.stderr and "warnings.warn" not in proc.stderr
