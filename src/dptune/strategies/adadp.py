"""``adadp``: ADADP, learning-rate adaptation by extrapolation (Koskela & Honkela, AISTATS 2020).

A. Koskela, A. Honkela. "Learning Rate Adaptation for Differentially Private Learning."
AISTATS 2020, PMLR 108:2465-2475 (arXiv:1809.03832). Used as a baseline by Mohapatra et al.
(2022), appendix A.1, with the tolerance τ = sqrt(d / (2T)).
"""

from __future__ import annotations

from dataclasses import dataclass

from dptune.release.context import RunPlan
from dptune.release.privatizers import FixedClip
from dptune.strategies.base import Composed
from dptune.updates import ADADP as ADADPRule
from dptune.updates import extrapolation_error

__all__ = ["ADADP", "extrapolation_error"]


@dataclass(frozen=True)
class ADADP(Composed):
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

    Default η₀ = 0.5 (measured, benchmarks/defaults.py): from the authors' 1e-3, η grows by at
    most ×1.1 per two steps, too slowly for runs of a few hundred steps; their value is pinned
    in the Mohapatra presets.
    """

    lr: float = 0.5  # η₀ (measured default; the authors' 1e-3 needs T ≫ 1,000 to grow)
    clip: float = 1.0  # C
    tolerance: float | None = None  # τ; None → sqrt(d / (2T))
    min_factor: float = 0.9  # α_min
    max_factor: float = 1.1  # α_max
    safety: float = 1.0  # s
    reject: bool = True
    name = "adadp"
    hyperparameters = ("lr", "clip", "tolerance", "min_factor", "max_factor", "safety", "reject")

    def parts(self):
        return FixedClip(self.clip), self.rule()

    def rule(self) -> ADADPRule:
        return ADADPRule(self.lr, self.tolerance, self.min_factor, self.max_factor, self.safety, self.reject)

    def tau(self, run: RunPlan, num_params: int) -> float:
        return self.rule().tau(run, num_params)

    def lr_factor(self, err: float, tau: float) -> float:
        return self.rule().lr_factor(err, tau)
