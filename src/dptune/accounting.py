"""Privacy accounting on top of ``dp_accounting``: ε(δ) of events, noise calibration, GDP.

Everything here is a pure function of immutable ``DpEvent``s. No accountant is
hand-rolled: RDP and PLD come from ``dp_accounting``; the μ-GDP conversion is the
closed form of Dong, Roth & Su (2019), Corollary 2.13, used only for unsampled
(full-batch, q = 1) Gaussian mechanisms, where it is exact.

Neighbouring relation: add/remove one example, everywhere (sensitivities in the
engine are stated for that relation too).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Literal

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, stats

from dptune.errors import ConfigError

# dp_accounting's RDP code logs a warning for every order it skips; that is expected, not news.
logging.getLogger("absl").setLevel(logging.ERROR)

AccountantName = Literal["rdp", "pld", "gdp"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld", "gdp")

# PLD discretisation: 1e-4 is dp_accounting's default; it is pessimistic (upper bound) by design.
PLD_DISCRETIZATION = 1e-4


# ----------------------------------------------------------------------------- validation
def check_epsilon(eps: float, name: str = "epsilon") -> float:
    if not isinstance(eps, int | float) or not math.isfinite(eps) or eps <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {eps!r}. Pick e.g. {name}=3.0.")
    return float(eps)


def check_delta(delta: float, name: str = "delta") -> float:
    if not isinstance(delta, int | float) or not (0 < delta < 1):
        raise ConfigError(
            f"{name} must lie in (0, 1), got {delta!r}. A common choice is 1/n rounded down "
            "to a power of ten, e.g. delta=1e-5 for n=60,000."
        )
    return float(delta)


def check_sampling_rate(q: float) -> float:
    if not isinstance(q, int | float) or not (0 < q <= 1):
        raise ConfigError(
            f"sampling rate q must lie in (0, 1], got {q!r}. q = expected_batch_size / n; "
            "q = 1 means full batch."
        )
    return float(q)


def check_accountant(name: str) -> str:
    if name not in ACCOUNTANTS:
        raise ConfigError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}.")
    return name


# ----------------------------------------------------------------------------- events
def gaussian_step_event(noise_multiplier: float, sampling_rate: float) -> dp_event.DpEvent:
    """One release of a Gaussian sum query over a Poisson sample of rate ``sampling_rate``.

    With q = 1 (full batch) the event is a plain Gaussian: there is no sampling to amplify.
    """
    g = dp_event.GaussianDpEvent(float(noise_multiplier))
    if sampling_rate >= 1.0:
        return g
    return dp_event.PoissonSampledDpEvent(float(sampling_rate), g)


def dpsgd_event(noise_multiplier: float, sampling_rate: float, steps: int, runs: int = 1) -> dp_event.DpEvent:
    """``runs`` independent runs of ``steps`` Poisson-sampled Gaussian releases."""
    ev = dp_event.SelfComposedDpEvent(gaussian_step_event(noise_multiplier, sampling_rate), int(steps))
    if runs != 1:
        ev = dp_event.SelfComposedDpEvent(ev, int(runs))
    return ev


def joint_noise_multiplier(component_multipliers: Iterable[float]) -> float:
    """Noise multiplier of several Gaussian queries released together on the same batch.

    Query i has L2 sensitivity s_i and noise std ν_i·s_i. Dividing each by its std gives
    one vector with unit noise whose sensitivity is sqrt(Σ ν_i⁻²); hence the pair/tuple is
    one Gaussian mechanism of multiplier (Σ ν_i⁻²)^(-1/2). This is Galli et al.'s
    Proposition 1 (OSO's q-query) and Andrew et al.'s Theorem 1 (the quantile count,
    sensitivity ½ with std σ_b, i.e. ν_b = 2σ_b).
    """
    inv = 0.0
    for nu in component_multipliers:
        if nu <= 0:
            raise ConfigError(f"noise multipliers must be > 0, got {nu}")
        if math.isinf(nu):
            continue
        inv += nu**-2
    if inv == 0.0:
        return math.inf
    return inv**-0.5


def split_noise_multiplier(nu: float, nu_aux: float) -> float:
    """ν_g such that (ν_g, ν_aux) jointly form one Gaussian of multiplier ν: (ν⁻² − ν_aux⁻²)^(-1/2)."""
    if nu_aux <= nu:
        raise ConfigError(
            f"the auxiliary query's noise multiplier ({nu_aux:.4g}) must exceed the total noise "
            f"multiplier ν = {nu:.4g}; otherwise no budget is left for the gradient. Increase the "
            "auxiliary noise (e.g. the quantile count's σ_b, or OSO's ν_q), or the total ν."
        )
    return (nu**-2 - nu_aux**-2) ** -0.5


def oso_q_noise_multiplier(nu: float, relative_increase: float = 0.01) -> float:
    """ν_q that raises the gradient's ν_g by ``relative_increase`` over ν (Galli §Privacy Analysis).

    From ν_g = (1 + r)ν and Proposition 1: ν_q = ν / sqrt(1 − (1 + r)⁻²); r = 1% → ν_q ≈ 7.124ν.
    """
    if relative_increase <= 0:
        raise ConfigError(f"relative_increase must be > 0, got {relative_increase}")
    return nu / math.sqrt(1.0 - (1.0 + relative_increase) ** -2)


# ----------------------------------------------------------------------------- GDP closed form
def gdp_delta(mu: float, eps: float) -> float:
    """δ(ε) of μ-GDP (Dong et al. 2019, Corollary 2.13)."""
    if mu <= 0:
        return 0.0
    return float(stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ε with δ(ε) ≤ δ for μ-GDP (root of the exact trade-off, not a bound)."""
    if math.isinf(mu):
        return math.inf
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12))


