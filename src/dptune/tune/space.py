"""Search spaces: grids and seeded random draws (``rng_for(study_seed, name)``: planning is a pure function
of the study, never of the data), except Liu–Talwar's and repeat-and-select's, which are secret."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dptune.release.sampling import stream_seed

if TYPE_CHECKING:
    from dptune.tune.theory import SecretCoins

# Run settings that a search space (or a strategy's fixed values) may hold besides hyperparameters.
TRAINING_KEYS = ("steps", "epochs", "expected_batch_size")


def rng_for(study_seed: int, name: str) -> np.random.Generator:
    """An independent generator per named stream of the study (e.g. 'random/dpsgd@1')."""
    return np.random.default_rng(stream_seed(study_seed, name))


def _plain(v: Any) -> Any:
    """numpy scalars → Python scalars (JSON and hashing)."""
    return v.item() if isinstance(v, np.generic) else v


def is_finite(space: Mapping[str, Any]) -> bool:
    return all(not isinstance(v, Mapping) for v in space.values())


def grid(space: Mapping[str, Any]) -> list[dict[str, Any]]:
    """All combinations of the listed values, in a fixed order (keys sorted, values as given)."""
    keys = sorted(space)  # none: the one empty configuration
    values = [list(space[k]) for k in keys]
    return [{k: _plain(v) for k, v in zip(keys, combo, strict=True)} for combo in itertools.product(*values)]


def size(space: Mapping[str, Any]) -> int:
    return math.prod(len(v) for v in space.values()) if space else 1


def small_grid(space: Mapping[str, Any], limit: int = 1000) -> list[dict[str, Any]]:
    """Every candidate of a finite space of at most ``limit``, else none (a secret search checks them before drawing)."""
    return grid(space) if is_finite(space) and size(space) <= limit else []


def draw_value(spec: Any, rng: np.random.Generator | SecretCoins) -> Any:
    if isinstance(spec, Mapping):
        dist, (lo, hi) = next(iter(spec.items()))
        if dist == "uniform":
            return float(rng.uniform(lo, hi))
        if dist == "log_uniform":
            return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        if dist == "int_uniform":
            return int(rng.integers(int(lo), int(hi) + 1))
        if dist == "int_log_uniform":
            return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        raise ValueError(dist)
    seq = list(spec)
    return _plain(seq[int(rng.integers(len(seq)))])


def draw(space: Mapping[str, Any], rng: np.random.Generator | SecretCoins) -> dict[str, Any]:
    """One configuration drawn uniformly, each axis independently (from the grid if all are lists)."""
    return {k: draw_value(space[k], rng) for k in sorted(space)}


def bounds(spec: Any) -> tuple[float, float]:
    """(min, max) of an axis (list or distribution)."""
    if isinstance(spec, Mapping):
        lo, hi = next(iter(spec.values()))
        return float(lo), float(hi)
    vals = [float(v) for v in spec]
    return min(vals), max(vals)


def config_key(config: Mapping[str, Any]) -> str:
    """A stable text key of a configuration (sorted 'k=v' pairs, floats to 4 significant digits)."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(config.items()))
