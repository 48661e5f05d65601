"""``quantile``: FixedQuantile adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dptune import accounting
from dptune.errors import ConfigError
from dptune.mechanisms import SumQuery
from dptune.strategies.base import (
    RunInfo,
    StepContext,
    Strategy,
    check_positive,
    check_unit_interval,
    clip_weights,
    heavy_ball,
)
from dptune.tree import Tensors


@dataclass(frozen=True)
class FixedQuantile(Strategy):
    """Clip at C_t and move C_t geometrically towards the γ-quantile of the gradient norms.

    Per step, on the same Poisson batch B_t, two queries are released jointly:
      g̃_t = (Σ clip_{C_t}(g_i) + N(0, ν_g² C_t² I)) / L                 (sensitivity C_t)
      b̃_t = (Σ (1[‖g_i‖ ≤ C_t] − ½) + N(0, σ_b²)) / L + ½                (recentred count, sensitivity ½)
      C_{t+1} = C_t · exp(−η_C (b̃_t − γ))                                (Andrew et al., geometric update)
    with ν_g = (ν⁻² − (2σ_b)⁻²)^(−½), so that the pair is ONE Gaussian mechanism of
    multiplier ν (Andrew et al., Theorem 1; ``accounting.joint_noise_multiplier``).
    The count's σ_b defaults to L/20 (Andrew et al.'s default: expected batch / 20).
    Galli's settings: η_C = 0.2, γ ∈ {0.1, …, 0.9}, C₀ = 0.1.
    """

    lr: float = 0.1
    target_quantile: float = 0.5  # γ
    clip_lr: float = 0.2  # η_C
    initial_clip: float = 0.1  # C₀
    count_noise_std: float | None = None  # σ_b; None → L/20
    momentum: float = 0.0
    name = "quantile"
    hyperparameters = ("lr", "target_quantile", "clip_lr", "initial_clip", "count_noise_std", "momentum")

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        if not (0 < self.target_quantile < 1):
            raise ConfigError(f"target_quantile (γ) must lie in (0, 1), got {self.target_quantile!r}.")
        check_positive("clip_lr (η_C)", self.clip_lr)
        check_positive("initial_clip (C₀)", self.initial_clip)
        if self.count_noise_std is not None:
            check_positive("count_noise_std (σ_b)", self.count_noise_std)
        check_unit_interval("momentum", self.momentum)

    def sigma_b(self, run: RunInfo) -> float:
        return self.count_noise_std if self.count_noise_std is not None else run.expected_batch_size / 20.0

    def split(self, run: RunInfo) -> tuple[float, float]:
        """(ν_g, ν_b) for the gradient and the count, with ν_b = 2σ_b (sensitivity ½)."""
        nu_b = 2.0 * self.sigma_b(run)
        if run.noise_multiplier >= nu_b:
            raise ConfigError(
                f"FixedQuantile needs ν < 2σ_b, got ν = {run.noise_multiplier:.4g} and σ_b = "
                f"{self.sigma_b(run):.4g}: the count query would use the whole budget. Raise "
                "count_noise_std (σ_b), use a larger expected batch size, or spend more ε."
            )
        return accounting.split_noise_multiplier(run.noise_multiplier, nu_b), nu_b

    def validate_run(self, run: RunInfo) -> None:
        self.split(run)

    def init(self, params: Tensors, run: RunInfo) -> dict[str, Any]:
        nu_g, nu_b = self.split(run)
        return {"clip": self.initial_clip, "momentum": None, "nu_g": nu_g, "nu_b": nu_b}

    def step(self, params: Tensors, state: dict[str, Any], ctx: StepContext):
        assert ctx.release is not None
        clip = state["clip"]
        grads = ctx.grads(params)
        unclipped = (grads.norms <= clip).to(torch.float64)
        count = (unclipped - 0.5).sum().reshape(())
        g_sum, b_sum = ctx.release.release(
            SumQuery("gradient", grads.weighted_sum(clip_weights(grads.norms, clip)), clip, state["nu_g"]),
            SumQuery("unclipped_count", count, 0.5, state["nu_b"]),
            label="quantile/gradient+count",
        )
        L = ctx.run.expected_batch_size
        b_frac = float(b_sum) / L + 0.5
        # g̃ = g_sum / L, folded into the update (fused multiply-adds, see heavy_ball).
        params, buf = heavy_ball(params, state["momentum"], g_sum, self.lr, self.momentum, scale=1.0 / L)
        new_clip = clip * math.exp(-self.clip_lr * (b_frac - self.target_quantile))
        state = {**state, "clip": new_clip, "momentum": buf}
        return params, state, {"lr": self.lr, "clip": clip, "unclipped_fraction": b_frac}
