"""Defaults that adapt to the run, and one name per concept (issue 27, item 3).

The batch default is a public function of n (q = L/n is public to the accountant): a fixed 256
failed on n = 240 and gave q = 0.56 and 9 steps on n = 455, silently. Plans with q > 0.5 or
T < 20 warn (``SamplingWarning``), printed by the CLI as one line.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import typer
from conftest import TESTS
from tune_helpers import tiny_study_toml
from typer.testing import CliRunner

import dptune
from dptune import accounting
from dptune.cli import app
from dptune.errors import ConfigError
from dptune.outputs import effective_hyperparameters
from dptune.release.sampling import default_batch_size
from dptune.strategies import make_strategy
from dptune.train import SamplingWarning, plan_run
from dptune.tune.spec import study_from_dict


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
    env = {
        **os.environ,
        "COLUMNS": "60",
        "PYTHONPATH": os.pathsep.join([str(Path(dptune.__file__).parents[1]), str(TESTS)]),
    }
    args = ["train", "--data", "own_factories:load_data", "--model", "own_factories:make_model", "--epochs", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "dptune", *args, "--no-progress", "--out", "r.json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    release = json.loads((tmp_path / "r.json").read_text())
    assert release["expected_batch_size"] == 24 and release["steps"] == 10
    flat = " ".join(proc.stderr.splitlines())  # wrapped to the terminal's width (COLUMNS=60 here)
    assert "warning: the run samples q = 0.1 of the data per step for T = 10 steps" in flat
    assert max(map(len, proc.stderr.splitlines())) <= 60
    assert "SamplingWarning" not in proc.stderr and "warnings.warn" not in proc.stderr


# --- one name per concept (dptune.names): target_epsilon, expected_batch_size, secure_mode ---


def test_plan_run_takes_the_aliases_with_a_note_and_refuses_both_spellings_or_unknown_keys():
    canonical = plan_run(make_strategy("dpsgd"), 455, target_epsilon=3.0, delta=1e-5, expected_batch_size=46, epochs=5)
    with pytest.warns(DeprecationWarning, match="epsilon= is an alias of target_epsilon="):
        alias = plan_run(make_strategy("dpsgd"), 455, epsilon=3.0, delta=1e-5, batch_size=46, epochs=5)
    assert alias == canonical
    with pytest.raises(ConfigError, match="epsilon= and target_epsilon= name one setting"):
        plan_run(make_strategy("dpsgd"), 455, epsilon=3.0, target_epsilon=3.0, delta=1e-5, epochs=5)
    with pytest.raises(ConfigError, match="unexpected keyword arguments \\['epsilonn'\\]"):
        plan_run(make_strategy("dpsgd"), 455, epsilonn=3.0, noise_multiplier=1.0, epochs=5)


def test_dptune_train_and_make_private_take_the_aliases():
    from own_factories import load_data, make_model

    data = load_data()[0]
    with pytest.warns(DeprecationWarning, match="secure= is an alias of secure_mode="):
        res = dptune.train(make_model(), data, "dpsgd", steps=2, epsilon=3.0, delta=1e-3, batch_size=30, secure=True)
    assert res.secure_mode and res.plan.expected_batch_size == 30 and res.epsilon() <= 3.0
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(DeprecationWarning, match="make_private: batch_size= is an alias"):
        pt = dptune.make_private(model, data, opt, steps=2, epsilon=3.0, delta=1e-3, batch_size=30, secure=True)
    assert pt.secure_mode and pt.plan.expected_batch_size == 30 and pt.plan.steps == 2


def test_the_cli_takes_the_canonical_spellings_and_the_short_ones(tmp_path: Path):
    base = ["train", "--data", "own_factories:load_data", "--model", "own_factories:make_model", "--epochs", "0.5"]
    releases = []
    for i, spell in enumerate([("--target-epsilon", "--expected-batch-size", "--secure-mode"),
                               ("--epsilon", "--batch-size", "--secure")]):  # fmt: skip
        out = tmp_path / f"r{i}.json"
        args = [*base, spell[0], "2", spell[1], "30", spell[2], "--no-progress", "--out", str(out)]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        releases.append(json.loads(out.read_text()))
    for r in releases:
        assert r["expected_batch_size"] == 30 and r["steps"] == 4 and r["randomness"] == "secure"
    assert releases[0]["noise_multiplier"] == releases[1]["noise_multiplier"]


def test_a_study_file_takes_the_python_names_as_aliases():
    stored = tomllib.loads(tiny_study_toml("s"))
    alias = copy.deepcopy(stored)
    alias["budget"]["target_epsilon"] = alias["budget"].pop("epsilon")
    alias["training"]["batch_size"] = alias["training"].pop("expected_batch_size")
    alias["study"]["secure_mode"] = True
    stored["study"]["secure"] = True
    assert study_from_dict(alias).fingerprint() == study_from_dict(stored).fingerprint()
    alias["budget"]["epsilon"] = 2.0
    with pytest.raises(ConfigError, match="budget.target_epsilon: and budget.epsilon name one setting"):
        study_from_dict(alias)


# --- one default strategy (dpsgd) and one default accountant (auto: PLD, exact GDP at q = 1) ---


@pytest.mark.parametrize(("q", "accountant"), [(0.01, "pld"), (1.0, "gdp")])
def test_calibrate_gives_the_same_nu_from_the_cli_and_from_python(q: float, accountant: str):
    """The issue's call: ν = 0.814 on the CLI (PLD) against 0.865 in Python (RDP)."""
    args = ["calibrate", "--epsilon", "3", "--sampling-rate", str(q), "--steps", "300"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert f", {accountant})" in res.output
    cal = dptune.calibrate(3.0, 1e-5, q, 300)
    assert cal.noise_multiplier == accounting.calibrate(3.0, 1e-5, q, 300, accountant=accountant).noise_multiplier
    printed = float(res.output.split("ν = ")[1].split()[0])
    assert cal.noise_multiplier <= printed <= cal.noise_multiplier * (1 + 1e-5)  # printed rounded up
    if q < 1:
        assert cal.noise_multiplier < accounting.calibrate(3.0, 1e-5, q, 300, accountant="rdp").noise_multiplier


def test_the_cli_and_python_train_default_to_the_same_strategy():
    default = inspect.signature(dptune.train).parameters["strategy"].default
    cli_train = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    (option,) = [p for p in cli_train.params if p.name == "strategy"]
    assert default == option.default == "dpsgd"
    assert inspect.signature(accounting.calibrate).parameters["accountant"].default == "auto"


# --- lr and coupled defaults: the effective step is stated, a given lr under default momentum warned ---


def test_an_lr_given_with_the_default_momentum_warns_of_the_tenfold_step():
    """The issue's Opacus port: lr = 1, C = 1 silently stepped 10× (80.1 % against Opacus's 84.4 %)."""
    from own_factories import load_data, make_model

    kw = dict(steps=20, noise_multiplier=1.0, delta=1e-3, expected_batch_size=24)
    with pytest.warns(UserWarning, match=r"lr = 1.0 with dpsgd's default momentum μ = 0.9: .* 10× lr·C"):
        res = dptune.train(make_model(), load_data()[0], "dpsgd", lr=1.0, clip=1.0, **kw)
    assert effective_hyperparameters(res.plan.strategy.config(), res.history[:1]) == {
        "lr": "1", "clip": "1", "momentum": "0.9", "step lr·C/(1−μ)": "10"
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # momentum given: no note
        warnings.filterwarnings("ignore", "dptune: .* runs one example at a time")  # a model of yours: said once
        dptune.train(make_model(), load_data()[0], "dpsgd", lr=1.0, clip=1.0, momentum=0.0, **kw)


def test_the_defaults_computed_at_the_start_are_shown_with_their_effective_step():
    cfg = {"strategy": "dpsgd", "lr": None, "clip": 1.0, "momentum": 0.9}
    hp = effective_hyperparameters(cfg, [{"step": 1, "lr": 0.253, "clip": 1.0}])
    assert hp == {"lr": "0.253", "clip": "1", "momentum": "0.9", "step lr·C/(1−μ)": "2.53"}
    oso = effective_hyperparameters({"strategy": "oso", "lr": None, "initial_clip": 1.0, "momentum": 0.0}, [])
    assert oso == {"initial_clip": "1", "momentum": "0"}  # no lr known, no step claimed


def test_dptune_train_prints_the_effective_hyperparameters(tmp_path: Path):
    args = ["train", "--data", "own_factories:load_data", "--model", "own_factories:make_model", "--epochs", "2"]
    res = CliRunner(env={"COLUMNS": "60"}).invoke(  # stacked rows: "quantity: …" then "value: …"
        app, [*args, "--hp", "lr=1", "--no-progress", "--out", str(tmp_path / "r.json")]
    )
    assert res.exit_code == 0, res.output
    for key, value in [("lr", "1"), ("momentum", "0.9"), ("step lr·C/(1−μ)", "10")]:
        assert f"quantity: {key}\nvalue: {value}\n" in res.output, res.output
    assert json.loads((tmp_path / "r.json").read_text())["strategy"]["momentum"] == 0.9
