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
    def computed_grads(self) -> PerSampleGrads | None:
        """The per-sample gradients if ``grads`` computed them during the step, else None (a
        strategy that never asked for them): for the loop's history, without computing them."""
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


# OSO's hyperparameter rates, horizon-aware (docs/strategies.md, "Horizon-aware rates"): under the
# sign rule C and ρ move by a factor of at most exp(ρ_c·T); Galli et al.'s ρ_c = ρ_r = 2.5e-3 at
# their T ≈ 1,172 steps (MNIST, 5 epochs at L = 256 of 60,000) allow exp(2.93) ≈ 19×. A rate
# left unset gives every run that same range: ρ = OSO_LOG_RANGE / T.
OSO_LOG_RANGE = 2.5e-3 * 1172


def horizon_rate(rate: float | None, run: RunInfo) -> float:
    """An OSO rate: the given one, or OSO_LOG_RANGE / T (public: T is planned)."""
    return float(rate) if rate is not None else OSO_LOG_RANGE / max(run.steps, 1)


def check_rate(name: str, rate: float | None) -> None:
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0
    ):
        raise ConfigError(f"{name} must be a finite number ≥ 0 or None (horizon-aware), got {rate!r}.")


# Default learning rates by Panda et al.'s linear scaling rule: what matters is r = η·T, the
# step size times the number of steps (docs/strategies.md, "Defaults", with the measurements).
# For SGD on clipped means, η is the effective step lr·C/(1 − μ) (the length of one update of
# a fully clipped batch); for Adam, lr itself (Adam normalises the gradient's scale).
SGD_STEP_BUDGET = 200.0  # r = lr·C/(1 − μ)·T
ADAM_STEP_BUDGET = 0.8  # r = lr·T


# The best r grows as the noise shrinks (Panda et al.: r grows with ε). The noise that matters is
# that of the mean gradient per unit of C, s = ν/L; below S_REF the budget grows as (S_REF/s)^1.5,
# at most ×3 (measured: best r ≈ 150–250 at ε = 1, ≈ 500–600 at ε = 8).
S_REF = 0.005
MAX_BUDGET_GROWTH = 3.0


def noise_scaled_budget(budget: float, run: RunInfo) -> float:
    """r for this run's noise level s = ν/L (public: the plan's ν and L)."""
    s = run.noise_multiplier / run.expected_batch_size
    if not math.isfinite(s) or s <= 0:
        return budget
    return budget * min(MAX_BUDGET_GROWTH, max(1.0, (S_REF / s) ** 1.5))


def scaled_lr(budget: float, run: RunInfo, clip: float = 1.0, momentum: float = 0.0) -> float:
    """The linear-scaling default: lr = r·(1 − μ)/(C·T) (public: T, C and μ are planned)."""
    return budget * (1.0 - momentum) / (clip * max(run.steps, 1))


def default_adam_lr(run: RunInfo) -> float:
    """Adam-type default (lr, or AdamWOSM's α): r/T, r = ADAM_STEP_BUDGET."""
    return scaled_lr(ADAM_STEP_BUDGET, run)


def default_sgd_lr(run: RunInfo, clip: float | None, momentum: float) -> float:
    """SGD-type default: lr = r·(1 − μ)/(C·T), r = SGD_STEP_BUDGET grown at low noise; C = 1
    for an unclipped (non-private) release."""
    return scaled_lr(noise_scaled_budget(SGD_STEP_BUDGET, run), run, 1.0 if clip is None else clip, momentum)


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
