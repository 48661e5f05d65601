"""Your own code from a fresh folder (issue 27, item 1): ``--model myproj:build`` with ``myproj.py``
in the current folder and no PYTHONPATH, in the CLI, a study file and a process worker; the
exceptions of your factories as one line naming them; the model card's reload code runs as is.

The commands run as ``python -P -m dptune``: ``-P`` keeps Python from putting the current folder
on the path itself (``python -m`` would), as the installed ``dptune`` script does not either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import invoke_train
from tune_helpers import own_factories_study_toml

import dptune
from dptune import ConfigError
from dptune.factories import call_factory, import_factory

PROJECT = """
import torch
from torch import nn


def load(n=160, n_test=60):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n + n_test, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:n], y[:n], x[n:], y[n:]


def build(input_dim, classes, hidden=8):
    return nn.Sequential(nn.Linear(input_dim, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def patients():
    return open("/data/secret/patients.csv").read()


def broken(input_dim, classes):
    raise RuntimeError("no GPU kernel for this layer")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x)
"""


def _project(tmp_path: Path, name: str) -> Path:
    (tmp_path / f"{name}.py").write_text(PROJECT)
    return tmp_path


def _dptune(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-P", "-m", "dptune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_finds_your_module_in_the_current_folder_and_the_card_reload_code_runs(tmp_path):
    d = _project(tmp_path, "myproj_h8a")
    args = ["train", "--data", "myproj_h8a:load", "--model", "myproj_h8a:build", "--epochs", "1"]
    res = _dptune(d, *args, "--batch-size", "40", "--hp", "lr=0.5", "--save", "m", "--out", "r.json", "--no-progress")
    assert res.returncode == 0, res.stderr
    card = json.loads((d / "m" / "model_card.json").read_text())
    load = card["load"]
    assert "from myproj_h8a import build" in load and "model=build(input_dim=6, classes=3)" in load
    assert load in (d / "m" / "model_card.md").read_text()
    # the reload code, pasted into Python in that folder (where `python` puts the folder on the path)
    code = load + "\nprint(type(model).__name__, sum(p.numel() for p in model.parameters()))"
    ran = subprocess.run([sys.executable, "-c", code], cwd=d, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["Sequential", str(6 * 8 + 8 + 8 * 3 + 3)]
    # without model=, the error shows that code (and what trust_factory=True would do)
    sys.path.insert(0, str(d))
    try:
        with pytest.raises(ConfigError, match="trust_factory=True") as err:
            dptune.load_model(d / "m")
        assert "from myproj_h8a import build" in str(err.value)
        model, _ = dptune.load_model(d / "m", trust_factory=True)
        assert isinstance(model, torch.nn.Sequential)
    finally:
        sys.path.remove(str(d))


@pytest.mark.parametrize("executor", ["process", pytest.param("ray", marks=pytest.mark.slow)])
def test_a_study_file_in_the_current_folder_runs_on_other_executors(tmp_path, executor):
    if executor == "ray":
        pytest.importorskip("ray")
    d = _project(tmp_path, f"myproj_h8b_{executor}")
    mod = f"myproj_h8b_{executor}"
    toml = own_factories_study_toml("cwd", f"{mod}:build").replace("own_factories:load_data", f"{mod}:load")
    (d / "study.toml").write_text(toml)
    res = _dptune(d, "tune", "study.toml", "--out", "s", "--executor", executor, "--workers", "1", "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    from dptune.tune import study_table

    assert [(r["runs_done"], r["runs_total"]) for r in study_table(d / "s")] == [(2, 2)]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--data", "myproj_h8c:patients", "--model", "myproj_h8c:build"],
            "your data factory 'myproj_h8c:patients' raised FileNotFoundError: [Errno 2] No such file or "
            "directory: '/data/secret/patients.csv'",
        ),
        (
            ["--data", "myproj_h8c:load", "--model", "myproj_h8c:broken"],
            "your model factory 'myproj_h8c:broken' raised RuntimeError: no GPU kernel for this layer",
        ),
    ],
)
def test_an_exception_of_your_factory_is_one_line_naming_it(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(_project(tmp_path, "myproj_h8c"))
    res = invoke_train(tmp_path / "r.json", data=args, epochs="1", batch_size="40", hps=["lr=0.5"])
    assert res.exit_code == 2, res.output
    assert needle in " ".join(res.output.split()) and "Traceback" not in res.output


def test_call_factory_names_options_the_factory_does_not_take(tmp_path, monkeypatch):
    monkeypatch.chdir(_project(tmp_path, "myproj_h8d"))
    fn = import_factory("myproj_h8d:build")
    with pytest.raises(
        ConfigError, match="your model factory 'myproj_h8d:build': got an unexpected keyword argument 'depth'"
    ):
        call_factory(fn, "myproj_h8d:build", "model factory", input_dim=6, classes=3, depth=2)
    assert isinstance(call_factory(fn, "myproj_h8d:build", "model factory", input_dim=6, classes=3), torch.nn.Module)


def test_a_class_of_yours_gets_reload_code_that_runs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_project(tmp_path, "myproj_h8e")))
    monkeypatch.chdir(tmp_path)
    from myproj_h8e import Net  # type: ignore[import-not-found]

    x = torch.randn(60, 6)
    res = dptune.train(Net(), (x, x[:, :3].argmax(1)), "dpsgd", steps=2, expected_batch_size=20, noise_multiplier=1.0)
    dptune.save_model(res, "net")
    load = json.loads((tmp_path / "net" / "model_card.json").read_text())["load"]
    assert "from myproj_h8e import Net" in load and "model=Net()" in load
    ns: dict[str, object] = {}
    exec(load, ns)
    assert torch.equal(ns["model"].fc.weight, res.model_with("final").fc.weight)  # type: ignore[attr-defined]
