"""Figures of a study, one function per figure (each names the paper figure it reproduces); each saves
a PNG and returns its Path. Matplotlib's ``Figure`` with the Agg canvas, never ``pyplot``: no global
state, safe in threads and headless."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, NullFormatter

from dptune import accounting
from dptune.errors import ConfigError
from dptune.metrics import clip_to_range
from dptune.outputs import DIAGNOSTICS_DIR, NOT_DP_LABEL, up
from dptune.report.data import (
    LedgerRow,
    LinearScalingFit,
    RunHistory,
    SummaryRow,
    coerce_histories,
    coerce_ledger_rows,
    coerce_lt_ma,
    metric_label,
)

DPI = 110
_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]


# Built-in strategies get fixed colours: a strategy looks the same in every figure and report, whatever a study ran.
_KNOWN = ("oso", "dpsgd", "quantile", "adamwosm", "dpadam", "adadp", "dpgd", "nodp")


def strategy_colors(names: Iterable[str]) -> dict[str, str]:
    """A stable colour per strategy name: fixed for built-in strategies, by CRC32 otherwise."""
    out = {}
    for n in sorted(set(names)):
        base = n.split("/")[0].split(" ")[0]
        i = _KNOWN.index(base) if base in _KNOWN else len(_KNOWN) + zlib.crc32(n.encode()) % 2
        out[n] = _COLORS[i % len(_COLORS)]
    return out


def _figure(width: float = 7.0, height: float = 4.2, nrows: int = 1, ncols: int = 1) -> tuple[Figure, Any]:
    """A figure and its axes: one ``Axes`` for a single panel, else a 1-D array of them."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"figures are PNG files: give a path ending in .png, got {str(path)!r}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    if DIAGNOSTICS_DIR in path.parts:  # a diagnostic image copied out of its folder keeps the label
        fig.text(0.005, 0.005, NOT_DP_LABEL, fontsize=7, color="#b00000", ha="left", va="bottom")
    fig.savefig(path, format="png", dpi=DPI)
    return path


def _finish(ax: Any, xlabel: str, ylabel: str, title: str, *, grid: str = "major", legend: str | None = "best") -> None:
    """Axis labels, title, a light grid and (``legend``: its location) the legend."""
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, which=grid)
    if legend:
        ax.legend(fontsize=8, loc=legend)


