"""Deliberately broken variants of dptune's privacy code, for the mutation suite.

Each mutant is a context manager that monkeypatches the real code (class or module
attributes) and restores it on exit. They live ONLY in the test tree: nothing in
``src/`` imports them. An audit with power must flag every one of them, i.e. report an ε
lower bound above the ε that dptune claims for the broken run.

* ``noise_scaled(0.25)``: every noise draw has std 0.25·σ while the ledger still claims σ
  (true ε at the audited settings: ≫ 10 for a claim of 2–4). Deferred draws (OSO's q̃
  projection, ``NoiseSource.scalar``) go through ``NoiseSource.normal`` too.
* ``clipping_disabled()``: clip weights min(1, C/‖g‖) replaced by 1 (unbounded sensitivity).
* ``q_noise_removed()``: OSO's q-query q̃_t is released without noise (eagerly: the exact
  sum; deferred: a handle of std 0, so its projection and its materialization are exact).
* ``split_accounted_at_nu_g()``: OSO's split accounted at ν_g instead of ν (Opacus-AdaClip
  style): the calibrated ν is used as the *gradient's* multiplier ν_g and the q-query is
  added on top with the same ν_q/ν_g ratio, while the ledger only sees ν_g. The true joint
  multiplier is ν/(1+r) (r = relative_increase): a factor 4 too little noise at r = 3.
* ``isolation_check_skipped()``: the isolation probe of the ghost path and of DP-ZO always
  passes; not in ``APPLICABLE`` (the audits' canary models do not mix examples), caught by
  ``tests/privacy/test_isolation_probe.py``, which measures ‖S(D ∪ {x}) − S(D)‖ > C through the gateway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dptune import accounting
from dptune.release import privatizers
from dptune.release.context import RunPlan
from dptune.release.mechanisms import DeferredSum, NoiseSource, NoisyRelease, SumQuery
from dptune.release.privatizers import OSOClip


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    previous = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextlib.contextmanager
def noise_scaled(factor: float = 0.25) -> Iterator[None]:
    """Every Gaussian draw of the gateway has std ``factor``·σ (the ledger still claims σ)."""
    original = NoiseSource.__dict__["normal"]

    def normal(self: NoiseSource, like: torch.Tensor, std: float) -> torch.Tensor:
        return original(self, like, std * factor)

    with _patched(NoiseSource, "normal", normal):
        yield


@contextlib.contextmanager
def clipping_disabled() -> Iterator[None]:
    """min(1, C/‖g‖) → 1 in every dptune module that imported ``clip_weights`` (the privatizers)."""
    original = privatizers.clip_weights

    def no_clip(norms: torch.Tensor, clip: float) -> torch.Tensor:
        return torch.ones_like(norms)

    owners = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("dptune") and getattr(m, "clip_weights", None) is original
    ]
    with contextlib.ExitStack() as stack:
        for m in owners:
            stack.enter_context(_patched(m, "clip_weights", no_clip))
        yield


@contextlib.contextmanager
def q_noise_removed() -> Iterator[None]:
    """OSO's q-query (named ``clip_hypergradient``) is released exactly, without noise."""
    original = NoisyRelease.__dict__["release"]

    def release(self: NoisyRelease, *queries: SumQuery, label: str):
        out = original(self, *queries, label=label)
        return [_noiseless(o, q) if q.name == "clip_hypergradient" else o for q, o in zip(queries, out, strict=True)]

    with _patched(NoisyRelease, "release", release):
        yield


def _noiseless(out: object, query: SumQuery) -> object:
    """The exact value, or for a deferred query the same handle with std 0 (nothing drawn yet)."""
    if isinstance(out, DeferredSum):
        return dataclasses.replace(out, std=0.0)
    return query.value


def _release_accounting_first_query_only(self: NoisyRelease, *queries: SumQuery, label: str):
    """The accounting bug: only the first query (the gradient) is charged to the ledger."""
    nu = queries[0].noise_multiplier
    event = accounting.gaussian_step_event(nu, self.sampling_rate)
    comps = tuple((q.name, float(q.noise_multiplier), float(q.sensitivity)) for q in queries)
    self.ledger.record(event, label, components=comps, run=self.run)
    return self._noisy_outputs(queries)  # the real noise (and deferred handles) of every query


