"""The CLI in a log file and a narrow terminal: ``COLUMNS=60``, stdout and stderr not a TTY.

No line wider than 60 cells, no ``\\r`` (progress bars) and no U+FFFD (a glyph cut in half), in
what ``train``, ``tune``, ``status``, ``report``, ``account``, ``calibrate``, ``reproduce list``
and ``--help`` print; the tuner's progress becomes plain lines; ``tune`` says what may be
published; no internal issue numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TESTS
from rich.cells import cell_len
from tune_helpers import tiny_study_toml

import dptune

SRC = Path(dptune.__file__).resolve().parents[1]
WIDTH = 60


def _cli(*args: str, cwd: Path) -> tuple[str, str]:
    """Run ``dptune ARGS`` with COLUMNS=60, stdout and stderr captured to files (not TTYs)."""
    env = {**os.environ, "COLUMNS": str(WIDTH), "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    env.pop("FORCE_COLOR", None)
    out, err = cwd / "stdout.txt", cwd / "stderr.txt"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.run(
            [sys.executable, "-m", "dptune", *args], stdout=o, stderr=e, env=env, cwd=ROOT, timeout=300
        )
    text, etext = out.read_text("utf-8"), err.read_text("utf-8")
    assert proc.returncode == 0, (args, text, etext)
    return text, etext


def _check_narrow(text: str, what: str) -> None:
    assert "\r" not in text, f"{what}: a \\r progress bar in a log"
    assert "\ufffd" not in text, f"{what}: a cut character"
    wide = [ln for ln in text.splitlines() if cell_len(ln) > WIDTH]
    assert not wide, f"{what}: lines wider than {WIDTH}: {wide}"
    assert not re.search(r"\bissue \d+", text, re.I), f"{what}: an internal issue number"


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("narrow")
    (d / "s.toml").write_text(tiny_study_toml("narrow", lrs=(0.5, 1.0)))
    return d


def test_tune_status_report_fit_60_columns_without_bars(study: Path) -> None:
    out, err = _cli("tune", str(study / "s.toml"), "--out", str(study / "st"), cwd=study)
    _check_narrow(out, "tune stdout")
    _check_narrow(err, "tune stderr")
    # The tuner's progress in a log: one plain line per finished run, no bar.
    assert [ln for ln in err.splitlines() if "runs" in ln] == [
        "narrow: 1/2 runs (dpsgd@eps=2)",
        "narrow: 2/2 runs (dpsgd@eps=2)",
    ]
    flat = " ".join(out.split())
    assert f"publish {study / 'st' / 'release'}/ only" in flat and "is for the data owner" in flat
    # Accuracy as a fraction, as in the CSV and HTML (not "accuracy (%)"); no empty "test" column.
    assert "(%)" not in out and "test:" not in out
    for args in (("status", str(study / "st")), ("report", str(study / "st"))):
        o, e = _cli(*args, cwd=study)
        _check_narrow(o + e, args[0])
        assert "dpsgd@eps=2" in o or args[0] != "status"  # a word is never cut to fit ("dpsgd@eps…")


def test_train_and_tables_fit_60_columns(tmp_path: Path) -> None:
    runs = [
        ("train", "--dataset", "digits", "--strategy", "dpsgd", "--epochs", "0.2", "--batch-size", "64")
        + ("--hp", "lr=0.5", "--out", str(tmp_path / "r.json")),
        ("account", "--noise-multiplier", "1", "--sampling-rate", "0.01", "--steps", "100"),
        ("calibrate", "--epsilon", "3", "--sampling-rate", "0.01", "--steps", "1000", "--runs", "3"),
        ("reproduce", "list"),
        ("--help",),
        ("train", "--help"),
        ("tune", "--help"),
        ("demo", "--help"),
    ]
    for args in runs:
        out, err = _cli(*args, cwd=tmp_path)
        _check_narrow(out, " ".join(args[:2]))
        _check_narrow(err, " ".join(args[:2]) + " (stderr)")