def _empty(ax: Any, text: str) -> None:
    """What a panel with nothing to draw says instead."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _log_axes(ax: Any, which: str) -> None:
    """Log ``which`` axes ("x", "y", "xy"), plain-number ticks (0.3, 1, 20), not mathtext: read and laid out faster."""
    for name in which:
        ax.set(**{f"{name}scale": "log"})
        axis, (lo, hi) = (ax.yaxis, ax.get_ylim()) if name == "y" else (ax.xaxis, ax.get_xlim())
        # Enough significant digits to tell neighbouring ticks apart on a narrow range.
        digits = 3 if not (lo > 0 and hi > lo) else max(3, math.ceil(-math.log10((hi - lo) / hi)) + 2)
        fmt = FuncFormatter(lambda v, _pos, d=digits: f"{v:.{d}g}")
        axis.set_major_formatter(fmt)
        # Less than a decade shown: at most one major tick, so label the minor ones too.
        axis.set_minor_formatter(fmt if lo > 0 and hi / lo < 10 else NullFormatter())


def _eps_text(eps: float) -> str:  # a stated ε: rounded up (found in review: 0.3222582694523013 → 0.322258)
    return "∞" if math.isinf(eps) else up(eps, 6)


def _sequential(n: int) -> list[Any]:
    return [colormaps["viridis"](x) for x in np.linspace(0.0, 0.85, max(n, 1))][:n]


# ----------------------------------------------------------------------------- metric vs ε
def metric_vs_epsilon(
    rows: Sequence[SummaryRow],
    path: str | Path,
    *,
    metric: str = "accuracy",
    higher: bool = True,
    title: str | None = None,
) -> Path:
    """Metric of the best (or selected) configuration per strategy vs ε: mean over seeds ± one std
    (Galli et al. 2024, Figs 3–5). Non-private rows (ε = ∞) are not drawn: this figure is published
    (docs/privacy.md); configurations whose seeds all diverged have no point."""
    fig, ax = _figure()
    rows = [r for r in rows if math.isfinite(r.epsilon)]
    colors = strategy_colors(r.strategy for r in rows)
    for strat in sorted(colors):
        fin = sorted((r for r in rows if r.strategy == strat and r.mean is not None), key=lambda r: r.epsilon)
        if fin:  # means clipped to the metric's range: a noisy private score can leave it
            x, y = [r.epsilon for r in fin], [clip_to_range(r.mean, metric) for r in fin]
            err = [r.std or 0.0 for r in fin]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=4, lw=1.6, color=colors[strat], label=strat)
    if rows:
        eps = sorted({r.epsilon for r in rows})
        ax.set_xticks(eps, [_eps_text(e) for e in eps])
    label, drawn = metric_label(metric, higher), bool(ax.get_legend_handles_labels()[0])
    title = title or f"{label} vs ε (mean ± std over seeds)"
    _finish(ax, "privacy budget ε", label, title, legend="best" if drawn else None)
    if not drawn:
        _empty(ax, "no finished configuration to show")
    return _save(fig, path)


# ----------------------------------------------------------------------------- C_t, ρ_t
def _series(rows: Sequence[Mapping[str, Any]], key: str, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    steps, vals = [], []
    for i, row in enumerate(rows):
        try:
            v = float(row[key])
        except (KeyError, TypeError, ValueError):  # missing, None or not a number
            continue
        # log axis: only finite positive values can be drawn.
        if math.isfinite(v) and v > 0:
            steps.append(float(row.get("step", i + 1)))
            vals.append(v)
    if len(steps) > max_points:
        # Long runs: every k-th point (and the last) — a line plot cannot show more anyway.
        idx = np.unique(np.r_[np.arange(0, len(steps), math.ceil(len(steps) / max_points)), len(steps) - 1])
        return np.asarray(steps)[idx], np.asarray(vals)[idx]
    return np.asarray(steps), np.asarray(vals)


_LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def trajectories(
    histories: Sequence[RunHistory | Mapping[str, Any]],
    path: str | Path,
    *,
    title: str | None = None,
    panels: Sequence[tuple[str, str]] = (("clip", "clipping threshold $C_t$"), ("lr", "learning rate $ρ_t$")),
    log: bool = True,
) -> Path:
    """C_t and ρ_t against the iteration t, log y-axis: one line per run, coloured by strategy, one line
    style per ε. Rows lacking a key or with non-positive values are skipped. ``panels``: (row key, y label)
    per panel, e.g. ``(("score", "accuracy"),)`` with ``log=False``."""
    hs = coerce_histories(histories)
    fig, axes = _figure(7.0, max(3.6, 3.0 * len(panels)), nrows=len(panels))
    axes = np.atleast_1d(axes)
    colors = strategy_colors(h.strategy for h in hs)
    # ε as the line style: runs of one strategy at two budgets would otherwise be the same line.
    epsilons = sorted({float(h.epsilon) for h in hs if h.epsilon is not None})
    style = {e: _LINE_STYLES[i % len(_LINE_STYLES)] for i, e in enumerate(epsilons)}

    def name(h: RunHistory) -> str:
        if len(epsilons) < 2 or h.epsilon is None:
            return h.strategy
        return f"{h.strategy}, ε = {_eps_text(float(h.epsilon))}"

    seen: set[tuple[str, str]] = set()
    for (key, label_y), ax in zip(panels, axes, strict=True):
        for h in hs:
            x, y = _series(h.rows, key)
            if len(x) == 0:
                continue
            label = name(h) if (key, name(h)) not in seen else None
            seen.add((key, name(h)))
            ls = style.get(float(h.epsilon), "-") if h.epsilon is not None else "-"
            mark = "o" if len(x) < 30 else None  # a few evaluations: dots, so that one alone shows
            ax.plot(x, y, lw=1.3, alpha=0.85, color=colors[h.strategy], ls=ls, label=label, marker=mark, ms=3)
        if ax.lines and log:
            _log_axes(ax, "y")
        if ax.lines:
            ax.legend(fontsize=8, loc="best", ncol=2 if len({name(h) for h in hs}) > 6 else 1)
        else:
            _empty(ax, f"no run recorded '{key}'")
        ax.set_ylabel(label_y)
        ax.grid(alpha=0.3, which="both")
    axes[-1].set_xlabel("iteration t")
    styles = "; line style: ε)" if len(epsilons) > 1 else ")"
    axes[0].set_title(title or "Trajectories of $C_t$ and $ρ_t$ (one line per run" + styles)
    return _save(fig, path)


# ----------------------------------------------------------------------------- cosine (Galli Fig. 1)
def cosine_similarity(result: Any, path: str | Path, *, title: str | None = None) -> Path:
    """cos(sanitized, true mean gradient) vs C per iteration t, ± one std (Galli et al. 2024, Fig. 1)."""
    fig, ax = _figure()
    clips = np.asarray(result.clips, dtype=float)
    for color, t in zip(_sequential(len(result.iterations)), result.iterations, strict=True):
        m = np.asarray(result.mean[t], dtype=float)
        s = np.asarray(result.std[t], dtype=float)
        ax.plot(clips, m, marker="o", ms=3, lw=1.5, color=color, label=f"t = {t}")
        ax.fill_between(clips, m - s, m + s, color=color, alpha=0.15)
    ax.axhline(0.0, color="k", lw=0.8)
    _log_axes(ax, "x")
    ax.set_ylim(min(-0.1, float(np.nanmin([np.nanmin(result.mean[t]) for t in result.iterations])) - 0.05), 1.02)
    default = (
        f"Sanitized vs true gradient (ν = {result.noise_multiplier:.3g}, "
        f"L = {result.expected_batch_size:g}, {result.repeats} draws)"
    )
    ylabel = "cosine similarity to the true mean gradient"
    _finish(ax, "clipping threshold C", ylabel, title or default, grid="both")
    return _save(fig, path)


# ----------------------------------------------------------------------------- Pareto (Galli Fig. 2)
def pareto_front(nu: float, nu_q: np.ndarray) -> np.ndarray:
    """ν_g = (ν⁻² − ν_q⁻²)^(−½) (Galli Proposition 1) for each ν_q > ν."""
    nu_q = np.asarray(nu_q, dtype=float)
    if np.any(nu_q <= nu):
        raise ConfigError(f"ν_q must exceed the total ν = {nu:.4g} on the Pareto front.")
    return (nu**-2 - nu_q**-2) ** -0.5


def pareto_choice(nu: float, relative_increase: float = 0.01) -> tuple[float, float]:
    """(ν_q, ν_g) chosen by the rule 'ν_g is ν raised by ``relative_increase``' (1 %: ν_q ≈ 7.124ν)."""
    nu_q = accounting.oso_q_noise_multiplier(nu, relative_increase)
    return nu_q, accounting.split_noise_multiplier(nu, nu_q)


def noise_pairs(noise_multipliers: Mapping[float, float] | Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The checked (ε, ν) pairs of ``noise_pareto``'s input, sorted by ε."""
    items = list(noise_multipliers.items()) if isinstance(noise_multipliers, Mapping) else list(noise_multipliers)
    if not items:
        raise ConfigError("noise_pareto needs at least one (epsilon, noise multiplier ν) pair.")
    out = []
    for item in items:
        try:
            eps, nu = (float(v) for v in item)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"noise_pareto takes (epsilon, ν) pairs, got {item!r}.") from e
        if not (math.isfinite(nu) and nu > 0):
            raise ConfigError(f"ν must be a finite number > 0 (ε = {eps:g} has ν = {nu!r}).")
        out.append((eps, nu))
    return sorted(out)


