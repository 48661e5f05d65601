"""Where runs execute (local, process, ray): each calls the pure ``worker.execute_task`` (same seeds, same results)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing import connection
from typing import Any

from dptune.devices import gpus_per_task, process_gpu_plan
from dptune.errors import ConfigError
from dptune.study_args import EXECUTORS, check_executor_name, check_workers

Task = tuple[str, tuple[Any, ...]]  # (task id, args of execute_task)
Result = tuple[dict[str, Any] | None, str | None]  # (result, error text)
Outcome = tuple[str, dict[str, Any] | None, str | None]  # (run_id, result, error text)
Fn = Callable[..., dict[str, Any]]


def _call(fn: Fn, args: tuple[Any, ...]) -> Result:
    try:
        return fn(*args), None
    except Exception as exc:  # a failed run is recorded, the study goes on
        return None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"


# Pools report when a worker *starts* a task (not queued): runs are "running" only while a worker has them.
START_POLL_S = 0.2
_STARTED: Any = None  # in a pool worker: the queue its task starts are reported on


def _pool_init(started: Any, counter: Any = None, masks: list[str] | None = None) -> None:
    """Process-pool initializer: the start-report queue; worker k sees only GPU ``masks[k mod n]``."""
    global _STARTED
    _STARTED = started
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the coordinator stops the workers (audit)
    if masks:
        with counter.get_lock():
            k, counter.value = counter.value, counter.value + 1
        os.environ["CUDA_VISIBLE_DEVICES"] = masks[k % len(masks)]


def _die_with_parent() -> None:
    """Linux: a worker gets SIGTERM when the coordinator dies (a SIGKILL left them holding GPUs, found in review)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _pool_call(task_id: str, fn: Fn, args: tuple[Any, ...]) -> Result:
    return _ray_call(_STARTED, (task_id, os.getpid()), fn, args)  # which worker: ProcessExecutor._broken


def _ray_call(started: Any, report: Any, fn: Fn, args: tuple[Any, ...]) -> Result:
    with contextlib.suppress(Exception):  # a lost start report never fails the run (its result marks it)
        started.put(report)
    return _call(fn, args)


class _Starts:
    """A batch's start reports as ``on_start`` calls: at most ``limit`` running, a result's lagging start first."""

    def __init__(self, task_ids: Iterable[str], on_start: Callable[[list[str]], None], limit: int | None):
        self.ids, self.on_start, self.limit = set(task_ids), on_start, limit
        self.started: set[str] = set()
        self.running: set[str] = set()
        self.waiting: list[str] = []

    def reported(self, task_ids: Iterable[str]) -> None:
        self.waiting += [t for t in task_ids if t in self.ids and t not in self.started and t not in self.waiting]
        new = []
        while self.waiting and (self.limit is None or len(self.running) + len(new) < self.limit):
            new.append(self.waiting.pop(0))
        self._start(new)

    def finishing(self, task_id: str) -> None:
        if task_id not in self.started:
            if task_id in self.waiting:
                self.waiting.remove(task_id)
            self._start([task_id])

    def finished(self, task_id: str) -> None:
        self.running.discard(task_id)
        self.reported([])

    def _start(self, new: list[str]) -> None:
        if new:
            self.started.update(new)
            self.running.update(new)
            self.on_start(new)

    def outcomes(self, rid: str, get: Callable[[], Result], died: str) -> Iterator[Outcome]:
        """A finished task's outcome (``died``: what failed when ``get`` raises), started first."""
        self.finishing(rid)
        try:
            res, err = get()
        except Exception as exc:  # the worker process, or the Ray task, died
            res, err = None, f"{died}: {type(exc).__name__}: {exc}"
        yield rid, res, err
        self.finished(rid)


class Executor:
    name = "base"

    def run(
        self,
        fn: Callable[..., dict[str, Any]],
        tasks: list[Task],
        on_start: Callable[[list[str]], None] = lambda ids: None,
    ) -> Iterator[Outcome]:
        """``fn(*args)`` of every task; ``on_start(task_ids)`` as workers take them (before their outcomes, yielded)."""
        raise NotImplementedError

    def close(self, interrupted: bool = False) -> None:
        """Release the workers; ``interrupted``: after a Ctrl-C, without waiting for the runs in flight."""


class LocalExecutor(Executor):
    name = "local"

    def run(self, fn, tasks, on_start=lambda ids: None):
        for rid, args in tasks:
            on_start([rid])
            yield rid, *_call(fn, args)


