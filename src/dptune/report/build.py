"""``build_report``: plain study data in (one ``ReportInputs``), figures + CSVs + one self-contained HTML page out."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dp_accounting import dp_event

from dptune import accounting
from dptune.outputs import (
    NOT_DP_LABEL,
    diagnostics_dir,
    release_dir,
    release_history_rows,
    write_csv_rows,
    write_labelled_csv,
)
from dptune.release.ledger import Ledger, compose
from dptune.report import figures as F
from dptune.report.data import (
    LedgerRow,
    LinearScalingFit,
    RunHistory,
    SummaryRow,
    best_per_strategy,
    check_budget,
    coerce_histories,
    coerce_ledger_rows,
    coerce_lt_ma,
    metric_label,
)
from dptune.report.data import higher_is_better as resolve_direction
from dptune.report.diagnostics import CosineResult
from dptune.report.html import FigureRef, Section, Table, check_selection_mode, write_report
from dptune.report.tables import (
    as_summary_rows,
    history_csv_rows,
    ledger_csv_rows,
    ledger_table,
    results_table,
    summary_csv_rows,
)


@dataclass(frozen=True)
class ReportInputs:
    """What ``build_report`` shows, checked when made (one ConfigError naming the fix before anything is
    written); dicts accepted for rows, (path, caption) pairs for ``extra_figures``. What goes to the release
    (covered by the guarantee) and what to the diagnostics: docs/reports.md."""

    results: Sequence[Any]
    selection_mode: str  # public | private: where the validation data that picked the hyperparameters came from
    planned: tuple[float, float] | None  # the whole study's (ε, δ); None: per procedure in ``budgets``
    spent: tuple[float, float] | None
    histories: Sequence[Any] = ()
    ledger: Sequence[Any] = ()
    metric: str = "accuracy"
    higher_is_better: bool | None = None  # None: the metric's own direction
    title: str = "dptune study report"
    subtitle: str = ""
    accountant: str | None = None
    selection_split: str | None = None
    budgets: Sequence[Mapping[str, Any]] = ()  # label, planned=(ε, δ), spent=(ε, δ), note: one per procedure
    conclusions: Sequence[str] = ()
    notes: Sequence[str] = ()
    pareto: Mapping[float, float] | Sequence[tuple[float, float]] | None = None  # ε → OSO's joint ν
    relative_increase: float = 0.01
    lt_ma: Sequence[Any] | None = None
    linear_scaling: LinearScalingFit | Mapping[str, Any] | None = None
    cosine: CosineResult | None = None
    extra_figures: Sequence[FigureRef | tuple[str | Path, str]] = ()
    extra_sections: Sequence[Section] = ()
    diagnostic_notes: Sequence[str] = ()
    diagnostic_sections: Sequence[Section] = ()
    all_results: Sequence[Any] | None = None
    lead_sections: Sequence[Section] = ()  # release, right after the conclusions (the selected model)
    curves: Sequence[Any] = ()  # RunHistory of {"step", "score"}: the selected runs' metric on the selection split
    whole: str | None = None  # what covers release/ published whole, where it holds several procedures

    def __post_init__(self) -> None:
        check_selection_mode(self.selection_mode, self.selection_split)
        resolve_direction(self.metric, self.higher_is_better)  # an unknown metric needs the direction
        checked = {
            "planned": check_budget("planned", self.planned),
            "spent": check_budget("spent", self.spent),
            "results": tuple(self.results),
            "histories": tuple(coerce_histories(self.histories)),
            "curves": tuple(coerce_histories(self.curves)),
            "ledger": tuple(coerce_ledger_rows(self.ledger)),
            "lt_ma": None if self.lt_ma is None else tuple(coerce_lt_ma(self.lt_ma)),
            "all_results": None if self.all_results is None else tuple(self.all_results),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def higher(self) -> bool:
        return resolve_direction(self.metric, self.higher_is_better)


@dataclass
class _Pages:
    """The two pages ``build_report`` fills: the release (``out``) and the diagnostics (``diag``)."""

    r: ReportInputs
    out: Path
    diag: Path
    include_diagnostics: bool
    sections: list[Section] = field(default_factory=list)
    dsections: list[Section] = field(default_factory=list)  # not DP: only on diagnostics/report.html


def _diagnostic(title: str, paragraph: str, **parts: Any) -> Section:
    return Section(title, diagnostic=True, paragraphs=[paragraph], **parts)


def build_report(out_dir: str | Path, inputs: ReportInputs, *, include_diagnostics: bool = False) -> Path:
    """Write the publishable report of ``inputs`` into ``out_dir/release/`` and the diagnostics into
    ``out_dir/diagnostics/`` (also as a page with ``include_diagnostics=True``); return ``release/report.html``."""
    r = inputs
    p = _Pages(r, release_dir(out_dir), diagnostics_dir(out_dir), include_diagnostics)
    if r.conclusions:  # first: what the results say, computed from them (covered by the guarantee)
        p.sections.append(Section("Conclusions", paragraphs=list(r.conclusions)))
    p.sections.extend(r.lead_sections)
    if r.notes:
        p.sections.append(Section("Notes", paragraphs=list(r.notes)))
    if r.diagnostic_notes:
        p.dsections.append(Section("Notes (diagnostics)", paragraphs=list(r.diagnostic_notes), diagnostic=True))
    best, baseline = _results(p)
    _learning_curves(p)
    _trajectories(p, best, baseline)
    _budget_and_ledger(p)
    if r.cosine is not None:
        _cosine(p, r.cosine)
    _paper_figures(p)
    if r.extra_figures:
        figs = [f if isinstance(f, FigureRef) else FigureRef(Path(f[0]), str(f[1])) for f in r.extra_figures]
        p.sections.append(Section("Additional figures", figures=figs))
    for s in r.extra_sections:
        (p.dsections if s.diagnostic else p.sections).append(s)
    p.dsections.extend(replace(s, diagnostic=True) for s in r.diagnostic_sections)
    head: dict[str, Any] = dict(selection_mode=r.selection_mode, planned=r.planned, spent=r.spent, budgets=r.budgets)
    head.update(accountant=r.accountant, selection_split=r.selection_split)
    page = write_report(p.out, r.title, p.sections, subtitle=r.subtitle, **head)
    if include_diagnostics:
        sub = NOT_DP_LABEL + (f" · {r.subtitle}" if r.subtitle else "")
        title = f"{r.title}: diagnostics"
        write_report(p.diag, title, [*p.sections, *p.dsections], diagnostics=True, subtitle=sub, **head)
    return page


def _results(p: _Pages) -> tuple[list[SummaryRow], list[SummaryRow]]:
    """The results section; returns (the private best rows, the non-private baseline rows)."""
    higher, all_results = p.r.higher, p.r.all_results
    summary = as_summary_rows(p.r.results, higher=higher, best_only=False)
    ranked = best_per_strategy(summary, higher)
    # Non-private rows (ε = ∞, the nodp baseline): exact functions of the private data, covered by
    # no guarantee; never in release/ (table, CSV, figure), only in the diagnostics.
    baseline = [r for r in ranked if not math.isfinite(r.epsilon)]
    best = [r for r in ranked if math.isfinite(r.epsilon)]
    # Every configuration (the losing candidates too) is a diagnostic: Liu–Talwar and
    # repeat-and-select cover only the selected one.
    every = summary if all_results is None else as_summary_rows(all_results, higher=higher, best_only=False)
    all_csv = write_labelled_csv(p.diag / "results_all.csv", summary_csv_rows(every))
    best_csv = write_csv_rows(p.out / "results_best.csv", summary_csv_rows(best))
    if p.include_diagnostics and every:
        table = results_table(every, p.r.metric, higher, "All configurations (diagnostics).")
        text = "Every candidate of the search with its metric, selected or not."
        p.dsections.append(_diagnostic("Every configuration tried", text, tables=[table], attachments=[all_csv]))
    if baseline:
        base_csv = write_labelled_csv(p.diag / "results_nonprivate.csv", summary_csv_rows(baseline))
        table = results_table(baseline, p.r.metric, higher, "Non-private baseline (diagnostics).")
        text = (
            "Trained without noise (ε = ∞): its scores are exact functions of the private data, "
            f"covered by no guarantee ({NOT_DP_LABEL}). The release shows the private arms only."
        )
        p.dsections.append(_diagnostic("Non-private baseline", text, tables=[table], attachments=[base_csv]))
    if not best:
        p.sections.append(Section("Results", paragraphs=["No results were recorded."]))
        return best, baseline
    metric, direction = p.r.metric, "higher" if higher else "lower"
    figures = []  # a curve over ε needs two ε at least: one ε would be a single dot per strategy
    if len({r.epsilon for r in best}) > 1:
        fig = F.metric_vs_epsilon(best, p.out / "figures" / "metric_vs_epsilon.png", metric=metric, higher=higher)
        figures.append(FigureRef(fig, f"{metric} vs ε per strategy, mean ± std over seeds ({direction} is better)."))
    if all(r.selected for r in best):
        text = f"Each row is the {metric} of the configuration the tuner selected for a strategy at that ε "
    else:
        text = (
            f"Each row is the {metric} of the best configuration of a strategy at that ε (or of the "
            "one the tuner selected, where it marked one) "
        )
    caption = (
        "One configuration per strategy and ε; 'seeds' counts those whose run did not diverge. A diverged "
        "seed's score, where it has one (that of the model it left), is in the mean, as in the tuner's table."
    )
    text += f"({direction} is better), averaged over seeds (± one standard deviation)."
    table = results_table(best, metric, higher, caption)
    p.sections.append(Section("Results", [text], figures, [table], attachments=[best_csv]))
    return best, baseline


def _trajectories(p: _Pages, best: list[SummaryRow], baseline: list[SummaryRow]) -> None:
    """Selected runs' C_t, ρ_t: release (post-processing); train_loss, batch_size, losers: diagnostics."""
    hs: list[RunHistory] = list(p.r.histories)
    if not hs:
        return
    full_rows = [{"selected": h.selected, **row} for h in hs for row in history_csv_rows([h])]
    diag_traj = write_labelled_csv(p.diag / "trajectories.csv", full_rows)
    # A non-private run's ρ_t is its configuration, selected on exact scores: diagnostics only
    # (ε = ∞, or, without ε, a strategy whose only results are non-private).
    nonprivate = {r.strategy for r in baseline} - {r.strategy for r in best}
    public = [
        replace(h, rows=release_history_rows(h.rows))
        for h in hs
        if h.selected and (math.isfinite(h.epsilon) if h.epsilon is not None else h.strategy not in nonprivate)
    ]
    if public:
        traj_csv = write_csv_rows(p.out / "trajectories.csv", history_csv_rows(public))
        title = "Clipping threshold and learning rate over training"
        fixed = [h for h in public if all(len({row.get(k) for row in h.rows}) <= 1 for k in ("clip", "lr"))]
        if len(fixed) == len(public):  # flat lines say nothing a sentence cannot
            said = "; ".join(
                f"{h.run}: C = {h.rows[0].get('clip', '—')}, ρ = {h.rows[0].get('lr', '—')}" for h in public
            )
            text = f"The selected runs kept C and ρ fixed over training ({said})."
            p.sections.append(Section(title, paragraphs=[text], attachments=[traj_csv]))
            public = []
    if public:
        fig = F.trajectories(public, p.out / "figures" / "trajectories.png")
        text = (
            "C_t and ρ_t per iteration (log scale) of the selected runs, one line per run. Flat lines are fixed "
            "hyperparameters; OSO, the quantile rule and ADADP adapt them during training, from noisy releases only."
        )
        figure = FigureRef(fig, "C_t (top) and ρ_t (bottom) against the iteration t.")
        p.sections.append(Section(title, paragraphs=[text], figures=[figure], attachments=[traj_csv]))
    if p.include_diagnostics:
        fig = F.trajectories(hs, p.diag / "figures" / "trajectories_all.png", title="C_t and ρ_t of every run")
        text = (
            "C_t and ρ_t of every run, selected or not; the CSV also has the loss on the private batch (train_loss) "
            "and the realised Poisson batch sizes (batch_size), computed in the clear."
        )
        figure = FigureRef(fig, "C_t (top) and ρ_t (bottom) of every run.")
        p.dsections.append(_diagnostic("Every run's history", text, figures=[figure], attachments=[diag_traj]))