def noise_pareto(
    noise_multipliers: Mapping[float, float] | Sequence[tuple[float, float]],
    path: str | Path,
    *,
    relative_increase: float = 0.01,
    title: str | None = None,
) -> Path:
    """The ν_g–ν_q Pareto front of OSO's joint release, one curve per ε (Galli Fig. 2): splits with
    ν_g = (ν⁻² − ν_q⁻²)^(−½); the marker is the chosen split ν_g = (1 + r)ν, the dotted line ν_g → ν."""
    pairs = noise_pairs(noise_multipliers)
    fig, ax = _figure()
    for color, (eps, nu) in zip(_sequential(len(pairs)), pairs, strict=True):
        nu_q = nu * np.geomspace(1.005, 60.0, 300)
        ax.plot(nu_q, pareto_front(nu, nu_q), color=color, lw=1.6, label=f"ε = {_eps_text(eps)} (ν = {nu:.3g})")
        ax.axhline(nu, color=color, ls=":", lw=0.9)
        q_star, g_star = pareto_choice(nu, relative_increase)
        ax.plot([q_star], [g_star], marker="*", ms=13, color=color, mec="k", mew=0.6)
    chosen = rf"chosen: $\nu_g$ = {1 + relative_increase:g}$\nu$"
    ax.plot([], [], ls="none", marker="*", ms=11, color="w", mec="k", label=chosen)
    _log_axes(ax, "xy")
    xlabel, ylabel = r"$\nu_q$ (noise multiplier of OSO's q-query)", r"$\nu_g$ (noise multiplier of the gradient)"
    title = title or r"Pareto front of the ($\nu_q$, $\nu_g$) split (Galli Prop. 1)"
    _finish(ax, xlabel, ylabel, title, grid="both", legend="upper right")
    return _save(fig, path)


