"""Privacy accounting on ``dp_accounting`` (no hand-rolled accountant): pure functions of ``DpEvent``s,
add/remove neighbours. ``events`` (checks, DP-SGD events, split noise), ``gdp`` (exact μ-GDP, full batch
only), ``accountants`` (``epsilon``), ``calibration`` (``calibrate``, printing ν), ``solver``, ``_fast_pld``
(search only). Derivations: docs/accounting.md."""

from __future__ import annotations

from dptune.accounting import _fast_pld
from dptune.accounting import accountants as _accountants
from dptune.accounting import calibration as _calibration
from dptune.accounting.accountants import (
    PLD_MAX_RELEASES,
    PLD_MIN_DELTA,
    epsilon,
    epsilon_cached,
    make_accountant,
    pld_cost_problem,
    tightest_accountant,
)
from dptune.accounting.calibration import Calibration, calibrate, noise_multiplier_text, round_up
from dptune.accounting.events import (
    check_accountant,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sampling_rate,
    dpsgd_event,
    gaussian_step_event,
    joint_noise_multiplier,
    oso_q_noise_multiplier,
    releases_of,
    split_noise_multiplier,
)
from dptune.accounting.gdp import gdp_delta, gdp_epsilon, gdp_mu_for_epsilon, gdp_mu_of_event

__all__ = [
    "Calibration",
    "calibrate",
    "check_accountant",
    "check_delta",
    "check_epsilon",
    "check_noise_multiplier",
    "check_sampling_rate",
    "clear_caches",
    "dpsgd_event",
    "epsilon",
    "epsilon_cached",
    "gaussian_step_event",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu_for_epsilon",
    "gdp_mu_of_event",
    "joint_noise_multiplier",
    "make_accountant",
    "noise_multiplier_text",
    "oso_q_noise_multiplier",
    "pld_cost_problem",
    "PLD_MAX_RELEASES",
    "PLD_MIN_DELTA",
    "releases_of",
    "round_up",
    "split_noise_multiplier",
    "tightest_accountant",
]


def clear_caches() -> None:
    """Forget every memoised ε, search PLD and calibration (benchmarks; tests that patch the code)."""
    _accountants.clear_caches()
    _fast_pld.clear_caches()
    _calibration.clear_caches()