def _learning_curves(p: _Pages) -> None:
    """The selected runs' metric over training: release on a public split, else diagnostics only."""
    if not p.r.curves:
        return
    public = p.r.selection_mode == "public"
    folder, write = (p.out, write_csv_rows) if public else (p.diag, write_labelled_csv)
    csv = write(folder / "learning_curves.csv", history_csv_rows(p.r.curves))
    if not (public or p.include_diagnostics):
        return
    label, split = metric_label(p.r.metric, p.r.higher), p.r.selection_split or "evaluation"
    path, title = folder / "figures" / "learning_curves.png", f"Learning curve: {split} split"
    fig = F.trajectories(p.r.curves, path, panels=(("score", label),), log=False, title=title)
    text = f"{label} of the selected runs on the {split} split at each evaluation during training."
    figure = FigureRef(fig, f"{label} against the iteration t, one line per selected run.")
    section = Section("Learning curve", [text], [figure], attachments=[csv], diagnostic=not public)
    (p.sections if public else p.dsections).append(section)


def _budget_and_ledger(p: _Pages) -> None:
    """The ledger's totals are the budget (release); its per-run rows list the candidates (diagnostics)."""
    lrows: list[LedgerRow] = list(p.r.ledger)
    if budget_rows := _budget_rows(p.r):
        text = (
            "The (ε, δ) each tuning procedure planned and spent (search and selection included), for adding or "
            "removing one training example. Everything on this page is covered by it; the diagnostics (every "
            "candidate, per-run ledger, training loss, batch sizes) are not and are kept apart."
        )
        budget_csv = write_csv_rows(p.out / "budget.csv", budget_rows)
        paragraphs = [text, p.r.whole] if p.r.whole else [text]
        p.sections.append(Section("Privacy guarantee", paragraphs=paragraphs, attachments=[budget_csv]))
    if not lrows:
        return
    led_csv = write_labelled_csv(p.diag / "ledger.csv", ledger_csv_rows(lrows))
    if p.include_diagnostics:
        lines = p.r.planned[0] if p.r.planned else _planned_lines(p.r.budgets)
        fig = F.ledger(lrows, p.diag / "figures" / "ledger.png", planned_epsilon=lines)
        text = (
            f"{len({r.run for r in lrows})} runs, {sum(int(r.releases) for r in lrows)} noisy "
            "releases in total. Every release is recorded before its noise is drawn."
        )
        figure = FigureRef(fig, "Left: ε of each run alone. Right: noisy releases per query label.")
        parts = dict(figures=[figure], tables=[ledger_table(lrows)], attachments=[led_csv])
        p.dsections.append(_diagnostic("Privacy ledger per run", text, **parts))


