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


def test_a_pool_broken_by_a_killed_worker_runs_the_next_round() -> None:
    """Found in review: the round after a worker was killed crashed with BrokenProcessPool (a traceback);
    the killed round's runs fail, and the next round runs on a new pool."""
    from dptune.tune.executors import ProcessExecutor

    ex = ProcessExecutor(workers=1)
    try:
        first = list(ex.run(_exit_if, [("a", (3,))]))
        assert first[0][0] == "a" and first[0][1] is None and "worker process failed" in first[0][2]
        assert sorted(ex.run(_exit_if, [("b", (0,)), ("c", (0,))]), key=lambda r: r[0]) == [  # completion order
            ("b", {"ok": True}, None),
            ("c", {"ok": True}, None),
        ]
    finally:
        ex.close()
