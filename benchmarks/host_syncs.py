"""Where one training run waits for the GPU: host syncs per step and the GPU's busy fraction.

    python benchmarks/host_syncs.py --device cuda              # galli_cnn, nodp / dpsgd / oso
    python benchmarks/host_syncs.py --device cpu --steps 3     # the pipeline only (no syncs to count)

A study keeps a GPU busy with several runs side by side; one run alone is only as fast as its
host lets it queue kernels. Each host sync (a ``.item()``, ``bool(tensor)``, a copy to the host)
empties the queue. For each strategy this runs ``dptune.train`` for ``--steps`` steps on
synthetic data of the model's shape (Poisson batches, the real gateway), and reports:

* the host syncs per step, by source line (``torch.cuda.set_sync_debug_mode('warn')``: a lower
  bound, since it does not see implicit driver syncs such as ``cudaFree``);
* the wall time per step, and the GPU kernels' total time per step (``torch.profiler``, device
  events only), whose ratio is how busy one run keeps the GPU.

``--src OTHER/src`` measures another checkout's dptune in the same process set-up (A/B runs on
one machine: compare timings only between runs of one call).

Warm-up (the first steps: the ghost self-check, lazy initialisation) is excluded by running
``--warmup`` steps first, and every measurement covers steps 2 … T of its run (``on_step``), so
set-up and the final accounting are left out.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import batch_for, build_model, check_device, machine, table  # noqa: E402

HP: dict[str, dict[str, Any]] = {
    "nodp": {"lr": 0.05},
    "dpsgd": {"lr": 0.05, "clip": 1.0},
    "oso": {"lr": 0.05, "initial_clip": 0.5},
}


class Window:
    """An ``on_step`` callback that opens a measurement after step 1 and closes it after the
    last step, so that set-up (planning, model copy) and the final accounting are left out.
    ``before_sync`` runs before the closing synchronize (turning sync counting off, so that this
    script's own synchronize is not counted), ``after_sync`` after it (stopping the profiler once
    the kernels have run); ``close`` runs whichever has not run, for a run that stopped early."""

    def __init__(self, steps: int, cuda: bool, opened: Any = None, before_sync: Any = None, after_sync: Any = None):
        self.steps, self.cuda, self.opened = steps, cuda, opened
        self.pending = [before_sync, after_sync]
        self.seconds = float("nan")

    def __call__(self, t: int, row: dict[str, Any]) -> None:
        if t == 1:
            if self.cuda:
                torch.cuda.synchronize()
            if self.opened:
                self.opened()
            self.t0 = time.perf_counter()
        elif t == self.steps:
            self.finish(0)
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.t0
            self.finish(1)

    def finish(self, which: int) -> None:
        fn, self.pending[which] = self.pending[which], None
        if fn is not None:
            fn()

    def close(self) -> None:
        self.finish(0)
        self.finish(1)


def run(args: argparse.Namespace, strategy: str, steps: int, window: Window | None = None) -> None:
    import dptune

    torch.manual_seed(0)
    model = build_model(args.model)
    x, y, loss = batch_for(args.model, args.n)
    try:
        dptune.train(
            model,
            (x.to(args.device), y.to(args.device)),
            strategy,
            steps=steps,
            expected_batch_size=args.batch,
            noise_multiplier=1.0 if strategy != "nodp" else None,
            loss=loss,
            device=args.device,
            eval_every=10**9,
            on_step=window,
            **HP[strategy],
        )
    finally:  # a run that diverged (no step T) must not leave sync counting or the profiler on
        if window is not None:
            window.close()


def kernel_seconds(prof: Any) -> float:
    """The GPU's kernel time in the profile: device events only. An aten op's row also carries
    the time of the kernels it launched, so summing every row would count them twice."""
    cuda = torch.autograd.DeviceType.CUDA
    return 1e-6 * sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if getattr(e, "device_type", None) == cuda and not getattr(e, "is_user_annotation", False)
    )


def measure(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    cuda = torch.device(args.device).type == "cuda"
    window = args.steps - 1  # steps 2 .. T
    run(args, strategy, args.warmup)
    timing = Window(args.steps, cuda)
    run(args, strategy, args.steps, timing)
    wall = timing.seconds / window
    syncs: collections.Counter[str] = collections.Counter()
    gpu = float("nan")
    if cuda:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            on, off = (lambda: torch.cuda.set_sync_debug_mode("warn")), (lambda: torch.cuda.set_sync_debug_mode(0))
            run(args, strategy, args.steps, Window(args.steps, cuda, opened=on, before_sync=off))
        for item in got:
            if "synchroniz" in str(item.message):
                syncs[f"{Path(item.filename).name}:{item.lineno}"] += 1
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        prof = torch.profiler.profile(activities=acts)
        run(args, strategy, args.steps, Window(args.steps, cuda, opened=prof.start, after_sync=prof.stop))
        gpu = kernel_seconds(prof) / window
    top = ", ".join(f"{k} ×{v / window:.3g}" for k, v in syncs.most_common(6))
    return {
        "strategy": strategy,
        "ms/step (wall)": 1e3 * wall,
        "GPU kernels ms/step": 1e3 * gpu,
        "GPU busy": gpu / wall if cuda else float("nan"),
        "host syncs/step (lower bound)": sum(syncs.values()) / window if cuda else float("nan"),
        "top sync sites (per step)": top or "—",
    }


def commit(where: Path) -> str:
    """The git commit of the checkout that holds ``where`` ("unknown" outside one)."""
    try:
        cmd = ["git", "-C", str(where), "describe", "--always", "--dirty"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="galli_cnn")
    p.add_argument("--strategies", nargs="+", default=list(HP), choices=list(HP))
    p.add_argument("--n", type=int, default=8192, help="synthetic training examples")
    p.add_argument("--batch", type=int, default=512, help="expected batch size (Poisson)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--src", type=Path, default=None, help="measure the dptune in this src/ folder (A/B runs)")
    args = p.parse_args()
    check_device(args.device)
    if args.src is not None:  # before dptune is first imported (common.py put this checkout's src first)
        sys.path.insert(0, str(args.src.resolve()))
    import dptune

    pkg = Path(dptune.__file__).parent
    where = f"{machine(args.device)}; dptune from {pkg}, commit {commit(pkg)}"
    print(f"# host syncs: {where}; {args.model}, n = {args.n}, batch {args.batch}, {args.steps} steps")
    rows = []
    for strategy in args.strategies:
        try:
            rows.append(measure(args, strategy))
        except Exception as exc:  # report and go on: one device call should bring back what it can
            print(f"  {strategy}: failed ({type(exc).__name__}: {exc})")
    if not rows:
        raise SystemExit("every strategy failed")
    print(table(rows, list(rows[0])))
    if args.json:
        args.json.write_text(json.dumps({"machine": where, "model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
