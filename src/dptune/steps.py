"""What one private step sees and shares: the run's public facts, the step's inputs, checks.

The core that privatizers (``dptune.privatizers``), update rules (``dptune.updates``) and
strategies (``dptune.strategies``) build on; it imports none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dptune.errors import ConfigError
from dptune.grads import GradientOracle, PerSampleGrads
from dptune.mechanisms import NoisyRelease
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
    def batch_size(self) -> int:
        return int(self.y.shape[0])


def check_positive(name: str, value: float) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def check_unit_interval(name: str, value: float, closed_left: bool = True) -> float:
    ok = (0 <= value < 1) if closed_left else (0 < value < 1)
    if not ok:
        raise ConfigError(f"{name} must lie in {'[' if closed_left else '('}0, 1), got {value!r}.")
    return float(value)


Rule = Literal["exp", "additive", "normalized"]
RULES = ("exp", "additive", "normalized")


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ConfigError(f"unknown OSO rule {rule!r}; choose exp, additive or normalized.")


def _sign(x: float) -> float:
    return 0.0 if x == 0 or math.isnan(x) else math.copysign(1.0, x)


def hypergradient_step(
    rule: Rule, value: float, rate: float, dir_dot: float, cos: float, scale: float, floor: float
) -> float:
    """One OSO hyperparameter update from a hypergradient's dot product (Galli eqs. 13–21):
    ``exp``: v·exp(rate·sign(dot)); ``normalized``: v(1 + rate·cos); ``additive``: v + rate·scale·dot.
    The last two are floored at ``floor`` so that v stays a valid C (or ρ)."""
    if rule == "exp":
        return value * math.exp(rate * _sign(dir_dot))
    if rule == "normalized":
        return max(value * (1.0 + rate * cos), floor)
    return max(value + rate * scale * dir_dot, floor)
