"""The fast PLD search twin (``dptune.accounting._fast_pld``) against dp_accounting itself.

The twin subclasses dp_accounting internals and mirrors ``PLDAccountant._maybe_compose``, so
these tests fail loudly when dp_accounting changes: the version pin, the internals it calls,
the twin's δ(ε) against the parent class's, and its ε against the public ``PLDAccountant`` at
the same discretisation. On an unchecked version the search falls back to the public accountant
(tested below), and calibration still certifies every ν with the public accountant.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution, privacy_loss_mechanism

from dptune import accounting as A
from dptune.accounting import _fast_pld

DELTA = 1e-5
G, P, S, C = (
    dp_event.GaussianDpEvent,
    dp_event.PoissonSampledDpEvent,
    dp_event.SelfComposedDpEvent,
    dp_event.ComposedDpEvent,
)


def public_epsilon(event: dp_event.DpEvent, delta: float, d: float) -> float:
    """dp_accounting's public PLD accountant, built here (not through dptune)."""
    return float(
        pld_privacy_accountant.PLDAccountant(value_discretization_interval=d).compose(event).get_epsilon(delta)
    )


@pytest.fixture
def fresh_caches():
    """The version gate and the ε caches are memoised: start and end each test without them."""
    _fast_pld.fast_path_enabled.cache_clear()
    A.clear_caches()
    yield
    _fast_pld.fast_path_enabled.cache_clear()
    A.clear_caches()


# ----------------------------------------------------------------------------- the pin
def test_the_installed_dp_accounting_is_a_checked_version(fresh_caches) -> None:
    version = _fast_pld.dp_accounting_version()
    assert version in _fast_pld.CHECKED_VERSIONS, (
        f"dp_accounting {version} is not in _fast_pld.CHECKED_VERSIONS {_fast_pld.CHECKED_VERSIONS}: the fast PLD "
        "search is off (calibration uses the public accountant, slower). To enable it, add the version and make "
        "every test in this file pass."
    )
    assert _fast_pld.fast_path_enabled()


def test_the_internals_it_relies_on_exist() -> None:
    assert _fast_pld.missing_internals() == []


def test_missing_internals_names_a_removed_function_and_a_renamed_parameter(monkeypatch) -> None:
    monkeypatch.delattr(privacy_loss_distribution, "_pld_for_subsampled_mechanism")

    def renamed(monotone_privacy_loss, pessimistic_estimate=True, value_discretization_interval=1e-4):  # noqa: ANN001, ANN202
        raise AssertionError("not called")

    monkeypatch.setattr(privacy_loss_distribution, "_create_pld_pmf_from_monotone_privacy_loss", renamed)
    assert _fast_pld.missing_internals() == [
        "_create_pld_pmf_from_monotone_privacy_loss(use_connect_dots=)",
        "_pld_for_subsampled_mechanism",
    ]


def test_an_unchecked_version_searches_with_the_public_accountant(monkeypatch, caplog, fresh_caches) -> None:
    """No silent change: one warning names the version, the twin is never built, ε is the public
    accountant's exactly, and calibration still certifies ν with the public accountant."""
    monkeypatch.setattr(_fast_pld, "dp_accounting_version", lambda: "99.0.0")

    def no_twin(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the twin was used on an unchecked version")

    monkeypatch.setattr(_fast_pld, "search_pld", no_twin)
    ev = A.dpsgd_event(1.2, 0.02, 60, 2)
    with caplog.at_level(logging.WARNING, logger=_fast_pld.__name__):
        assert _fast_pld.pld_epsilon_at(ev, DELTA, 1e-3) == public_epsilon(ev, DELTA, 1e-3)
        cal = A.calibrate(2.0, DELTA, 0.02, 60, 2, "pld")
    warnings = [r.getMessage() for r in caplog.records if r.name == _fast_pld.__name__]
    assert len(warnings) == 1, warnings
    assert "99.0.0" in warnings[0] and "public PLD accountant" in warnings[0] and "0.6.0" in warnings[0]
    nu = cal.noise_multiplier
    assert public_epsilon(A.dpsgd_event(nu, 0.02, 60, 2), DELTA, 1e-4) == cal.epsilon <= 2.0
    assert public_epsilon(A.dpsgd_event(cal.lower, 0.02, 60, 2), DELTA, 1e-4) > 2.0
    assert 1 < nu / cal.lower <= 1 + 1e-4 + 1e-12


def test_missing_internals_switch_the_twin_off_on_a_checked_version(monkeypatch, caplog, fresh_caches) -> None:
    monkeypatch.setattr(_fast_pld, "missing_internals", lambda: ["GaussianPrivacyLoss.mu_upper_cdf"])
    with caplog.at_level(logging.WARNING, logger=_fast_pld.__name__):
        assert not _fast_pld.fast_path_enabled()
    assert "GaussianPrivacyLoss.mu_upper_cdf" in caplog.text


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("std", [0.7, 2.0])
@pytest.mark.parametrize("q", [1.0, 0.3, 0.01])
@pytest.mark.parametrize("adjacency", ["ADD", "REMOVE"])
def test_twin_loss_delta_equals_the_parent_class(std: float, q: float, adjacency: str) -> None:
    """δ(ε) of the vectorised loss equals GaussianPrivacyLoss's, point by point (both sides of 0)."""
    adj = privacy_loss_mechanism.AdjacencyType[adjacency]
    ref = privacy_loss_mechanism.GaussianPrivacyLoss(std, sampling_prob=q, adjacency_type=adj)
    twin = _fast_pld._VectorizedGaussianLoss(std, sampling_prob=q, adjacency_type=adj)
    eps = np.linspace(-3.0, 6.0, 91)
    got = twin.get_delta_for_epsilon(eps)
    want = np.array([ref.get_delta_for_epsilon(float(e)) for e in eps])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-15)
    assert twin.get_delta_for_epsilon(0.5) == pytest.approx(ref.get_delta_for_epsilon(0.5), rel=1e-12, abs=1e-300)


