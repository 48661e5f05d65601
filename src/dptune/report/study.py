"""``report_study(study_dir)``: a thin adapter from a stored study (the tuner's own readers) to
``build_report``; the tuner is the authority on what was selected and spent, the report never re-selects.
What goes to ``release/`` vs ``diagnostics/``: docs/reports.md."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from dptune.metrics import better, clip_to_range, finite_number, mean_std
from dptune.outputs import (
    RELEASE_DIR,
    diagnostics_dir,
    epsilon_text,
    hides_run_count,
    note_report_files,
    public_run_name,
    randomness_statement,
    release_files,
    split_arm_notes,
    write_labelled_csv,
)
from dptune.report import figures as F
from dptune.report.build import ReportInputs, build_report, nu_q
from dptune.report.data import LedgerRow, LinearScalingFit, RunHistory, SummaryRow
from dptune.report.html import FigureRef, Section, Table
from dptune.report.summary import learning_curves, selected_model_section, tried_section
from dptune.tune import theory
from dptune.tune.methods import get_method
from dptune.tune.records import StudyPlan
from dptune.tune.results import budget_rows, load_study, metric_text, private_rows, release_note, study_table
from dptune.tune.space import config_key

MAX_ALL_HISTORIES = 24


class StudyRows(NamedTuple):
    """A stored study as the reports read it, through the tuner's own readers (``tune.results``)."""

    cfg: dict[str, Any]
    plan: StudyPlan
    runs: list[dict[str, Any]]  # config and fit parsed
    entries: list[Any]  # the ledger
    table: list[dict[str, Any]]  # study_table
    per_run: list[dict[str, Any]]  # budget_rows
    arm_of: dict[str, Any]  # arm id → ArmPlan

    @property
    def hides_k(self) -> bool:
        """Does an arm's guarantee need the number of runs K kept secret (Liu–Talwar, repeat-and-select)?"""
        return any(hides_run_count(a.guarantee.get("kind")) for a in self.plan.arms)

    @property
    def chosen(self) -> set[str]:
        """The selected runs of every arm, the non-private baseline's too (diagnostics)."""
        return {rid for r in self.table for rid in r["selected_runs"]}


def read_study(study_dir: Path) -> StudyRows:
    """Read ``study_dir``; raises ConfigError naming the fix if there is no study."""
    cfg, plan, runs, entries = load_study(study_dir)
    per_run, _ = budget_rows(study_dir)
    return StudyRows(cfg or {}, plan, runs, entries, study_table(study_dir), per_run, {a.arm: a for a in plan.arms})


def study_inputs(s: StudyRows, results: Sequence[Any], **fields: Any) -> ReportInputs:
    """What every report of a stored study shows alike (one budget per private procedure); ``fields``: the rest."""
    sel, plan = s.cfg.get("selection", {}), s.plan
    # selection scores clipped to the metric's range (noisy private scores can leave it; post-processing)
    table = [{**r, "value_mean": clip_to_range(r.get("value_mean"), plan.metric)} for r in private_rows(s.table)]
    return ReportInputs(
        results,
        selection_mode=sel.get("mode", "public"),
        selection_split=sel.get("split"),
        planned=None,
        spent=None,
        ledger=study_ledger_rows(plan, s.entries, s.per_run),
        budgets=[  # one per private procedure: planned vs spent (ε, δ), scope, accountant
            {"label": f"{r['strategy']} @ ε = {epsilon_text(r['epsilon'])} ({r['method']})"}
            | {"planned": (r["planned_epsilon"], r["planned_delta"]), "spent": (r["spent_epsilon"], r["spent_delta"])}
            | {"note": f"per {r['guarantee_per']}, accountant {r['accountant']}", "accountant": r["accountant"]}
            for r in private_rows(s.table)
        ],
        metric=plan.metric,
        higher_is_better=plan.higher_is_better,
        conclusions=conclusions(table, arm_costs(plan), plan.higher_is_better, plan.metric, s.hides_k),
        pareto=oso_joint_noise(plan) or None,
        whole=release_note(plan),
        **fields,
    )


