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
from dataclasses import dataclass
from typing import Literal

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.pld import (
    pld_privacy_accountant,
    privacy_loss_distribution,
    privacy_loss_mechanism,
)
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, special

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
        raise ConfigError(f"{name} must be a finite number > 0, got {eps!r}. Fix: pick e.g. {name}=3.0.")
    return float(eps)


def check_delta(delta: float, name: str = "delta") -> float:
    if not isinstance(delta, int | float) or not (0 < delta < 1):
        raise ConfigError(
            f"{name} must lie in (0, 1), got {delta!r}. Fix: a common choice is 1/n rounded down "
            "to a power of ten, e.g. delta=1e-5 for n=60,000."
        )
    return float(delta)


MIN_SAMPLING_RATE = 1e-12  # below it the accountants' float arithmetic breaks down (dptune.sampling too)


def check_sampling_rate(q: float) -> float:
    if not isinstance(q, int | float) or not (0 < q <= 1):
        raise ConfigError(
            f"sampling rate q must lie in (0, 1], got {q!r}. Fix: q = expected_batch_size / n; q = 1 means full batch."
        )
    if q < MIN_SAMPLING_RATE:  # q = 1e-320 gave "a must be greater than b. Got a=inf and b=inf."
        raise ConfigError(
            f"sampling rate q = {q!r} is below {MIN_SAMPLING_RATE:g}: the accountants cannot evaluate it (and "
            "almost every batch would be empty). Fix: use q = expected_batch_size / n ≥ 1e-12."
        )
    return float(q)


def check_noise_multiplier(nu: float) -> float:
    """ν in [NU_FLOOR, NU_CEILING]: beyond them the accountants overflow or divide by zero
    (ν = 1e-320, ν = 1e308 were tracebacks) and ε is ≈ 0 or unbounded anyway."""
    if not isinstance(nu, int | float) or not (nu > 0) or math.isnan(nu):
        raise ConfigError(f"noise_multiplier must be > 0, got {nu!r}. Fix: e.g. noise_multiplier=1.0.")
    if not (NU_FLOOR <= nu <= NU_CEILING):
        raise ConfigError(
            f"noise_multiplier = {nu!r} is outside [{NU_FLOOR:g}, {NU_CEILING:g}], where the accountants "
            "work (beyond it ε is ≈ 0 or unbounded). Fix: use a noise multiplier in that range, typically 0.5 to 10."
        )
    return float(nu)


def check_accountant(name: str) -> str:
    if name not in ACCOUNTANTS:
        raise ConfigError(
            f"unknown accountant {name!r}. Fix: choose one of {', '.join(ACCOUNTANTS)} "
            "('auto' picks the tightest when a run is planned)."
        )
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
    # special.ndtr is the standard normal CDF that stats.norm.cdf wraps, ~100× cheaper per scalar
    # call (planning a Mohapatra paper-scale study makes ~25k of these calls).
    return float(special.ndtr(-eps / mu + mu / 2) - math.exp(eps) * special.ndtr(-eps / mu - mu / 2))


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


def tightest_accountant(sampling_rate: float) -> str:
    """The tightest valid accountant for a run: exact μ-GDP at full batch (a composition of
    Gaussians is exactly GDP), PLD with Poisson sampling (RDP's conversion to (ε, δ) overstates
    ε: 3.00 against 2.65 on mnist5k at the same ν). Calibration stays under 2 s a run."""
    return "gdp" if sampling_rate >= 1.0 else "pld"


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


# ----------------------------------------------------------------------------- calibration
# Fast calibration (docs/performance.md, "Calibration"). The root of ε(ν) = target is found
# on x = log ν by a safeguarded regula falsi (Illinois) that keeps the bisection invariant
# "hi feasible, lo infeasible". For PLD the search runs on a coarse discretisation (cheap),
# a Richardson step predicts where the root lies at the default precision, and only the
# final bracket [lo, hi] (hi/lo ≤ 1 + rel_tol) is evaluated at PLD_DISCRETIZATION, which is
# what epsilon(..., 'pld') reports. The returned ν is always such a verified ``hi``.
# The PLD accountant's work grows as 1/ν (one step's grid) and with the releases composed: below
# this ν or beyond this count an evaluation takes minutes and gigabytes (ν = 1e-6 asked numpy for
# 35 PiB; 10¹² steps for 37 TiB), so calibration refuses them up front and points to RDP.
PLD_MIN_NOISE = 0.1
PLD_MAX_RELEASES = 10**7


