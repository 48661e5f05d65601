"""``benchmarks/gpu_batch_sweep.py`` on the CPU: both sides run, every cell has its row, the
table reads the ratios it was given (the GPU numbers come from the same code: docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_batch_sweep.py"


@pytest.mark.slow  # two subprocesses that import torch and dptune: ~15 s on an idle 2-core machine
def test_the_sweep_times_every_cell_of_both_sides(tmp_path) -> None:
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "mlp", "--batches", "8", "16"]
    cmd += ["--rounds", "1", "--no-opacus", "--baseline-src", str(ROOT / "src"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    got = {(r["side"], r["config"], r["batch"]) for r in rows}
    for side, suffix in (("new", ""), ("baseline", " (baseline)")):
        for cfg in ("torch", "dpsgd/ghost", "oso/ghost"):
            assert {(side, cfg + suffix, b) for b in (8, 16)} <= got
    for r in rows:
        assert r["ms/step"] > 0 and abs(r["samples/s"] * r["ms/step"] / 1e3 - r["batch"]) < 1e-6 * r["batch"]
    plain = {(r["side"], r["batch"]): r["ms/step"] for r in rows if r["config"].startswith("torch")}
    for r in rows:
        assert abs(r["vs plain"] - plain[r["side"], r["batch"]] / r["ms/step"]) < 1e-9
    dp = next(r for r in rows if r["config"] == "oso/ghost (baseline)" and r["batch"] == 16)
    assert "| mlp | oso/ghost (baseline) | " in done.stdout and f"{dp['vs plain']:.2f} |" in done.stdout
