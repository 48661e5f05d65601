"""The tuner end to end: a grid study with vectorised groups against one run per task.

    python benchmarks/tuner_groups.py --quick          # ~2 minutes on 2 cores
    python benchmarks/tuner_groups.py                   # LR, TLNN and BoW FC, 2 rounds

A DP-SGD grid (lr × C, ``--grid`` × ``--grid``, one seed, per-grid budget ε = 3, RDP) on
synthetic data of the papers' shapes (MNIST-shaped 784 → 10 for Mohapatra's LR/TLNN,
750 → 4 for Galli's BoW FC), expected batch 512, public selection on 2,000 held-out examples
every 50 steps. The same study runs with ``study.trials_per_group = 1`` (each run its own task)
and ``= --group`` (runs trained together by ``dptune.train_many``), both on the local
executor with one torch thread, in alternating rounds. Prints the wall and CPU time of the
whole ``run_study`` call (planning, training, checkpoint scoring, store) and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, table  # noqa: E402

from dptune.tune import (  # noqa: E402
    BudgetSpec,
    MethodSpec,
    SelectionSpec,
    StrategyArm,
    Study,
    TrainingSpec,
    run_study,
)

SHAPES = {
    "logistic_regression": (784, 10, 60_000),
    "two_layer_nn": (784, 10, 60_000),
    "galli_bow_fc": (750, 4, 120_000),
}


def study_for(model: str, grid: int, steps: int, n: int | None) -> Study:
    d, k, n_default = SHAPES[model]
    n = n or n_default
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n + 2000, d, generator=g)
    y = (x @ torch.randn(d, k, generator=g) + 2.0 * torch.randn(n + 2000, k, generator=g)).argmax(1)
    lrs = [0.05 * 2**i for i in range(grid)]
    clips = [0.1 * 2**i for i in range(grid)]
    return Study(  # the model's input_dim and classes come from the data
        data=(x[:n], y[:n], x[n:], y[n:]),
        model=model,
        strategies=(StrategyArm("dpsgd", space={"lr": lrs, "clip": clips}),),
        training=TrainingSpec(steps=steps, expected_batch_size=512),
        budget=BudgetSpec(epsilon=(3.0,), delta=1e-5, accountant="rdp"),
        method=MethodSpec("grid"),
        selection=SelectionSpec(eval_every=50),
        seeds=(0,),
        name=f"bench-{model}",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--grid", type=int, default=5, help="grid side: grid² runs")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="LR and TLNN, 4 × 4 grid, 50 steps, 1 round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.models, args.grid, args.steps, args.rounds = ["logistic_regression", "two_layer_nn"], 4, 50, 1
    print(f"# tuner groups: {machine()}")
    rows = []
    for model in args.models:
        base = study_for(model, args.grid, args.steps, args.n)
        times: dict[int, list[tuple[float, float]]] = {1: [], args.group: []}
        for _ in range(args.rounds):
            for group in times:
                study = dataclasses.replace(base, trials_per_group=group)
                with tempfile.TemporaryDirectory() as tmp:
                    w0, c0 = time.perf_counter(), time.process_time()
                    out = run_study(study, Path(tmp) / "s", progress=False)
                    times[group].append((time.perf_counter() - w0, time.process_time() - c0))
                    assert out.complete and out.ledger_matches_plan
        ref_w = statistics.median(w for w, _ in times[1])
        ref_c = statistics.median(c for _, c in times[1])
        for group, ts in times.items():
            w, c = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
            rows.append(
                {
                    "model": model,
                    "runs": args.grid**2,
                    "trials_per_group": group,
                    "wall s": w,
                    "cpu s": c,
                    "speed-up (wall)": ref_w / w,
                    "speed-up (cpu)": ref_c / c,
                }
            )
            print(
                f"  {model:20s} group {group:3d}: {w:7.1f} s wall  {c:7.1f} s cpu  {ref_w / w:5.2f}x / {ref_c / c:5.2f}x"
            )
    print(
        "\n"
        + table(rows, ["model", "runs", "trials_per_group", "wall s", "cpu s", "speed-up (wall)", "speed-up (cpu)"])
    )


if __name__ == "__main__":
    main()
