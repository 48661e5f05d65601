"""Panda, Tang, Mahloujifar, Sehwag & Mittal (ICML 2024), "A New Linear Scaling Rule for
Private Adaptive Hyperparameter Optimization".

The rule (Alg. 2–3): with full-batch DP-GD (momentum 0.9, unit clipping; Table 1), search the
total step size r = η·T with ``runs_per_sweep`` = 3 random runs at each of two small budgets
(ε₁ = 0.1, ε₂ = 0.2), fit r linearly in ε through the two best points, and spend what is left
of the budget on one final run at the extrapolated r. The whole procedure is accounted as
one μ-GDP composition, μ = √(n·μ₁² + n·μ₂² + μ_f²) (App. A.7), at δ = 10⁻⁵.

Every study here holds three arms on the same search space, so the report can compute
Panda's relative error-rate reduction (RERR, Table 3):

* ``linear-scaling`` — the rule;
* ``random-search`` — one random (η, T) at the full ε (Panda's random-search baseline, n = 1);
* ``grid-oracle`` — a grid whose runs are each (ε, δ)-DP, the HPO cost *not* counted (Panda's
  "grid search" oracle; the honest composed ε is stated in the notes).

Presets: ``panda-linear-scaling-mnist`` trains a CNN from scratch (the Galli CNN: the
registry's MNIST CNN; zero initialisation is for linear probes only), and
``panda-linear-scaling-text`` trains zero-initialised, bias-free linear probes on fixed
all-MiniLM-L6-v2 sentence embeddings of AG News and Enron1 (two parts). Both plot r = η·T
against ε: the sweep points, the fitted line, the extrapolated r* and the oracle's r.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dptune.presets._common import Part, study_dict
from dptune.report.html import FigureRef

DELTA = 1e-5

MNIST: dict[str, dict[str, Any]] = {
    "paper": {
        "limit": None,
        "lr": (0.01, 4.0),
        "steps": (20, 200),
        "grid_lr": [0.03, 0.1, 0.3, 1.0, 3.0],
        "grid_steps": [25, 50, 100, 200],
        "epsilons": [0.5, 1.0, 2.0],
        "seeds": [0, 1, 2],
        "sweeps": [0.1, 0.2],
    },
    "small": {
        "limit": 1500,
        "lr": (0.05, 2.0),
        "steps": (5, 30),
        "grid_lr": [0.1, 1.0],
        "grid_steps": [10, 30],
        "epsilons": [2.0, 8.0],
        "seeds": [0],
        "sweeps": [0.2, 0.4],
    },
    "smoke": {
        "limit": 100,
        "lr": (0.05, 1.0),
        "steps": (2, 4),
        "grid_lr": [0.1, 1.0],
        "grid_steps": [3],
        "epsilons": [1.0],
        "seeds": [0],
        "sweeps": [0.1, 0.2],
    },
}
TEXT: dict[str, dict[str, Any]] = {
    "paper": {
        "limit": None,
        "lr": (0.05, 5.0),
        "steps": (10, 200),
        "grid_lr": [0.1, 0.3, 1.0, 3.0],
        "grid_steps": [25, 50, 100, 200],
        "epsilons": [0.5, 1.0, 2.0, 4.0],
        "seeds": [0, 1, 2],
        "sweeps": [0.1, 0.2],
    },
    "small": {
        "limit": 3000,
        "lr": (0.05, 5.0),
        "steps": (10, 200),
        "grid_lr": [0.1, 0.3, 1.0, 3.0],
        "grid_steps": [25, 50, 100, 200],
        "epsilons": [0.5, 1.0, 2.0, 4.0],
        "seeds": [0, 1, 2],
        "sweeps": [0.1, 0.2],
    },
    "smoke": {
        "limit": 40,
        "lr": (0.1, 2.0),
        "steps": (2, 6),
        "grid_lr": [0.3, 1.0],
        "grid_steps": [4],
        "epsilons": [1.0],
        "seeds": [0],
        "sweeps": [0.1, 0.2],
    },
}
TEXT_DATASETS = {"agnews": ("ag_news", "AG News"), "enron": ("enron_spam", "Enron1 spam")}


def _arms(s: Mapping[str, Any], fixed: Mapping[str, Any]) -> list[dict[str, Any]]:
    space = {"lr": {"log_uniform": list(s["lr"])}, "steps": {"int_uniform": list(s["steps"])}}
    return [
        {
            "name": "dpgd",
            "label": "linear-scaling",
            "space": space,
            "fixed": dict(fixed),
            "method": {
                "name": "linear-scaling",
                "sweep_epsilons": list(s["sweeps"]),
                "runs_per_sweep": 3,
                "fit": "linear",
                "fit_axis": "epsilon",
                "r_sampling": "uniform",
                "final_steps": "max",
            },
        },
        {
            "name": "dpgd",
            "label": "random-search",
            "space": space,
            "fixed": dict(fixed),
            "method": {"name": "random", "n": 1},
        },
        {
            "name": "dpgd",
            "label": "grid-oracle",
            "space": {"lr": list(s["grid_lr"]), "steps": list(s["grid_steps"])},
            "fixed": dict(fixed),
            "method": {"name": "oracle"},
        },
    ]


def _study(
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
        method={"name": "grid"},
        # Panda evaluate the final model (with DP-GD's free step along the momentum buffer).
        selection={"mode": "public", "split": "test", "checkpoint": "final", "across_seeds": "per-seed"},
        strategies=_arms(s, fixed),
        seeds=s["seeds"],
    )


def build_mnist(scale: str, options: Mapping[str, Any]) -> list[Part]:
    s = MNIST[scale]
    fixed = {"clip": 1.0, "momentum": 0.9, "zero_init": False}
    study = _study(f"panda-linear-scaling-mnist-{scale}", {"name": "mnist"}, {"name": "galli_cnn"}, s, fixed)
    notes = (
        f"full-batch DP-GD (momentum 0.9, C = 1), CNN from scratch; sweeps at ε ∈ {s['sweeps']}, "
        f"targets ε ∈ {s['epsilons']}, δ = {DELTA:g}, μ-GDP accounting.",
    )
    return [Part("study", "MNIST, CNN from scratch (full-batch DP-GD, linear scaling)", study, notes)]


def build_text(scale: str, options: Mapping[str, Any]) -> list[Part]:
    s = TEXT[scale]
    fixed = {"clip": 1.0, "momentum": 0.9, "zero_init": True}
    parts = []
    for key, (dataset, title) in TEXT_DATASETS.items():
        data = {"name": dataset, "options": {"representation": "minilm"}}
        model = {"name": "linear_probe", "options": {"zero_init": True, "bias": False}}
        study = _study(f"panda-linear-scaling-{key}-{scale}", data, model, s, fixed)
        notes = (
            f"zero-initialised linear probe without bias on all-MiniLM-L6-v2 embeddings (384-d), full-batch "
            f"DP-GD; sweeps at ε ∈ {s['sweeps']}, targets ε ∈ {s['epsilons']}, δ = {DELTA:g}.",
        )
        parts.append(Part(key, f"{title}, MiniLM features + linear probe (linear scaling)", study, notes))
    return parts


def r_vs_epsilon_figure(study_dir: str | Path, path: str | Path) -> FigureRef | None:
    """r = η·T against ε (Panda Fig. 3): each procedure's sweep points and fitted line, the
    extrapolated r* at its final run's ε, and the r the grid oracle selected at each target ε."""
    from matplotlib.figure import Figure

    from dptune.tune.results import study_table
    from dptune.tune.store import Store

    rows = study_table(study_dir)
    with Store(study_dir) as store:
        configs = {r["run_id"]: json.loads(r["config"]) for r in store.runs() if r["config"]}
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    drawn = False
    for r in rows:
        if r["method"] == "linear-scaling":
            for fit in r.get("fits") or []:
                if not fit:
                    continue
                pts = fit["points"]
                lab = "sweep best r" if not drawn else None
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", s=18, label=lab)
                if fit.get("coef"):
                    xs = [min(p[0] for p in pts), fit["x_final"]]
                    a, b = fit["coef"][0], fit["coef"][-1]
                    ax.plot(
                        xs,
                        [a * x + b for x in xs],
                        color="tab:blue",
                        lw=0.8,
                        alpha=0.6,
                        label="linear fit" if not drawn else None,
                    )
                ax.scatter(
                    [fit["x_final"]],
                    [fit["r_star"]],
                    marker="*",
                    s=90,
                    color="tab:red",
                    label=("r* (final run, at its own ε_f)" if not drawn else None),
                    zorder=3,
                )
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
    ax.set_xlabel("ε")
    ax.set_ylabel("r = η · T")
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
