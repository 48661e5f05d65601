"""Devices (issue 11, item 5): a named device is validated (never a silent run on the CPU), Ray
tasks request GPUs when runs use CUDA, and the process pool places CUDA workers on GPUs.

No test here needs a GPU: CUDA's presence is monkeypatched, and Ray is given a declared (fake)
GPU resource, ``ray.init(num_gpus=1)``, which it schedules like a real one."""

from __future__ import annotations

import os

import pytest
import torch
from tune_helpers import linear_data, make_study
from typer.testing import CliRunner

from dptune import devices
from dptune.cli import app
from dptune.errors import ConfigError
from dptune.tune import SelectionSpec, TrainingSpec, run_study
from dptune.tune.executors import ProcessExecutor, make_executor


def _study(device: str):
    return make_study(
        linear_data(0, n=60, dim=3, n_train=40),
        fixed={"clip": 1.0},
        training=TrainingSpec(steps=3, expected_batch_size=10, device=device),
        selection=SelectionSpec(mode="public", split="test"),
        name="dev",
    )


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _cuda(monkeypatch, n: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, canon",
    [("cpu", "cpu"), (" CUDA ", "cuda"), ("cuda:1", "cuda:1"), ("mps:0", "mps"), (torch.device("cpu"), "cpu")],
)
def test_device_names_are_canonicalised(name, canon):
    assert devices.check_device_name(name) == canon


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:-1", "cpu:1", "", None, 0, "tpu"])
def test_unknown_device_names_are_one_clear_error(bad):
    with pytest.raises(ConfigError, match=r"Fix: use cpu, cuda, cuda:N or mps|one cpu device"):
        devices.check_device_name(bad)


def test_cuda_without_cuda_is_an_error_not_the_cpu(monkeypatch):
    _no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        devices.resolve_device("cuda")
    assert devices.resolve_device(None) == torch.device("cpu")  # only 'automatic' picks for the user


def test_cuda_index_must_be_visible(monkeypatch):
    _cuda(monkeypatch, 2)
    assert devices.resolve_device("cuda:1") == torch.device("cuda:1")
    assert devices.resolve_device(None) == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"only 2 CUDA device\(s\)"):
        devices.resolve_device("cuda:2")


def test_train_refuses_cuda_without_cuda(monkeypatch):
    # Before: torch moved the data with a torch-internal AssertionError ("Torch not compiled with CUDA").
    import dptune

    _no_cuda(monkeypatch)
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    with pytest.raises(ConfigError, match="CUDA is not available"):
        dptune.train(
            torch.nn.Linear(3, 2), (x, y), "nodp", steps=1, expected_batch_size=5, lr=0.1, device="cuda", progress=False
        )
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        dptune.train(
            torch.nn.Linear(3, 2), (x, y), "nodp", steps=1, expected_batch_size=5, lr=0.1, device="gpu", progress=False
        )


def test_cli_train_refuses_bad_device_before_reading_data(monkeypatch, tmp_path):
    from dptune import data as dpdata

    def no_load(*a, **k):  # the device is checked first: no dataset is even opened
        raise AssertionError("data loaded before the device was checked")

    monkeypatch.setattr(dpdata, "load", no_load)
    _no_cuda(monkeypatch)
    for dev, msg in (("cuda", "CUDA is not available"), ("gpu0", "unknown device")):
        r = CliRunner().invoke(
            app, ["train", "--dataset", "digits", "--device", dev, "--out", str(tmp_path / "r.json")]
        )
        assert r.exit_code != 0 and msg in r.output, r.output
        assert "Traceback" not in r.output
    assert not (tmp_path / "r.json").exists()


def test_study_device_syntax_checked_when_read():
    with pytest.raises(ConfigError, match="training.device: unknown device 'gpu'"):
        TrainingSpec(steps=5, expected_batch_size=10, device="gpu")
    assert TrainingSpec(steps=5, expected_batch_size=10, device="CUDA").device == "cuda"


def test_study_with_cuda_without_cuda_fails_before_any_directory(monkeypatch, tmp_path):
    _no_cuda(monkeypatch)
    study = _study("cuda")
    for ex in ("local", "process", "ray"):
        with pytest.raises(ConfigError, match="CUDA is not available"):
            run_study(study, tmp_path / ex, executor=ex, progress=False)
        assert not (tmp_path / ex).exists()
    with pytest.raises(ConfigError, match="Fix: use device = 'cuda'"):  # Ray assigns the GPU itself
        run_study(_study("cuda:1"), tmp_path / "r1", executor="ray", progress=False)


def test_run_study_hands_the_device_to_the_executor(monkeypatch, tmp_path):
    import dptune.tune.study as st

    _cuda(monkeypatch, 1)
    seen = {}

    class Stop(Exception):
        pass

    def fake(name, workers, address, device=None, gpus_per_run=None):
        seen.update(name=name, device=device, gpus_per_run=gpus_per_run)
        raise Stop

    monkeypatch.setattr(st, "make_executor", fake)
    monkeypatch.setattr(st, "require_ray", lambda: None)  # Ray is an optional extra: not needed here
    study = _study("cuda")
    with pytest.raises(Stop):
        run_study(study, tmp_path / "s", executor="ray", progress=False, gpus_per_run=0.5)
    assert seen == {"name": "ray", "device": "cuda", "gpus_per_run": 0.5}


