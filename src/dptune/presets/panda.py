"""Panda, Tang, Mahloujifar, Sehwag & Mittal (ICML 2024), "A New Linear Scaling Rule for Private Adaptive
Hyperparameter Optimization": full-batch DP-GD tuned by the rule, beside Panda's random search and grid oracle
on the same space. Presets ``panda-linear-scaling-mnist`` and ``-text`` (MiniLM probes on AG News and Enron1);
option ``average`` adds the iterate-averaging ablation (Fig. 11). Settings, deviations: docs/reproduce.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dptune.errors import ConfigError
from dptune.metrics import clip_to_range
from dptune.outputs import NOT_DP_LABEL, diagnostics_dir, up
from dptune.presets._common import Part, study_dict
from dptune.report.figures import annotate_cells, cell_grid
from dptune.report.html import FigureRef
from dptune.tune.results import load_study, study_table

DELTA = 1e-5
# Sweep budgets at small n: each sweep gets Panda's share of its own target (0.1·ε and 0.2·ε: their ε = 1
# split at every ε) instead of a fixed 0.1 and 0.2, which would tell little about r at n ≈ 2,000 (the noise
# per step has std √T/(μ·n)). docs/reproduce.md, "Why the rule lost to random search", item 2.
SMALL_N_SWEEPS: dict[str, list[float]] = {"fraction": [0.1, 0.2]}
# r = η·T log-uniform (Alg. 3 says uniformly: over a 2,000-fold r range uniform draws miss the small r the
# low-ε sweeps favour; docs/reproduce.md, same section, item 1), like Panda's logarithmic η grids.
R_SAMPLING = "log_uniform"

_MNIST_PAPER: dict[str, Any] = {
    **{"limit": None, "lr": (0.01, 4.0), "steps": (20, 200), "grid_lr": [0.03, 0.1, 0.3, 1.0, 3.0]},
    **{"grid_steps": [25, 50, 100, 200], "epsilons": [0.5, 1.0, 2.0], "seeds": [0, 1, 2], "sweeps": [0.1, 0.2]},
}
MNIST: dict[str, dict[str, Any]] = {
    "paper": _MNIST_PAPER,
    "small": {
        **{"limit": 1500, "lr": (0.05, 2.0), "steps": (5, 30), "grid_lr": [0.1, 1.0], "grid_steps": [10, 30]},
        **{"epsilons": [2.0, 8.0], "seeds": [0], "sweeps": SMALL_N_SWEEPS},
    },
    "smoke": {
        **{"limit": 100, "lr": (0.05, 1.0), "steps": (2, 4), "grid_lr": [0.1, 1.0], "grid_steps": [3]},
        **{"epsilons": [1.0], "seeds": [0], "sweeps": [0.1, 0.2]},
    },
}
_TEXT_PAPER: dict[str, Any] = {
    **{"limit": None, "lr": (0.05, 5.0), "steps": (10, 200), "grid_lr": [0.1, 0.3, 1.0, 3.0]},
    **{"grid_steps": [25, 50, 100, 200], "epsilons": [0.5, 1.0, 2.0, 4.0], "seeds": [0, 1, 2], "sweeps": [0.1, 0.2]},
}
TEXT: dict[str, dict[str, Any]] = {
    "paper": _TEXT_PAPER,
    "small": {**_TEXT_PAPER, "limit": 3000, "sweeps": SMALL_N_SWEEPS},  # the paper's search on subsets
    "smoke": {
        **{"limit": 40, "lr": (0.1, 2.0), "steps": (2, 6), "grid_lr": [0.3, 1.0], "grid_steps": [4]},
        **{"epsilons": [1.0], "seeds": [0], "sweeps": [0.1, 0.2]},
    },
}
TEXT_DATASETS = {"agnews": ("ag_news", "AG News"), "enron": ("enron_spam", "Enron1 spam")}


def rule_notes(scale: str, s: Mapping[str, Any], probe: bool) -> tuple[str, ...]:
    """What to expect of the rule at this scale (measurements in docs/reproduce.md)."""
    span = (s["lr"][1] * s["steps"][1]) / (s["lr"][0] * s["steps"][0])
    notes = (
        f"r = η·T is drawn log-uniformly (Alg. 3 says uniformly; over this {span:,.0f}-fold r range uniform "
        "draws rarely reach the small r the low-ε sweeps favour). random-search is one draw of (η, T) per "
        "seed replicate (shared across ε): the mean over seeds averages that many draws.",
    )
    if scale != "small":
        return notes
    small_n = (
        "Small n: a sweep informs as μ·n allows (DP-GD's noise per step of the averaged gradient has std √T/(μ·n)); "
        "Panda's ε₁ = 0.1 at n = 50,000 would be ε₁ ≈ 2.8 at n = 2,400 (4.8 at 1,500), so the sweeps are noisy and "
        "their best r is close to a random draw (docs/reproduce.md, 'Why the rule lost to random search')."
    )
    if not probe:
        return (*notes, small_n)
    return (
        *notes,
        small_n + " Measured on these probes: the r beyond which accuracy falls grows with ε (≈ 50·ε on AG News), "
        "but at the sweep budgets the accuracy-vs-r curve is flat (a zero-initialised probe is a class-mean "
        "classifier at tiny r) or broadly peaked within the seed noise; about half of the fitted slopes come out "
        "negative (r* clipped to r_min, the final run at η_min·T_f) and the rule lands on that plateau: it beats "
        "a random draw at small ε and misses the larger r that pays at the largest ε.",
    )


def sweeps_text(sweeps: Any) -> str:
    if isinstance(sweeps, Mapping):
        shares = " and ".join(f"{f:g}·ε" for f in sweeps["fraction"])
        return f"{shares} of each target ε (Panda's ε = 1 split at every ε; sized for small n)"
    return f"ε ∈ {list(sweeps)}"


def _arms(s: Mapping[str, Any], fixed: Mapping[str, Any]) -> list[dict[str, Any]]:
    space = {"lr": {"log_uniform": list(s["lr"])}, "steps": {"int_uniform": list(s["steps"])}}
    sweeps = dict(s["sweeps"]) if isinstance(s["sweeps"], Mapping) else list(s["sweeps"])
    rule = {"name": "linear-scaling", "sweep_epsilons": sweeps, "runs_per_sweep": s.get("runs_per_sweep", 3)}
    rule |= {"fit": "linear", "fit_axis": "epsilon", "r_sampling": R_SAMPLING, "final_steps": "max"}
    arms = [
        ("linear-scaling", space, rule),
        ("random-search", space, {"name": "random", "n": 1}),
        ("grid-oracle", {"lr": list(s["grid_lr"]), "steps": list(s["grid_steps"])}, {"name": "oracle"}),
    ]
    return [{"name": "dpgd", "label": label, "space": sp, "fixed": dict(fixed), "method": m} for label, sp, m in arms]


def panda_study(
    name: str, data: dict[str, Any], model: dict[str, Any], s: Mapping[str, Any], fixed: Mapping[str, Any]
) -> dict[str, Any]:
    if s["limit"] is not None:
        data.setdefault("options", {})["limit"] = s["limit"]
    return study_dict(
        name=name,
        data=data,
        model=model,
        # steps is searched (it overrides this value per run); the training section needs one.
        training={"steps": int(s["steps"][1]), "full_batch": True},
        budget={"epsilon": list(s["epsilons"]), "delta": DELTA, "accountant": "auto", "account_seeds": False},
        # Panda evaluate the final model (with DP-GD's free step along the momentum buffer).
        selection={"mode": "public", "split": "test", "checkpoint": "final", "across_seeds": "per-seed"},
        strategies=_arms(s, fixed),
        seeds=s["seeds"],
    )


# The iterate-averaging ablation (Panda §A.5, Fig. 11): option ``average`` adds a second grid
# oracle whose DP-GD returns the EMA or SWA of its iterates (post-processing: same ε per run).
AVERAGING_ABLATIONS = ("ema", "swa")


def _with_averaging(study: dict[str, Any], options: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``study`` with, for option ``average = avg``, a ``grid-oracle-<avg>`` arm (the oracle's grid, DP-GD with
    ``average = avg``, defaults ema_decay = 1 − 10/T, swa_start = 0.5) after the other arms, and its note."""
    avg = options.get("average")
    if avg is None or avg == "none":
        return study, ()
    if avg not in AVERAGING_ABLATIONS:
        raise ConfigError(
            f"option average = {avg!r} is not an averaging ablation. Fix: use 'ema' or 'swa' (or leave it "
            "out: no ablation arm)."
        )
    oracle = next(a for a in study["strategies"] if a.get("label") == "grid-oracle")
    arm = {**oracle, "label": f"grid-oracle-{avg}", "fixed": {**oracle["fixed"], "average": avg}}
    study["strategies"] = [*study["strategies"], arm]
    what = "the EMA (decay 1 − 10/T)" if avg == "ema" else "the SWA (mean of the iterates of the last half)"
    note = (
        f"ablation (Panda §A.5, Fig. 11): grid-oracle-{avg} is the oracle's grid with DP-GD returning {what} of "
        "its iterates instead of the last one; averaging is post-processing (same ε per run), but the arm is a "
        "second grid: its runs add to the study's composed ε.",
    )
    return study, note


