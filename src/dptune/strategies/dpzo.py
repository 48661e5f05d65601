"""``dpzo``: DP zeroth-order optimisation (Tang, Panda, Nasr, Mahloujifar & Mittal 2024, "Private
Fine-tuning of Large Language Models with Zeroth-order Optimization"; Panda et al. 2024, §A.4)."""

from __future__ import annotations

from dataclasses import dataclass

from dptune.release.privatizers import ZerothOrderClip
from dptune.strategies.base import Composed
from dptune.updates import SGD


@dataclass(frozen=True)
class DPZO(Composed):
    """DP-ZO: SGD along one random direction per step, scaled by a privatized scalar.

      z_t ~ N(0, I_d)                                   (data-independent: may be public)
      d_i = (ℓ(θ_t + μz_t; x_i) − ℓ(θ_t − μz_t; x_i)) / (2μ)          (per example, i ∈ B_t)
      s̃_t = Σ_{i∈B_t} clip_C(d_i) + N(0, ν²C²)                        (clip_C(d) ∈ [−C, C])
      m_t = momentum·m_{t−1} + (s̃_t/L)·z_t;   θ_{t+1} = θ_t − η·m_t    (momentum 0: plain DP-ZO)

    = chain(ZerothOrderClip(C, μ), SGD(η, momentum)). E[(∇ℓ·z)z] = ∇ℓ for z ~ N(0, I): without
    clipping and noise the step is SGD in expectation, with a variance that grows with d (the
    method targets fine-tuning, where d is large but the loss is well conditioned).

    Privacy: the only release is the scalar sum, sensitivity C under add/remove of one example
    (each example contributes one term in [−C, C]), with noise N(0, (νC)²): one Poisson-sampled
    Gaussian of multiplier ν per step, the same event (and the same accounting, q and ν) as
    DP-SGD's. z_t comes from its own stream (derived from the run's noise seed, or the OS CSPRNG
    in secure mode) and is independent of the data; θ_{t+1} is post-processing of (z_t, s̃_t).

    Dividing by the expected batch size L (not |B_t|) as everywhere in dptune. Defaults: C = 1,
    μ = 10⁻³ (Tang et al., after MeZO), no momentum, and η by DP-SGD's linear scaling rule,
    η = r/(C·T) with r = 200 grown at low noise (Panda et al. apply their rule to DP-ZO, Table 14).
    Measured (benchmarks/panda_ablations.py; digits, logistic regression, ε = 3, T = 500, L = 256):
    the default (η = 0.4) reaches 0.79, as the best of η ∈ {0.003, …, 1} (0.3: 0.79); DP-SGD 0.94.
    """

    lr: float | None = None  # η; None: linear scaling, r/(C·T) (docs/strategies.md, "Defaults")
    clip: float = 1.0  # C
    perturbation: float = 1e-3  # μ
    momentum: float = 0.0
    name = "dpzo"
    hyperparameters = ("lr", "clip", "perturbation", "momentum")

    def parts(self):
        return ZerothOrderClip(self.clip, self.perturbation), SGD(self.lr, self.momentum)
