"""The study specification: frozen dataclasses, built in Python or loaded from TOML/YAML.

A *study* is: a dataset + a model + one or more training strategies (each with its own
search space, like Galli et al.'s per-strategy grids) + a tuning method + a total
budget (ε, δ) per tuning procedure + seeds + a selection rule. Every field is
validated when the object is built; every error is a ``ConfigError`` that names the
field (``budget.delta``, ``strategies[1].space.lr``, ...) and says how to fix it.

File form (TOML; YAML has the same keys)::

    [study]     name, seed (the study seed), seeds (training replicate seeds), secure (OS CSPRNG)
    [data]      name | factory, options, test_public (a factory's test split: private by default)
    [model]     name + options   (dptune.models.build(name, **options))
    [training]  epochs | steps, expected_batch_size | full_batch, device
    [budget]    epsilon (number or list), delta (< 1/n), accountant, account_seeds, allow_large_delta
    [method]    name + method options
    [selection] mode, split, metric, checkpoint, eval_every, across_seeds, noise_multiplier
    [[strategies]] name, space, fixed, (method)

See ``docs/tuning.md`` for the full reference and an example.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from dptune import data as datasets
from dptune import models
from dptune.accounting.events import check_delta_for_n
from dptune.devices import check_device_name
from dptune.errors import ConfigError, config_error
from dptune.factories import import_factory
from dptune.metrics import named as named_metric
from dptune.strategies import STRATEGIES, make_strategy, strategy_signature
from dptune.tune.methods.registry import canonical_method, get_method
from dptune.tune.space import TRAINING_KEYS

ACCOUNTANT_CHOICES = ("auto", "rdp", "pld", "gdp")
DISTRIBUTIONS = ("log_uniform", "uniform", "int_uniform", "int_log_uniform")
SELECTION_MODES = ("public", "private")
METRICS = ("accuracy", "mse")
# A study name becomes a folder (studies/<name>): one path component, never "..".
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _positive_number(path: str, value: Any, *, allow_inf: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    ok = ok and (allow_inf or math.isfinite(value))
    if not ok:
        raise config_error(path, f"must be a number > 0, got {value!r}", f"set {path} to e.g. 1.0")
    return float(value)


def _check_flag_options(name: str, options: Mapping[str, Any]) -> None:
    """A dataset option whose default is true/false takes only true/false: ``flatten = "maybe"``
    (or 2) would be read as true by the loader. Unknown options are left to ``dptune.data.load``."""
    try:
        defaults = datasets.options(name)
    except ConfigError:  # an unknown dataset is reported by the caller
        return
    for key, value in options.items():
        if isinstance(defaults.get(key), bool) and not isinstance(value, bool):
            raise config_error(
                f"data.options.{key}", f"must be true or false, got {value!r}", f"{key} = {str(defaults[key]).lower()}"
            )


def _one_source(section: str, sources: Sequence[Any], choices: str, fix: str, factory: str | None) -> None:
    """Exactly one of a section's ``sources`` is given; a ``"pkg.module:name"`` factory must import
    here, so that a typo fails before any run starts."""
    if sum(v is not None for v in sources) != 1:
        raise config_error(section, f"give exactly one of {choices}", fix)
    if factory is not None:
        import_factory(factory, f"{section}.factory")


# ----------------------------------------------------------------------------- pieces
@dataclass(frozen=True)
class DataSpec:
    """Where the data comes from: a registered dataset (``name`` + ``options``) or tensors.

    ``tensors`` = (x_train, y_train, x_test, y_test) for studies built in Python; a
    ``dptune.data.Dataset`` passed as ``Study(data=...)`` is converted to this form.
    """

    name: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # "pkg.module:loader": the user's data, loader(**options) (contract: docs/your_data.md).
    factory: str | None = None
    # A registered dataset's standard test split is public; the user's (factory) is private unless declared.
    test_public: bool | None = None

    def __post_init__(self) -> None:
        if self.test_public is None:
            object.__setattr__(self, "test_public", self.factory is None)
        elif not isinstance(self.test_public, bool):
            raise config_error("data.test_public", f"must be true or false, got {self.test_public!r}", "true")
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
            names = datasets.available()
            if self.name not in names:
                raise config_error("data.name", f"unknown dataset {self.name!r}", f"choose one of {', '.join(names)}")
            if not isinstance(self.options, Mapping):
                raise config_error("data.options", "must be a table of options", "e.g. options = { flatten = true }")
            _check_flag_options(self.name, self.options)
        else:
            t = self.tensors
            if not isinstance(t, tuple | list) or len(t) != 4:
                raise config_error("data.tensors", "must be (x_train, y_train, x_test, y_test)", "pass four tensors")
            ts = tuple(torch.as_tensor(v) for v in t)
            if ts[0].shape[0] != ts[1].shape[0] or ts[2].shape[0] != ts[3].shape[0]:
                raise config_error("data.tensors", "x and y lengths differ", "pass matching x/y tensors")
            if ts[0].shape[0] == 0:
                raise config_error("data.tensors", "the training set is empty", "pass at least one example")
            object.__setattr__(self, "tensors", ts)

    def fingerprint(self) -> str:
        if self.tensors is None:
            return ""
        memo = self.__dict__.get("_fingerprint")
        if memo is not None:
            return memo
        h = hashlib.sha256()
        for t in self.tensors:
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
    """``dptune.models.build(name, **options)`` or a picklable callable ``builder(**options)``.

    For registered models, ``input_dim`` and ``classes`` are filled in from the dataset
    when the builder takes them and they are not given.
    """

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
            if self.name not in models.MODELS:
                raise config_error(
                    "model.name", f"unknown model {self.name!r}", f"choose one of {', '.join(sorted(models.MODELS))}"
                )
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
    """Run length and batching shared by every run (a search space may override
    ``steps``/``epochs``/``expected_batch_size`` per configuration)."""

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
            _positive_number("training.epochs", self.epochs)
        if self.steps is not None and (
            not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1
        ):
            raise config_error("training.steps", f"must be an integer ≥ 1, got {self.steps!r}", "e.g. steps = 500")
        if not isinstance(self.full_batch, bool):  # "maybe" or 2 would be read as true
            raise config_error(
                "training.full_batch",
                f"must be true or false, got {self.full_batch!r}",
                "full_batch = true (no quotes)",
            )
        if self.full_batch and self.expected_batch_size is not None:
            raise config_error(
                "training", "full_batch = true and expected_batch_size are exclusive", "drop one of them"
            )
        if not self.full_batch and self.expected_batch_size is None:
            raise config_error(
                "training.expected_batch_size",
                "missing",
                "set expected_batch_size (Poisson sampling, q = L/n) or full_batch = true",
            )
        if self.expected_batch_size is not None:
            _positive_number("training.expected_batch_size", self.expected_batch_size)
        if self.loss is not None and self.loss not in ("cross_entropy", "mse", "bce"):
            raise config_error(
                "training.loss",
                f"unknown loss {self.loss!r}",
                "choose cross_entropy, mse or bce (or omit it: chosen from the task)",
            )
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
        if self.accountant not in ACCOUNTANT_CHOICES:
            raise config_error(
                "budget.accountant",
                f"unknown accountant {self.accountant!r}",
                f"choose one of {', '.join(ACCOUNTANT_CHOICES)}",
            )
        for key in ("account_seeds", "allow_large_delta"):
            if not isinstance(getattr(self, key), bool):
                raise config_error(
                    f"budget.{key}", f"must be true or false, got {getattr(self, key)!r}", "true or false"
                )


@dataclass(frozen=True)
class MethodSpec:
    """A tuning method (``tune.methods``: its name or an alias) and its options; ``options`` becomes
    the method's full set of options (defaults filled in), checked by the method's ``Options``."""

    name: str = "grid"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", canonical_method(self.name))
        if not isinstance(self.options, Mapping):
            raise config_error("method", "options must be a table", "e.g. [method] name = 'random', n = 10")
        object.__setattr__(self, "options", get_method(self.name).parse_options(self.options))


@dataclass(frozen=True)
class SelectionSpec:
    """How the best configuration (and checkpoint) is chosen, and at what privacy cost.

    * ``mode='public'``: the validation split is treated as public (what the papers do);
      only ``split='test'`` (a holdout is carved from the private training data: refused).
    * ``mode='private'``: every validation score is released by the Gaussian mechanism
      (count of correct predictions, sensitivity 1, noise std ``noise_multiplier``) through
      ``NoisyRelease``; its events are in the plan and the ledger. ``split='holdout'`` assigns
      each training example to the holdout by a keyed hash of its own content
      (``tune.data.holdout_mask``), so adding or removing one example moves no other one.
    """

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
        if self.mode not in SELECTION_MODES:
            raise config_error(
                "selection.mode",
                f"unknown mode {self.mode!r}",
                "choose 'public' (validation data assumed public, as in the papers) or 'private'",
            )
        if self.split not in ("test", "holdout"):
            raise config_error("selection.split", f"unknown split {self.split!r}", "choose 'test' or 'holdout'")
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
        if self.checkpoint not in ("best", "final"):
            raise config_error(
                "selection.checkpoint", f"unknown checkpoint rule {self.checkpoint!r}", "choose best or final"
            )
        if not isinstance(self.eval_every, int) or isinstance(self.eval_every, bool) or self.eval_every < 1:
            raise config_error(
                "selection.eval_every",
                f"must be an integer ≥ 1, got {self.eval_every!r}",
                "e.g. eval_every = 50 (Galli et al.)",
            )
        if self.across_seeds not in ("per-seed", "mean"):
            raise config_error(
                "selection.across_seeds", f"unknown rule {self.across_seeds!r}", "choose per-seed or mean"
            )
        _positive_number("selection.noise_multiplier", self.noise_multiplier)
        _positive_number("selection.mse_clip", self.mse_clip)


@dataclass(frozen=True)
class StrategyArm:
    """One strategy compared in the study, with its own search space (and optionally method).

    ``space`` maps a hyperparameter (or ``steps``/``epochs``/``expected_batch_size``) to a
    list of values (a grid axis) or to a distribution ``{"log_uniform": [lo, hi]}``,
    ``{"uniform": [lo, hi]}``, ``{"int_uniform": [lo, hi]}``, ``{"int_log_uniform": [lo, hi]}``
    (random draws only). ``fixed`` holds hyperparameters that are not searched.
    """

    name: str
    space: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    method: MethodSpec | None = None
    label: str | None = None

    @property
    def key(self) -> str:
        return self.label or self.name


@dataclass(frozen=True)
class Study:
    """A complete, validated tuning study. Build it in Python or with ``load_study_config``."""

    data: DataSpec
    model: ModelSpec
    strategies: tuple[StrategyArm, ...]
    training: TrainingSpec
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    method: MethodSpec = field(default_factory=MethodSpec)
    selection: SelectionSpec = field(default_factory=SelectionSpec)
    seeds: tuple[int, ...] = (0,)
    seed: int = 0  # the study seed: random configurations, holdout split (NOT LT/RS coins: secret)
    name: str = "study"
    threads_per_run: int = 1  # torch threads per run, equal on every executor (bitwise-equal results)
    # Runs of one stage trained together by dptune.train_many (stackable models only; 1 = off).
    # Part of the fingerprint: the grouping is fixed by the plan, so results do not depend on the executor.
    trials_per_group: int = 16
    # Secure mode: every run's noise, Poisson batches and private-selection noise come from the
    # OS CSPRNG, not from the seeds (which are then not a secret key; results not reproducible).
    secure: bool = False

    def __post_init__(self) -> None:
        data = self.data
        if not isinstance(data, DataSpec):
            if hasattr(data, "x_train"):
                data = DataSpec(tensors=(data.x_train, data.y_train, data.x_test, data.y_test))
            elif isinstance(data, tuple | list) and len(data) == 4:
                data = DataSpec(tensors=tuple(data))
            elif isinstance(data, str):
                data = DataSpec(name=data)
            else:
                raise config_error(
                    "data",
                    f"unsupported data {type(data).__name__}",
                    "pass a DataSpec, a dptune.data.Dataset, a dataset name or (x_train, y_train, x_test, y_test)",
                )
            object.__setattr__(self, "data", data)
        model = self.model
        if not isinstance(model, ModelSpec):
            model = ModelSpec(name=model) if isinstance(model, str) else ModelSpec(builder=model)
            object.__setattr__(self, "model", model)
        if not isinstance(self.training, TrainingSpec):
            raise config_error(
                "training", "must be a TrainingSpec", "pass TrainingSpec(epochs=..., expected_batch_size=...)"
            )
        strategies = tuple(self.strategies) if isinstance(self.strategies, Sequence) else (self.strategies,)
        if not strategies:
            raise config_error("strategies", "no strategy given", 'add a [[strategies]] table with name = "dpsgd"')
        object.__setattr__(self, "strategies", strategies)
        seeds = self.seeds
        if isinstance(seeds, int):
            seeds = (seeds,)
        if (
            not isinstance(seeds, Sequence)
            or isinstance(seeds, str)
            or not seeds
            or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds)
        ):
            raise config_error(
                "study.seeds", f"must be a non-empty list of integers ≥ 0, got {self.seeds!r}", "e.g. seeds = [0, 1, 2]"
            )
        if len(set(seeds)) != len(seeds):
            raise config_error("study.seeds", "seeds repeat", "list each seed once")
        object.__setattr__(self, "seeds", tuple(int(s) for s in seeds))
        if not isinstance(self.seed, int) or self.seed < 0:
            raise config_error("study.seed", f"must be an integer ≥ 0, got {self.seed!r}", "e.g. seed = 0")
        if not isinstance(self.threads_per_run, int) or self.threads_per_run < 1:
            raise config_error(
                "study.threads_per_run", f"must be an integer ≥ 1, got {self.threads_per_run!r}", "e.g. 1"
            )
        if (
            not isinstance(self.trials_per_group, int)
            or isinstance(self.trials_per_group, bool)
            or self.trials_per_group < 1
        ):
            raise config_error(
                "study.trials_per_group",
                f"must be an integer ≥ 1, got {self.trials_per_group!r}",
                "e.g. 16 (vectorised trials), or 1 to train every run on its own",
            )
        if not isinstance(self.name, str) or not STUDY_NAME.match(self.name) or ".." in self.name:
            raise config_error(
                "study.name",
                f"must be letters, digits, '-', '_' or '.' (starting with a letter or digit, "
                f"no '..'), got {self.name!r}: it names the study's folder (studies/<name>)",
                'e.g. name = "mnist-dpsgd"; choose where the study goes with `dptune tune CONFIG -o DIR`',
            )
        if not isinstance(self.secure, bool):
            raise config_error(
                "study.secure",
                f"must be true or false, got {self.secure!r}",
                "secure = true (OS CSPRNG randomness, for results you will publish) or false (seeded)",
            )
        keys = [a.key for a in strategies]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise config_error(
                "strategies",
                f"two strategies share the name {dup[0]!r}",
                'give each a distinct label, e.g. label = "dpsgd-momentum"',
            )
        for i, arm in enumerate(strategies):
            _check_arm(self, arm, i)
        _check_test_split(self)

    # -- helpers
    def method_for(self, arm: StrategyArm) -> MethodSpec:
        return arm.method or self.method

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (tensors and callables are described, not embedded)."""
        return {
            "study": {
                "name": self.name,
                "seed": self.seed,
                "seeds": list(self.seeds),
                "threads_per_run": self.threads_per_run,
                # written only when not the default: studies stored before the field
                # existed keep their fingerprint and can still be resumed
                **({"trials_per_group": self.trials_per_group} if self.trials_per_group != 16 else {}),
                **({"secure": True} if self.secure else {}),
            },  # likewise
            "data": self.data.describe(),
            "model": self.model.describe(),
            "training": {f.name: getattr(self.training, f.name) for f in fields(self.training)},
            "budget": {
                "epsilon": list(self.budget.epsilon),
                "delta": self.budget.delta,
                "accountant": self.budget.accountant,
                "account_seeds": self.budget.account_seeds,
                **({"allow_large_delta": True} if self.budget.allow_large_delta else {}),  # as trials_per_group
            },
            "method": {"name": self.method.name, **dict(self.method.options)},
            "selection": {f.name: getattr(self.selection, f.name) for f in fields(self.selection)},
            "strategies": [
                {
                    "name": a.name,
                    "label": a.label,
                    "space": _jsonable(a.space),
                    "fixed": _jsonable(a.fixed),
                    **({"method": {"name": a.method.name, **dict(a.method.options)}} if a.method else {}),
                }
                for a in self.strategies
            ],
        }

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()

    @property
    def from_python(self) -> bool:
        return self.data.tensors is not None or self.model.builder is not None


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def _check_test_split(study: Study) -> None:
    if study.selection.mode == "public" and study.selection.split == "test" and not study.data.test_public:
        raise config_error(
            "selection.mode",
            "public selection on your own data's test split, which is private unless declared public",
            "set data.test_public = true if it truly is public, or selection.mode = 'private'",
        )