class ProcessExecutor(Executor):
    """A spawned process pool (a forked CUDA context is unusable); on CUDA, one worker per GPU (process_gpu_plan)."""

    name = "process"

    def __init__(self, workers: int | None = None, device: str | None = None):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("spawn")
        n, self.gpu_masks = process_gpu_plan(device, workers)
        self.workers = n = n or max(1, min(4, os.cpu_count() or 1))
        self.started_queue = ctx.Queue()  # workers report the tasks they start (handed over at spawn)
        init = (self.started_queue, ctx.Value("i", 0), self.gpu_masks) if self.gpu_masks else (self.started_queue,)
        self._new_pool = lambda: ProcessPoolExecutor(n, mp_context=ctx, initializer=_pool_init, initargs=init)
        self.pool, self._dead = self._new_pool(), set[int]()

    def _drain(self, starts: _Starts, pids: dict[str, int]) -> None:
        """The start reports: task id → the pid of the worker that took it (one reader: get() never waits)."""
        new = dict(self.started_queue.get() for _ in iter(self.started_queue.empty, True))
        pids.update(new)
        starts.reported(new)

    def run(self, fn, tasks, on_start=lambda ids: None):
        from concurrent.futures import FIRST_COMPLETED, wait
        from concurrent.futures.process import BrokenProcessPool

        todo: dict[str, Any] = dict(tasks)  # tasks may be an iterator: read once
        pids, breaks = {}, dict.fromkeys(todo, 0)
        starts = _Starts(todo, on_start, self.workers)
        while todo:  # one round per pool: a worker that dies breaks it, and what it did not kill goes on in a new one
            futs = {}
            for rid, args in todo.items():
                with contextlib.suppress(BrokenProcessPool):  # it broke (a worker died, maybe while idle): see below
                    futs[self.pool.submit(_pool_call, rid, fn, args)] = rid
            self._watch()
            pending = set(futs)
            while pending:
                done, pending = wait(pending, timeout=START_POLL_S, return_when=FIRST_COMPLETED)
                self._drain(starts, pids)
                for fut in (f for f in done if not isinstance(f.exception(), BrokenProcessPool)):
                    del todo[futs[fut]]
                    yield from starts.outcomes(futs[fut], fut.result, "worker process failed")
            if todo:
                yield from self._broken(todo, starts, pids, breaks)

    def _broken(self, todo: dict[str, Any], starts: _Starts, pids: dict[str, int], breaks: dict[str, int]):
        """A worker died (not SIGTERMed by the pool, or noted by _watch): its run fails alone (audit: 5 of 6 did), the
        rest go on in a new pool, unless two broke under them with no dead worker's run known (it died unreported)."""
        procs = dict(getattr(self.pool, "_processes", None) or {})
        self.pool.shutdown(wait=True)  # its workers have stopped: their exit codes are known
        self.pool, dead, self._dead = self._new_pool(), self._dead, set()
        self._drain(starts, pids)
        codes = {pid: p.exitcode for pid, p in procs.items() if pid in dead or p.exitcode != -signal.SIGTERM}
        lost = {rid: codes[pid] for rid in todo if (pid := pids.pop(rid, -1)) in codes}
        for rid in list(todo):
            breaks[rid] += not lost
            if rid in lost or breaks[rid] == 2:
                code = lost.get(rid, next(iter(codes.values()), None))
                how = "exit code unknown" if code is None else f"exit code {code}" if code >= 0 else f"signal {-code}"
                why = "while running this run" if rid in lost else "in two pools in a row, this run queued or starting"
                del todo[rid]
                starts.finishing(rid)
                yield rid, None, f"worker process died ({how}) {why}"
                starts.finished(rid)

    def _watch(self) -> None:
        """Note the workers dead before the pool stops the rest (review: a run's own SIGTERM read as the pool's)."""
        for p in (getattr(self.pool, "_processes", None) or {}).values():
            if "terminate" not in vars(p):

                def terminate(p: Any = p, stop: Callable[[], None] = p.terminate) -> None:
                    with contextlib.suppress(ValueError):  # a closed process: none to note
                        if connection.wait([p.sentinel], 0):  # it had exited before the pool stops it
                            self._dead.add(p.pid)
                    stop()

                p.terminate = terminate

    def close(self, interrupted: bool = False) -> None:
        if interrupted:  # a Ctrl-C to this process alone (kill -INT, a notebook): its runs in flight re-run on resume
            for proc in list(getattr(self.pool, "_processes", {}).values()):
                proc.terminate()
        self.pool.shutdown(wait=not interrupted, cancel_futures=True)
        self.started_queue.close()
        self.started_queue.join_thread()


def _local_pythonpath() -> dict[str, Any]:
    """``sys.path`` as local Ray workers' PYTHONPATH: a ``module:factory`` importable here is there too."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    extra = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths + ([extra] if extra else []))}}


RAY_MISSING = (
    "executor 'ray' needs Ray, which is not installed here. Fix: pip install 'dptune[ray]' "
    "(or use executor 'local' or 'process')."
)


def require_ray() -> Any:
    """The ``ray`` module, or one clear ``ConfigError``: Ray is an optional extra (``dptune[ray]``)."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(RAY_MISSING) from exc
    return ray


RAY_PORTS = {"ray": 10001, "": 6379}  # Ray Client (ray://host) and the GCS of `ray start --head`


