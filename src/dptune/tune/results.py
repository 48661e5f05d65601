"""Results of a stored study, read from its directory only: the selection table (per procedure, by the
arm's method), the budget, the status, CSVs and a terminal rendering. ``release/results.csv`` holds
``RELEASE_COLUMNS`` of the private arms only; the rest is in ``diagnostics/`` (docs/privacy.md)."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from dptune.metrics import clip_to_range, finite_number, mean_std
from dptune.outputs import (
    DIAGNOSTICS_DIR,
    NOT_DP_LABEL,
    diagnostics_dir,
    print_table,
    randomness_statement,
    release_dir,
    split_arm_notes,
    terminal_console,
    up,
    write_csv_rows,
    write_labelled_csv,
)
from dptune.release.ledger import LedgerEntry, compose
from dptune.tune import theory
from dptune.tune.groups import balanced, plan_groups
from dptune.tune.methods import get_method
from dptune.tune.records import ArmPlan, StudyPlan, entries_epsilon, event_epsilon
from dptune.tune.space import config_key
from dptune.tune.store import Store

TERMINAL_WIDTH = 100

# The columns of study_table that the guarantee covers: per tuning procedure, the selected configuration and its
# metrics (selection score: exact on the public split or noisy in private mode; test metric on the public test split),
# the guarantee and the ledger's totals. Left out: run counts, diverged/failed counts over every candidate, selected
# run ids (they number the candidates: K is secret under Liu–Talwar / repeat-and-select) and fits' raw data.
RELEASE_COLUMNS: tuple[str, ...] = (
    "strategy", "optimizer", "epsilon", "method", "selection", "split", "metric", "selected", "value_mean",
    "value_std", "test_mean", "test_std", "replicates", "planned_epsilon", "planned_delta", "selection_epsilon",
    "epsilon_float_slack", "spent_epsilon", "spent_delta", "guarantee_per", "accountant", "arm",
)  # fmt: skip


def is_nonprivate(row: Mapping[str, Any]) -> bool:
    """Is this ``study_table`` row a non-private arm (the nodp baseline: guarantee ε = ∞)? Its scores
    and selection are exact functions of the private data: never published, only in the diagnostics."""
    eps = row.get("planned_epsilon", row.get("epsilon"))
    try:
        return eps is None or not math.isfinite(float(eps))
    except (TypeError, ValueError):
        return True  # fail closed: an unreadable guarantee is no guarantee


_Row = TypeVar("_Row", bound=Mapping[str, Any])


def private_rows(table: Iterable[_Row]) -> list[_Row]:
    """The rows of ``table`` that a finite (ε, δ) guarantee covers (``is_nonprivate`` left out)."""
    return [r for r in table if not is_nonprivate(r)]


def release_rows(table: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``study_table`` rows reduced to ``RELEASE_COLUMNS``, non-private arms left out."""
    return [{k: r.get(k) for k in RELEASE_COLUMNS} for r in private_rows(table)]


def release_guarantee(plan: StudyPlan) -> tuple[float, float] | None:
    """(ε, δ) of release/ as a whole, its procedures published together (found in review: each card states
    its own): the composition-kind arms' planned runs, every seed, composed (RDP), plus each other arm's
    stated guarantee once per procedure (basic composition). None where release/ holds one procedure."""
    private = [a for a in plan.arms if math.isfinite(a.guarantee["epsilon"])]

    def procedures(a: ArmPlan) -> int:  # seed replicates are procedures unless the guarantee is per study
        return 1 if a.guarantee.get("per") == "study" else len({plan.runs[r].replicate for r in a.runs})

    if sum(map(procedures, private)) < 2:
        return None
    composed = [plan.runs[r] for a in private if a.guarantee.get("kind") == "composition" for r in a.runs]
    other = [a for a in private if a.guarantee.get("kind") != "composition"]
    delta = min(a.delta for a in private)
    eps = event_epsilon(compose((r.planned_event, 1) for r in composed), delta, "rdp")  # 0 without such arms
    return (
        eps + sum(a.guarantee["epsilon"] * procedures(a) for a in other),
        (delta if composed else 0.0) + sum(a.guarantee["delta"] * procedures(a) for a in other),
    )


def release_note(plan: StudyPlan) -> str | None:
    """The line that says what covers release/ published whole (``release_guarantee``), or None."""
    w = release_guarantee(plan)
    return None if w is None else f"release/ as a whole (all its procedures published together) is ({up(w[0], 4)}, {up(w[1])})-DP; each card's guarantee covers its own model alone."  # fmt: skip


