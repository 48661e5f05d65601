"""Per-grid noise calibration time: ``accounting.calibrate`` for a 49-run grid.

    python benchmarks/calibration.py --quick     # ε ∈ {1, 3, 9}, baseline at ε = 3 only
    python benchmarks/calibration.py             # ε ∈ {1, …, 9}, with the bisection baseline at ε = 3

Setting (Galli et al.'s grids): q = 512/60000, 10 epochs (T = 1172 steps), δ = 1e-5,
K = 49 runs composed, ε ∈ {1, …, 9}, accountant PLD (dp_accounting, discretisation 1e-4)
and RDP. Caches are cleared before every calibration (cold timings). For each ε the
script prints the time, the number of evaluations at the reporting precision, the cheap
search evaluations, the returned ν and its certificate ε(ν) ≤ target < ε(ν/(1+rel_tol)).

Baselines: one dp_accounting PLD evaluation of the 49-run block at the calibrated ν (the
unit of cost), and the previous algorithm (RDP calibration for the upper bracket, then
bisection on log ν with PLD at full precision to rel_tol = 1e-4).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, table  # noqa: E402

from dptune import accounting as A  # noqa: E402

Q, STEPS, DELTA, RUNS = 512 / 60000, 1172, 1e-5, 49


def clear_caches() -> None:
    A.clear_caches()


def previous_algorithm(eps: float) -> tuple[float, int]:
    """The pre-optimisation calibrate(..., 'pld'): RDP bracket, then PLD bisection on log ν."""
    evals = 0

    def pld(nu: float) -> float:
        nonlocal evals
        evals += 1
        return A.epsilon(A.dpsgd_event(nu, Q, STEPS, RUNS), DELTA, "pld")

    lo_r, hi_r = 0.05, 1.0  # RDP calibration to 1e-3 by bisection (as before)
    while A.epsilon(A.dpsgd_event(hi_r, Q, STEPS, RUNS), DELTA, "rdp") > eps:
        lo_r, hi_r = hi_r, 2 * hi_r
    while hi_r / lo_r > 1 + 1e-3:
        mid = math.sqrt(lo_r * hi_r)
        if A.epsilon(A.dpsgd_event(mid, Q, STEPS, RUNS), DELTA, "rdp") <= eps:
            hi_r = mid
        else:
            lo_r = mid
    lo, hi = 0.5 * hi_r, hi_r
    while pld(lo) <= eps:
        hi, lo = lo, lo / 2
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        if pld(mid) <= eps:
            hi = mid
        else:
            lo = mid
    return hi, evals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", nargs="+", type=float, default=[float(e) for e in range(1, 10)])
    ap.add_argument("--accountants", nargs="+", default=["pld", "rdp"], choices=["pld", "rdp"])
    ap.add_argument("--baseline-eps", nargs="*", type=float, default=[3.0], help="ε values for the old algorithm")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.eps = [1.0, 3.0, 9.0]
    print(f"# calibration: {machine()}")
    print(f"# q = {Q:.6g}, T = {STEPS}, δ = {DELTA:g}, K = {RUNS} runs\n")
    rows = []
    for acc in args.accountants:
        total = 0.0
        for eps in args.eps:
            clear_caches()
            t0 = time.perf_counter()
            info = A.calibrate(eps, DELTA, Q, STEPS, RUNS, acc)
            dt = time.perf_counter() - t0
            total += dt
            rows.append(
                {
                    "accountant": acc,
                    "ε": eps,
                    "seconds": dt,
                    "ν": info.noise_multiplier,
                    "ε(ν)": info.epsilon,
                    "ν/lower": info.noise_multiplier / info.lower,
                    "full-precision evals": info.evaluations,
                    "search evals": info.search_evaluations,
                }
            )
            print(
                f"{acc} ε = {eps:g}: {dt:6.2f} s  ν = {info.noise_multiplier:.6f}  ε(ν) = {info.epsilon:.6f}  "
                f"({info.evaluations} full-precision + {info.search_evaluations} search evaluations)"
            )
        print(f"{acc}: {len(args.eps)} calibrations in {total:.2f} s ({total / len(args.eps):.2f} s each)\n")
    if "pld" in args.accountants:
        for eps in args.baseline_eps:
            clear_caches()
            nu = A.calibrate(eps, DELTA, Q, STEPS, RUNS, "pld").noise_multiplier
            clear_caches()
            t0 = time.perf_counter()
            A.epsilon(A.dpsgd_event(nu, Q, STEPS, RUNS), DELTA, "pld")
            one = time.perf_counter() - t0
            clear_caches()
            t0 = time.perf_counter()
            nu_old, evals = previous_algorithm(eps)
            old = time.perf_counter() - t0
            print(
                f"baseline ε = {eps:g}: one dp_accounting PLD evaluation of the 49-run block: {one:.2f} s; "
                f"previous algorithm: {old:.1f} s ({evals} PLD evaluations), ν = {nu_old:.6f} vs {nu:.6f} now"
            )
            rows.append(
                {"accountant": "pld (previous)", "ε": eps, "seconds": old, "ν": nu_old, "full-precision evals": evals}
            )
            rows.append({"accountant": "one PLD evaluation", "ε": eps, "seconds": one})
    print(
        "\n"
        + table(rows, ["accountant", "ε", "seconds", "ν", "ε(ν)", "ν/lower", "full-precision evals", "search evals"])
    )


if __name__ == "__main__":
    main()
