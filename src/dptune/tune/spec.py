"""The study specification: a ``Study`` of sections (``tune.sections``: data, model, strategies with
their search spaces, tuning method, budget per procedure, seeds, selection), built in Python or loaded
from TOML/YAML; every error is a ``ConfigError`` naming the field and the fix. Reference: docs/tuning.md."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dptune.data import tabular
from dptune.errors import ConfigError, config_error
from dptune.strategies import STRATEGIES, make_strategy, strategy_signature
from dptune.study_args import check_study_path
from dptune.tune import sections
from dptune.tune.methods.registry import get_method
from dptune.tune.sections import BudgetSpec, DataSpec, MethodSpec, ModelSpec, SelectionSpec, StrategyArm, TrainingSpec
from dptune.tune.space import TRAINING_KEYS

DISTRIBUTIONS = ("log_uniform", "uniform", "int_uniform", "int_log_uniform")
# A study name becomes a folder (studies/<name>): one path component, never "..".
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
ARM_LABEL = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._+-]*$")


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
        object.__setattr__(self, "data", _data_spec(self.data))
        if not isinstance(m := self.model, ModelSpec):
            object.__setattr__(self, "model", ModelSpec(name=m) if isinstance(m, str) else ModelSpec(builder=m))
        if not isinstance(self.training, TrainingSpec):
            raise config_error(
                "training", "must be a TrainingSpec", "pass TrainingSpec(epochs=..., expected_batch_size=...)"
            )
        strategies = tuple(self.strategies) if isinstance(self.strategies, Sequence) else (self.strategies,)
        if not strategies:
            raise config_error("strategies", "no strategy given", 'add a [[strategies]] table with name = "dpsgd"')
        object.__setattr__(self, "strategies", strategies)
        seeds = (self.seeds,) if isinstance(self.seeds, int) else self.seeds
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
        sections.check_count(
            "study.trials_per_group",
            self.trials_per_group,
            "e.g. 16 (vectorised trials), or 1 to train every run on its own",
        )
        if not isinstance(self.name, str) or not STUDY_NAME.match(self.name) or ".." in self.name:
            raise config_error(
                "study.name",
                f"must be letters, digits, '-', '_' or '.' (starting with a letter or digit, "
                f"no '..'), got {self.name!r}: it names the study's folder (studies/<name>)",
                'e.g. name = "mnist-dpsgd"; choose where the study goes with `dptune tune CONFIG -o DIR`',
            )
        for i, arm in enumerate(strategies):  # a label names the arm's model folder and figure legends
            if arm.label is not None and (not isinstance(arm.label, str) or not ARM_LABEL.match(arm.label)):
                raise config_error(
                    f"strategies[{i}].label",
                    f"must be letters, digits, '-', '_', '+' or '.' (starting with a letter or digit, no '..'), "
                    f"got {arm.label!r}: it names the arm's model folder (found in review: '../x' wrote outside)",
                    'e.g. label = "dpsgd-small-batch"',
                )
        sections.check_flag(
            "study.secure",
            self.secure,
            "secure = true (OS CSPRNG randomness, for results you will publish) or false (seeded)",
        )
        keys = [a.key for a in strategies]
        if dup := sorted({k for k in keys if keys.count(k) > 1}):
            raise config_error(
                "strategies",
                f"two strategies share the name {dup[0]!r}",
                'give each a distinct label, e.g. label = "dpsgd-momentum"',
            )
        for i, arm in enumerate(strategies):
            _check_arm(self, arm, i)
        if self.selection.mode == "public" and self.selection.split == "test" and not self.data.test_public:
            raise config_error(
                "selection.mode",
                "public selection on your own data's test split, which is private unless declared public",
                "set data.test_public = true if it truly is public, or selection.mode = 'private'",
            )

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
                # only when not the default: studies stored before the field keep their fingerprint (resumable)
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


def _data_spec(data: Any) -> DataSpec:
    """What ``Study(data=...)`` takes: a DataSpec, a dptune.data.Dataset, a dataset name or four tensors."""
    if isinstance(data, DataSpec):
        return data
    if hasattr(data, "x_train"):
        return DataSpec(tensors=(data.x_train, data.y_train, data.x_test, data.y_test))
    if isinstance(data, tuple | list) and len(data) == 4:
        return DataSpec(tensors=tuple(data))
    if isinstance(data, str):
        return DataSpec(name=data)
    raise config_error(
        "data",
        f"unsupported data {type(data).__name__}",
        "pass a DataSpec, a dptune.data.Dataset, a dataset name or (x_train, y_train, x_test, y_test)",
    )


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def _check_arm(study: Study, arm: StrategyArm, i: int) -> None:
    """One arm: its strategy (its name becomes the canonical one), its space's names and values (each a
    hyperparameter of the strategy or a run setting, once), its method's checks, that it builds."""
    path = f"strategies[{i}]"
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
    if not isinstance(arm.space, Mapping) or not isinstance(arm.fixed, Mapping):
        raise config_error(f"{path}.space", "space and fixed must be tables", "e.g. space = { lr = [0.1, 1.0] }")
    method = study.method_for(arm)
    if arm.method is not None and not isinstance(arm.method, MethodSpec):
        raise config_error(f"{path}.method", "must be a MethodSpec", "e.g. method = { name = 'grid' }")
    allowed = set(hyperparameters) | set(TRAINING_KEYS)
    for k in list(arm.space) + list(arm.fixed):
        if k not in allowed:
            where = "space" if k in arm.space else "fixed"
            raise config_error(
                f"{path}.{where}.{k}",
                f"strategy {key!r} has no hyperparameter {k!r}",
                f"use one of {', '.join(sorted(allowed))}",
            )
    if both := sorted(set(arm.space) & set(arm.fixed)):
        raise config_error(f"{path}.fixed.{both[0]}", "is both searched and fixed", "keep it in one of space/fixed")
    tuner = get_method(method.name)
    _check_space_values(arm.space, method.name, tuner.needs_value_lists, path)
    tuner.check_arm(study, arm, path, private)
    try:  # it builds with the first value of every axis (a distribution: its lower bound) and the fixed values
        first = {
            k: (v[0] if isinstance(v, Sequence) and not isinstance(v, str) else list(v.values())[0][0])
            for k, v in arm.space.items()
        }
        make_strategy(key, **{k: v for k, v in {**first, **arm.fixed}.items() if k not in TRAINING_KEYS})
    except ConfigError as exc:  # its message names its fix already (one "Fix:", found in review)
        raise (
            ConfigError(f"{path}: {exc}")
            if "Fix:" in str(exc)
            else config_error(path, str(exc), "fix the strategy's hyperparameters")
        ) from None
    except TypeError as exc:
        raise config_error(path, str(exc), "check the hyperparameter types") from None


