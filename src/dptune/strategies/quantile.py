"""``quantile``: FixedQuantile adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021)."""

from __future__ import annotations

from dataclasses import dataclass

from dptune.release.privatizers import QuantileClip
from dptune.strategies.base import Composed
from dptune.updates import SGD


@dataclass(frozen=True)
class FixedQuantile(Composed):
    """Clip at C_t and move C_t geometrically towards the γ-quantile of the gradient norms,
    then (momentum) SGD: chain(QuantileClip(γ, η_C, C₀, σ_b), SGD(lr, μ)).

      g̃_t = (Σ clip_{C_t}(g_i) + N(0, ν_g² C_t² I)) / L                 (sensitivity C_t)
      b̃_t = (Σ (1[‖g_i‖ ≤ C_t] − ½) + N(0, σ_b²)) / L + ½                (recentred count, sensitivity ½)
      C_{t+1} = C_t · exp(−η_C (b̃_t − γ))                                (Andrew et al., geometric update)
    with ν_g = (ν⁻² − (2σ_b)⁻²)^(−½), so that the pair is ONE Gaussian mechanism of
    multiplier ν (Andrew et al., Theorem 1; ``accounting.joint_noise_multiplier``).
    The count's σ_b defaults to L/20 (Andrew et al.'s default: expected batch / 20).
    Galli's settings: η_C = 0.2, γ ∈ {0.1, …, 0.9}, C₀ = 0.1 (pinned in the galli presets).
    Defaults: γ = 0.5 and η_C = 0.2 (Andrew et al.), C₀ = 1, μ = 0.9, and lr_t = 200·(1 − μ)/(C_t·T):
    linear scaling of the effective step lr_t·C_t/(1 − μ), which stays r/T while C_t moves to
    the median norm (measured: benchmarks/defaults.py). Galli's fixed lr and μ = 0 are pinned
    in their presets.
    """

    lr: float | None = None  # None: lr_t = 200·(1 − μ)/(C_t·T) (docs/strategies.md, "Defaults")
    target_quantile: float = 0.5  # γ (Andrew et al.: the median)
    clip_lr: float = 0.2  # η_C (Andrew et al.)
    initial_clip: float = 1.0  # C₀ (Galli: 0.1, pinned in their preset)
    count_noise_std: float | None = None  # σ_b; None → L/20
    momentum: float = 0.9
    name = "quantile"
    hyperparameters = (
        "lr",
        "target_quantile",
        "clip_lr",
        "initial_clip",
        "count_noise_std",
        "momentum",
    )

    def parts(self):
        return (
            QuantileClip(self.target_quantile, self.clip_lr, self.initial_clip, self.count_noise_std),
            SGD(self.lr, self.momentum),
        )