def _check_arm(study: Study, arm: StrategyArm, i: int) -> None:
    """One strategy arm: its strategy, the names and values of its space, then what its tuning
    method requires of it (``TuningMethod.check_arm``), then that the strategy builds."""
    path = f"strategies[{i}]"
    key, hyperparameters, private = _check_strategy_name(arm, path)
    method = _check_arm_tables(study, arm, path)
    _check_keys(arm, key, hyperparameters, path)
    tuner = get_method(method.name)
    _check_space_values(arm.space, method.name, tuner.needs_value_lists, path)
    tuner.check_arm(study, arm, path, private)
    _check_strategy_builds(arm, key, path)


def _check_strategy_name(arm: StrategyArm, path: str) -> tuple[str, tuple[str, ...], bool]:
    """(the strategy's canonical name, its hyperparameters, whether it is private); the arm's
    name becomes the canonical one."""
    if not isinstance(arm, StrategyArm):
        raise config_error(path, "must be a StrategyArm", "StrategyArm(name='dpsgd', space={'lr': [0.1, 1.0]})")
    try:
        key, hyperparameters, private = strategy_signature(str(arm.name))
    except ConfigError as exc:
        raise config_error(
            f"{path}.name",
            str(exc).rstrip("."),
            f"choose one of {', '.join(sorted(STRATEGIES))}, or '<privatizer>+<update>' (e.g. 'oso+adam')",
        ) from None
    object.__setattr__(arm, "name", key)
    return key, tuple(hyperparameters), private


