#!/usr/bin/env python
"""SIGKILL a study at random points; after each kill, re-running it must give the uninterrupted study.

    python scripts/kill_test.py                 # 20 random kill points (≈ 3 min on 2 cores)
    python scripts/kill_test.py --points 3      # the reduced version run in CI (tests/cli/test_faults.py)

For each point: start ``run_study`` in a fresh process, SIGKILL it after a random delay drawn
uniformly over the duration of one uninterrupted study (planning, SQLite writes, training,
merging, CSV writing: wherever it lands), then run the same ``run_study`` call again, which
re-opens the store, resets interrupted runs and completes. The result must equal a reference
study run without interruption: the same results table, the same per-run scores, checkpoints
and histories (the same noise is re-drawn), the same ledger (nothing released twice) and a
ledger equal to the plan. Exit status 0 when every point passes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CONFIG = textwrap.dedent("""
    [study]
    name = "kill"
    seeds = [0, 1]

    [data]
    name = "digits"
    options = { flatten = true }

    [model]
    name = "logistic_regression"

    [training]
    steps = 40
    expected_batch_size = 64

    [budget]
    epsilon = 2.0
    delta = 1e-5
    accountant = "rdp"

    [method]
    name = "grid"

    [selection]
    mode = "private"
    split = "holdout"
    eval_every = 20
    noise_multiplier = 30.0

    [[strategies]]
    name = "dpsgd"
    space = { lr = [0.3, 1.0] }
    fixed = { clip = 1.0 }
""")


def _run_code(cfg: Path, study_dir: Path) -> str:
    return f"from dptune.tune import run_study; run_study({str(cfg)!r}, {str(study_dir)!r}, progress=False)"


def _start(cfg: Path, study_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.Popen([sys.executable, "-c", _run_code(cfg, study_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def snapshot(study_dir: Path) -> dict:
    """Everything that must not depend on interruptions (attempt counts and timings excluded)."""
    from dptune.release.ledger import event_to_dict
    from dptune.tune import study_table
    from dptune.tune.store import Store

    with Store(study_dir, readonly=True) as s:
        keep = ("status", "score", "best_step", "test_metric", "evals", "history", "config", "noise_multiplier")
        runs = {r["run_id"]: {k: r[k] for k in keep} for r in s.runs()}
        ledger = sorted(json.dumps([e.run, e.label, event_to_dict(e.event), e.count], sort_keys=True)
                        for e in s.ledger_entries())
    return {"table": study_table(study_dir), "runs": runs, "ledger": ledger}


def kill_and_recover(cfg: Path, study_dir: Path, delay: float) -> str:
    """Kill a study ``delay`` seconds after its start, re-run it; return where the kill landed."""
    from dptune.tune import run_study

    proc = _start(cfg, study_dir)
    try:
        proc.wait(timeout=delay)
        landed = "after completion"
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        landed = "killed"
    if landed == "after completion" and proc.returncode != 0:
        raise RuntimeError(f"the study failed before the kill: {proc.stderr.read().decode()[-2000:]}")
    out = run_study(cfg, study_dir, progress=False)  # the same call again: re-open and finish
    if not (out.complete and out.ledger_matches_plan):
        raise AssertionError(f"after a kill at {delay:.2f} s the study is not complete/equal to its plan: {out.counts}")
    return landed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="dptune-kill-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cfg = work / "kill.toml"
        cfg.write_text(CONFIG)
        t0 = time.perf_counter()
        ref_proc = _start(cfg, work / "reference")
        if ref_proc.wait() != 0:
            print(ref_proc.stderr.read().decode()[-2000:], file=sys.stderr)
            return 2
        duration = time.perf_counter() - t0
        reference = snapshot(work / "reference")
        print(f"reference study: {duration:.1f} s (process start included)", flush=True)
        failures = 0
        for i in range(args.points):
            delay = rng.uniform(0.0, duration)
            d = work / f"killed-{i}"
            try:
                landed = kill_and_recover(cfg, d, delay)
                same = snapshot(d) == reference
            except Exception as exc:  # report every point, then fail
                landed, same = f"error: {exc}", False
            failures += not same
            print(f"point {i + 1:2d}/{args.points}: kill at {delay:5.2f} s ({landed}): "
                  f"{'identical to the reference' if same else 'DIFFERS'}", flush=True)
    print("all points recovered" if not failures else f"{failures} point(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
