"""``dpsgd``: FixedThreshold DP-SGD (Abadi et al. 2016), with optional heavy-ball momentum
(= DP-Momentum of Mohapatra et al. 2022, appendix A.1)."""

from __future__ import annotations

from dataclasses import dataclass

from dptune.release.privatizers import FixedClip
from dptune.strategies.base import Composed
from dptune.updates import SGD


@dataclass(frozen=True)
class DPSGD(Composed):
    """g̃_t = (Σ_{i∈B_t} clip_C(g_i) + N(0, ν²C²I)) / L          (Galli eqs. 4, 18; L = expected batch)
    m_t = μ·m_{t−1} + g̃_t;  θ_{t+1} = θ_t − lr·m_t                (μ = 0: DP-SGD; μ > 0: DP-Momentum)

    = chain(FixedClip(C), SGD(lr, μ)): one Poisson-sampled Gaussian release of multiplier ν per step.

    Defaults (docs/strategies.md, "Defaults"): C = 1 and μ = 0.9 (the momentum of Panda et al.
    and De et al.); lr by Panda et al.'s linear scaling rule, lr = r·(1 − μ)/(C·T) with
    r = 200, grown up to ×3 as the noise ν/L shrinks (r grows with ε), measured on mnist5k,
    digits, Adult and Fashion-MNIST. Galli's FixedThreshold is μ = 0 (pinned in the presets).
    """

    lr: float | None = None  # None: linear scaling, lr = 200·(1 − μ)/(C·T) (docs/strategies.md, "Defaults")
    clip: float = 1.0
    momentum: float = 0.9
    name = "dpsgd"
    hyperparameters = ("lr", "clip", "momentum")

    def parts(self):
        return FixedClip(self.clip), SGD(self.lr, self.momentum)
