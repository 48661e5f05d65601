"""What a team reads first in a study's report: the selected model with its guarantee, its learning curve
and what was tried; candidates' scores stay in the diagnostics (docs/privacy.md)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dptune.outputs import epsilon_text, hides_run_count, public_run_name, up
from dptune.report.data import RunHistory
from dptune.report.html import Section, Table
from dptune.tune.results import metric_text, private_rows


def learning_curves(runs: Sequence[Any], arm_of: Mapping[str, Any], selected: set[str]) -> list[RunHistory]:
    """The selected runs' selection-split scores over training (their stored evaluations)."""
    out = []
    for r in (r for r in runs if r["run_id"] in selected and r["evals"]):
        rows = [{"step": e["step"], "score": e["score"]} for e in json.loads(r["evals"]) if e.get("score") is not None]
        arm = arm_of[r["arm"]]
        out.append(RunHistory(public_run_name(arm, r), arm.label, rows, selected=True, epsilon=float(arm.epsilon)))
    return out


def selected_model_section(table: Sequence[Mapping[str, Any]], metric: str, split: str, use_test: bool) -> Section:
    """One paragraph per private procedure: selected configuration, metric, guarantee, model."""
    said = []
    for r in private_rows(table):
        m, s = (r["test_mean"], r["test_std"]) if use_test else (r["value_mean"], r["value_std"])
        where = "test split" if use_test else f"{split} split (selection score)"
        # Where the selection averages seeds of which one is accounted: the ε that covers what it chose.
        e = r.get("selection_epsilon", r["planned_epsilon"])
        covers = f"; the selection averages every seed: ε = {epsilon_text(e)} covers it"
        note = "" if e == r["planned_epsilon"] else covers
        said.append(
            f"{r['strategy']} ({r['method']}) at ε = {epsilon_text(r['epsilon'])}: {r['selected'] or 'no selection yet'}; "
            f"{metric} {metric_text(m, s, metric)} on the {where}. Guarantee: (ε, δ) = "
            f"({epsilon_text(r['planned_epsilon'])}, {up(r['planned_delta'])}) for the whole search, per "
            f"{r['guarantee_per']} (accountant {r['accountant']}); spent ε = {epsilon_text(r['spent_epsilon'])}"
            f"{note}. Model and card: release/models/{r['arm']}/ (`dptune export`, once the study is finished)."
        )
    return Section("Selected model", paragraphs=said or ["No procedure has selected a model yet."])


def tried_section(cfg: Mapping[str, Any], plan: Any) -> Section:
    """What was tried, from the public plan: each private procedure's space, runs (unless secret) and ν."""
    spaces = {s.get("label") or s["name"]: s for s in cfg.get("strategies", [])}
    rows = []
    for a in plan.arms:
        if a.epsilon == float("inf"):
            continue  # the non-private baseline: diagnostics only
        spec = spaces.get(a.label, {})
        grid = ", ".join(f"{k} ∈ {v}" for k, v in sorted(spec.get("space", {}).items()))
        fixed = ", ".join(f"{k}={v}" for k, v in sorted(spec.get("fixed", {}).items()))
        hidden = hides_run_count(a.guarantee.get("kind"))
        if hidden or not a.runs:
            # A hidden-K search's first run is a secret draw (maybe a losing one; none when K = 0): the selected
            # run's T and ν are on its model card.
            count, steps, nu = "secret (K)" if hidden else "—", "per candidate", "per candidate"
        else:
            run = plan.runs[a.runs[0]]  # the plan's first run: its T and ν
            count, steps = a.guarantee.get("runs_accounted", "—"), run.steps
            nu = f"{run.noise_multiplier:.4g}" if run.noise_multiplier is not None else "—"
        rows.append([a.label, epsilon_text(a.epsilon), a.method, grid or "defaults", fixed or "—", count, steps, nu])
    caption = (
        "The search space and plan of each procedure (data-independent). The score of every configuration "
        "tried is for the data owner only: `dptune report DIR --include-diagnostics` (diagnostics/report.html)."
    )
    columns = ["strategy", "ε", "method", "searched", "fixed", "runs", "steps T", "ν (first run)"]
    return Section("What was tried", tables=[Table(columns, rows, caption)])