def _check_arm_tables(study: Study, arm: StrategyArm, path: str) -> MethodSpec:
    """``space`` and ``fixed`` are tables and ``method`` a MethodSpec; returns the arm's method."""
    if not isinstance(arm.space, Mapping) or not isinstance(arm.fixed, Mapping):
        raise config_error(f"{path}.space", "space and fixed must be tables", "e.g. space = { lr = [0.1, 1.0] }")
    method = study.method_for(arm)
    if arm.method is not None and not isinstance(arm.method, MethodSpec):
        raise config_error(f"{path}.method", "must be a MethodSpec", "e.g. method = { name = 'grid' }")
    return method


def _check_keys(arm: StrategyArm, key: str, hyperparameters: Sequence[str], path: str) -> None:
    """Every searched or fixed name is a hyperparameter of the strategy (or a run setting), once."""
    allowed = set(hyperparameters) | set(TRAINING_KEYS)
    for k in list(arm.space) + list(arm.fixed):
        if k not in allowed:
            where = "space" if k in arm.space else "fixed"
            raise config_error(
                f"{path}.{where}.{k}",
                f"strategy {key!r} has no hyperparameter {k!r}",
                f"use one of {', '.join(sorted(allowed))}",
            )
    both = sorted(set(arm.space) & set(arm.fixed))
    if both:
        raise config_error(f"{path}.fixed.{both[0]}", "is both searched and fixed", "keep it in one of space/fixed")