def report_study(
    study_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    title: str | None = None,
    include_diagnostics: bool = False,
) -> Path:
    """Write the report of a stored study (finished or not); return ``<out>/release/report.html``. ``out_dir`` defaults
    to ``study_dir``; ``include_diagnostics=True`` also writes ``<out>/diagnostics/report.html``."""
    study_dir = Path(study_dir)
    out = Path(out_dir) if out_dir is not None else study_dir
    before = release_files(out)  # what the report writes is what it changes (a file of yours is not listed)
    s = read_study(study_dir)
    cfg, plan, runs, table, arm_of = s.cfg, s.plan, s.runs, s.table, s.arm_of
    # The non-private baseline (nodp, ε = ∞) is in no release table, figure or sentence: its exact
    # scores go to the diagnostics (build_report's "Non-private baseline" section).
    released = private_rows(table)
    has_test = any(r["test_mean"] is not None for r in table)  # else the selection score is shown
    # The tuner's own table and every run: diagnostics (counts of runs reveal K under LT/RS).
    notes, secret_notes = split_arm_notes(plan)
    dsections = [every_run_section(table, write_runs_csv(out, runs, arm_of), secret_notes)]
    dsections += study_heatmaps(s, out) if include_diagnostics else []
    subtitle = f"{len(plan.arms)} tuning procedures, " + ("" if s.hides_k else f"{len(runs)} runs, ")
    diverged = {r["run_id"] for r in runs if r["status"] == "diverged"}  # of the selected runs: their models'
    inputs = study_inputs(
        s,
        [_selected_row(r, has_test, diverged) for r in table],  # every arm: build_report keeps ε = ∞ apart
        histories=_histories(runs, arm_of, s.chosen, {rid for r in released for rid in r["selected_runs"]}),
        title=title or f"Study report: {cfg.get('study', {}).get('name') or study_dir.name}",
        subtitle=f"{subtitle}n_train = {plan.n_train}",
        notes=_progress(runs, s.hides_k),
        lt_ma=_lt_ma_rows(plan),
        extra_figures=_linear_scaling_figures(plan, runs, out),
        extra_sections=[_selection_section(cfg, released, plan.metric, has_test, notes), tried_section(cfg, plan)],
        lead_sections=[
            selected_model_section(table, plan.metric, cfg.get("selection", {}).get("split", "test"), has_test)
        ],
        curves=learning_curves(runs, arm_of, {rid for r in released for rid in r["selected_runs"]}),
        diagnostic_sections=dsections,
        all_results=every_configuration(runs, arm_of, s.chosen, has_test),
    )
    page = build_report(out, inputs, include_diagnostics=include_diagnostics)
    # removed by the tuner once more runs finish: never a stale report beside new results
    note_report_files(out, before)
    return page


def _selected_row(r: Mapping[str, Any], use_test: bool, diverged: set[str]) -> SummaryRow:
    """A tuner's table row as shown: selection, metric, diverged selected runs (post-processing; review: always 0)."""
    mean, std = (r["test_mean"], r["test_std"]) if use_test else (r["value_mean"], r["value_std"])
    label, n_div = _arm_label(r["strategy"], r["method"]), len(diverged.intersection(r["selected_runs"]))
    return SummaryRow(label, float(r["epsilon"]), r["selected"] or "—", mean, std, int(r["replicates"]), n_div, True)


def _histories(
    runs: Sequence[Mapping[str, Any]], arm_of: Mapping[str, Any], chosen: set[str], selected: set[str]
) -> list[RunHistory]:
    """The selected runs (release, named without their run id); every run of a small study (diagnostics)."""
    wanted = {r["run_id"] for r in runs} if len(runs) <= MAX_ALL_HISTORIES else chosen
    out = []
    for r in (r for r in runs if r["run_id"] in wanted and r["history"]):
        arm, public = arm_of[r["arm"]], r["run_id"] in selected
        name = public_run_name(arm, r) if public else r["run_id"]
        out.append(RunHistory(name, arm.label, json.loads(r["history"]), selected=public, epsilon=float(arm.epsilon)))
    return out


def _progress(runs: Sequence[Mapping[str, Any]], hidden_k: bool) -> list[str]:
    """The note of an unfinished study (without the run counts where they are secret)."""
    done = sum(1 for r in runs if r["status"] in ("done", "diverged"))
    if done == len(runs):
        return []
    if hidden_k:
        return ["The study is not finished: the results cover the runs done so far."]
    return [f"The study is not finished: {done} of {len(runs)} runs are done."]


