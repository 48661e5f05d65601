"""Training strategies (optimiser × clipping rule), one small module each."""

from __future__ import annotations

from typing import Any

from dptune.errors import ConfigError
from dptune.strategies.adamwosm import AdamWOSM
from dptune.strategies.base import RunInfo, StepContext, Strategy
from dptune.strategies.dpadam import DPAdam
from dptune.strategies.dpgd import DPGD
from dptune.strategies.dpsgd import DPSGD
from dptune.strategies.nodp import NoDP
from dptune.strategies.oso import OSO
from dptune.strategies.quantile import FixedQuantile

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (NoDP, DPSGD, FixedQuantile, OSO, DPAdam, AdamWOSM, DPGD)
}

try:  # ADADP lives in its own module (Koskela & Honkela 2020)
    from dptune.strategies.adadp import ADADP

    STRATEGIES[ADADP.name] = ADADP
except ImportError:  # pragma: no cover - only while the module is being written
    pass

ALIASES = {"online": "oso", "fixed_threshold": "dpsgd", "fixedquantile": "quantile", "fixed_quantile": "quantile",
           "dpmomentum": "dpsgd", "dpadamwosm": "adamwosm", "sgd": "nodp"}


def make_strategy(name: str, **hyperparameters: Any) -> Strategy:
    """Build a strategy by name; unknown names or hyperparameters give one clear error."""
    key = ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else name
    if key not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(sorted(STRATEGIES))}.")
    cls = STRATEGIES[key]
    allowed = set(cls.hyperparameters)
    unknown = set(hyperparameters) - allowed
    if unknown:
        raise ConfigError(
            f"strategy {key!r} has no hyperparameter(s) {sorted(unknown)}; it takes {sorted(allowed)}."
        )
    return cls(**hyperparameters)


__all__ = ["STRATEGIES", "Strategy", "RunInfo", "StepContext", "make_strategy", "NoDP", "DPSGD",
           "FixedQuantile", "OSO", "DPAdam", "AdamWOSM", "DPGD"]
