"""``dpadam``: DP-Adam (Adam of Kingma & Ba on the DP-SGD noisy gradient; Mohapatra et al. A.1)."""

from __future__ import annotations

from dataclasses import dataclass

from dptune.release.privatizers import FixedClip
from dptune.strategies.base import Composed
from dptune.updates import Adam


@dataclass(frozen=True)
class DPAdam(Composed):
    """g̃_t as in DP-SGD, then Adam with bias correction: chain(FixedClip(C), Adam(lr, β₁, β₂, ε)).
      m_t = β₁ m_{t−1} + (1−β₁) g̃_t,   v_t = β₂ v_{t−1} + (1−β₂) g̃_t²
      θ_{t+1} = θ_t − lr · m̂_t / (√v̂_t + ε),  m̂_t = m_t/(1−β₁ᵗ), v̂_t = v_t/(1−β₂ᵗ)
    Adam is post-processing of g̃_t: one Gaussian release of multiplier ν per step.
    Default lr = 0.8/T (linear scaling for Adam, measured: docs/strategies.md, "Defaults");
    Mohapatra et al.'s 1e-3 is pinned in their presets.
    """

    lr: float | None = None  # None: linear scaling, lr = 0.8/T (docs/strategies.md, "Defaults")
    clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    name = "dpadam"
    hyperparameters = ("lr", "clip", "beta1", "beta2", "eps")

    def parts(self):
        return FixedClip(self.clip), Adam(self.lr, self.beta1, self.beta2, self.eps)
