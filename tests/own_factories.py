"""A user's own model and data, imported as ``own_factories:make_model`` / ``own_factories:load_data``
by the CLI and study tests (tests/cli/test_factory_cli.py): the module:factory contract."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

import dptune


class Points(Dataset):
    """A map-style dataset that builds each example on access (nothing is held as one tensor)."""

    def __init__(self, n: int, seed: int, dim: int = 6):
        self.n, self.seed, self.dim = n, seed, dim
        g = torch.Generator().manual_seed(1234)
        self.w = torch.randn(dim, 3, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + int(i))
        x = torch.randn(self.dim, generator=g)
        return x, (x @ self.w).argmax()


def load_data(n: int = 240, n_test: int = 80) -> tuple[Dataset, Dataset]:
    return Points(n, seed=1), Points(n_test, seed=2)


class TwoLayer(nn.Module):
    def __init__(self, input_dim: int, classes: int, hidden: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(input_dim, hidden), nn.Tanh(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_model(input_dim: int = 6, classes: int = 3, hidden: int = 8) -> nn.Module:
    return TwoLayer(input_dim, classes, hidden)


NOT_CALLABLE = 3


def _correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(1) == y).double()


# Your own selection metrics, named in a study as "own_factories:ACCURACY" (selection.metric).
ACCURACY = dptune.Metric(_correct, higher_is_better=True, sensitivity=1.0, name="my_accuracy")
NO_SENSITIVITY = dptune.Metric(_correct, higher_is_better=True, name="my_accuracy_unbounded")


def explode(**_: object) -> nn.Module:
    """A model factory that fails (tests of how a failure is reported)."""
    raise RuntimeError("factory exploded")
