"""Fast noise calibration (``accounting.calibrate`` / ``calibrate_event``): never overshoots,
tight to ``rel_tol`` at the reporting accountant's own precision, and cheap."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from dptune import accounting as A
from dptune.errors import ConfigError

DELTA = 1e-5


def pld_epsilon(event: dp_event.DpEvent) -> float:
    """dp_accounting itself, at its default discretisation (what epsilon(..., 'pld') reports)."""
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    return float(acc.compose(event).get_epsilon(DELTA))


@pytest.mark.parametrize(
    "eps, q, steps, runs",
    [(1.0, 0.01, 300, 1), (4.0, 0.01, 300, 10), (2.0, 1.0, 50, 3), (3.0, 0.02, 200, 5)],
)
def test_pld_calibration_is_feasible_and_certified_tight(eps: float, q: float, steps: int, runs: int) -> None:
    info = A.calibrate_info(eps, DELTA, q, steps, runs, "pld")
    nu, lo = info.noise_multiplier, info.lower
    # Never overshoots, checked by dp_accounting directly.
    assert pld_epsilon(A.dpsgd_event(nu, q, steps, runs)) <= eps
    assert info.epsilon == A.epsilon(A.dpsgd_event(nu, q, steps, runs), DELTA, "pld") <= eps
    # Tight: the lower end of the certificate is infeasible, and within rel_tol.
    assert pld_epsilon(A.dpsgd_event(lo, q, steps, runs)) > eps
    assert 1.0 < nu / lo <= 1 + 1e-4 + 1e-12
    # Cheap: only the final point goes through the slow accountant (a second one only if
    # the vectorised twin and dp_accounting disagree right at the target).
    assert info.evaluations <= 2
    assert info.search_evaluations <= 16


@pytest.mark.parametrize(
    "eps, q, steps, runs", [(0.5, 0.005, 1000, 1), (3.0, 512 / 60000, 1172, 49), (9.0, 0.1, 100, 5)]
)
def test_rdp_calibration_matches_a_plain_bisection(eps: float, q: float, steps: int, runs: int) -> None:
    info = A.calibrate_info(eps, DELTA, q, steps, runs, "rdp")
    assert A.epsilon(A.dpsgd_event(info.noise_multiplier, q, steps, runs), DELTA, "rdp") <= eps
    assert A.epsilon(A.dpsgd_event(info.lower, q, steps, runs), DELTA, "rdp") > eps
    # Reference: bisection on ν with dp_accounting's RDP accountant, to 1e-6.
    lo, hi = 0.1, 100.0
    while hi / lo > 1 + 1e-6:
        mid = math.sqrt(lo * hi)
        if A.epsilon(A.dpsgd_event(mid, q, steps, runs), DELTA, "rdp") <= eps:
            hi = mid
        else:
            lo = mid
    assert info.noise_multiplier == pytest.approx(hi, rel=1.1e-4)
    assert info.noise_multiplier >= lo  # the smallest feasible ν is never undercut
    assert info.evaluations <= 12  # the bisection above takes ~24


def test_search_twin_agrees_with_dp_accounting() -> None:
    """The vectorised PLD used for the search reproduces dp_accounting's ε to ~1e-8."""
    events = [
        A.dpsgd_event(0.9, 0.02, 100, 1),
        A.dpsgd_event(2.5, 512 / 60000, 500, 3),
        A.dpsgd_event(3.0, 1.0, 20, 1),
        dp_event.ComposedDpEvent([A.dpsgd_event(1.5, 0.05, 40), A.dpsgd_event(4.0, 0.01, 80)]),
    ]
    for ev in events:
        ref = pld_epsilon(ev)
        assert A._pld_epsilon_at(ev, DELTA, 1e-4) == pytest.approx(ref, rel=1e-7)
    assert A._search_pld(dp_event.LaplaceDpEvent(1.0), 1e-3) is None  # unsupported → public path