def _cosine(p: _Pages, cosine: CosineResult) -> None:
    cos_csv = write_labelled_csv(p.diag / "cosine_vs_clip.csv", cosine.to_rows())
    if not p.include_diagnostics:
        return
    fig = F.cosine_similarity(cosine, p.diag / "figures" / "cosine_vs_clip.png")
    text = (
        "NON-PRIVATE diagnostic computed on raw data on this machine; it is not a DP release and must not be published "
        "as one. Small C biases the clipped gradient, large C drowns it in noise ν·C."
    )
    caption = (
        "Cosine similarity between the clipped, noised mean gradient and the true mean gradient vs C, at several "
        "iterations (Galli et al. 2024, Fig. 1); band: ± one std over the realizations."
    )
    title = "Clipping trade-off (non-private diagnostic)"
    p.dsections.append(_diagnostic(title, text, figures=[FigureRef(fig, caption)], attachments=[cos_csv]))


def _paper_figures(p: _Pages) -> None:
    """The optional release figures of the papers: OSO's noise split, LT vs MA, the linear scaling rule."""
    r, figures = p.r, p.out / "figures"
    if r.pareto is not None:
        fig = F.noise_pareto(r.pareto, figures / "noise_pareto.png", relative_increase=r.relative_increase)
        choices = [(e, nu, *F.pareto_choice(nu, r.relative_increase)) for e, nu in F.noise_pairs(r.pareto)]
        choice_rows = [[e, nu, nu_q, nu_g, nu_q / nu] for e, nu, nu_q, nu_g in choices]
        caption = (
            "Pareto front of the noise multipliers of OSO's gradient (ν_g) and q-query (ν_q) at the privacy of one "
            f"Gaussian of multiplier ν; star: ν_g = {1 + r.relative_increase:g}·ν (Galli et al. 2024, Fig. 2)."
        )
        columns = ["ε", "ν (joint)", "ν_q chosen", "ν_g chosen", "ν_q/ν"]
        table = Table(columns, choice_rows, caption="Chosen noise split per ε.")
        title = "Noise split of OSO's joint release"
        p.sections.append(Section(title, figures=[FigureRef(fig, caption)], tables=[table]))
    if r.lt_ma is not None:
        fig = F.lt_vs_ma(r.lt_ma, figures / "lt_vs_ma.png")
        k_star = F.ma_break_even(r.lt_ma)
        tail = f" MA is no more expensive up to k = {k_star}." if k_star is not None else " LT is cheaper at every k."
        caption = (
            "ε of the whole search vs the number of candidates k: Liu–Talwar random stopping vs composing every "
            "run with the moments accountant (Mohapatra et al. 2022, Fig. 6)." + tail
        )
        rows = [{"k": row.k, "eps_LT": row.eps_lt, "eps_MA": row.eps_ma} for row in r.lt_ma]
        csv = write_csv_rows(p.out / "lt_vs_ma.csv", rows)
        title = "Cost of tuning: Liu–Talwar vs moments accountant"
        p.sections.append(Section(title, figures=[FigureRef(fig, caption)], attachments=[csv]))
    if r.linear_scaling is not None:
        fig = F.linear_scaling(r.linear_scaling, figures / "linear_scaling.png")
        caption = (
            "r = η·T found by the cheap searches vs ε, the fitted line, and the value it "
            "extrapolates to at the target ε (Panda et al. 2024, Fig. 3)."
        )
        p.sections.append(Section("Linear scaling rule", figures=[FigureRef(fig, caption)]))


