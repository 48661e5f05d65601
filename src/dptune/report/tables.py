"""Results tables (Galli et al. 2024, Tables 2–4) for HTML, CSV and the terminal: per strategy and ε the
best (or selected) configuration and its metric, mean ± std over seeds."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from rich.table import Table as RichTable

from dptune.errors import ConfigError
from dptune.metrics import clip_to_range
from dptune.report.data import (
    LedgerRow,
    RunHistory,
    SummaryRow,
    best_per_strategy,
    coerce_histories,
    coerce_ledger_rows,
    flag_text,
    metric_label,
    summarize,
)
from dptune.report.data import higher_is_better as resolve_direction
from dptune.report.html import Table
from dptune.report.html import cell_text as fmt_value


def fmt_hyperparameters(hp: Mapping[str, Any] | str) -> str:
    text = hp if isinstance(hp, str) else ", ".join(f"{k}={fmt_value(v)}" for k, v in sorted(hp.items()))
    return text or "—"


def fmt_metric(r: SummaryRow, metric: str | None = None) -> str:
    """mean ± std (4 and 2 significant digits); with ``metric``, the mean clipped to its range (noisy scores)."""
    mean = clip_to_range(r.mean, metric) if metric else r.mean
    if mean is None:  # no score: every seed diverged, or none finished yet (an unfinished Liu–Talwar arm)
        return "diverged" if r.n_diverged else "not finished"
    return f"{mean:.4g} ± {r.std:.2g}" if r.std is not None else f"{mean:.4g}"


def as_summary_rows(rows: Iterable[Any], *, higher: bool = True, best_only: bool = True) -> list[SummaryRow]:
    """SummaryRows from rows, summary dicts or trial rows; ``best_only``: the best per (strategy, ε)."""
    rows = list(rows)
    if all(isinstance(r, SummaryRow) or (isinstance(r, Mapping) and "mean" in r) for r in rows):
        srows = [r if isinstance(r, SummaryRow) else _summary_from_dict(r) for r in rows]
    else:
        srows = summarize(rows, higher)
    return best_per_strategy(srows, higher) if best_only else srows


def _summary_from_dict(r: Mapping[str, Any]) -> SummaryRow:
    if missing := [k for k in ("strategy", "epsilon") if k not in r]:
        raise ConfigError(f"summary row {dict(r)!r} lacks {missing}; give strategy, epsilon, mean, std.")
    strategy, eps, hp = str(r["strategy"]), float(r["epsilon"]), r.get("hyperparameters", {})
    hp = hp if isinstance(hp, str) else dict(hp)
    mean = None if r["mean"] is None else float(r["mean"])
    std = None if r.get("std") is None else float(r["std"])
    n_seeds, n_diverged = int(r.get("n_seeds", 1)), int(r.get("n_diverged", 0))
    return SummaryRow(strategy, eps, hp, mean, std, n_seeds, n_diverged, flag_text(r.get("selected", False)))


def results_table(rows: Sequence[SummaryRow], metric: str, higher: bool, caption: str = "") -> Table:
    """HTML table: strategy, ε, best hyperparameters, metric mean ± std, seeds."""
    mark = not all(r.selected for r in rows)  # when every row is the tuner's choice, say it once
    columns = ["strategy", "ε", "selected configuration" if not mark and rows else "best hyperparameters"]
    cells = []
    for r in rows:
        name = r.strategy + (" (selected)" if r.selected and mark else "")
        eps = "∞ (non-private)" if math.isinf(r.epsilon) else f"{r.epsilon:g}"
        seeds = f"{r.n_seeds - r.n_diverged}/{r.n_seeds}" + (f" ({r.n_diverged} diverged)" if r.n_diverged else "")
        cells.append([name, eps, fmt_hyperparameters(r.hyperparameters), fmt_metric(r, metric), seeds])
    return Table([*columns, metric_label(metric, higher) + ", mean ± std", "seeds"], cells, caption=caption)


def render_terminal_table(
    rows: Iterable[Any], *, metric: str = "accuracy", higher_is_better: bool | None = None, title: str | None = None
) -> RichTable:
    """A ``rich`` table of the best configuration per strategy and ε that fits 100 columns."""
    higher = resolve_direction(metric, higher_is_better)
    srows = as_summary_rows(rows, higher=higher)
    name = {"accuracy": "Accuracy", "mse": "MSE", "loss": "Loss"}.get(metric, metric)
    default = f"Best hyperparameters per strategy and ε ({name}: {'higher' if higher else 'lower'} is better)"
    t = RichTable(title=title or default, header_style="bold", title_justify="left", caption_justify="left")
    # Column caps: 6 borders + 5×2 padding + these = 100 columns whatever the console width (long cells fold).
    t.add_column("Strategy", style="cyan", overflow="fold", max_width=14)
    t.add_column("ε", justify="right", overflow="fold", max_width=6)
    t.add_column("Best hyperparameters", overflow="fold", max_width=40)
    t.add_column(f"{name} {'↑' if higher else '↓'}", justify="right", overflow="fold", min_width=19, max_width=19)
    t.add_column("Seeds", justify="right", overflow="fold", max_width=5)
    for r in srows:
        strategy, eps = r.strategy + (" *" if r.selected else ""), "∞" if math.isinf(r.epsilon) else f"{r.epsilon:g}"
        hp, seeds = fmt_hyperparameters(r.hyperparameters), f"{r.n_seeds - r.n_diverged}/{r.n_seeds}"
        t.add_row(strategy, eps, hp, fmt_metric(r, metric), seeds)
    notes = ["mean ± std over seeds; Seeds = finished/run (the rest diverged)."]
    if any(r.selected for r in srows):
        notes.append("* configuration selected by the tuner.")
    t.caption = " ".join(notes)
    return t


# ----------------------------------------------------------------------------- CSV
def summary_csv_rows(rows: Sequence[SummaryRow]) -> list[dict[str, Any]]:
    """Flat rows: strategy, epsilon, mean, std, seeds, then one column per hyperparameter."""
    out = [asdict(r) for r in rows]
    for d in out:
        hp = d.pop("hyperparameters")
        d.update({"configuration": hp} if isinstance(hp, str) else {f"hp_{k}": v for k, v in sorted(hp.items())})
    return out


def ledger_csv_rows(rows: Iterable[LedgerRow | Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [asdict(r) for r in coerce_ledger_rows(rows)]


def history_csv_rows(histories: Iterable[RunHistory | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Long format: run, strategy, then the history row (step, clip, lr, ...)."""
    return [{"run": h.run, "strategy": h.strategy, **row} for h in coerce_histories(histories) for row in h.rows]


def ledger_table(rows: Sequence[LedgerRow], max_rows: int = 200) -> Table:
    """HTML ledger table; long ledgers are truncated (the CSV has every row)."""
    cap = "ε of a run alone at the study's δ; per-run values do not add up (composition is sub-additive)."
    if len(rows) > max_rows:
        cap += f" First {max_rows} of {len(rows)} rows; ledger.csv has all."
    columns = ["run", "query label", "releases", "ε spent", "ε planned", "ν", "q"]
    cells = [
        [r.run, r.label, int(r.releases), r.epsilon, r.planned_epsilon, r.noise_multiplier, r.sampling_rate]
        for r in rows[:max_rows]
    ]
    return Table(columns, cells, caption=cap)