# ----------------------------------------------------------------------------- LT vs MA (Mohapatra Fig. 6)
def ma_break_even(rows: Sequence[Any]) -> int | None:
    """Largest k with ε_MA(k) ≤ ε_LT(k) (as ``theory.lt_vs_ma(...).k_max``; Mohapatra App. F), or None."""
    ks = [r.k for r in coerce_lt_ma(rows) if r.eps_ma <= r.eps_lt]
    return max(ks) if ks else None


def lt_vs_ma(rows: Sequence[Any], path: str | Path, *, title: str | None = None) -> Path:
    """ε of the whole tuning vs k candidates: Liu–Talwar vs MA (Mohapatra et al. 2022, App. F, Fig. 6)."""
    rs = coerce_lt_ma(rows)
    if not rs:
        raise ConfigError("lt_vs_ma needs at least one (k, eps_LT, eps_MA) row.")
    fig, ax = _figure()
    ks = [r.k for r in rs]
    ax.plot(ks, [r.eps_lt for r in rs], marker="o", ms=3, color="#1f77b4", label="Liu–Talwar (LT)")
    ax.plot(ks, [r.eps_ma for r in rs], marker="o", ms=3, color="#ff7f0e", label="moments accountant (MA)")
    k_star = ma_break_even(rs)
    if k_star is not None:
        ax.axvline(k_star, color="k", ls="--", lw=0.9, label=f"MA no costlier up to k = {k_star}")
    title = title or "Cost of tuning: LT vs MA"
    _finish(ax, "number of candidates k", "ε of the whole search (lower is better)", title)
    return _save(fig, path)


