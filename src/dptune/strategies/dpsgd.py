"""``dpsgd``: FixedThreshold DP-SGD (Abadi et al. 2016), with optional heavy-ball momentum
(= DP-Momentum of Mohapatra et al. 2022, appendix A.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dptune.strategies.base import (
    RunInfo,
    StepContext,
    Strategy,
    check_positive,
    check_unit_interval,
    heavy_ball,
    release_sum,
)
from dptune.tree import Tensors


@dataclass(frozen=True)
class DPSGD(Strategy):
    """g̃_t = (Σ_{i∈B_t} clip_C(g_i) + N(0, ν²C²I)) / L          (Galli eqs. 4, 18; L = expected batch)
    m_t = μ·m_{t−1} + g̃_t;  θ_{t+1} = θ_t − lr·m_t                (μ = 0: DP-SGD; μ > 0: DP-Momentum)

    One Poisson-sampled Gaussian release of multiplier ν per step.
    """

    lr: float = 0.1
    clip: float = 1.0
    momentum: float = 0.0
    name = "dpsgd"
    hyperparameters = ("lr", "clip", "momentum")

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        check_positive("clip (C)", self.clip)
        check_unit_interval("momentum", self.momentum)

    def init(self, params: Tensors, run: RunInfo) -> dict[str, Any]:
        return {"momentum": None}

    def step(self, params: Tensors, state: dict[str, Any], ctx: StepContext):
        noisy = release_sum(ctx, params, self.clip, ctx.run.noise_multiplier, "dpsgd/gradient")
        # g̃ = noisy / L, folded into the update (fused multiply-adds, see heavy_ball).
        params, buf = heavy_ball(params, state["momentum"], noisy, self.lr, self.momentum,
                                 scale=1.0 / ctx.run.expected_batch_size)
        return params, {"momentum": buf}, {"lr": self.lr, "clip": self.clip}