def _planned_lines(budgets: Sequence[Mapping[str, Any]]) -> list[tuple[float, str]]:
    """The ledger figure's planned-ε lines: one per distinct planned ε (3 digits), naming its procedures."""
    by_eps: dict[str, list[float]] = {}
    for b in budgets:
        pl = b.get("planned")
        if pl and pl[0] is not None and math.isfinite(float(pl[0])):
            by_eps.setdefault(f"{float(pl[0]):.3g}", []).append(float(pl[0]))
    return sorted((max(v), f"planned, {len(v)} procedure{'s' if len(v) > 1 else ''}") for v in by_eps.values())


def _budget_rows(r: ReportInputs) -> list[dict[str, Any]]:
    """The guarantee and the ledger's totals: one row for the study and/or one per procedure."""
    procedures = [
        (b.get("label", ""), b.get("planned"), b.get("spent"), b.get("note", ""), b.get("accountant", r.accountant))
        for b in r.budgets
    ]  # a study's procedures: each its accountant (found in review: the column was empty)
    if r.planned is not None or r.spent is not None:
        procedures.insert(0, ("whole study", r.planned, r.spent, "study", r.accountant))
    return [
        {"procedure": name, "planned_epsilon": pl[0] if pl else None, "planned_delta": pl[1] if pl else None}
        | {"spent_epsilon": sp[0] if sp else None, "spent_delta": sp[1] if sp else None}
        | {"accountant": acc, "scope": scope}
        for name, pl, sp, scope, acc in procedures
    ]


