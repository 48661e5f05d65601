"""Argument checks, the DP-SGD events dptune emits, and the split-noise algebra (add/remove neighbours);
dp_accounting's event classes only (no accountant, no scipy)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from dp_accounting import dp_event

from dptune.errors import ConfigError

ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld", "gdp")

MIN_SAMPLING_RATE = 1e-12  # below it the accountants' float arithmetic breaks down (dptune.release.sampling too)
NU_FLOOR = 1e-6  # below this ν every target is treated as reachable (nothing to calibrate)
NU_CEILING = 1e9


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


def check_delta_for_n(delta: float, n: int, allow_large: bool, name: str, allow: str) -> float:
    """δ < 1/n unless ``allow_large`` (at δ ≥ 1/n, publishing a random example is (ε, δ)-DP)."""
    delta = check_delta(delta, name)
    if delta >= 1.0 / n and not allow_large:
        raise ConfigError(
            f"{name}: δ = {delta:g} ≥ 1/n = 1/{n}: δ is the probability of a catastrophic leak and must be "
            f"well below 1/n. Fix: use e.g. δ = {10.0 ** (math.floor(math.log10(1.0 / n)) - 1):g}, "
            f"or {allow} if you really mean it."
        )
    return delta


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
    """ν in [NU_FLOOR, NU_CEILING]: beyond, the accountants overflow (and ε is ≈ 0 or unbounded)."""
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


def count_or_none(value: object) -> int | None:
    """An integer ≥ 1 (ints, numpy ints, or integral floats), else None."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return int(v) if math.isfinite(v) and v >= 1 and v == int(v) else None


# ----------------------------------------------------------------------------- events
def gaussian_step_event(noise_multiplier: float, sampling_rate: float) -> dp_event.DpEvent:
    """One Gaussian sum query over a Poisson sample of rate ``sampling_rate`` (q = 1: a plain Gaussian)."""
    g = dp_event.GaussianDpEvent(float(noise_multiplier))
    return g if sampling_rate >= 1.0 else dp_event.PoissonSampledDpEvent(float(sampling_rate), g)


def dpsgd_event(noise_multiplier: float, sampling_rate: float, steps: int, runs: int = 1) -> dp_event.DpEvent:
    """``runs`` independent runs of ``steps`` Poisson-sampled Gaussian releases."""
    ev = dp_event.SelfComposedDpEvent(gaussian_step_event(noise_multiplier, sampling_rate), int(steps))
    if runs != 1:
        ev = dp_event.SelfComposedDpEvent(ev, int(runs))
    return ev


def releases_of(event: dp_event.DpEvent) -> int:
    """How many Gaussian releases ``event`` composes (what PLD's composition cost grows with)."""
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return event.count * releases_of(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return sum(releases_of(e) for e in event.events)
    return 0 if isinstance(event, dp_event.NoOpDpEvent) else 1


def is_hashable(event: dp_event.DpEvent) -> bool:
    """Whether ``event`` can key a cache (a ``ComposedDpEvent`` built with a list cannot)."""
    try:
        hash(event)
    except TypeError:
        return False
    return True


# ----------------------------------------------------------------------------- split noise
def joint_noise_multiplier(component_multipliers: Iterable[float]) -> float:
    """(Σ ν_i⁻²)^(-1/2): Gaussian queries on one batch are ONE Gaussian (docs/accounting.md); ∞ left out."""
    inv = 0.0
    for nu in component_multipliers:
        if nu <= 0:
            raise ConfigError(f"noise multipliers must be > 0, got {nu}")
        if math.isinf(nu):
            continue
        inv += nu**-2
    return math.inf if inv == 0.0 else inv**-0.5


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
    """ν_q raising ν_g to (1 + r)ν (Galli): ν_q = ν / sqrt(1 − (1 + r)⁻²); r = 1% → ν_q ≈ 7.124ν."""
    if relative_increase <= 0:
        raise ConfigError(f"relative_increase must be > 0, got {relative_increase}")
    return nu / math.sqrt(1.0 - (1.0 + relative_increase) ** -2)
