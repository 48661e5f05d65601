"""Fast noise calibration (``accounting.calibrate``, run and ``make_event`` forms): never overshoots,
tight to ``rel_tol`` at the reporting accountant's own precision, and cheap."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from dptune import accounting as A
from dptune.accounting import solver
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
    info = A.calibrate(eps, DELTA, q, steps, runs, "pld")
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
    info = A.calibrate(eps, DELTA, q, steps, runs, "rdp")
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


def test_calibrate_event_generic_and_bracket_hints() -> None:
    """Any event family (here OSO/quantile-style composed runs), any starting bracket."""

    def make(nu: float) -> dp_event.DpEvent:
        return dp_event.ComposedDpEvent([A.dpsgd_event(nu, 0.02, 150, 2), A.dpsgd_event(nu * 1.5, 0.02, 50)])

    far = A.calibrate(2.0, DELTA, accountant="pld", make_event=make, bracket=(50.0, 60.0))
    near = A.calibrate(2.0, DELTA, accountant="pld", make_event=make)
    assert pld_epsilon(make(near.noise_multiplier)) <= 2.0 < pld_epsilon(make(near.lower))
    assert far.epsilon <= 2.0  # evaluated by dp_accounting inside the calibration
    assert far.noise_multiplier == pytest.approx(near.noise_multiplier, rel=2e-4)
    gdp = A.calibrate(1.0, DELTA, accountant="gdp", make_event=lambda nu: A.dpsgd_event(nu, 1.0, 30)).noise_multiplier
    assert A.epsilon(A.dpsgd_event(gdp, 1.0, 30), DELTA, "gdp") <= 1.0


def test_one_calibrate_for_the_run_and_the_event_forms() -> None:
    """A DP-SGD run given as (q, steps, runs) or as make_event gets the same certified ν, and the
    result names the δ and the accountant its ε was checked at."""
    q, steps, runs = 0.01, 300, 2
    run = A.calibrate(2.0, DELTA, q, steps, runs, "rdp")
    event = A.calibrate(2.0, DELTA, accountant="rdp", make_event=lambda nu: A.dpsgd_event(nu, q, steps, runs))
    assert (event.noise_multiplier, event.lower) == (run.noise_multiplier, run.lower)
    assert (run.delta, run.accountant, event.delta, event.accountant) == (DELTA, "rdp", DELTA, "rdp")
    assert run.epsilon == A.epsilon(A.dpsgd_event(run.noise_multiplier, q, steps, runs), DELTA, "rdp") <= 2.0
    # A bracket is a hint in the run form too: far from the root, the same ν within rel_tol.
    far = A.calibrate(2.0, DELTA, q, steps, runs, "rdp", bracket=(40.0, 50.0))
    assert far.epsilon <= 2.0 < A.epsilon(A.dpsgd_event(far.lower, q, steps, runs), DELTA, "rdp")
    assert far.noise_multiplier == pytest.approx(run.noise_multiplier, rel=2e-4)


def test_calibrate_refuses_an_ambiguous_or_missing_event() -> None:
    def make(nu: float) -> dp_event.DpEvent:
        return A.dpsgd_event(nu, 0.01, 10)

    with pytest.raises(ConfigError, match=r"both make_event and a run.*Fix: pass one of them"):
        A.calibrate(1.0, DELTA, 0.01, 10, make_event=make)
    with pytest.raises(ConfigError, match=r"runs=3.*runs included"):
        A.calibrate(1.0, DELTA, runs=3, make_event=make)
    with pytest.raises(ConfigError, match=r"needs the run.*Fix: pass sampling_rate and steps"):
        A.calibrate(1.0, DELTA)
    for bad in [(0.0, 1.0), (1.0, math.inf), ("a", 1.0), (1.0,)]:
        with pytest.raises(ConfigError, match=r"bracket must hold two positive.*Fix"):
            A.calibrate(1.0, DELTA, 0.01, 10, bracket=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"bracket must hold two positive.*Fix"):
            A.calibrate(1.0, DELTA, make_event=make, bracket=bad)  # type: ignore[arg-type]


def test_per_grid_calibration_is_cached() -> None:
    q, steps = 512 / 60000, 1172
    first = A.calibrate(3.0, DELTA, q, steps, 49, "pld")
    assert A.calibrate(3.0, DELTA, q, steps, 49, "pld") is first  # a planner asking twice pays once
    assert A.calibrate(3.0, DELTA, sampling_rate=q, steps=steps, runs=49, accountant="pld") is first
    # The 49-run grid needs more noise than one run, less than 49 independent budgets would.
    single = A.calibrate(3.0, DELTA, q, steps, 1, "pld").noise_multiplier
    assert single < first.noise_multiplier < 49 * single


def test_bad_inputs_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="steps and runs"):
        A.calibrate(1.0, DELTA, 0.01, 0)
    with pytest.raises(ConfigError, match="rel_tol"):
        A.calibrate(1.0, DELTA, make_event=lambda nu: A.dpsgd_event(nu, 0.01, 10), rel_tol=0.0)
    with pytest.raises(ConfigError, match="could not reach"):
        A.calibrate(
            1.0,
            DELTA,
            accountant="rdp",
            make_event=lambda nu: dp_event.ComposedDpEvent([A.dpsgd_event(nu, 0.1, 5), dp_event.NonPrivateDpEvent()]),
        )
    assert A.calibrate(3.0, DELTA, 0.01, 10.0) is A.calibrate(3.0, DELTA, 0.01, 10)  # integral floats are counts


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

    f = solver.LogEps(eps_of, target)
    lo, hi = solver.solve(f, guess, math.log1p(rel_tol), target)
    assert lo is not None  # the root (c/target)^(1/a) ≥ 6e-4 lies above NU_FLOOR
    assert eps_of(math.exp(hi)) <= target < eps_of(math.exp(lo))
    assert hi - lo <= math.log1p(rel_tol) * (1 + 1e-9)
    assert len(f.values) <= 120


def test_an_epsilon_of_zero_from_the_accountant_is_no_certificate() -> None:
    """Found in review: below RDP's conversion floor dp_accounting answers a numerical instability with ε = 0, which the
    solver took for feasible: ν = 2.3·10⁷ certified by a float artifact, a chance-level model. Now one clear error."""
    from dptune.accounting import calibrate
    from dptune.errors import ConfigError

    with pytest.raises(ConfigError, match="could not reach ε ≤ 0.001.*RDP cannot certify a tiny ε"):
        calibrate(1e-3, 1e-15, sampling_rate=40 / 270, steps=10, accountant="rdp")