def _check_space_values(space: Mapping[str, Any], method: str, needs_lists: bool, path: str) -> None:
    """Each axis: a non-empty list of values, or one distribution with valid bounds (not for
    methods that need lists, such as a grid)."""
    for k, v in space.items():
        vpath = f"{path}.space.{k}"
        if isinstance(v, Mapping):
            _check_distribution(v, vpath)
            if needs_lists:
                raise config_error(
                    vpath,
                    f"method {method!r} needs a list of values, not a distribution",
                    f"write {k} = [v1, v2, ...] or use method 'random'",
                )
        elif isinstance(v, Sequence) and not isinstance(v, str):
            if len(v) == 0:
                raise config_error(
                    vpath, "the list of values is empty", f"give at least one value, e.g. {k} = [0.1, 1.0]"
                )
        else:
            raise config_error(vpath, f"must be a list of values or a distribution, got {v!r}", f"e.g. {k} = [{v!r}]")


def _check_distribution(v: Mapping[str, Any], vpath: str) -> None:
    if len(v) != 1 or next(iter(v)) not in DISTRIBUTIONS:
        raise config_error(
            vpath,
            f"unknown distribution {dict(v)!r}",
            f"use a list of values or one of {', '.join(DISTRIBUTIONS)} = [lo, hi]",
        )
    dist, bounds = next(iter(v.items()))
    if not (
        isinstance(bounds, Sequence)
        and len(bounds) == 2
        and all(isinstance(b, int | float) for b in bounds)
        and bounds[0] <= bounds[1]
    ):
        raise config_error(vpath, f"{dist} needs [lo, hi] with lo ≤ hi, got {bounds!r}", f"e.g. {dist} = [1e-3, 1.0]")
    if "log" in dist and bounds[0] <= 0:
        raise config_error(vpath, f"{dist} needs lo > 0, got {bounds[0]!r}", "use a positive lower bound")


