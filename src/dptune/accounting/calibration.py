"""Noise calibration: the smallest ν whose ε meets a target, never above it (``calibrate``), and
printing ν (never rounded down). Speed: docs/performance.md, "3. Calibration"."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dp_accounting import dp_event
from scipy import optimize

from dptune.accounting import _fast_pld, gdp
from dptune.accounting.accountants import (
    PLD_DISCRETIZATION,
    PLD_MIN_NOISE,
    epsilon,
    epsilon_cached,
    pld_cost_problem,
    tightest_accountant,
)
from dptune.accounting.events import (
    check_accountant,
    check_delta,
    check_epsilon,
    check_sampling_rate,
    count_or_none,
    dpsgd_event,
    gaussian_step_event,
    releases_of,
)
from dptune.accounting.solver import LogEps, solve
from dptune.errors import ConfigError
from dptune.rounding import round_up

PLD_COARSE_DISCRETIZATION = 1e-3  # search level: ~1% pessimistic in ε, 5-10x cheaper
PLD_MID_RATIO = 0.3  # a second level at 0.3x the coarse one extrapolates ε to PLD_DISCRETIZATION


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Result of a calibration with its certificate: ``noise_multiplier`` (hi) checked to give
    ``epsilon`` ≤ target and ``lower`` (lo; 0 when ν → 0 stays feasible) ε > target, so hi/lo ≤ 1 + rel_tol."""

    noise_multiplier: float
    epsilon: float  # ε at noise_multiplier, ≤ the target
    delta: float
    accountant: str
    lower: float
    evaluations: int  # evaluations at the reported accountant's default precision
    search_evaluations: int  # cheaper evaluations (coarse PLD discretisations) used to search
    seconds: float


def calibrate(
    target_epsilon: float,
    delta: float,
    sampling_rate: float | None = None,
    steps: int | None = None,
    runs: int = 1,
    accountant: str = "auto",
    *,
    make_event: Callable[[float], dp_event.DpEvent] | None = None,
    rel_tol: float = 1e-4,
    bracket: tuple[float, float] | None = None,
) -> Calibration:
    """Smallest noise multiplier ν with ε(event(ν), δ) ≤ ``target_epsilon``. Never overshoots.

    The event: ``runs`` runs of ``steps`` Poisson-sampled Gaussians at ``sampling_rate`` (cached), or ``make_event(ν)``.
    The returned ν was checked feasible by ``epsilon(event, delta, accountant)`` itself, whatever the accountant's
    numerical noise. ``bracket``: a starting hint. ``accountant='auto'``: the tightest (PLD; exact GDP at q = 1)."""
    if accountant == "auto":
        accountant = tightest_accountant(sampling_rate or 0.0, (steps or 0) * runs, delta)  # None: a sampled event
    span = _check_bracket(bracket)
    if make_event is not None and (sampling_rate is not None or steps is not None or runs != 1):
        raise ConfigError(
            f"calibrate got both make_event and a run (sampling_rate={sampling_rate!r}, steps={steps!r}, "
            f"runs={runs!r}). Fix: pass one of them; make_event(ν) must return the whole event, runs included."
        )
    # The one check of (ε, δ) and the accountant on the way to a calibration.
    check_epsilon(target_epsilon, "target_epsilon")
    check_delta(delta)
    check_accountant(accountant)
    if make_event is not None:
        return _calibrate_event(make_event, target_epsilon, delta, accountant, rel_tol, span)
    if sampling_rate is None:
        raise ConfigError(
            "calibrate needs the run to calibrate. Fix: pass sampling_rate and steps (a DP-SGD run, e.g. "
            "calibrate(3.0, 1e-5, sampling_rate=0.01, steps=1000)) or make_event (a function ν → DpEvent)."
        )
    check_sampling_rate(sampling_rate)
    steps_i, runs_i = count_or_none(steps), count_or_none(runs)
    if steps_i is None or runs_i is None:
        raise ConfigError(
            f"steps and runs must be integers ≥ 1, got steps={steps!r}, runs={runs!r}. Fix: e.g. steps=1000, runs=1."
        )
    return _calibrate_dpsgd_cached(
        float(target_epsilon), float(delta), float(sampling_rate), steps_i, runs_i, accountant, float(rel_tol), span
    )


