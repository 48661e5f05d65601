"""``adadp``: ADADP, learning-rate adaptation by extrapolation (Koskela & Honkela, AISTATS 2020).

A. Koskela, A. Honkela. "Learning Rate Adaptation for Differentially Private Learning."
AISTATS 2020, PMLR 108:2465-2475 (arXiv:1809.03832). Used as a baseline by Mohapatra et al.
(2022), appendix A.1, with the tolerance τ = sqrt(d / (2T)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dptune.errors import ConfigError
from dptune.strategies.base import RunInfo, StepContext, Strategy, check_positive, release_gradient
from dptune.tree import Tensors


def extrapolation_error(full: Tensors, halves: Tensors) -> float:
    """err = ‖(θ₁ − θ₂) / max(1, |θ₁|)‖₂, elementwise division (Koskela & Honkela's mixed
    absolute/relative error: absolute for |θ₁| ≤ 1, relative above)."""
    sq = 0.0
    for k, a in full.items():
        a64, b64 = a.double(), halves[k].double()
        sq += float((((a64 - b64) / a64.abs().clamp_min(1.0)) ** 2).sum())
    return math.sqrt(sq)


@dataclass(frozen=True)
class ADADP(Strategy):
    """DP-SGD whose step size η is adapted by comparing one full step with two half steps.

    Every noisy gradient is the DP-SGD query on its own Poisson batch,
      g̃(θ; B) = (Σ_{i∈B} clip_C(∇ℓ_i(θ)) + N(0, ν²C²I)) / L        (L = expected batch size),
    and the algorithm alternates two kinds of step (so η changes every other step; Mohapatra
    et al. A.1: "finds the best learning rate at every alternate iteration"):

    odd step t = 2k−1, batch B_t:   g₀ = g̃(θ₀; B_t) at the current θ₀
        θ₁ = θ₀ − η g₀                      (one full step: kept aside, not applied)
        θ_{½} = θ₀ − (η/2) g₀               (first half step: the new parameters)
    even step t = 2k, fresh batch B_t:   g_{½} = g̃(θ_{½}; B_t)
        θ₂ = θ_{½} − (η/2) g_{½}            (second half step)
        err = ‖(θ₁ − θ₂) / max(1, |θ₁|)‖₂   (elementwise; θ₁ − θ₂ = (η/2)(g_{½} − g₀) is the
                                            first-order local error of the Euler step
                                            against the gradient flow)
        η ← η · min(max(s·sqrt(τ/err), α_min), α_max)     (closed form: Euler's local error
                                            is O(η²), so η·sqrt(τ/err) makes err ≈ τ)
        θ ← θ₂ if err ≤ τ, else θ ← θ₀      (a rejected pair of half steps is undone)

    Defaults: α_min = 0.9, α_max = 1.1, s = 1 (the authors' code, DPBayes/ADADP, and d3p's
    ``adadp``), τ = sqrt(d / (2T)) with d = number of trainable parameters and T = total
    number of steps (Mohapatra et al. A.1, "as suggested by the authors"), η₀ = 10⁻³ (the
    authors' default initial step size).

    Choices where the sources are loose or silent, all following the authors' code:
      * each gradient evaluation uses a NEW Poisson batch and is one dptune step (one
        release at multiplier ν); the run's T counts gradient evaluations, so one full
        adaptation cycle takes two steps and ``releases_per_run(T) = T``;
      * the rejection (undo when err > τ) is on by default (``reject=True``); the authors
        note that it "can be sometimes neglected";
      * err = 0 (identical gradients) gives the maximal growth α_max;
      * with T odd, the last step is a half step that is kept (it is a plain DP-SGD step of
        size η/2).
    The safety factor s (classical step-size control multiplies the ratio by ≈ 0.9) is 1 in
    the authors' code; it is exposed as ``safety``.

    Accounting: one Poisson-sampled Gaussian release of multiplier ν (sensitivity C) per
    step; everything else (θ₁, err, η, the accept/reject choice) is post-processing.
    """

    lr: float = 1e-3  # η₀
    clip: float = 1.0  # C
    tolerance: float | None = None  # τ; None → sqrt(d / (2T))
    min_factor: float = 0.9  # α_min
    max_factor: float = 1.1  # α_max
    safety: float = 1.0  # s
    reject: bool = True
    name = "adadp"
    hyperparameters = ("lr", "clip", "tolerance", "min_factor", "max_factor", "safety", "reject")

    def __post_init__(self) -> None:
        check_positive("lr (η₀)", self.lr)
        check_positive("clip (C)", self.clip)
        if self.tolerance is not None:
            check_positive("tolerance (τ)", self.tolerance)
        check_positive("min_factor (α_min)", self.min_factor)
        check_positive("max_factor (α_max)", self.max_factor)
        check_positive("safety", self.safety)
        if not self.min_factor <= 1.0 <= self.max_factor:
            raise ConfigError(
                f"ADADP needs min_factor ≤ 1 ≤ max_factor, got {self.min_factor} and {self.max_factor}; "
                "the defaults are 0.9 and 1.1."
            )

    def tau(self, run: RunInfo) -> float:
        """τ: the given tolerance, or sqrt(d / (2T)) (Mohapatra et al. A.1)."""
        if self.tolerance is not None:
            return float(self.tolerance)
        return math.sqrt(run.num_params / (2.0 * run.steps))

    def lr_factor(self, err: float, tau: float) -> float:
        """min(max(s·sqrt(τ/err), α_min), α_max); err = 0 → α_max."""
        if err <= 0.0:
            return self.max_factor
        if not math.isfinite(err):
            return self.min_factor
        return min(max(self.safety * math.sqrt(tau / err), self.min_factor), self.max_factor)

    def init(self, params: Tensors, run: RunInfo) -> dict[str, Any]:
        return {
            "lr": float(self.lr), "tau": self.tau(run), "theta0": None, "theta_full": None,
            "accepted": 0, "rejected": 0,
        }

    def step(self, params: Tensors, state: dict[str, Any], ctx: StepContext):
        lr = state["lr"]
        g = release_gradient(ctx, params, self.clip, ctx.run.noise_multiplier, "adadp/gradient")
        if state["theta0"] is None:
            # First half of a cycle: remember θ₀ and the full-step point θ₁, move to θ_½.
            with torch.no_grad():
                full = {k: params[k] - lr * g[k] for k in params}
                half = {k: params[k] - (0.5 * lr) * g[k] for k in params}
            state = {**state, "theta0": params, "theta_full": full}
            return half, state, {"lr": lr, "clip": self.clip}
        # Second half: finish the two half steps, estimate the error, adapt η, accept/reject.
        with torch.no_grad():
            two_halves = {k: params[k] - (0.5 * lr) * g[k] for k in params}
        err = extrapolation_error(state["theta_full"], two_halves)
        tau = state["tau"]
        new_lr = lr * self.lr_factor(err, tau)
        accept = err <= tau or not self.reject
        out = two_halves if accept else state["theta0"]
        state = {
            **state, "lr": new_lr, "theta0": None, "theta_full": None,
            "accepted": state["accepted"] + int(accept), "rejected": state["rejected"] + int(not accept),
        }
        return out, state, {"lr": lr, "clip": self.clip, "adadp_error": err, "accepted": float(accept)}