def _check_strategy_builds(arm: StrategyArm, key: str, path: str) -> None:
    """The strategy accepts the first value of every axis and the fixed values."""
    try:
        make_strategy(
            key,
            **{
                k: (v[0] if isinstance(v, Sequence) and not isinstance(v, str) else list(v.values())[0][0])
                for k, v in arm.space.items()
                if k not in TRAINING_KEYS
            },
            **{k: v for k, v in arm.fixed.items() if k not in TRAINING_KEYS},
        )
    except ConfigError as exc:
        raise config_error(path, str(exc), "fix the strategy's hyperparameters") from None
    except TypeError as exc:
        raise config_error(path, str(exc), "check the hyperparameter types") from None


# ----------------------------------------------------------------------------- loading
def study_from_dict(d: Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None) -> Study:
    """Build a ``Study`` from the nested mapping of a TOML/YAML file (see module docstring)."""
    try:
        return _study_from_dict(d, base_dir)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # Validation names the field wherever it can; a value of a wholly unexpected type
        # that slipped past it still ends as one clear line, never a traceback.
        raise ConfigError(
            f"invalid study file: {type(exc).__name__}: {exc}. Fix: compare it with "
            "the reference in docs/tuning.md (types of each key)."
        ) from None


def _study_from_dict(d: Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None) -> Study:
    if not isinstance(d, Mapping):
        raise ConfigError("a study file must hold a table/mapping at the top level")
    top = {"study", "data", "model", "training", "budget", "method", "selection", "strategies"}
    unknown = sorted(set(d) - top, key=str)
    if unknown:
        raise _unknown_name(str(unknown[0]), f"section [{unknown[0]}]", unknown[0], top, "the sections")
    for req in ("data", "model", "training", "strategies"):
        if req not in d:
            raise config_error(req, "section missing", f"add a [{req}] section (see docs/tuning.md)")
    st = _table(d, "study")
    _only(st, "study", {"name", "seed", "seeds", "threads_per_run", "trials_per_group", "secure"})
    data_t = _table(d, "data")
    _only(data_t, "data", {"name", "options", "factory", "test_public"})
    model_t = _table(d, "model")
    _only(model_t, "model", {"name", "options", "factory"})
    training = _build(TrainingSpec, _table(d, "training"), "training")
    budget_t = dict(_table(d, "budget"))
    _only(budget_t, "budget", {"epsilon", "delta", "accountant", "account_seeds", "allow_large_delta"})
    if "epsilon" in budget_t and isinstance(budget_t["epsilon"], list):
        budget_t["epsilon"] = tuple(budget_t["epsilon"])
    budget = BudgetSpec(**budget_t)
    method = _method(_table(d, "method"), "method") if "method" in d else MethodSpec()
    selection = _build(SelectionSpec, _table(d, "selection"), "selection")
    raw = d["strategies"]
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise config_error("strategies", "must be a non-empty list", 'add [[strategies]] name = "dpsgd" ...')
    arms = []
    for i, s in enumerate(raw):
        if not isinstance(s, Mapping):
            raise config_error(f"strategies[{i}]", "must be a table", 'e.g. [[strategies]] name = "dpsgd"')
        _only(s, f"strategies[{i}]", {"name", "space", "fixed", "method", "label"})
        if "name" not in s:
            raise config_error(f"strategies[{i}].name", "missing", 'e.g. name = "dpsgd"')
        m = _method(s["method"], f"strategies[{i}].method") if "method" in s else None
        for part in ("space", "fixed"):
            if not isinstance(s.get(part, {}), Mapping):
                raise config_error(
                    f"strategies[{i}].{part}",
                    f"must be a table, got {s[part]!r}",
                    f"e.g. {part} = {{ lr = [0.1, 1.0] }}",
                )
        arms.append(
            StrategyArm(
                name=s["name"],
                space=dict(s.get("space", {})),
                fixed=dict(s.get("fixed", {})),
                method=m,
                label=s.get("label"),
            )
        )
    if "name" not in data_t and "factory" not in data_t:
        raise config_error("data.name", "missing", 'e.g. name = "digits" (or factory = "mypkg.data:load")')
    if "name" not in model_t and "factory" not in model_t:
        raise config_error(
            "model.name", "missing", 'e.g. name = "logistic_regression" (or factory = "mypkg.models:build")'
        )
    for part, t in (("data", data_t), ("model", model_t)):
        if not isinstance(t.get("options", {}), Mapping):
            raise config_error(
                f"{part}.options", f"must be a table, got {t['options']!r}", "e.g. options = { flatten = true }"
            )
    return Study(
        data=DataSpec(
            options=dict(data_t.get("options", {})), **{k: data_t.get(k) for k in ("name", "factory", "test_public")}
        ),
        model=ModelSpec(
            name=model_t.get("name"), options=dict(model_t.get("options", {})), factory=model_t.get("factory")
        ),
        strategies=tuple(arms),
        training=training,
        budget=budget,
        method=method,
        selection=selection,
        seeds=tuple(st.get("seeds", (0,))) if isinstance(st.get("seeds", (0,)), list | tuple) else st.get("seeds"),
        seed=st.get("seed", 0),
        name=st.get("name", "study"),
        threads_per_run=st.get("threads_per_run", 1),
        trials_per_group=st.get("trials_per_group", 16),
        secure=st.get("secure", False),
    )


