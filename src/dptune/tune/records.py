"""Plan records (``RunSpec``, ``ArmPlan``, ``StudyPlan``) and the ε of their events; a ``StudyPlan``'s event
is the study ledger's plan (``Ledger.with_plan``)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError
from dptune.release.context import RunPlan
from dptune.release.ledger import LedgerEntry, atoms, compose, event_from_dict, event_to_dict

if TYPE_CHECKING:
    from dptune.strategies import Strategy

EVAL_LABEL = "selection/validation_score"
PLD_MAX_DISTINCT_ATOMS = 8


# ----------------------------------------------------------------------------- records
def _enc(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    return x


def _dec(x: Any) -> Any:
    return float(x) if x in ("inf", "-inf", "nan") else x


def _json_floats(d: Any, decode: bool = False) -> Any:
    if isinstance(d, Mapping):
        return {k: _json_floats(v, decode) for k, v in d.items()}
    if isinstance(d, list | tuple):
        return [_json_floats(v, decode) for v in d]
    return _dec(d) if decode else _enc(d)


# How a record's field is written to JSON and read back: field(metadata={"json": (encode, decode)});
# a field without one is copied as it is. Stored plans are read back with the same table.
EVENT = {"json": (event_to_dict, event_from_dict)}
NUMBER = {"json": (_enc, _dec)}  # ∞ (a non-private arm's ε) as the string "inf"
NUMBERS = {"json": (_json_floats, lambda d: _json_floats(d, decode=True))}  # likewise, nested
TUPLE = {"json": (list, tuple)}


R = TypeVar("R", bound="JsonRecord")


class JsonRecord:
    """``to_dict``/``from_dict`` of a dataclass in field order, through each field's ``"json"`` codec."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            codec = f.metadata.get("json")
            value = getattr(self, f.name)
            out[f.name] = codec[0](value) if codec else copy.deepcopy(value)
        return out

    @classmethod
    def from_dict(cls: type[R], d: Mapping[str, Any]) -> R:
        d = dict(d)
        for f in fields(cls):  # type: ignore[arg-type]
            codec = f.metadata.get("json")
            if codec and f.name in d:
                d[f.name] = codec[1](d[f.name])
        return cls(**d)


@dataclass
class RunSpec(JsonRecord):
    """One planned run. A worker receives exactly this (plus data/model specs)."""

    run_id: str
    arm: str
    stage: str  # main | sweep<i> | final
    index: int  # candidate index within (arm, stage, procedure)
    procedure: int  # which selection procedure the run belongs to
    replicate: int  # index of the training seed in study.seeds
    seed: int  # training seed (model initialisation)
    run_seed: int  # seed of the run's sampling and noise streams (distinct for every run)
    config: dict[str, Any] | None  # hyperparameters (+ steps/epochs/expected_batch_size); None until resolved
    steps: int
    sampling_rate: float
    noise_multiplier: float
    eval_steps: tuple[int, ...] = field(metadata=TUPLE)
    eval_final: bool
    eval_noise_multiplier: float | None  # private selection: std of the noise on the score's sum
    planned_event: dp_event.DpEvent = field(metadata=EVENT)

    def run_plan(self, strategy: Strategy, n: int, accountant: str) -> RunPlan:
        """The run's ``RunPlan``: planned ν, q, T and the study's accountant (as ``plan_run``)."""
        acc = accounting.tightest_accountant(self.sampling_rate, self.steps) if accountant == "auto" else accountant
        return RunPlan(strategy, n, self.sampling_rate, self.steps, self.noise_multiplier, acc)


@dataclass
class ArmPlan(JsonRecord):
    """One tuning procedure family: a strategy at one ε with one method."""

    arm: str
    label: str  # the strategy arm's key (label or name)
    strategy: str
    epsilon: float = field(metadata=NUMBER)  # target total ε of one procedure (math.inf: non-private)
    delta: float
    method: str  # the registered name of its tuning method (tune.methods)
    options: dict[str, Any]
    accountant: str
    guarantee: dict[str, Any] = field(metadata=NUMBERS)  # kind, epsilon, delta, per, details
    release_event: dp_event.DpEvent = field(metadata=EVENT)
    runs: list[str]
    procedures: int
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict, metadata=NUMBERS)


