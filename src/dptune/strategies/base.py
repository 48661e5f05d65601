"""The strategy contract: small stateful transforms with explicit state (optax-style).

A strategy is an immutable bundle of hyperparameters with two pure-ish methods:

* ``init(params, run) -> state`` builds the explicit state (momentum buffers, an
  adaptive clipping threshold C_t, a learning rate ρ_t, ...);
* ``step(params, state, ctx) -> (params, state, metrics)`` performs one iteration.
  It reads per-sample *norms* and *weighted sums* from ``ctx.grads`` and releases
  private statistics only through ``ctx.release`` (the run's privacy gateway).

``planned_event(nu, q, steps)`` says, before training, exactly which releases the
run will make; the run's ledger is created with that plan, so a strategy that
tried to release more would be stopped by ``BudgetExceededError``.

Noise multiplier convention: ``run.noise_multiplier`` (ν) is the *joint* per-step
multiplier that the accountant sees. Strategies that release several queries per
step (OSO, quantile) split ν internally so that the joint release is exactly one
Gaussian of multiplier ν.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from dp_accounting import dp_event

from dptune import accounting, tree
from dptune.errors import ConfigError
from dptune.grads import GradientOracle, PerSampleGrads
from dptune.mechanisms import NoisyRelease, SumQuery
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
    """One iteration's inputs. ``grads`` is computed lazily at the current parameters."""

    t: int  # 1-based iteration
    x: torch.Tensor
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
        return int(self.x.shape[0])


def clip_weights(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C/‖g_i‖): the per-sample weights of the clipped sum (Galli eq. 4)."""
    # In place on the fresh clamp_min result. ``C / t`` is ``t.reciprocal() * C`` in torch
    # (Tensor.__rdiv__): the same two roundings here.
    return norms.clamp_min(1e-12).reciprocal_().mul_(clip).clamp_(max=1.0)


def clipped_sum(grads: PerSampleGrads, clip: float) -> Tensors:
    """Σ_i clip_C(g_i). Sensitivity C under add/remove."""
    return grads.weighted_sum(clip_weights(grads.norms, clip))


def check_positive(name: str, value: float) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def check_unit_interval(name: str, value: float, closed_left: bool = True) -> float:
    ok = (0 <= value < 1) if closed_left else (0 < value < 1)
    if not ok:
        raise ConfigError(f"{name} must lie in {'[' if closed_left else '('}0, 1), got {value!r}.")
    return float(value)


class Strategy(ABC):
    """Base class. Subclasses are frozen dataclasses of hyperparameters."""

    name: ClassVar[str]
    private: ClassVar[bool] = True
    hyperparameters: ClassVar[tuple[str, ...]] = ()

    def releases_per_run(self, steps: int) -> int:
        """Number of Gaussian releases (each at joint multiplier ν) that ``steps`` iterations make."""
        return steps

    def planned_event(self, noise_multiplier: float, sampling_rate: float, steps: int) -> dp_event.DpEvent:
        if not self.private:
            return dp_event.SelfComposedDpEvent(dp_event.NonPrivateDpEvent(), steps)
        ev = accounting.gaussian_step_event(noise_multiplier, sampling_rate)
        return dp_event.SelfComposedDpEvent(ev, self.releases_per_run(steps))

    def validate_run(self, run: RunInfo) -> None:
        """Raise ConfigError if this strategy cannot run with these run settings."""

    @abstractmethod
    def init(self, params: Tensors, run: RunInfo) -> Any: ...

    @abstractmethod
    def step(self, params: Tensors, state: Any, ctx: StepContext) -> tuple[Tensors, Any, dict[str, float]]: ...

    def prepare(self, params: Tensors) -> Tensors:
        """Transform the initial parameters before training (e.g. zero init). Default: none."""
        return params

    def finalize(self, params: Tensors, state: Any) -> Tensors:
        """Post-processing after the last step (free of privacy cost). Default: none."""
        return params

    def config(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"strategy": self.name, **asdict(self)}  # type: ignore[call-overload]


def release_sum(ctx: StepContext, params: Tensors, clip: float, nu: float, label: str) -> Tensors:
    """The standard DP-SGD query, undivided: Σ clip_C(g_i) + N(0, ν²C²)."""
    assert ctx.release is not None
    (noisy,) = ctx.release.release(
        SumQuery("gradient", clipped_sum(ctx.grads(params), clip), clip, nu), label=label
    )
    return noisy


def release_gradient(ctx: StepContext, params: Tensors, clip: float, nu: float, label: str) -> Tensors:
    """The standard DP-SGD query: (Σ clip_C(g_i) + N(0, ν²C²I)) / L."""
    return tree.scale(release_sum(ctx, params, clip, nu, label), 1.0 / ctx.run.expected_batch_size)


def heavy_ball(
    params: Tensors, buf: Tensors | None, g: Tensors, lr: float, momentum: float, scale: float | None = None
) -> tuple[Tensors, Tensors | None]:
    """θ ← θ − lr·m with m ← μ·m + s·g (PyTorch SGD convention, no dampening). μ = 0: plain SGD.

    ``scale=None`` (s = 1): rounded exactly as the per-tensor expressions θ − lr·g and
    μ·m + g. ``scale=s``: g is an unscaled sum (the noisy clipped sum, s = 1/L) and s is
    folded into fused multiply-adds: θ + (−lr·s)·g is ONE pass over θ and g instead of
    three (g·s, lr·(g·s), θ − ·), the same up to the last bits.
    """
    if scale is None:
        if momentum == 0.0:
            return tree.axpy(-lr, g, params), None
        buf = g if buf is None else tree.axpy(momentum, buf, g)
        return tree.axpy(-lr, buf, params), buf
    if momentum == 0.0:
        return tree.add_scaled(params, -lr * scale, g), None
    buf = tree.scale(g, scale) if buf is None else tree.ema(momentum, buf, scale, g)
    return tree.add_scaled(params, -lr, buf), buf
