"""The host's time per DP step outside the CUDA graphs, measured on the CPU: what bounds a small model's
step on a GPU, where the forward/backward/norms and the weighted sums are graph replays.

On the CPU a "replay" is made a no-op after its capture (the static outputs stay those of the captured
step), so each step times only what the host does around the graphs: sampling, the batch copy, the
non-finite check, the gateway (ledger, noise), the update rule, the loop's book-keeping. A model of
``--depth`` Linear(6, 6) + Tanh blocks has 2·depth + 2 tensors (a transformer has ~100: depth 50).

    python benchmarks/host_time.py --depth 1 50
    python benchmarks/host_time.py --src OTHER/src     # another checkout's dptune (A/B: alternate runs)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path


def child(depth: int, strategy: str, steps: int) -> float:
    import torch
    from torch import nn

    import dptune
    from dptune.gradients import graphed, norm_bounds

    graphed.replayable = lambda device: True  # the GPU's path (at any batch size) ...
    graphed.MAX_PADDING = float("inf")
    norm_bounds.fast_fp64 = lambda device: True
    graphed.capture = lambda fn, pool: fn() or (lambda: None)  # ... whose replays cost the host nothing
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    x, y = torch.randn(4000, 6), torch.randint(0, 3, (4000,))
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(6, 6), nn.Tanh())], nn.Linear(6, 3))
    stamps: list[float] = []
    dptune.train(model, (x, y), strategy, steps=steps, noise_multiplier=1.0, expected_batch_size=48,
                 grad_method="ghost", on_step=lambda i, row: stamps.append(time.perf_counter()), seed=1)  # fmt: skip
    gaps = sorted(b - a for a, b in zip(stamps[20:], stamps[21:], strict=False))
    return 1e3 * gaps[len(gaps) // 5]  # 20th percentile: the step without the VM's interruptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, nargs="+", default=[1, 50])
    ap.add_argument("--strategies", nargs="+", default=["dpsgd", "oso", "dpadam", "quantile"])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(child(int(args._child[0]), args._child[1], int(args._child[2])))
        return
    print("| tensors | " + " | ".join(args.strategies) + " |\n|---|" + "---|" * len(args.strategies))
    for depth in args.depth:
        cells = []
        for name in args.strategies:
            cmd = [sys.executable, __file__, "--_child", str(depth), name, str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": args.src})
            cells.append(f"{float(out.stdout.strip().splitlines()[-1]):.2f} ms")
        print(f"| {2 * depth + 2} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