def _to_dicts(records: Iterable[JsonRecord]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in records]


# Stored as the list of the runs (each names itself).
RUNS = {"json": (lambda runs: _to_dicts(runs.values()), lambda ds: {r.run_id: r for r in map(RunSpec.from_dict, ds)})}


@dataclass
class StudyPlan(JsonRecord):
    arms: list[ArmPlan] = field(metadata={"json": (_to_dicts, lambda ds: [ArmPlan.from_dict(d) for d in ds])})
    runs: dict[str, RunSpec] = field(metadata=RUNS)
    release_event: dp_event.DpEvent = field(metadata=EVENT)
    n_train: int
    n_val: int
    metric: str
    higher_is_better: bool

    def arm(self, arm_id: str) -> ArmPlan:
        for a in self.arms:
            if a.arm == arm_id:
                return a
        raise KeyError(arm_id)


# ----------------------------------------------------------------------------- events and their ε
def canonical(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """The same composition regrouped by atomic event (each atom once, self-composed ``count`` times, fixed
    order): K identical runs become one ``SelfComposedDpEvent`` (fast PLD), hashable for caching."""
    return compose(sorted(atoms(event).items(), key=lambda kv: repr(kv[0])))


def group_events(events: Iterable[dp_event.DpEvent]) -> dp_event.DpEvent:
    """Compose events (canonical form: see ``canonical``; none: ``NoOpDpEvent``)."""
    return canonical(dp_event.ComposedDpEvent(list(events)))


def event_epsilon(event: dp_event.DpEvent, delta: float, acc: str) -> float:
    """ε of ``event`` at δ (∞ non-private, 0 empty), on its canonical form, cached."""
    found = atoms(event)
    if any(isinstance(e, dp_event.NonPrivateDpEvent) for e in found):
        return math.inf
    return 0.0 if not found else accounting.epsilon_cached(canonical(event), delta, acc)


def entries_epsilon(entries: Iterable[LedgerEntry], delta: float, acc: str) -> float:
    """ε of the composition of ledger entries (``event_epsilon``)."""
    return event_epsilon(compose((e.event, e.count) for e in entries), delta, acc)


def choose_accountant(requested: str, event: dp_event.DpEvent, auto: str | None = None, delta: float = 1.0) -> str:
    """Resolve ``auto`` deterministically: GDP when exact (unsampled Gaussians), else PLD up to
    ``PLD_MAX_DISTINCT_ATOMS`` atoms, else RDP; ``auto``: a method's own meaning (Liu–Talwar: ``"rdp"``)."""
    a = atoms(event)
    unsampled = all(isinstance(e, dp_event.GaussianDpEvent) for e in a)
    if requested == "gdp" and not unsampled:
        raise ConfigError(
            "budget.accountant = 'gdp' is exact only for full-batch Gaussian releases. "
            "Fix: use 'pld' or 'rdp' (or full_batch = true)."
        )
    if requested != "auto":
        return requested
    if auto is not None:
        return auto
    pld = (
        len(a) <= PLD_MAX_DISTINCT_ATOMS
        and accounting.tightest_accountant(0.0, accounting.releases_of(event), delta) == "pld"
    )
    return "gdp" if unsampled else "pld" if pld else "rdp"


def calibrate_nu(
    make_event: Callable[[float], dp_event.DpEvent], eps: float, delta: float, acc: str, what: str
) -> float:
    """Smallest ν meeting the target (``accounting.calibrate``; no RDP pre-bracket: it only adds time)."""
    try:
        return accounting.calibrate(eps, delta, accountant=acc, make_event=make_event).noise_multiplier
    except ConfigError as exc:  # a message that names its fix is kept as it is
        fix = "" if "Fix:" in str(exc) else " Fix: raise ε, shorten the runs or lower the number of runs."
        raise ConfigError(f"{what}: {str(exc).rstrip('.')}.{fix}") from None