def check_ray_address(address: str, timeout: float = 3.0) -> None:
    """Refuse, within ``timeout`` s, a Ray address where nothing listens (``ray.init`` retries it for minutes)."""
    if address in ("auto", "local"):  # Ray finds (or starts) the cluster itself
        return
    scheme, _, hostport = address.rpartition("://")
    host, colon, port = hostport.rpartition(":")
    if not colon or "]" in port:  # no port (an IPv6 host alone ends in "]")
        host, port = hostport, str(RAY_PORTS.get(scheme, 6379))
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ConfigError(
            f"Ray address {address!r} is not host:port. Fix: e.g. --address 10.0.0.5:6379 (the "
            "address `ray start --head` prints), or leave it out to start a local Ray."
        )
    import socket

    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"no Ray cluster answers at {address!r} ({exc.strerror or exc}). Fix: start the cluster (`ray start "
            "--head` prints its address), check the host and port, or leave out --address to start a local Ray."
        ) from None


def check_executor(name: str | Executor, address: str | None = None) -> None:
    """Refuse, before a study directory exists, an unknown name, 'ray' not installed, or a Ray address not answering."""
    if isinstance(name, Executor):
        return
    check_executor_name(name, address)
    if name == "ray":
        require_ray()
        if address is not None:  # '' once started a local Ray instead
            check_ray_address(address)


class RayExecutor(Executor):
    """Ray tasks on a small local Ray, or the cluster at ``address``; shuts down only a Ray it started."""

    name = "ray"

    def __init__(
        self,
        workers: int | None = None,
        address: str | None = None,
        device: str | None = None,
        gpus_per_run: float | None = None,
    ):
        self.num_gpus = gpus_per_task(device, gpus_per_run)  # on CUDA: each task asks Ray for GPUs (a GPU node's)
        self.ray = ray = require_ray()
        self.started = False
        self._init: dict[str, Any] | None = None  # how this executor started Ray (restarted on reuse)
        if not ray.is_initialized():
            if address:
                try:
                    ray.init(address=address, include_dashboard=False, log_to_driver=False)
                except ConnectionError as exc:  # a port that answers but is no Ray cluster
                    raise ConfigError(
                        f"no Ray cluster at {address!r} ({exc}). Fix: check the address "
                        "(`ray start --head` prints it), or leave it out to start a local Ray."
                    ) from None
            else:
                cpus = workers or max(1, min(4, os.cpu_count() or 1))
                self._init = {"num_cpus": cpus, "runtime_env": _local_pythonpath(), "include_dashboard": False}
                self._init |= {"log_to_driver": False, "configure_logging": False}
                ray.init(**self._init)
            self.started = True
        self.remote = ray.remote(num_cpus=1, num_gpus=self.num_gpus, max_retries=0)(_ray_call)
        self.started_queue: Any = None

    def _drain(self) -> list[str]:
        if self.started_queue is None:
            return []
        try:
            n = self.started_queue.qsize()
            return list(self.started_queue.get_nowait_batch(n)) if n else []
        except Exception:  # the queue's actor died: stop reporting starts (results still mark them)
            self.started_queue = None
            return []

    def run(self, fn, tasks, on_start=lambda ids: None):
        ray = self.ray
        if self._init is not None and not ray.is_initialized():  # reused after close(): our Ray again
            ray.init(**self._init)
            self.started = True
        if self.started_queue is None:  # an actor: reachable from the tasks on every node
            from ray.util.queue import Queue

            self.started_queue = Queue()
        fn_ref = ray.put(fn)
        pending = {self.remote.remote(self.started_queue, rid, fn_ref, args): rid for rid, args in tasks}
        starts = _Starts(pending.values(), on_start, None)  # a cluster's size varies: no limit
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=START_POLL_S)
            for ref in done:
                yield from starts.outcomes(pending.pop(ref), lambda ref=ref: ray.get(ref), "ray task failed")
            starts.reported(self._drain())

    def close(self, interrupted: bool = False) -> None:
        """Shut down the queue's actor and the Ray this executor started (``run`` can start anew)."""
        queue, self.started_queue = self.started_queue, None
        if queue is not None:
            with contextlib.suppress(Exception):  # already gone with its cluster: nothing to shut down
                queue.shutdown()
        if self.started:
            self.ray.shutdown()
            self.started = False


def make_executor(
    name: str | Executor,
    workers: int | None = None,
    address: str | None = None,
    device: str | None = None,
    gpus_per_run: float | None = None,
) -> Executor:
    """``device``: the runs' device (CUDA runs placed on GPUs); ``gpus_per_run``: Ray's GPUs per task."""
    if isinstance(name, Executor):
        return name
    check_workers(workers)
    if gpus_per_run is not None and name != "ray":
        raise ConfigError(
            f"gpus_per_run is a Ray option; executor {name!r} does not use it. Fix: drop it, "
            "or use executor 'ray' (the process executor takes workers)."
        )
    if name == "local":
        return LocalExecutor()
    if name == "process":
        return ProcessExecutor(workers, device)
    if name == "ray":
        return RayExecutor(workers, address, device, gpus_per_run)
    raise ConfigError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}.")
