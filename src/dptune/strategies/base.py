"""The strategy contract (optax-style): ``init(params, run) -> state`` and ``step(params, state, ctx) -> (params, state,
metrics)``; ``planned_event(nu, q, steps)`` is what the run's ledger is created with, so releasing more raises
``BudgetExceededError``. Every built-in strategy is ``Composed``: a privatizer (the only reader of per-sample gradients
and caller of the gateway) then an update rule (released values only). ``run.noise_multiplier`` is the *joint* per-step
ν; privatizers releasing several queries split it exactly (``release.context.snap_noise``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, ClassVar

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError, check_positive, check_unit_interval
from dptune.release.context import RunPlan, StepContext
from dptune.release.privatizers import PRIVATIZERS, Privatizer
from dptune.tree import Tensors
from dptune.updates import UPDATES, UpdateRule

__all__ = ["Strategy", "Composed", "Chain", "chain", "RunPlan", "StepContext", "check_positive", "check_unit_interval"]


class Strategy(ABC):
    """Base class. Subclasses are frozen dataclasses of hyperparameters."""

    name: ClassVar[str]
    private: ClassVar[bool] = True
    hyperparameters: ClassVar[tuple[str, ...]] = ()

    def releases_per_run(self, steps: int) -> int:
        """Number of Gaussian releases (each at joint multiplier ν) that ``steps`` iterations make."""
        return steps

    def planned_event(self, noise_multiplier: float, sampling_rate: float, steps: int) -> dp_event.DpEvent:
        if not self.private:
            return dp_event.SelfComposedDpEvent(dp_event.NonPrivateDpEvent(), steps)
        ev = accounting.gaussian_step_event(noise_multiplier, sampling_rate)
        return dp_event.SelfComposedDpEvent(ev, self.releases_per_run(steps))

    def multipliers(self, run: RunPlan) -> tuple[float, ...]:
        """The per-query noise multipliers of one step's joint release (they recombine to the
        run's ν: ``RunPlan.released_multiplier``). Default: one query at ν."""
        return (run.noise_multiplier,)

    def validate_run(self, run: RunPlan) -> None:
        """Raise ConfigError if this strategy cannot run with these run settings."""

    @abstractmethod
    def init(self, params: Tensors, run: RunPlan) -> Any: ...

    @abstractmethod
    def step(self, params: Tensors, state: Any, ctx: StepContext) -> tuple[Tensors, Any, dict[str, float]]: ...

    def prepare(self, params: Tensors) -> Tensors:
        """Transform the initial parameters before training (e.g. zero init). Default: none."""
        return params

    def finalize(self, params: Tensors, state: Any) -> Tensors:
        """Post-processing after the last step (free of privacy cost). Default: none."""
        return params

    def evaluated(self, params: Tensors, state: Any) -> Tensors:
        """The parameters an evaluation during training scores and a best checkpoint keeps
        (post-processing of the iterates, free of privacy cost). Default: the iterate itself;
        an averaging update rule (``updates.Averaged``) gives the running average."""
        return params

    @property
    def finalizes(self) -> bool:
        """Does ``finalize`` change the parameters (so the finalised ones deserve an evaluation)?"""
        return type(self).finalize is not Strategy.finalize

    def config(self) -> dict[str, Any]:
        return {"strategy": self.name, **asdict(self)}  # type: ignore[call-overload]


class Composed(Strategy):
    """A strategy made of one privatizer and one update rule (``parts``), each with its own state; the
    update rule's current (public) learning rate is passed to the privatizer (OSO's additive C rule)."""

    @abstractmethod
    def parts(self) -> tuple[Privatizer, UpdateRule]: ...

    def __post_init__(self) -> None:
        _ = self._parts  # builds (validates) the parts once, when the strategy is made

    @cached_property
    def _parts(self) -> tuple[Privatizer, UpdateRule]:
        return self.parts()

    @property
    def privatizer(self) -> Privatizer:
        return self._parts[0]

    @property
    def update_rule(self) -> UpdateRule:
        return self._parts[1]

    def multipliers(self, run: RunPlan) -> tuple[float, ...]:
        return self._parts[0].multipliers(run)

    def validate_run(self, run: RunPlan) -> None:
        self._parts[0].validate_run(run)
        self._parts[1].validate_run(run)

    def init(self, params: Tensors, run: RunPlan) -> dict[str, Any]:
        privatizer, update = self._parts
        return {"privatizer": privatizer.init(run), "update": update.init(params, run)}

    def step(self, params: Tensors, state: dict[str, Any], ctx: StepContext):
        privatizer, update = self._parts
        released, p_state, p_info = privatizer.privatize(
            params, state["privatizer"], ctx, lr=update.rate(state["update"]), label=self.name
        )
        if released is None:  # nothing to apply (an empty non-private batch)
            return params, {**state, "privatizer": p_state}, {"lr": update.rate(state["update"])}
        params, u_state, u_info = update.update(params, state["update"], released)
        # Column order of the history: lr, the privatizer's (clip, ...), the update's others.
        info = {"lr": u_info["lr"], **p_info, **u_info}
        return params, {"privatizer": p_state, "update": u_state}, info

    def finalize(self, params: Tensors, state: dict[str, Any]) -> Tensors:
        return self._parts[1].finalize(params, state["update"])

    def evaluated(self, params: Tensors, state: dict[str, Any]) -> Tensors:
        return self._parts[1].evaluated(params, state["update"])

    @property
    def finalizes(self) -> bool:
        return bool(self._parts[1].finalizes)