def _selection_section(
    cfg: Mapping[str, Any], released: Sequence[Mapping[str, Any]], metric: str, has_test: bool, notes: list[str]
) -> Section:
    """The tuner's selection table with how it selected (split, seeds, noise) and the randomness mode."""
    sel = cfg.get("selection", {})
    shown = "metric on the test split" if has_test else "selection score"
    paragraphs = [
        f"Selection on the {sel.get('split', 'test')} split, across seeds: {sel.get('across_seeds', 'per-seed')}. "
        f"The results above show the {shown} of the selected configurations."
    ]
    if sel.get("mode") == "private":
        paragraphs.append(
            "Private selection: every selection score was released with Gaussian noise (σ = "
            f"{sel.get('noise_multiplier')} on its sum), so selection scores are noisy and may fall outside the "
            "metric's range: this page shows them clipped to it (post-processing); the CSV files keep the raw values."
        )
    paragraphs.append(randomness_note(cfg))
    rows = [
        [r["strategy"], r["epsilon"], r["method"], r["selected"] or "—"]
        + [metric_text(r["value_mean"], r["value_std"], metric)]
        + ([metric_text(r["test_mean"], r["test_std"], metric)] if has_test else [])  # no empty column
        for r in released
    ]
    columns = ["strategy", "ε", "method", "selected configuration", "selection score"] + ["test"] * has_test
    caption = "[k/P]: the configuration was selected by k of the P seed replicates (per-seed selection)."
    return Section("Tuner's selection table", paragraphs=paragraphs + notes, tables=[Table(columns, rows, caption)])


def _lt_ma_rows(plan: Any) -> list[tuple[int, float, float]] | None:
    """LT vs MA cost (Mohapatra Fig. 6) for the [training] geometry of the first Liu–Talwar arm: public, where a
    drawn run's geometry is a secret draw (found in review: it showed a losing candidate's T and that K ≥ 2)."""
    for arm in plan.arms:
        if arm.method == "liu-talwar" and (g := arm.extra.get("public_geometry")):
            nu, batch, steps = g["noise_multiplier"], g["sampling_rate"] * plan.n_train, g["steps"]
            return list(theory.lt_vs_ma(plan.n_train, nu, batch, steps, ks=range(1, 41), delta=arm.delta).rows)
    return None


def _linear_scaling_figures(plan: Any, runs: Sequence[Mapping[str, Any]], out: Path) -> list[FigureRef]:
    """The fit of r = η·T of the first procedure of each linear-scaling arm (Panda Fig. 3)."""
    figs = []
    for arm in plan.arms:
        if arm.method != "linear-scaling":
            continue
        first = (r for r in runs if r["arm"] == arm.arm and r["fit"] and plan.runs[r["run_id"]].procedure == 0)
        fit = next((r["fit"] for r in first), None)
        if not (fit and fit.get("points")):
            continue
        coef = fit.get("coef")
        lsf = LinearScalingFit(
            [tuple(p) for p in fit["points"]],
            slope=coef[-2] if coef and len(coef) >= 2 else 0.0,
            intercept=coef[-1] if coef else float(fit.get("r_star", 0.0)),
            target_epsilon=fit.get("x_final"),
            coefficients=coef if coef and len(coef) > 2 else None,
            axis="mu" if fit.get("axis") == "mu" else "epsilon",
        )
        name = f"{arm.label} @ ε = {arm.epsilon:g}"
        path = out / RELEASE_DIR / "figures" / f"linear_scaling_{_file_stem(arm.arm)}.png"
        caption = (
            f"{name}: r = η·T of the best sweep runs, the fit ({fit.get('how', 'fit')}) and "
            f"r* = {fit.get('r_star', math.nan):.4g} used by the final run"
        )
        rf, rs = fit.get("r_final"), fit.get("r_star")
        if not (rf is None or rs is None or math.isclose(rf, rs, rel_tol=1e-9)):  # r* outside what T_f allows
            caption += f" — outside [η_min·T_f, η_max·T_f], so the final run used r = η_f·T_f = {rf:.4g}"
        fig = F.linear_scaling(lsf, path, title=f"Linear scaling rule: {name}")
        figs.append(FigureRef(fig, caption + " (Panda et al. 2024, Fig. 3)."))
    return figs


def _file_stem(arm: str) -> str:
    """An arm id (``dpsgd@eps=2``) as a file name (``dpsgd_at_eps2``)."""
    return arm.replace("/", "_").replace("@", "_at_").replace("=", "")


def randomness_note(cfg: Mapping[str, Any]) -> str:
    """The study's randomness mode (docs/privacy.md, item 3): secure (OS CSPRNG) or seeded."""
    return "Randomness: " + randomness_statement(bool(cfg.get("study", {}).get("secure")))["randomness_note"]


def _arm_label(label: str, method: str) -> str:
    """``label``, with the method unless it is a plain grid search: every candidate listed
    (``needs_value_lists``) and one ν shared by all (``shared_noise``; grid, online)."""
    m = get_method(method)
    return label if m.needs_value_lists and m.shared_noise else f"{label} ({method})"


