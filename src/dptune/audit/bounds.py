"""Statistics of privacy audits: membership guesses → ε lower bounds at confidence ``1 − α``, valid for
ANY (ε, δ)-DP mechanism: one run (Steinke, Nasr & Jagielski 2023, Thm 5.2) and two worlds (Jagielski et
al. 2020). Data-driven choices are Bonferroni-corrected or made on a held-out split (docs/reliability.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special, stats

from dptune.errors import ConfigError

EPS_MAX = 60.0  # the search ceiling for ε lower bounds (e^60 is far beyond any float count ratio)


def check_confidence(confidence: float) -> float:
    if not isinstance(confidence, int | float) or not (0.5 <= confidence < 1):
        raise ConfigError(f"confidence must lie in [0.5, 1), got {confidence!r}. Fix: the usual choice is 0.95.")
    return float(confidence)


# ----------------------------------------------------------------------------- one run
def one_run_p_value(m: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """Upper bound on P[W ≥ correct] for an (ε, δ)-DP mechanism (Steinke et al., Theorem 5.2); ``m``:
    the canaries in all (the δ term scales with m, not with the guesses)."""
    if guesses <= 0 or correct <= 0:
        return 1.0
    p = float(special.expit(eps))
    # f(v − i) for i = 0..correct: P[Binom(r, p) ≥ v − i] = sf(v − i − 1).
    f = stats.binom.sf(correct - np.arange(0, correct + 1) - 1, guesses, p)
    beta = float(f[0])
    if delta == 0:
        return min(beta, 1.0)
    i = np.arange(1, correct + 1)
    alpha = float(np.max((f[1:] - beta) / i, initial=0.0))
    return min(beta + 2.0 * m * delta * alpha, 1.0)


def one_run_epsilon(m: int, guesses: int, correct: int, delta: float, significance: float) -> float:
    """Largest ε ≥ 0 that ``correct`` of ``guesses`` rejects at ``significance`` (0 if even ε = 0 is not)."""

    def excess(eps: float) -> float:
        return significance - one_run_p_value(m, guesses, correct, eps, delta)

    if excess(0.0) <= 0:
        return 0.0
    if excess(EPS_MAX) > 0:
        return EPS_MAX
    return float(optimize.brentq(excess, 0.0, EPS_MAX, xtol=1e-6))


@dataclass(frozen=True)
class OneRunBound:
    epsilon: float
    canaries: int  # canaries the bound is computed on (m of the theorem)
    guesses: int
    correct: int
    k_in: int  # guesses "included" (top scores)
    k_out: int  # guesses "excluded" (bottom scores)
    score: int  # index of the chosen candidate score
    tests: int  # number of tests the significance is split over (Bonferroni factor)


# Fractions of the canaries guessed: (top, bottom). One-sided policies suit Poisson-subsampled training (an included
# canary never sampled looks like an absent one: "out" guesses are less reliable); two-sided ones suit full batch.
GUESS_FRACTIONS: tuple[tuple[float, float], ...] = tuple((f, 0.0) for f in (0.02, 0.05, 0.1, 0.2, 0.4)) + tuple(
    (f, f) for f in (0.01, 0.025, 0.05, 0.1, 0.2)
)


def _score_arrays(scores: Sequence[np.ndarray] | np.ndarray) -> list[np.ndarray]:
    """One score array, or several candidate scores, as float arrays."""
    return [np.asarray(s, dtype=float) for s in ([scores] if isinstance(scores, np.ndarray) else scores)]


def _guess(order: np.ndarray, inc: np.ndarray, k_in: int, k_out: int) -> int:
    """#correct when the top ``k_in`` are guessed in and the bottom ``k_out`` out."""
    m = order.size
    top, bottom = order[:k_in], order[m - k_out :] if k_out else order[:0]
    return int(inc[top].sum() + (~inc[bottom]).sum())