@dataclass(frozen=True)
class Chain(Composed):
    """Any privatizer then any update rule: ``chain(OSOClip(), Adam(lr=1e-3))``, named ``"<privatizer>+<update>"``."""

    privatizer_part: Privatizer
    update_part: UpdateRule

    def __post_init__(self) -> None:
        if not isinstance(self.privatizer_part, Privatizer):
            raise ConfigError(
                f"chain() takes a privatizer first (dptune.release.privatizers), got {self.privatizer_part!r}."
            )
        if not isinstance(self.update_part, UpdateRule):
            raise ConfigError(f"chain() takes an update rule second (dptune.updates), got {self.update_part!r}.")
        if self.update_part.needs_noisy_release and not self.privatizer_part.private:
            raise ConfigError(
                f"the update rule {self.update_part.name!r} is defined by the noise of a private release; "
                f"it cannot follow the non-private privatizer {self.privatizer_part.name!r} (use 'adam')."
            )
        # A hyperparameter both parts have (OSO's rule) has one value: config() stays flat.
        p_cfg, u_cfg = self.privatizer_part.config(), self.update_part.config()
        clash = sorted(k for k in set(p_cfg) & set(u_cfg) if p_cfg[k] != u_cfg[k])
        if clash:
            raise ConfigError(
                f"both parts of the chain take {clash[0]!r} and were given different values "
                f"({p_cfg[clash[0]]!r} and {u_cfg[clash[0]]!r}); give them the same value."
            )
        # Instance-level name and privacy: a chain is whatever its parts are.
        object.__setattr__(self, "name", f"{self.privatizer_part.name}+{self.update_part.name}")
        object.__setattr__(self, "private", self.privatizer_part.private)
        object.__setattr__(
            self, "hyperparameters", chain_hyperparameters(type(self.privatizer_part), type(self.update_part))
        )

    def parts(self) -> tuple[Privatizer, UpdateRule]:
        return self.privatizer_part, self.update_part

    def config(self) -> dict[str, Any]:
        # Flat, like every strategy's config: make_strategy(config["strategy"], **rest) rebuilds it.
        return {"strategy": self.name, **self.privatizer_part.config(), **self.update_part.config()}


def chain(privatizer: Privatizer, update: UpdateRule) -> Chain:
    """Compose a privatizer with an update rule into a strategy (privacy by post-processing)."""
    return Chain(privatizer, update)


def chain_hyperparameters(p: type[Privatizer], u: type[UpdateRule]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.hyperparameters + u.hyperparameters))


# The one table of other names, for a strategy and for a part alike: in each place (a strategy
# name, a privatizer, an update rule) an alias stands for its target that is a name there.
ALIASES: dict[str, str | tuple[str, ...]] = {
    "online": "oso",
    "fixed_threshold": ("dpsgd", "fixed"),
    "fixedthreshold": "fixed",
    "fixed_quantile": "quantile",
    "fixedquantile": "quantile",
    "dpmomentum": "dpsgd",
    "dpadamwosm": "adamwosm",
    "sgd": "nodp",
    "nodp": "none",
    "nonprivate": "none",
    "dp-zo": "dpzo",
    "dp_zo": "dpzo",
    "momentum": "sgd",
    "oso_rho": "oso_rate",
}


def canonical(name: str, names: dict[str, Any]) -> str:
    """``name`` stripped, lower-cased and, unless it is one of ``names``, its alias among them."""
    key = name.strip().lower()
    if key in names:
        return key
    targets = ALIASES.get(key, ())
    return next((t for t in ((targets,) if isinstance(targets, str) else targets) if t in names), key)


def canonical_chain_name(name: str) -> str:
    """``" Online + Adam "`` → ``"oso+adam"``: parts stripped, lower-cased, aliases resolved."""
    p_name, _, u_name = name.partition("+")
    return f"{canonical(p_name, PRIVATIZERS)}+{canonical(u_name, UPDATES)}"


def chain_parts(name: str) -> tuple[type[Privatizer], type[UpdateRule]] | None:
    """The part classes of a ``"<privatizer>+<update>"`` name, or None if it is not one."""
    if "+" not in name:
        return None
    p_name, _, u_name = canonical_chain_name(name).partition("+")
    if p_name not in PRIVATIZERS or u_name not in UPDATES:
        raise ConfigError(
            f"unknown composition {name!r}: write '<privatizer>+<update>' with a privatizer in "
            f"{', '.join(PRIVATIZERS)} and an update rule in {', '.join(UPDATES)} (e.g. 'oso+adam')."
        )
    return PRIVATIZERS[p_name], UPDATES[u_name]


def make_chain(name: str, **hyperparameters: Any) -> Chain:
    """``make_chain("oso+adam", lr=1e-3)``: each hyperparameter goes to every part that has it."""
    parts = chain_parts(name)
    assert parts is not None
    p_cls, u_cls = parts
    p_kw = {k: v for k, v in hyperparameters.items() if k in p_cls.hyperparameters}
    u_kw = {k: v for k, v in hyperparameters.items() if k in u_cls.hyperparameters}
    defaults = CHAIN_DEFAULTS.get(canonical_chain_name(name).partition("+")[2], {})
    return Chain(p_cls(**p_kw), u_cls(**{**defaults, **u_kw}))


# A composition's update rule at the named strategies' defaults (found in review: the classes' 0.1 or 1e-3: 0.06-0.48)
CHAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": None, "momentum": 0.9}, "adam": {"lr": None}, "adamwosm": {"alpha": None}, "adadp": {"lr": 0.5}
}  # fmt: skip