def _check_bracket(bracket: tuple[float, float] | None) -> tuple[float, float] | None:
    if bracket is None:
        return None
    try:
        b_lo, b_hi = sorted(float(b) for b in bracket)
    except (TypeError, ValueError):
        b_lo = b_hi = math.nan
    if not (b_lo > 0 and math.isfinite(b_hi)):
        raise ConfigError(
            f"bracket must hold two positive noise multipliers, got {bracket!r}. Fix: e.g. bracket=(0.5, 2.0), "
            "or leave it out."
        )
    return b_lo, b_hi


@functools.lru_cache(maxsize=1024)
def _calibrate_dpsgd_cached(
    eps: float,
    delta: float,
    q: float,
    steps: int,
    runs: int,
    accountant: str,
    rel_tol: float,
    bracket: tuple[float, float] | None,
) -> Calibration:
    if accountant == "gdp":
        return _calibrate_gdp_closed_form(eps, delta, q, steps, runs)
    return _calibrate_event(lambda nu: dpsgd_event(nu, q, steps, runs), eps, delta, accountant, rel_tol, bracket)


def _calibrate_gdp_closed_form(eps: float, delta: float, q: float, steps: int, runs: int) -> Calibration:
    """μ = sqrt(runs·steps)/ν, nudged up until both reporting forms confirm the target (docs/accounting.md)."""
    t0 = time.perf_counter()
    if q < 1:
        raise ConfigError("accountant='gdp' needs full batch (q = 1); use 'pld' or 'rdp'.")
    mu = gdp.gdp_mu_for_epsilon(eps, delta)

    def eps_of(v: float) -> float:  # dpsgd_event(ν) and the ledger's grouped form: both must meet eps
        grouped = dp_event.SelfComposedDpEvent(gaussian_step_event(v, 1.0), runs * steps)
        return max(epsilon(dpsgd_event(v, 1.0, steps, runs), delta, "gdp"), epsilon(grouped, delta, "gdp"))

    nu = math.sqrt(runs * steps) / mu
    e_nu, evals, step = eps_of(nu), 1, 1e-15
    while e_nu > eps:  # a few ulps to go: steps that double reach any gap quickly
        nu *= 1 + step
        e_nu, evals, step = eps_of(nu), evals + 1, step * 2
    # The certificate's lower end: a multiplier checked to miss the target.
    lower, step = 0.0, 1e-12
    while step < 1:
        evals += 1
        if eps_of(nu / (1 + step)) > eps:
            lower = nu / (1 + step)
            break
        step *= 10
    return Calibration(
        noise_multiplier=nu, epsilon=e_nu, delta=delta, accountant="gdp", lower=lower, evaluations=evals,
        search_evaluations=0, seconds=time.perf_counter() - t0,
    )  # fmt: skip