def _config(run: Mapping[str, Any]) -> dict[str, Any]:
    """A run's configuration: parsed already (``tune.results.load_study``) or its stored JSON."""
    c = run["config"]
    return dict(c) if isinstance(c, Mapping) else json.loads(c)


def every_configuration(
    runs: Sequence[Mapping[str, Any]],
    arm_of: Mapping[str, Any],
    selected: Iterable[str],
    use_test: bool,
    name: Callable[[Any], str] | None = None,
) -> list[SummaryRow]:
    """One row per configuration tried: test metric (``use_test``) or selection score, mean ± std over seeds,
    ``selected``, named ``name(arm)`` (default ``_arm_label``). Diagnostics: LT / repeat-and-select cover no loser."""
    name = name or (lambda arm: _arm_label(arm.label, arm.method))
    chosen = set(selected)
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for r in runs:
        if r["status"] in ("done", "diverged") and r["config"] is not None:
            groups[(r["arm"], r["stage"], config_key(_config(r)))].append(r)
    out = []
    for (arm, _, key), rs in groups.items():
        ok = [v for r in rs if finite_number(v := r["test_metric"] if use_test else r["score"])]
        mean, std = mean_std(ok)
        a, picked = arm_of[arm], any(r["run_id"] in chosen for r in rs)
        out.append(SummaryRow(name(a), float(a.epsilon), key, mean, std, len(rs), len(rs) - len(ok), picked))
    return out


def study_ledger_rows(plan: Any, entries: Iterable[Any], per_run: Sequence[Mapping[str, Any]]) -> list[LedgerRow]:
    """Releases per (run, query label): the run's ε and planned ε alone, the label's ν and q."""
    eps_alone = {r["run_id"]: r["epsilon_alone"] for r in per_run}
    planned = {r["run_id"]: r.get("planned_epsilon") for r in per_run}
    releases: dict[tuple[str, str], int] = defaultdict(int)
    event: dict[tuple[str, str], Any] = {}
    for e in entries:
        releases[(e.run, e.label)] += e.count
        event.setdefault((e.run, e.label), e.event)
    rows = []
    for (rid, label), n in releases.items():
        nu, q = nu_q(event[(rid, label)])
        planned_nu = plan.runs[rid].noise_multiplier
        nu = nu if nu is not None else (planned_nu if finite_number(planned_nu) else None)
        q = q if q is not None else plan.runs[rid].sampling_rate
        rows.append(LedgerRow(rid, label, n, eps_alone.get(rid), planned.get(rid), nu, q))
    return rows


# runs.csv: what each run is (its procedure, seed and configuration), then its plan and results (a failed one's error).
_RUN_IDENTITY = ("run_id", "arm", "strategy", "epsilon", "stage", "procedure", "replicate", "seed", "status", "config")
_RUN_PLAN_AND_RESULTS = ("noise_multiplier", "steps", "sampling_rate", "score", "best_step", "test_metric", "seconds")
RUNS_CSV_COLUMNS = _RUN_IDENTITY + _RUN_PLAN_AND_RESULTS + ("error",)


def write_runs_csv(out: str | Path, runs: Sequence[Mapping[str, Any]], arm_of: Mapping[str, Any]) -> Path:
    """``diagnostics/runs.csv``: every run (not DP: it lists the losers and, under LT/RS, reveals K)."""
    rows = []
    for r in runs:
        arm, cfg = arm_of[r["arm"]], r["config"]
        config = cfg if cfg is None or isinstance(cfg, str) else json.dumps(cfg)
        overrides = {"strategy": arm.label, "epsilon": arm.epsilon, "config": config}
        rows.append({k: r.get(k) for k in RUNS_CSV_COLUMNS} | overrides)
    return write_labelled_csv(diagnostics_dir(out) / "runs.csv", rows, RUNS_CSV_COLUMNS)


def every_run_section(table: Sequence[Mapping[str, Any]], runs_csv: Path, paragraphs: Sequence[str] = ()) -> Section:
    """The diagnostics section with the run counts per tuning procedure and ``runs.csv``."""
    rows = [
        [r["strategy"], r["epsilon"], r["method"], f"{r['runs_done']}/{r['runs_total']}", r["diverged"], r["failed"]]
        for r in table
    ]
    caption = "Runs per tuning procedure (under Liu–Talwar / repeat-and-select their number is secret)."
    runs_table = Table(["strategy", "ε", "method", "runs", "diverged", "failed"], rows, caption)
    return Section("Every run", list(paragraphs), tables=[runs_table], attachments=[runs_csv], diagnostic=True)


