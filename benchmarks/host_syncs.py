"""Where one training run waits for the GPU: host syncs per step and the GPU's busy fraction.

    python benchmarks/host_syncs.py --device cuda              # galli_cnn, nodp / dpsgd / oso
    python benchmarks/host_syncs.py --device cpu --steps 3     # the pipeline only (no syncs to count)

A study keeps a GPU busy with several runs side by side; one run alone is only as fast as its
host lets it queue kernels. Each host sync (a ``.item()``, ``bool(tensor)``, a copy to the host)
empties the queue. For each strategy this runs ``dptune.train`` for ``--steps`` steps on
synthetic data of the model's shape (Poisson batches, the real gateway), and reports:

* the host syncs per step, by source line (``torch.cuda.set_sync_debug_mode('warn')``);
* the wall time per step, and the GPU kernels' total time per step (``torch.profiler``), whose
  ratio is how busy one run keeps the GPU.

Warm-up (the first steps: the ghost self-check, lazy initialisation) is excluded by running
``--warmup`` steps first, and every measurement covers steps 2 … T of its run (``on_step``), so
set-up and the final accounting are left out.
"""

from __future__ import annotations

import argparse
import collections
import json
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
    """Callbacks for ``on_step`` that open a measurement after step 1 and close it after the last
    step, so that set-up (planning, model copy) and the final accounting are left out."""

    def __init__(self, steps: int, cuda: bool, opened: Any = None, closed: Any = None) -> None:
        self.steps, self.cuda, self.opened, self.closed = steps, cuda, opened, closed
        self.seconds = float("nan")

    def __call__(self, t: int, row: dict[str, Any]) -> None:
        if t == 1:
            if self.cuda:
                torch.cuda.synchronize()
            if self.opened:
                self.opened()
            self.t0 = time.perf_counter()
        elif t == self.steps:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.t0
            if self.closed:
                self.closed()


def run(args: argparse.Namespace, strategy: str, steps: int, on_step: Any = None) -> None:
    import dptune

    torch.manual_seed(0)
    model = build_model(args.model)
    x, y, loss = batch_for(args.model, args.n)
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
        on_step=on_step,
        **HP[strategy],
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
            w = Window(
                args.steps,
                cuda,
                lambda: torch.cuda.set_sync_debug_mode("warn"),
                lambda: torch.cuda.set_sync_debug_mode(0),
            )
            run(args, strategy, args.steps, w)
        for item in got:
            if "synchroniz" in str(item.message):
                syncs[f"{Path(item.filename).name}:{item.lineno}"] += 1
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        prof = torch.profiler.profile(activities=acts)
        run(args, strategy, args.steps, Window(args.steps, cuda, prof.start, prof.stop))
        times = (
            getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in prof.key_averages()
        )
        kernel_us = sum(t for t in times if t > 0)
        gpu = kernel_us * 1e-6 / window
    top = ", ".join(f"{k} ×{v / window:.2g}" for k, v in syncs.most_common(6))
    return {
        "strategy": strategy,
        "ms/step (wall)": 1e3 * wall,
        "GPU kernels ms/step": 1e3 * gpu,
        "GPU busy": gpu / wall if cuda else float("nan"),
        "host syncs/step": sum(syncs.values()) / window if cuda else float("nan"),
        "top sync sites (per step)": top or "—",
    }


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
    args = p.parse_args()
    check_device(args.device)
    print(f"# host syncs: {machine(args.device)}; {args.model}, n = {args.n}, batch {args.batch}, {args.steps} steps")
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
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
