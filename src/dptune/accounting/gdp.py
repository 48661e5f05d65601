"""Exact μ-GDP (Dong, Roth & Su 2019, Cor. 2.13), used only for unsampled Gaussians: a composition of
multipliers ν_i is μ-GDP with μ = sqrt(Σ ν_i⁻²)."""

from __future__ import annotations

import math

import mpmath
from dp_accounting import dp_event
from scipy import optimize, special

from dptune.accounting.events import check_delta, check_epsilon
from dptune.errors import ConfigError


def gdp_delta(mu: float, eps: float) -> float:
    """δ(ε) of μ-GDP (Dong et al. 2019, Corollary 2.13)."""
    if mu <= 0:
        return 0.0
    # special.ndtr is the standard normal CDF that stats.norm.cdf wraps, ~100× cheaper per scalar
    # call (planning a Mohapatra paper-scale study makes ~25k of these calls).
    a, b = -eps / mu + mu / 2, -eps / mu - mu / 2
    if mu < 1e-2:  # Φ(a) and e^ε·Φ(b) cancel to ~1/μ ulps: 80 digits (found in review: ν calibrated 4e-11 over)
        with mpmath.workdps(80):
            m, e = mpmath.mpf(mu), mpmath.mpf(eps)
            return float(mpmath.ncdf(-e / m + m / 2) - mpmath.exp(e) * mpmath.ncdf(-e / m - m / 2))
    # e^ε·Φ(b) as exp(ε + log Φ(b)) ≤ Φ(a): no overflow past ε ≈ 709 (found in review: a spent run lost)
    return float(special.ndtr(a) - math.exp(eps + special.log_ndtr(b)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ε with δ(ε) ≤ δ for μ-GDP (root of the exact trade-off, not a bound)."""
    if math.isinf(mu):
        return math.inf
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2
    e = float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12))
    # brentq lands within xtol of the root, on either side: step up to a checked δ(ε) ≤ δ so
    # the reported ε is never below the root (and calibration against it never overshoots).
    step = 1e-15
    while gdp_delta(mu, e) > delta and e < hi:
        e, step = min(e + max(step, math.ulp(e)), hi), step * 2
    return e


def gdp_mu_for_epsilon(eps: float, delta: float) -> float:
    """The μ whose (ε, δ) curve passes through the target: the largest μ with δ(ε) ≤ δ."""
    check_epsilon(eps)
    check_delta(delta)
    lo, hi = 1e-6, 1.0
    while gdp_delta(hi, eps) < delta:
        hi *= 2
    while gdp_delta(lo, eps) >= delta and lo > 1e-300:  # a tiny ε: μ below 1e-6 (found in review: scipy's error)
        lo /= 16
    return float(optimize.brentq(lambda m: gdp_delta(m, eps) - delta, lo, hi, xtol=1e-12))


def gdp_mu_of_event(event: dp_event.DpEvent) -> float:
    """μ of a composition of unsampled Gaussian events: μ = sqrt(Σ ν_i⁻²). Raises otherwise."""
    if isinstance(event, dp_event.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_event.NonPrivateDpEvent):
        return math.inf
    if isinstance(event, dp_event.GaussianDpEvent):
        return 1.0 / event.noise_multiplier if event.noise_multiplier > 0 else math.inf
    if isinstance(event, dp_event.PoissonSampledDpEvent) and event.sampling_probability >= 1.0:
        return gdp_mu_of_event(event.event)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return math.sqrt(event.count) * gdp_mu_of_event(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return math.sqrt(sum(gdp_mu_of_event(e) ** 2 for e in event.events))
    raise ConfigError(
        f"the 'gdp' accountant is exact only for full-batch Gaussian releases; got {type(event).__name__}. "
        "Use accountant='pld' (tight) or 'rdp' for Poisson-subsampled runs."
    )