def _first_query_multiplier(self: RunPlan) -> float:
    """The same accounting bug at plan time: the recombined ν is the first query's."""
    return self.strategy.multipliers(self)[0]


@contextlib.contextmanager
def split_accounted_at_nu_g(fool_ledger: bool = True) -> Iterator[None]:
    """OSO's (ν_g, ν_q) computed as if the calibrated ν were ν_g (see module docstring).

    With ``fool_ledger=False`` only the split is wrong: its parts never recombine to the planned
    ν, so planning the run refuses it (``context.snap_noise``: ConfigError), before any release.
    That check is why the bug needs a second one (the accountant ignoring the extra query: the
    plan's recombination and the gateway's charge both count the first query only) to go unnoticed.
    """
    original: Callable[[OSOClip, Any], tuple[float, float]] = OSOClip.__dict__["multipliers"]

    def split(self: OSOClip, run: Any) -> tuple[float, float]:
        # ν_g = ν exactly (so the fooled ledger matches the plan), ν_q with the usual ν_q/ν_g ratio.
        nu = run.noise_multiplier
        return nu, original(self, dataclasses.replace(run, noise_multiplier=nu / (1.0 + self.relative_increase)))[1]

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(OSOClip, "multipliers", split))
        if fool_ledger:
            stack.enter_context(_patched(NoisyRelease, "release", _release_accounting_first_query_only))
            stack.enter_context(_patched(RunPlan, "released_multiplier", _first_query_multiplier))
        yield


@contextlib.contextmanager
def isolation_check_skipped() -> Iterator[None]:
    """The ghost path's and DP-ZO's isolation probe always passes (``GradientOracle._probe`` only
    schedules the next one, ``_compare_alone`` and ``_loss_alone`` do nothing): a pipeline that mixes examples is
    released from the batched forward (issue 23)."""
    from dptune.gradients.oracle import GradientOracle

    def probe(self, kind, x, y, before, again, got):  # noqa: ANN001, ANN202, ARG001
        self._next_probe[kind] = self._calls[kind] + self.PROBE_EVERY

    def compare_alone(self, *args):  # noqa: ANN002, ANN202, ARG001
        return None

    with (
        _patched(GradientOracle, "_probe", probe),
        _patched(GradientOracle, "_compare_alone", compare_alone),
        _patched(GradientOracle, "_loss_alone", compare_alone),
    ):
        yield


MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "noise×0.25": lambda: noise_scaled(0.25),
    "no clipping": clipping_disabled,
    "q-query noise removed": q_noise_removed,
    "split accounted at ν_g": split_accounted_at_nu_g,
    # No audited strategy's canaries mix examples: tests/privacy/test_isolation_probe.py measures its
    # sensitivity (one added example moves the released sum by > C) instead of an ε bound.
    "isolation check skipped": isolation_check_skipped,
}

# Which mutants apply to which audited strategy (the OSO-specific ones only to OSO).
APPLICABLE: dict[str, tuple[str, ...]] = {
    "dpsgd": ("noise×0.25", "no clipping"),
    "quantile": ("noise×0.25", "no clipping"),
    "oso": ("noise×0.25", "no clipping", "q-query noise removed", "split accounted at ν_g"),
    "adamwosm": ("noise×0.25", "no clipping"),
    "adadp": ("noise×0.25", "no clipping"),
    "dpgd": ("noise×0.25", "no clipping"),
    "grid": ("noise×0.25", "no clipping"),
}


# ----------------------------------------------------------------------------- tuner mutants (issue 10)
# Selection-level bugs that no one-run audit can see; ``tests/tuning/test_edge_selection.py`` checks that
# its independent checks flag each of them. Not in ``MUTANTS`` (those are audited per strategy).
@contextlib.contextmanager
def mean_mode_seeds_unaccounted() -> Iterator[None]:
    """Liu–Talwar / repeat-and-select with ``across_seeds = "mean"`` and unaccounted seeds:
    a candidate (S seed runs) calibrated as ONE run (the planner before issue 10, item 4)."""
    from dptune.tune.methods import liu_talwar, repeat_and_select

    def procedures(study, composite: bool = False):  # noqa: ANN001, ARG001 - the bug ignores it
        s = len(study.seeds)
        if study.selection.across_seeds == "mean":
            return 1, 1, (s if study.budget.account_seeds else 1)
        return s, (s if study.budget.account_seeds else 1), 1

    with _patched(liu_talwar, "procedures", procedures), _patched(repeat_and_select, "procedures", procedures):
        yield