def _check_space_values(space: Mapping[str, Any], method: str, needs_lists: bool, path: str) -> None:
    """Each axis: a non-empty list, or one distribution with valid bounds (not for grids)."""
    for k, v in space.items():
        vpath = f"{path}.space.{k}"
        if isinstance(v, Mapping):
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
                raise config_error(
                    vpath, f"{dist} needs [lo, hi] with lo ≤ hi, got {bounds!r}", f"e.g. {dist} = [1e-3, 1.0]"
                )
            if "log" in dist and bounds[0] <= 0:
                raise config_error(vpath, f"{dist} needs lo > 0, got {bounds[0]!r}", "use a positive lower bound")
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


# ----------------------------------------------------------------------------- loading
def study_from_dict(d: Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None) -> Study:
    """Build a ``Study`` from the nested mapping of a TOML/YAML file (see module docstring)."""
    try:
        return _study_from_dict(d, base_dir)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # Validation names the field where it can; a wholly unexpected type that slipped past is still one line.
        raise ConfigError(
            f"invalid study file: {type(exc).__name__}: {exc}. Fix: compare it with "
            "the reference in docs/tuning.md (types of each key)."
        ) from None


def _study_from_dict(d: Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None) -> Study:
    if not isinstance(d, Mapping):
        raise ConfigError("a study file must hold a table/mapping at the top level")
    top = {"study", "data", "model", "training", "budget", "method", "selection", "strategies"}
    if unknown := sorted(set(d) - top, key=str):
        raise _unknown_name(str(unknown[0]), f"section [{unknown[0]}]", unknown[0], top, "the sections")
    for req in ("data", "model", "training", "strategies"):
        if req not in d:
            raise config_error(req, "section missing", f"add a [{req}] section (see docs/tuning.md)")
    st = _stored_keys(_table(d, "study"), "study", {"secure_mode": "secure"})
    _only(st, "study", {"name", "seed", "seeds", "threads_per_run", "trials_per_group", "secure"})
    data_t = _table(d, "data")
    _only(data_t, "data", {"name", "options", "factory", "test_public", *tabular.CSV_KEYS})
    data_t = tabular.as_factory_table(data_t, base_dir)
    model_t = _table(d, "model")
    _only(model_t, "model", {"name", "options", "factory"})
    training_t = _stored_keys(_table(d, "training"), "training", {"batch_size": "expected_batch_size"})
    training = _build(TrainingSpec, training_t, "training")
    budget_t = _stored_keys(_table(d, "budget"), "budget", {"target_epsilon": "epsilon"})
    if isinstance(budget_t.get("epsilon"), list):
        budget_t["epsilon"] = tuple(budget_t["epsilon"])
    budget = _build(BudgetSpec, budget_t, "budget")
    method = _method(_table(d, "method"), "method") if "method" in d else MethodSpec()
    selection = _build(SelectionSpec, _table(d, "selection"), "selection")
    arms = _arms(d["strategies"])
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
        strategies=arms,
        training=training,
        budget=budget,
        method=method,
        selection=selection,
        seeds=tuple(st.get("seeds", (0,))) if isinstance(st.get("seeds", (0,)), list | tuple) else st.get("seeds"),
        # absent keys keep the Study defaults
        **{k: st[k] for k in ("seed", "name", "threads_per_run", "trials_per_group", "secure") if k in st},
    )