def releases_of(event: dp_event.DpEvent) -> int:
    """How many Gaussian releases ``event`` composes (what PLD's composition cost grows with)."""
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return event.count * releases_of(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return sum(releases_of(e) for e in event.events)
    return 0 if isinstance(event, dp_event.NoOpDpEvent) else 1


def pld_cost_problem(noise_multiplier: float, releases: int) -> str | None:
    """Why PLD cannot evaluate ``releases`` steps at ``noise_multiplier`` in bounded work, or None."""
    if noise_multiplier < PLD_MIN_NOISE:
        return f"ν = {noise_multiplier:.3g} is below {PLD_MIN_NOISE:g}, where one step's PLD grid grows to gigabytes"
    if releases > PLD_MAX_RELEASES:
        return f"{releases:.3g} releases are more than {PLD_MAX_RELEASES:.0e}, where PLD's composition takes gigabytes"
    return None


PLD_COARSE_DISCRETIZATION = 1e-3  # search level: ~1% pessimistic in ε, 5-10x cheaper
PLD_MID_RATIO = 0.3  # a second level at 0.3x the coarse one extrapolates ε to PLD_DISCRETIZATION
NU_FLOOR = 1e-6  # below this ν every target is treated as reachable (nothing to calibrate)
NU_CEILING = 1e9


@dataclass(frozen=True)
class Calibration:
    """Result of a calibration with its certificate.

    ``noise_multiplier`` (hi) was checked to give ε ≤ target, and ``lower`` (lo) to give
    ε > target, both by ``epsilon(event, delta, accountant)`` at its default precision; so
    ν* ∈ (lo, hi] and hi/lo ≤ 1 + rel_tol. ``lower`` is 0 when ν → 0 stays feasible.
    """

    noise_multiplier: float
    lower: float
    epsilon: float
    evaluations: int  # evaluations at the reported accountant's default precision
    search_evaluations: int  # cheaper evaluations (coarse PLD discretisations) used to search
    seconds: float


class _LogEps:
    """f(x) = log ε(e^x) − log target, cached; f ≤ 0 ⇔ ν = e^x is feasible."""

    def __init__(self, eps_of: Callable[[float], float], target: float):
        self.eps_of = eps_of
        self.target = target
        self.log_target = math.log(target)
        self.values: dict[float, float] = {}
        self.eps: dict[float, float] = {}

    def __call__(self, x: float) -> float:
        if x not in self.values:
            e = float(self.eps_of(math.exp(x)))
            self.eps[x] = e
            if math.isnan(e):
                v = math.inf  # unknown privacy counts as infeasible
            elif e <= 0:
                v = -math.inf
            else:
                # Feasibility is decided on ε itself (log space can round a 1-ulp excess to 0).
                v = math.log(e) - self.log_target
                if e <= self.target:
                    v = min(v, 0.0)
                elif v <= 0:
                    v = math.ulp(0.0)
            self.values[x] = v
        return self.values[x]

    def bounds(self) -> tuple[float | None, float | None]:
        """(largest infeasible x below hi, smallest feasible x): the current bracket."""
        feasible = [x for x, v in self.values.items() if v <= 0]
        hi = min(feasible) if feasible else None
        below = [x for x, v in self.values.items() if v > 0 and (hi is None or x < hi)]
        return (max(below) if below else None), hi


def _solve(f: _LogEps, guess: float, tol: float, target: float, slope: float = -1.0) -> tuple[float | None, float]:
    """Bracket and shrink the root of f to hi − lo ≤ tol (log space). Returns (lo, hi).

    Bracketing: Newton jumps with the current slope estimate d log ε / d log ν (secant of
    the last two points; ε ∝ 1/ν gives −1 to start) plus an overshoot that starts at half
    a tolerance and doubles, so a good guess costs two evaluations and a bad one a few
    more. Shrinking: regula falsi with the Illinois modification (superlinear on smooth
    ε(ν)), clamped half a tolerance inside the bracket so each evaluation shrinks it, with
    a bisection step whenever the width failed to halve over two iterations. ``lo`` is
    None when even ν = NU_FLOOR is feasible.
    """
    lo, hi = f.bounds()
    if lo is None and hi is None:
        f(guess)
        lo, hi = f.bounds()
    over = 0.45 * tol
    cap = math.log(20.0)  # no single jump beyond a factor 20 in ν
    while lo is None or hi is None:
        base = lo if hi is None else hi
        fb = f.values[base]
        jump = -fb / slope if math.isfinite(fb) else 0.0
        if hi is None:
            x = base + min(max(jump, 0.0), cap) + over
            if x > math.log(NU_CEILING):
                raise ConfigError(
                    f"could not reach ε ≤ {target} even with noise multiplier {math.exp(base):.3g}: more noise "
                    "does not help. Fix: check δ (a δ below about 1e-300 cannot be met by any noise level) and "
                    "that every release of the run is noised."
                )
        else:
            x = base + max(min(jump, 0.0), -cap) - over
            if x < math.log(NU_FLOOR):
                return None, hi
        v = f(x)
        if math.isfinite(v) and math.isfinite(fb) and (v - fb) / (x - base) < -1e-3:
            slope = (v - fb) / (x - base)
        over *= 2
        lo, hi = f.bounds()
    flo, fhi = f.values[lo], f.values[hi]
    side = 0
    widths: list[float] = []
    while hi - lo > tol:
        w = hi - lo
        stalled = len(widths) >= 2 and w > 0.5 * widths[-2]
        if math.isfinite(flo) and math.isfinite(fhi) and flo > fhi and not stalled:
            x = hi - fhi * (hi - lo) / (fhi - flo)
        else:
            x = 0.5 * (lo + hi)
        x = min(max(x, lo + 0.5 * tol), hi - 0.5 * tol)
        widths.append(w)
        v = f(x)
        if v <= 0:
            hi, fhi = x, v
            if side == 1:
                flo *= 0.5
            side = 1
        else:
            lo, flo = x, v
            if side == -1:
                fhi *= 0.5
            side = -1
    return lo, hi


def _clt_mu(event: dp_event.DpEvent) -> float | None:
    """μ of the Gaussian-DP central-limit approximation of ``event`` (None if unsupported).

    Poisson-subsampled Gaussian steps: μ² = Σ q²(e^{1/ν²} − 1) (Bu, Dong, Long & Su 2020,
    Thm. 5; Dong et al. 2019, §5.2); plain Gaussians: μ = 1/ν (exact). Only a starting guess.
    """
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
        return None if any(m is None for m in ms) else math.sqrt(sum(m * m for m in ms))  # type: ignore[operator]
    return None


def _guess(make_event: Callable[[float], dp_event.DpEvent], target: float, delta: float) -> float | None:
    """ν whose CLT-GDP approximation meets (target, δ): a starting point within a few %."""
    try:
        mu_t = gdp_mu_for_epsilon(target, delta)
        if _clt_mu(make_event(1.0)) is None:
            return None
        g = lambda x: math.log(max(_clt_mu(make_event(math.exp(x))) or 1e-300, 1e-300)) - math.log(mu_t)  # noqa: E731
        a, b = math.log(1e-3), math.log(1e4)
        if not (g(a) > 0 > g(b)):
            return None
        return math.exp(optimize.brentq(g, a, b, xtol=1e-6))
    except (ConfigError, ValueError, OverflowError, ZeroDivisionError):
        return None


class _VectorizedGaussianLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """dp_accounting's Gaussian privacy loss with ``get_delta_for_epsilon`` vectorised.

    dp_accounting inverts the privacy loss one grid point at a time in Python (84k calls
    per subsampled PLD at discretisation 1e-4: > 90% of an evaluation). The inverse has a
    closed form (remove: x = −s/2 − σ² ℓ₀(ε)/s with ℓ₀(ε) = log(1 + (e^ε − 1)/q); add: the
    same shifted by s with ℓ₀(ε) = −log(1 + (e^{−ε} − 1)/q)), evaluated here on the whole
    grid at once. Used only to *search*: every returned ν is re-checked by dp_accounting.
    """

    def get_delta_for_epsilon(self, epsilon):  # type: ignore[override]
        import numpy as np

        eps = np.atleast_1d(np.asarray(epsilon, dtype=float))
        deltas = np.zeros_like(eps)
        q, s, var = self.sampling_prob, self.sensitivity, self._standard_deviation**2
        add = self.adjacency_type == privacy_loss_mechanism.AdjacencyType.ADD
        if q == 1.0:
            inside = np.ones_like(eps, dtype=bool)
            pl0 = -eps if add else eps
        elif add:
            inside = eps < -math.log1p(-q)
            b = -eps[inside]
            pl0 = -self._log_mix(b, q)
        else:
            inside = eps > math.log1p(-q)
            deltas[~inside] = -np.expm1(eps[~inside])
            pl0 = self._log_mix(eps[inside], q)
        x = -0.5 * s - pl0 * var / s
        if add:
            x = x + s
        e_in = eps[inside]
        deltas[inside] = self.mu_upper_cdf(x) - np.exp(e_in + self.mu_lower_log_cdf(x))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if np.ndim(epsilon) == 0 else deltas

    @staticmethod
    def _log_mix(b, q: float):
        """log(1 + (e^b − 1)/q) = log(e^b − (1 − q)) − log q, stably (−inf at the boundary)."""
        import numpy as np

        with np.errstate(divide="ignore", invalid="ignore"):
            big = b > 0
            out = np.empty_like(b)
            out[big] = b[big] + np.log1p(-(1 - q) * np.exp(-b[big]))
            out[~big] = np.log(np.expm1(b[~big]) + q)
        return out - math.log(q)


def _search_pld(event: dp_event.DpEvent, d: float, count: int = 1):
    """PLD of ``event`` built as PLDAccountant does, with the vectorised Gaussian loss.

    Mirrors ``PLDAccountant._maybe_compose`` for the events dptune emits (self/composed
    Poisson-sampled Gaussians, plain Gaussians, no-ops); None for anything else.
    """
    PLD = privacy_loss_distribution

    def single(std: float, q: float):
        def pmf(adj):
            loss = _VectorizedGaussianLoss(std, sampling_prob=q, adjacency_type=adj)
            return PLD._create_pld_pmf_from_monotone_privacy_loss(
                loss, pessimistic_estimate=True, value_discretization_interval=d, use_connect_dots=True
            )

        return PLD._pld_for_subsampled_mechanism(pmf, q)

    if isinstance(event, dp_event.NoOpDpEvent):
        return PLD.identity(d)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _search_pld(event.event, d, count * event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        out = PLD.identity(d)
        for e in event.events:
            part = _search_pld(e, d, count)
            if part is None:
                return None
            out = out.compose(part)
        return out
    if isinstance(event, dp_event.GaussianDpEvent) and event.noise_multiplier > 0:
        return single(event.noise_multiplier / math.sqrt(count), 1.0)
    if (
        isinstance(event, dp_event.PoissonSampledDpEvent)
        and isinstance(event.event, dp_event.GaussianDpEvent)
        and event.event.noise_multiplier > 0
        and event.sampling_probability > 0
    ):
        return single(event.event.noise_multiplier, event.sampling_probability).self_compose(count)
    return None


def _hashable(event: dp_event.DpEvent) -> bool:
    try:
        hash(event)
    except TypeError:  # e.g. ComposedDpEvent built with a list of events
        return False
    return True


def epsilon_cached(event: dp_event.DpEvent, delta: float, accountant: str) -> float:
    """``epsilon`` memoised on the (immutable) event when it is hashable: the same ledger's ε
    is asked for by the summary, the release JSON and the model card."""
    return _epsilon_cached(event, delta, accountant) if _hashable(event) else epsilon(event, delta, accountant)


def _pld_epsilon_at(event: dp_event.DpEvent, delta: float, discretization: float) -> float:
    """ε(δ) at a given PLD discretisation, for the search (fast path when supported); cached."""
    if _hashable(event):
        return _pld_epsilon_at_cached(event, delta, discretization)
    return _pld_epsilon_at_cached.__wrapped__(event, delta, discretization)


@functools.lru_cache(maxsize=4096)
def _pld_epsilon_at_cached(event: dp_event.DpEvent, delta: float, discretization: float) -> float:
    try:
        pld = _search_pld(event, discretization)
    except (AttributeError, TypeError):  # dp_accounting internals changed: use the public path
        pld = None
    if pld is None:
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=discretization)
        return float(acc.compose(event).get_epsilon(delta))
    return float(pld.get_epsilon_for_delta(delta))


def calibrate_event_info(
    make_event: Callable[[float], dp_event.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str = "rdp",
    *,
    rel_tol: float = 1e-4,
    bracket: tuple[float, float] | None = None,
) -> Calibration:
    """``calibrate_event`` with its certificate and cost (see ``Calibration``)."""
    import time

    check_epsilon(target_epsilon, "target epsilon")
    check_delta(delta)
    check_accountant(accountant)
    if not (rel_tol > 0):
        raise ConfigError(f"rel_tol must be > 0, got {rel_tol!r}")
    t0 = time.perf_counter()
    tol = math.log1p(rel_tol)
    if bracket is not None:
        b_lo, b_hi = sorted(float(b) for b in bracket)
        if not (b_lo > 0):
            raise ConfigError(f"bracket must hold two positive noise multipliers, got {bracket!r}")
        # A bracket is a hint (it need not contain the root): the CLT guess wins when it
        # lies inside it (e.g. planners that pass (ν_rdp/2, ν_rdp) for PLD).
        clt = _guess(make_event, target_epsilon, delta)
        guess: float | None = clt if clt is not None and b_lo <= clt <= b_hi else math.sqrt(b_lo * b_hi)
    else:
        guess = _guess(make_event, target_epsilon, delta)
        guess = guess if guess is not None else 1.0

    releases = releases_of(make_event(1.0)) if accountant == "pld" else 0
    if releases:

        def bounded(nu: float) -> float:
            """Refuse, before any PLD is built, a ν or a count where it would take minutes and gigabytes."""
            problem = pld_cost_problem(nu, releases)
            if problem is not None:
                raise ConfigError(
                    f"calibrating ν to ε = {target_epsilon:g} at δ = {delta:g} with the PLD accountant: {problem} "
                    "(a large ε, a tiny sampling rate, or many steps and runs). Fix: use the 'rdp' accountant (its cost does not grow "
                    "with ν or the steps), or a smaller ε / fewer steps."
                )
            return nu

        if guess is not None and guess < PLD_MIN_NOISE:  # the CLT guess is within a few %: no PLD built
            bounded(guess)
        bounded(PLD_MIN_NOISE)  # the count alone
    else:

        def bounded(nu: float) -> float:
            return nu

    fine = _LogEps(lambda nu: epsilon_cached(make_event(bounded(nu)), delta, accountant), target_epsilon)
    search_evals = 0
    if accountant == "pld":
        # The discretisation error is absolute in ε, so small targets search on a finer grid.
        d_c = min(PLD_COARSE_DISCRETIZATION, max(2.5 * PLD_DISCRETIZATION, 4e-4 * target_epsilon))
        d_m = PLD_MID_RATIO * d_c
        coarse = _LogEps(lambda nu: _pld_epsilon_at(make_event(bounded(nu)), delta, d_c), target_epsilon)
        slope = -1.0
        c_lo, c_hi = _solve(coarse, math.log(guess), max(tol, math.log1p(5e-3)), target_epsilon)
        x_star = c_hi
        f_lo = coarse.values[c_lo] if c_lo is not None else math.nan
        f_hi = coarse.values[c_hi]
        if c_lo is not None and math.isfinite(f_lo) and math.isfinite(f_hi) and f_hi > -math.inf:
            s = (f_hi - f_lo) / (c_hi - c_lo)
            slope = s if s < -1e-3 else -1.0
            # ε(d) ≈ ε₀ + c·d² in the discretisation d (measured; docs/performance.md): two
            # levels at the same ν extrapolate ε to PLD_DISCRETIZATION; a Newton step with
            # the coarse slope moves to the predicted root; once more from there, so the
            # slope's error only acts over a ~1e-4 distance.
            c2, m2, f2 = d_c**2, d_m**2, PLD_DISCRETIZATION**2
            for _ in range(2):
                nu = math.exp(x_star)
                e_c = _pld_epsilon_at(make_event(bounded(nu)), delta, d_c)
                e_m = _pld_epsilon_at(make_event(bounded(nu)), delta, d_m)
                search_evals += 1 + (x_star != c_hi)
                e_pred = e_m - (e_c - e_m) * (m2 - f2) / (c2 - m2)
                if not (math.isfinite(e_pred) and e_pred > 0):
                    break
                x_star = x_star - (math.log(e_pred) - math.log(target_epsilon)) / slope
        # Default precision from here on. The point expected feasible is evaluated by the
        # reporting accountant itself; the search below it uses the vectorised twin.
        fast = _LogEps(lambda nu: _pld_epsilon_at(make_event(bounded(nu)), delta, PLD_DISCRETIZATION), target_epsilon)
        x0 = x_star + 0.45 * tol
        fast.values[x0], fast.eps[x0] = fine(x0), fine.eps[x0]
        lo, hi = _solve(fast, x0, tol, target_epsilon, slope)
        search_evals += len(coarse.values) + len(fast.values) - 1
        while fine(hi) > 0:  # the twin said feasible, the accountant did not (≈1e-8 apart)
            lo, hi = hi, hi + 0.5 * tol
    else:
        lo, hi = _solve(fine, math.log(guess), tol, target_epsilon)
    nu_hi = math.exp(hi)
    eps_hi = fine.eps[hi]
    # The guarantee, re-stated: the returned ν was evaluated by the reporting accountant.
    assert eps_hi <= target_epsilon
    return Calibration(
        noise_multiplier=nu_hi,
        lower=math.exp(lo) if lo is not None else 0.0,
        epsilon=eps_hi,
        evaluations=len(fine.values),
        search_evaluations=search_evals,
        seconds=time.perf_counter() - t0,
    )


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

    The root is bracketed on log ν with the invariant that ``hi`` is feasible (ε ≤ target,
    as computed by ``epsilon(make_event(hi), delta, accountant)`` itself) and ``lo``
    infeasible; the returned value is always a checked-feasible ``hi`` with hi/lo ≤ 1 +
    rel_tol, so it can never exceed the target whatever the accountant's numerical noise.
    The search starts from the Gaussian-DP central-limit guess; for PLD it runs on a coarse
    discretisation and only the final bracket is evaluated at the default precision
    (``calibrate_event_info`` reports the counts). ``bracket`` is an optional starting
    region (it need not contain the root). Evaluations are cached.
    """
    return calibrate_event_info(
        make_event, target_epsilon, delta, accountant, rel_tol=rel_tol, bracket=bracket
    ).noise_multiplier


def calibrate_info(
    eps: float,
    delta: float,
    q: float,
    steps: int,
    runs: int = 1,
    accountant: str = "rdp",
    *,
    rel_tol: float = 1e-4,
) -> Calibration:
    """``calibrate`` with its certificate and cost (see ``Calibration``); cached."""
    check_sampling_rate(q)
    steps_i, runs_i = _count(steps), _count(runs)
    if steps_i is None or runs_i is None:
        raise ConfigError(
            f"steps and runs must be integers ≥ 1, got steps={steps!r}, runs={runs!r}. Fix: e.g. steps=1000, runs=1."
        )
    check_accountant(accountant)
    return _calibrate_info_cached(float(eps), float(delta), float(q), steps_i, runs_i, accountant, float(rel_tol))


def _count(value: object) -> int | None:
    """An integer ≥ 1 (ints, numpy ints, or integral floats), else None."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return int(v) if math.isfinite(v) and v >= 1 and v == int(v) else None


@functools.lru_cache(maxsize=1024)
def _calibrate_info_cached(
    eps: float, delta: float, q: float, steps: int, runs: int, accountant: str, rel_tol: float
) -> Calibration:
    if accountant == "gdp":
        import time

        t0 = time.perf_counter()
        check_epsilon(eps)
        check_delta(delta)
        if q < 1:
            raise ConfigError("accountant='gdp' needs full batch (q = 1); use 'pld' or 'rdp'.")
        # Closed form: μ_total = sqrt(runs·steps)/ν; pick the largest admissible μ, then
        # nudge ν up until the reporting paths themselves confirm the target: epsilon() of
        # dpsgd_event(ν) and of the ledger's grouped form (runs·steps releases of one
        # Gaussian). Checking sqrt(runs·steps)/ν, as before, differs in rounding from
        # gdp_mu_of_event's sqrt(runs)·sqrt(steps)·(1/ν): ε overshot by 1 ulp.
        mu = gdp_mu_for_epsilon(eps, delta)

        def eps_of(v: float) -> float:
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
        return Calibration(nu, lower, e_nu, evals, 0, time.perf_counter() - t0)
    return calibrate_event_info(lambda nu: dpsgd_event(nu, q, steps, runs), eps, delta, accountant, rel_tol=rel_tol)


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
    Gaussian releases at rate ``q`` are (eps, delta)-DP in total. Never overshoots eps.

    The returned ν is verified with ``epsilon(dpsgd_event(ν, q, steps, runs), delta,
    accountant)`` at that accountant's default precision; ν/(1 + rel_tol) is verified not
    to meet the target. Results are cached per argument tuple.
    """
    return calibrate_info(eps, delta, q, steps, runs, accountant, rel_tol=rel_tol).noise_multiplier


# ----------------------------------------------------------------------------- printing ν
def round_up(nu: float, digits: int = 6) -> float:
    """The smallest float ≥ ``nu`` that prints with ``digits`` significant digits.

    Rounding ν to nearest for display can round it *down*, and a smaller ν spends more
    than the target: calibrate(1, 1e-5, q=0.01, T=1000) = 1.513123018 printed as 1.51312
    has ε = 1.0000021. The ceiling is exact (Decimal holds the float's exact value) and
    float() of it is ≥ ν because float rounding is monotone and ν is itself a float.
    """
    from decimal import ROUND_CEILING, Decimal

    if not math.isfinite(nu) or nu <= 0:
        return nu
    d = Decimal(nu)
    return float(d.quantize(Decimal(1).scaleb(d.adjusted() - digits + 1), rounding=ROUND_CEILING))


def noise_multiplier_text(
    nu: float, eps_of: Callable[[float], float] | None = None, target: float | None = None, digits: int = 6
) -> tuple[str, float]:
    """(text, value) to print for a noise multiplier: never below ``nu``.

    ``nu`` rounded up to ``digits`` significant digits; with ``eps_of`` and ``target``, the
    rounded value is re-checked (ε(value) ≤ target), and when an accountant's numerical
    noise makes it fail, the full ``repr`` of ``nu`` (the calibrated, verified value) is
    printed instead. Copying the text back (``--noise-multiplier``) thus never overshoots.
    """
    up = round_up(nu, digits)
    if not math.isfinite(up):
        return repr(up), up
    if eps_of is not None and target is not None and up != nu and not eps_of(up) <= target:
        return repr(nu), nu
    text = f"{up:.{digits}g}"
    assert float(text) == up >= nu
    return text, up