# ----------------------------------------------------------------------------- linear scaling (Panda Fig. 3)
def linear_scaling(fit: LinearScalingFit | Mapping[str, Any], path: str | Path, *, title: str | None = None) -> Path:
    """r = η·T against ε (Panda et al. 2024, Alg. 2 / Fig. 3): searched points, the fitted line (or
    ``fit.coefficients`` polynomial; x = μ with ``fit.axis == "mu"``) and r_f at the target (star)."""
    if isinstance(fit, Mapping):
        try:
            fit = LinearScalingFit(**fit)
        except TypeError as e:
            raise ConfigError(f"linear_scaling needs points, slope, intercept[, target_epsilon]: {e}.") from e
    pts = [(float(e), float(r)) for e, r in fit.points]
    if not pts:
        raise ConfigError("linear_scaling needs at least one (epsilon, r) point.")
    fig, ax = _figure()
    target = fit.target_epsilon
    grid = np.linspace(0.0, max([e for e, _ in pts] + ([target] if target is not None else [])) * 1.08, 100)
    sym = "μ" if fit.axis == "mu" else "ε"
    if fit.coefficients is not None:
        label = f"degree-{len(fit.coefficients) - 1} fit of r against {sym}"
    else:
        label = f"fit r = {fit.slope:.4g}·{sym} + {fit.intercept:.4g}"
    ax.plot(grid, [fit.r_at(g) for g in grid], color="#1f77b4", lw=1.4, label=label)
    ax.scatter([e for e, _ in pts], [r for _, r in pts], color="#d62728", zorder=3, label="searched points")
    if target is not None:
        star = f"extrapolated r at {sym} = {target:.4g}"
        ax.plot([target], [fit.r_at(target)], marker="*", ms=14, color="#2ca02c", mec="k", ls="none", label=star)
    xlabel = "μ of μ-GDP" if fit.axis == "mu" else "privacy budget ε"
    _finish(ax, xlabel, "r = η·T (learning rate × steps)", title or "Linear scaling rule (Panda et al. 2024)")
    return _save(fig, path)


# ----------------------------------------------------------------------------- ledger
def ledger(
    rows: Sequence[LedgerRow | Mapping[str, Any]],
    path: str | Path,
    *,
    planned_epsilon: float | Sequence[tuple[float, str]] | None = None,
    max_bars: int = 40,
    title: str | None = None,
) -> Path:
    """Left: ε spent by each run alone (bars, a histogram beyond ``max_bars``; planned ε as a black tick;
    the planned total or per-procedure ε as red lines; ε = ∞ marked). Right: releases per query label."""
    rs = coerce_ledger_rows(rows)
    fig, (ax_eps, ax_rel) = _figure(10.0, 4.4, ncols=2)
    _epsilon_per_run(ax_eps, rs, planned_epsilon, max_bars)
    by_label: dict[str, int] = {}
    for r in rs:
        by_label[r.label] = by_label.get(r.label, 0) + int(r.releases)
    if by_label:
        labels = sorted(by_label)
        ax_rel.barh(np.arange(len(labels)), [by_label[k] for k in labels], color="#2ca02c")
        ax_rel.set_yticks(np.arange(len(labels)), labels, fontsize=7)
        ax_rel.invert_yaxis()
    else:
        _empty(ax_rel, "no releases recorded")
    ax_rel.set(xlabel="noisy releases (all runs)", title="releases per query label")
    fig.suptitle(title or "Privacy ledger")
    return _save(fig, path)