@contextlib.contextmanager
def mse_nonfinite_rule_removed() -> Iterator[None]:
    """Private MSE selection without the per-example rule: a NaN error makes the whole clipped
    sum NaN, which the scorer then releases as the constant c·m (issue 10, item 5)."""
    import math

    from torch.func import functional_call

    from dptune.tree import is_finite
    from dptune.tune.worker import Scorer

    def total(self, params, x, y, clip):  # noqa: ANN001
        if not is_finite(params):
            return math.nan
        with torch.no_grad():
            out = functional_call(self.model, params, (x,))
            if self.metric == "accuracy":
                pred = out.argmax(1) if out.ndim > 1 and out.shape[1] > 1 else (out.reshape(-1) > 0).long()
                return float((pred == y).sum())
            err = ((out - y) ** 2).reshape(out.shape[0], -1).mean(1)
            return float((err.clamp(0.0, clip) if clip is not None else err).sum())

    with _patched(Scorer, "total", total):
        yield


@contextlib.contextmanager
def coins_from_study_seed() -> Iterator[None]:
    """Liu–Talwar / repeat-and-select draws (K, configurations) from the PUBLIC study seed
    (the planner before issue 10, item 7): anyone with the config can recompute K."""
    import numpy as np

    from dptune.release.sampling import stream_seed
    from dptune.tune import builder

    original = builder.Builder.__dict__["__init__"]

    def init(self, ctx, coins=None):  # noqa: ANN001, ARG001
        original(self, ctx, np.random.default_rng(stream_seed(ctx.study.seed, "liu-talwar")))

    with _patched(builder.Builder, "__init__", init):
        yield


TUNER_MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "LT/RS mean-mode seeds unaccounted": mean_mode_seeds_unaccounted,
    "MSE non-finite rule removed": mse_nonfinite_rule_removed,
    "LT/RS coins from the study seed": coins_from_study_seed,
}


# ----------------------------------------------------------------------------- norm mutants (issue 10)
# Per-sample norms that under-estimate what is released for an example (item 1). No audit
# canary exercises these layers; ``tests/gradients/test_edge_ghost_norms.py`` checks that its independent
# checks flag each of them. Not in ``MUTANTS`` (those are audited per strategy).
@contextlib.contextmanager
def ghost_gram_float32() -> Iterator[None]:
    """The Gram forms of the ghost path (Linear over tokens, small-output convolutions, repeated
    Embedding tokens) evaluated in float32 with no rounding bound: the code before issue 10."""
    from dptune.gradients import ghost, norm_bounds

    def gram_bound(chunks, u_release):  # noqa: ANN001, ARG001 - the bug ignores it
        S = []
        for make in chunks:
            A, Bm = (x.float() for x in make())
            S.append((torch.bmm(A, A.transpose(1, 2)) * torch.bmm(Bm, Bm.transpose(1, 2))).sum((1, 2)))
        s = torch.cat(S)
        return (s, 0.0), torch.zeros_like(s, dtype=torch.float64)

    def grouped(self):  # noqa: ANN001, ANN202
        same = (self.idx.unsqueeze(2) == self.idx.unsqueeze(1)).to(self.b.dtype)
        s = (torch.bmm(self.b, self.b.transpose(1, 2)) * same).sum((1, 2))
        return (s, 0.0), torch.zeros_like(s, dtype=torch.float64)

    with (
        _patched(norm_bounds, "gram_bound", gram_bound),
        _patched(ghost, "gram_bound", gram_bound),
        _patched(ghost._Embedding, "_grouped", grouped),
    ):
        yield


@contextlib.contextmanager
def norms_rounded_to_nearest() -> Iterator[None]:
    """Per-sample norms as the plain float √(Σ s) (rounded to nearest, no slack): about half of
    them fall below the exact norm, so fl(C/N)·g can exceed C."""
    from dptune.gradients import ghost, persample, stacked
    from dptune.gradients import oracle as grads

    def plain(parts, like, dtype=None, release_dtypes=()):  # noqa: ANN001, ANN202
        sq = None
        for s, _ in parts:
            s = s.to(dtype or like.dtype)
            sq = s if sq is None else sq + s
        return (sq if sq is not None else torch.zeros_like(like, dtype=dtype)).sqrt()

    with contextlib.ExitStack() as stack:
        for owner in (persample, grads, ghost, stacked):
            stack.enter_context(_patched(owner, "upper_norms", plain))
        yield