def build_mnist(scale: str, options: Mapping[str, Any]) -> list[Part]:
    s = MNIST[scale]
    fixed = {"clip": 1.0, "momentum": 0.9, "zero_init": False}
    study = panda_study(f"panda-linear-scaling-mnist-{scale}", {"name": "mnist"}, {"name": "galli_cnn"}, s, fixed)
    study, ablation = _with_averaging(study, options)
    notes = (
        f"full-batch DP-GD (momentum 0.9, C = 1), CNN from scratch; sweeps at {sweeps_text(s['sweeps'])}, "
        f"targets ε ∈ {s['epsilons']}, δ = {DELTA:g}, μ-GDP accounting.",
        *rule_notes(scale, s, probe=False),
        *ablation,
    )
    return [Part("study", "MNIST, CNN from scratch (full-batch DP-GD, linear scaling)", study, notes)]


def build_text(scale: str, options: Mapping[str, Any]) -> list[Part]:
    s = TEXT[scale]
    fixed = {"clip": 1.0, "momentum": 0.9, "zero_init": True}
    parts = []
    for key, (dataset, title) in TEXT_DATASETS.items():
        data = {"name": dataset, "options": {"representation": "minilm"}}
        model = {"name": "linear_probe", "options": {"zero_init": True, "bias": False}}
        study = panda_study(f"panda-linear-scaling-{key}-{scale}", data, model, s, fixed)
        study, ablation = _with_averaging(study, options)
        notes = (
            f"zero-initialised linear probe without bias on all-MiniLM-L6-v2 embeddings (384-d), full-batch "
            f"DP-GD; sweeps at {sweeps_text(s['sweeps'])}, targets ε ∈ {s['epsilons']}, δ = {DELTA:g}.",
            *rule_notes(scale, s, probe=True),
            *ablation,
        )
        parts.append(Part(key, f"{title}, MiniLM features + linear probe (linear scaling)", study, notes))
    return parts