def one_run_bound(
    scores: Sequence[np.ndarray] | np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    selection_fraction: float = 0.2,
    seed: int = 0,
    fractions: Sequence[tuple[float, float]] = GUESS_FRACTIONS,
) -> OneRunBound:
    """ε lower bound of a one-run audit; ``scores``: one array (higher = "member") or several. The guess
    policy is chosen on a revealed ``selection_fraction`` of the canaries and the test run on the others at
    full significance; ``selection_fraction=0``: every policy, Bonferroni-corrected."""
    check_confidence(confidence)
    score_list = _score_arrays(scores)
    inc = np.asarray(included, dtype=bool)
    m = int(inc.shape[0])
    if m < 20 or any(s.shape != inc.shape for s in score_list) or not score_list:
        raise ConfigError("a one-run audit needs ≥ 20 canaries and one score per canary.")
    if any(not np.all(np.isfinite(s)) for s in score_list):
        raise ConfigError("canary scores must be finite.")
    if not (0 <= selection_fraction < 1):
        raise ConfigError(f"selection_fraction must lie in [0, 1), got {selection_fraction}.")
    alpha = 1.0 - confidence
    policies = [(j, fi, fo) for j in range(len(score_list)) for fi, fo in fractions]

    def evaluate(idx: np.ndarray, sig: float, pol: list[tuple[int, float, float]]) -> OneRunBound:
        mm = idx.size
        best = OneRunBound(0.0, mm, 0, 0, 0, 0, pol[0][0], len(pol))
        for j, fi, fo in pol:
            k_in, k_out = round(fi * mm), round(fo * mm)
            if k_in + k_out == 0 or k_in + k_out > mm:
                continue
            # A stable sort: ties keep a fixed order (index), so they cannot favour the truth.
            correct = _guess(np.argsort(-score_list[j][idx], kind="stable"), inc[idx], k_in, k_out)
            eps = one_run_epsilon(mm, k_in + k_out, correct, delta, sig)
            if eps > best.epsilon:
                best = OneRunBound(eps, mm, k_in + k_out, correct, k_in, k_out, j, len(pol))
        return best

    if selection_fraction == 0 or len(policies) == 1:
        return evaluate(np.arange(m), alpha / len(policies), policies)
    perm = np.random.default_rng(seed).permutation(m)
    n_sel = int(round(selection_fraction * m))
    sel, ev = perm[:n_sel], perm[n_sel:]

    def on_selection(policy: tuple[int, float, float]) -> tuple[float, int]:
        # The same statistic at the same level; among ties (e.g. all perfect) more guesses, which
        # saturate higher; among equals the first policy.
        b = evaluate(sel, alpha, [policy])
        return b.epsilon, b.guesses

    return evaluate(ev, alpha, [max(policies, key=on_selection)])


# ----------------------------------------------------------------------------- two worlds
def clopper_pearson_upper(k: int, n: int, significance: float) -> float:
    """One-sided upper confidence bound on a binomial rate: P[Binom(n, p⁺) ≤ k] = significance."""
    if n <= 0 or k >= n:
        return 1.0
    return float(stats.beta.ppf(1.0 - significance, k + 1, n - k))


def dp_epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """max(log((1−δ−FPR)/FNR), log((1−δ−FNR)/FPR)), floored at 0 (the (ε, δ)-DP region)."""
    best = 0.0
    for a, b in ((fpr, fnr), (fnr, fpr)):
        num = 1.0 - delta - a
        if num > 0 and b > 0:
            best = max(best, math.log(num / b))
        elif num > 0 and b == 0:
            return math.inf
    return best


@dataclass(frozen=True)
class TwoWorldBound:
    epsilon: float
    threshold: float
    fpr_upper: float
    fnr_upper: float
    false_positives: int
    false_negatives: int
    trials_out: int
    trials_in: int
    score: int  # index of the chosen candidate score


