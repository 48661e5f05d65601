"""Ray is an optional extra (``dptune[ray]``): without it, executor 'ray' is one clear line naming
the install command, before any study directory is made; the other executors do not need it."""

from __future__ import annotations

import sys
import tomllib

import pytest
from conftest import ROOT
from tune_helpers import own_factories_study_toml
from typer.testing import CliRunner

from dptune.cli import app
from dptune.errors import ConfigError
from dptune.tune.executors import make_executor

STUDY = own_factories_study_toml("no-ray")


@pytest.fixture
def no_ray(monkeypatch):
    """``import ray`` fails as it does where the extra is not installed (None in sys.modules)."""
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError):
        import ray  # noqa: F401


def test_ray_executor_without_ray_names_the_extra(no_ray):
    with pytest.raises(ConfigError) as exc:
        make_executor("ray")
    msg = str(exc.value)
    assert "pip install 'dptune[ray]'" in msg and "Fix:" in msg
    assert make_executor("local").name == "local"  # the others do not need Ray


def test_cli_tune_executor_ray_without_ray_is_one_line_and_no_directory(no_ray, tmp_path):
    cfg = tmp_path / "study.toml"
    cfg.write_text(STUDY)
    out = tmp_path / "study"
    res = CliRunner().invoke(app, ["tune", str(cfg), "--out", str(out), "--executor", "ray", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "pip install 'dptune[ray]'" in res.output
    assert "Traceback" not in res.output
    assert not out.exists()  # refused before the study directory is made


def test_ray_is_an_extra_and_ci_installs_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.split(">")[0].split("[")[0].strip() == "ray" for dep in project["dependencies"])
    assert any(dep.startswith("ray") for dep in project["optional-dependencies"]["ray"])
    # CI installs the extra, so the Ray tests (skipped without Ray) run there.
    assert "ray" in (ROOT / ".ci" / "run").read_text().split("-e '.[", 1)[1].split("]'", 1)[0].split(",")


@pytest.mark.parametrize("command", ["tune", "resume", "reproduce"])
def test_help_names_the_extra(command):
    # Rich markup would eat an unescaped "[ray]": the help must show the command as typed.
    res = CliRunner().invoke(app, [command, "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "pip install 'dptune[ray]'" in res.output