def _table(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = d.get(key, {})
    if not isinstance(v, Mapping):
        raise config_error(
            key, f"must be a table, got {type(v).__name__}", f"write [{key}] followed by key = value lines"
        )
    return v


def _unknown_name(path: str, what: str, name: Any, allowed: set[str], listing: str) -> ConfigError:
    """An unknown key or section, with the closest allowed name when it looks like a typo."""
    close = difflib.get_close_matches(str(name), sorted(allowed), n=1, cutoff=0.6)
    names = ", ".join(sorted(allowed))
    if close:
        return ConfigError(
            f"{path}: unknown {what}; did you mean {close[0]}? Fix: rename it to {close[0]!r} ({listing}: {names})."
        )
    return ConfigError(f"{path}: unknown {what}. Fix: remove it, or use one of {listing}: {names}.")


def _only(t: Mapping[str, Any], path: str, allowed: set[str]) -> None:
    unknown = sorted(set(t) - allowed, key=str)
    if unknown:
        raise _unknown_name(f"{path}.{unknown[0]}", f"key in [{path}]", unknown[0], allowed, f"the keys of [{path}]")


def _build(cls: type, t: Mapping[str, Any], path: str) -> Any:
    names = {f.name for f in fields(cls)}
    _only(t, path, names)
    return cls(**t)


def _method(t: Any, path: str) -> MethodSpec:
    if isinstance(t, str):
        return MethodSpec(name=t)
    if not isinstance(t, Mapping) or "name" not in t:
        raise config_error(f"{path}.name", "missing", f"e.g. [{path}] name = 'grid'")
    opts = {k: v for k, v in t.items() if k != "name"}
    return MethodSpec(name=t["name"], options=opts)


# YAML 1.1 (PyYAML) reads 1e-5 as a string: a float needs a dot there (1.0e-5). YAML 1.2 and TOML
# read it as a number, and so do study files: exponent floats without a dot resolve to floats.
_YAML_EXP_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _yaml_loader() -> type:
    import yaml

    class StudyLoader(yaml.SafeLoader):
        pass

    StudyLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_EXP_FLOAT, list("-+0123456789"))
    return StudyLoader