def _calibrate_event(
    make_event: Callable[[float], dp_event.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str,
    rel_tol: float,
    bracket: tuple[float, float] | None,
) -> Calibration:
    if not (rel_tol > 0):
        raise ConfigError(f"rel_tol must be > 0, got {rel_tol!r}. Fix: e.g. rel_tol=1e-4.")
    t0 = time.perf_counter()
    tol = math.log1p(rel_tol)
    clt = _guess(make_event, target_epsilon, delta)
    if bracket is not None:
        # A bracket is a hint (it need not contain the root): the CLT guess wins when it
        # lies inside it (e.g. planners that pass (ν_rdp/2, ν_rdp) for PLD).
        b_lo, b_hi = bracket
        guess = clt if clt is not None and b_lo <= clt <= b_hi else math.sqrt(b_lo * b_hi)
    else:
        guess = clt if clt is not None else 1.0

    bounded = _pld_cost_guard(make_event, target_epsilon, delta, guess) if accountant == "pld" else lambda nu: nu

    def eps_at(nu: float) -> float:  # an accountant's math error (RDP underflowing at huge ν): not a certificate
        event = make_event(bounded(nu))  # a ConfigError (PLD's cost guard) is the caller's
        try:
            return epsilon_cached(event, delta, accountant)
        except (ValueError, OverflowError, ZeroDivisionError):  # found in review: "math domain error" at ε = 1e-3
            return math.inf

    fine = LogEps(eps_at, target_epsilon)
    search_evals = 0
    if accountant == "pld":
        lo, hi, search_evals = _search_pld(make_event, bounded, fine, target_epsilon, delta, guess, tol)
    else:
        lo, hi = solve(fine, math.log(guess), tol, target_epsilon)
    eps_hi = fine.eps[hi]
    # The guarantee, re-stated: the returned ν was evaluated by the reporting accountant.
    assert eps_hi <= target_epsilon
    return Calibration(
        noise_multiplier=math.exp(hi), epsilon=eps_hi, delta=delta, accountant=accountant,
        lower=math.exp(lo) if lo is not None else 0.0, evaluations=len(fine.values),
        search_evaluations=search_evals, seconds=time.perf_counter() - t0,
    )  # fmt: skip


def _pld_cost_guard(
    make_event: Callable[[float], dp_event.DpEvent], target_epsilon: float, delta: float, guess: float
) -> Callable[[float], float]:
    """ν ↦ ν, refusing up front a ν or release count whose PLD would take minutes and gigabytes."""
    releases = releases_of(make_event(1.0))

    def bounded(nu: float) -> float:
        problem = pld_cost_problem(nu, releases) if releases else None
        if problem is not None:
            raise ConfigError(
                f"calibrating ν to ε = {target_epsilon:g} at δ = {delta:g} with the PLD accountant: {problem} "
                "(a large ε, a tiny sampling rate, or many steps and runs). Fix: use the 'rdp' accountant (its cost does not grow "
                "with ν or the steps), or a smaller ε / fewer steps."
            )
        return nu

    if guess < PLD_MIN_NOISE:  # the CLT guess is within a few %: no PLD built
        bounded(guess)
    bounded(PLD_MIN_NOISE)  # the count alone
    return bounded


def _search_pld(
    make_event: Callable[[float], dp_event.DpEvent],
    bounded: Callable[[float], float],
    fine: LogEps,
    target_epsilon: float,
    delta: float,
    guess: float,
    tol: float,
) -> tuple[float | None, float, int]:
    """PLD's search: coarse grid, Richardson prediction, then the default precision (docs/performance.md,
    "3. Calibration", steps 3-4). Returns (lo, hi, cheaper evaluations); ``fine`` holds hi's ε."""

    def at(d: float) -> Callable[[float], float]:
        return lambda nu: _fast_pld.pld_epsilon_at(make_event(bounded(nu)), delta, d)

    # The discretisation error is absolute in ε, so small targets search on a finer grid.
    d_c = min(PLD_COARSE_DISCRETIZATION, max(2.5 * PLD_DISCRETIZATION, 4e-4 * target_epsilon))
    d_m = PLD_MID_RATIO * d_c
    coarse = LogEps(at(d_c), target_epsilon)
    slope = -1.0
    search_evals = 0
    c_lo, c_hi = solve(coarse, math.log(guess), max(tol, math.log1p(5e-3)), target_epsilon)
    x_star = c_hi
    f_lo = coarse.values[c_lo] if c_lo is not None else math.nan
    f_hi = coarse.values[c_hi]
    if c_lo is not None and math.isfinite(f_lo) and math.isfinite(f_hi) and f_hi > -math.inf:
        s = (f_hi - f_lo) / (c_hi - c_lo)
        slope = s if s < -1e-3 else -1.0
        # ε(d) ≈ ε₀ + c·d²: two levels at the same ν extrapolate ε to PLD_DISCRETIZATION; a
        # Newton step with the coarse slope moves to the predicted root; twice.
        c2, m2, f2 = d_c**2, d_m**2, PLD_DISCRETIZATION**2
        for _ in range(2):
            nu = math.exp(x_star)
            e_c, e_m = at(d_c)(nu), at(d_m)(nu)
            search_evals += 1 + (x_star != c_hi)
            e_pred = e_m - (e_c - e_m) * (m2 - f2) / (c2 - m2)
            if not (math.isfinite(e_pred) and e_pred > 0):
                break
            x_star = x_star - (math.log(e_pred) - math.log(target_epsilon)) / slope
    # Default precision from here on. The point expected feasible is evaluated by the
    # reporting accountant itself; the search below it uses the vectorised twin.
    fast = LogEps(at(PLD_DISCRETIZATION), target_epsilon)
    x0 = x_star + 0.45 * tol
    fast.values[x0], fast.eps[x0] = fine(x0), fine.eps[x0]
    lo, hi = solve(fast, x0, tol, target_epsilon, slope)
    search_evals += len(coarse.values) + len(fast.values) - 1
    while fine(hi) > 0:  # the twin said feasible, the accountant did not (≈1e-8 apart)
        lo, hi = hi, hi + 0.5 * tol
    return lo, hi, search_evals


def _clt_mu(event: dp_event.DpEvent) -> float | None:
    """μ of the Gaussian-DP CLT approximation of ``event`` (Bu et al. 2020, Thm. 5), or None: a start."""
    if isinstance(event, dp_event.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_event.GaussianDpEvent):
        return 1.0 / event.noise_multiplier if event.noise_multiplier > 0 else None
    if isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(event.event, dp_event.GaussianDpEvent):
        q, nu = event.sampling_probability, event.event.noise_multiplier
        if nu <= 0:
            return None
        if q >= 1:
            return 1.0 / nu
        return q * math.sqrt(math.expm1(min(nu**-2, 700.0)))
    if isinstance(event, dp_event.SelfComposedDpEvent):
        m = _clt_mu(event.event)
        return None if m is None else math.sqrt(event.count) * m
    if isinstance(event, dp_event.ComposedDpEvent):
        ms = [_clt_mu(e) for e in event.events]
        known = [m for m in ms if m is not None]
        return math.sqrt(sum(m * m for m in known)) if len(known) == len(ms) else None
    return None


def _guess(make_event: Callable[[float], dp_event.DpEvent], target: float, delta: float) -> float | None:
    """ν whose CLT-GDP approximation meets (target, δ): a starting point within a few %."""
    try:
        mu_t = gdp.gdp_mu_for_epsilon(target, delta)
        if _clt_mu(make_event(1.0)) is None:
            return None
        g = lambda x: math.log(max(_clt_mu(make_event(math.exp(x))) or 1e-300, 1e-300)) - math.log(mu_t)  # noqa: E731
        a, b = math.log(1e-3), math.log(1e4)
        if not (g(a) > 0 > g(b)):
            return None
        return math.exp(optimize.brentq(g, a, b, xtol=1e-6))
    except (ConfigError, ValueError, OverflowError, ZeroDivisionError):
        return None


def clear_caches() -> None:
    _calibrate_dpsgd_cached.cache_clear()


# ----------------------------------------------------------------------------- printing ν
def noise_multiplier_text(
    nu: float, eps_of: Callable[[float], float] | None = None, target: float | None = None, digits: int = 6
) -> tuple[str, float]:
    """(text, value) to print for ν, never below it: rounded up, re-checked against ``target`` (else ``repr``)."""
    up = round_up(nu, digits)
    if not math.isfinite(up):
        return repr(up), up
    if eps_of is not None and target is not None and up != nu and not eps_of(up) <= target:
        return repr(nu), nu
    text = f"{up:.{digits}g}"
    assert float(text) == up >= nu
    return text, up
