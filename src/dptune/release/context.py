"""What one private step sees: the run's public facts (``RunInfo``) and the step's inputs
(``StepContext``), shared by privatizers, update rules and strategies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dptune.gradients.oracle import GradientOracle, PerSampleGrads
from dptune.release.mechanisms import NoisyRelease
from dptune.tree import Tensors


@dataclass(frozen=True)
class RunInfo:
    """What a strategy may know about its run (all public)."""

    noise_multiplier: float  # joint per-release ν (inf for non-private)
    sampling_rate: float  # q
    expected_batch_size: float  # L = q·n
    steps: int  # T
    num_params: int  # d


@dataclass
class StepContext:
    """One iteration's inputs. ``grads`` is computed lazily at the current parameters.

    Only privatizers read it: an update rule sees the released values, never this context."""

    t: int  # 1-based iteration
    x: Any  # a tensor, or a tuple/dict of tensors (dptune.inputs)
    y: torch.Tensor
    oracle: GradientOracle
    release: NoisyRelease | None
    run: RunInfo
    _grads: PerSampleGrads | None = None

    def grads(self, params: Tensors) -> PerSampleGrads:
        if self._grads is None:
            self._grads = self.oracle(params, self.x, self.y)
        return self._grads

    @property
    def computed_grads(self) -> PerSampleGrads | None:
        """The per-sample gradients if ``grads`` computed them during the step, else None (a
        strategy that never asked for them): for the loop's history, without computing them."""
        return self._grads

    @property
    def batch_size(self) -> int:
        return int(self.y.shape[0])
