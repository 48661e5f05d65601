"""What one private step sees: the run's plan (``RunPlan``, public, fixed before the run) and the
step's inputs (``StepContext``), shared by privatizers, update rules and strategies; ``snap_noise``,
the one place a planned ν is rounded (up) to one the strategy's releases carry exactly."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError
from dptune.gradients.oracle import GradientOracle, PerSampleGrads
from dptune.release.mechanisms import DeferredSum, NoisyRelease, SumQuery
from dptune.tree import Tensors


class PlannedStrategy(Protocol):
    """What a plan needs of its strategy (``dptune.strategies.Strategy`` is one; typed structurally
    because strategies import this module)."""

    @property
    def name(self) -> str: ...
    @property
    def private(self) -> bool: ...
    def config(self) -> dict[str, Any]: ...
    def planned_event(self, noise_multiplier: float, sampling_rate: float, steps: int) -> dp_event.DpEvent: ...
    def multipliers(self, run: RunPlan) -> tuple[float, ...]: ...
    def validate_run(self, run: RunPlan) -> None: ...


@dataclass(frozen=True)
class RunPlan:
    """One run, from plan to step: everything the accountant and the strategy may know about it
    (all public), fixed before it starts (``dptune.plan_run``; a study's planner)."""

    strategy: PlannedStrategy
    n: int
    sampling_rate: float  # q
    steps: int  # T
    noise_multiplier: float  # the joint per-release ν (inf for non-private), snapped (``snap_noise``)
    # The accountant ν was calibrated with (or that reports a given ν): the run's ε is its ε.
    # Another accountant's ε of the same run can exceed the target (RDP vs a PLD calibration).
    accountant: str = "rdp"
    pretrained: bool = False  # the model starts from pretrained weights: fine-tuning defaults (updates.defaults)

    @property
    def expected_batch_size(self) -> float:
        return self.sampling_rate * self.n  # L = q·n

    def event(self) -> dp_event.DpEvent:
        return self.strategy.planned_event(self.noise_multiplier, self.sampling_rate, self.steps)

    def released_multiplier(self) -> float:
        """The joint ν that the strategy's per-query multipliers recombine to, (Σ ν_i⁻²)^(-1/2)."""
        return accounting.joint_noise_multiplier(self.strategy.multipliers(self))


def snap_noise(nu: float, plans: Iterable[RunPlan]) -> float:
    """The smallest ν' ≥ ν whose per-query parts recombine to at least ν' for every plan (``plans``
    with ν replaced): the noise drawn is never below the planned event the gateway records. Split strategies
    (OSO, quantile) recompute (Σ ν_i⁻²)^(-1/2) from their parts, a few ulps off ν; more noise only
    lowers ε, so the snapped ν still meets the budget. A strategy refusing ν raises its ConfigError."""
    if not math.isfinite(nu):
        return nu
    plans = list(plans)
    v = nu
    for _ in range(1_000):  # a few ulps in practice
        if all(not p.strategy.private or replace(p, noise_multiplier=v).released_multiplier() >= v for p in plans):
            return v
        v = math.nextafter(v, math.inf)
    raise ConfigError(f"the strategy's per-query noise multipliers do not recombine to any ν near {nu}")


@dataclass
class StepContext:
    """One iteration's inputs. ``grads`` is computed lazily at the current parameters.

    Only privatizers read it: an update rule sees the released values, never this context."""

    t: int  # 1-based iteration
    x: Any  # a tensor, or a tuple/dict of tensors (dptune.inputs)
    y: torch.Tensor
    oracle: GradientOracle
    release: NoisyRelease | None
    run: RunPlan
    _grads: PerSampleGrads | None = None
    _losses: torch.Tensor | None = None

    def grads(self, params: Tensors) -> PerSampleGrads:
        if self._grads is None:
            grads = self._grads = self.oracle(params, self.x, self.y)
            self._losses = grads.losses
        return self._grads

    def publish(self, *queries: SumQuery, label: str) -> list[torch.Tensor | Tensors | DeferredSum]:
        """The gateway's ``release`` of the step's queries, the per-example state freed first: the sums are
        formed, and the kept activations and output gradients (a transformer's largest tensors) would
        otherwise sit under the noise and the update (docs/performance.md). The losses stay."""
        free = getattr(self._grads, "free", None)
        if free is not None:
            free()
        self._grads = None  # a later ``grads`` call computes them again
        assert self.release is not None
        return self.release.release(*queries, label=label)

    @property
    def computed_losses(self) -> torch.Tensor | None:
        """The per-example losses if ``grads`` computed them during the step, else None (a strategy
        that never asked for them): for the loop's history (data owner only), without computing them."""
        return self._losses

    @property
    def batch_size(self) -> int:
        return int(self.y.shape[0])
