"""The root of a decreasing ε(ν) = target on x = log ν, keeping "hi feasible, lo infeasible". Generic (no DP
here); the algorithm (Newton bracketing, Illinois regula falsi): docs/performance.md, "3. Calibration"."""

from __future__ import annotations

import math
from collections.abc import Callable

from dptune.accounting.events import NU_CEILING, NU_FLOOR
from dptune.errors import ConfigError


class LogEps:
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
            if math.isnan(e) or e <= 0:  # unknown privacy counts as infeasible; so does ε = 0 at finite noise,
                v = math.inf  # dp_accounting's answer to a numerical instability, no certificate (found in review)
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


def solve(f: LogEps, guess: float, tol: float, target: float, slope: float = -1.0) -> tuple[float | None, float]:
    """Bracket and shrink the root of f to hi − lo ≤ tol (log space); returns (lo, hi), lo None when ν =
    NU_FLOOR is feasible; ConfigError when ν = NU_CEILING is not. ``slope``: the start d log ε / d log ν."""
    lo, hi = f.bounds()
    if lo is None and hi is None:
        f(guess)
        lo, hi = f.bounds()
    over = 0.45 * tol
    cap = math.log(20.0)  # no single jump beyond a factor 20 in ν
    while lo is None or hi is None:
        base = hi if hi is not None else lo
        assert base is not None  # f(guess) was evaluated: one end is known
        fb = f.values[base]
        jump = -fb / slope if math.isfinite(fb) else 0.0
        if hi is None:
            x = base + min(max(jump, 0.0), cap) + over
            if x > math.log(NU_CEILING):
                raise ConfigError(
                    f"could not reach ε ≤ {target} even with noise multiplier {math.exp(base):.3g}: more noise "
                    "does not help. Fix: check δ (a δ below about 1e-300 cannot be met by any noise level; RDP cannot "
                    "certify a tiny ε at a tiny δ: raise either) and that every release of the run is noised."
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
    assert lo is not None and hi is not None  # mypy does not narrow through the loop condition
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
