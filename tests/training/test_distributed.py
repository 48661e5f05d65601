"""Data-parallel private training on 2 CPU processes (gloo): the same algorithm as one process.

Each test starts two ranks of ``dist_worker.py`` with torchrun's environment and compares what rank 0
wrote with an independent reference: one process's run with the same seed, one process's Poisson
batches, the Gaussian law of one draw (not the sum of two)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import dptune
from dptune.errors import ConfigError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dist_worker  # noqa: E402


def two_ranks(mode: str, tmp_path: Path, timeout: float = 120) -> tuple[dict, list[int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"{mode}.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "DPTUNE_DIST_TIMEOUT": "20", "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "dist_worker.py"), mode, str(out)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )  # fmt: skip
        for r in range(2)
    ]
    codes = [p.wait(timeout=timeout) for p in procs]
    return (json.loads(out.read_text()) if out.exists() else {}), codes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """What rank 0 of one 2-rank start wrote: the trained runs, the batches, the noise."""
    got, codes = two_ranks("all", tmp_path_factory.mktemp("dist"))
    assert codes == [0, 0]
    return got


@pytest.mark.slow
def test_two_ranks_train_like_one_process(ranks):
    """Same batches and noise (rank 0's streams are one process's), sums all-reduced: the final
    parameters, evaluations and ledger of every strategy equal one process's run with the same seed."""
    got, off = ranks["train"], {}
    for name, hps in dist_worker.RUNS.items():
        alone = dptune.train(dist_worker.model(0), dist_worker.data(), name, steps=6, expected_batch_size=40,
                             noise_multiplier=1.3, delta=1e-3, eval_data=dist_worker.data(40), eval_public=True,
                             eval_every=3, seed=11, **hps)  # fmt: skip
        off[name] = max(
            float(np.abs(np.array(got[name]["params"][k]) - v.numpy()).max()) for k, v in alone.final_params.items()
        )
        assert got[name]["ledger"] == json.loads(json.dumps(alone.ledger.to_dict())), name
        assert [e["step"] for e in got[name]["evals"]] == [e["step"] for e in alone.evals]
    assert max(off.values()) < 1e-9, off  # float64: only the reassociation of the all-reduced sums


def test_sharded_batches_are_one_poisson_batch(ranks):
    for step in ranks["batches"]["steps"]:
        assert step["disjoint"] and step["union"] == step["alone"]


def test_noise_is_drawn_once(ranks):
    """2,000 coordinates released with σ = ν·s = 2: N(0, 4), identical on both ranks; noise drawn on each
    rank and summed would have variance 8 (KS and variance both reject that)."""
    got = ranks["noise"]
    assert got["same_on_every_rank"] and got["releases"] == 2
    z = np.array(got["z"])
    assert stats.kstest(z / 2.0, "norm").pvalue > 1e-3
    assert stats.kstest(z / (2.0 * math.sqrt(2)), "norm").pvalue < 1e-6
    assert abs(z.var() / 4.0 - 1) < 0.15


def test_secure_mode_gives_every_rank_the_same_model(ranks):
    assert ranks["secure"]["secure_same_on_every_rank"]


def test_ranks_with_different_plans_models_or_rows_are_refused(ranks):
    """Rows in another order clipped one example on two ranks in a step (2C, accounted as C); a rank with
    another model trained it, or (float64 vs float32) received half the noise vector: refused on every rank."""
    refused = ranks["secure"]["refused"]
    assert "planned different runs" in refused["plan"]
    assert "hold a different training data (its rows, in order)" in refused["rows"]
    assert "hold a different training data (its rows, in order)" in refused["rows_map"]
    assert "hold a different model" in refused["model"]


def test_every_rank_starts_from_rank_0s_buffers_saved_or_not(ranks):
    """A buffer registered with persistent=False was left as each rank drew it (found in review)."""
    assert ranks["secure"]["buffer_same_on_every_rank"]


def test_a_process_group_that_never_forms_is_one_clear_error(tmp_path):
    """WORLD_SIZE=2 set, no other rank: torch's DistStoreError was a traceback (found in review)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "0",
           "LOCAL_RANK": "0", "DPTUNE_DIST_TIMEOUT": "2"}  # fmt: skip
    argv = ["train", "--dataset", "digits", "--epochs", "0.1", "--no-progress", "--out", str(tmp_path / "r.json")]
    res = subprocess.run([sys.executable, "-m", "dptune", *argv], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "the process group did not start" in res.stderr and "Fix: launch every rank with torchrun" in res.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_a_lost_rank_stops_the_run_cleanly(tmp_path):
    got, codes = two_ranks("die", tmp_path, timeout=60)
    assert codes[1] == 3
    assert got["steps"] == 3 and got["releases"] == 3  # step 4 never gathered its sums: nothing recorded
    assert "stopped or timed out" in got["error"] and "Nothing of this step was released" in got["error"]


def test_distributed_without_a_process_group_is_refused(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    x, y = dist_worker.data()
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node"):
        dptune.train(dist_worker.model(0), (x, y), "dpsgd", steps=2, noise_multiplier=1.0, distributed=True)


def test_a_study_under_torchrun_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from dptune.tune import run_study

    with pytest.raises(ConfigError, match="does not run under torchrun"):
        run_study(tmp_path / "missing.toml", tmp_path / "study")
    from dptune.vectorized import train_many

    x, y = dist_worker.data()
    with pytest.raises(ConfigError, match="train_many does not run under torchrun"):
        train_many(dist_worker.model, (x, y), "dpsgd", [{}, {}], steps=2, noise_multiplier=1.0)
    from typer.testing import CliRunner

    from dptune.cli import app

    res = CliRunner().invoke(
        app, ["audit", "--strategy", "dpsgd", "--out", str(tmp_path / "a.json")]
    )  # every rank wrote it
    assert res.exit_code == 2 and "dptune audit does not run under torchrun" in res.output
    assert not (tmp_path / "a.json").exists()


@pytest.mark.slow
def test_dptune_train_under_torchrun_writes_once_what_one_process_writes(tmp_path):
    from cli_helpers import invoke_train

    argv = ["--dataset", "digits", "--strategy", "dpsgd", "--epochs", "0.2", "--batch-size", "64", "--hp", "lr=0.5",
            "--hp", "clip=1.0", "--eval-every", "2", "--no-progress", "--out", str(tmp_path / "two.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DPTUNE_DIST_TIMEOUT": "60"}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dptune"]
    proc = subprocess.run([*run, "train", *argv], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("dptune train: dpsgd on digits") == 1  # rank 0 prints and writes
    assert invoke_train(tmp_path / "one.json").exit_code == 0
    two, one = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("two", "one"))
    for key in ("steps", "noise_multiplier", "epsilon", "best_step", "checkpoint"):
        assert two[key] == one[key], key
    assert two["best_metric"] == pytest.approx(one["best_metric"], abs=0.01)  # float32 sums, reassociated
    assert two["ranks"] == 2 and "rank 0's shard" in two["ranks_note"] and "ranks" not in one


def test_a_process_group_started_without_torchrun_counts_as_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mp.spawn`` + ``init_process_group``: no torchrun variables, yet N ranks; each used to run a whole
    private run of its own (N·ε spent). Such a group now makes train/make_private distributed by default."""
    from dptune import distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert not distributed.launched()
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)
    assert distributed.launched()
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 1)
    assert not distributed.launched()
