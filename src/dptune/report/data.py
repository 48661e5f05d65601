"""Plain data the report layer consumes: small dataclasses, each also accepted as a dict (``coerce_*``
reject malformed input early). ``summarize``: mean ± std over seeds (Galli et al. 2024, Tables 2–4), and
the configuration the tuner *selected* where marked, not the one hindsight would choose."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import numpy as np

from dptune.errors import ConfigError
from dptune.metrics import HIGHER_IS_BETTER, mean_std
from dptune.metrics import higher_is_better as metric_direction  # the one resolver


def higher_is_better(metric: str, override: bool | None = None) -> bool:
    """Direction of ``metric`` (``metrics.higher_is_better``); ``override`` wins (needed if unknown)."""
    if override is not None:
        return bool(override)
    try:
        return metric_direction(metric)
    except ConfigError:
        raise ConfigError(
            f"unknown metric {metric!r}: pass higher_is_better=True/False so the report knows "
            f"which direction is better (known: {', '.join(HIGHER_IS_BETTER)})."
        ) from None


def metric_label(metric: str, higher: bool) -> str:
    """Axis/column label that states the direction, e.g. 'MSE (lower is better)'."""
    name = {"accuracy": "Accuracy", "mse": "MSE", "loss": "Loss"}.get(metric, metric)
    return f"{name} ({'higher' if higher else 'lower'} is better)"


@dataclass(frozen=True)
class TrialResult:
    """One run of the search (strategy, ε, seed); ``value`` None/NaN: diverged; ``selected``: the tuner's."""

    strategy: str
    epsilon: float  # the ε of the whole study/run this row belongs to (math.inf for non-private)
    value: float | None
    seed: int = 0
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    selected: bool = False

    @property
    def diverged(self) -> bool:
        return self.value is None or not math.isfinite(self.value)


@dataclass(frozen=True)
class SummaryRow:
    """A configuration's metric aggregated over seeds: mean ± sample std (ddof = 1)."""

    strategy: str
    epsilon: float
    hyperparameters: Mapping[str, Any] | str  # a str: the tuner's own description of its choice
    mean: float | None  # None: every seed diverged
    std: float | None  # None with a single finite seed
    n_seeds: int  # all seeds run
    n_diverged: int = 0
    selected: bool = False


@dataclass(frozen=True)
class RunHistory:
    """Per-step rows of one run (``TrainResult.history``). ``selected``: in the release (named without the
    run id, which numbers the candidates), else diagnostics only; ``epsilon``: its procedure's (public) ε."""

    run: str
    strategy: str
    rows: Sequence[Mapping[str, Any]]
    selected: bool = True
    epsilon: float | None = None


@dataclass(frozen=True)
class LedgerRow:
    """Releases and ε of one run (or query label) *alone* at the study's δ (sub-additive: no sum)."""

    run: str
    label: str
    releases: int
    epsilon: float | None = None
    planned_epsilon: float | None = None
    noise_multiplier: float | None = None
    sampling_rate: float | None = None


@dataclass(frozen=True)
class LinearScalingFit:
    """Panda et al.'s rule r = η·T ≈ slope·ε + intercept, fitted on ``points``, extrapolated to ``target``."""

    points: Sequence[tuple[float, float]]
    slope: float
    intercept: float
    target_epsilon: float | None = None
    coefficients: Sequence[float] | None = None  # polynomial fit, highest degree first (overrides slope/intercept)
    axis: str = "epsilon"  # what the x values are: "epsilon" or "mu" (μ-GDP)

    def r_at(self, eps: float) -> float:
        if self.coefficients is not None:
            return float(np.polyval(np.asarray(self.coefficients, dtype=float), eps))
        return self.slope * eps + self.intercept


@dataclass(frozen=True)
class LtMaRow:
    """Mohapatra et al. (2022), Appendix F: cost of k candidates under Liu–Talwar vs MA."""

    k: int
    eps_lt: float
    eps_ma: float


# ----------------------------------------------------------------------------- coercion
def _coerce(cls: type, item: Any, what: str) -> Any:
    if isinstance(item, cls):
        return item
    if isinstance(item, Mapping):
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if missing := sorted(required - set(item)):
            raise ConfigError(f"{what} row {dict(item)!r} lacks {missing}; give keys {sorted(names)}.")
        return cls(**{k: v for k, v in item.items() if k in names})
    if isinstance(item, Sequence) and not isinstance(item, str):
        try:
            return cls(*item)
        except TypeError as e:
            raise ConfigError(f"{what} row {item!r} does not fit {cls.__name__}: {e}.") from e
    raise ConfigError(f"{what} rows must be {cls.__name__} objects or dicts, got {type(item).__name__}.")


def _number(value: Any, name: str, *, allow_inf: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} must be a number, got {value!r}.") from e
    if math.isnan(v) or (math.isinf(v) and not allow_inf):
        raise ConfigError(f"{name} must be finite, got {value!r}.")
    return v