NORM_MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "ghost Gram norms in float32": ghost_gram_float32,
    "norms rounded to nearest": norms_rounded_to_nearest,
}


# ----------------------------------------------------------------------------- edge mutants (issue 10)
# Items 2, 3, 6, 8 and 9 (a, b, d) of docs/privacy.md ("At the edges") put back into their old
# state. No one-run audit can see them (a tail event of probability ~2⁻⁵³, batches an adversary
# regenerates from a known seed, noise shared between two runs, a split that moves with n, a ν
# printed a few 1e-6 too small, an ε one ulp over its target, seeds sharing their low 32 bits);
# ``tests/privacy/test_edge_mutants.py`` checks that each item's regression test flags its mutant and
# passes without it. Not in ``MUTANTS`` (those are audited per strategy).
@contextlib.contextmanager
def noise_tail_cut_off(bits: int = 53) -> Iterator[None]:
    """Box–Muller radius from a uniform of at most ``bits`` bits, never refined (item 2): E = −ln U
    ≤ bits·ln 2, so |z| ≤ √(2·bits·ln 2) (8.57σ at 53 bits, the old secure sampler; 7.26σ for the
    float32 layout's 38 radius bits). Host (numpy) and CUDA (torch) transforms alike."""
    import numpy as np

    from dptune.release import mechanisms

    def capped(words, a, width, precision, scale=1.0, depth=0):  # noqa: ANN001, ANN202, ARG001
        if width > bits:
            a, width = a >> (width - bits), bits
        return -scale * np.log((a + 1) * 2.0**-width)

    def capped_torch(words, a, width, precision, depth=0):  # noqa: ANN001, ANN202, ARG001
        if width > bits:
            a, width = a >> (width - bits), bits
        return torch.log((a + 1).to(torch.float64) * 2.0**-width).neg()

    with _patched(mechanisms, "exponentials", capped), _patched(mechanisms, "_exponentials_torch", capped_torch):
        yield


@contextlib.contextmanager
def secure_sampler_seeded() -> Iterator[None]:
    """``PoissonSampler(..., secure=True)`` draws its batches from the public seed (item 3, the code
    before issue 10); it still says ``secure`` and the noise stays secure."""
    from dptune.release.sampling import PoissonSampler

    original = PoissonSampler.__dict__["__init__"]

    def init(self, n, sampling_rate, seed, secure=False):  # noqa: ANN001, ANN202
        original(self, n, sampling_rate, seed, secure=False)
        self.secure = bool(secure)

    with _patched(PoissonSampler, "__init__", init):
        yield


@contextlib.contextmanager
def one_seed_for_all_trials() -> Iterator[None]:
    """``train_many(..., seeds=s)`` gives every trial the seed s itself (item 6, the code before
    issue 10): the trials share their Poisson batches and their noise. Seed lists are unchanged."""
    from dptune import vectorized

    original = vectorized._seed_list

    def seed_list(seeds, K, allow_shared_seeds):  # noqa: ANN001, ANN202, N803
        if isinstance(seeds, int):
            return [seeds] * K
        return original(seeds, K, allow_shared_seeds)

    with _patched(vectorized, "_seed_list", seed_list):
        yield


@contextlib.contextmanager
def holdout_by_permutation() -> Iterator[None]:
    """The holdout is the first round(f·n) of a permutation seeded by the study seed (item 8, the
    code before issue 10): removing one example changes n and reshuffles both sets."""
    from dptune.release.sampling import stream_seed
    from dptune.tune import data

    def holdout_mask(x, y, fraction, study_seed):  # noqa: ANN001, ANN202, ARG001
        n = int(x.shape[0])
        g = torch.Generator().manual_seed(stream_seed(study_seed, "holdout"))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[torch.randperm(n, generator=g)[: int(round(fraction * n))]] = True
        return mask

    data._CACHE.clear()  # study_data caches its splits: none made by the mutant may outlive it
    try:
        with _patched(data, "holdout_mask", holdout_mask):
            yield
    finally:
        data._CACHE.clear()


