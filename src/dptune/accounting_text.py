"""ε per accountant and the calibrated ν as ``dptune account`` and ``calibrate`` print them: rounded up
(a privacy claim); extreme ν or q is one clear error. Imports the accountant only when called."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dptune.errors import ConfigError

PLD_EPSILON_CAP = 1000.0  # above this RDP ε, PLD's discretised privacy-loss grid is not built


@contextmanager
def numeric_range(what: str) -> Iterator[None]:
    """One clear line where dp_accounting's floats overflow at extreme ν and q (ν = 1e154, q = 1e-179)."""
    try:
        yield
    except ArithmeticError as exc:
        raise ConfigError(
            f"the accountant cannot evaluate {what}: numerically out of range ({exc}). Fix: use a "
            "noise multiplier in [1e-3, 1e4] and a sampling rate ≥ 1e-12 (beyond them ε is ≈ 0 or unbounded)."
        ) from None


def epsilon_rows(
    nu: float, q: float, steps: int, delta: float, runs: int, accountant: str
) -> Iterator[tuple[str, str]]:
    """(accountant, ε rounded up) of T Poisson-sampled Gaussian steps (× runs); ``accountant``: rdp|pld|gdp|all."""
    from dptune import accounting

    event = accounting.dpsgd_event(nu, q, steps, runs)
    names = ["rdp", "pld"] + (["gdp"] if q >= 1 else []) if accountant == "all" else [accountant]
    with numeric_range(f"ν = {nu!r}, q = {q!r}"):
        rdp_eps = accounting.epsilon(event, delta, "rdp")
        for name in names:
            problem = accounting.pld_cost_problem(nu, accounting.releases_of(event)) if name == "pld" else None
            if name == "pld" and delta < accounting.PLD_MIN_DELTA:  # dp_accounting's PLD answers ∞ there
                problem = f"δ below {accounting.PLD_MIN_DELTA:g}, beyond PLD's resolved tails"
            if name == "pld" and rdp_eps > PLD_EPSILON_CAP:
                # PLD ≤ RDP, but its grid grows with ε (35 PiB at ν = 1e-6): no guarantee worth a table.
                yield name, f"not computed (RDP gives {accounting.round_up(rdp_eps, 6):.6g}: no meaningful privacy)"
            elif problem is not None:  # minutes and gigabytes: RDP's row stands
                yield name, f"not computed ({problem}; see RDP)"
            else:
                eps = rdp_eps if name == "rdp" else accounting.epsilon(event, delta, name)
                yield name, f"{accounting.round_up(eps, 6):.6g}"


def calibrated_noise(
    epsilon: float, delta: float, q: float, steps: int, runs: int, accountant: str
) -> tuple[str, float, str]:
    """(ν as printed, rounded up, the ε that printed value achieves, the accountant) for (ε, δ)."""
    from dptune import accounting

    if accountant == "auto":
        accountant = accounting.tightest_accountant(q, steps * runs, delta)
    with numeric_range(f"ε = {epsilon!r}, q = {q!r}"):
        nu = accounting.calibrate(epsilon, delta, q, steps, runs, accountant).noise_multiplier

    def eps_of(v: float) -> float:
        return accounting.epsilon(accounting.dpsgd_event(v, q, steps, runs), delta, accountant)

    text, shown = accounting.noise_multiplier_text(nu, eps_of, epsilon)
    return text, accounting.round_up(eps_of(shown), 6), accountant
