"""Mohapatra et al. (AAAI 2022)'s analyses of the DP-SGD arm's (α, C) grid from a preset's stored runs:
appendix G's best counts (Fig. 7), the best α per C (Sec. 4.1), Theorem 4's optimal step. What each shows
and its privacy: docs/reproduce.md."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dptune.outputs import diagnostics_dir, hides_run_count, up, write_csv_rows, write_labelled_csv
from dptune.presets._common import Part
from dptune.report import figures as F
from dptune.report.html import FigureRef, Section, Table, write_report
from dptune.tune import theory
from dptune.tune.data import study_data
from dptune.tune.results import load_study, study_table
from dptune.tune.spec import DataSpec, SelectionSpec

SGD_LABEL = "dpsgd"  # the DP-SGD arm (α × C grid, momentum 0); DPMomentum is another arm of the same strategy
PRIVACY_RELEASE = (
    "Privacy: which candidate was best is computed from every DP-SGD run's scores. Here every run is "
    "accounted (grid, composition) and the scores are on the selection split assumed public (or, in private "
    "mode, noisy charged releases), so this is post-processing of outputs the guarantee covers, with the scope "
    "of the results tables (per tuning procedure)."
)
PRIVACY_DIAGNOSTIC = (
    "Privacy: not differentially private: for the data owner only. The DP-SGD arm uses Liu–Talwar or "
    "repeat-and-select, whose guarantee covers only the selected candidate; counting which candidate was best "
    "at every checkpoint shows the losing candidates (and how many ran)."
)


THEOREM4_COLUMNS = [
    "part", "ε", "ν", "σ = ν√d/L", "T", "α_opt·C per unit R", "selected (α, C) per seed", "selected α·C", "implied R"
]  # fmt: skip


@dataclass(frozen=True)
class BestCounts:
    """Appendix G's score: how many times each (α, C) cell was the best candidate."""

    counts: dict[tuple[float, float], int]  # every cell that ran; 0 if it never won
    contests: int  # comparisons made: one per (part, ε, checkpoint step)
    by_group: dict[tuple[str, float], dict[tuple[float, float], int]]  # the same per (part, ε)


def _tied_best(scores: Mapping[Any, list[float]], higher: bool, rtol: float) -> tuple[list[Any], float]:
    """The keys whose mean score ties the best mean (within ``rtol``), and the best mean."""
    means = {k: statistics.fmean(v) for k, v in scores.items()}
    best = max(means.values()) if higher else min(means.values())
    return [k for k, m in means.items() if abs(m - best) <= rtol * max(1.0, abs(best))], best


