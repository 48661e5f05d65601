"""``oso``: OSO-DPSGD, online sensitivity optimisation (Galli, Palamidessi, Cucinotta, AAAI 2024)."""

from __future__ import annotations

from dataclasses import dataclass

from dptune.release.hypergradient import Rule
from dptune.release.privatizers import MIN_CLIP, OSOClip
from dptune.strategies.base import Composed
from dptune.updates import OSORate

__all__ = ["OSO", "MIN_CLIP"]


@dataclass(frozen=True)
class OSO(Composed):
    """OSO-DPSGD (Galli et al. 2024, Algorithm 1), with the seed's typos corrected:
    chain(OSOClip(C₀, ρ_c, ν_q, rule), OSORate(ρ₀, ρ_r, rule, μ)).

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

    Alternative rules (``rule``, shared by both parts):
      * ``additive``  (eqs. 13, 16): C_{t+1} = C_t + ρ_c ρ_t g̃_tᵀ q̃_{t−1};  ρ_{t+1} = ρ_t + ρ_r ρ_t g̃_tᵀ g̃_{t−1}
        (C is floored at 1e-8 and ρ at 1e-12 to remain valid);
      * ``normalized`` (eq. 19, Rubio 2017): C_{t+1} = C_t (1 + ρ_c cos(g̃_t, q̃_{t−1})),
        ρ_{t+1} = ρ_t (1 + ρ_r cos(g̃_t, g̃_{t−1})).

    Momentum (μ > 0, heavy ball m_t = μ m_{t−1} + g̃_t, θ_{t+1} = θ_t − ρ_t m_t): the C rule is
    unchanged and the ρ rule uses g̃_tᵀ m_{t−1} (derivation: docs/strategies.md, `oso`,
    "Momentum derivation"). q̃'s noise is drawn as one scalar for the exp and additive rules (same law, same
    ledger event: docs/privacy.md). Defaults: docs/strategies.md, "Defaults".
    """

    lr: float | None = None  # ρ₀; None → 200·(1 − μ)/(C₀·T) (docs/strategies.md, "Defaults")
    initial_clip: float = 1.0  # C₀
    clip_lr: float | None = None  # ρ_c; None → OSO_LOG_RANGE / T (horizon-aware; paper: 2.5e-3)
    lr_lr: float | None = None  # ρ_r; likewise
    q_noise_multiplier: float | None = None  # ν_q; None → from relative_increase
    relative_increase: float = 0.01  # allowed increase of ν_g over ν
    rule: Rule = "exp"
    momentum: float = 0.0
    adapt_lr: bool = True
    name = "oso"
    hyperparameters = (
        "lr",
        "initial_clip",
        "clip_lr",
        "lr_lr",
        "q_noise_multiplier",
        "relative_increase",
        "rule",
        "momentum",
        "adapt_lr",
    )

    def parts(self):
        return (
            OSOClip(
                self.initial_clip,
                self.clip_lr,
                self.q_noise_multiplier,
                self.relative_increase,
                self.rule,
            ),
            OSORate(self.lr, self.lr_lr, self.rule, self.momentum, self.adapt_lr),
        )
