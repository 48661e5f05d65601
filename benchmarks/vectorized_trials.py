"""K vectorised trials (``dptune.vectorized.train_many``) against K sequential ``dptune.train`` runs.

    python benchmarks/vectorized_trials.py --quick      # a couple of minutes on 2 cores
    python benchmarks/vectorized_trials.py              # K = 49, 40 steps, three models
    python benchmarks/vectorized_trials.py --models galli_cnn --trials 25 --seq-trials 5 \
        --n 6000 --batch 64 --steps 4 --clock cpu --threads 1          # the stacked CNN on a CPU
    python benchmarks/vectorized_trials.py --models galli_cnn --trials 25 --seq-trials 5 \
        --batch 256 --steps 20 --device cuda --json out.json           # the same on a GPU (< 60 s)

A 7 × 7 grid (learning rate × clipping threshold, DP-SGD; or OSO's ρ₀ × C₀) of K = 49
trials, each with its own seed, on synthetic data of the paper's shapes: Galli's BoW FC
(750 → 128 → 128 → 4, n = 120,000 like AG News) and Mohapatra's LR and TLNN on
MNIST-shaped data (784 → 10, 784 → 100 → 10, n = 60,000), and the Galli CNN (Conv2d, MaxPool,
Conv2d, two Linear layers; 1×28×28 inputs, n = 60,000; ``--models galli_cnn``); expected batch 512; one
evaluation on 2,000 held-out examples at the end. Throughput = trained examples per
second over all trials. The sequential baseline is timed on ``--seq-trials`` of the K
trials (each trial is independent, so examples/s is the same for any subset); it runs
with the default gradient path (ghost), and with ``--vmap`` also with the vmap path.
Rounds alternate vectorised and sequential so load from other processes hits both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CLOCKS, build_model, check_device, device_sync, machine, table  # noqa: E402

from dptune.gradients.oracle import default_method  # noqa: E402
from dptune.train import train  # noqa: E402
from dptune.vectorized import train_many  # noqa: E402

SHAPES = {  # name: (input dim, hidden widths, classes, n)
    "galli_bow_fc": (750, (128, 128), 4, 120_000),
    "logistic_regression": (784, (), 10, 60_000),
    "two_layer_nn": (784, (100,), 10, 60_000),
    "galli_cnn": (784, (), 10, 60_000),  # inputs reshaped to 1×28×28
}
DENSE = ["galli_bow_fc", "logistic_regression", "two_layer_nn"]


def model_fn(name: str):
    d, hidden, k, _ = SHAPES[name]
    if name == "galli_cnn":
        return lambda seed: build_model("galli_cnn", seed)

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        prev = d
        act = nn.LeakyReLU if name == "galli_bow_fc" else nn.ReLU
        for h in hidden:
            layers += [nn.Linear(prev, h), act()]
            prev = h
        layers.append(nn.Linear(prev, k))
        return nn.Sequential(*layers)

    return build


def data_for(name: str, n: int | None = None):
    d, _, k, n_default = SHAPES[name]
    n = n or n_default
    g = torch.Generator().manual_seed(0)
    w = torch.randn(d, k, generator=g)
    x = torch.randn(n + 2000, d, generator=g)
    y = (x @ w + 2.0 * torch.randn(n + 2000, k, generator=g)).argmax(1)
    if name == "galli_cnn":
        x = x.view(-1, 1, 28, 28)
    return (x[:n], y[:n]), (x[n:], y[n:])


def grid(strategy: str, K: int) -> list[dict]:
    side = round(K**0.5)
    lrs = [0.02 * 2**i for i in range(side)]
    clips = [0.05 * 2**i for i in range(side)]
    if strategy == "oso":
        cfgs = [{"lr": lr, "initial_clip": c} for lr in lrs for c in clips]
    else:
        cfgs = [{"lr": lr, "clip": c} for lr in lrs for c in clips]
    return (cfgs * (K // len(cfgs) + 1))[:K]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DENSE, choices=list(SHAPES))
    ap.add_argument("--strategy", default="dpsgd", choices=["dpsgd", "oso", "quantile", "adamwosm", "nodp"])
    ap.add_argument("--trials", type=int, default=49)
    ap.add_argument("--seq-trials", type=int, default=49, help="sequential trials timed (throughput per example)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--device", default="cpu", help="torch device of every trial, e.g. cuda")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--n", type=int, default=None, help="training set size (default: the dataset's)")
    ap.add_argument("--vmap", action="store_true", help="also time sequential runs on the vmap path")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (busy machine)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--quick", action="store_true", help="K = 49, 10 steps, 7 sequential trials, BoW FC and LR")
    ap.add_argument("--profile", action="store_true", help="then one vectorised call under torch.profiler: top ops")
    args = ap.parse_args()
    check_device(args.device)
    sync = device_sync(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.seq_trials = 10, 7
        args.models = [m for m in args.models if m != "two_layer_nn"]
    print(f"# vectorised trials: {machine(args.device)}")
    rows = []
    for name in args.models:
        train_data, eval_data = data_for(name, args.n)
        K, S = args.trials, min(args.seq_trials, args.trials)
        cfgs = grid(args.strategy, K)
        seeds = list(range(K))
        nu = None if args.strategy == "nodp" else 1.0
        common = dict(
            steps=args.steps,
            expected_batch_size=args.batch,
            eval_data=eval_data,
            eval_every=args.steps,
            device=args.device,
        )
        fn = model_fn(name)
        times: dict[str, list[float]] = {"vectorised": [], "sequential (ghost)": []}
        if args.vmap:
            times["sequential (vmap)"] = []
        now = CLOCKS[args.clock]
        for _ in range(args.rounds):
            t0 = now()
            train_many(fn, train_data, args.strategy, cfgs, seeds, noise_multiplier=nu, fallback="error", **common)
            sync()
            times["vectorised"].append((now() - t0) / K)
            for label in [k for k in times if k.startswith("sequential")]:
                method = "vmap" if "vmap" in label else "auto"
                t0 = now()
                with default_method(method):
                    for k in range(S):
                        train(
                            fn(seeds[k]),
                            train_data,
                            args.strategy,
                            seed=seeds[k],
                            noise_multiplier=nu,
                            **common,
                            **cfgs[k],
                        )
                sync()
                times[label].append((now() - t0) / S)
        if args.profile:
            profile_call(partial(train_many, fn, train_data, args.strategy, cfgs, seeds, noise_multiplier=nu, **common))
        per_trial = {k: statistics.median(v) for k, v in times.items()}
        base = per_trial["sequential (ghost)"]
        print(
            f"\n{name}: {args.strategy}, K = {K}, {args.steps} steps, batch {args.batch} "
            f"(sequential timed on {S} trials), {args.clock} time, median over {args.rounds} round(s)"
        )
        for label, t in per_trial.items():
            sps = args.steps * args.batch / t
            row = {"model": name, "mode": label, "s/trial": t, "examples/s": sps, "vs sequential (ghost)": base / t}
            rows.append(row)
            print(f"  {label:22s} {t:8.3f} s/trial  {sps:10.0f} examples/s  {base / t:6.2f}x")
    print("\n" + table(rows, ["model", "mode", "s/trial", "examples/s", "vs sequential (ghost)"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(args.device), "args": vars(args), "rows": rows}))


def profile_call(call) -> None:
    """Where a vectorised call's time goes: the top operations by device (CUDA) or host self time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
