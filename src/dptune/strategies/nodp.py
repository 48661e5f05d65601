"""``nodp``: the non-private SGD baseline (Galli's NoDP)."""

from __future__ import annotations

from dataclasses import dataclass

from dptune.release.privatizers import NonPrivate
from dptune.strategies.base import Composed
from dptune.updates import SGD


@dataclass(frozen=True)
class NoDP(Composed):
    """Plain (momentum) SGD on the mean loss of the Poisson-sampled batch:
    chain(NonPrivate(), SGD(lr, μ)).

    θ_{t+1} = θ_t − lr·m_t,  m_t = μ·m_{t−1} + ∇ℓ_B(θ_t)   (μ = 0: SGD).
    Not private: every step is recorded as a ``NonPrivateDpEvent`` (ε = ∞).
    """

    lr: float = 0.3  # measured (benchmarks/defaults.py): best of {0.03, 0.1, 0.3} on mnist5k and digits
    momentum: float = 0.0
    name = "nodp"
    private = False
    hyperparameters = ("lr", "momentum")

    def parts(self):
        return NonPrivate(), SGD(self.lr, self.momentum)
