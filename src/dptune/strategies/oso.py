"""``oso``: OSO-DPSGD, online sensitivity optimisation (Galli, Palamidessi, Cucinotta, AAAI 2024)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from dptune import accounting
from dptune.errors import ConfigError
from dptune.mechanisms import DeferredSum, SumQuery
from dptune.strategies.base import (
    RunInfo,
    StepContext,
    Strategy,
    check_positive,
    check_unit_interval,
    clip_weights,
    heavy_ball,
)
from dptune.tree import Tensors, dot, norm

Rule = Literal["exp", "additive", "normalized"]
MIN_CLIP = 1e-8  # the additive rule can cross zero; C must stay a valid (positive) sensitivity


def _sign(x: float) -> float:
    return 0.0 if x == 0 or math.isnan(x) else math.copysign(1.0, x)


@dataclass(frozen=True)
class OSO(Strategy):
    """OSO-DPSGD (Galli et al. 2024, Algorithm 1), with the seed's typos corrected.

    Per step t, on the Poisson batch B_t (L = expected batch size):
      q_t(z_i) = g_i/‖g_i‖ if ‖g_i‖ > C_t else 0                                   (eq. 11)
      g̃_t = (Σ clip_{C_t}(g_i) + N(0, ν_g² C_t² I)) / L                            (eq. 18, line 11)
      q̃_t = (Σ q_t(z_i) + N(0, ν_q² I)) / L          (eq. 17; line 13 of Alg. 1 writes ν_g: typo)
      θ_{t+1} = θ_t − ρ_t g̃_t                         (line 12 writes ĝ_t: it is g̃_t)
      C_{t+1} = C_t · exp(ρ_c · sign(g̃_tᵀ q̃_{t−1}))                                (eq. 20)
      ρ_{t+1} = ρ_t · exp(ρ_r · sign(g̃_tᵀ g̃_{t−1}))   (Alg. 1 line 15; eq. 21 writes q̃: typo)
    with q̃_0 = g̃_0 = 0 (so the first step leaves C and ρ unchanged) and the split
    ν_g = (ν⁻² − ν_q⁻²)^(−½) (Proposition 1): the pair (g̃_t, q̃_t) is ONE Gaussian
    mechanism of multiplier ν. ν_q defaults to the 1% rule (ν_g = 1.01ν → ν_q ≈ 7.124ν).

    Alternative rules (``rule``):
      * ``additive``  (eqs. 13, 16): C_{t+1} = C_t + ρ_c ρ_t g̃_tᵀ q̃_{t−1};  ρ_{t+1} = ρ_t + ρ_r ρ_t g̃_tᵀ g̃_{t−1}
        (C is floored at 1e-8 and ρ at 1e-12 to remain valid);
      * ``normalized`` (eq. 19, Rubio 2017): C_{t+1} = C_t (1 + ρ_c cos(g̃_t, q̃_{t−1})),
        ρ_{t+1} = ρ_t (1 + ρ_r cos(g̃_t, g̃_{t−1})).

    Momentum (μ > 0, heavy ball m_t = μ m_{t−1} + g̃_t, θ_{t+1} = θ_t − ρ_t m_t): the
    paper only says it "adds a multiplicative factor". Derivation: θ_t depends on C_{t−1}
    only through g̃_{t−1} inside m_{t−1}, with ∂m_{t−1}/∂g̃_{t−1} = I, so
    ∂ℓ(θ_t)/∂C_{t−1} = −ρ ∇ℓ(θ_t)ᵀ q_{t−1}: the factor is 1 for this convention
    (1 − μ for the EMA convention m_t = μ m_{t−1} + (1−μ) g̃_t), and the C rule is unchanged.
    For ρ, ∂θ_t/∂ρ_{t−1} = −m_{t−1}, so the ρ rule uses g̃_tᵀ m_{t−1} (= g̃_tᵀ g̃_{t−1} at μ = 0).

    q̃'s noise as one scalar (rules ``exp`` and ``additive``; class switch ``defer_q_noise``).
    These rules read q̃_t = (Q_t + Z_t)/L only through s_t = g̃_{t+1}ᵀq̃_t (the C rule at step
    t+1, metric ``g_dot_q``), and g̃_{t+1} is independent of Z_t. It is a function of θ_{t+1}
    (of g̃_1..g̃_t and ρ_1..ρ_t; with momentum through m_t, still g̃'s only), of ρ_t (g̃ᵀm
    products), of C_{t+1} (of s_1..s_{t−1}, never q̃_t), of the batch B_{t+1} and of its own
    fresh noise. So, given everything else, s_t ~ N(g̃_{t+1}ᵀQ_t/L, (ν_q‖g̃_{t+1}‖/L)²), which
    ``NoisyRelease.project`` draws: every output of the run has the same joint law as with the
    full vector Z_t, the ledger records the same joint (g̃_t, q̃_t) event at step t, and the
    guarantee is unchanged (post-processing). It saves one d-dimensional Gaussian draw per
    step. ``normalized`` also needs ‖q̃_t‖, not a function of s_t: it draws the full vector.
    Q_t lives in the state (a ``DeferredSum``) from step t to step t+1 only.
    """

    lr: float = 0.1  # ρ₀
    initial_clip: float = 0.1  # C₀
    clip_lr: float = 2.5e-3  # ρ_c
    lr_lr: float = 2.5e-3  # ρ_r
    q_noise_multiplier: float | None = None  # ν_q; None → from relative_increase
    relative_increase: float = 0.01  # allowed increase of ν_g over ν
    rule: Rule = "exp"
    momentum: float = 0.0
    adapt_lr: bool = True
    name = "oso"
    # Same algorithm either way (same law of every output, class docstring); not a
    # hyperparameter. False restores the full q̃ draw (equivalence tests, benchmarks).
    defer_q_noise: ClassVar[bool] = True
    hyperparameters = (
        "lr", "initial_clip", "clip_lr", "lr_lr", "q_noise_multiplier", "relative_increase", "rule", "momentum", "adapt_lr",
    )

    def __post_init__(self) -> None:
        check_positive("lr (ρ₀)", self.lr)
        check_positive("initial_clip (C₀)", self.initial_clip)
        if self.clip_lr < 0 or self.lr_lr < 0:
            raise ConfigError(f"clip_lr and lr_lr must be ≥ 0, got {self.clip_lr}, {self.lr_lr}.")
        if self.rule not in ("exp", "additive", "normalized"):
            raise ConfigError(f"unknown OSO rule {self.rule!r}; choose exp, additive or normalized.")
        if self.q_noise_multiplier is not None:
            check_positive("q_noise_multiplier (ν_q)", self.q_noise_multiplier)
        check_positive("relative_increase", self.relative_increase)
        check_unit_interval("momentum", self.momentum)

    def split(self, nu: float) -> tuple[float, float]:
        """(ν_g, ν_q) for a joint per-step multiplier ν."""
        nu_q = self.q_noise_multiplier or accounting.oso_q_noise_multiplier(nu, self.relative_increase)
        return accounting.split_noise_multiplier(nu, nu_q), nu_q

    def validate_run(self, run: RunInfo) -> None:
        self.split(run.noise_multiplier)

    def init(self, params: Tensors, run: RunInfo) -> dict[str, Any]:
        nu_g, nu_q = self.split(run.noise_multiplier)
        return {
            "clip": self.initial_clip, "lr": self.lr, "nu_g": nu_g, "nu_q": nu_q,
            "prev_g": None, "prev_q": None, "momentum": None,
        }

    def _update(self, value: float, rate: float, dir_dot: float, cos: float, scale: float, floor: float) -> float:
        if self.rule == "exp":
            return value * math.exp(rate * _sign(dir_dot))
        if self.rule == "normalized":
            return max(value * (1.0 + rate * cos), floor)
        return max(value + rate * scale * dir_dot, floor)

    def step(self, params: Tensors, state: dict[str, Any], ctx: StepContext):
        assert ctx.release is not None
        clip, lr = state["clip"], state["lr"]
        grads = ctx.grads(params)
        norms = grads.norms
        # Both queries are weighted sums of the same per-sample gradients: clip weights and
        # q weights 1[‖g‖ > C]/‖g‖ (unit-norm rows, so sensitivity 1).
        q_w = torch.where(norms > clip, 1.0 / norms.clamp_min(1e-12), torch.zeros_like(norms))
        deferred = self.defer_q_noise and self.rule != "normalized"
        g_sum, q_out = ctx.release.release(
            SumQuery("gradient", grads.weighted_sum(clip_weights(norms, clip)), clip, state["nu_g"]),
            SumQuery("clip_hypergradient", grads.weighted_sum(q_w), 1.0, state["nu_q"], deferred=deferred),
            label="oso/gradient+q",
        )
        L = ctx.run.expected_batch_size
        g = {k: v / L for k, v in g_sum.items()}
        # A deferred q̃_t stays a handle; a gateway that returns tensors (test stubs) is also fine.
        q = q_out.scaled(1.0 / L) if isinstance(q_out, DeferredSum) else {k: v / L for k, v in q_out.items()}

        params, buf = heavy_ball(params, state["momentum"], g, lr, self.momentum)

        prev_q, prev_g = state["prev_q"], state["prev_g"]
        new_clip, new_lr = clip, lr
        gq = gg = 0.0
        if prev_q is not None:
            # g̃_t is independent of q̃_{t−1}'s noise: the one projection is exact (class docstring).
            gq = ctx.release.project(prev_q, g) if isinstance(prev_q, DeferredSum) else dot(g, prev_q)
            cos_q = gq / max(norm(g) * norm(prev_q), 1e-30) if self.rule == "normalized" else 0.0
            new_clip = self._update(clip, self.clip_lr, gq, cos_q, lr, MIN_CLIP)
        if self.adapt_lr and prev_g is not None:
            gg = dot(g, prev_g)
            cos_g = gg / max(norm(g) * norm(prev_g), 1e-30) if self.rule == "normalized" else 0.0
            new_lr = self._update(lr, self.lr_lr, gg, cos_g, lr, 1e-12)
        # With momentum, ∂θ_t/∂ρ_{t-1} = −m_{t−1}: keep the applied direction for the next ρ rule.
        direction = buf if buf is not None else g
        state = {**state, "clip": new_clip, "lr": new_lr, "prev_g": direction, "prev_q": q, "momentum": buf}
        return params, state, {"lr": lr, "clip": clip, "g_dot_q": gq, "g_dot_g": gg}
