"""A study on a real 2-node Ray cluster on loopback: the worker node is killed mid-study, the study
is resumed, and it equals the local executor's (runs, table, budget: nothing lost, nothing spent twice).

Loopback: Ray rewrites 127.0.0.1 (and ``localhost``) to the machine's outward address, which a
sandbox may not route (``Failed to connect to Ray cluster at 192.0.2.2:6390``); any other loopback
address (127.0.0.2, 127.0.0.3: all of 127/8 is loopback on Linux) is kept as given. docs/tuning.md."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_tune_ray import _runs
from tune_helpers import tiny_dpsgd_study

from dptune.tune import SelectionSpec, Study, budget_rows, run_study, study_table
from dptune.tune.store import Store

pytest.importorskip("ray")
HERE = Path(__file__).resolve().parent
HEAD, WORKER = "127.0.0.2", "127.0.0.3"


def study() -> Study:
    """8 runs, one task each (``trials_per_group = 1``), long enough for the kill to land mid-study."""
    return tiny_dpsgd_study(
        data_seed=3, n=400, dim=8, n_train=300, lrs=[0.1, 0.3, 1.0, 3.0], steps=800, batch=40, eps=2.0,
        selection=SelectionSpec(mode="private", split="holdout", eval_every=50, noise_multiplier=30.0),
        seeds=(0, 1), name="ray-cluster", trials_per_group=1,
    )  # fmt: skip


def _node(env: dict, *args: str) -> subprocess.Popen:
    """``ray start --block`` in its own session: ended by its process group, not ``ray stop``
    (which would end every Ray on the machine)."""
    common = ["--num-cpus=1", "--object-store-memory=80000000", "--disable-usage-stats", "--block"]
    return subprocess.Popen(["ray", "start", *args, *common], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def _stop(node: subprocess.Popen) -> None:
    if node.poll() is None:
        os.killpg(node.pid, signal.SIGKILL)
    node.wait(timeout=30)


def _listening(port: int, head: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.skip(f"`ray start --head` cannot run here: {head.stderr.read().decode()[-400:]}")
        with socket.socket() as s:
            if s.connect_ex((HEAD, port)) == 0:
                return
        time.sleep(0.5)
    pytest.skip(f"`ray start --head --node-ip-address={HEAD}` did not listen within {timeout:.0f} s")


def _last_json(out: str) -> dict:
    """The driver's last JSON line (Ray may print its own log lines, some starting with '[')."""
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _planned(study_dir: Path) -> bool:
    try:
        with Store(study_dir, readonly=True) as st:
            return sum(st.counts().values()) > 0
    except Exception:  # not planned yet
        return False


@pytest.mark.slow
def test_worker_node_killed_mid_study_then_resumed(tmp_path):
    local = run_study(study(), tmp_path / "local", executor="local", progress=False)
    with socket.socket() as s:
        s.bind((HEAD, 0))
        port = s.getsockname()[1]
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    temp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's Unix sockets live under it
    address, study_dir = f"{HEAD}:{port}", tmp_path / "ray"
    head = _node(env, "--head", f"--node-ip-address={HEAD}", f"--port={port}", f"--temp-dir={temp}",
                 "--include-dashboard=false")  # fmt: skip
    worker = None
    try:
        _listening(port, head)
        worker = _node(env, f"--address={address}", f"--node-ip-address={WORKER}")
        driver = [sys.executable, str(HERE / "ray_cluster_driver.py"), address, str(study_dir)]
        first = subprocess.Popen([*driver, "run"], env=env, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while first.poll() is None and time.monotonic() < deadline:  # kill the worker node once runs are under way
            if _planned(study_dir):
                time.sleep(3.0)  # the worker node has imported dptune and taken tasks (runs of 800 steps)
                break
            time.sleep(0.05)
        _stop(worker)
        out, _ = first.communicate(timeout=300)
        after_kill = _last_json(out)
        resumed = subprocess.run([*driver, "resume"], env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        final = _last_json(resumed.stdout)
    finally:
        for node in (worker, head):
            if node is not None:
                _stop(node)
        shutil.rmtree(temp, ignore_errors=True)
    print("after the worker node was killed:", after_kill["counts"], "resumed:", final["counts"])
    assert after_kill["counts"].get("done", 0) < 8  # the kill landed mid-study
    assert final["complete"] and final["ledger"], final
    assert sum(final["counts"].values()) == sum(local.counts.values()), (after_kill, final)
    assert _runs(tmp_path / "local") == _runs(study_dir)  # same seeds: bit-identical runs
    assert study_table(tmp_path / "local") == study_table(study_dir)
    assert budget_rows(tmp_path / "local") == budget_rows(study_dir)  # nothing spent twice