# -- Ray: GPU requests ---------------------------------------------------------------------------


def test_gpus_per_task_rule():
    assert devices.gpus_per_task("cpu", None) == 0.0
    assert devices.gpus_per_task("cuda", None) == 1.0
    assert devices.gpus_per_task("cuda", 0.25) == 0.25
    assert devices.gpus_per_task("cuda", 2) == 2.0
    for bad in (0, -1, 1.5, True, "half"):
        with pytest.raises(ConfigError, match="gpus_per_run"):
            devices.gpus_per_task("cuda", bad)
    with pytest.raises(ConfigError, match="needs runs on CUDA"):
        devices.gpus_per_task("cpu", 0.5)
    with pytest.raises(ConfigError, match="Ray option"):
        make_executor("process", device="cuda", gpus_per_run=0.5)


@pytest.mark.slow
def test_ray_tasks_request_gpus_only_for_cuda_runs():
    ray = pytest.importorskip("ray")
    from dptune.tune.executors import RayExecutor

    def _probe() -> dict:  # nested: cloudpickle ships it by value (Ray workers cannot import tests/)
        import ray

        return {
            "gpus": list(ray.get_gpu_ids()),
            "mask": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "resources": ray.get_runtime_context().get_assigned_resources(),
        }

    def results(ex):
        out = {rid: (res, err) for rid, res, err in ex.run(_probe, tasks)}
        assert all(err is None for _, err in out.values()), out
        return [res for res, _ in out.values()]

    tasks = [("r0", ())]
    assert not ray.is_initialized()
    # A declared GPU resource: Ray schedules on it like a real GPU (it cannot check it exists).
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        cpu = results(RayExecutor(device="cpu"))
        assert all(r["gpus"] == [] and "GPU" not in r["resources"] for r in cpu), cpu
        gpu = results(RayExecutor(device="cuda"))
        assert all(r["gpus"] == [0] and r["resources"]["GPU"] == 1.0 and r["mask"] == "0" for r in gpu), gpu
        half = results(RayExecutor(device="cuda", gpus_per_run=0.5))
        assert all(r["resources"]["GPU"] == 0.5 for r in half), half
        # Asking for more GPUs than the cluster has is never run on the CPU instead: Ray keeps
        # the task pending (here: infeasible), so nothing comes back.
        ex = RayExecutor(device="cuda", gpus_per_run=2)
        ref = ex.remote.remote(None, "r0", ray.put(_probe), ())  # never runs: no queue needed
        ready, _ = ray.wait([ref], timeout=2.0)
        assert ready == []
        ray.cancel(ref, force=True)
    finally:
        ray.shutdown()


# -- process executor: one GPU shared sensibly --------------------------------------------------


def test_process_gpu_plan(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _cuda(monkeypatch, 1)
    assert devices.process_gpu_plan("cpu", None) == (None, None)
    assert devices.process_gpu_plan("cpu", 3) == (3, None)
    assert devices.process_gpu_plan("cuda", None) == (1, ["0"])  # one GPU: one worker by default
    assert devices.process_gpu_plan("cuda", 3) == (3, ["0", "0", "0"])  # opt-in sharing
    assert devices.process_gpu_plan("cuda:0", None) == (1, None)
    _cuda(monkeypatch, 2)
    assert devices.process_gpu_plan("cuda", None) == (2, ["0", "1"])
    assert devices.process_gpu_plan("cuda", 3) == (3, ["0", "1", "0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # an existing mask names the physical GPUs
    assert devices.process_gpu_plan("cuda", None) == (2, ["5", "7"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        devices.process_gpu_plan("cuda", None)


def _mask(_: int) -> tuple[int, str | None]:
    import time

    time.sleep(0.5)  # keep workers busy so that both get tasks
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_process_workers_are_pinned_to_their_gpu(monkeypatch):
    # Spawned workers read the mask set by the pool's initializer (before CUDA would start).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    _cuda(monkeypatch, 2)
    ex = ProcessExecutor(device="cuda")
    try:
        assert ex.workers == 2 and ex.gpu_masks == ["3", "4"]
        seen: dict[int, str | None] = {}
        for _ in range(5):  # until both workers have answered
            seen.update(f.result() for f in [ex.pool.submit(_mask, i) for i in range(4)])
            if len(seen) == 2:
                break
        assert sorted(seen.values()) == ["3", "4"], seen  # one worker per GPU, each sees only its own
    finally:
        ex.close()
    cpu = ProcessExecutor(workers=2, device="cpu")
    try:
        assert cpu.gpu_masks is None and cpu.workers == 2
    finally:
        cpu.close()
