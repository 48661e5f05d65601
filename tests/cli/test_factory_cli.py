"""Your own model and data from the CLI and study files: ``pkg.module:factory`` (issue 11, item 3).

The user's module is tests/own_factories.py (a map-style dataset built example by example
and a small MLP). A study of it runs identically on the local, process and Ray executors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_helpers import OWN_FACTORIES, invoke_train
from tune_helpers import own_factories_study_toml
from typer.testing import CliRunner

from dptune import ConfigError
from dptune.cli import app
from dptune.tune import load_study_config, run_study
from dptune.tune.spec import DataSpec, ModelSpec
from dptune.tune.store import Store

runner = CliRunner()


def _toml(tmp_path: Path, model: str = "own_factories:make_model") -> Path:
    p = tmp_path / "own.toml"
    p.write_text(own_factories_study_toml("own", model))
    return p


def _runs(d: Path) -> dict[str, tuple]:
    with Store(d) as s:
        return {r["run_id"]: (r["status"], r["score"], r["best_step"], r["history"]) for r in s.runs()}


def test_cli_train_with_own_model_and_data(tmp_path):
    out = tmp_path / "r.json"
    res = invoke_train(out, data=OWN_FACTORIES, epochs="1", batch_size="40", eval_every="3", hps=["lr=0.5"])
    assert res.exit_code == 0, res.output
    release = json.loads(out.read_text())
    text = json.dumps(release)
    assert "own_factories:load_data" in text
    assert release["steps"] == 6 and release["checkpoint"] == "final"  # 240 examples, L = 40, 1 epoch
    # your test split is private unless --eval-public: its metrics are in the diagnostics only
    diag = json.loads((tmp_path / "diagnostics" / "r.json").read_text())
    assert "best_metric" not in release and 0.0 <= diag["private_evaluation"]["best_metric"] <= 1.0


def test_cli_model_factory_with_a_builtin_dataset(tmp_path):
    out = tmp_path / "r.json"
    res = invoke_train(
        out, data=["--dataset", "digits", "--model", "own_factories:make_model"], eval_every=None, hps=[]
    )
    assert res.exit_code == 0, res.output
    assert out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "no_such_module_xyz:make"], "cannot import module 'no_such_module_xyz'"),
        (["--model", "own_factories:nope"], "has no attribute 'nope'"),
        (["--model", "own_factories:NOT_CALLABLE"], "is not callable"),
        (["--data", "own_factories:load_data"], "--data needs your own model too"),
        (["--data", "own_factories", "--model", "own_factories:make_model"], "not of the form 'pkg.module:function'"),
    ],
)
def test_cli_bad_factory_is_one_clear_error_before_any_file(tmp_path, args, needle):
    out = tmp_path / "sub" / "r.json"
    res = runner.invoke(app, ["train", *args, "--no-progress", "--out", str(out)])
    assert res.exit_code != 0
    assert "Traceback" not in res.output
    assert needle in " ".join(res.output.split()), res.output
    assert not (tmp_path / "sub").exists()


def test_study_spec_factories_are_checked_early_and_fingerprinted(tmp_path):
    study = load_study_config(_toml(tmp_path))
    d = study.to_dict()
    assert d["data"] == {"factory": "own_factories:load_data", "options": {"n": 160, "n_test": 60}}
    assert d["model"]["factory"] == "own_factories:make_model"
    other = load_study_config(_toml(tmp_path, "own_factories:TwoLayer"))
    assert other.fingerprint() != study.fingerprint()
    assert not study.from_python  # a file-based study: resumable from its description
    with pytest.raises(ConfigError, match="cannot import module"):
        load_study_config(_toml(tmp_path, "missing_pkg_xyz.models:build"))
    with pytest.raises(ConfigError, match="exactly one of"):
        ModelSpec(name="logistic_regression", factory="own_factories:make_model")
    with pytest.raises(ConfigError, match="exactly one of"):
        DataSpec(name="digits", factory="own_factories:load_data")


def test_study_with_factories_local(tmp_path):
    study = load_study_config(_toml(tmp_path))
    run_study(study, tmp_path / "local", executor="local", progress=False)
    runs = _runs(tmp_path / "local")
    assert len(runs) == 2 and all(r[0] == "done" and math.isfinite(r[1]) for r in runs.values())


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["process", "ray"])
def test_study_with_factories_on_other_executors_matches_local(tmp_path, executor):
    if executor == "ray":
        ray = pytest.importorskip("ray")
        assert not ray.is_initialized()
    study = load_study_config(_toml(tmp_path))
    run_study(study, tmp_path / "local", executor="local", progress=False)
    run_study(study, tmp_path / executor, executor=executor, workers=2, progress=False)
    local, other = _runs(tmp_path / "local"), _runs(tmp_path / executor)
    assert all(r[0] == "done" for r in other.values()), other
    assert local == other


def _with_metric(tmp_path: Path, metric: str, mode: str = "private") -> Path:
    p = _toml(tmp_path)
    text = p.read_text().replace('mode = "private"', f'mode = "{mode}"\nmetric = "{metric}"')
    if mode == "public":  # public selection on your own test split must be declared
        text = text.replace("n_test = 60 }", "n_test = 60 }\ntest_public = true")
    p.write_text(text)
    return p


def test_study_private_selection_with_own_metric_equals_builtin(tmp_path):
    # The same per-example scores (correct = 1) with the declared sensitivity 1 give the same
    # released sums, hence bit-identical noisy scores, as the built-in accuracy.
    builtin = load_study_config(_with_metric(tmp_path, "accuracy"))
    run_study(builtin, tmp_path / "builtin", progress=False)
    mine = load_study_config(_with_metric(tmp_path, "own_factories:ACCURACY"))
    assert mine.fingerprint() != builtin.fingerprint()
    run_study(mine, tmp_path / "mine", progress=False)
    a, b = _runs(tmp_path / "builtin"), _runs(tmp_path / "mine")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][:3] == b[k][:3], k


def test_study_private_selection_needs_the_metrics_sensitivity(tmp_path):
    with pytest.raises(ConfigError, match="states no sensitivity"):
        load_study_config(_with_metric(tmp_path, "own_factories:NO_SENSITIVITY"))
    with pytest.raises(ConfigError, match="not a dptune.Metric"):
        load_study_config(_with_metric(tmp_path, "own_factories:make_model"))
    # Public selection (on a public test split) does not release it: no sensitivity needed.
    public = load_study_config(_with_metric(tmp_path, "own_factories:NO_SENSITIVITY", mode="public"))
    run_study(public, tmp_path / "pub", progress=False)
    assert all(r[0] == "done" for r in _runs(tmp_path / "pub").values())