def _draw_fit(ax: Any, fit: Mapping[str, Any], first: bool) -> None:
    """One linear-scaling procedure on the r-vs-ε axes: sweep points, fitted line, r* (legend labels: first drawn)."""
    pts, label = fit["points"], "sweep best r" if first else None
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", s=18, label=label)
    if fit.get("coef"):
        # sampled, so that on the log axis the positive part of a falling line still shows
        x0, x1 = min(p[0] for p in pts), fit["x_final"]
        xs = [x0 + (x1 - x0) * i / 60 for i in range(61)]
        ys = [sum(c * x ** (len(fit["coef"]) - 1 - k) for k, c in enumerate(fit["coef"])) for x in xs]
        ax.plot(xs, ys, color="tab:blue", lw=0.8, alpha=0.6, label="linear fit" if first else None)
    label = "r* (final run, at its own ε_f)" if first else None
    ax.scatter([fit["x_final"]], [fit["r_star"]], marker="*", s=90, color="tab:red", label=label, zorder=3)
    rf = fit.get("r_final")
    if rf is not None and not math.isclose(rf, fit["r_star"], rel_tol=1e-9):
        # T_f is fixed at planning: an r* outside [η_min·T_f, η_max·T_f] runs at the nearest r
        label = "r the final run could use (η_f clamped)"
        ax.scatter(
            [fit["x_final"]], [rf], marker="o", s=60, facecolors="none", edgecolors="tab:red", label=label, zorder=3
        )


def r_vs_epsilon_figure(study_dir: str | Path, path: str | Path) -> FigureRef | None:
    """r = η·T against ε (Panda Fig. 3): each procedure's sweep points and fitted line, the
    extrapolated r* at its final run's ε, and the r the grid oracle selected at each target ε."""
    rows = study_table(study_dir)
    configs = {r["run_id"]: r["config"] for r in load_study(study_dir)[2] if r["config"] is not None}
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    drawn = False
    for r in rows:
        if r["method"] == "linear-scaling":
            for fit in filter(None, r.get("fits") or []):
                _draw_fit(ax, fit, first=not drawn)
                drawn = True
        elif r["method"] in ("oracle", "random"):
            rs = [configs[rid]["lr"] * configs[rid]["steps"] for rid in r["selected_runs"] if rid in configs]
            if rs and math.isfinite(r["epsilon"]):
                marker, color = ("s", "tab:green") if r["method"] == "oracle" else ("^", "tab:gray")
                ax.scatter([r["epsilon"]] * len(rs), rs, marker=marker, color=color, s=28, label=r["strategy"])
    if not drawn:
        return None
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    ax.set(xlabel="ε", ylabel="r = η · T (log scale; fits below 0 are cut)")
    # r spans decades (r_min to r_max is 240–4,000-fold here): a linear axis squeezes every good r to 0
    ax.set_yscale("log", nonpositive="mask")
    ax.set_title("Linear scaling rule: r vs ε")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    return FigureRef(
        p,
        "r = η·T vs ε: best sweep run per sweep (dots), linear fit, extrapolated r* at the final "
        "run's ε (star), and the r selected by the grid oracle (squares) and random search "
        "(triangles) at each target ε (Panda et al. 2024, Fig. 3).",
    )


