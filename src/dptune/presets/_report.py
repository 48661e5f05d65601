"""A stored study directory → ``dptune.report.build_report`` (figures, CSVs, one HTML page).

``dptune.report`` takes plain rows and never reads the tuner's store; ``dptune.tune.results``
reads the store and prints tables; this module joins the two for the presets. Results show the
*selected* configuration (what the honest procedure chose, not hindsight's best). The page, its
figures and the release CSVs go to ``<out>/release/``; the per-run ledger, the full histories and
the notes of Liu–Talwar / repeat-and-select arms (they state K) to ``<out>/diagnostics/``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dptune.outputs import hides_run_count, public_run_name, split_arm_notes
from dptune.report import LinearScalingFit, RunHistory, build_report
from dptune.report.html import FigureRef, Section
from dptune.report.study import (
    arm_costs,
    budget_entries,
    conclusions,
    display_table,
    every_configuration,
    every_run_section,
    grid_heatmaps,
    heatmap_section,
    oso_joint_noise,
    randomness_note,
    read_study,
    study_ledger_rows,
    write_runs_csv,
)

MAX_HISTORIES = 40


def _results(table: list[dict[str, Any]], runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The results table: one row per (strategy, ε), its selected configuration."""
    return [
        {
            "strategy": r["strategy"],
            "epsilon": r["epsilon"],
            "hyperparameters": r["selected"] or "—",
            "mean": r["value_mean"],
            "std": r["value_std"],
            "n_seeds": max(1, r["replicates"]),
            # the selected runs only: the arm's count covers the losing candidates
            "n_diverged": sum(1 for rid in r["selected_runs"] if runs.get(rid, {}).get("status") == "diverged"),
            "selected": True,
        }
        for r in table
        if r["value_mean"] is not None or r["runs_done"]
    ]


def _histories(table: list[dict[str, Any]], runs: dict[str, dict[str, Any]], arm_of: Any) -> list[RunHistory]:
    """Trajectories of the selected runs (two per row at most: every run would be unreadable)."""
    histories: list[RunHistory] = []
    for r in table:
        for rid in r["selected_runs"][:2]:
            h = runs.get(rid, {}).get("history")
            if h and len(histories) < MAX_HISTORIES:
                name = public_run_name(arm_of[r["arm"]], runs[rid])
                histories.append(RunHistory(name, r["strategy"], json.loads(h), epsilon=float(r["epsilon"])))
    return histories


def _linear_fit(table: list[dict[str, Any]]) -> LinearScalingFit | None:
    """The r = η·T fit of the last linear-scaling procedure (Panda Fig. 3), if any."""
    linear = None
    for r in table:
        for fit in r.get("fits") or []:
            if fit and fit.get("coef") and len(fit["coef"]) == 2:
                slope, intercept = (float(c) for c in fit["coef"])
                points = [tuple(p) for p in fit["points"]]
                axis = fit.get("axis", "epsilon")
                linear = LinearScalingFit(points, slope, intercept, float(fit["x_final"]), None, axis)
    return linear


def study_report(
    study_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    title: str | None = None,
    subtitle: str = "",
    notes: Sequence[str] = (),
    extra_figures: Sequence[FigureRef] = (),
    extra_sections: Sequence[Section] = (),
    include_diagnostics: bool = False,
) -> Path:
    """Write ``<out_dir or study_dir>/release/report.html`` (+ figures/ and CSVs) and the
    diagnostics folder beside it for a stored study; return the HTML path."""
    d = Path(study_dir)
    out = Path(out_dir) if out_dir is not None else d
    cfg, plan, rows, entries, table, per_run, arm_of = read_study(d)
    runs = {r["run_id"]: r for r in rows}
    label_of = {a.arm: a.label for a in plan.arms}
    sel = cfg.get("selection", {})

    def _name(a: Any) -> str:
        return f"{label_of.get(a.arm, a.arm)} @ {a.arm.split('@')[-1]}"

    # Notes of LT/RS arms state K (runs drawn): diagnostics; the release says K is secret.
    arm_notes, secret_notes = split_arm_notes(plan.arms, _name)
    accountants = sorted({a.accountant for a in plan.arms if a.accountant != "none"})
    hidden_k = any(hides_run_count(a.guarantee.get("kind")) for a in plan.arms)
    heatmaps = (
        grid_heatmaps(list(runs.values()), arm_of, out, plan.metric, plan.higher_is_better)
        if include_diagnostics
        else []
    )
    if heatmaps:
        extra_sections = [*extra_sections, heatmap_section(heatmaps)]
    # Every run and every configuration: diagnostics, as in ``dptune report`` (report_study).
    runs_section = every_run_section(table, write_runs_csv(out, list(runs.values()), arm_of))
    # The selection score, as in this page's results table.
    every = every_configuration(
        list(runs.values()),
        arm_of,
        {rid for r in table for rid in r["selected_runs"]},
        use_test=False,
        name=lambda a: a.label,
    )
    return build_report(
        out,
        _results(table, runs),
        _histories(table, runs, arm_of),
        study_ledger_rows(plan, entries, per_run),
        selection_mode=sel.get("mode", "public"),
        selection_split=sel.get("split"),
        planned=None,
        spent=None,
        metric=plan.metric,
        higher_is_better=plan.higher_is_better,
        title=title or cfg.get("study", {}).get("name", "study"),
        subtitle=subtitle,
        accountant=", ".join(accountants) or None,
        budgets=budget_entries(table),
        notes=[*notes, *dict.fromkeys(arm_notes), randomness_note(cfg)],
        pareto=oso_joint_noise(plan) or None,
        linear_scaling=_linear_fit(table),
        conclusions=conclusions(
            display_table(table, plan.metric), arm_costs(plan), plan.higher_is_better, plan.metric, hidden_k
        ),
        extra_figures=extra_figures,
        extra_sections=extra_sections,
        diagnostic_notes=list(dict.fromkeys(secret_notes)),
        include_diagnostics=include_diagnostics,
        diagnostic_sections=[runs_section],
        all_results=every,
    )
