"""Closed forms of the tuning methods' privacy: Liu–Talwar, repeat-and-select, Panda's GDP sum. Statements
and the papers' misprints corrected here: docs/tuning.md."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dptune import accounting
from dptune.errors import ConfigError


# ----------------------------------------------------------------------------- Liu–Talwar
def lt_max_runs(gamma: float, delta2: float) -> int:
    """T_max = ⌈(1/γ)·ln(1/δ₂)⌉ (Liu & Talwar Thm 3.4; Mohapatra Alg. 1's Υ)."""
    if not 0 < gamma <= 1:
        raise ConfigError(f"γ must lie in (0, 1], got {gamma}.")
    if not 0 < delta2 < 1:
        raise ConfigError(f"δ₂ must lie in (0, 1), got {delta2}.")
    t = max(1, math.ceil(math.log(1.0 / delta2) / gamma - 1e-12))  # - 1e-12: an exact integer stays itself
    while (1.0 - gamma) ** t > delta2:  # the truncation mass must stay ≤ δ₂ even where the slack cut a step
        t += 1
    return t


def lt_total(eps1: float, delta1: float, gamma: float, delta2: float) -> tuple[float, float]:
    """(ε, δ) of LT random stopping over (ε₁, δ₁)-DP runs: (3ε₁ + 3√(2δ₁), √(2δ₁)·T_max + δ₂)."""
    s = math.sqrt(2.0 * delta1)
    return 3.0 * eps1 + 3.0 * s, s * lt_max_runs(gamma, delta2) + delta2


@dataclass(frozen=True)
class LTParams:
    """The per-run budget (ε₁, δ₁) that makes LT random stopping meet a total (ε, δ)."""

    eps1: float
    delta1: float
    gamma: float
    delta2: float
    t_max: int
    total: tuple[float, float]  # (ε, δ) by the theorem, ≤ the target


def lt_solve(eps: float, delta: float, gamma: float, delta2_fraction: float = 0.5) -> LTParams:
    """Theorem 3.4 solved for (ε₁, δ₁): δ₂ = fraction·δ, √(2δ₁) = (δ − δ₂)/T_max, ε₁ = ε/3 − √(2δ₁)."""
    accounting.check_epsilon(eps)
    accounting.check_delta(delta)
    delta2 = delta2_fraction * delta
    t_max = lt_max_runs(gamma, delta2)
    s = (delta - delta2) / t_max
    delta1 = s * s / 2.0
    eps1 = eps / 3.0 - s
    if eps1 <= 0:
        raise ConfigError(
            f"Liu–Talwar: with ε = {eps} there is no budget left per run (ε₁ = ε/3 − √(2δ₁) = {eps1:.3g}). "
            "Raise ε or lower δ₂'s share (method.delta2_fraction)."
        )
    # Rounding: shave ε₁/δ₁ by one ulp-ish so that the theorem's total never exceeds the target.
    eps1 = math.nextafter(eps1, 0.0)
    while True:
        tot = lt_total(eps1, delta1, gamma, delta2)
        if tot[0] <= eps and tot[1] <= delta:
            break
        delta1 *= 1 - 1e-12
        eps1 = math.nextafter(eps1, 0.0)
    return LTParams(eps1, delta1, gamma, delta2, t_max, tot)


class SecretCoins:
    """The random draws of Liu–Talwar and repeat-and-select (K, each candidate) from the OS CSPRNG: both
    theorems hide K and the winner, which the public seed would reveal. ``seed``: a SECRET seed (never stored)."""

    def __init__(self, seed: int | None = None):
        import random
        import secrets

        self._r = secrets.SystemRandom() if seed is None else random.Random(seed)
        self.secure = seed is None

    def random(self) -> float:
        return self._r.random()

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * self._r.random()

    def integers(self, low: int, high: int | None = None) -> int:
        if high is None:
            low, high = 0, low
        return low + self._r.randrange(high - low)

    def poisson(self, lam: float) -> int:
        """Inversion in log space (exact up to float rounding; O(λ) steps, fine for a planner)."""
        u, k, log_p = self._r.random(), 0, -lam
        cdf = math.exp(log_p)
        while u >= cdf:
            k += 1
            log_p += math.log(lam) - math.log(k)
            cdf += math.exp(log_p)
            if k > lam and log_p < -60.0:  # float rounding kept cdf below u: the rest is < e⁻⁶⁰
                break
        return k


def lt_stops(gamma: float, t_max: int, rng: np.random.Generator | SecretCoins) -> int:
    """Number of runs LT makes: flip a γ-coin after each run, at most T_max runs (the coins do not
    depend on the data: drawing them up front is the same algorithm)."""
    k = 1
    while k < t_max and rng.random() >= gamma:
        k += 1
    return k


# ----------------------------------------------------------------------------- repeat-and-select
def tnb_mean(gamma: float, shape: float) -> float:
    """E[K] of the truncated negative binomial D_{η,γ} (Papernot & Steinke, Def. 1)."""
    if shape == 1:
        return 1.0 / gamma
    if shape == 0:
        return (1.0 - gamma) / (gamma * math.log(1.0 / gamma)) if gamma < 1 else 1.0
    return shape * (1.0 - gamma) / (gamma * (1.0 - gamma**shape)) if gamma < 1 else 1.0


def tnb_gamma(shape: float, mean: float) -> float:
    """γ of D_{η,γ} with the given mean — the same conservative γ dp_accounting uses."""
    try:  # same numbers as the accountant's own inversion (private helper; fall back below)
        return float(rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, mean))
    except AttributeError:  # pragma: no cover - dp_accounting renamed it
        lo, hi = 0.0, min(1.0, 2 * (shape + 1) / mean)
        while hi > lo * (1 + 1e-9):
            mid = (lo + hi) / 2
            if tnb_mean(mid, shape) < mean:
                hi = mid
            else:
                lo = mid
        return lo