def conclusions(
    table: Sequence[Mapping[str, Any]],
    costs: Mapping[str, Mapping[str, Any]],
    higher: bool,
    metric: str,
    hidden_k: bool,
) -> list[str]:
    """One sentence per ε: the best procedure, its margin over the next and, where the number of
    runs is public, its noise cost (``costs``: arm → {"runs", "nu"}, from ``arm_costs``). Oracle and
    non-private arms are left out; everything used is on the release page already."""
    key = "test_mean" if any(r.get("test_mean") is not None for r in table) else "value_mean"
    by_eps: dict[float, list[Mapping[str, Any]]] = defaultdict(list)
    for r in private_rows(table):
        if r.get("method") != "oracle":
            by_eps[float(r["epsilon"])].append(r)

    def value(r: Mapping[str, Any]) -> float:
        return float(r[key])

    def gap(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:  # in the metric's unit, like the scores
        return f"{abs(value(a) - value(b)):.2g}"

    def tied(a: float, b: float) -> bool:  # accuracy: half a tenth of a point; else relative
        return abs(a - b) < (5e-4 if metric == "accuracy" else 5e-4 * max(abs(a), abs(b)))

    def name(r: Mapping[str, Any]) -> str:
        n = costs.get(r["arm"], {}).get("runs", r.get("runs_total"))
        runs = "" if hidden_k or n is None else f", {n} run{'s' if n != 1 else ''}"
        return f"{r['strategy']} ({r['method']}{runs})"

    out = []
    for eps in sorted(by_eps):  # finite: non-private rows were left out above
        finite = (r for r in by_eps[eps] if r.get(key) is not None and math.isfinite(value(r)))
        rows = sorted(finite, key=value, reverse=higher)
        if not rows:
            out.append(f"At ε = {epsilon_text(eps)}, no procedure has a finite result yet.")
            continue
        first, v1 = rows[0], value(rows[0])
        se = _standard_error(first, rows[1], key) if len(rows) > 1 else None
        unbeaten = len(rows) == 1 or tied(v1, value(rows[1])) or (se is not None and abs(v1 - value(rows[1])) <= se)
        text = f"At ε = {epsilon_text(eps)}, {name(first)} {'scores' if unbeaten else 'is best:'} {metric} {v1:.3g}"
        if len(rows) > 1:
            second = rows[1]
            if tied(v1, value(second)):
                text += f", tied with {name(second)}"
            elif unbeaten:  # a winner named within the seeds' spread (found in review)
                text += f", within the seeds' spread of {name(second)} at {value(second):.3g} (standard error {se:.2g})"
            else:
                text += f", ahead of {name(second)} at {value(second):.3g} by {gap(first, second)}"
                text += " (one seed each: no spread measured)" if se is None else f" (standard error {se:.2g})"
            text += "" if hidden_k else _noise_cost(first, second, costs)
        # Galli et al.'s comparison, when the study has both and they are not the pair above.
        oso = next((r for r in rows if r.get("optimizer") == "oso"), None)
        sgd = next((r for r in rows if r.get("optimizer") == "dpsgd"), None)
        if oso is not None and sgd is not None and {id(oso), id(sgd)} != {id(r) for r in rows[:2]}:
            ahead = "better" if better(value(oso), value(sgd), higher) else "worse"
            text += (
                f". Online vs DP-SGD: {name(oso)} {value(oso):.3g} against {name(sgd)} "
                f"{value(sgd):.3g} ({ahead} by {gap(oso, sgd)})"
            )
        out.append(text + ".")
    return out


def _standard_error(a: Mapping[str, Any], b: Mapping[str, Any], key: str) -> float | None:
    """√(s_a²/n_a + s_b²/n_b) of two rows' means over seeds (``key``'s std); None when either has one seed."""
    std = key.replace("_mean", "_std")
    n_a, n_b = int(a.get("replicates") or 1), int(b.get("replicates") or 1)
    if n_a < 2 or n_b < 2 or a.get(std) is None or b.get(std) is None:
        return None
    return math.sqrt(float(a[std]) ** 2 / n_a + float(b[std]) ** 2 / n_b)


def _noise_cost(first: Mapping[str, Any], second: Mapping[str, Any], costs: Mapping[str, Mapping[str, Any]]) -> str:
    """How much more noise per run splitting its budget cost one procedure than the other."""
    n1, n2 = costs.get(first["arm"], {}).get("nu"), costs.get(second["arm"], {}).get("nu")
    if not (n1 and n2 and math.isfinite(n1) and math.isfinite(n2) and n1 != n2):
        return ""
    more, less = (second, first) if n2 > n1 else (first, second)
    hi, lo = max(n1, n2), min(n1, n2)
    return (
        f". Splitting the budget over its runs cost {more['strategy']} {hi / lo:.2g}× "
        f"the noise per run of {less['strategy']} (ν = {hi:.3g} against {lo:.3g})"
    )


def oso_joint_noise(plan: Any) -> dict[float, float]:
    """ε → the joint ν of the Pareto figure: the smallest ν of the OSO arms' runs (public plan; the drawn runs of
    Liu–Talwar or repeat-and-select are secret draws: its [training] geometry's ν, or its one calibrated ν)."""
    out: dict[float, float] = {}
    for arm in plan.arms:
        if arm.strategy != "oso" or not math.isfinite(arm.epsilon):
            continue
        if hides_run_count(arm.guarantee.get("kind")):  # drawn runs are secret: the plan's public geometry, or none
            nus = [g["noise_multiplier"]] if (g := arm.extra.get("public_geometry")) else []
        else:  # the finite, positive ν of the arm's runs
            nus = [float(v) for rid in arm.runs if finite_number(v := plan.runs[rid].noise_multiplier) and v > 0]
        if nus:
            out[float(arm.epsilon)] = min([*nus, out.get(float(arm.epsilon), math.inf)])
    return out


def arm_costs(plan: Any) -> dict[str, dict[str, Any]]:
    """Arm → {"runs": runs its budget is split over, "nu": their one ν or None} (public plan)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in plan.arms:
        nus = {plan.runs[rid].noise_multiplier for rid in arm.runs}
        nu = next(iter(nus)) if len(nus) == 1 and get_method(arm.method).shared_noise else None
        out[arm.arm] = {"runs": arm.guarantee.get("runs_accounted", len(arm.runs)), "nu": float(nu) if nu else None}
    return out


def study_heatmaps(s: StudyRows, out: Path) -> list[Section]:
    """The diagnostics section of ``grid_heatmaps``' figures, if the study has a two-axis grid."""
    figures = grid_heatmaps(s.runs, s.arm_of, out, s.plan.metric, s.plan.higher_is_better)
    if not figures:
        return []
    text = (
        "The score of every configuration (mean over seed replicates), the best outlined: the shape of the search "
        "space (Mohapatra et al.'s lr × C inverse relation, Panda et al.'s η × T). It shows the losing candidates, "
        "which the guarantee of a private selection does not cover."
    )
    return [Section("Every configuration of each two-axis grid", diagnostic=True, figures=figures, paragraphs=[text])]


def grid_heatmaps(
    runs: Sequence[Mapping[str, Any]], arm_of: Mapping[str, Any], out: Path, metric: str, higher: bool
) -> list[FigureRef]:
    """One heatmap per arm whose runs vary exactly two numeric hyperparameters (diagnostics)."""
    figs = []
    by_arm: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in runs:  # grid-like searches only: random/linear-scaling spaces are not grids
        if r["score"] is None or r["config"] is None:
            continue
        if get_method(getattr(arm_of[r["arm"]], "method", "grid")).needs_value_lists:
            by_arm[r["arm"]].append(r)
    for arm, rs in by_arm.items():
        configs = [_config(r) for r in rs]
        varying = [
            k
            for k in configs[0]
            if all(isinstance(c.get(k), int | float) and not isinstance(c.get(k), bool) for c in configs)
            and len({c[k] for c in configs}) > 1
        ]
        if len(varying) != 2:
            continue
        x, y = varying
        cells: dict[tuple[Any, Any], list[float]] = defaultdict(list)
        for c, r in zip(configs, rs, strict=True):
            cells[(c[x], c[y])].append(float(r["score"]))
        scores = {k: clip_to_range(sum(v) / len(v), metric) for k, v in cells.items()}  # displayed: clipped
        label = f"{arm_of[arm].label} @ ε = {arm_of[arm].epsilon:g}"
        path = diagnostics_dir(out) / "figures" / f"grid_{_file_stem(arm)}.png"
        p = F.grid_heatmap(scores, x, y, path, title=label, metric=metric, higher=higher)
        figs.append(FigureRef(p, f"{label}: selection score of every {x} × {y} configuration."))
    return figs