def load_study(study_dir: str | Path) -> tuple[dict[str, Any], StudyPlan, list[dict[str, Any]], list[LedgerEntry]]:
    with Store(study_dir, readonly=True) as store:
        cfg = store.get_meta("config")
        plan = StudyPlan.from_dict(store.get_meta("plan"))
        rows = [dict(r) for r in store.runs()]
        entries = store.ledger_entries()
        slack = store.get_meta("float_slack") or {}
    for r in rows:
        r["float_slack"] = slack.get(r["run_id"], 0.0)
        r["config"] = json.loads(r["config"]) if r["config"] else None
        r["fit"] = json.loads(r["fit"]) if r.get("fit") else None
    return cfg, plan, rows, entries


# ----------------------------------------------------------------------------- budget
def _arm_entries(arm: ArmPlan, entries: list[LedgerEntry]) -> list[LedgerEntry]:
    ids = set(arm.runs)
    return [e for e in entries if e.run in ids]


def spent(arm: ArmPlan, plan: StudyPlan, entries: list[LedgerEntry]) -> tuple[float, float]:
    """(ε, δ) spent so far by the arm under its own guarantee (``TuningMethod.spent``)."""
    if get_method(arm.method).hides_run_count:  # its K draws were made when planned: the whole guarantee, whatever
        return float(arm.guarantee["epsilon"]), arm.delta  # K (0 too: found in review) and however far the runs are
    mine = _arm_entries(arm, entries)
    if not mine:
        return 0.0, 0.0
    if arm.guarantee["kind"] == "nonprivate":
        return math.inf, arm.delta
    return get_method(arm.method).spent(arm, plan, mine)


def budget_rows(study_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per-run rows, per-(arm, query label) rows): each run's releases and its ε *alone* against its
    planned ε alone (these do not add up); per label, its releases in the arm's scope and their ε alone."""
    _, plan, rows, entries = load_study(study_dir)
    status = {r["run_id"]: r["status"] for r in rows}
    by_run: dict[str, list[LedgerEntry]] = defaultdict(list)
    for e in entries:
        by_run[e.run].append(e)
    per_run, per_label = [], []
    for arm in plan.arms:
        acc = arm.accountant if arm.accountant != "none" else "rdp"
        for rid in arm.runs:
            run = plan.runs[rid]
            es = by_run.get(rid, [])
            per_run.append(
                {
                    "arm": arm.arm,
                    "run_id": rid,
                    "stage": run.stage,
                    "status": status.get(rid),
                    "releases": sum(e.count for e in es),
                    "epsilon_alone": entries_epsilon(es, arm.delta, acc) if es else 0.0,
                    "planned_epsilon": event_epsilon(run.planned_event, arm.delta, acc),
                    "noise_multiplier": run.noise_multiplier,
                    "sampling_rate": run.sampling_rate,
                    "steps": run.steps,
                }
            )
        per_study = arm.guarantee.get("per") == "study"
        scope = [e for e in _arm_entries(arm, entries) if per_study or plan.runs[e.run].replicate == 0]
        labels: dict[str, list[LedgerEntry]] = defaultdict(list)
        for e in scope:
            labels[e.label].append(e)
        # (label, its entries, accountant, scope) of each row
        parts = [
            (label, es, acc, "all seeds" if per_study else "seed replicate 0") for label, es in sorted(labels.items())
        ]
        if get_method(arm.method).hides_run_count and scope:
            parts.append(("(every run, if all were published)", scope, "rdp", "composition, NOT the guarantee"))
        per_label += [
            {
                "arm": arm.arm,
                "label": label,
                "releases": sum(e.count for e in es),
                "epsilon_alone": entries_epsilon(es, arm.delta, a),
                "scope": where,
            }
            for label, es, a, where in parts
        ]
    return per_run, per_label


def _selection_epsilon(arm: ArmPlan, plan: StudyPlan, across: str, cfg: Mapping[str, Any]) -> float:
    """The ε that covers the arm's selection: stored by the planner, else (a study planned before it was)
    all seeds' runs composed where a composition arm averages unaccounted seeds (found in review)."""
    stored, g = arm.guarantee.get("selection_epsilon"), arm.guarantee
    mixed = across == "mean" and not cfg.get("budget", {}).get("account_seeds") and g.get("kind") == "composition"
    every = compose((plan.runs[r].planned_event, 1) for r in arm.runs)
    return stored if stored is not None else event_epsilon(every, arm.delta, arm.accountant) if mixed else g["epsilon"]


