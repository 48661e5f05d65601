"""A faster twin of dp_accounting's PLD construction, used only to SEARCH for a noise multiplier. Version-pinned
(``CHECKED_VERSIONS``) because it uses dp_accounting internals; elsewhere the public ``PLDAccountant`` is used. Either
way every calibrated ν is re-checked by ``accountants.epsilon`` (docs/accounting.md, "The fast PLD search")."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from importlib import metadata

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution, privacy_loss_mechanism

from dptune.accounting.events import is_hashable

# dp_accounting releases whose internals this module was checked against (tests/privacy/test_fast_pld.py).
# To add one: install it, run tests/privacy/test_fast_pld.py with the version added here; all must pass.
CHECKED_VERSIONS: tuple[str, ...] = ("0.6.0",)

_log = logging.getLogger(__name__)


def dp_accounting_version() -> str | None:
    """The installed dp_accounting's version (None when its metadata is missing)."""
    try:
        return metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:
        return None


def missing_internals() -> list[str]:
    """The dp_accounting internals (names and parameters) this module relies on that are absent."""
    P, M = privacy_loss_distribution, privacy_loss_mechanism
    functions = [  # (what, the object, the parameters passed by name)
        (
            "_create_pld_pmf_from_monotone_privacy_loss",
            getattr(P, "_create_pld_pmf_from_monotone_privacy_loss", None),
            ("pessimistic_estimate", "value_discretization_interval", "use_connect_dots"),
        ),
        ("_pld_for_subsampled_mechanism", getattr(P, "_pld_for_subsampled_mechanism", None), ()),
        ("identity", getattr(P, "identity", None), ("value_discretization_interval",)),
        ("GaussianPrivacyLoss.__init__", M.GaussianPrivacyLoss.__init__, ("sampling_prob", "adjacency_type")),
        ("PLDAccountant._maybe_compose", getattr(pld_privacy_accountant.PLDAccountant, "_maybe_compose", None), ()),
    ]
    missing = []
    for name, fn, params in functions:
        if fn is None:
            missing.append(name)
            continue
        have = inspect.signature(fn).parameters
        missing += [f"{name}({p}=)" for p in params if p not in have]
    classes = [
        (M.GaussianPrivacyLoss, ("get_delta_for_epsilon", "mu_upper_cdf", "mu_lower_log_cdf", "standard_deviation")),
        (P.PrivacyLossDistribution, ("compose", "self_compose", "get_epsilon_for_delta")),
        (M.AdjacencyType, ("ADD", "REMOVE")),
    ]
    for owner, names in classes:
        missing += [f"{owner.__name__}.{a}" for a in names if not hasattr(owner, a)]
    try:  # attributes that __init__ sets and get_delta_for_epsilon reads
        probe = M.GaussianPrivacyLoss(1.0, sampling_prob=0.5)
        missing += [
            f"GaussianPrivacyLoss().{a}"
            for a in ("sensitivity", "sampling_prob", "adjacency_type")
            if not hasattr(probe, a)
        ]
    except Exception as e:  # noqa: BLE001 (any failure means: do not use the twin)
        missing.append(f"GaussianPrivacyLoss(1.0, sampling_prob=0.5) raised {e!r}")
    return missing


@functools.cache
def fast_path_enabled() -> bool:
    """Whether the search may use the twin: a checked version with every internal present."""
    version, missing = dp_accounting_version(), missing_internals()
    if version in CHECKED_VERSIONS and not missing:
        return True
    why = f"missing internals {missing}" if missing else "not among the checked versions " + ", ".join(CHECKED_VERSIONS)
    _log.warning(
        "dp_accounting %s: %s; noise calibration searches with the public PLD accountant "
        "(slower; the calibrated ν is verified by the same accountant either way).",
        version,
        why,
    )
    return False


class _VectorizedGaussianLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """dp_accounting's Gaussian privacy loss with ``get_delta_for_epsilon`` in closed form, on the grid."""

    def get_delta_for_epsilon(self, epsilon):  # type: ignore[override]
        eps = np.atleast_1d(np.asarray(epsilon, dtype=float))
        deltas = np.zeros_like(eps)
        q, s, var = self.sampling_prob, self.sensitivity, self.standard_deviation**2
        add = self.adjacency_type == privacy_loss_mechanism.AdjacencyType.ADD
        if q == 1.0:  # both adjacencies: the unsampled loss (ADD was −ε here, unused by search_pld at q = 1)
            inside = np.ones_like(eps, dtype=bool)
            pl0 = eps
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
        with np.errstate(divide="ignore", invalid="ignore"):
            big = b > 0
            out = np.empty_like(b)
            out[big] = b[big] + np.log1p(-(1 - q) * np.exp(-b[big]))
            out[~big] = np.log(np.expm1(b[~big]) + q)
        return out - math.log(q)


def search_pld(event: dp_event.DpEvent, d: float, count: int = 1):
    """PLD of ``event`` at ``d`` built as ``PLDAccountant`` does, with the vectorised loss; None if unsupported."""
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
        return search_pld(event.event, d, count * event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        out = PLD.identity(d)
        for e in event.events:
            part = search_pld(e, d, count)
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


def pld_epsilon_at(event: dp_event.DpEvent, delta: float, discretization: float) -> float:
    """ε(δ) at a PLD discretisation for the search: the twin where supported, else the public one; cached."""
    if is_hashable(event):
        return _pld_epsilon_at_cached(event, delta, discretization)
    return _pld_epsilon_at_cached.__wrapped__(event, delta, discretization)


@functools.lru_cache(maxsize=4096)
def _pld_epsilon_at_cached(event: dp_event.DpEvent, delta: float, discretization: float) -> float:
    pld = None
    if fast_path_enabled():
        try:
            pld = search_pld(event, discretization)
        except (AttributeError, TypeError):  # internals changed under a checked version string
            pld = None
    if pld is None:  # dp_accounting's public accountant
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=discretization)
        return float(acc.compose(event).get_epsilon(delta))
    return float(pld.get_epsilon_for_delta(delta))


def clear_caches() -> None:
    _pld_epsilon_at_cached.cache_clear()