def two_world_bound_at(
    out_s: np.ndarray, in_s: np.ndarray, thr: float, delta: float, confidence: float
) -> tuple[float, float, float, int, int]:
    """Clopper–Pearson ε lower bound of the fixed test "member iff score ≥ thr"."""
    fp, fn = int((out_s >= thr).sum()), int((in_s < thr).sum())  # false positives, false negatives
    sig = (1.0 - confidence) / 2.0  # union bound over the two rates
    fpr_u = clopper_pearson_upper(fp, out_s.size, sig)
    fnr_u = clopper_pearson_upper(fn, in_s.size, sig)
    return dp_epsilon_from_rates(fpr_u, fnr_u, delta), fpr_u, fnr_u, fp, fn


def _bounds_at_thresholds(
    out_s: np.ndarray, in_s: np.ndarray, thr: np.ndarray, delta: float, confidence: float
) -> np.ndarray:
    """Vectorised ``two_world_bound_at`` over an array of thresholds."""
    fp = out_s.size - np.searchsorted(np.sort(out_s), thr, side="left")  # #out ≥ thr
    fn = np.searchsorted(np.sort(in_s), thr, side="left")  # #in < thr
    sig = (1.0 - confidence) / 2.0
    fpr_u = np.where(fp < out_s.size, stats.beta.ppf(1.0 - sig, fp + 1, np.maximum(out_s.size - fp, 1)), 1.0)
    fnr_u = np.where(fn < in_s.size, stats.beta.ppf(1.0 - sig, fn + 1, np.maximum(in_s.size - fn, 1)), 1.0)
    return np.array([dp_epsilon_from_rates(a, b, delta) for a, b in zip(fpr_u, fnr_u, strict=True)])


def two_world_bound(
    out_scores: Sequence[np.ndarray] | np.ndarray,
    in_scores: Sequence[np.ndarray] | np.ndarray,
    delta: float,
    confidence: float = 0.95,
    selection_fraction: float = 0.5,
    seed: int = 0,
) -> TwoWorldBound:
    """Two-world ε lower bound: (score, threshold) chosen on a ``selection_fraction`` of each world's
    trials, the Clopper–Pearson bound on the others; ``out_scores``/``in_scores``: one array per candidate."""
    check_confidence(confidence)
    outs, ins = _score_arrays(out_scores), _score_arrays(in_scores)
    if len(outs) != len(ins) or not outs:
        raise ConfigError("give the same number of candidate scores for both worlds.")
    n_out, n_in = outs[0].size, ins[0].size
    if n_out < 4 or n_in < 4:
        raise ConfigError("a two-world audit needs at least 4 trials in each world.")
    if not (0 < selection_fraction < 1):
        raise ConfigError(f"selection_fraction must lie in (0, 1), got {selection_fraction}.")
    rng = np.random.default_rng(seed)
    po, pi = rng.permutation(n_out), rng.permutation(n_in)
    so, si = po[: int(n_out * selection_fraction)], pi[: int(n_in * selection_fraction)]
    eo, ei = po[int(n_out * selection_fraction) :], pi[int(n_in * selection_fraction) :]
    best_sel, choice = -1.0, (0, math.inf)
    for j, (o, i) in enumerate(zip(outs, ins, strict=True)):
        o_sel, i_sel = o[so], i[si]
        qs = np.unique(np.quantile(np.concatenate([o_sel, i_sel]), np.linspace(0.0, 1.0, 400)))
        # Midpoints avoid thresholds that sit exactly on observed (tied) scores.
        thr = np.unique(np.concatenate([qs, (qs[1:] + qs[:-1]) / 2]))
        # Select on the same statistic that will be reported (CP bound), on the selection split.
        eps = _bounds_at_thresholds(o_sel, i_sel, thr, delta, confidence)
        k = int(np.argmax(eps))
        if eps[k] > best_sel:
            best_sel, choice = float(eps[k]), (j, float(thr[k]))
    j, thr = choice
    eps, fpr_u, fnr_u, fp, fn = two_world_bound_at(outs[j][eo], ins[j][ei], thr, delta, confidence)
    return TwoWorldBound(eps, thr, fpr_u, fnr_u, fp, fn, eo.size, ei.size, j)