def _epsilon_per_run(
    ax: Any, rs: list[LedgerRow], planned_epsilon: float | Sequence[tuple[float, str]] | None, max_bars: int
) -> None:
    """The ledger figure's left panel: each run's ε alone, and the planned ε lines."""
    eps_by_run: dict[str, float] = {}
    plan_by_run: dict[str, float] = {}
    for r in rs:
        if r.epsilon is not None:
            eps_by_run[r.run] = max(eps_by_run.get(r.run, 0.0), float(r.epsilon))
        if r.planned_epsilon is not None:
            plan_by_run[r.run] = max(plan_by_run.get(r.run, 0.0), float(r.planned_epsilon))
    runs = list(eps_by_run)
    # ε = ∞ (a non-private run) cannot be drawn (an infinite bar or bin is NaN in matplotlib): named instead.
    finite = {r: e for r, e in eps_by_run.items() if math.isfinite(e)}
    if not runs:
        _empty(ax, "no per-run ε recorded")
    elif len(runs) <= max_bars:
        y = np.arange(len(runs))
        ax.barh(y, [finite.get(r, 0.0) for r in runs], color="#1f77b4", label="spent")
        for i, r in enumerate(runs):
            if r not in finite:
                ax.text(0.0, i, " ε = ∞ (non-private)", va="center", fontsize=7)
        ticks = [(plan_by_run[r], i) for i, r in enumerate(runs) if math.isfinite(plan_by_run.get(r, math.nan))]
        if ticks:
            ax.scatter(*zip(*ticks, strict=True), marker="|", s=160, color="k", zorder=3, label="planned (run alone)")
        ax.set_yticks(y, [str(r) or "(run)" for r in runs], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ε of the run alone")
    else:
        if finite:
            ax.hist(list(finite.values()), bins=20, color="#1f77b4")
        n_inf = len(runs) - len(finite)
        hidden = f"; {n_inf} non-private, ε = ∞, not shown)" if n_inf else ")"
        ax.set(xlabel=f"ε of the run alone ({len(runs)} runs" + hidden, ylabel="runs")
    if isinstance(planned_epsilon, int | float):
        lines = [(float(planned_epsilon), "study plan")]
    else:
        lines = [(float(e), str(lab)) for e, lab in planned_epsilon or ()]
    lines = [(e, lab) for e, lab in lines if math.isfinite(e)]
    for k, (e, lab) in enumerate(lines):
        ax.axvline(e, color="#d62728", lw=1.2, ls=("-", "--", ":", "-.")[k % 4], label=f"{lab}: ε = {up(e)}")
    if runs and ax.get_legend_handles_labels()[0]:  # a histogram alone has nothing to name
        # Below the axes: inside, it would hide the longest bars.
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ax.set_title("privacy spent per run")


# ----------------------------------------------------------------------------- heatmaps
def cell_grid(cells: Mapping[tuple[Any, Any], float | None]) -> tuple[list[Any], list[Any], np.ndarray]:
    """(x values, y values, grid [y, x]) of the cells keyed (x, y) in numeric order; missing cells NaN."""
    xs = sorted({x for x, _ in cells}, key=float)
    ys = sorted({y for _, y in cells}, key=float)
    grid = np.full((len(ys), len(xs)), np.nan)
    for (x, y), v in cells.items():
        grid[ys.index(y), xs.index(x)] = np.nan if v is None else v
    return xs, ys, grid


def annotate_cells(
    ax: Any, grid: np.ndarray, lo: float, hi: float, higher: bool, *, fontsize: float = 7, missing: str | None = None
) -> None:
    """Each heatmap cell's value (3 digits), black on light cells, white on dark; NaN shows ``missing``."""
    for (i, j), v in np.ndenumerate(grid):
        if not np.isfinite(v) and missing is None:
            continue
        frac = (v - lo) / ((hi - lo) or 1.0) if np.isfinite(v) else 0.0
        light = frac > 0.6 if higher else frac < 0.4
        text = f"{v:.3g}" if np.isfinite(v) else missing
        ax.text(j, i, text, ha="center", va="center", fontsize=fontsize, color="black" if light else "white")


def _heatmap(
    ax: Any, xs: list[Any], ys: list[Any], grid: np.ndarray, names: tuple[str, str], title: str, **imshow: Any
) -> Any:
    """``cell_grid``'s output drawn on ``ax`` with the axes ticked and named; returns the image."""
    im = ax.imshow(grid, origin="lower", aspect="auto", **imshow)
    ax.set_xticks(range(len(xs)), [f"{float(x):g}" for x in xs])
    ax.set_yticks(range(len(ys)), [f"{float(y):g}" for y in ys])
    ax.set(xlabel=names[0], ylabel=names[1])
    ax.set_title(title, fontsize=9)
    return im


def grid_heatmap(
    scores: Mapping[tuple[Any, Any], float],
    x_name: str,
    y_name: str,
    path: str | Path,
    *,
    title: str,
    metric: str = "accuracy",
    higher: bool = True,
) -> Path:
    """Every configuration's score on a two-axis grid, the best outlined. Shows losers: a diagnostic."""
    xs, ys, grid = cell_grid(scores)
    cmap = "viridis" if higher else "viridis_r"
    fig, ax = _figure(1.1 * len(xs) + 2.4, 0.55 * len(ys) + 1.8)
    im = _heatmap(ax, xs, ys, grid, (x_name, y_name), title, cmap=cmap)
    lo, hi = (np.nanmin(grid), np.nanmax(grid)) if np.isfinite(grid).any() else (0.0, 1.0)
    annotate_cells(ax, grid, lo, hi, higher)
    if np.isfinite(grid).any():
        i, j = np.unravel_index(np.nanargmax(grid) if higher else np.nanargmin(grid), grid.shape)
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec="red"))
    fig.colorbar(im, ax=ax, label=metric)
    return _save(fig, path)


