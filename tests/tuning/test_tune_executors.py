"""The process pool's workers and their coordinator."""

from __future__ import annotations

import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_pool_worker_dies_with_its_coordinator() -> None:
    """A SIGKILLed coordinator left its process-pool workers alive, holding memory and GPUs (found in
    review): a worker now gets SIGTERM when its parent dies."""
    import os
    import subprocess
    import textwrap
    import time

    child = ("from dptune.tune.executors import _die_with_parent; _die_with_parent(); import time; "
             "print('ready', flush=True); time.sleep(60)")  # fmt: skip
    parent = textwrap.dedent(f"""
        import os, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE)
        print(child.pid, child.stdout.readline().decode().strip(), flush=True)
        os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60).stdout
    pid_text, ready = out.split()[:2]
    assert ready == "ready"  # the worker had started (and set its parent-death signal)
    pid = int(pid_text)
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the worker outlived its coordinator")


def _exit_if(code: int) -> dict:
    import os

    if code:
        os._exit(code)  # a worker killed mid-run (SIGKILL, out of memory)
    return {"ok": True}


class _EndsTheWorker:
    """An argument whose unpickling ends its worker (exit code 5) before the worker reports the task's start."""

    def __reduce__(self) -> tuple:
        import os

        return os._exit, (5,)


def test_a_pool_broken_by_a_killed_worker_runs_the_next_round() -> None:
    """Found in review: the round after a worker was killed crashed with BrokenProcessPool (a traceback). A worker
    that dies before naming its run breaks every new pool: its round's runs fail after two (no endless loop), and
    the next round runs on a new pool."""
    from dptune.tune.executors import ProcessExecutor

    ex = ProcessExecutor(workers=1)
    try:
        first = sorted(ex.run(_exit_if, [("a", (_EndsTheWorker(),)), ("b", (0,))]))
        why = "worker process died (exit code 5) in two pools in a row, this run queued or starting"
        assert first == [("a", None, why), ("b", None, why)]
        assert sorted(ex.run(_exit_if, [("b", (0,)), ("c", (0,))]), key=lambda r: r[0]) == [  # completion order
            ("b", {"ok": True}, None),
            ("c", {"ok": True}, None),
        ]
    finally:
        ex.close()


def _work(name: str, exit_code: int = 0, interrupt: bool = False) -> dict:
    import os
    import signal
    import time

    if interrupt:
        os.kill(os.getpid(), signal.SIGINT)  # a terminal's Ctrl-C reaches the workers too
    time.sleep(0.3)  # a run's work: its start is reported before it ends
    if exit_code > 0:
        os._exit(exit_code)
    if exit_code < 0:
        os.kill(os.getpid(), -exit_code)  # as the pool stops the workers that did not die (SIGTERM)
    return {"name": name}


@pytest.mark.parametrize(("code", "how"), [(3, "exit code 3"), (-15, "signal 15")])
def test_a_dead_worker_fails_its_run_alone(code: int, how: str) -> None:
    """Found in an audit: a worker that died (os._exit, the out-of-memory killer) broke the pool, and 5 of 6 runs
    failed with BrokenProcessPool; now its run alone fails, naming the exit code, and the others run in a new pool.
    Found in review: a worker that SIGTERMed itself read as stopped by the pool, and 4 of 5 runs failed."""
    from dptune.tune.executors import ProcessExecutor

    started: list[str] = []
    ex = ProcessExecutor(workers=2)
    try:
        tasks = [(c, (c, code if c == "c" else 0)) for c in "abcdef"]
        out = {rid: (res, err) for rid, res, err in ex.run(_work, tasks, on_start=started.extend)}
    finally:
        ex.close()
    assert out.pop("c") == (None, f"worker process died ({how}) while running this run")
    assert out == {c: ({"name": c}, None) for c in "abdef"}
    assert sorted(started) == list("abcdef")  # each start reported once, a re-run too


def test_a_pool_worker_ignores_ctrl_c() -> None:
    """Found in an audit: a Ctrl-C printed an idle worker's KeyboardInterrupt traceback before the coordinator's
    clean line (here a busy worker's became the coordinator's own KeyboardInterrupt); the coordinator stops them."""
    from dptune.tune.executors import ProcessExecutor

    ex = ProcessExecutor(workers=1)
    try:
        assert list(ex.run(_work, [("a", ("a", 0, True))])) == [("a", {"name": "a"}, None)]
    except KeyboardInterrupt:  # not pytest's: it would end the session
        pytest.fail("a Ctrl-C sent to a worker raised KeyboardInterrupt")
    finally:
        ex.close()