# ----------------------------------------------------------------------------- selection table
def _selected(
    arm: ArmPlan, plan: StudyPlan, runs: dict[str, dict[str, Any]], across: str
) -> tuple[dict[str, Any], list[str], list[Any]]:
    """(the table's selection columns, the selected run ids, fit records) of the arm's method."""
    picks, fits = get_method(arm.method).select(arm, plan, [runs[r] for r in arm.runs], across)
    keys = Counter(config_key(p["config"]) for p in picks if p["config"])
    config = ""
    if keys:
        k, c = keys.most_common(1)[0]
        config = k if (len(picks) <= 1 or across == "mean") else f"{k} [{c}/{len(picks)}]"
    val_m, val_s = mean_std([p["score"] for p in picks])
    test_m, test_s = mean_std([p["test_metric"] for p in picks if p["test_metric"] is not None])
    cols = {"selected": config, "value_mean": val_m, "value_std": val_s, "test_mean": test_m, "test_std": test_s}
    return {**cols, "replicates": len(picks)}, [p["run_id"] for p in picks], fits


def study_table(study_dir: str | Path) -> list[dict[str, Any]]:
    """One row per (strategy, ε): selected configuration, metric mean ± std, planned and spent (ε, δ); run counts
    and ids too, the owner's only (K of a hidden-K arm): ``release_rows`` keeps what the guarantee covers."""
    cfg, plan, rows, entries = load_study(study_dir)
    runs = {r["run_id"]: r for r in rows}
    sel = cfg.get("selection", {})
    across = sel.get("across_seeds", "per-seed")
    out = []
    for arm in plan.arms:
        cols, selected_runs, fits = _selected(arm, plan, runs, across)
        st = Counter(runs[r]["status"] for r in arm.runs)
        if get_method(arm.method).hides_run_count and st.get("done", 0) + st.get("diverged", 0) < len(arm.runs):
            # Liu-Talwar / repeat-and-select cover the best of the WHOLE secret search, not of the runs done
            # so far: nothing selected from an unfinished one (in release/ or anywhere) until it finishes.
            cols = {k: (None if k != "selected" else "") for k in cols} | {"replicates": 0}
            selected_runs, fits = [], []
        summed = cfg.get("study", {}).get("secure") and arm.guarantee.get("kind") == "composition"  # item 1b; not K
        sp = spent(arm, plan, entries)
        out.append(
            {
                "strategy": arm.label,
                "optimizer": arm.strategy,
                "epsilon": arm.epsilon,
                "method": arm.method,
                "selection": sel.get("mode", "public"),
                "split": sel.get("split", "test"),
                "metric": plan.metric,
                **cols,
                "runs_done": st.get("done", 0) + st.get("diverged", 0),
                "runs_total": len(arm.runs),
                "diverged": st.get("diverged", 0),
                "failed": st.get("failed", 0),
                "planned_epsilon": arm.guarantee["epsilon"],
                "planned_delta": arm.guarantee["delta"],
                # what covers the selected configuration (> planned where it averages unaccounted seeds)
                "selection_epsilon": _selection_epsilon(arm, plan, across, cfg),
                **({"epsilon_float_slack": sum(runs[r]["float_slack"] for r in arm.runs)} if summed else {}),
                "spent_epsilon": sp[0],
                "spent_delta": sp[1],
                "guarantee_per": arm.guarantee.get("per", "study"),
                "accountant": arm.accountant,
                "arm": arm.arm,
                "selected_runs": selected_runs,
                **({"fits": fits} if fits else {}),
            }
        )
    return out


def rerr_rows(rows: list[dict[str, Any]], higher: bool = True) -> list[dict[str, Any]]:
    """Panda's RERR of each linear-scaling row against same-ε ``random`` and ``oracle``/``grid`` rows."""
    out = []
    for r in rows:
        if r["method"] != "linear-scaling" or r["value_mean"] is None:
            continue
        same = [
            x
            for x in rows
            if x is not r
            and x.get("optimizer") == r.get("optimizer")
            and x["epsilon"] == r["epsilon"]
            and x["value_mean"] is not None
        ]
        rnd = [x for x in same if x["method"] == "random"]
        orc = [x for x in same if x["method"] in ("oracle", "grid")]
        if rnd and orc:
            out.append(
                {
                    "strategy": r["strategy"],
                    "epsilon": r["epsilon"],
                    "rerr": theory.rerr(r["value_mean"], rnd[0]["value_mean"], orc[0]["value_mean"], higher),
                    "random": rnd[0]["strategy"],
                    "oracle": orc[0]["strategy"],
                    "scores": (r["value_mean"], rnd[0]["value_mean"], orc[0]["value_mean"]),
                }
            )
    return out


