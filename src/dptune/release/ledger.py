"""The privacy ledger: every noisy release as ``dp_accounting`` events, append-only and run-length encoded. A plan
(a multiset of atomic events: composition is commutative) bounds what it may record; anything outside the remaining
plan raises ``BudgetExceededError`` before the noise is drawn."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import attr
from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import BudgetExceededError


# ----------------------------------------------------------------------------- (de)serialisation
def event_to_dict(event: dp_event.DpEvent) -> dict[str, Any]:
    """JSON-able form of any attrs-based ``DpEvent`` (recursively)."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in attr.fields(type(event)):
        v = getattr(event, f.name)
        if isinstance(v, dp_event.DpEvent):
            v = event_to_dict(v)
        elif isinstance(v, list | tuple) and v and isinstance(v[0], dp_event.DpEvent):
            v = [event_to_dict(e) for e in v]
        elif isinstance(v, list | tuple):
            v = list(v)
        out[f.name] = v
    return out


def event_from_dict(d: Mapping[str, Any]) -> dp_event.DpEvent:
    def field_value(v: Any) -> Any:
        if isinstance(v, Mapping) and "type" in v:
            return event_from_dict(v)
        if isinstance(v, list) and v and isinstance(v[0], Mapping):
            return [event_from_dict(e) for e in v]
        return v

    return getattr(dp_event, d["type"])(**{k: field_value(v) for k, v in d.items() if k != "type"})


def atoms(event: dp_event.DpEvent, count: int = 1) -> Counter:
    """Flatten composition into a multiset of atomic events (non-composed events)."""
    out: Counter = Counter()
    if isinstance(event, dp_event.NoOpDpEvent):
        return out
    if isinstance(event, dp_event.SelfComposedDpEvent):
        out.update(atoms(event.event, count * event.count))
    elif isinstance(event, dp_event.ComposedDpEvent):
        for e in event.events:
            out.update(atoms(e, count))
    else:
        out[event] += count
    return out


def compose(groups: Iterable[tuple[dp_event.DpEvent, int]]) -> dp_event.DpEvent:
    evs = [e if n == 1 else dp_event.SelfComposedDpEvent(e, n) for e, n in groups if n > 0]
    if not evs:
        return dp_event.NoOpDpEvent()
    # A tuple (not a list) keeps the event hashable, so accountant results can be cached.
    return evs[0] if len(evs) == 1 else dp_event.ComposedDpEvent(tuple(evs))


# ----------------------------------------------------------------------------- ledger
Components = tuple[tuple[str, float, float], ...]  # (query, noise multiplier, sensitivity) of each query


@dataclass
class LedgerEntry:
    label: str  # what was released, e.g. "dpsgd/gradient" or "oso/gradient+q"
    event: dp_event.DpEvent  # the atomic event of one release
    count: int  # run-length: how many identical consecutive releases
    components: Components = ()
    run: str = ""  # run id, when several runs share one ledger

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "event": event_to_dict(self.event),
            "count": self.count,
            "components": [list(c) for c in self.components],
            "run": self.run,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LedgerEntry:
        return cls(
            label=d["label"],
            event=event_from_dict(d["event"]),
            count=int(d["count"]),
            components=tuple(tuple(c) for c in d.get("components", ())),
            run=d.get("run", ""),
        )


@dataclass
class Ledger:
    """Append-only record of releases, with an optional plan that bounds what may be recorded."""

    entries: list[LedgerEntry] = field(default_factory=list)
    plan: Counter | None = None  # remaining allowance: atomic event -> count (None: unbounded)
    planned_event: dp_event.DpEvent | None = None

    @classmethod
    def with_plan(cls, planned: dp_event.DpEvent) -> Ledger:
        return cls(plan=atoms(planned), planned_event=planned)

    def check(self, event: dp_event.DpEvent, count: int = 1) -> None:
        """Raise unless ``count`` releases of ``event`` fit in the remaining plan."""
        if self.plan is not None and self.plan.get(event, 0) < count:
            raise BudgetExceededError(
                f"release of {event} ×{count} is not in the privacy plan "
                f"(remaining allowance for it: {self.plan.get(event, 0)}). A run may not take more "
                "steps, runs or noisier/looser releases than were planned; re-plan the budget instead."
            )

    def record(
        self, event: dp_event.DpEvent, label: str, *, count: int = 1, components: Components = (), run: str = ""
    ) -> None:
        self.check(event, count)
        if self.plan is not None:
            self.plan[event] -= count
        last = self.entries[-1] if self.entries else None
        if last and last.event == event and last.label == label and last.run == run and last.components == components:
            last.count += count
        else:
            self.entries.append(LedgerEntry(label, event, count, components, run))

    def extend(self, other: Ledger, run: str = "") -> None:
        for e in other.entries:
            self.record(e.event, e.label, count=e.count, components=e.components, run=run or e.run)

    # -- views
    @property
    def releases(self) -> int:
        return sum(e.count for e in self.entries)

    def event(self) -> dp_event.DpEvent:
        """The composed event of everything recorded, identical releases grouped.

        Composition is commutative, so grouping by atomic event (whatever the labels or the
        per-step sensitivities, e.g. OSO's C_t) gives the same privacy and keeps PLD fast."""
        return compose(self.atoms().items())

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        if not self.entries:
            return 0.0
        return accounting.epsilon_cached(self.event(), delta, accountant)  # the event is immutable

    def by_label(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.label] = out.get(e.label, 0) + e.count
        return out

    def atoms(self) -> Counter:
        out: Counter = Counter()
        for e in self.entries:
            out[e.event] += e.count
        return out

    def matches(self, planned: dp_event.DpEvent) -> bool:
        """True when what was spent is exactly the planned multiset of releases."""
        return self.atoms() == atoms(planned)

    # -- persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "entries": [e.to_dict() for e in self.entries],
            "planned_event": event_to_dict(self.planned_event) if self.planned_event else None,
        }

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON of the entries as a multiset (each entry's JSON with sorted keys, the
        list sorted): a study merges runs in completion order, so their order must not change the digest. The plan is
        left out (it is the configuration's, stated separately in a model card)."""
        rows = sorted(json.dumps(e.to_dict(), sort_keys=True, separators=(",", ":")) for e in self.entries)
        return hashlib.sha256(("[" + ",".join(rows) + "]").encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Ledger:
        planned = event_from_dict(d["planned_event"]) if d.get("planned_event") else None
        led = cls.with_plan(planned) if planned is not None else cls()
        for e in map(LedgerEntry.from_dict, d.get("entries", [])):
            led.record(e.event, e.label, count=e.count, components=e.components, run=e.run)
        return led
