"""Fast start: ``dptune --help`` and friends must not import torch (5-8 s of start-up before).

Each check runs a fresh interpreter (this test process has long imported torch) and looks at
``sys.modules``: a deterministic guard, unlike a wall-clock limit on a shared CI machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from conftest import ROOT
from typer.testing import CliRunner

import dptune
from dptune.cli import app

SRC = Path(dptune.__file__).resolve().parents[1]  # the dptune actually under test
HEAVY = ("torch", "scipy", "dp_accounting", "ray", "matplotlib", "sklearn", "pandas", "mlxtend")

# Runs the CLI with argv and, even when it exits, prints which heavy modules got imported.
RUN_CLI = f"""
import sys
try:
    from dptune.cli import app
    app(sys.argv[1:], prog_name="dptune")
finally:
    print("HEAVY=" + ",".join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def _heavy_loaded(proc: subprocess.CompletedProcess[str]) -> set[str]:
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY=")]
    assert line, proc.stderr
    return {m for m in line[-1].removeprefix("HEAVY=").split(",") if m}


def test_import_cli_imports_no_heavy_module():
    proc = _python(f"import sys, dptune.cli; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["calibrate", "--help"],
        ["train", "--help"],
        ["tune", "--help"],
        ["account", "--help"],
    ],
)
def test_help_and_version_import_no_heavy_module(argv):
    proc = _python(RUN_CLI, *argv)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert _heavy_loaded(proc) == set()


def test_account_does_not_import_torch():
    # dp_accounting (and so scipy) is what ε needs; torch is not.
    proc = _python(
        RUN_CLI,
        "account",
        "--noise-multiplier",
        "1.1",
        "--sampling-rate",
        "0.01",
        "--steps",
        "1000",
    )
    assert proc.returncode == 0, proc.stderr
    assert "1.51538" in proc.stdout  # the PLD ε of this event, rounded up
    loaded = _heavy_loaded(proc)
    assert "dp_accounting" in loaded  # the probe sees imports: its "nothing" above means something
    assert "torch" not in loaded


def test_import_dptune_is_lazy_and_the_api_resolves():
    code = """
import sys
import dptune
assert "torch" not in sys.modules, "import dptune imported torch"
assert dptune.accounting.__name__ == "dptune.accounting"  # a submodule, as when imports were eager
import dptune.train  # the submodule must not shadow the function of the same name
from dptune import train, make_private, ConfigError, models
assert callable(dptune.train) and dptune.train is train and train.__module__ == "dptune.train"
assert callable(make_private) and issubclass(ConfigError, Exception) and models.__name__ == "dptune.models"
missing = [n for n in dptune.__all__ if getattr(dptune, n, None) is None]
assert not missing, missing
assert set(dptune.__all__) <= set(dir(dptune))
try:
    dptune.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("unknown attribute did not raise")
print("ok")
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_star_import_gives_every_public_name():
    ns: dict[str, object] = {}
    exec("from dptune import *", ns)
    assert set(dptune.__all__) <= set(ns)
    assert ns["train"] is dptune.train and callable(ns["train"])


def test_version_option():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    try:
        expected = version("dptune")
    except PackageNotFoundError:
        expected = dptune.__version__
    assert res.output == f"dptune {expected}\n"


def test_version_in_source_matches_pyproject():
    # The fallback of --version (a source tree that is not installed) and model cards use it.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert dptune.__version__ == project["version"]


def test_the_tree_is_ruff_formatted_and_lint_clean() -> None:
    """ruff format (line length 120) and ruff check hold for the whole tree, as pre-commit keeps them."""
    import shutil
    import subprocess

    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is in the dev extra")
    root = ROOT
    dirs = ["src", "tests", "benchmarks", "examples"]
    fmt = subprocess.run([ruff, "format", "--check", *dirs], cwd=root, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout[-3000:]
    lint = subprocess.run([ruff, "check", *dirs], cwd=root, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout[-3000:]