def coerce_trials(rows: Iterable[Any]) -> list[TrialResult]:
    """TrialResults from records or dicts; a flat dict's extra keys become the hyperparameters."""
    out = []
    reserved = {f.name for f in fields(TrialResult)}
    for r in rows:
        if isinstance(r, Mapping) and "hyperparameters" not in r:
            hp = {k: v for k, v in r.items() if k not in reserved}
            r = {**{k: v for k, v in r.items() if k in reserved}, "hyperparameters": hp}
        t = _coerce(TrialResult, r, "results")
        eps = _number(t.epsilon, f"epsilon of {t.strategy!r}", allow_inf=True)
        value = _optional_value(t.value, t.strategy)
        try:
            seed = int(t.seed)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"seed of a {t.strategy!r} row must be an integer, got {t.seed!r}.") from e
        out.append(TrialResult(str(t.strategy), eps, value, seed, dict(t.hyperparameters), flag_text(t.selected)))
    return out


def _optional_value(v: Any, strategy: str) -> float | None:
    """A run's metric; None, NaN, '' and 'nan'/'none' (CSV) mean 'diverged'."""
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "nan", "none", "null")):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"value of a {strategy!r} row must be a number (or None if it diverged), got {v!r}.") from e
    return None if math.isnan(f) else f


def flag_text(v: Any) -> bool:
    """bool, also from CSV text ('true'/'1'/'yes'), where bool('False') would be True."""
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes")
    return bool(v)


def coerce_histories(items: Iterable[Any]) -> list[RunHistory]:
    return [_coerce(RunHistory, h, "history") for h in items]


def coerce_ledger_rows(items: Iterable[Any]) -> list[LedgerRow]:
    out = []
    for r in items:
        row = _coerce(LedgerRow, r, "ledger")
        if int(row.releases) < 0:
            raise ConfigError(f"ledger row {row!r}: releases must be ≥ 0.")
        out.append(row)
    return out


def coerce_lt_ma(items: Iterable[Any]) -> list[LtMaRow]:
    out = [_coerce(LtMaRow, r, "LT-vs-MA") for r in items]
    for r in out:
        if int(r.k) < 1:
            raise ConfigError(f"LT-vs-MA row {r!r}: the number of candidates k must be ≥ 1.")
        _number(r.eps_lt, "eps_LT")
        _number(r.eps_ma, "eps_MA")
    return sorted(out, key=lambda r: r.k)


# ----------------------------------------------------------------------------- aggregation
def summarize(trials: Iterable[Any], higher: bool = True) -> list[SummaryRow]:
    """Every configuration's mean ± std over seeds (diverged excluded, counted), by strategy, ε, rank."""
    groups: dict[tuple, list[TrialResult]] = {}
    for t in coerce_trials(trials):
        config = tuple(sorted((str(k), repr(v)) for k, v in t.hyperparameters.items()))
        groups.setdefault((t.strategy, t.epsilon, config), []).append(t)
    rows = []
    for (strategy, eps, _), ts in groups.items():
        vals = [t.value for t in ts if not t.diverged]
        mean, std = mean_std(vals)
        hp, selected = dict(ts[0].hyperparameters), any(t.selected for t in ts)
        rows.append(SummaryRow(strategy, eps, hp, mean, std, len(ts), len(ts) - len(vals), selected))
    rows.sort(key=lambda r: (r.strategy, r.epsilon, *_rank_key(r, higher)))
    return rows


def _rank_key(r: SummaryRow, higher: bool) -> tuple:
    # Fewer diverged seeds first (a lucky single seed must not beat a robust config), then
    # the better mean; all-diverged configurations last.
    if r.mean is None:
        return (1, r.n_diverged, 0.0)
    return (0, r.n_diverged, -r.mean if higher else r.mean)


def best_per_strategy(summary: Iterable[SummaryRow], higher: bool = True) -> list[SummaryRow]:
    """One row per (strategy, ε): the selected configuration, else the best (fewest diverged, best mean)."""
    groups: dict[tuple[str, float], list[SummaryRow]] = {}
    for r in summary:
        groups.setdefault((r.strategy, r.epsilon), []).append(r)
    return [
        next((r for r in rs if r.selected), None) or min(rs, key=lambda r: _rank_key(r, higher))
        for _, rs in sorted(groups.items(), key=lambda kv: kv[0])
    ]


def check_budget(name: str, pair: Any) -> tuple[float, float] | None:
    """(ε, δ) or None; ε may be inf (a non-private study)."""
    if pair is None:
        return None
    if not isinstance(pair, Sequence) or len(pair) != 2:
        raise ConfigError(f"{name} must be a pair (epsilon, delta), got {pair!r}.")
    eps = _number(pair[0], f"{name} epsilon", allow_inf=True)
    delta = _number(pair[1], f"{name} delta")
    if eps < 0 or not (0 <= delta < 1):
        raise ConfigError(f"{name} = {pair!r}: need epsilon ≥ 0 and delta in [0, 1).")
    return eps, delta
