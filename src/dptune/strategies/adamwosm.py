"""``adamwosm``: DPAdamWOSM, DP-Adam without second moment (Mohapatra et al. 2022, appendix Algorithm 2)."""

from __future__ import annotations

from dataclasses import dataclass

from dptune.release.context import RunPlan
from dptune.release.privatizers import FixedClip
from dptune.strategies.base import Composed
from dptune.updates import AdamWOSM as AdamWOSMRule
from dptune.updates.defaults import default_adam_lr


@dataclass(frozen=True)
class AdamWOSM(Composed):
    """First moment only, with bias correction, at the effective step size (ESS):
      lr = ESS = α / (σ·C/L + 10⁻⁸)          (Algorithm 2, line 3; σ = ν, L = expected batch)
      g̃_t = (Σ clip_C(g_i) + N(0, σ²C²I)) / L
      m_t = β₁ m_{t−1} + (1−β₁) g̃_t;  m̂_t = m_t / (1−β₁ᵗ);  θ_t = θ_{t−1} − lr · m̂_t
    = chain(FixedClip(C), updates.AdamWOSM(α, β₁)). Algorithm 2 line 8 divides by the
    realised |L_t|; dptune divides by the expected L (the realised size is private and the
    accountant assumes the expected one). Only C is tuned (Galli's grid for AdamWOSM is over C alone).
    Default α = 0.8/T (linear scaling for Adam, measured: docs/strategies.md, "Defaults"); the
    paper's α = 10⁻³ (= 0.8/T at T = 800) is pinned in the presets.
    """

    clip: float = 1.0
    alpha: float | None = None  # None: linear scaling, α = 0.8/T (the paper's 1e-3 suits T ≈ 800)
    beta1: float = 0.9
    name = "adamwosm"
    hyperparameters = ("clip", "alpha", "beta1")

    def parts(self):
        return FixedClip(self.clip), AdamWOSMRule(self.alpha, self.beta1)

    def effective_step_size(self, run: RunPlan) -> float:
        rule = AdamWOSMRule(self.alpha, self.beta1)
        alpha = self.alpha if self.alpha is not None else default_adam_lr(run)
        return rule.effective_step_size(run.noise_multiplier * self.clip, run.expected_batch_size, alpha)
