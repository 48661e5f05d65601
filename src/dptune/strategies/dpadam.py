"""``dpadam``: DP-Adam (Adam of Kingma & Ba on the DP-SGD noisy gradient; Mohapatra et al. A.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dptune.strategies.base import (
    RunInfo,
    StepContext,
    Strategy,
    check_positive,
    check_unit_interval,
    release_gradient,
)
from dptune.tree import Tensors, lincomb, zeros_like


@dataclass(frozen=True)
class DPAdam(Strategy):
    """g̃_t as in DP-SGD, then Adam with bias correction:
      m_t = β₁ m_{t−1} + (1−β₁) g̃_t,   v_t = β₂ v_{t−1} + (1−β₂) g̃_t²
      θ_{t+1} = θ_t − lr · m̂_t / (√v̂_t + ε),  m̂_t = m_t/(1−β₁ᵗ), v̂_t = v_t/(1−β₂ᵗ)
    Adam is post-processing of g̃_t: one Gaussian release of multiplier ν per step.
    """

    lr: float = 1e-3
    clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    name = "dpadam"
    hyperparameters = ("lr", "clip", "beta1", "beta2", "eps")

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        check_positive("clip (C)", self.clip)
        check_unit_interval("beta1", self.beta1)
        check_unit_interval("beta2", self.beta2)
        check_positive("eps", self.eps)

    def init(self, params: Tensors, run: RunInfo) -> dict[str, Any]:
        return {"m": zeros_like(params), "v": zeros_like(params), "t": 0}

    def step(self, params: Tensors, state: dict[str, Any], ctx: StepContext):
        g = release_gradient(ctx, params, self.clip, ctx.run.noise_multiplier, "dpadam/gradient")
        t = state["t"] + 1
        b1, b2 = self.beta1, self.beta2
        keys = list(g)
        gs = list(g.values())
        m = lincomb(b1, state["m"], 1 - b1, g)
        # v ← β₂ v + ((1−β₂)·g)·g, rounded in that order as before.
        g2 = torch._foreach_mul(gs, 1 - b2)
        torch._foreach_mul_(g2, gs)
        v = dict(zip(keys, torch._foreach_add(torch._foreach_mul([state["v"][k] for k in keys], b2), g2), strict=True))
        c1, c2 = 1 - b1**t, 1 - b2**t
        # θ − lr·(m/c1) / (sqrt(v/c2) + ε), with the same roundings; −lr folds the subtraction
        # into an addition exactly (negation commutes with every rounding here).
        num = torch._foreach_div([m[k] for k in params], c1)
        torch._foreach_mul_(num, -self.lr)
        den = torch._foreach_div([v[k] for k in params], c2)
        torch._foreach_sqrt_(den)
        torch._foreach_add_(den, self.eps)
        torch._foreach_div_(num, den)
        params = dict(zip(params, torch._foreach_add(list(params.values()), num), strict=True))
        return params, {"m": m, "v": v, "t": t}, {"lr": self.lr, "clip": self.clip}
