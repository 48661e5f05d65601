"""``report_study(study_dir)``: the report of a study stored by ``dptune.tune``.

A thin adapter: it reads the study directory (``study.sqlite``) through the tuner's own
readers (``study_table``, ``budget_rows``, ``Store``) and hands plain rows to
``build_report``. The tuner is the authority on what was selected and what was spent;
the report never re-selects.

What is shown:

* results: per (strategy, ε) the configuration the tuner selected, its metric on the
  test split (mean ± std over seed replicates; the selection score when the study has no
  test metric);
* the tuner's selection table (selection score and test metric, runs, planned and spent);
* C_t and ρ_t of the selected runs (of every run for studies of at most 24 runs);
* the ledger: each run's ε alone and the releases per query label;
* OSO arms: the ν_g–ν_q Pareto front at the arms' ν; Liu–Talwar arms: LT vs MA cost for
  that run geometry; linear-scaling arms: the fit of r = η·T of the first procedure.

Release vs diagnostics (``dptune.report.privacy``): ``<out>/release/`` shows the selected
configurations, their metrics, the budgets, the selected runs' C_t/ρ_t (named by procedure
and replicate, never by run id: the id numbers the candidates) and the plan-derived figures.
Every run, the per-run ledger, run counts, diverged counts over all candidates and the notes
of Liu–Talwar / repeat-and-select arms (they state K, the number of runs drawn) go to
``<out>/diagnostics/``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from dptune.report.build import build_report
from dptune.report.data import LedgerRow, LinearScalingFit, RunHistory, SummaryRow
from dptune.report.html import FigureRef, Section, Table
from dptune.report.privacy import (
    RELEASE_DIR,
    diagnostics_dir,
    hides_run_count,
    public_run_name,
    split_arm_notes,
    write_labelled_csv,
)

MAX_ALL_HISTORIES = 24


def report_study(study_dir: str | Path, out_dir: str | Path | None = None, *, title: str | None = None,
                 include_diagnostics: bool = False) -> Path:
    """Write the report of a stored study; return the path of ``<out>/release/report.html``.

    ``out_dir`` defaults to ``study_dir``: the publishable page, figures and CSVs go to
    ``<out>/release/``, the diagnostics (labelled "not differentially private: for the data
    owner only") to ``<out>/diagnostics/``; ``include_diagnostics=True`` also writes the page
    ``<out>/diagnostics/report.html`` with the diagnostics under a red banner. Works on an
    unfinished study too.
    """
    from dptune.report import figures as F
    from dptune.tune import theory
    from dptune.tune.planners import StudyPlan
    from dptune.tune.results import budget_rows, study_table
    from dptune.tune.store import Store

    study_dir = Path(study_dir)
    out = Path(out_dir) if out_dir is not None else study_dir
    with Store(study_dir) as store:  # raises ConfigError naming the fix if there is no study
        cfg = store.get_meta("config") or {}
        plan = StudyPlan.from_dict(store.get_meta("plan"))
        runs = [dict(r) for r in store.runs()]
        entries = store.ledger_entries()
    table = study_table(study_dir)
    per_run, _ = budget_rows(study_dir)
    arm_of = {a.arm: a for a in plan.arms}
    sel = cfg.get("selection", {})
    metric = plan.metric

    # -- results: the tuner's selection, metric on the test split where there is one
    has_test = any(r["test_mean"] is not None for r in table)
    summary = []
    for r in table:
        mean, std = (r["test_mean"], r["test_std"]) if has_test else (r["value_mean"], r["value_std"])
        summary.append(SummaryRow(
            r["strategy"] if r["method"] in ("grid", "online") else f"{r['strategy']} ({r['method']})",
            float(r["epsilon"]), r["selected"] or "—", mean, std, int(r["replicates"]), 0, True,
        ))

    hidden_k = any(hides_run_count(a.guarantee.get("kind")) for a in plan.arms)

    # -- histories: the selected runs (release, named without their run id); every run of a
    # small study for the diagnostics
    selected = {rid for r in table for rid in r["selected_runs"]}
    wanted = set(selected)
    if len(runs) <= MAX_ALL_HISTORIES:
        wanted = {r["run_id"] for r in runs}
    histories = [
        RunHistory(public_run_name(arm_of[r["arm"]], r) if r["run_id"] in selected else r["run_id"],
                   arm_of[r["arm"]].label, json.loads(r["history"]), selected=r["run_id"] in selected)
        for r in runs if r["run_id"] in wanted and r["history"]
    ]

    # -- ledger rows: releases per (run, label); each run's ε alone from the tuner
    eps_alone = {r["run_id"]: r["epsilon_alone"] for r in per_run}
    releases: dict[tuple[str, str], int] = defaultdict(int)
    for e in entries:
        releases[(e.run, e.label)] += e.count
    ledger_rows = [
        LedgerRow(rid, label, n, eps_alone.get(rid), None, _finite(plan.runs[rid].noise_multiplier),
                  plan.runs[rid].sampling_rate)
        for (rid, label), n in releases.items()
    ]

    # -- budgets: one row per tuning procedure family (arm)
    budgets = [
        {"label": f"{r['strategy']} @ ε = {r['epsilon']:g} ({r['method']})",
         "planned": (r["planned_epsilon"], r["planned_delta"]), "spent": (r["spent_epsilon"], r["spent_delta"]),
         "note": f"per {r['guarantee_per']}, accountant {r['accountant']}"}
        for r in table
    ]

    # -- method figures
    pareto = {}
    lt_rows = None
    extra: list[FigureRef] = []
    for arm in plan.arms:
        nus = [plan.runs[rid].noise_multiplier for rid in arm.runs]
        nus = [v for v in nus if v is not None and math.isfinite(v) and v > 0]
        if arm.strategy == "oso" and nus and math.isfinite(arm.epsilon):
            pareto.setdefault(float(arm.epsilon), float(nus[0]))
        if arm.method == "liu-talwar" and lt_rows is None and nus:
            run = plan.runs[arm.runs[0]]
            lt_rows = list(theory.lt_vs_ma(plan.n_train, float(nus[0]), run.sampling_rate * plan.n_train,
                                           run.steps, ks=range(1, 41), delta=arm.delta).rows)
        if arm.method == "linear-scaling":
            fit = next((json.loads(r["fit"]) for r in runs if r["arm"] == arm.arm and r["fit"]
                        and plan.runs[r["run_id"]].procedure == 0), None)
            if fit and fit.get("points"):
                coef = fit.get("coef")
                lsf = LinearScalingFit(
                    [tuple(p) for p in fit["points"]],
                    slope=coef[-2] if coef and len(coef) >= 2 else 0.0,
                    intercept=coef[-1] if coef else float(fit.get("r_star", 0.0)),
                    target_epsilon=fit.get("x_final"),
                    coefficients=coef if coef and len(coef) > 2 else None,
                    axis="mu" if fit.get("axis") == "mu" else "epsilon",
                )
                safe = arm.arm.replace("/", "_").replace("@", "_at_").replace("=", "")
                p = F.linear_scaling(lsf, out / RELEASE_DIR / "figures" / f"linear_scaling_{safe}.png",
                                     title=f"Linear scaling rule: {arm.label} @ ε = {arm.epsilon:g}")
                extra.append(FigureRef(p, f"{arm.label} @ ε = {arm.epsilon:g}: r = η·T of the best sweep runs, "
                                          f"the fit ({fit.get('how', 'fit')}) and r* = {fit.get('r_star', math.nan):.4g} "
                                          "used by the final run (Panda et al. 2024, Fig. 3)."))

    # -- the tuner's own table and every run: diagnostics (counts of runs reveal K under LT/RS)
    runs_csv = write_labelled_csv(diagnostics_dir(out) / "runs.csv", [
        {"run_id": r["run_id"], "arm": r["arm"], "strategy": arm_of[r["arm"]].label, "epsilon": arm_of[r["arm"]].epsilon,
         "stage": r["stage"], "procedure": r["procedure"], "replicate": r["replicate"], "seed": r["seed"],
         "status": r["status"], "config": r["config"], "noise_multiplier": r["noise_multiplier"], "steps": r["steps"],
         "sampling_rate": r["sampling_rate"], "score": r["score"], "best_step": r["best_step"],
         "test_metric": r["test_metric"], "seconds": r["seconds"]}
        for r in runs
    ])
    tuner_table = Table(
        ["strategy", "ε", "method", "selected configuration", "selection score", "test"],
        [[r["strategy"], r["epsilon"], r["method"], r["selected"] or "—", _pm(r["value_mean"], r["value_std"]),
          _pm(r["test_mean"], r["test_std"])] for r in table],
        caption="[k/P]: the configuration was selected by k of the P seed replicates (per-seed selection).",
    )
    runs_table = Table(
        ["strategy", "ε", "method", "runs", "diverged", "failed"],
        [[r["strategy"], r["epsilon"], r["method"], f"{r['runs_done']}/{r['runs_total']}", r["diverged"],
          r["failed"]] for r in table],
        caption="Runs per tuning procedure (under Liu–Talwar / repeat-and-select their number is secret).",
    )
    done = sum(1 for r in runs if r["status"] in ("done", "diverged"))
    notes, secret_notes = split_arm_notes(plan.arms)
    paragraphs = [
        f"Selection on the {sel.get('split', 'test')} split, across seeds: {sel.get('across_seeds', 'per-seed')}. "
        + ("The results above show the metric on the test split of the selected configurations."
           if has_test else "The results above show the selection score of the selected configurations."),
    ]
    if sel.get("mode") == "private":
        paragraphs.append(f"Private selection: every selection score was released with Gaussian noise "
                          f"(σ = {sel.get('noise_multiplier')} on its sum), so selection scores are noisy and "
                          "may fall outside the metric's range.")
    # The randomness mode (issue 10, item 3): secure (OS CSPRNG) or seeded (the seeds are a secret key).
    from dptune.train import randomness_statement

    paragraphs.append("Randomness: " + randomness_statement(bool(cfg.get("study", {}).get("secure")))["randomness_note"])
    sections = [Section("Tuner's selection table", paragraphs=paragraphs + notes, tables=[tuner_table])]
    dsections = [Section("Every run", paragraphs=secret_notes, tables=[runs_table], attachments=[runs_csv],
                         diagnostic=True)]
    status = [] if done == len(runs) else (
        ["The study is not finished: the results cover the runs done so far."] if hidden_k
        else [f"The study is not finished: {done} of {len(runs)} runs are done."])
    subtitle = f"{len(plan.arms)} tuning procedures, " + ("" if hidden_k else f"{len(runs)} runs, ")

    return build_report(
        out, summary, histories, ledger_rows,
        selection_mode=sel.get("mode", "public"), selection_split=sel.get("split"),
        planned=None, spent=None, budgets=budgets,
        metric=metric, higher_is_better=plan.higher_is_better,
        title=title or f"Study report: {cfg.get('study', {}).get('name') or study_dir.name}",
        subtitle=f"{subtitle}n_train = {plan.n_train}",
        notes=status, pareto=pareto or None, lt_ma=lt_rows, extra_figures=extra, extra_sections=sections,
        diagnostic_sections=dsections, include_diagnostics=include_diagnostics,
    )


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _pm(m: Any, s: Any) -> str:
    if m is None:
        return "—"
    return f"{m:.4g} ± {s:.2g}" if s is not None else f"{m:.4g}"
