"""Poisson sampling (and full batch), matching what the accountant assumes.

Each step, every example is included independently with probability q = L/n.
The realised batch size varies (it can be 0); sums are normalised by the
*expected* batch size L, never the realised one, because the realised size is
itself private. Full batch is q = 1.
"""

from __future__ import annotations

import numpy as np
import torch

from dptune.errors import ConfigError


def stream_seed(seed: int, stream: str) -> int:
    """Independent 63-bit seeds for the named random streams of one run (sampling, noise, ...)."""
    tag = [ord(c) for c in stream]
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *tag]).generate_state(2, dtype=np.uint64)[0] >> 1)


class PoissonSampler:
    """Draws index sets with Poisson sampling at rate q from ``n`` examples."""

    def __init__(self, n: int, sampling_rate: float, seed: int):
        if n <= 0:
            raise ConfigError(f"the training set is empty (n = {n}); provide at least one example.")
        if not (0 < sampling_rate <= 1):
            raise ConfigError(
                f"sampling rate q must lie in (0, 1], got {sampling_rate}. Use an expected batch "
                f"size between 1 and n = {n}."
            )
        self.n = n
        self.q = float(sampling_rate)
        self.generator = torch.Generator().manual_seed(stream_seed(seed, "sampling"))

    @property
    def expected_batch_size(self) -> float:
        return self.q * self.n

    @property
    def full_batch(self) -> bool:
        return self.q >= 1.0

    def sample(self) -> torch.Tensor:
        if self.full_batch:
            return torch.arange(self.n)
        mask = torch.rand(self.n, generator=self.generator) < self.q
        return mask.nonzero().squeeze(1)

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def sampling_rate_for(n: int, expected_batch_size: float | None, full_batch: bool = False) -> float:
    if full_batch or expected_batch_size is None:
        return 1.0
    if not (0 < expected_batch_size <= n):
        raise ConfigError(
            f"expected batch size must lie in (0, n = {n}], got {expected_batch_size}. "
            "Use full_batch=True for q = 1."
        )
    return float(expected_batch_size) / n


def steps_for_epochs(epochs: float, sampling_rate: float) -> int:
    """T = ceil(epochs / q): an epoch is n/L expected steps."""
    if epochs <= 0:
        raise ConfigError(f"epochs must be > 0, got {epochs}")
    return max(1, int(np.ceil(epochs / sampling_rate - 1e-9)))
