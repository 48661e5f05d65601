"""A study of your own model and data from a TOML file, with ``module:factory``.

    python examples/own_model_study.py                       # examples/own_model_study.toml
    python examples/own_model_study.py --n 400 --steps 10    # a few seconds
    PYTHONPATH=examples dptune tune examples/own_model_study.toml   # the same from the CLI

The study file names this module's ``load_data`` and ``make_model`` as
``own_model_study:load_data`` / ``own_model_study:make_model``. dptune imports them when it
reads the file (a wrong path is one clear error, before anything runs) and again in every
worker, so the same study runs on the local, process and Ray executors (local Ray workers get
this interpreter's ``sys.path``; on a cluster, ship the module with Ray's ``runtime_env``).
The factory strings are part of the study's fingerprint. Contracts: docs/your_data.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parent
TOML = HERE / "own_model_study.toml"


class Rings(Dataset):
    """Points on three noisy concentric rings (not linearly separable), made on access."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        y = int(torch.randint(3, (1,), generator=g))
        angle = 2 * torch.pi * torch.rand((), generator=g)
        r = 1.0 + y + 0.25 * torch.randn((), generator=g)
        return torch.stack([r * torch.cos(angle), r * torch.sin(angle)]), torch.tensor(y)


def load_data(n: int = 3000, n_test: int = 600) -> tuple[Dataset, Dataset]:
    """The [data] factory: (train, test) map-style datasets. A study reads them into memory
    (its holdout split hashes each example); ``dptune.train`` reads them by index."""
    return Rings(n, seed=1), Rings(n_test, seed=2)


class RingNet(nn.Module):
    def __init__(self, input_dim: int, classes: int, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(input_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model(input_dim: int, classes: int, hidden: int = 32) -> nn.Module:
    """The [model] factory: dptune passes ``input_dim`` and ``classes`` (from the data) and the
    [model] options; the study seeds torch before each call, so initial weights follow the seed."""
    return RingNet(input_dim, classes, hidden)


def main(
    out: str | Path = "studies/own-model-study",
    n: int | None = None,
    steps: int | None = None,
    executor: str = "local",
    workers: int | None = None,
) -> dict[str, Any]:
    if str(HERE) not in sys.path:  # the factories are imported by name: make this folder importable
        sys.path.insert(0, str(HERE))
    from dptune.tune import load_study_config, run_study
    from dptune.tune.results import study_table
    from dptune.tune.spec import DataSpec, TrainingSpec

    study = load_study_config(TOML)
    if n is not None:  # a smaller run (the test): same code path, fewer examples
        study = dataclasses.replace(
            study, data=DataSpec(factory=study.data.factory, options={"n": n, "n_test": max(n // 5, 50)})
        )
    if steps is not None:
        study = dataclasses.replace(
            study, training=TrainingSpec(steps=steps, expected_batch_size=max((n or 3000) // 10, 8))
        )
        study = dataclasses.replace(
            study, selection=dataclasses.replace(study.selection, eval_every=max(steps // 2, 1))
        )
    run_study(study, out, executor=executor, workers=workers, progress=False)
    table = study_table(out)
    for row in table:
        print(
            f"{row['arm']}: selected {row['selected']}, {row['metric']} {row['value_mean']:.3f} (noisy, "
            f"selection split), test {row['test_mean']}, ε spent {row['spent_epsilon']:.3f} at δ = {row['spent_delta']}"
        )
    return {"table": table, "out": str(out), "fingerprint": study.fingerprint()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="studies/own-model-study")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--executor", default="local", choices=["local", "process", "ray"])
    p.add_argument("--workers", type=int, default=None)
    a = p.parse_args()
    main(a.out, a.n, a.steps, a.executor, a.workers)
