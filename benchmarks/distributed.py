"""One private run on 1 process and on 2 data-parallel processes (``dptune.train(distributed=True)``).

    python benchmarks/distributed.py                                   # CPU, gloo, 1 vs 2 processes
    python benchmarks/distributed.py --device cuda --backend nccl --json out.json
    python benchmarks/distributed.py --device cuda --backend gloo      # where NCCL refuses 2 ranks on 1 GPU

Each configuration starts fresh processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_*),
trains an MLP (784-256-10, n = 6,000, expected batch 512, DP-SGD) for a warm-up run and then
``--steps`` steps, and reports per step: the wall time of rank 0 and the CPU seconds of each rank
(``time.process_time``: on a shared machine, the work each rank did, undistorted by waiting). Two
processes on 2 shared CPU cores are NOT a speed claim: they show the work split and the cost of the
collectives (two broadcasts for the batch, one all-reduce of the clipped sums, one broadcast of the
noise per step). Prints a markdown table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(device: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import dptune
    from dptune.distributed import join

    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        join(device)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6000, 784, generator=g), torch.randint(0, 10, (6000,), generator=g)

    def run(t: int) -> None:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        dptune.train(net, (x, y), "dpsgd", steps=t, expected_batch_size=512, noise_multiplier=1.0,
                     device=device, seed=1, distributed=world > 1)  # fmt: skip
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    run(3)  # warm-up: imports, allocator, the oracle's probe
    w0, c0 = time.perf_counter(), time.process_time()
    run(steps)
    wall, cpu = (time.perf_counter() - w0) / steps, (time.process_time() - c0) / steps
    cpus = [cpu] * world
    if world > 1:
        dist.all_gather_object(cpus, cpu)
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps({"processes": world, "wall_s_per_step": wall, "cpu_s_per_step": cpus}))
    if world > 1:
        dist.destroy_process_group()


def launch(n: int, device: str, backend: str, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
           "DPTUNE_DIST_BACKEND": backend, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, __file__, "--worker", "--device", device, "--steps", str(steps), "--out", out]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)]
    if any(p.wait(timeout=600) for p in procs):
        raise SystemExit(f"{n} processes on {device} ({backend}) failed: see their output above")
    row = json.loads(Path(out).read_text())
    os.unlink(out)
    return {**row, "device": device, "backend": backend if n > 1 else "-"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo", help="gloo (CPU; CUDA through the host) or nccl")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.device, a.steps, a.out)
    t0 = time.perf_counter()
    rows = [launch(n, a.device, a.backend, a.steps) for n in (1, 2)]
    for r in rows:
        r["samples_per_s"] = 512 / r["wall_s_per_step"]
        r["cpu_s_per_step_all_ranks"] = sum(r["cpu_s_per_step"])
    print(f"DP-SGD, MLP 784-256-10, expected batch 512, {a.steps} steps ({time.perf_counter() - t0:.0f} s in all)\n")
    cols = ["processes", "device", "backend", "wall_s_per_step", "samples_per_s", "cpu_s_per_step_all_ranks"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import table

    print(table(rows, cols))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
