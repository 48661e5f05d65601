"""``adamwosm``: DPAdamWOSM, DP-Adam without second moment (Mohapatra et al. 2022, appendix Algorithm 2)."""

from __future__ import annotations

from dataclasses import dataclass

from dptune.privatizers import FixedClip
from dptune.steps import RunInfo
from dptune.strategies.base import Composed
from dptune.updates import AdamWOSM as AdamWOSMRule


@dataclass(frozen=True)
class AdamWOSM(Composed):
    """First moment only, with bias correction, at the effective step size (ESS):
      lr = ESS = α / (σ·C/L + 10⁻⁸),  α = 10⁻³   (Algorithm 2, line 3; σ = ν, L = expected batch)
      g̃_t = (Σ clip_C(g_i) + N(0, σ²C²I)) / L
      m_t = β₁ m_{t−1} + (1−β₁) g̃_t;  m̂_t = m_t / (1−β₁ᵗ);  θ_t = θ_{t−1} − lr · m̂_t
    = chain(FixedClip(C), updates.AdamWOSM(α, β₁)). Algorithm 2 line 8 divides by the
    realised |L_t|; dptune divides by the expected L (the realised size is private and the
    accountant assumes the expected one). Only C is tuned (Galli's grid for AdamWOSM is over C alone).
    """

    clip: float = 1.0
    alpha: float = 1e-3
    beta1: float = 0.9
    name = "adamwosm"
    hyperparameters = ("clip", "alpha", "beta1")

    def __post_init__(self) -> None:
        self.parts()

    def parts(self):
        return FixedClip(self.clip), AdamWOSMRule(self.alpha, self.beta1)

    def effective_step_size(self, run: RunInfo) -> float:
        rule = AdamWOSMRule(self.alpha, self.beta1)
        return rule.effective_step_size(run.noise_multiplier * self.clip, run.expected_batch_size)
