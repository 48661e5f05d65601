"""Executors: where runs execute. The budget is planned centrally; executors only run tasks.

* ``local``: sequentially, in this process.
* ``process``: a ``concurrent.futures.ProcessPoolExecutor`` with the *spawn* context
  (fresh interpreters: no forked torch state, same behaviour on every OS); on CUDA one worker
  per visible GPU by default, each pinned to its GPU.
* ``ray``: Ray tasks, on a local Ray started here (``ray.init(num_cpus=workers)``) or on
  an existing cluster (``address``); on CUDA each task requests ``num_gpus`` (``gpus_per_run``).

Every executor calls the same pure function ``worker.execute_task`` (one run, or a group
of runs trained together as vectorised trials) with the same arguments, with torch pinned to ``study.threads_per_run`` threads, so the same seeds
give bit-identical results whichever executor runs them (seeded mode: a ``study.secure`` study
reaches every worker inside its ``Study``, and its OS-CSPRNG draws are not reproducible). Results come back in
completion order; the coordinator makes the outcome independent of that order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from dptune.errors import ConfigError

Task = tuple[str, tuple[Any, ...]]  # (task id, args of execute_task)
Outcome = tuple[str, dict[str, Any] | None, str | None]  # (run_id, result, error text)

EXECUTORS = ("local", "process", "ray")


def _call(fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return fn(*args), None
    except Exception as exc:  # a failed run is recorded, the study goes on
        import traceback

        return None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"


def _remote_call(fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> tuple[dict[str, Any] | None, str | None]:
    return _call(fn, args)


class Executor:
    name = "base"

    def run(self, fn: Callable[..., dict[str, Any]], tasks: list[Task],
            on_start: Callable[[list[str]], None] = lambda ids: None) -> Iterator[Outcome]:
        """Execute ``fn(*args)`` for every task; call ``on_start(run_ids)`` just before runs are
        dispatched (one at a time locally, all at once for pools); yield outcomes as they finish."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalExecutor(Executor):
    name = "local"

    def run(self, fn, tasks, on_start=lambda ids: None):
        for rid, args in tasks:
            on_start([rid])
            res, err = _call(fn, args)
            yield rid, res, err


def _pin_gpu(counter: Any, masks: list[str]) -> None:
    """Process-pool initializer: worker k sees only GPU ``masks[k mod n]`` (set before CUDA starts)."""
    with counter.get_lock():
        k = counter.value
        counter.value += 1
    os.environ["CUDA_VISIBLE_DEVICES"] = masks[k % len(masks)]


class ProcessExecutor(Executor):
    """A spawned process pool (CUDA needs *spawn*: a forked CUDA context is unusable). With
    ``device`` on CUDA, ``devices.process_gpu_plan`` sets the pool size (default one worker per
    visible GPU) and pins each worker to one GPU."""

    name = "process"

    def __init__(self, workers: int | None = None, device: str | None = None):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        from dptune.devices import process_gpu_plan

        ctx = mp.get_context("spawn")
        n, self.gpu_masks = process_gpu_plan(device, workers)
        self.workers = n or max(1, min(4, os.cpu_count() or 1))
        init: dict[str, Any] = {}
        if self.gpu_masks:
            init = {"initializer": _pin_gpu, "initargs": (ctx.Value("i", 0), self.gpu_masks)}
        self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx, **init)

    def run(self, fn, tasks, on_start=lambda ids: None):
        from concurrent.futures import as_completed

        on_start([rid for rid, _ in tasks])
        futs = {self.pool.submit(_remote_call, fn, args): rid for rid, args in tasks}
        for fut in as_completed(futs):
            rid = futs[fut]
            try:
                res, err = fut.result()
            except Exception as exc:  # the worker process died
                res, err = None, f"worker process failed: {type(exc).__name__}: {exc}"
            yield rid, res, err

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _local_pythonpath() -> dict[str, Any]:
    """This interpreter's ``sys.path`` as the local Ray workers' PYTHONPATH: a user's
    ``module:factory`` (a study's [model]/[data] factory) importable here is importable
    there (spawned pool workers get ``sys.path`` from multiprocessing itself). On a cluster
    (``address``) ship the code with Ray's own ``runtime_env`` (docs/tuning.md)."""
    import sys

    paths = [p for p in sys.path if p and os.path.isdir(p)]
    extra = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths + ([extra] if extra else []))}}


class RayExecutor(Executor):
    """Ray tasks. Starts a small local Ray unless ``address`` names an existing cluster;
    shuts down only the Ray it started."""

    name = "ray"

    def __init__(self, workers: int | None = None, address: str | None = None, device: str | None = None,
                 gpus_per_run: float | None = None):
        from dptune.devices import gpus_per_task

        # On CUDA every task asks Ray for GPUs, so a cluster schedules it on a GPU node and Ray
        # sets the task's CUDA_VISIBLE_DEVICES (its "cuda" is then the GPU Ray assigned).
        self.num_gpus = gpus_per_task(device, gpus_per_run)
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - ray is a declared dependency
            raise ConfigError("executor 'ray' needs Ray: pip install 'ray[default]'") from exc
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(num_cpus=workers or max(1, min(4, os.cpu_count() or 1)), include_dashboard=False,
                         log_to_driver=False, configure_logging=False, runtime_env=_local_pythonpath())
            self.started = True
        self.remote = ray.remote(num_cpus=1, num_gpus=self.num_gpus, max_retries=0)(_remote_call)

    def run(self, fn, tasks, on_start=lambda ids: None):
        ray = self.ray
        on_start([rid for rid, _ in tasks])
        fn_ref = ray.put(fn)
        pending = {self.remote.remote(fn_ref, args): rid for rid, args in tasks}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            ref = done[0]
            rid = pending.pop(ref)
            try:
                res, err = ray.get(ref)
            except Exception as exc:  # the task or its worker died
                res, err = None, f"ray task failed: {type(exc).__name__}: {exc}"
            yield rid, res, err

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def make_executor(name: str | Executor, workers: int | None = None, address: str | None = None,
                  device: str | None = None, gpus_per_run: float | None = None) -> Executor:
    """``device``: the runs' training device (places CUDA runs on GPUs); ``gpus_per_run``: Ray's
    GPU share of one task (default 1 on CUDA; only with executor 'ray')."""
    if isinstance(name, Executor):
        return name
    if gpus_per_run is not None and name != "ray":
        raise ConfigError(f"gpus_per_run is a Ray option; executor {name!r} does not use it. Fix: drop it, "
                          "or use executor 'ray' (the process executor takes workers).")
    if name == "local":
        return LocalExecutor()
    if name == "process":
        return ProcessExecutor(workers, device)
    if name == "ray":
        return RayExecutor(workers, address, device, gpus_per_run)
    raise ConfigError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}.")