def gdp_mu_for_epsilon(eps: float, delta: float) -> float:
    """The μ whose (ε, δ) curve passes through the target: the largest μ with δ(ε) ≤ δ."""
    check_epsilon(eps)
    check_delta(delta)
    lo, hi = 1e-6, 1.0
    while gdp_delta(hi, eps) < delta:
        hi *= 2
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


# ----------------------------------------------------------------------------- ε(δ)
def make_accountant(name: str) -> dp_accounting.PrivacyAccountant:
    check_accountant(name)
    if name == "rdp":
        return rdp_privacy_accountant.RdpAccountant()
    if name == "pld":
        return pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    raise ConfigError("the 'gdp' accountant has no dp_accounting object; call epsilon() directly.")


def epsilon(event: dp_event.DpEvent, delta: float, accountant: str = "rdp") -> float:
    """ε at δ of ``event`` (add/remove neighbours)."""
    check_delta(delta)
    check_accountant(accountant)
    if accountant == "gdp":
        return gdp_epsilon(gdp_mu_of_event(event), delta)
    return float(make_accountant(accountant).compose(event).get_epsilon(delta))


@functools.lru_cache(maxsize=4096)
def _epsilon_cached(event: dp_event.DpEvent, delta: float, accountant: str) -> float:
    return epsilon(event, delta, accountant)


def calibrate_event(
    make_event: Callable[[float], dp_event.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str = "rdp",
    *,
    rel_tol: float = 1e-4,
    bracket: tuple[float, float] | None = None,
) -> float:
    """Smallest noise multiplier ν with ε(make_event(ν), δ) ≤ target. Never overshoots.

    Bisection on log ν, keeping the invariant that ``hi`` is feasible (ε ≤ target). The
    returned value is always a checked-feasible ``hi``, so the result can never exceed
    the target, whatever the accountant's numerical noise. Evaluations are cached, so a
    planner that calibrates the same grid twice pays once.
    """
    check_epsilon(target_epsilon, "target epsilon")
    check_delta(delta)
    check_accountant(accountant)

    def eps_of(nu: float) -> float:
        return _epsilon_cached(make_event(nu), delta, accountant)

    lo, hi = bracket if bracket else (0.05, 1.0)
    # Expand until hi feasible and lo infeasible.
    for _ in range(60):
        if eps_of(hi) <= target_epsilon:
            break
        lo, hi = hi, hi * 2
    else:
        raise ConfigError(f"could not reach ε ≤ {target_epsilon} even with ν = {hi:.3g}")
    for _ in range(60):
        if eps_of(lo) > target_epsilon:
            break
        hi, lo = lo, lo / 2
        if lo < 1e-6:
            return hi
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if eps_of(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def calibrate(
    eps: float,
    delta: float,
    q: float,
    steps: int,
    runs: int = 1,
    accountant: str = "rdp",
    *,
    rel_tol: float = 1e-4,
) -> float:
    """Smallest per-step noise multiplier ν such that ``runs`` runs of ``steps`` Poisson-sampled
    Gaussian releases at rate ``q`` are (eps, delta)-DP in total. Never overshoots eps."""
    check_sampling_rate(q)
    if steps < 1 or runs < 1:
        raise ConfigError(f"steps and runs must be ≥ 1, got steps={steps}, runs={runs}")
    if accountant == "gdp":
        if q < 1:
            raise ConfigError("accountant='gdp' needs full batch (q = 1); use 'pld' or 'rdp'.")
        # Closed form: μ_total = sqrt(runs·steps)/ν; pick the largest admissible μ, then
        # nudge ν up until the exact conversion confirms the target.
        mu = gdp_mu_for_epsilon(eps, delta)
        nu = math.sqrt(runs * steps) / mu
        while gdp_epsilon(math.sqrt(runs * steps) / nu, delta) > eps:
            nu *= 1 + 1e-9
        return nu
    bracket = None
    if accountant == "pld":
        # RDP is looser than PLD, so ν_rdp is feasible for PLD: a tight upper bracket.
        nu_rdp = calibrate(eps, delta, q, steps, runs, "rdp", rel_tol=1e-3)
        bracket = (nu_rdp * 0.5, nu_rdp)
    return calibrate_event(
        lambda nu: dpsgd_event(nu, q, steps, runs), eps, delta, accountant, rel_tol=rel_tol, bracket=bracket
    )
