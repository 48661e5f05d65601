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
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator

import torch

from dptune import accounting
from dptune.mechanisms import DeferredSum, NoiseSource, NoisyRelease, SumQuery
from dptune.strategies import base as strategies_base
from dptune.strategies.oso import OSO


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
    """min(1, C/‖g‖) → 1 in every strategy module that imported ``clip_weights``."""
    original = strategies_base.clip_weights

    def no_clip(norms: torch.Tensor, clip: float) -> torch.Tensor:
        return torch.ones_like(norms)

    owners = [m for name, m in list(sys.modules.items())
              if name.startswith("dptune.strategies") and getattr(m, "clip_weights", None) is original]
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


@contextlib.contextmanager
def split_accounted_at_nu_g(fool_ledger: bool = True) -> Iterator[None]:
    """OSO's (ν_g, ν_q) computed as if the calibrated ν were ν_g (see module docstring).

    With ``fool_ledger=False`` only the split is wrong: the real gateway then charges the true
    joint multiplier, which is not in the run's plan, and the ledger's plan guard refuses the
    first release (BudgetExceededError). That guard is why the bug needs a second one (the
    accountant ignoring the extra query) to go unnoticed.
    """
    original: Callable[[OSO, float], tuple[float, float]] = OSO.__dict__["split"]

    def split(self: OSO, nu: float) -> tuple[float, float]:
        # ν_g = ν exactly (so the fooled ledger matches the plan), ν_q with the usual ν_q/ν_g ratio.
        return nu, original(self, nu / (1.0 + self.relative_increase))[1]

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(OSO, "split", split))
        if fool_ledger:
            stack.enter_context(_patched(NoisyRelease, "release", _release_accounting_first_query_only))
        yield


MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "noise×0.25": lambda: noise_scaled(0.25),
    "no clipping": clipping_disabled,
    "q-query noise removed": q_noise_removed,
    "split accounted at ν_g": split_accounted_at_nu_g,
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
