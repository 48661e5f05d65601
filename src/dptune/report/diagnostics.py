"""Non-private diagnostics for figures: the clipping bias/noise trade-off (Galli Fig. 1). They read raw
data, for the owner's eyes only; nothing is released or recorded in a ledger. The Gaussian draws go through
``NoiseSource`` only so that no second noise generator exists: they *simulate* the mechanism."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dptune.errors import ConfigError
from dptune.gradients.oracle import GradientOracle
from dptune.release.mechanisms import NoiseSource
from dptune.release.privatizers import clip_weights
from dptune.release.sampling import PoissonSampler, stream_seed
from dptune.tree import Tensors


@dataclass(frozen=True)
class CosineResult:
    """Mean and std (over ``repeats`` realizations) of the cosine similarity per iteration and C."""

    clips: tuple[float, ...]
    iterations: tuple[int, ...]
    mean: Mapping[int, tuple[float, ...]]
    std: Mapping[int, tuple[float, ...]]
    noise_multiplier: float
    expected_batch_size: float
    repeats: int

    def to_rows(self) -> list[dict[str, float]]:
        """Long format (iteration, clip, cosine_mean, cosine_std), e.g. for a CSV."""
        return [
            {"iteration": t, "clip": c, "cosine_mean": m, "cosine_std": s}
            for t in self.iterations
            for c, m, s in zip(self.clips, self.mean[t], self.std[t], strict=True)
        ]


def _flat(tree: Tensors, names: Sequence[str]) -> torch.Tensor:
    return torch.cat([tree[k].reshape(-1).double() for k in names])


def cosine_vs_clip(
    model: nn.Module,
    data: tuple[torch.Tensor, torch.Tensor] | Any,
    params_at_iterations: Mapping[int, Tensors],
    clips: Sequence[float],
    noise_multiplier: float,
    expected_batch_size: float,
    repeats: int = 20,
    seed: int = 0,
    *,
    loss: str | None = None,
    chunk_size: int | None = None,
) -> CosineResult:
    """Cosine similarity between the sanitized and the true mean gradient, per C and iteration (Galli
    et al. 2024, Fig. 1; docs/reports.md). NON-PRIVATE DIAGNOSTIC: never publish it as a DP result. Every C
    of a realization shares the batch and the draw z (noise = ν·C·z), so the curve over C is smooth."""
    x, y, clip_list, nu, batch = _checked(data, clips, noise_multiplier, expected_batch_size, repeats)
    n = int(x.shape[0])
    if not params_at_iterations:
        raise ConfigError("params_at_iterations is empty: give {iteration: parameters} for at least one iteration.")
    if loss is None:
        loss = "mse" if (x.shape == y.shape and y.dtype.is_floating_point) else "cross_entropy"

    oracle = GradientOracle(model, loss, chunk_size=chunk_size)
    names = oracle.param_names
    sampler = PoissonSampler(n, batch / n, stream_seed(seed, "cosine-batches"))
    noise = NoiseSource(stream_seed(seed, "cosine-noise"))
    iterations = tuple(sorted(int(t) for t in params_at_iterations))
    mean: dict[int, tuple[float, ...]] = {}
    std: dict[int, tuple[float, ...]] = {}
    for t in iterations:
        params = {k: v.detach() for k, v in params_at_iterations[t].items()}
        if missing := [k for k in names if k not in params]:
            raise ConfigError(f"parameters for iteration {t} lack {missing}; pass the model's named_parameters().")
        # The oracle may run autograd itself (ghost norms): call it with grad mode on.
        grads = oracle(params, x, y)
        with torch.no_grad():
            true = _flat(grads.weighted_sum(torch.full((n,), 1.0 / n, device=y.device)), names)
            true_norm = float(true.norm())
            if true_norm == 0.0:
                raise ConfigError(f"the true mean gradient at iteration {t} is zero; cosine similarity is undefined.")
            norms = grads.norms
            values = torch.empty(repeats, len(clip_list), dtype=torch.float64)
            for r in range(repeats):
                mask = torch.zeros(n, device=y.device)  # the data's device (a GPU's)
                mask[sampler.sample()] = 1.0
                z = noise.normal(true, 1.0)  # one standard normal draw shared by every C
                for j, c in enumerate(clip_list):
                    s = _flat(grads.weighted_sum(clip_weights(norms, c) * mask), names)
                    g_tilde = (s + (nu * c) * z) / batch
                    denom = float(g_tilde.norm()) * true_norm
                    values[r, j] = float(g_tilde @ true) / denom if denom > 0 else math.nan
        mean[t] = tuple(float(v) for v in values.mean(0))
        std[t] = tuple(float(v) for v in (values.std(0) if repeats > 1 else torch.zeros(len(clip_list))))
    return CosineResult(tuple(clip_list), iterations, mean, std, nu, batch, repeats)


def _checked(
    data: Any, clips: Sequence[float], noise_multiplier: float, expected_batch_size: float, repeats: int
) -> tuple[torch.Tensor, torch.Tensor, list[float], float, float]:
    """``cosine_vs_clip``'s arguments checked: (x, y, clips, ν, expected batch size L)."""
    if hasattr(data, "x_train"):
        x, y = data.x_train, data.y_train
    elif isinstance(data, Sequence) and len(data) == 2:
        x, y = data
    else:
        raise ConfigError("data must be a pair (x, y) of tensors or a dptune.data.Dataset.")
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ConfigError(f"x and y must be non-empty and of equal length (got {x.shape[0]} and {y.shape[0]}).")
    clip_list = [_positive(c, "each clip C") for c in clips]
    if not clip_list:
        raise ConfigError("cosine_vs_clip needs at least one clipping threshold in clips, e.g. [0.01, 0.1, 1, 10].")
    nu = float(noise_multiplier)
    if not (math.isfinite(nu) and nu >= 0):
        raise ConfigError(f"noise_multiplier must be finite and ≥ 0 (0: clipping bias only), got {noise_multiplier!r}.")
    batch = _positive(expected_batch_size, "expected_batch_size")
    if batch > x.shape[0]:
        raise ConfigError(
            f"expected_batch_size = {batch:g} exceeds the {x.shape[0]} examples given; use at most n (full batch)."
        )
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an integer ≥ 1, got {repeats!r}.")
    return x, y, clip_list, nu, batch


def _positive(v: Any, name: str) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} must be a number > 0, got {v!r}.") from e
    if not (math.isfinite(f) and f > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {v!r}.")
    return f