def sample_repetitions(mean: float, shape: float, rng: np.random.Generator | SecretCoins) -> int:
    """K ~ Poisson(mean) (shape = ∞) or the truncated negative binomial with that mean.

    P[K = k] ∝ (1−γ)^k · Π_{l<k} (l+η)/(l+1) for k ≥ 1 (η > 0); ∝ (1−γ)^k / k (η = 0)."""
    if math.isinf(shape):
        return int(rng.poisson(mean))
    gamma = tnb_gamma(shape, mean)
    if gamma >= 1:
        return 1
    u = rng.random()
    log1m = math.log1p(-gamma)
    # log of the normaliser: ln(1/γ) for η = 0 (logarithmic), γ^(−η) − 1 otherwise.
    log_norm = math.log(math.log(1.0 / gamma)) if shape == 0 else math.log(gamma**-shape - 1.0)
    cdf, k, log_prod = 0.0, 0, 0.0  # log_prod = log Π_{l<k} (l+η)/(l+1)
    while k < 10_000_000:
        k += 1
        if shape == 0:
            log_p = k * log1m - math.log(k) - log_norm
        else:
            log_prod += math.log((k - 1 + shape) / k)
            log_p = k * log1m + log_prod - log_norm
        cdf += math.exp(log_p)
        if u < cdf:
            break
    return k


def repeat_and_select_event(event, mean: float, shape: float):
    return dp_event.RepeatAndSelectDpEvent(event, float(mean), float(shape))


# ----------------------------------------------------------------------------- Panda (GDP)
def panda_total_epsilon(runs: Sequence[tuple[int, float]], delta: float) -> float:
    """ε at δ of Panda's HPO: ``runs`` [(count, ε_i)] composed as μ-GDP (appendix A.7)."""
    mus = [accounting.gdp_mu_for_epsilon(e, delta) for _, e in runs]
    mu = math.sqrt(sum(c * m * m for (c, _), m in zip(runs, mus, strict=True)))
    return accounting.gdp_epsilon(mu, delta)


def rerr(ours: float, random_search: float, oracle: float, higher_is_better: bool = True) -> float:
    """Relative error-rate reduction (Panda et al. §5.2.3, Table 3), as a fraction:
    1 − err_ours / err_random = (ours − random) / (oracle − random), errors measured to the oracle. NaN where the
    oracle does not beat random search: the ratio of two negative gaps read as a large gain (found in review)."""
    gap = (oracle - random_search) if higher_is_better else (random_search - oracle)
    gain = (ours - random_search) if higher_is_better else (random_search - ours)
    return gain / gap if gap > 0 else math.nan


# ----------------------------------------------------------------------------- Mohapatra App. F
@dataclass(frozen=True)
class LtVsMa:
    n: int
    delta: float
    k_max: int  # the most candidates MA composition affords for LT's price
    rows: tuple[tuple[int, float, float], ...]  # (k, ε_LT(k), ε_MA(k))