def test_calibrate_event_generic_and_bracket_hints() -> None:
    """Any event family (here OSO/quantile-style composed runs), any starting bracket."""

    def make(nu: float) -> dp_event.DpEvent:
        return dp_event.ComposedDpEvent([A.dpsgd_event(nu, 0.02, 150, 2), A.dpsgd_event(nu * 1.5, 0.02, 50)])

    far = A.calibrate_event_info(make, 2.0, DELTA, "pld", bracket=(50.0, 60.0))
    near = A.calibrate_event_info(make, 2.0, DELTA, "pld")
    assert pld_epsilon(make(near.noise_multiplier)) <= 2.0 < pld_epsilon(make(near.lower))
    assert far.epsilon <= 2.0  # evaluated by dp_accounting inside the calibration
    assert far.noise_multiplier == pytest.approx(near.noise_multiplier, rel=2e-4)
    gdp = A.calibrate_event(lambda nu: A.dpsgd_event(nu, 1.0, 30), 1.0, DELTA, "gdp")
    assert A.epsilon(A.dpsgd_event(gdp, 1.0, 30), DELTA, "gdp") <= 1.0


def test_per_grid_calibration_is_cached() -> None:
    q, steps = 512 / 60000, 1172
    first = A.calibrate_info(3.0, DELTA, q, steps, 49, "pld")
    assert A.calibrate_info(3.0, DELTA, q, steps, 49, "pld") is first  # a planner asking twice pays once
    assert A.calibrate(3.0, DELTA, q, steps, 49, "pld") == first.noise_multiplier
    # The 49-run grid needs more noise than one run, less than 49 independent budgets would.
    single = A.calibrate(3.0, DELTA, q, steps, 1, "pld")
    assert single < first.noise_multiplier < 49 * single


def test_bad_inputs_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="steps and runs"):
        A.calibrate(1.0, DELTA, 0.01, 0)
    with pytest.raises(ConfigError, match="rel_tol"):
        A.calibrate_event(lambda nu: A.dpsgd_event(nu, 0.01, 10), 1.0, DELTA, rel_tol=0.0)
    with pytest.raises(ConfigError, match="could not reach"):
        A.calibrate_event(
            lambda nu: dp_event.ComposedDpEvent([A.dpsgd_event(nu, 0.1, 5), dp_event.NonPrivateDpEvent()]),
            1.0,
            DELTA,
            "rdp",
        )
    assert A.calibrate(3.0, DELTA, 0.01, 10.0) == A.calibrate(3.0, DELTA, 0.01, 10)  # integral floats are counts


@settings(max_examples=60, deadline=None)
@given(
    a=st.floats(0.5, 3.0),
    c=st.floats(0.5, 50.0),
    target=st.floats(0.1, 20.0),
    step=st.floats(0.0, 0.2),
    guess=st.floats(-5.0, 5.0),
    rel_tol=st.sampled_from([1e-2, 1e-4, 1e-6]),
)
def test_solver_invariant_on_arbitrary_monotone_curves(
    a: float, c: float, target: float, step: float, guess: float, rel_tol: float
) -> None:
    """ε(ν) = c·ν^(−a), plus a staircase (discretisation-like, not smooth): the returned hi is
    feasible, lo infeasible, hi/lo ≤ 1 + rel_tol, whatever the guess."""

    def eps_of(nu: float) -> float:
        smooth = c * nu ** (-a)
        return smooth + step * math.floor(smooth / max(step, 1e-9)) * 1e-3 if step else smooth

    f = A._LogEps(eps_of, target)
    lo, hi = A._solve(f, guess, math.log1p(rel_tol), target)
    assert lo is not None  # the root (c/target)^(1/a) ≥ 6e-4 lies above NU_FLOOR
    assert eps_of(math.exp(hi)) <= target < eps_of(math.exp(lo))
    assert hi - lo <= math.log1p(rel_tol) * (1 + 1e-9)
    assert len(f.values) <= 120