def study_status(study_dir: str | Path) -> dict[str, Any]:
    """Progress and budget of a (possibly running) study: counts per status, per arm (they state K: labelled)."""
    cfg, plan, rows, entries = load_study(study_dir)
    counts = Counter(r["status"] for r in rows)
    arms = []
    by_id = {r["run_id"]: r for r in rows}
    for arm in plan.arms:
        st = Counter(by_id[r]["status"] for r in arm.runs)
        sp = spent(arm, plan, entries)
        arms.append(
            {
                "arm": arm.arm,
                "method": arm.method,
                "runs": len(arm.runs),
                **dict(st),
                "planned_epsilon": arm.guarantee["epsilon"],
                "planned_delta": arm.guarantee["delta"],
                "spent_epsilon": sp[0],
                "spent_delta": sp[1],
                "per": arm.guarantee.get("per"),
            }
        )
    size = int(cfg.get("study", {}).get("trials_per_group", 16))
    eta_s, eta_text = eta(rows, plan_groups(plan, size, None, balanced(cfg)))  # as the coordinator groups
    return {
        "name": cfg.get("study", {}).get("name", "study"),
        "privacy": NOT_DP_LABEL,
        "total": len(rows),
        "counts": dict(counts),
        "complete": set(counts) <= {"done", "diverged"},
        "arms": arms,
        "selection_mode": cfg.get("selection", {}).get("mode", "public"),
        "eta_seconds": eta_s,
        "eta": eta_text,
    }


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def eta(
    rows: Iterable[Mapping[str, Any]], groups: Mapping[str, tuple[str, ...]] | None = None
) -> tuple[float | None, str]:
    """(seconds, text): runs left (failed ones too: ``resume`` retries them) × mean seconds per finished run ÷ tasks
    running (≥ 1); for the data owner only. ``groups`` (run_id → group): a group is one task, counted once."""
    rows = list(rows)
    groups = groups or {}
    left = sum(1 for r in rows if r["status"] in ("planned", "running", "failed"))
    running = len(
        {(groups.get(r["run_id"], (r["run_id"],)), r.get("started")) for r in rows if r["status"] == "running"}
    )
    took = [
        float(r["seconds"]) for r in rows if r["status"] in ("done", "diverged") and finite_number(r.get("seconds"))
    ]
    if left == 0:
        return 0.0, "no run left"
    if not took:
        return None, f"unknown until a run finishes ({left} runs left)"
    per = statistics.fmean(took)
    seconds = left * per / max(1, running)
    return seconds, (
        f"≈ {_duration(seconds)} ({left} runs left × {per:.3g} s per finished run"
        + (f" ÷ {running} running tasks)" if running > 1 else ")")
    )


# ----------------------------------------------------------------------------- files and terminal
def write_csvs(study_dir: str | Path) -> list[Path]:
    """``release/results.csv`` and, labelled not DP, ``diagnostics/`` results and budget CSVs."""
    d = Path(study_dir)
    per_run, per_label = budget_rows(d)
    table = study_table(d)
    rel, diag = release_dir(d), diagnostics_dir(d)
    return [
        write_csv_rows(rel / "results.csv", release_rows(table)),
        write_labelled_csv(diag / "results.csv", table),
        write_labelled_csv(diag / "budget_runs.csv", per_run),
        write_labelled_csv(diag / "budget_labels.csv", per_label),
    ]


def metric_text(m: float | None, s: float | None, metric: str) -> str:
    """``mean ± std`` in the metric's unit (accuracy as a fraction), the mean clipped to the metric's range."""
    m = clip_to_range(m, metric)
    if m is None:
        return "—"
    return f"{m:.4g}" + (f" ± {s:.2g}" if s is not None else "")


