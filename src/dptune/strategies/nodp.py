"""``nodp``: the non-private SGD baseline (Galli's NoDP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dptune.mechanisms import record_nonprivate
from dptune.strategies.base import (
    RunInfo,
    StepContext,
    Strategy,
    check_positive,
    check_unit_interval,
    heavy_ball,
)
from dptune.tree import Tensors


@dataclass(frozen=True)
class NoDP(Strategy):
    """Plain (momentum) SGD on the mean loss of the Poisson-sampled batch.

    θ_{t+1} = θ_t − lr·m_t,  m_t = μ·m_{t−1} + ∇ℓ_B(θ_t)   (μ = 0: SGD).
    Not private: every step is recorded as a ``NonPrivateDpEvent`` (ε = ∞).
    """

    lr: float = 0.1
    momentum: float = 0.0
    name = "nodp"
    private = False
    hyperparameters = ("lr", "momentum")

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        check_unit_interval("momentum", self.momentum)

    def init(self, params: Tensors, run: RunInfo) -> dict[str, Any]:
        return {"momentum": None}

    def step(self, params: Tensors, state: dict[str, Any], ctx: StepContext):
        assert ctx.release is not None
        record_nonprivate(ctx.release.ledger, "nodp/gradient", run=ctx.release.run)
        if ctx.batch_size == 0:
            return params, state, {"lr": self.lr}
        _, g = ctx.oracle.loss_and_grad(params, ctx.x, ctx.y)
        params, buf = heavy_ball(params, state["momentum"], g, self.lr, self.momentum)
        return params, {"momentum": buf}, {"lr": self.lr}
