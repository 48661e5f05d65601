"""The ``Dataset`` container and the deterministic split helpers shared by all loaders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from dptune.errors import ConfigError

Task = Literal["classification", "reconstruction"]


@dataclass(frozen=True, eq=False, repr=False)
class Dataset:
    """A loaded, preprocessed dataset: float32 features, int64 labels (``y_train is x_train`` and
    ``num_classes`` None for reconstruction); ``notes``: preprocessing, each example mapped alone."""

    name: str
    x_train: torch.Tensor | dict[str, torch.Tensor]  # a dict: representation='tokens'
    y_train: torch.Tensor
    x_test: torch.Tensor | dict[str, torch.Tensor]
    y_test: torch.Tensor
    task: Task
    num_classes: int | None
    input_shape: tuple[int, ...]
    notes: str
    class_names: tuple[str, ...] | None = None
    files: tuple[str, ...] = ()

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.y_test.shape[0])

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, task={self.task!r}, n_train={self.n_train}, n_test={self.n_test}, "
            f"input_shape={self.input_shape}, num_classes={self.num_classes})"
        )


def check_fraction(test_fraction: float) -> float:
    if not 0.0 < float(test_fraction) < 1.0:
        raise ConfigError(f"test_fraction={test_fraction!r} must lie strictly between 0 and 1.")
    return float(test_fraction)


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded train/test partition of ``range(n)``: ``round(n * test_fraction)`` test rows, both sorted."""
    test_fraction = check_fraction(test_fraction)
    n_test = int(round(n * test_fraction))
    if n_test == 0 or n_test == n:
        raise ConfigError(
            f"test_fraction={test_fraction} of {n} examples leaves an empty split; "
            "use more examples (limit=) or another test_fraction."
        )
    perm = np.random.default_rng([seed, 0]).permutation(n)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def subset_indices(n: int, limit: int | None, seed: int, salt: int = 0) -> np.ndarray:
    """Indices of a seeded random subset of at most ``limit`` of ``n`` examples (sorted)."""
    if limit is None or limit >= n:
        return np.arange(n)
    if int(limit) < 1:
        raise ConfigError(f"limit={limit!r} must be a positive number of examples (or None).")
    return np.sort(np.random.default_rng([seed, 1, salt]).choice(n, size=int(limit), replace=False))


def labels_tensor(y: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(y, dtype=np.int64))


def features_tensor(x: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(x, dtype=np.float32))