@contextlib.contextmanager
def nu_printed_to_nearest() -> Iterator[None]:
    """ν and ε printed with 6 significant digits rounded to nearest, with no re-check (item 9a,
    the code before issue 10): about half the printed ν are below the calibrated one."""
    from dptune import accounting

    def nearest(x: float, digits: int = 6) -> float:
        return float(f"{x:.{digits}g}")

    def text(nu, eps_of=None, target=None, digits=6):  # noqa: ANN001, ANN202, ARG001
        return f"{nu:.{digits}g}", nearest(nu, digits)

    with _patched(accounting, "round_up", nearest), _patched(accounting, "noise_multiplier_text", text):
        yield


@contextlib.contextmanager
def gdp_calibration_unverified() -> Iterator[None]:
    """μ-GDP calibration and ε as before issue 10 (item 9b): ν nudged until √(runs·steps)/ν, not
    the reporting paths' √runs·(√steps·(1/ν)), meets the target, and ``gdp_epsilon`` returns
    brentq's root estimate, which can lie below the root. ε(ν) overshoots by an ulp or two."""
    import math

    from scipy import optimize

    from dptune.accounting import calibration, gdp

    original = calibration._calibrate_dpsgd_cached

    def gdp_epsilon(mu: float, delta: float) -> float:
        if math.isinf(mu):
            return math.inf
        if accounting.gdp_delta(mu, 0.0) <= delta:
            return 0.0
        hi = 1.0
        while accounting.gdp_delta(mu, hi) > delta:
            hi *= 2
        return float(optimize.brentq(lambda e: accounting.gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12))

    def cached(eps, delta, q, steps, runs, accountant, rel_tol, bracket):  # noqa: ANN001, ANN202
        if accountant != "gdp" or q < 1:
            return original(eps, delta, q, steps, runs, accountant, rel_tol, bracket)
        nu = math.sqrt(runs * steps) / accounting.gdp_mu_for_epsilon(eps, delta)
        evals = 1
        while accounting.gdp_epsilon(math.sqrt(runs * steps) / nu, delta) > eps:
            nu *= 1 + 1e-9
            evals += 1
        return accounting.Calibration(
            noise_multiplier=nu,
            epsilon=accounting.gdp_epsilon(math.sqrt(runs * steps) / nu, delta),
            delta=delta,
            accountant="gdp",
            lower=nu / (1 + 1e-9),
            evaluations=evals,
            search_evaluations=0,
            seconds=0.0,
        )

    accounting.clear_caches()  # cached ε values must come from the code under test
    try:
        with (
            _patched(accounting, "gdp_epsilon", gdp_epsilon),  # the name callers use
            _patched(gdp, "gdp_epsilon", gdp_epsilon),  # the one accounting.epsilon calls
            _patched(calibration, "_calibrate_dpsgd_cached", cached),
        ):
            yield
    finally:
        accounting.clear_caches()


@contextlib.contextmanager
def seeds_masked_to_32_bits() -> Iterator[None]:
    """Every stream seed derived from the low 32 bits of the seed (item 9d, the code before issue
    10): seeds that differ only above bit 31 share their Poisson batches and their noise. Patched
    in every dptune module that imported ``stream_seed``."""
    from dptune.release import sampling

    original = sampling.stream_seed

    def masked(seed: int, stream: str) -> int:
        return original(int(seed) & 0xFFFFFFFF, stream)

    owners = [
        m
        for name, m in list(sys.modules.items())
        if name.split(".")[0] == "dptune" and getattr(m, "stream_seed", None) is original
    ]
    with contextlib.ExitStack() as stack:
        for m in owners:
            stack.enter_context(_patched(m, "stream_seed", masked))
        yield


EDGE_MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "noise tail cut off at 53 bits": noise_tail_cut_off,
    "secure sampler seeded": secure_sampler_seeded,
    "train_many: one seed for all trials": one_seed_for_all_trials,
    "holdout by seeded permutation": holdout_by_permutation,
    "ν printed rounded to nearest": nu_printed_to_nearest,
    "GDP calibration unverified": gdp_calibration_unverified,
    "seeds masked to 32 bits": seeds_masked_to_32_bits,
}
