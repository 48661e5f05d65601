"""The study specification: frozen dataclasses, built in Python or loaded from TOML/YAML.

A *study* is: a dataset + a model + one or more training strategies (each with its own
search space, like Galli et al.'s per-strategy grids) + a tuning method + a total
budget (ε, δ) per tuning procedure + seeds + a selection rule. Every field is
validated when the object is built; every error is a ``ConfigError`` that names the
field (``budget.delta``, ``strategies[1].space.lr``, ...) and says how to fix it.

File form (TOML; YAML has the same keys)::

    [study]     name, seed (the study seed), seeds (training replicate seeds), secure (OS CSPRNG)
    [data]      name + options   (dptune.data.load(name, **options))
    [model]     name + options   (dptune.models.build(name, **options))
    [training]  epochs | steps, expected_batch_size | full_batch, device
    [budget]    epsilon (number or list), delta, accountant, account_seeds
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

from dptune.errors import ConfigError

METHODS: tuple[str, ...] = (
    "grid",
    "random",
    "online",
    "oracle",
    "liu-talwar",
    "repeat-and-select",
    "linear-scaling",
)
METHOD_ALIASES = {
    "lt": "liu-talwar",
    "liu_talwar": "liu-talwar",
    "liutalwar": "liu-talwar",
    "repeat_and_select": "repeat-and-select",
    "papernot-steinke": "repeat-and-select",
    "linear_scaling": "linear-scaling",
    "panda": "linear-scaling",
    "oso": "online",
    "ma": "grid",
}
# Options each method accepts (with defaults); anything else is rejected by name.
METHOD_OPTIONS: dict[str, dict[str, Any]] = {
    "grid": {},
    "online": {},
    "oracle": {},
    "random": {"n": 10},
    "liu-talwar": {"gamma": None, "delta2_fraction": 0.5},
    "repeat-and-select": {"mean": None, "distribution": "poisson", "shape": None},
    "linear-scaling": {
        "sweep_epsilons": [0.1, 0.2],
        "runs_per_sweep": 3,
        "fit": "linear",
        "fit_axis": "epsilon",
        "r_sampling": "uniform",
        "final_steps": "max",
    },
}
RS_DISTRIBUTIONS = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0, "negative-binomial": None}
ACCOUNTANT_CHOICES = ("auto", "rdp", "pld", "gdp")
TRAINING_KEYS = ("steps", "epochs", "expected_batch_size")  # may appear in a search space
DISTRIBUTIONS = ("log_uniform", "uniform", "int_uniform", "int_log_uniform")
SELECTION_MODES = ("public", "private")
METRICS = ("accuracy", "mse")
# A study name becomes a folder (studies/<name>): one path component, never "..".
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _err(path: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{path}: {problem}. Fix: {fix}")


def _positive_number(path: str, value: Any, *, allow_inf: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    ok = ok and (allow_inf or math.isfinite(value))
    if not ok:
        raise _err(path, f"must be a number > 0, got {value!r}", f"set {path} to e.g. 1.0")
    return float(value)


def canonical_method(name: Any, path: str = "method.name") -> str:
    if not isinstance(name, str):
        raise _err(path, f"must be a string, got {name!r}", f"choose one of {', '.join(METHODS)}")
    key = METHOD_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in METHODS:
        raise _err(path, f"unknown tuning method {name!r}", f"choose one of {', '.join(METHODS)}")
    return key


def _check_flag_options(name: str, options: Mapping[str, Any]) -> None:
    """A dataset option whose default is true/false takes only true/false: ``flatten = "maybe"``
    (or 2) would be read as true by the loader. Unknown options are left to ``dptune.data.load``."""
    from dptune import data as _data

    try:
        defaults = _data.options(name)
    except ConfigError:  # an unknown dataset is reported by the caller
        return
    for key, value in options.items():
        if isinstance(defaults.get(key), bool) and not isinstance(value, bool):
            raise _err(
                f"data.options.{key}", f"must be true or false, got {value!r}", f"{key} = {str(defaults[key]).lower()}"
            )


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

    def __post_init__(self) -> None:
        if sum(v is not None for v in (self.name, self.tensors, self.factory)) != 1:
            raise _err(
                "data",
                "give exactly one of data.name (a registered dataset), data.factory or tensors",
                'set data.name = "digits" or data.factory = "mypkg.data:load" '
                "(or pass Study(data=(x_train, y_train, x_test, y_test)))",
            )
        if self.factory is not None:
            from dptune.own import import_factory

            import_factory(self.factory, "data.factory")  # importable here: fail before any run starts
            if not isinstance(self.options, Mapping):
                raise _err("data.options", "must be a table of options", "e.g. options = { n = 1000 }")
        elif self.name is not None:
            if not isinstance(self.name, str):
                raise _err("data.name", f"must be a string, got {self.name!r}", 'e.g. name = "digits"')
            try:
                from dptune import data as _data

                names = _data.available()
            except ImportError:  # pragma: no cover - the data package is part of dptune
                names = []
            if names and self.name not in names:
                raise _err("data.name", f"unknown dataset {self.name!r}", f"choose one of {', '.join(names)}")
            if not isinstance(self.options, Mapping):
                raise _err("data.options", "must be a table of options", "e.g. options = { flatten = true }")
            _check_flag_options(self.name, self.options)
        else:
            t = self.tensors
            if not isinstance(t, tuple | list) or len(t) != 4:
                raise _err("data.tensors", "must be (x_train, y_train, x_test, y_test)", "pass four tensors")
            ts = tuple(torch.as_tensor(v) for v in t)
            if ts[0].shape[0] != ts[1].shape[0] or ts[2].shape[0] != ts[3].shape[0]:
                raise _err("data.tensors", "x and y lengths differ", "pass matching x/y tensors")
            if ts[0].shape[0] == 0:
                raise _err("data.tensors", "the training set is empty", "pass at least one example")
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
        if self.factory is not None:  # the factory string is part of the study fingerprint
            return {"factory": self.factory, "options": dict(self.options)}
        if self.name is not None:
            return {"name": self.name, "options": dict(self.options)}
        return {"python_tensors": self.fingerprint()}


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
        if sum(v is not None for v in (self.name, self.builder, self.factory)) != 1:
            raise _err(
                "model",
                "give exactly one of model.name, model.factory or a builder callable",
                'set model.name = "logistic_regression" or model.factory = "mypkg.models:build"',
            )
        if self.factory is not None:
            from dptune.own import import_factory

            import_factory(self.factory, "model.factory")  # importable here: fail before any run starts
        elif self.name is not None:
            if not isinstance(self.name, str):
                raise _err("model.name", f"must be a string, got {self.name!r}", 'e.g. name = "logistic_regression"')
            try:
                from dptune.models import MODELS
            except ImportError:  # pragma: no cover
                MODELS = {}
            if MODELS and self.name not in MODELS:
                raise _err("model.name", f"unknown model {self.name!r}", f"choose one of {', '.join(sorted(MODELS))}")
        elif not callable(self.builder):
            raise _err("model.builder", "must be callable", "pass a function returning an nn.Module")
        if not isinstance(self.options, Mapping):
            raise _err("model.options", "must be a table", "e.g. options = { hidden = 100 }")

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
            raise _err("training", "give exactly one of training.epochs or training.steps", "e.g. epochs = 5")
        if self.epochs is not None:
            _positive_number("training.epochs", self.epochs)
        if self.steps is not None and (
            not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1
        ):
            raise _err("training.steps", f"must be an integer ≥ 1, got {self.steps!r}", "e.g. steps = 500")
        if not isinstance(self.full_batch, bool):  # "maybe" or 2 would be read as true
            raise _err(
                "training.full_batch",
                f"must be true or false, got {self.full_batch!r}",
                "full_batch = true (no quotes)",
            )
        if self.full_batch and self.expected_batch_size is not None:
            raise _err("training", "full_batch = true and expected_batch_size are exclusive", "drop one of them")
        if not self.full_batch and self.expected_batch_size is None:
            raise _err(
                "training.expected_batch_size",
                "missing",
                "set expected_batch_size (Poisson sampling, q = L/n) or full_batch = true",
            )
        if self.expected_batch_size is not None:
            _positive_number("training.expected_batch_size", self.expected_batch_size)
        if self.loss is not None and self.loss not in ("cross_entropy", "mse", "bce"):
            raise _err(
                "training.loss",
                f"unknown loss {self.loss!r}",
                "choose cross_entropy, mse or bce (or omit it: chosen from the task)",
            )
        from dptune.devices import check_device_name

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

    def __post_init__(self) -> None:
        eps = self.epsilon
        if isinstance(eps, int | float) and not isinstance(eps, bool):
            eps = (eps,)
        if isinstance(eps, str):  # a string is a Sequence: its characters would be read as the list
            raise _err(
                "budget.epsilon",
                f"must be a number or a list of numbers, got {eps!r}",
                "e.g. epsilon = 3.0 or epsilon = [1.0, 3.0] (no quotes)",
            )
        if not isinstance(eps, Sequence) or not eps:
            raise _err(
                "budget.epsilon",
                f"must be a number or a non-empty list, got {self.epsilon!r}",
                "e.g. epsilon = 3.0 or epsilon = [1.0, 3.0]",
            )
        out = []
        for i, e in enumerate(eps):
            path = "budget.epsilon" if len(eps) == 1 else f"budget.epsilon[{i}]"
            if not isinstance(e, int | float) or isinstance(e, bool) or not math.isfinite(e) or e <= 0:
                raise _err(path, f"ε must be a finite number > 0, got {e!r}", "use e.g. epsilon = 3.0")
            out.append(float(e))
        if len(set(out)) != len(out):
            raise _err("budget.epsilon", "values repeat", "list each ε once")
        object.__setattr__(self, "epsilon", tuple(out))
        d = self.delta
        if not isinstance(d, int | float) or isinstance(d, bool) or not (0 < d < 1):
            raise _err(
                "budget.delta",
                f"δ must lie in (0, 1), got {d!r}",
                "use δ < 1/n, e.g. delta = 1e-5 for n = 60,000 (1/n rounded down to a power of ten)",
            )
        object.__setattr__(self, "delta", float(d))
        if self.accountant not in ACCOUNTANT_CHOICES:
            raise _err(
                "budget.accountant",
                f"unknown accountant {self.accountant!r}",
                f"choose one of {', '.join(ACCOUNTANT_CHOICES)}",
            )
        if not isinstance(self.account_seeds, bool):
            raise _err("budget.account_seeds", f"must be true or false, got {self.account_seeds!r}", "true or false")


@dataclass(frozen=True)
class MethodSpec:
    name: str = "grid"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", canonical_method(self.name))
        if not isinstance(self.options, Mapping):
            raise _err("method", "options must be a table", "e.g. [method] name = 'random', n = 10")
        allowed = METHOD_OPTIONS[self.name]
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            raise _err(
                f"method.{unknown[0]}",
                f"method {self.name!r} has no option {unknown[0]!r}",
                f"its options are: {', '.join(allowed) or '(none)'}",
            )
        merged = {**allowed, **self.options}
        _check_method_options(self.name, merged)
        object.__setattr__(self, "options", merged)


def _check_method_options(name: str, o: dict[str, Any]) -> None:
    if name == "random" and (not isinstance(o["n"], int) or isinstance(o["n"], bool) or o["n"] < 1):
        raise _err("method.n", f"must be an integer ≥ 1, got {o['n']!r}", "e.g. n = 10 (n = 1: Panda's random search)")
    if name == "liu-talwar":
        if o["gamma"] is not None and not (isinstance(o["gamma"], int | float) and 0 < o["gamma"] <= 1):
            raise _err(
                "method.gamma",
                f"stopping probability γ must lie in (0, 1], got {o['gamma']!r}",
                "e.g. gamma = 0.1, or omit it for γ = 1/(number of grid candidates) as Mohapatra et al.",
            )
        f = o["delta2_fraction"]
        if not (isinstance(f, int | float) and 0 < f < 1):
            raise _err("method.delta2_fraction", f"must lie in (0, 1), got {f!r}", "e.g. delta2_fraction = 0.5")
    if name == "repeat-and-select":
        dist = o["distribution"]
        if dist not in RS_DISTRIBUTIONS:
            raise _err(
                "method.distribution", f"unknown distribution {dist!r}", f"choose one of {', '.join(RS_DISTRIBUTIONS)}"
            )
        if o["mean"] is not None and not (isinstance(o["mean"], int | float) and o["mean"] >= 1):
            raise _err("method.mean", f"the mean number of runs must be ≥ 1, got {o['mean']!r}", "e.g. mean = 10")
        if dist == "negative-binomial":
            s = o["shape"]
            if not (isinstance(s, int | float) and 0 < s < math.inf):
                raise _err(
                    "method.shape",
                    f"the negative binomial's shape η must be in (0, ∞), got {s!r}",
                    "e.g. shape = 0.5 (or use distribution = 'poisson' / 'geometric' / 'logarithmic')",
                )
        elif o["shape"] is not None:
            raise _err(
                "method.shape", f"shape is only for distribution = 'negative-binomial', not {dist!r}", "drop shape"
            )
    if name == "linear-scaling":
        se = o["sweep_epsilons"]
        # A table {fraction = [f₁, f₂]}: each sweep at f_i × the target ε (Panda's ε = 1 split,
        # 0.1 and 0.2, at every target), so the sweeps scale with the budget they serve.
        fraction = isinstance(se, Mapping)
        if fraction:
            if set(se) != {"fraction"}:
                raise _err(
                    "method.sweep_epsilons",
                    f"a table must be {{fraction = [...]}}, got keys {sorted(se)}",
                    "e.g. sweep_epsilons = { fraction = [0.1, 0.2] }",
                )
            se = se["fraction"]
        bad = not isinstance(se, Sequence) or isinstance(se, str) or len(se) < 2
        if bad or any(isinstance(e, bool) or not isinstance(e, int | float) or e <= 0 for e in se):
            raise _err(
                "method.sweep_epsilons",
                f"need ≥ 2 per-run ε values > 0 (or a table {{fraction = [...]}}), got {o['sweep_epsilons']!r}",
                "e.g. sweep_epsilons = [0.1, 0.2] (Panda et al.) or { fraction = [0.1, 0.2] }",
            )
        if fraction and any(e >= 1 for e in se):
            raise _err(
                "method.sweep_epsilons",
                f"fractions of the target ε must be < 1, got {list(se)!r}",
                "e.g. sweep_epsilons = { fraction = [0.1, 0.2] }",
            )
        if len(set(se)) != len(se):
            raise _err("method.sweep_epsilons", "values repeat", "use distinct ε values")
        if not isinstance(o["runs_per_sweep"], int) or o["runs_per_sweep"] < 1:
            raise _err("method.runs_per_sweep", f"must be an integer ≥ 1, got {o['runs_per_sweep']!r}", "e.g. 3")
        if o["fit"] not in ("linear", "quadratic"):
            raise _err("method.fit", f"unknown fit {o['fit']!r}", "choose linear or quadratic")
        if o["fit"] == "quadratic" and len(se) < 3:
            raise _err("method.fit", "a quadratic fit needs ≥ 3 sweeps", "give three sweep_epsilons")
        if o["fit_axis"] not in ("epsilon", "mu"):
            raise _err("method.fit_axis", f"unknown axis {o['fit_axis']!r}", "choose epsilon or mu")
        if o["r_sampling"] not in ("uniform", "log_uniform"):
            raise _err("method.r_sampling", f"unknown sampling {o['r_sampling']!r}", "choose uniform or log_uniform")
        fs = o["final_steps"]
        if fs != "max" and not (isinstance(fs, int) and fs >= 1):
            raise _err("method.final_steps", f"must be 'max' or an integer ≥ 1, got {fs!r}", "e.g. final_steps = 'max'")


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
            raise _err(
                "selection.mode",
                f"unknown mode {self.mode!r}",
                "choose 'public' (validation data assumed public, as in the papers) or 'private'",
            )
        if self.split not in ("test", "holdout"):
            raise _err("selection.split", f"unknown split {self.split!r}", "choose 'test' or 'holdout'")
        if self.split == "holdout" and self.mode == "public":
            # The holdout is carved from the private training data: scoring on it in public
            # mode would be an unaccounted read of private data (docs/privacy.md).
            raise _err(
                "selection.split",
                "a holdout carved from the private training data cannot be "
                "treated as public (mode = 'public' charges nothing for the selection)",
                "use selection.mode = 'private' (each score is released through the gateway and "
                "charged), or split = 'test' with a split that really is public",
            )
        if not (isinstance(self.holdout_fraction, int | float) and 0 < self.holdout_fraction < 1):
            raise _err(
                "selection.holdout_fraction",
                f"must lie in (0, 1), got {self.holdout_fraction!r}",
                "e.g. holdout_fraction = 0.2",
            )
        if self.metric is not None and ":" in str(self.metric):
            from dptune.own import named_metric

            # Your own dptune.Metric: importable now, and private selection needs its sensitivity.
            m = named_metric(self.metric)
            if self.mode == "private":
                m.require_sensitivity()  # type: ignore[union-attr]
        elif self.metric is not None and self.metric not in METRICS:
            raise _err(
                "selection.metric",
                f"unknown metric {self.metric!r}",
                f"choose one of {', '.join(METRICS)}, or 'pkg.module:NAME' for your own dptune.Metric",
            )
        if self.checkpoint not in ("best", "final"):
            raise _err("selection.checkpoint", f"unknown checkpoint rule {self.checkpoint!r}", "choose best or final")
        if not isinstance(self.eval_every, int) or isinstance(self.eval_every, bool) or self.eval_every < 1:
            raise _err(
                "selection.eval_every",
                f"must be an integer ≥ 1, got {self.eval_every!r}",
                "e.g. eval_every = 50 (Galli et al.)",
            )
        if self.across_seeds not in ("per-seed", "mean"):
            raise _err("selection.across_seeds", f"unknown rule {self.across_seeds!r}", "choose per-seed or mean")
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
                raise _err(
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
            raise _err("training", "must be a TrainingSpec", "pass TrainingSpec(epochs=..., expected_batch_size=...)")
        strategies = tuple(self.strategies) if isinstance(self.strategies, Sequence) else (self.strategies,)
        if not strategies:
            raise _err("strategies", "no strategy given", 'add a [[strategies]] table with name = "dpsgd"')
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
            raise _err(
                "study.seeds", f"must be a non-empty list of integers ≥ 0, got {self.seeds!r}", "e.g. seeds = [0, 1, 2]"
            )
        if len(set(seeds)) != len(seeds):
            raise _err("study.seeds", "seeds repeat", "list each seed once")
        object.__setattr__(self, "seeds", tuple(int(s) for s in seeds))
        if not isinstance(self.seed, int) or self.seed < 0:
            raise _err("study.seed", f"must be an integer ≥ 0, got {self.seed!r}", "e.g. seed = 0")
        if not isinstance(self.threads_per_run, int) or self.threads_per_run < 1:
            raise _err("study.threads_per_run", f"must be an integer ≥ 1, got {self.threads_per_run!r}", "e.g. 1")
        if (
            not isinstance(self.trials_per_group, int)
            or isinstance(self.trials_per_group, bool)
            or self.trials_per_group < 1
        ):
            raise _err(
                "study.trials_per_group",
                f"must be an integer ≥ 1, got {self.trials_per_group!r}",
                "e.g. 16 (vectorised trials), or 1 to train every run on its own",
            )
        if not isinstance(self.name, str) or not STUDY_NAME.match(self.name) or ".." in self.name:
            raise _err(
                "study.name",
                f"must be letters, digits, '-', '_' or '.' (starting with a letter or digit, "
                f"no '..'), got {self.name!r}: it names the study's folder (studies/<name>)",
                'e.g. name = "mnist-dpsgd"; choose where the study goes with `dptune tune CONFIG -o DIR`',
            )
        if not isinstance(self.secure, bool):
            raise _err(
                "study.secure",
                f"must be true or false, got {self.secure!r}",
                "secure = true (OS CSPRNG randomness, for results you will publish) or false (seeded)",
            )
        keys = [a.key for a in strategies]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise _err(
                "strategies",
                f"two strategies share the name {dup[0]!r}",
                'give each a distinct label, e.g. label = "dpsgd-momentum"',
            )
        for i, arm in enumerate(strategies):
            _check_arm(self, arm, i)

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


def _check_arm(study: Study, arm: StrategyArm, i: int) -> None:
    from dptune.strategies import STRATEGIES, make_strategy, strategy_signature

    path = f"strategies[{i}]"
    if not isinstance(arm, StrategyArm):
        raise _err(path, "must be a StrategyArm", "StrategyArm(name='dpsgd', space={'lr': [0.1, 1.0]})")
    try:
        key, hyperparameters, private = strategy_signature(str(arm.name))
    except ConfigError as exc:
        raise _err(
            f"{path}.name",
            str(exc).rstrip("."),
            f"choose one of {', '.join(sorted(STRATEGIES))}, or '<privatizer>+<update>' (e.g. 'oso+adam')",
        ) from None
    object.__setattr__(arm, "name", key)
    if not isinstance(arm.space, Mapping) or not isinstance(arm.fixed, Mapping):
        raise _err(f"{path}.space", "space and fixed must be tables", "e.g. space = { lr = [0.1, 1.0] }")
    method = study.method_for(arm)
    if arm.method is not None and not isinstance(arm.method, MethodSpec):
        raise _err(f"{path}.method", "must be a MethodSpec", "e.g. method = { name = 'grid' }")
    allowed = set(hyperparameters) | set(TRAINING_KEYS)
    for k in list(arm.space) + list(arm.fixed):
        if k not in allowed:
            where = "space" if k in arm.space else "fixed"
            raise _err(
                f"{path}.{where}.{k}",
                f"strategy {key!r} has no hyperparameter {k!r}",
                f"use one of {', '.join(sorted(allowed))}",
            )
    both = sorted(set(arm.space) & set(arm.fixed))
    if both:
        raise _err(f"{path}.fixed.{both[0]}", "is both searched and fixed", "keep it in one of space/fixed")
    if not arm.space and private and method.name != "linear-scaling":
        raise _err(
            f"{path}.space",
            "the search space is empty",
            "add at least one hyperparameter with values, e.g. space = { lr = [0.01, 0.1, 1.0] }",
        )
    grid_like = method.name in ("grid", "online", "oracle")
    for k, v in arm.space.items():
        vpath = f"{path}.space.{k}"
        if isinstance(v, Mapping):
            if len(v) != 1 or next(iter(v)) not in DISTRIBUTIONS:
                raise _err(
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
                raise _err(vpath, f"{dist} needs [lo, hi] with lo ≤ hi, got {bounds!r}", f"e.g. {dist} = [1e-3, 1.0]")
            if "log" in dist and bounds[0] <= 0:
                raise _err(vpath, f"{dist} needs lo > 0, got {bounds[0]!r}", "use a positive lower bound")
            if grid_like:
                raise _err(
                    vpath,
                    f"method {method.name!r} needs a list of values, not a distribution",
                    f"write {k} = [v1, v2, ...] or use method 'random'",
                )
        elif isinstance(v, Sequence) and not isinstance(v, str):
            if len(v) == 0:
                raise _err(vpath, "the list of values is empty", f"give at least one value, e.g. {k} = [0.1, 1.0]")
        else:
            raise _err(vpath, f"must be a list of values or a distribution, got {v!r}", f"e.g. {k} = [{v!r}]")
    if method.name == "online":
        if key != "oso":
            raise _err(
                f"{path}.name",
                f"method 'online' tunes OSO-DPSGD only, got strategy {key!r}",
                "use name = 'oso' (or 'online'), or method 'grid' for other strategies",
            )
        if set(arm.space) != {"lr"}:
            raise _err(
                f"{path}.space",
                f"method 'online' searches the learning rate only, got {sorted(arm.space)}",
                "use space = { lr = [...] } (C is learned online: Galli's 'one hyperparameter fewer')",
            )
    if method.name == "linear-scaling" and private:
        if set(arm.space) != {"lr", "steps"}:
            raise _err(
                f"{path}.space",
                f"linear-scaling searches r = η·T: it needs exactly lr and steps, got {sorted(arm.space)}",
                "use space = { lr = { log_uniform = [1e-3, 1.0] }, steps = { int_uniform = [10, 200] } }",
            )
        if study.selection.across_seeds != "per-seed":
            raise _err(
                "selection.across_seeds",
                "linear-scaling runs one adaptive procedure per seed",
                "set across_seeds = 'per-seed'",
            )
    if method.name == "liu-talwar" and method.options.get("gamma") is None and not _finite(arm.space):
        raise _err(
            "method.gamma",
            "γ is needed when the space has continuous distributions",
            "set gamma (e.g. 0.1), or make every axis a list (γ = 1/#candidates)",
        )
    if method.name == "repeat-and-select" and method.options.get("mean") is None and not _finite(arm.space):
        raise _err("method.mean", "the mean number of runs is needed with continuous spaces", "set mean = 10")
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
        raise _err(path, str(exc), "fix the strategy's hyperparameters") from None
    except TypeError as exc:
        raise _err(path, str(exc), "check the hyperparameter types") from None


def _finite(space: Mapping[str, Any]) -> bool:
    return all(not isinstance(v, Mapping) for v in space.values())


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
            raise _err(req, "section missing", f"add a [{req}] section (see docs/tuning.md)")
    st = _table(d, "study")
    _only(st, "study", {"name", "seed", "seeds", "threads_per_run", "trials_per_group", "secure"})
    data_t = _table(d, "data")
    _only(data_t, "data", {"name", "options", "factory"})
    model_t = _table(d, "model")
    _only(model_t, "model", {"name", "options", "factory"})
    training = _build(TrainingSpec, _table(d, "training"), "training")
    budget_t = dict(_table(d, "budget"))
    _only(budget_t, "budget", {"epsilon", "delta", "accountant", "account_seeds"})
    if "epsilon" in budget_t and isinstance(budget_t["epsilon"], list):
        budget_t["epsilon"] = tuple(budget_t["epsilon"])
    budget = BudgetSpec(**budget_t)
    method = _method(_table(d, "method"), "method") if "method" in d else MethodSpec()
    selection = _build(SelectionSpec, _table(d, "selection"), "selection")
    raw = d["strategies"]
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise _err("strategies", "must be a non-empty list", 'add [[strategies]] name = "dpsgd" ...')
    arms = []
    for i, s in enumerate(raw):
        if not isinstance(s, Mapping):
            raise _err(f"strategies[{i}]", "must be a table", 'e.g. [[strategies]] name = "dpsgd"')
        _only(s, f"strategies[{i}]", {"name", "space", "fixed", "method", "label"})
        if "name" not in s:
            raise _err(f"strategies[{i}].name", "missing", 'e.g. name = "dpsgd"')
        m = _method(s["method"], f"strategies[{i}].method") if "method" in s else None
        for part in ("space", "fixed"):
            if not isinstance(s.get(part, {}), Mapping):
                raise _err(
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
        raise _err("data.name", "missing", 'e.g. name = "digits" (or factory = "mypkg.data:load")')
    if "name" not in model_t and "factory" not in model_t:
        raise _err("model.name", "missing", 'e.g. name = "logistic_regression" (or factory = "mypkg.models:build")')
    for part, t in (("data", data_t), ("model", model_t)):
        if not isinstance(t.get("options", {}), Mapping):
            raise _err(f"{part}.options", f"must be a table, got {t['options']!r}", "e.g. options = { flatten = true }")
    return Study(
        data=DataSpec(name=data_t.get("name"), options=dict(data_t.get("options", {})), factory=data_t.get("factory")),
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
        raise _err(key, f"must be a table, got {type(v).__name__}", f"write [{key}] followed by key = value lines")
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
        raise _err(f"{path}.name", "missing", f"e.g. [{path}] name = 'grid'")
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
