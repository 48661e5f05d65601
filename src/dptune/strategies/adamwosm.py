"""``adamwosm``: DPAdamWOSM, DP-Adam without second moment (Mohapatra et al. 2022, appendix Algorithm 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dptune.strategies.base import (
    RunInfo,
    StepContext,
    Strategy,
    check_positive,
    check_unit_interval,
    release_sum,
)
from dptune.tree import Tensors, add_scaled, ema, zeros_like


@dataclass(frozen=True)
class AdamWOSM(Strategy):
    """First moment only, with bias correction, at the effective step size (ESS):
      lr = ESS = α / (σ·C/L + 10⁻⁸),  α = 10⁻³   (Algorithm 2, line 3; σ = ν, L = expected batch)
      g̃_t = (Σ clip_C(g_i) + N(0, σ²C²I)) / L
      m_t = β₁ m_{t−1} + (1−β₁) g̃_t;  m̂_t = m_t / (1−β₁ᵗ);  θ_t = θ_{t−1} − lr · m̂_t
    Algorithm 2 line 8 divides by the realised |L_t|; dptune divides by the expected L
    (the realised size is private and the accountant assumes the expected one).
    Only C is tuned (Galli's grid for AdamWOSM is over C alone).
    """

    clip: float = 1.0
    alpha: float = 1e-3
    beta1: float = 0.9
    name = "adamwosm"
    hyperparameters = ("clip", "alpha", "beta1")

    def __post_init__(self) -> None:
        check_positive("clip (C)", self.clip)
        check_positive("alpha", self.alpha)
        check_unit_interval("beta1", self.beta1)

    def effective_step_size(self, run: RunInfo) -> float:
        return self.alpha / (run.noise_multiplier * self.clip / run.expected_batch_size + 1e-8)

    def init(self, params: Tensors, run: RunInfo) -> dict[str, Any]:
        return {"m": zeros_like(params), "t": 0, "lr": self.effective_step_size(run)}

    def step(self, params: Tensors, state: dict[str, Any], ctx: StepContext):
        noisy = release_sum(ctx, params, self.clip, ctx.run.noise_multiplier, "adamwosm/gradient")
        t = state["t"] + 1
        # m ← β₁m + (1−β₁)·g̃ with g̃ = noisy/L, and θ ← θ − (lr/c1)·m: 1/L and 1/c1 are folded
        # into fused multiply-adds (two passes for m, one for θ; the same up to the last bits).
        m = ema(self.beta1, state["m"], (1 - self.beta1) / ctx.run.expected_batch_size, noisy)
        c1 = 1 - self.beta1**t
        lr = state["lr"]
        params = add_scaled(params, -lr / c1, m)
        return params, {**state, "m": m, "t": t}, {"lr": lr, "clip": self.clip}
