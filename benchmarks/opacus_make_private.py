"""Your own loop, side by side: Opacus's ``make_private`` against ``dptune.make_private``.

    python benchmarks/opacus_make_private.py              # digits, ε = 3, 3 seeds (~1 min on 2 cores)
    python benchmarks/opacus_make_private.py --seeds 5 --epochs 30

The same small CNN, the same torch Adam (lr 0.01) and the same hand-written loop on the
embedded digits data (1,438 training images), at the same (ε, δ) = (3, 1e-5), Poisson
sampling with expected batch 128, 15 epochs. Rows:

* ``opacus``: ``PrivacyEngine.make_private_with_epsilon`` (flat clipping C = 1, hooks);
* ``dptune fixed``: ``dptune.make_private(..., privatizer=FixedClip(1.0))``;
* ``dptune oso``: ``privatizer=OSOClip()`` (C learned online; nothing to tune).

It prints the calibrated ν, the ε each library reports after training, the test accuracy
(mean ± std over seeds) and the wall time per run. Needs ``pip install opacus``. The plans
differ slightly: Opacus takes q = 1/len(loader) = 1/12 and T = 15·12 = 180; dptune takes
q = L/n = 128/1438 and T = ⌈15·n/L⌉ = 169 (the same ε = 3 either way).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import torch
from torch import nn

import dptune
import dptune.data
from dptune.release.privatizers import FixedClip, OSOClip


def small_cnn(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, classes),
    )  # fmt: skip


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def run_opacus(data: Any, seed: int, args: argparse.Namespace) -> dict[str, float]:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=args.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's secure-RNG and functorch notices
        engine = PrivacyEngine(accountant="rdp")
        model, opt, loader = engine.make_private_with_epsilon(
            module=model, optimizer=opt, data_loader=loader, target_epsilon=args.epsilon,
            target_delta=1e-5, epochs=args.epochs, max_grad_norm=1.0, poisson_sampling=True,
        )  # fmt: skip
        loss_fn = nn.CrossEntropyLoss()
        start = time.perf_counter()
        for _ in range(args.epochs):
            for x, y in loader:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
        seconds = time.perf_counter() - start
    return {"nu": opt.noise_multiplier, "epsilon": engine.get_epsilon(1e-5), "seconds": seconds,
            "accuracy": accuracy(model._module, data.x_test, data.y_test)}  # fmt: skip


def run_dptune(data: Any, seed: int, args: argparse.Namespace, privatizer: Any) -> dict[str, float]:
    torch.manual_seed(seed)
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    private = dptune.make_private(
        model, (data.x_train, data.y_train), opt, privatizer=privatizer, target_epsilon=args.epsilon,
        delta=1e-5, epochs=args.epochs, expected_batch_size=args.batch, seed=seed, device="cpu",
    )  # fmt: skip
    start = time.perf_counter()
    for x, y in private.batches():
        opt.zero_grad()
        private.backward(x, y)
        opt.step()
    seconds = time.perf_counter() - start
    return {"nu": private.plan.noise_multiplier, "epsilon": private.epsilon(), "seconds": seconds,
            "accuracy": accuracy(model, data.x_test, data.y_test)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()
    data = dptune.data.load("digits")
    rows = {
        "opacus (C = 1)": lambda s: run_opacus(data, s, args),
        "dptune FixedClip(1)": lambda s: run_dptune(data, s, args, FixedClip(1.0)),
        "dptune OSOClip()": lambda s: run_dptune(data, s, args, OSOClip(initial_clip=0.5, clip_lr=0.05)),
    }
    results: dict[str, list[dict[str, float]]] = {k: [] for k in rows}
    for seed in range(args.seeds):  # interleaved: one seed of each row, then the next seed
        for name, fn in rows.items():
            results[name].append(fn(seed))
    print(f"digits, ε = {args.epsilon}, δ = 1e-5, {args.epochs} epochs, L = {args.batch}, Adam lr {args.lr}, "
          f"{args.seeds} seeds")  # fmt: skip
    print(f"{'':22s} {'ν':>7s} {'ε reported':>11s} {'test accuracy':>16s} {'s/run':>7s}")
    for name, rs in results.items():
        acc = [r["accuracy"] for r in rs]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        print(f"{name:22s} {rs[0]['nu']:7.4f} {max(r['epsilon'] for r in rs):11.4f} "
              f"{statistics.mean(acc):9.3f} ± {sd:.3f} {statistics.median(r['seconds'] for r in rs):7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
