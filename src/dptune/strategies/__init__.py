"""Training strategies: a privatizer then an update rule. The named ones are ``@recipe`` classes over
``chain`` (``named``); any other pair by name, ``"<privatizer>+<update>"``, or ``chain(OSOClip(), Adam())``."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from dptune.errors import ConfigError
from dptune.strategies.base import (
    ALIASES,
    Chain,
    Composed,
    RunPlan,
    StepContext,
    Strategy,
    canonical,
    canonical_chain_name,
    chain,
    chain_hyperparameters,
    chain_parts,
    make_chain,
)
from dptune.strategies.named import (
    ADADP,
    DPGD,
    DPSGD,
    DPZO,
    OSO,
    STRATEGIES,
    AdamWOSM,
    DPAdam,
    FixedQuantile,
    NoDP,
    Recipe,
    recipe,
)


def strategy_signature(name: str) -> tuple[str, tuple[str, ...], bool]:
    """(canonical name, hyperparameters, private) of a strategy name or composition; else ConfigError."""
    if not isinstance(name, str):
        raise ConfigError(f"a strategy name must be a string, got {name!r}.")
    key = canonical(name, STRATEGIES)
    if key in STRATEGIES:
        cls = STRATEGIES[key]
        return key, cls.hyperparameters, cls.private
    parts = chain_parts(key)
    if parts is None:
        raise ConfigError(
            f"unknown strategy {name!r}; choose one of: {', '.join(sorted(STRATEGIES))}, or compose "
            "'<privatizer>+<update>' (e.g. 'oso+adam')."
        )
    p_cls, u_cls = parts
    if u_cls.needs_noisy_release and not p_cls.private:
        raise ConfigError(f"the update rule {u_cls.name!r} needs a private (noisy) release; use 'none+adam'.")
    key = canonical_chain_name(key)
    return key, chain_hyperparameters(p_cls, u_cls), p_cls.private


_KINDS = {"bool": (bool,), "float": (numbers.Real,), "int": (numbers.Integral,), "str": (str,)}


def check_types(key: str, classes: tuple[type, ...], hyperparameters: dict[str, Any]) -> None:
    """Each value has its field's type (``--hp adapt_lr=maybe`` is an error, not a string):
    bool fields take booleans, numeric fields numbers (not booleans), ``X | None`` also None."""
    # A field of several classes: the first class's annotation.
    annotations = {f.name: str(f.type) for cls in reversed(classes) for f in dataclasses.fields(cls)}
    for k, v in hyperparameters.items():
        kinds = [t.strip() for t in annotations.get(k, "").split("|")]
        if v is None and "None" in kinds:
            continue
        wanted = [w for t in kinds for w in _KINDS.get(t, ())]
        if not wanted:
            continue  # Literal aliases (OSO's rule) are checked by the strategy itself
        ok = isinstance(v, tuple(wanted)) and not (isinstance(v, bool) and bool not in wanted)
        if not ok:
            example = {"bool": "true", "int": "3", "float": "0.5", "str": "'name'"}.get(kinds[0], "null")
            raise ConfigError(
                f"strategy {key!r}: {k} must be {' or '.join(kinds)}, got {v!r} ({type(v).__name__}). "
                f"Fix: e.g. --hp {k}={example} (in a study file: {k} = {example})."
            )


def make_strategy(name: str, **hyperparameters: Any) -> Strategy:
    """Build a strategy by name; unknown names, hyperparameters or types give one clear error."""
    key, allowed, _ = strategy_signature(name)
    unknown = set(hyperparameters) - set(allowed)
    if unknown:
        raise ConfigError(
            f"strategy {key!r} has no hyperparameter(s) {sorted(unknown)}. Fix: use those it takes: {sorted(allowed)}."
        )
    parts = chain_parts(key)
    check_types(key, (STRATEGIES[key],) if key in STRATEGIES else parts or (), hyperparameters)
    if key in STRATEGIES:
        return STRATEGIES[key](**hyperparameters)
    return make_chain(key, **hyperparameters)


# fmt: off
__all__ = [
    "ALIASES", "STRATEGIES", "Strategy", "Composed", "Chain", "Recipe", "chain", "RunPlan", "recipe", "StepContext",
    "make_strategy", "strategy_signature", "canonical_chain_name",
    "NoDP", "DPSGD", "FixedQuantile", "OSO", "DPAdam", "AdamWOSM", "DPGD", "DPZO", "ADADP",
]
# fmt: on