def best_counts(rows: Iterable[Mapping[str, Any]], higher_is_better: bool = True, rtol: float = 1e-12) -> BestCounts:
    """Appendix G: each (α, C) cell scores a point each time it is best in a *contest* (one part, ε,
    checkpoint step), by its mean over seed replicates; ties each score, diverged runs do not compete.
    ``rows``: dicts with ``part``, ``epsilon``, ``step``, ``lr``, ``clip``, ``score``."""
    scores: dict[tuple[str, float, int], dict[tuple[float, float], list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    groups: dict[tuple[str, float], set[tuple[float, float]]] = defaultdict(set)
    for r in rows:
        cell = (float(r["lr"]), float(r["clip"]))
        group = (str(r["part"]), float(r["epsilon"]))
        groups[group].add(cell)
        s = r.get("score")
        if s is not None and math.isfinite(float(s)):
            scores[(*group, int(r["step"]))][cell].append(float(s))
    counts = dict.fromkeys(sorted(set().union(*groups.values()), key=lambda c: (c[1], c[0])), 0)
    by_group = {g: dict.fromkeys(sorted(cs, key=lambda c: (c[1], c[0])), 0) for g, cs in groups.items()}
    for (part, eps, _step), cand in scores.items():
        for c in _tied_best(cand, higher_is_better, rtol)[0]:
            counts[c] += 1
            by_group[(part, eps)][c] += 1
    return BestCounts(counts, len(scores), by_group)


def pruned_grid(counts: Mapping[tuple[float, float], int], min_count: int = 1) -> list[tuple[float, float]]:
    """Appendix G's pruned grid: the (α, C) cells best ≥ ``min_count`` times (paper: once), by C then α."""
    return sorted((c for c, k in counts.items() if k >= min_count), key=lambda c: (c[1], c[0]))


def best_lr_per_clip(
    rows: Iterable[Mapping[str, Any]], higher_is_better: bool = True, rtol: float = 1e-12
) -> dict[tuple[str, float], list[tuple[float, tuple[float, ...], float]]]:
    """The LR–C relation (Sec. 4.1): (part, ε) → [(C, (best α, …), best mean score)], C ascending."""
    cells: dict[tuple[str, float, float], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        s = r.get("score")
        if s is not None and math.isfinite(float(s)):
            cells[(str(r["part"]), float(r["epsilon"]), float(r["clip"]))][float(r["lr"])].append(float(s))
    out: dict[tuple[str, float], list[tuple[float, tuple[float, ...], float]]] = defaultdict(list)
    for (part, eps, clip), by_lr in sorted(cells.items()):
        tied, best = _tied_best(by_lr, higher_is_better, rtol)
        out[(part, eps)].append((clip, tuple(sorted(tied)), best))
    return dict(out)


def loglog_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of log α on log C (−1: α ∝ 1/C); None with fewer than two distinct C."""
    xs = [math.log(c) for c, _ in points]
    ys = [math.log(a) for _, a in points]
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def dpsgd_rows(
    part: str, plan: Any, runs: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(checkpoint rows, final rows) of a study's DP-SGD arm: per (run, evaluation), and per run."""
    arms = {a.arm: a for a in plan.arms if a.label == SGD_LABEL}
    evals: list[dict[str, Any]] = []
    finals: list[dict[str, Any]] = []
    for r in runs:
        a = arms.get(r["arm"])
        if a is None:
            continue
        base = {"part": part, "epsilon": float(a.epsilon), "seed": r["seed"]}
        base |= {"lr": float(r["config"]["lr"]), "clip": float(r["config"]["clip"])}
        by_step = {int(e["step"]): e.get("score") for e in json.loads(r["evals"] or "[]")}  # last eval of a step
        evals.extend({**base, "step": t, "score": s} for t, s in sorted(by_step.items()))
        finals.append({**base, "score": r["score"]})
    return evals, finals


def analyses(out_dir: Path, parts: Sequence[Part]) -> list[Section]:
    """Report sections of the (α, C) analyses. The count and the per-C best α show every candidate: published
    only when every DP-SGD run is covered by the guarantee, else in ``diagnostics/`` (docs/privacy.md); the
    Theorem 4 table uses the selected runs only."""
    evals: list[dict[str, Any]] = []
    finals: list[dict[str, Any]] = []
    stored: list[tuple[Part, Any, list[dict[str, Any]]]] = []
    covered, higher = True, True
    for p in parts:
        d = out_dir / p.name
        if not (d / "study.sqlite").is_file():
            continue
        _, plan, runs, _ = load_study(d)
        runs = [r for r in runs if r["status"] in ("done", "diverged") and r["config"] is not None]
        higher = bool(plan.higher_is_better)
        stored.append((p, plan, runs))
        sgd = [a for a in plan.arms if a.label == SGD_LABEL]
        covered &= not any(hides_run_count(a.guarantee.get("kind")) for a in sgd)
        # Cells average seed replicates: unaccounted replicates are separate procedures, and no one
        # guarantee covers the losing candidates of several of them.
        covered &= all(a.guarantee.get("per", "study") == "study" for a in sgd)
        e, f = dpsgd_rows(p.name, plan, runs)
        evals += e
        finals += f
    if not evals:
        return []
    where = out_dir if covered else diagnostics_dir(out_dir)
    write = write_csv_rows if covered else write_labelled_csv
    privacy = PRIVACY_RELEASE if covered else PRIVACY_DIAGNOSTIC
    sections = [
        _best_counts_section(evals, higher, where, write, privacy),
        _lr_vs_clip_section(finals, higher, where, write, privacy),
    ]
    theorem = theorem4_section(out_dir, stored)
    if covered:
        return [*sections, *theorem]
    title = "Mohapatra et al.: DP-SGD (α, C) analyses"
    diagnostic = [replace(s, diagnostic=True) for s in sections]
    page = write_report(where, title, diagnostic, diagnostics=True, filename="mohapatra_analyses.html")
    text = (
        "The best-count heatmap (Fig. 7), the pruned grid and the best α per C show every DP-SGD candidate. "
        "This preset's DP-SGD arm uses Liu–Talwar (or repeat-and-select), whose guarantee covers only the "
        "selected candidate, so they are not covered and are written for the data owner only: "
        f"{page.relative_to(out_dir)} (not differentially private: for the data owner only)."
    )
    return [Section("DP-SGD (α, C) analyses (appendix G, Sec. 4.1): diagnostics only", [text]), *theorem]


def _best_counts_section(
    evals: list[dict[str, Any]], higher: bool, where: Path, write: Callable[..., Path], privacy: str
) -> Section:
    """Appendix G / Fig. 7: how often each (α, C) was best, and the pruned grid it implies."""
    bc = best_counts(evals, higher)
    pruned = pruned_grid(bc.counts)
    groups: dict[tuple[str, Any], dict[tuple[float, float], int]] = {("all", "all"): bc.counts, **bc.by_group}
    count_rows = [
        {"part": part, "epsilon": eps, "lr": a, "clip": c, "times_best": k, "pruned_grid": k >= 1}
        for (part, eps), cnt in groups.items()
        for (a, c), k in cnt.items()
    ]
    counts_csv = write(where / "dpsgd_best_counts.csv", count_rows)
    title = f"DP-SGD: times each (α, C) was best, {bc.contests} comparisons"
    heat = F.best_count_heatmap(bc.counts, where / "figures" / "dpsgd_best_counts.png", title=title)
    by_clip: dict[float, list[float]] = defaultdict(list)
    for a, c in pruned:
        by_clip[c].append(a)
    times: dict[float, int] = defaultdict(int)
    for (_, c), k in bc.counts.items():
        times[c] += k
    pruned_table = Table(
        ["C", "α ever best (pruned grid)", "times best"],
        [[f"{c:g}", ", ".join(f"{a:g}" for a in by_clip[c]) or "— (never best)", times[c]] for c in sorted(times)],
        caption=f"Pruned grid: {len(pruned)} of {len(bc.counts)} (α, C) cells were best at least once "
        f"(appendix G's rule). {bc.contests} comparisons: parts {', '.join(sorted({r['part'] for r in evals}))} × "
        f"ε × checkpoints; tied cells each score a point.",
    )
    paragraphs = [
        "Mohapatra et al. score each (α, C) pair of the DP-SGD grid once for every checkpoint (every "
        "evaluation, 100 iterations apart at the paper scale) at which it was the best candidate, pooling "
        "models and noise levels (their Fig. 7 totals 2,400 = 4 datasets × 2 models × 3 σ × 100 checkpoints; "
        "this preset holds one dataset). A candidate's score at a checkpoint is the mean over its seed "
        'replicates. The pruned grid keeps every pair that was ever best: "a generous pruning" that gives '
        "DP-SGD the best possible advantage.",
        "The pruning is hindsight on this very data: tuning again on the pruned grid with the same data and "
        "reporting only its cost would hide the first search's cost. It is a grid for other tasks.",
        privacy,
    ]
    figure = FigureRef(heat, "Times each (α, C) was the best DP-SGD candidate; red outline: the pruned grid.")
    heading = "DP-SGD: how often each (α, C) was best (appendix G, Fig. 7) and the pruned grid"
    return Section(heading, paragraphs, [figure], [pruned_table], attachments=[counts_csv])


def _lr_vs_clip_section(
    finals: list[dict[str, Any]], higher: bool, where: Path, write: Callable[..., Path], privacy: str
) -> Section:
    """Sec. 4.1: the best α for each C, and the slope of log α on log C."""
    series, lr_rows, body = {}, [], []
    for (part, eps), per_c in best_lr_per_clip(finals, higher).items():
        pts = [(c, statistics.geometric_mean(al)) for c, al, _ in per_c]
        series[f"{part}, ε = {up(eps, 4)}"] = pts
        slope = loglog_slope(pts)
        slope_txt = "—" if slope is None else f"{slope:.2f}"
        for (c, al, s), (_, a) in zip(per_c, pts, strict=True):
            lr_rows.append({"part": part, "epsilon": eps, "clip": c, "best_lr": ";".join(f"{x:g}" for x in al)})
            lr_rows[-1] |= {"best_lr_times_clip": a * c, "score": s, "slope_log_lr_vs_log_clip": slope}
            cells = [f"{c:g}", ", ".join(f"{x:g}" for x in al), f"{a * c:.3g}", f"{s:.4g}", slope_txt]
            body.append([part, up(eps, 4), *cells])
    lr_csv = write(where / "dpsgd_lr_vs_clip.csv", lr_rows)
    lr_fig = F.lr_vs_clip(series, where / "figures" / "dpsgd_lr_vs_clip.png", title="DP-SGD: best α for each C")
    paragraphs = [
        "For each clipping threshold C, the learning rate α whose runs scored best (mean over seed "
        "replicates of each run's selection score; tied α are all listed, and plotted at their geometric "
        'mean). Mohapatra et al. observe that "LR and C have inverse relation" for DP-SGD: with clipping '
        "active the update is α·C times a bounded direction, so the best α scales like 1/C, a slope of −1 "
        "on the log–log plot. Theorem 4 (convex case) predicts the same: its optimal α·C does not depend "
        "on C. The grid's coarseness (α in steps of ×2–2.5 at the paper scale, ×10 at the small scale) "
        "limits how exactly the slope can show it.",
        privacy,
    ]
    figure = FigureRef(lr_fig, "Best α per C (log–log); dashed: α ∝ 1/C through each line's geometric mean.")
    columns = ["part", "ε", "C", "best α", "α·C", "score", "slope of log α vs log C"]
    table = Table(columns, body, caption="Slope: least squares over the C values of one (part, ε); −1 is α ∝ 1/C.")
    heading = "DP-SGD: the learning rate–clipping relation (Sec. 4.1)"
    return Section(heading, paragraphs, [figure], [table], attachments=[lr_csv])


def tuner_data(data: Mapping[str, Any]) -> Any:
    """The tuner's view of a data section (loaded once per process: the tuner's cache)."""
    return study_data(DataSpec(name=data["name"], options=dict(data.get("options", {}))), SelectionSpec(), 0)


def _theorem4_rows(
    out_dir: Path, stored: Sequence[tuple[Part, Any, list[dict[str, Any]]]]
) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """(CSV rows, table rows) of ``theorem4_section``: one per (logistic regression part, ε)."""
    rows, body = [], []
    for p, plan, runs in stored:
        if p.study["model"]["name"] != "logistic_regression":
            continue  # the theorem is for convex f: the TLNN is not
        arms = {a.arm for a in plan.arms if a.label == SGD_LABEL}
        by_id = {r["run_id"]: r for r in runs}
        sd = tuner_data(p.study["data"])
        d = (math.prod(sd.input_shape) + 1) * int(sd.num_classes or 1)  # logistic regression: (inputs + 1) × classes
        lot = float(p.study["training"]["expected_batch_size"])
        for row in study_table(out_dir / p.name):
            sel = [by_id[rid] for rid in row["selected_runs"] if rid in by_id]
            if row["arm"] not in arms or not sel:
                continue
            eps, nu, steps = float(row["epsilon"]), float(sel[0]["noise_multiplier"]), int(sel[0]["steps"])
            sigma = nu * math.sqrt(d) / lot  # E‖z‖² = d·ν²C²/L² for DP-SGD's noisy mean gradient
            per_r = theory.convex_dpsgd_step(1.0, 1.0, sigma, steps).effective_step
            configs = [(r["config"]["lr"], r["config"]["clip"]) for r in sel]
            ac = statistics.geometric_mean([float(lr) * float(clip) for lr, clip in configs])
            row = {"part": p.name, "epsilon": eps, "noise_multiplier": nu, "params": d, "lot": lot, "steps": steps}
            row |= {"sigma_theorem": sigma, "alpha_opt_times_clip_per_unit_R": per_r}
            row |= {"selected": ";".join(f"lr={lr:g} clip={clip:g}" for lr, clip in configs)}
            rows.append(row | {"selected_alpha_times_clip": ac, "implied_R": ac / per_r})
            selected = ", ".join(f"({lr:g}, {clip:g})" for lr, clip in configs)
            numbers = [f"{nu:.3g}", f"{sigma:.3g}", steps, f"{per_r:.3g}"]
            body.append([p.name, up(eps, 4), *numbers, selected, f"{ac:.3g}", f"{ac / per_r:.3g}"])
    return rows, body


def theorem4_section(out_dir: Path, stored: Sequence[tuple[Part, Any, list[dict[str, Any]]]]) -> list[Section]:
    """Theorem 4 (appendix D) beside the selected DP-SGD step for the convex parts: α_opt·C per unit R, the
    selected α·C and the R that equates them. Selected runs only: a release section."""
    rows, body = _theorem4_rows(out_dir, stored)
    if not rows:
        return []
    return [
        Section(
            "Theorem 4 (convex DP-SGD): the bound's optimal step beside the selected one",
            paragraphs=[
                "Theorem 4 (appendix D, Eq. 1; dptune.tune.theory.convex_dpsgd_step): for convex f with gradients "
                "bounded by C, noisy projected gradient descent with E‖z‖² = σ²C² reaches E[f(x̄_T) − f(x*)] ≤ "
                "R²/(2αT) + αC²(1 + σ²)/2, minimised at α_opt = R/(C·√(T(1 + σ²))) (the appendix misprints T for "
                "√T), i.e. at an effective step α_opt·C = R/√(T(1 + σ²)) that does not depend on C. For DP-SGD's "
                "noisy mean gradient σ = ν·√d/L (d parameters, expected batch L).",
                "R, the distance from the initialisation to the optimum, depends on the private data and is not "
                "computed (it would be a non-private statistic). The table shows instead the R at which the "
                "theorem's optimum equals the selected α·C (geometric mean over seed replicates): R does not "
                "depend on the noise, so if the selection followed the theorem's noise dependence the implied R "
                "would be the same at every ε. A rough check only: per-example clipping is active (the clipped "
                "mean is biased, the proof assumes ‖∇f‖ ≤ C), the selected checkpoint may come before T, the grid "
                "is coarse, and only logistic regression is convex (the TLNN is left out).",
                "Privacy: the selected configurations (released by every tuning method) and the plan: covered.",
            ],
            tables=[Table(THEOREM4_COLUMNS, body, caption="Logistic regression parts; d = (inputs + 1) × classes.")],
            attachments=[write_csv_rows(out_dir / "theorem4.csv", rows)],
        )
    ]
