"""Issue 11, example (c): examples/own_model_study.py — a study of your own model and data from a
TOML file with ``module:factory`` — runs on small data, from Python and from ``dptune tune``."""

from __future__ import annotations

import math

import pytest
from conftest import EXAMPLES, load_example
from typer.testing import CliRunner

from dptune import ConfigError
from dptune.cli import app
from dptune.tune import load_study_config
from dptune.tune.store import Store


def _example():
    return load_example("own_model_study.py", "own_model_study_example")


def test_example_study_runs_on_small_data(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    ex = _example()
    out = ex.main(out=tmp_path / "study", n=300, steps=8)
    (row,) = out["table"]
    assert row["arm"] == "dpsgd@eps=3" and row["spent_epsilon"] <= 3.0 and row["runs_done"] == 3
    with Store(tmp_path / "study") as s:
        runs = list(s.runs())
    assert len(runs) == 3 and all(r["status"] == "done" and math.isfinite(r["score"]) for r in runs)


def test_example_toml_names_the_factories_and_needs_them_importable(tmp_path, monkeypatch):
    toml = EXAMPLES / "own_model_study.toml"
    monkeypatch.syspath_prepend(str(EXAMPLES))
    study = load_study_config(toml)
    assert study.data.factory == "own_model_study:load_data"
    assert study.model.factory == "own_model_study:make_model"
    # Without the folder on the path: one clear error naming the fix, when the file is read.
    bad = tmp_path / "bad.toml"
    bad.write_text(toml.read_text().replace("own_model_study:", "not_on_path_own_model_study:"))
    with pytest.raises(ConfigError, match="PYTHONPATH"):
        load_study_config(bad)


def test_example_toml_from_the_cli(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    text = (EXAMPLES / "own_model_study.toml").read_text()
    small = (
        text.replace("n = 3000, n_test = 600", "n = 240, n_test = 60")
        .replace("epochs = 5\nexpected_batch_size = 150", "steps = 6\nexpected_batch_size = 24")
        .replace("eval_every = 20", "eval_every = 3")
        .replace("lr = [0.3, 1.0, 3.0]", "lr = [1.0]")
    )
    assert small.count("steps = 6") == 1
    cfg = tmp_path / "small.toml"
    cfg.write_text(small)
    res = CliRunner().invoke(app, ["tune", str(cfg), "--out", str(tmp_path / "s"), "--no-progress"])
    assert res.exit_code == 0, res.output
    with Store(tmp_path / "s") as st:
        runs = list(st.runs())
    assert len(runs) == 1 and runs[0]["status"] == "done"