# ----------------------------------------------------------------------------- η × T heatmaps (Fig. 5/15/16)
HEATMAP_FILE = "eta_T_heatmaps.png"


def eta_t_grids(study_dir: str | Path) -> list[dict[str, Any]]:
    """The η × T grids of a study's grid-search arms, one per (arm label, ε): ``cells`` maps (η, T) to the
    mean selection score over seed replicates (None: none finite), with the grid's guarantee (``covered``:
    the composed ε), the best cell and the linear-scaling arm's r* at the same ε (None without one)."""
    cfg, plan, rows, _ = load_study(study_dir)
    runs = {r["run_id"]: r for r in rows}
    table = {r["arm"]: r for r in study_table(study_dir)}
    configs = {rid: r["config"] for rid, r in runs.items() if r["config"] is not None}
    ls_r: dict[float, float] = {}
    for r in (r for r in table.values() if r["method"] == "linear-scaling"):
        sel = [configs[rid] for rid in r["selected_runs"] if rid in configs]
        if rs := [c["lr"] * c["steps"] for c in sel if "lr" in c and "steps" in c]:
            ls_r[float(r["epsilon"])] = sum(rs) / len(rs)
    grids = []
    for arm in plan.arms:
        if arm.method not in ("oracle", "grid") or not math.isfinite(arm.epsilon):
            continue
        scores: dict[tuple[float, int], list[float]] = {}
        for rid in arm.runs:
            c = configs.get(rid)
            if c is None or "lr" not in c or "steps" not in c:
                break  # not a grid over (η, T)
            s = runs[rid]["score"]
            cell = scores.setdefault((float(c["lr"]), int(c["steps"])), [])
            if runs[rid]["status"] in ("done", "diverged") and s is not None and math.isfinite(s):
                cell.append(float(s))
        else:
            if len(scores) < 2:
                continue  # one configuration: nothing to map (one value per axis is drawn as a strip)
            cells = {k: (sum(v) / len(v) if v else None) for k, v in scores.items()}
            finite = {k: v for k, v in cells.items() if v is not None}
            best = (max if plan.higher_is_better else min)(finite, key=finite.__getitem__, default=None)
            row, eps, selection = table[arm.arm], float(arm.epsilon), cfg.get("selection", {})
            grid = {"label": arm.label, "epsilon": eps, "cells": cells, "best": best, "runs": len(arm.runs)}
            grid |= {"covered": float(row["planned_epsilon"]), "delta": float(row["planned_delta"])}
            grid |= {"per": row["guarantee_per"], "kind": arm.guarantee.get("kind"), "ls_r": ls_r.get(eps)}
            grid |= {"metric": plan.metric, "higher": plan.higher_is_better}
            grids.append(grid | {"mode": selection.get("mode", "public"), "split": selection.get("split", "test")})
    return grids