# ----------------------------------------------------------------------------- Mohapatra App. G (Fig. 7), Sec. 4.1
def best_count_heatmap(
    counts: Mapping[tuple[float, float], int],
    path: str | Path,
    *,
    title: str,
    x_name: str = "learning rate α",
    y_name: str = "clipping threshold C",
) -> Path:
    """How often each (α, C) cell won (Mohapatra et al. 2022, App. G, Fig. 7); winners outlined in red."""
    if not counts:
        raise ConfigError("best_count_heatmap needs at least one (α, C) cell.")
    xs, ys, grid = cell_grid(counts)
    top = max(1.0, float(np.nanmax(grid)))
    fig, ax = _figure(0.75 * len(xs) + 2.6, 0.55 * len(ys) + 1.8)
    im = _heatmap(ax, xs, ys, grid, (x_name, y_name), title, cmap="Blues", vmin=0, vmax=top)
    for i, j in zip(*np.nonzero(np.isfinite(grid)), strict=True):
        v = grid[i, j]
        ax.text(j, i, f"{int(v)}", ha="center", va="center", fontsize=7, color="white" if v > 0.6 * top else "black")
        if v >= 1:
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=1.5, ec="red"))
    fig.colorbar(im, ax=ax, label="times best")
    return _save(fig, path)


def lr_vs_clip(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, *, title: str) -> Path:
    """The best learning rate per C, log–log, with α ∝ 1/C references (Mohapatra et al. 2022, Sec. 4.1)."""
    pts = {k: sorted((float(c), float(a)) for c, a in v) for k, v in series.items() if v}
    if not pts:
        raise ConfigError("lr_vs_clip needs at least one series with a (C, α) point.")
    fig, ax = _figure(6.4, 4.2)
    for (label, p), col in zip(pts.items(), _sequential(len(pts)), strict=True):
        cs, al = np.array([c for c, _ in p]), np.array([a for _, a in p])
        ax.plot(cs, al, marker="o", color=col, label=label)
        if len(cs) > 1:
            k = math.exp(float(np.mean(np.log(al * cs))))  # α = k/C through the points' geometric mean
            grid = np.geomspace(cs.min(), cs.max(), 20)
            ax.plot(grid, k / grid, ls="--", lw=0.9, color=col, alpha=0.7)
    _log_axes(ax, "xy")
    _finish(ax, "clipping threshold C", "best learning rate α", title, grid="both", legend=None)
    ax.title.set_fontsize(9)
    ax.plot([], [], ls="--", color="grey", label="α ∝ 1/C")
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)
