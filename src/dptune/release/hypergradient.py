"""OSO's hypergradient sign rules (Galli et al., eqs. 13–21), shared by the online clipping
threshold (``privatizers.OSOClip``) and the online learning rate (``updates.OSORate``)."""

from __future__ import annotations

import math
from typing import Literal

from dptune.errors import ConfigError
from dptune.release.context import RunPlan

# OSO's hyperparameter rates, horizon-aware (docs/strategies.md, "Horizon-aware rates"): under the
# sign rule C and ρ move by a factor of at most exp(ρ_c·T); Galli et al.'s ρ_c = ρ_r = 2.5e-3 at
# their T ≈ 1,172 steps (MNIST, 5 epochs at L = 256 of 60,000) allow exp(2.93) ≈ 19×. A rate
# left unset gives every run that same range: ρ = OSO_LOG_RANGE / T.
OSO_LOG_RANGE = 2.5e-3 * 1172


def horizon_rate(rate: float | None, run: RunPlan) -> float:
    """An OSO rate: the given one, or OSO_LOG_RANGE / T (public: T is planned)."""
    return float(rate) if rate is not None else OSO_LOG_RANGE / max(run.steps, 1)


def check_rate(name: str, rate: float | None) -> None:
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0
    ):
        raise ConfigError(f"{name} must be a finite number ≥ 0 or None (horizon-aware), got {rate!r}.")


Rule = Literal["exp", "additive", "normalized"]
RULES = ("exp", "additive", "normalized")


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ConfigError(f"unknown OSO rule {rule!r}; choose exp, additive or normalized.")


def _sign(x: float) -> float:
    return 0.0 if x == 0 or math.isnan(x) else math.copysign(1.0, x)


def hypergradient_step(
    rule: Rule, value: float, rate: float, dir_dot: float, cos: float, scale: float, floor: float
) -> float:
    """One OSO hyperparameter update from a hypergradient's dot product (Galli eqs. 13–21):
    ``exp``: v·exp(rate·sign(dot)); ``normalized``: v(1 + rate·cos); ``additive``: v + rate·scale·dot.
    The last two are floored at ``floor`` so that v stays a valid C (or ρ)."""
    if rule == "exp":
        return value * math.exp(rate * _sign(dir_dot))
    if rule == "normalized":
        return max(value * (1.0 + rate * cos), floor)
    return max(value + rate * scale * dir_dot, floor)
