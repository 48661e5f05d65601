"""A private step inside your own, hand-written training loop (Opacus's ``make_private`` pattern).

    python examples/private_step_in_your_loop.py                 # digits (embedded), ε = 3, OSO's C + Adam
    python examples/private_step_in_your_loop.py --epochs 1      # a few seconds

Your loop keeps what is yours: the model, a torch optimizer and its learning-rate schedule,
logging, evaluation on data you may look at, early stopping, saving. dptune supplies three
things, and only these touch private data:

* ``private.batches()``: the planned Poisson batches (the sampling the accountant assumes),
  drawn by index from your dataset;
* ``private.backward(x, y)``: the privatizer's released gradient in each ``p.grad``
  (per-example gradients, clipping and noise stay inside dptune);
* the ledger: ``private.epsilon()`` is what the executed steps spent.

The privatizer here is OSO's online clipping threshold (Galli et al. 2024): no C to tune,
and it composes with any optimizer. Swap in ``FixedClip(1.0)`` or ``QuantileClip()``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dptune
import dptune.data
from dptune.release.privatizers import OSOClip


def small_cnn(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),
        nn.Tanh(),
        nn.Linear(32, classes),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    out = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return out


def main(
    epochs: float = 15.0,
    epsilon: float = 3.0,
    batch: int = 128,
    lr: float = 0.01,
    seed: int = 0,
    save: str | Path | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    data = dptune.data.load("digits")  # 1,438 training and 359 test images, embedded: no download
    torch.manual_seed(seed)
    model = small_cnn(data.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    private = dptune.make_private(
        model,
        (data.x_train, data.y_train),
        optimizer,
        privatizer=OSOClip(initial_clip=0.5, clip_lr=0.05),
        target_epsilon=epsilon,
        delta=1e-5,
        epochs=epochs,
        expected_batch_size=batch,
        seed=seed,
        device="cpu",
    )
    # Yours: a cosine schedule over the planned steps (the plan fixes T up front).
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=private.steps)
    if verbose:
        print(
            f"plan: T = {private.steps} steps, q = {private.plan.sampling_rate:.4f}, "
            f"ν = {private.plan.noise_multiplier:.3f}, ε = {epsilon} at δ = 1e-5"
        )

    curve = []
    for x, y in private.batches():
        optimizer.zero_grad()
        row = private.backward(x, y)  # p.grad ← (Σ clip_C(g_i) + noise) / L; row: step, C_t, g̃ᵀq̃
        optimizer.step()
        schedule.step()
        if row["step"] % max(1, private.steps // 5) == 0 or row["step"] == private.steps:
            acc = accuracy(model, data.x_test, data.y_test)  # the test split, assumed public
            curve.append((row["step"], acc, row["clip"]))
            if verbose:
                print(f"step {row['step']:4d}  C_t = {row['clip']:.3f}  test accuracy = {acc:.3f}")

    spent = private.epsilon()
    out = {
        "steps": private.steps,
        "epsilon": spent,
        "test_accuracy": curve[-1][1],
        "curve": curve,
        "clips": [r["clip"] for r in private.history],
        "releases": private.ledger.releases,
    }
    if save is not None:
        folder = dptune.save_model(private.result(), save, model_id={"class": "examples.small_cnn"})
        reloaded, card = dptune.load_model(folder, model=small_cnn(data.num_classes))
        out["reloaded_accuracy"] = accuracy(reloaded, data.x_test, data.y_test)
        out["card"] = card
    if verbose:
        print(
            f"spent ε = {spent:.3f} (δ = 1e-5) in {private.ledger.releases} releases; "
            f"final test accuracy {out['test_accuracy']:.3f}"
        )
    assert math.isfinite(spent)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=float, default=15.0)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="folder for the model and its card")
    a = ap.parse_args()
    main(a.epochs, a.epsilon, a.batch, a.lr, a.seed, a.save)