def _arms(raw: Any) -> tuple[StrategyArm, ...]:
    """The ``[[strategies]]`` tables (one table: one arm) as ``StrategyArm``s."""
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
        arms.append(StrategyArm(s["name"], dict(s.get("space", {})), dict(s.get("fixed", {})), m, s.get("label")))
    return tuple(arms)


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


def _stored_keys(t: Mapping[str, Any], path: str, aliases: dict[str, str]) -> dict[str, Any]:
    """[path] with the Python API's names (``dptune.names``) under the keys a study stores."""
    out = dict(t)
    for alias, key in aliases.items():
        if alias in out:
            if key in out:
                raise config_error(f"{path}.{alias}", f"and {path}.{key} name one setting", f"keep {key} only")
            out[key] = out.pop(alias)
    return out


def _only(t: Mapping[str, Any], path: str, allowed: set[str]) -> None:
    if unknown := sorted(set(t) - allowed, key=str):
        raise _unknown_name(f"{path}.{unknown[0]}", f"key in [{path}]", unknown[0], allowed, f"the keys of [{path}]")


def _build(cls: type, t: Mapping[str, Any], path: str) -> Any:
    _only(t, path, {f.name for f in fields(cls)})
    return cls(**t)


def _method(t: Any, path: str) -> MethodSpec:
    if isinstance(t, str):
        return MethodSpec(name=t)
    if not isinstance(t, Mapping) or "name" not in t:
        raise config_error(f"{path}.name", "missing", f"e.g. [{path}] name = 'grid'")
    return MethodSpec(name=t["name"], options={k: v for k, v in t.items() if k != "name"})


# YAML 1.1 (PyYAML) reads 1e-5 as a string: a float needs a dot there (1.0e-5). YAML 1.2 and TOML
# read it as a number, and so do study files: exponent floats without a dot resolve to floats.
_YAML_EXP_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _yaml_loader() -> type:
    import yaml

    class StudyLoader(yaml.SafeLoader):
        pass

    StudyLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_EXP_FLOAT, list("-+0123456789"))
    return StudyLoader


def load_study_config(path: str | os.PathLike[str] | Study | Mapping[str, Any]) -> Study:
    """A study read from a ``.toml`` (tomllib) or ``.yaml``/``.yml`` (PyYAML) file, or from its dict (a preset's
    ``study_dict()``, as docs/reproduce.md edits one)."""
    if isinstance(path, (Study, Mapping)):
        return path if isinstance(path, Study) else study_from_dict(path)
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"study file {str(p)!r} is a directory, not a file. Fix: pass the path of a .toml or "
            "a .yaml file (to continue a study directory: dptune resume DIR)."
        )
    if not p.is_file():
        check_study_path(p, is_file=True)
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
