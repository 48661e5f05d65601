"""A study's sections ([data], [model], [training], [budget], [method], [selection], [[strategies]]):
frozen dataclasses that check their own fields. The ``Study`` of them is in ``dptune.tune.spec``."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dptune import data as datasets
from dptune import inputs, models
from dptune.accounting.events import check_delta_for_n
from dptune.devices import check_device_name
from dptune.errors import config_error
from dptune.factories import import_factory
from dptune.inputs import batch_len
from dptune.metrics import named as named_metric
from dptune.tune.methods.registry import canonical_method, get_method

ACCOUNTANT_CHOICES = ("auto", "rdp", "pld", "gdp")
SELECTION_MODES = ("public", "private")
METRICS = ("accuracy", "mse")


def _positive_number(path: str, value: Any, example: float = 1.0) -> float:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and math.isfinite(value)):
        raise config_error(path, f"must be a number > 0, got {value!r}", f"set {path} to e.g. {example:g}")
    return float(value)


def check_flag(path: str, value: Any, fix: str) -> None:
    """true or false only: "maybe" or 2 would be read as true."""
    if not isinstance(value, bool):
        raise config_error(path, f"must be true or false, got {value!r}", fix)


def check_count(path: str, value: Any, fix: str) -> None:
    """An integer ≥ 1 (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise config_error(path, f"must be an integer ≥ 1, got {value!r}", fix)


def _check_choice(path: str, value: Any, choices: Sequence[str], what: str, fix: str = "") -> None:
    """``value`` is one of ``choices``; else "unknown <what>", the fix listing them unless given."""
    if value not in choices:
        raise config_error(path, f"unknown {what} {value!r}", fix or f"choose one of {', '.join(choices)}")


def _one_source(section: str, sources: Sequence[Any], choices: str, fix: str, factory: str | None) -> None:
    """Exactly one of ``sources`` is given; a ``"pkg.module:name"`` factory must import here (fail early)."""
    if sum(v is not None for v in sources) != 1:
        raise config_error(section, f"give exactly one of {choices}", fix)
    if factory is not None:
        import_factory(factory, f"{section}.factory")


@dataclass(frozen=True)
class DataSpec:
    """Where the data comes from: a registered dataset (``name`` + ``options``), a factory, a CSV, or
    ``tensors`` = (x_train, y_train, x_test, y_test) (a ``dptune.data.Dataset`` is converted to these)."""

    name: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    tensors: tuple[Any, torch.Tensor, Any, torch.Tensor] | None = None  # x: a tensor or a dict (tokens)
    # "pkg.module:loader": the user's data, loader(**options) (contract: docs/your_data.md).
    factory: str | None = None
    # A registered dataset's standard test split is public; the user's (factory) is private unless declared.
    test_public: bool | None = None

    def __post_init__(self) -> None:
        if self.test_public is None:
            object.__setattr__(self, "test_public", self.factory is None)
        check_flag("data.test_public", self.test_public, "true")
        _one_source(
            "data",
            (self.name, self.tensors, self.factory),
            "data.name (a registered dataset), data.factory or tensors",
            'set data.name = "digits" or data.factory = "mypkg.data:load" '
            "(or pass Study(data=(x_train, y_train, x_test, y_test)))",
            self.factory,
        )
        if self.factory is not None:
            if not isinstance(self.options, Mapping):
                raise config_error("data.options", "must be a table of options", "e.g. options = { n = 1000 }")
        elif self.name is not None:
            if not isinstance(self.name, str):
                raise config_error("data.name", f"must be a string, got {self.name!r}", 'e.g. name = "digits"')
            _check_choice("data.name", self.name, datasets.available(), "dataset")
            if not isinstance(self.options, Mapping):
                raise config_error("data.options", "must be a table of options", "e.g. options = { flatten = true }")
            # An option whose default is true/false takes only true/false: flatten = "maybe" (or 2) would be
            # read as true by the loader. Unknown options are left to dptune.data.load.
            defaults = datasets.options(self.name)  # a known name: checked above
            for key, value in self.options.items():
                if isinstance(defaults.get(key), bool):
                    check_flag(f"data.options.{key}", value, f"{key} = {str(defaults[key]).lower()}")
        else:
            t = self.tensors
            if not isinstance(t, tuple | list) or len(t) != 4:
                raise config_error("data.tensors", "must be (x_train, y_train, x_test, y_test)", "pass four tensors")
            ts = tuple(inputs.as_inputs(v, "data.tensors") for v in t)  # x: a tensor, or a dict of tensors
            if batch_len(ts[0]) != batch_len(ts[1]) or batch_len(ts[2]) != batch_len(ts[3]):
                raise config_error("data.tensors", "x and y lengths differ", "pass matching x/y tensors")
            if batch_len(ts[0]) == 0:
                raise config_error("data.tensors", "the training set is empty", "pass at least one example")
            object.__setattr__(self, "tensors", ts)

    def fingerprint(self) -> str:
        if self.tensors is None:
            return ""
        memo = self.__dict__.get("_fingerprint")
        if memo is not None:
            return memo
        h = hashlib.sha256()
        for t in (leaf for part in self.tensors for leaf in inputs.leaves(part)):
            h.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        object.__setattr__(self, "_fingerprint", h.hexdigest())  # tensors are immutable by contract
        return self.__dict__["_fingerprint"]

    def describe(self) -> dict[str, Any]:
        # test_public only when not its default: stored studies keep their fingerprint
        declared = {} if self.test_public == (self.factory is None) else {"test_public": self.test_public}
        if self.factory is not None:  # the factory string is part of the study fingerprint
            return {"factory": self.factory, "options": dict(self.options), **declared}
        if self.name is not None:
            return {"name": self.name, "options": dict(self.options), **declared}
        return {"python_tensors": self.fingerprint(), **declared}


@dataclass(frozen=True)
class ModelSpec:
    """``models.build(name, **options)`` or a picklable ``builder``; ``input_dim``/``classes`` filled in."""

    name: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    builder: Callable[..., torch.nn.Module] | None = None
    # "pkg.module:factory": the user's model, factory(**options) -> nn.Module, imported by every worker.
    factory: str | None = None

    def __post_init__(self) -> None:
        _one_source(
            "model",
            (self.name, self.builder, self.factory),
            "model.name, model.factory or a builder callable",
            'set model.name = "logistic_regression" or model.factory = "mypkg.models:build"',
            self.factory,
        )
        if self.name is not None:
            if not isinstance(self.name, str):
                raise config_error(
                    "model.name", f"must be a string, got {self.name!r}", 'e.g. name = "logistic_regression"'
                )
            _check_choice("model.name", self.name, sorted(models.MODELS), "model")
        elif self.factory is None and not callable(self.builder):
            raise config_error("model.builder", "must be callable", "pass a function returning an nn.Module")
        if not isinstance(self.options, Mapping):
            raise config_error("model.options", "must be a table", "e.g. options = { hidden = 100 }")

    def describe(self) -> dict[str, Any]:
        if self.factory is not None:  # the factory string is part of the study fingerprint
            return {"factory": self.factory, "options": dict(self.options)}
        if self.name is not None:
            return {"name": self.name, "options": dict(self.options)}
        b = self.builder
        return {
            "builder": f"{getattr(b, '__module__', '?')}.{getattr(b, '__qualname__', repr(b))}",
            "options": dict(self.options),
        }


@dataclass(frozen=True)
class TrainingSpec:
    """Run length and batching of every run (a space may search steps/epochs/expected_batch_size)."""

    epochs: float | None = None
    steps: int | None = None
    expected_batch_size: float | None = None
    full_batch: bool = False
    device: str = "cpu"
    loss: str | None = None

    def __post_init__(self) -> None:
        if (self.epochs is None) == (self.steps is None):
            raise config_error("training", "give exactly one of training.epochs or training.steps", "e.g. epochs = 5")
        if self.epochs is not None:
            _positive_number("training.epochs", self.epochs, 10)
        if self.steps is not None:
            check_count("training.steps", self.steps, "e.g. steps = 500")
        check_flag("training.full_batch", self.full_batch, "full_batch = true (no quotes)")
        if self.full_batch and self.expected_batch_size is not None:
            raise config_error(
                "training", "full_batch = true and expected_batch_size are exclusive", "drop one of them"
            )
        if self.expected_batch_size is not None:
            _positive_number("training.expected_batch_size", self.expected_batch_size, 256)
        if self.loss is not None:
            fix = "choose cross_entropy, mse or bce (or omit it: chosen from the task)"
            _check_choice("training.loss", self.loss, ("cross_entropy", "mse", "bce"), "loss", fix)
        # Syntax only: a study may be planned on a driver without the GPUs of its Ray cluster;
        # availability is checked where the runs execute (run_study, worker).
        object.__setattr__(self, "device", check_device_name(self.device, "training.device"))


@dataclass(frozen=True)
class BudgetSpec:
    """The total budget of ONE tuning procedure; a list of ε runs one procedure per ε."""

    epsilon: tuple[float, ...] = (1.0,)
    delta: float = 1e-5
    accountant: str = "auto"
    account_seeds: bool = False
    allow_large_delta: bool = False  # accept δ ≥ 1/n

    def check_delta(self, n: int) -> None:  # by tune.plan.plan_study, where n (training examples) is first known
        check_delta_for_n(self.delta, n, self.allow_large_delta, "budget.delta", "set budget.allow_large_delta = true")

    def __post_init__(self) -> None:
        eps = self.epsilon
        if isinstance(eps, int | float) and not isinstance(eps, bool):
            eps = (eps,)
        if isinstance(eps, str):  # a string is a Sequence: its characters would be read as the list
            raise config_error(
                "budget.epsilon",
                f"must be a number or a list of numbers, got {eps!r}",
                "e.g. epsilon = 3.0 or epsilon = [1.0, 3.0] (no quotes)",
            )
        if not isinstance(eps, Sequence) or not eps:
            raise config_error(
                "budget.epsilon",
                f"must be a number or a non-empty list, got {self.epsilon!r}",
                "e.g. epsilon = 3.0 or epsilon = [1.0, 3.0]",
            )
        out = []
        for i, e in enumerate(eps):
            path = "budget.epsilon" if len(eps) == 1 else f"budget.epsilon[{i}]"
            if not isinstance(e, int | float) or isinstance(e, bool) or not math.isfinite(e) or e <= 0:
                raise config_error(path, f"ε must be a finite number > 0, got {e!r}", "use e.g. epsilon = 3.0")
            out.append(float(e))
        if len(set(out)) != len(out):
            raise config_error("budget.epsilon", "values repeat", "list each ε once")
        object.__setattr__(self, "epsilon", tuple(out))
        d = self.delta
        if not isinstance(d, int | float) or isinstance(d, bool) or not (0 < d < 1):
            raise config_error(
                "budget.delta",
                f"δ must lie in (0, 1), got {d!r}",
                "use δ < 1/n, e.g. delta = 1e-5 for n = 60,000 (1/n rounded down to a power of ten)",
            )
        object.__setattr__(self, "delta", float(d))
        _check_choice("budget.accountant", self.accountant, ACCOUNTANT_CHOICES, "accountant")
        for key in ("account_seeds", "allow_large_delta"):
            check_flag(f"budget.{key}", getattr(self, key), "true or false")


@dataclass(frozen=True)
class MethodSpec:
    """A tuning method (name or alias) and its options, completed and checked by the method's ``Options``."""

    name: str = "grid"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", canonical_method(self.name))
        if not isinstance(self.options, Mapping):
            raise config_error("method", "options must be a table", "e.g. [method] name = 'random', n = 10")
        object.__setattr__(self, "options", get_method(self.name).parse_options(self.options))


@dataclass(frozen=True)
class SelectionSpec:
    """How the best configuration (and checkpoint) is chosen, and at what privacy cost: ``mode='public'``
    (the test split treated as public, as in the papers) or ``'private'`` (every score a Gaussian release
    in the plan and the ledger; a ``'holdout'`` split by a keyed hash of each example: docs/privacy.md)."""

    mode: str = "public"
    split: str = "test"  # "test" (papers: select on the test split) or "holdout" (carved from train)
    holdout_fraction: float = 0.2
    metric: str | None = None  # accuracy | mse; None: from the task
    checkpoint: str = "best"  # best (evaluate every eval_every steps) | final
    eval_every: int = 50
    across_seeds: str = "per-seed"  # per-seed | mean
    noise_multiplier: float = 20.0  # private mode: std of the noise on the score's sum (sensitivity 1)
    mse_clip: float = 1.0  # private mode, metric mse: per-example error clipped to [0, mse_clip]

    def __post_init__(self) -> None:
        fix = "choose 'public' (validation data assumed public, as in the papers) or 'private'"
        _check_choice("selection.mode", self.mode, SELECTION_MODES, "mode", fix)
        _check_choice("selection.split", self.split, ("test", "holdout"), "split", "choose 'test' or 'holdout'")
        if self.split == "holdout" and self.mode == "public":
            # The holdout is carved from the private training data: scoring on it in public
            # mode would be an unaccounted read of private data (docs/privacy.md).
            raise config_error(
                "selection.split",
                "a holdout carved from the private training data cannot be "
                "treated as public (mode = 'public' charges nothing for the selection)",
                "use selection.mode = 'private' (each score is released through the gateway and "
                "charged), or split = 'test' with a split that really is public",
            )
        if not (isinstance(self.holdout_fraction, int | float) and 0 < self.holdout_fraction < 1):
            raise config_error(
                "selection.holdout_fraction",
                f"must lie in (0, 1), got {self.holdout_fraction!r}",
                "e.g. holdout_fraction = 0.2",
            )
        if self.metric is not None and ":" in str(self.metric):
            # Your own dptune.Metric: importable now, and private selection needs its sensitivity.
            m = named_metric(self.metric)
            if self.mode == "private":
                m.require_sensitivity()  # type: ignore[union-attr]
        elif self.metric is not None and self.metric not in METRICS:
            raise config_error(
                "selection.metric",
                f"unknown metric {self.metric!r}",
                f"choose one of {', '.join(METRICS)}, or 'pkg.module:NAME' for your own dptune.Metric",
            )
        _check_choice(
            "selection.checkpoint", self.checkpoint, ("best", "final"), "checkpoint rule", "choose best or final"
        )
        check_count("selection.eval_every", self.eval_every, "e.g. eval_every = 50 (Galli et al.)")
        _check_choice(
            "selection.across_seeds", self.across_seeds, ("per-seed", "mean"), "rule", "choose per-seed or mean"
        )
        _positive_number("selection.noise_multiplier", self.noise_multiplier)
        _positive_number("selection.mse_clip", self.mse_clip)


@dataclass(frozen=True)
class StrategyArm:
    """One strategy compared in the study, with its own search space (and optionally method): ``space``
    maps a hyperparameter (or steps/epochs/expected_batch_size) to a list (grid axis) or a distribution
    (log_uniform, uniform, int_uniform, int_log_uniform); ``fixed``: not searched."""

    name: str
    space: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    method: MethodSpec | None = None
    label: str | None = None

    @property
    def key(self) -> str:
        return self.label or self.name
