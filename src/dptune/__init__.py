"""dptune: differentially private training and honest hyperparameter tuning. The public API is imported
lazily (PEP 562): ``import dptune`` and ``dptune --help`` do not load torch, scipy or dp_accounting."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

from dptune._version import __version__ as __version__

_PRIVATIZERS = ("Privatizer", "FixedClip", "QuantileClip", "OSOClip", "ZerothOrderClip", "NonPrivate")
_UPDATES = ("UpdateRule", "SGD", "Adam", "AdamWOSM", "OSORate", "ADADP", "Averaged")
# public name → (module, attribute in it)
_LAZY: dict[str, tuple[str, str]] = {
    "train": ("dptune.train", "train"),
    "plan_run": ("dptune.train", "plan_run"),
    "RunPlan": ("dptune.train", "RunPlan"),
    "TrainResult": ("dptune.train", "TrainResult"),
    "save_model": ("dptune.deliverable", "save_trained"),
    "load_model": ("dptune.deliverable", "load_model"),
    "calibrate": ("dptune.accounting", "calibrate"),
    "epsilon": ("dptune.accounting", "epsilon"),
    "joint_noise_multiplier": ("dptune.accounting", "joint_noise_multiplier"),
    "oso_q_noise_multiplier": ("dptune.accounting", "oso_q_noise_multiplier"),
    "Ledger": ("dptune.release.ledger", "Ledger"),
    "make_strategy": ("dptune.strategies", "make_strategy"),
    "STRATEGIES": ("dptune.strategies", "STRATEGIES"),
    "chain": ("dptune.strategies", "chain"),
    "ConfigError": ("dptune.errors", "ConfigError"),
    "DataError": ("dptune.errors", "DataError"),
    "BudgetExceededError": ("dptune.errors", "BudgetExceededError"),
    "DivergedError": ("dptune.errors", "DivergedError"),
    "DPTuneError": ("dptune.errors", "DPTuneError"),
    "Metric": ("dptune.metrics", "Metric"),
    "from_dataloader": ("dptune.own", "from_dataloader"),
    "make_private": ("dptune.loop", "make_private"),
    "PrivateTraining": ("dptune.loop", "PrivateTraining"),
}
# the parts of ``chain(privatizer, update)`` and ``make_private(..., privatizer=...)``
_LAZY.update({n: ("dptune.release.privatizers", n) for n in _PRIVATIZERS})
_LAZY.update({n: ("dptune.updates", n) for n in _UPDATES})

__all__ = [
    "train", "save_model", "load_model", "plan_run", "RunPlan", "TrainResult", "calibrate", "epsilon",
    "joint_noise_multiplier", "oso_q_noise_multiplier", "Ledger", "make_strategy", "STRATEGIES", "ConfigError",
    "DataError", "BudgetExceededError", "DivergedError", "DPTuneError", "Metric", "from_dataloader", "make_private",
    "PrivateTraining", "chain", "Privatizer", "FixedClip", "QuantileClip", "OSOClip", "ZerothOrderClip",
    "NonPrivate", "UpdateRule", "SGD", "Adam", "AdamWOSM", "OSORate", "ADADP", "Averaged",
]  # fmt: skip

if TYPE_CHECKING:  # static tools see the eager imports
    from dptune.accounting import calibrate, epsilon, joint_noise_multiplier, oso_q_noise_multiplier
    from dptune.deliverable import load_model
    from dptune.deliverable import save_trained as save_model
    from dptune.errors import BudgetExceededError, ConfigError, DataError, DivergedError, DPTuneError
    from dptune.loop import PrivateTraining, make_private
    from dptune.metrics import Metric
    from dptune.own import from_dataloader
    from dptune.release.ledger import Ledger
    from dptune.release.privatizers import FixedClip, NonPrivate, OSOClip, Privatizer, QuantileClip, ZerothOrderClip
    from dptune.strategies import STRATEGIES, chain, make_strategy
    from dptune.train import RunPlan, TrainResult, plan_run, train
    from dptune.updates import ADADP, SGD, Adam, AdamWOSM, Averaged, OSORate, UpdateRule


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        # ``dptune.accounting`` after a bare ``import dptune`` worked when the package imported
        # its submodules eagerly: import the submodule now.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'dptune' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # cached: __getattr__ runs once per name
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """``dptune.train`` is the function: the submodule import's attribute assignment is dropped."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _LAZY and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
