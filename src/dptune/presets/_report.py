"""A stored study directory → ``dptune.report.build_report`` for the presets (``report`` never reads the
store; ``tune.results`` does). Results show the *selected* configuration; what goes to ``release/`` and
``diagnostics/``: docs/reports.md."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dptune.outputs import public_run_name, split_arm_notes
from dptune.report import LinearScalingFit, RunHistory, build_report
from dptune.report.html import FigureRef, Section
from dptune.report.study import (
    every_configuration,
    every_run_section,
    randomness_note,
    read_study,
    study_heatmaps,
    study_inputs,
    write_runs_csv,
)

MAX_HISTORIES = 40


def _results(table: list[dict[str, Any]], runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The results table: one row per (strategy, ε), its selected configuration."""
    return [
        {"strategy": r["strategy"], "epsilon": r["epsilon"], "hyperparameters": r["selected"] or "—", "selected": True}
        | {"mean": r["value_mean"], "std": r["value_std"], "n_seeds": max(1, r["replicates"])}
        # the selected runs only: the arm's count covers the losing candidates
        | {"n_diverged": sum(1 for rid in r["selected_runs"] if runs.get(rid, {}).get("status") == "diverged")}
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
    fits = [f for r in table for f in r.get("fits") or [] if f and f.get("coef") and len(f["coef"]) == 2]
    if not fits:
        return None
    slope, intercept = (float(c) for c in fits[-1]["coef"])
    points = [tuple(p) for p in fits[-1]["points"]]
    return LinearScalingFit(points, slope, intercept, float(fits[-1]["x_final"]), None, fits[-1].get("axis", "epsilon"))


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
    """Write a stored study's ``release/report.html`` (+ figures, CSVs) and diagnostics; return the HTML path."""
    d = Path(study_dir)
    out = Path(out_dir) if out_dir is not None else d
    s = read_study(d)
    cfg, plan, table, arm_of = s.cfg, s.plan, s.table, s.arm_of
    runs = {r["run_id"]: r for r in s.runs}
    # Notes of LT/RS arms state K (runs drawn): diagnostics; the release says K is secret.
    arm_notes, secret_notes = split_arm_notes(plan, lambda a: f"{a.label} @ {a.arm.split('@')[-1]}")
    # Every run and every configuration: diagnostics, as in ``dptune report`` (report_study).
    inputs = study_inputs(
        s,
        _results(table, runs),
        histories=_histories(table, runs, arm_of),
        title=title or cfg.get("study", {}).get("name", "study"),
        subtitle=subtitle,
        accountant=", ".join(sorted({a.accountant for a in plan.arms if a.accountant != "none"})) or None,
        notes=[*notes, *dict.fromkeys(arm_notes), randomness_note(cfg)],
        linear_scaling=_linear_fit(table),
        extra_figures=extra_figures,
        extra_sections=[*extra_sections, *(study_heatmaps(s, out) if include_diagnostics else [])],
        diagnostic_notes=list(dict.fromkeys(secret_notes)),
        diagnostic_sections=[every_run_section(table, write_runs_csv(out, s.runs, arm_of))],
        # the selection score, as in this page's results table
        all_results=every_configuration(s.runs, arm_of, s.chosen, use_test=False, name=lambda a: a.label),
    )
    return build_report(out, inputs, include_diagnostics=include_diagnostics)
