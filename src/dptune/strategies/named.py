"""The named strategies, each a recipe over ``chain(privatizer, update)`` as in optax, not a class that repeats its
parts. Hyperparameters (names, defaults, types, order) are the parts' fields; only what is really special is code.
Adding a strategy is ONE ``@recipe`` class here. Equations, sources and defaults of each: docs/strategies.md."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import torch

from dptune.errors import ConfigError
from dptune.release.context import RunPlan
from dptune.release.privatizers import FixedClip, NonPrivate, OSOClip, Privatizer, QuantileClip, ZerothOrderClip
from dptune.strategies.base import Composed
from dptune.tree import Tensors
from dptune.updates import ADADP as ADADPRule
from dptune.updates import SGD, Adam, Averaged, OSORate, UpdateRule, check_average
from dptune.updates import AdamWOSM as AdamWOSMRule

STRATEGIES: dict[str, type[Recipe]] = {}


class Recipe(Composed):
    """A named strategy: its fields are its hyperparameters, given flat to the parts that take them."""

    templates: ClassVar[tuple[Privatizer, UpdateRule]]
    averaged: ClassVar[bool] = False  # the averaging options of ``updates.Averaged`` (off: "none")

    def parts(self) -> tuple[Privatizer, UpdateRule]:
        hp = {k: getattr(self, k) for k in self.hyperparameters}
        if self.averaged:  # checked even when off, so a bad value is never silently kept
            check_average(hp["average"], hp["ema_decay"], hp["swa_start"])
        p, u = self.templates  # each part gets the hyperparameters it takes; a hidden one keeps its value
        privatizer = type(p)(**{k: hp.get(k, v) for k, v in p.config().items()})
        update = type(u)(**{k: hp.get(k, v) for k, v in u.config().items()})
        if self.averaged and hp["average"] != "none":
            update = Averaged(update, hp["average"], hp["ema_decay"], hp["swa_start"])
        return privatizer, update


def recipe(
    name: str,
    privatizer: Privatizer,
    update: UpdateRule,
    *,
    hide: tuple[str, ...] = (),
    order: tuple[str, ...] | None = None,
    average: bool = False,
) -> Callable[[type[Recipe]], type[Recipe]]:
    """Make the decorated class the named strategy ``chain(privatizer, update)``: its hyperparameters
    are the parts' fields (less ``hide``; plus ``Averaged``'s with ``average``, and the class's own) with the
    templates' values as defaults, ``lr`` first (or ``order``)."""

    def make(cls: type[Recipe]) -> type[Recipe]:
        found: dict[str, tuple[str, Any]] = {}  # hyperparameter → (type, default)
        for part in (privatizer, update, *([Averaged(update, "none")] if average else [])):
            for f in fields(part):  # type: ignore[arg-type]
                if f.name in hide or f.default is MISSING:  # Averaged's rule: the wrapped rule
                    continue
                kind, value = str(f.type), getattr(part, f.name)
                if value is not None and value != f.default:
                    kind = " | ".join(t.strip() for t in kind.split("|") if t.strip() != "None")
                found.setdefault(f.name, (kind, value))
        found.update({k: (str(t), getattr(cls, k)) for k, t in inspect.get_annotations(cls).items()})
        names = order or tuple(sorted(found, key=lambda k: k != "lr"))
        assert sorted(names) == sorted(found), f"{name}: order {names} is not a permutation of {sorted(found)}"
        cls.__annotations__ = {k: found[k][0] for k in names}
        for k in names:
            setattr(cls, k, found[k][1])
        cls.name, cls.private, cls.hyperparameters = name, privatizer.private, names
        cls.templates, cls.averaged = (privatizer, update), average
        STRATEGIES[name] = dataclass(frozen=True)(cls)
        return cls

    return make


@recipe("nodp", NonPrivate(), SGD(lr=0.3), hide=("final_step",))
class NoDP(Recipe):
    """Galli's NoDP baseline: (momentum) SGD on the Poisson batch's mean loss (ε = ∞)."""


@recipe("dpsgd", FixedClip(), SGD(lr=None, momentum=0.9), hide=("final_step",))
class DPSGD(Recipe):
    """FixedThreshold DP-SGD / DP-Momentum (Abadi et al. 2016; Mohapatra et al. 2022) (docs/strategies.md)."""


@recipe("quantile", QuantileClip(), SGD(lr=None, momentum=0.9), hide=("final_step",))
class FixedQuantile(Recipe):
    """FixedQuantile adaptive clipping (Andrew et al., NeurIPS 2021) (docs/strategies.md)."""


_OSO_ORDER = ("lr", "initial_clip", "clip_lr", "lr_lr", "q_noise_multiplier", "relative_increase", "rule")


@recipe("oso", OSOClip(), OSORate(), order=(*_OSO_ORDER, "momentum", "adapt_lr"))
class OSO(Recipe):
    """OSO-DPSGD (Galli et al., AAAI 2024, Alg. 1, typos corrected) (docs/strategies.md)."""


@recipe("dpadam", FixedClip(), Adam(lr=None))
class DPAdam(Recipe):
    """DP-Adam (Mohapatra et al. 2022, A.1): Adam on DP-SGD's g̃_t, lr = None (docs/strategies.md)."""


@recipe("adamwosm", FixedClip(), AdamWOSMRule(alpha=None))
class AdamWOSM(Recipe):
    """DPAdamWOSM, DP-Adam without second moment (Mohapatra et al. 2022, Algorithm 2) (docs/strategies.md)."""


_DPGD_ORDER = ("lr", "clip", "momentum", "zero_init", "final_step", "average", "ema_decay", "swa_start")


@recipe("dpgd", FixedClip(), SGD(lr=None, momentum=0.9, final_step=True), average=True, order=_DPGD_ORDER)
class DPGD(Recipe):
    """Full-batch DP-GD with momentum (Panda et al. 2024, Alg. 1), divided by n (docs/strategies.md)."""

    zero_init: bool = False

    def validate_run(self, run: RunPlan) -> None:
        if run.sampling_rate < 1.0:
            raise ConfigError(
                f"dpgd is full-batch DP-GD: it needs q = 1, got q = {run.sampling_rate:.4g}. "
                "Set full_batch=True (or expected_batch_size = n), or use 'dpsgd' with momentum."
            )

    def init(self, params: Tensors, run: RunPlan):
        self.validate_run(run)
        return super().init(params, run)

    def prepare(self, params: Tensors) -> Tensors:
        return {k: torch.zeros_like(v) for k, v in params.items()} if self.zero_init else params


@recipe("dpzo", ZerothOrderClip(), SGD(lr=None), hide=("final_step",))
class DPZO(Recipe):
    """DP-ZO (Tang et al. 2024; Panda et al. 2024 §A.4): one privatized scalar per step (docs/strategies.md)."""


@recipe("adadp", FixedClip(), ADADPRule(lr=0.5))
class ADADP(Recipe):
    """ADADP (Koskela & Honkela, AISTATS 2020) as in the authors' code (docs/strategies.md)."""