def render(study_dir: str | Path, console: Any = None, *, diagnostics: bool = False) -> None:
    """Print the private arms' results and the notes the guarantee covers; ``diagnostics``: also the labelled
    non-private parts, else one line saying where they are."""
    from rich.table import Table

    console = console or terminal_console()
    cfg, plan, _, _ = load_study(study_dir)
    every = study_table(study_dir)
    rows = private_rows(every)  # the non-private baseline only under the label (diagnostics)
    sel = cfg.get("selection", {})
    metric = plan.metric
    mode_txt = (
        "PUBLIC validation data (assumed public, as in the papers)"
        if sel.get("mode", "public") == "public"
        else f"PRIVATE validation data (Gaussian noise σ = {sel.get('noise_multiplier')} on each score, in the ledger)"
    )
    console.print(
        f"[bold]{cfg.get('study', {}).get('name', 'study')}[/bold] — selection on the "
        f"{sel.get('split', 'test')} split, {mode_txt}; across seeds: {sel.get('across_seeds', 'per-seed')}"
    )
    print_table(console, _results_table(rows, metric))
    if any(r["value_mean"] is not None and clip_to_range(r["value_mean"], metric) != r["value_mean"] for r in rows):
        console.print(
            f"[dim]Noisy selection scores outside the range of {metric} are shown clipped to it; "
            "results.csv keeps the raw values.[/dim]"
        )
    for r in rerr_rows(rows, plan.higher_is_better):
        ratio = "undefined (the oracle does not beat random search)" if math.isnan(r["rerr"]) else f"{r['rerr']:.1%}"
        console.print(
            f"RERR of linear scaling ({r['strategy']}, ε = {r['epsilon']:g}) vs random search ({r['random']}) and "
            f"grid/oracle ({r['oracle']}): {ratio}; scores {' / '.join(f'{v:.4g}' for v in r['scores'])}"
        )
    for note in split_arm_notes(plan)[0]:
        console.print(f"[dim]• {note}[/dim]")
    # The randomness mode (docs/privacy.md, item 3): every study's terminal report states it.
    secure = bool(cfg.get("study", {}).get("secure"))
    note = randomness_statement(secure)["randomness_note"]
    console.print(f"randomness: {note}" if secure else f"[yellow]warning[/]: {note}", highlight=False)
    if not diagnostics:
        baseline = [r["strategy"] for r in every if is_nonprivate(r)]
        console.print(
            f"[dim]Diagnostics ({NOT_DP_LABEL}): {Path(study_dir) / DIAGNOSTICS_DIR}/, "
            "`dptune status`, `dptune report --include-diagnostics`"
            + (f"; the non-private baseline ({', '.join(baseline)}) is there only" if baseline else "")
            + ".[/dim]"
        )
        return
    console.print(f"[bold red]Diagnostics: {NOT_DP_LABEL}[/bold red]")
    render_nonprivate(study_dir, console, table=every)
    for r in every:
        flags = ", ".join(f"{r[k]} {k}" for k in ("failed", "diverged") if r[k])
        console.print(f"• {r['arm']}: {r['runs_done']}/{r['runs_total']} runs" + (f" ({flags})" if flags else ""))
    _, per_label = budget_rows(study_dir)
    b = Table(title=f"where the budget went (ε of each query type alone, at δ) — {NOT_DP_LABEL}")
    for col in ("arm", "query", "releases", "ε alone", "scope"):
        b.add_column(col, overflow="fold")
    for r in per_label:
        b.add_row(r["arm"], r["label"], str(r["releases"]), up(r["epsilon_alone"]), r["scope"])
    print_table(console, b)
    for note in split_arm_notes(plan)[1]:
        console.print(f"[dim]• {note}[/dim]")


def _results_table(rows: Iterable[Mapping[str, Any]], metric: str, title: str | None = None) -> Any:
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    rows = list(rows)
    test = any(r["test_mean"] is not None for r in rows)  # no empty "test" column
    cols = ("strategy", "ε", "method", "selected configuration", metric, "test", "planned (ε, δ)", "spent ε")
    for col in cols:
        if col != "test" or test:
            t.add_column(col, overflow="fold")
    for r in rows:
        planned = f"({up(r['planned_epsilon'])}, {up(r['planned_delta'])})"
        cells = [r["strategy"], up(r["epsilon"]), r["method"], r["selected"] or "—"]
        cells.append(metric_text(r["value_mean"], r["value_std"], metric))
        cells += [metric_text(r["test_mean"], r["test_std"], metric)] if test else []
        cells.append(planned + (" per seed" if r["guarantee_per"] == "seed replicate" else ""))
        if r["selection_epsilon"] != r["planned_epsilon"]:
            cells[-1] += f"; the selection: ε = {up(r['selection_epsilon'])}"
        t.add_row(*cells, up(r["spent_epsilon"]))
    return t


def render_nonprivate(study_dir: str | Path, console: Any = None, *, table: list[dict[str, Any]] | None = None) -> bool:
    """Print the non-private arms' table (exact scores) under the not-DP label; True if printed."""
    console = console or terminal_console()
    rows = [r for r in (table if table is not None else study_table(study_dir)) if is_nonprivate(r)]
    if not rows:
        return False
    print_table(console, _results_table(rows, rows[0]["metric"], title=f"non-private baseline — {NOT_DP_LABEL}"))
    return True


def report_text(study_dir: str | Path, *, diagnostics: bool = False) -> str:
    """The terminal rendering as plain text (100 columns)."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=TERMINAL_WIDTH, force_terminal=False, color_system=None)
    render(study_dir, console, diagnostics=diagnostics)
    return buf.getvalue()
