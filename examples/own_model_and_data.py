"""Your own ``nn.Module`` and map-style ``Dataset`` → ``dptune.train`` → saved model → reloaded.

    python examples/own_model_and_data.py                   # 4,000 examples, 300 steps, ε = 3
    python examples/own_model_and_data.py --n 400 --steps 20  # a few seconds

The dataset is a plain ``torch.utils.data.Dataset`` (``__len__`` and ``__getitem__``): dptune
draws each Poisson batch by index (the sampling its privacy accountant assumes), so the data
need not fit in memory. The model is an ordinary module. ``dptune.save_model`` writes the
final parameters with their model card (the evaluation data is yours, hence private: nothing is
selected on it and its accuracy is for your eyes only; ``eval_public=True`` if it truly is public);
``dptune.load_model`` loads it back in one call. Saving and loading release nothing: the
weights are post-processing of the run's noisy releases (docs/privacy.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import dptune


class Blobs(Dataset):
    """``classes`` Gaussian blobs in ``dim`` dimensions, generated example by example on access
    (a stand-in for data read from disk): item i is always the same pair."""

    def __init__(self, n: int, dim: int = 10, classes: int = 3, seed: int = 0):
        self.n, self.dim, self.classes, self.seed = n, dim, classes, seed
        self.centres = 0.8 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        y = int(torch.randint(self.classes, (1,), generator=g))
        x = self.centres[y] + torch.randn(self.dim, generator=g)
        return x, torch.tensor(y)


class SmallNet(nn.Module):
    """A two-layer perceptron: your own architecture (no BatchNorm: it mixes examples)."""

    def __init__(self, dim: int = 10, hidden: int = 32, classes: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def accuracy(model: nn.Module, data: Dataset) -> float:
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.stack([data[i][1] for i in range(len(data))])
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(
    n: int = 4000, steps: int = 300, epsilon: float = 3.0, out: str | Path = "own-model", seed: int = 0
) -> dict[str, Any]:
    train_data, test_data = Blobs(n, seed=1), Blobs(max(n // 4, 50), seed=2)
    torch.manual_seed(seed)
    net = SmallNet()
    result = dptune.train(
        net,
        train_data,
        "dpsgd",
        steps=steps,
        expected_batch_size=max(n // 20, 8),
        target_epsilon=epsilon,
        delta=1e-5,
        eval_data=test_data,
        eval_every=max(steps // 10, 1),
        lr=0.5,
        clip=1.0,
        momentum=0.0,
        seed=seed,
        device="cpu",
    )
    folder = dptune.save_model(
        result,
        out,
        model_id={"class": "examples.own_model_and_data.SmallNet", "kwargs": {"dim": 10, "hidden": 32, "classes": 3}},
        data_id={"name": "Blobs (synthetic, examples/own_model_and_data.py)"},
    )
    # One call: your module's class is yours, so pass an instance of it (built-in models
    # are rebuilt from the card without it).
    model, card = dptune.load_model(folder, model=SmallNet())
    reloaded = accuracy(model, test_data)
    summary = {
        "epsilon": result.epsilon(),
        "delta": 1e-5,
        "checkpoint": card["checkpoint"],
        "final_accuracy (not DP: for the data owner only)": result.evals[-1]["accuracy"],
        "reloaded_accuracy": reloaded,
        "folder": str(folder),
        "ledger_digest": card["ledger"]["digest"],
    }
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--out", default="own-model")
    a = p.parse_args()
    main(a.n, a.steps, a.epsilon, a.out)