# ----------------------------------------------------------------------------- from a Ledger
def nu_q(event: dp_event.DpEvent) -> tuple[float | None, float | None]:
    if isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(event.event, dp_event.GaussianDpEvent):
        return float(event.event.noise_multiplier), float(event.sampling_probability)
    if isinstance(event, dp_event.GaussianDpEvent):
        return float(event.noise_multiplier), 1.0
    return None, None


def ledger_rows_from_ledger(
    ledger: Ledger, delta: float, accountant: str = "rdp", planned_epsilon: Mapping[str, float] | None = None
) -> list[LedgerRow]:
    """One ``LedgerRow`` per (run, query label, event) of ``ledger``, each with its run's own ε at ``delta``."""
    accounting.check_delta(delta)
    by_run: dict[str, list] = {}
    for e in ledger.entries:
        by_run.setdefault(e.run, []).append(e)
    rows = []
    for run, entries in by_run.items():
        ev = compose((e.event, e.count) for e in entries)
        nonprivate = any(isinstance(e.event, dp_event.NonPrivateDpEvent) for e in entries)
        eps = math.inf if nonprivate else accounting.epsilon(ev, delta, accountant)
        merged: dict[tuple[str, dp_event.DpEvent], int] = {}
        for e in entries:
            merged[(e.label, e.event)] = merged.get((e.label, e.event), 0) + e.count
        for (label, event), count in merged.items():
            nu, q = nu_q(event)
            rows.append(LedgerRow(run, label, count, eps, (planned_epsilon or {}).get(run), nu, q))
    return rows