def eta_t_heatmaps(study_dir: str | Path) -> tuple[FigureRef | None, bool]:
    """Panda et al.'s η × T heatmaps (Fig. 5, 15, 16): one panel per ε (columns) and grid arm (rows), best
    cell outlined. Returns (figure, released): released only when covered at the grid's composed ε, else
    in ``diagnostics/figures``, labelled (docs/privacy.md, ``eta_T_heatmaps.png``)."""
    grids = eta_t_grids(study_dir)
    if not grids:
        return None, False
    # A cell averages the seed replicates: with unaccounted replicates (per "seed replicate") a panel
    # mixes the losing candidates of several procedures, which no single guarantee covers.
    released = all(g["mode"] == "public" and g["kind"] == "composition" and g["per"] == "study" for g in grids)
    labels = list(dict.fromkeys(g["label"] for g in grids))
    epsilons = sorted({g["epsilon"] for g in grids})
    metric = grids[0]["metric"]
    shown: list[float] = [
        c for g in grids for v in g["cells"].values() if v is not None and (c := clip_to_range(v, metric)) is not None
    ]
    lo, hi = (min(shown), max(shown)) if shown else (0.0, 1.0)
    fig = Figure(figsize=(3.3 * len(epsilons) + 1.2, 3.0 * len(labels) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(labels), len(epsilons), squeeze=False)
    im = None
    for i, lab in enumerate(labels):
        for j, eps in enumerate(epsilons):
            ax = axes[i][j]
            g = next((g for g in grids if g["label"] == lab and g["epsilon"] == eps), None)
            if g is None:
                ax.set_axis_off()
                continue
            im = _heatmap_panel(ax, g, lo, hi, released)
            if i == len(labels) - 1:
                ax.set_xlabel("T (steps)", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{lab}\nη (learning rate)", fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=axes, label=metric, shrink=0.8)
    if not released:
        fig.suptitle(NOT_DP_LABEL.upper(), color="red", fontsize=9)
    base = Path(study_dir) / "release" if released else diagnostics_dir(study_dir)
    path = base / "figures" / HEATMAP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return FigureRef(path, _heatmap_caption(grids[0], released)), released


def _heatmap_panel(ax: Any, g: Mapping[str, Any], lo: float, hi: float, released: bool) -> Any:
    """One grid at one ε: every cell's score (η grows downwards, T to the right: Panda's layout)."""
    ts, etas, grid = cell_grid({(t, lr): clip_to_range(v, g["metric"]) for (lr, t), v in g["cells"].items()})
    cmap = "viridis" if g["higher"] else "viridis_r"  # lighter is better either way
    im = ax.imshow(grid, origin="upper", aspect="auto", cmap=cmap, vmin=lo, vmax=hi)
    ax.set_xticks(range(len(ts)), [str(t) for t in ts], fontsize=7)
    ax.set_yticks(range(len(etas)), [f"{e:g}" for e in etas], fontsize=7)
    annotate_cells(ax, grid, lo, hi, g["higher"], fontsize=6.5, missing="—")
    if g["best"] is not None:
        a, b = etas.index(g["best"][0]), ts.index(g["best"][1])
        ax.add_patch(Rectangle((b - 0.5, a - 0.5), 1, 1, fill=False, lw=2, ec="red"))
    best_r = f"best r = η·T = {g['best'][0] * g['best'][1]:.3g}" if g["best"] is not None else "no finite run"
    ls = f"; linear scaling r* = {g['ls_r']:.3g}" if g["ls_r"] is not None else ""
    cover = f"panel covered at ε = {up(g['covered'])} (the grid's runs composed)" if released else NOT_DP_LABEL
    ax.set_title(f"ε = {g['epsilon']:g} per run ({g['runs']} runs)\n{cover}\n{best_r}{ls}", fontsize=7)
    return im


def _heatmap_caption(g0: Mapping[str, Any], released: bool) -> str:
    if not released:
        return (
            f"{NOT_DP_LABEL}: η × T heatmaps of every run's selection score under private selection; the losing "
            "candidates' scores are not covered by the guarantee of a private selection. Do not publish."
        )
    scope = "per seed replicate" if g0["per"] == "seed replicate" else "for the whole study"
    return (
        f"η × T heatmaps per ε (Panda et al. 2024, Fig. 5/15/16): the selection score on the public "
        f"{g0['split']} split of every run of each grid arm (mean over seed replicates), one panel per ε, best "
        "cell outlined, lighter is better; the title gives the best cell's r = η·T and the r* the linear-scaling "
        "arm selected at that ε. Privacy: every run alone is (ε, δ)-DP at its panel's ε, but a panel shows "
        "every run of its grid, losing ones included, so it is covered only at the composition of the grid's "
        f"runs: the ε stated in the panel (δ = {g0['delta']:g}, {scope}), which the oracle's note gives as its "
        "honest total — not at the panel's ε; the panels together, at the composition of all their grids."
    )


def report_figures(study_dir: str | Path) -> list[FigureRef]:
    """The panda presets' extra figures for a part's release report: r = η·T vs ε (Fig. 3) and, when covered
    (public selection), the η × T heatmaps per ε (Fig. 5/15/16; else in ``diagnostics/figures`` only)."""
    study_dir = Path(study_dir)
    ref = r_vs_epsilon_figure(study_dir, study_dir / "release" / "figures" / "r_vs_epsilon.png")
    heat, released = eta_t_heatmaps(study_dir)
    return [f for f in (ref, heat if released else None) if f is not None]