EVENTS = {
    "gaussian": G(1.3),
    "poisson-subsampled": P(0.02, G(0.9)),
    "self-composed": S(P(512 / 60000, G(2.5)), 500),
    "runs of steps": A.dpsgd_event(1.1, 0.05, 40, 3),
    "full-batch steps": A.dpsgd_event(3.0, 1.0, 20),
    "composed": C([A.dpsgd_event(1.5, 0.05, 40), A.dpsgd_event(4.0, 0.01, 80)]),
    "composed, mixed": C((S(G(3.0), 20), P(0.1, G(1.0)), dp_event.NoOpDpEvent())),
    "self-composed composition": S(C([P(0.05, G(1.5)), G(6.0)]), 30),
}
# Measured with dp_accounting 0.6.0: ≤ 1e-10 relative at δ = 1e-5, ≤ 3e-7 at δ = 1e-9 (tiny masses).
TOLERANCE = {1e-5: 1e-9, 1e-9: 1e-6}


@pytest.mark.parametrize("name", list(EVENTS))
@pytest.mark.parametrize("delta", list(TOLERANCE))
def test_twin_epsilon_equals_the_public_accountant(name: str, delta: float) -> None:
    ev = EVENTS[name]
    pld = _fast_pld.search_pld(ev, 1e-3)
    assert pld is not None
    assert pld.get_epsilon_for_delta(delta) == pytest.approx(public_epsilon(ev, delta, 1e-3), rel=TOLERANCE[delta])


def test_twin_epsilon_at_the_default_discretisation(fresh_caches) -> None:
    """At 1e-4 (what ``epsilon(..., 'pld')`` reports), through the cached search entry point."""
    events = [
        A.dpsgd_event(0.9, 0.02, 100, 1),
        A.dpsgd_event(2.5, 512 / 60000, 500, 3),
        A.dpsgd_event(3.0, 1.0, 20, 1),
        C([A.dpsgd_event(1.5, 0.05, 40), A.dpsgd_event(4.0, 0.01, 80)]),
    ]
    for ev in events:
        ref = public_epsilon(ev, DELTA, 1e-4)
        assert _fast_pld.pld_epsilon_at(ev, DELTA, 1e-4) == pytest.approx(ref, rel=1e-9)
        assert A.epsilon(ev, DELTA, "pld") == ref  # what dptune reports IS the public accountant


def test_unsupported_events_take_the_public_path(fresh_caches) -> None:
    lap = dp_event.LaplaceDpEvent(1.0)
    assert _fast_pld.search_pld(lap, 1e-3) is None
    assert _fast_pld.search_pld(C([G(2.0), lap]), 1e-3) is None
    assert _fast_pld.search_pld(P(0.1, lap), 1e-3) is None
    assert _fast_pld.pld_epsilon_at(lap, DELTA, 1e-3) == public_epsilon(lap, DELTA, 1e-3)
    non_private = C([G(2.0), dp_event.NonPrivateDpEvent()])
    assert _fast_pld.search_pld(non_private, 1e-3) is None
    assert math.isinf(_fast_pld.pld_epsilon_at(non_private, DELTA, 1e-3))