def delta_for_n(n: int) -> float:
    """Mohapatra et al.: δ_f = 1/n rounded down to the nearest power of ten."""
    return 10.0 ** math.floor(math.log10(1.0 / n))


def lt_vs_ma(
    n: int,
    sigma: float = 4.0,
    L: float = 250,
    T: int = 10000,
    *,
    ks: Iterable[int] = range(1, 61),
    delta: float | None = None,
    delta2_fraction: float = 0.5,
    conversion: str = "tight",
) -> LtVsMa:
    """Mohapatra et al. (2022), App. F / Fig. 6: ε of k candidates by LT (γ = 1/k) and by composition (MA),
    and ``k_max`` (docs/tuning.md); ``conversion``: ``tight`` (dp_accounting) or ``classic`` RDP→(ε, δ)."""
    if conversion not in ("tight", "classic"):
        raise ConfigError(f"conversion must be 'tight' or 'classic', got {conversion!r}.")
    delta = delta_for_n(n) if delta is None else float(delta)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(accounting.dpsgd_event(sigma, L / n, T))
    orders, rdp1 = np.asarray(acc.orders, dtype=float), np.asarray(acc.rdp, dtype=float)

    def eps_of(rdp: np.ndarray, d: float) -> float:
        if conversion == "classic":
            return float(np.min(rdp + math.log(1.0 / d) / (orders - 1.0)))
        return float(rdp_privacy_accountant.compute_epsilon(orders, rdp, d)[0])

    rows, delta2 = [], delta2_fraction * delta
    for k in ks:  # LT at γ = 1/k (as lt_total), MA: k runs composed
        s = (delta - delta2) / lt_max_runs(1.0 / k, delta2)
        rows.append((k, 3.0 * eps_of(rdp1, s * s / 2.0) + 3.0 * s, eps_of(k * rdp1, delta)))
    affordable = [k for k, a, b in rows if b <= a]
    return LtVsMa(n, delta, max(affordable) if affordable else 0, tuple(rows))


# ----------------------------------------------------------------------------- Mohapatra App. D, Theorem 4
@dataclass(frozen=True)
class ConvexDPSGDStep:
    """Theorem 4's optimum: the step α_opt, the bound (Eq. 1) there, and the effective step α_opt·C."""

    alpha: float  # α_opt = R / (C·√(T·(1 + σ²)))
    bound: float  # Eq. (1) at α_opt = R·C·√(1 + σ²)/√T
    effective_step: float  # α_opt·C = R/√(T·(1 + σ²)): the same for every C (best α ∝ 1/C)


def _positive_finite(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{name} must be a finite number > 0, got {v!r}. Fix: pass a positive value.")


def _theorem4_args(radius: float, clip: float, sigma: float, steps: int) -> None:
    _positive_finite(radius=radius, clip=clip)
    if not (isinstance(sigma, int | float) and not isinstance(sigma, bool) and math.isfinite(sigma) and sigma >= 0):
        raise ConfigError(f"sigma must be a finite number ≥ 0, got {sigma!r}. Fix: pass the noise multiplier.")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"steps must be an integer ≥ 1, got {steps!r}. Fix: pass the number of iterations T.")


def convex_dpsgd_bound(alpha: float, radius: float, clip: float, sigma: float, steps: int) -> float:
    """Mohapatra et al. (2022), appendix D, Eq. (1): E[f(x̄_T) − f(x*)] ≤ R²/(2αT) + α·C²·(1 + σ²)/2
    after T noisy projected gradient steps of size α (assumptions: docs/tuning.md, "Theorem 4")."""
    _positive_finite(alpha=alpha)
    _theorem4_args(radius, clip, sigma, steps)
    return radius**2 / (2.0 * alpha * steps) + alpha * clip**2 * (1.0 + sigma**2) / 2.0


def convex_dpsgd_step(radius: float, clip: float, sigma: float, steps: int) -> ConvexDPSGDStep:
    """Mohapatra et al. (2022), App. D, Theorem 4 (misprints corrected: docs/tuning.md): α_opt =
    R / (C·√(T·(1 + σ²))), the bound R·C·√(1 + σ²)/√T, and α_opt·C."""
    _theorem4_args(radius, clip, sigma, steps)
    root = math.sqrt(steps * (1.0 + sigma**2))
    alpha = radius / (clip * root)
    return ConvexDPSGDStep(alpha, radius * clip * math.sqrt(1.0 + sigma**2) / math.sqrt(steps), radius / root)