def load_study_config(path: str | os.PathLike[str] | Study) -> Study:
    """Read a study from a ``.toml`` (tomllib) or ``.yaml``/``.yml`` (PyYAML) file."""
    if isinstance(path, Study):
        return path
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"study file {str(p)!r} is a directory, not a file. Fix: pass the path of a .toml or "
            "a .yaml file (to continue a study directory: dptune resume DIR)."
        )
    if not p.is_file():
        raise ConfigError(f"study file {str(p)!r} does not exist. Fix: pass the path of a .toml or .yaml file.")
    if p.suffix.lower() not in (".toml", ".yaml", ".yml"):  # before reading: an image is not decoded as text
        raise ConfigError(f"{p}: unknown file type {p.suffix!r}. Fix: use a .toml or .yaml file.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"study file {str(p)!r} is not a text file (byte {exc.start} is not UTF-8: binary data, an image?). "
            "Fix: pass the study's .toml or .yaml file (UTF-8 text)."
        ) from None
    if p.suffix.lower() == ".toml":
        try:
            d = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            fix = "it reads as YAML: rename it to .yaml" if _is_yaml_mapping(text) else "correct the syntax there"
            raise ConfigError(f"{p}: not valid TOML ({exc}). Fix: {fix}.") from None
    elif p.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            d = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader: no arbitrary objects
        except yaml.YAMLError as exc:
            where = " ".join(str(exc).split())  # PyYAML's message spans lines: the CLI prints one
            raise ConfigError(f"{p}: not valid YAML ({where}). Fix: correct the syntax there.") from None
    return study_from_dict(d or {}, base_dir=p.parent)


def _is_yaml_mapping(text: str) -> bool:
    """Does ``text`` (not valid TOML) parse as a YAML mapping? Then it was written for a .yaml file."""
    import yaml

    try:
        return isinstance(yaml.load(text, Loader=_yaml_loader()), dict)
    except yaml.YAMLError:
        return False
