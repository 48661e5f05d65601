"""``build_report``: plain study data in, figures + CSVs + one self-contained HTML page out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError
from dptune.ledger import Ledger, compose
from dptune.outputs import (
    NOT_DP_LABEL,
    diagnostics_dir,
    release_dir,
    release_history_rows,
    write_labelled_csv,
)
from dptune.report import figures as F
from dptune.report.data import (
    LedgerRow,
    LinearScalingFit,
    SummaryRow,
    best_per_strategy,
    check_budget,
    coerce_histories,
    coerce_ledger_rows,
    coerce_lt_ma,
    summarize,
)
from dptune.report.data import (
    higher_is_better as resolve_direction,
)
from dptune.report.diagnostics import CosineResult
from dptune.report.html import SELECTION_MODES, FigureRef, Section, Table, write_report
from dptune.report.tables import (
    as_summary_rows,
    history_csv_rows,
    ledger_csv_rows,
    ledger_table,
    results_table,
    summary_csv_rows,
    write_csv,
)


def build_report(
    out_dir: str | Path,
    results_rows: Iterable[Any],
    histories: Iterable[Any] = (),
    ledger_rows: Iterable[Any] = (),
    *,
    selection_mode: str,
    planned: tuple[float, float] | None,
    spent: tuple[float, float] | None,
    metric: str = "accuracy",
    higher_is_better: bool | None = None,
    title: str = "dptune study report",
    subtitle: str = "",
    accountant: str | None = None,
    selection_split: str | None = None,
    budgets: Sequence[Mapping[str, Any]] = (),
    notes: Sequence[str] = (),
    conclusions: Sequence[str] = (),
    pareto: Mapping[float, float] | Sequence[tuple[float, float]] | None = None,
    relative_increase: float = 0.01,
    lt_ma: Sequence[Any] | None = None,
    linear_scaling: LinearScalingFit | Mapping[str, Any] | None = None,
    cosine: CosineResult | None = None,
    extra_figures: Sequence[FigureRef | tuple[str | Path, str]] = (),
    extra_sections: Sequence[Section] = (),
    diagnostic_notes: Sequence[str] = (),
    diagnostic_sections: Sequence[Section] = (),
    include_diagnostics: bool = False,
    all_results: Iterable[Any] | None = None,
) -> Path:
    """Write the publishable report into ``out_dir/release/`` and the diagnostics into
    ``out_dir/diagnostics/``; return the path of ``release/report.html``.

    Non-private results (ε = ∞, e.g. the NoDP baseline) never go to ``release/``: they are in
    ``diagnostics/results_nonprivate.csv`` and the diagnostics page only.

    ``release/`` (report.html, figures/, results_best.csv, trajectories.csv, budget.csv, ...)
    holds only what the guarantee covers: the best (or selected) configuration per strategy
    and ε with its metric, the C_t/ρ_t trajectories of the ``selected`` histories (step, clip
    and lr only), the budget, the noise split, LT-vs-MA and linear-scaling figures and the
    caller's ``conclusions`` (first), ``notes``, ``extra_figures`` and ``extra_sections``. ``diagnostics/`` (labelled
    "not differentially private: for the data owner only", see ``dptune.outputs``)
    holds every configuration (results_all.csv), every history with every column (train
    loss, batch sizes), the per-run ledger, the cosine diagnostic, ``diagnostic_notes`` and
    ``diagnostic_sections``; ``include_diagnostics=True`` also writes them as a page,
    ``diagnostics/report.html``, under a red banner.

    * ``all_results``: every configuration tried, for ``diagnostics/results_all.csv`` (same
      forms as ``results_rows``; default: every configuration of ``results_rows``). A tuner's
      report passes its selection table as ``results_rows`` and every candidate here.

    * ``results_rows``: per-seed trial rows (``TrialResult`` or dicts with strategy,
      epsilon, value, seed, hyperparameters[, selected]); aggregated to mean ± std over
      seeds, best (or selected) configuration per strategy and ε. Already aggregated rows
      (``SummaryRow`` or dicts with ``mean``) are used as they are.
    * ``histories``: ``RunHistory`` (run, strategy, rows with step/clip/lr) for C_t, ρ_t.
    * ``ledger_rows``: ``LedgerRow`` (run, label, releases, epsilon, ...); see
      ``ledger_rows_from_ledger`` to derive them from a ``dptune.Ledger``.
    * ``selection_mode``: 'public' or 'private' validation data (stated in the header);
      ``planned``/``spent``: the study's (ε, δ); ``budgets``: per-procedure rows (label,
      planned, spent, note) for studies of several procedures; ``selection_split``
      ('test'/'holdout') adds what the selection was scored on.
    * Optional figures: ``pareto`` (ε → ν, Galli Fig. 2), ``lt_ma`` rows (k, eps_LT,
      eps_MA; Mohapatra Fig. 6), ``linear_scaling`` (Panda Fig. 3), ``cosine`` (a
      ``CosineResult`` from ``cosine_vs_clip``; Galli Fig. 1; a diagnostic), ``extra_figures``.
    """
    if selection_mode not in SELECTION_MODES:
        raise ConfigError(
            f"selection_mode must be 'public' or 'private' (where the validation data that picks "
            f"hyperparameters comes from), got {selection_mode!r}."
        )
    planned_b = check_budget("planned", planned)
    spent_b = check_budget("spent", spent)
    higher = resolve_direction(metric, higher_is_better)
    out = release_dir(out_dir)  # everything written here is publishable
    diag = diagnostics_dir(out_dir)
    fig_dir, diag_figs = out / "figures", diag / "figures"

    sections: list[Section] = []
    dsections: list[Section] = []  # not DP: only on diagnostics/report.html
    if conclusions:  # first: what the results say, computed from them (covered by the guarantee)
        sections.append(Section("Conclusions", paragraphs=list(conclusions)))
    if notes:
        sections.append(Section("Notes", paragraphs=list(notes)))
    if diagnostic_notes:
        dsections.append(Section("Notes (diagnostics)", paragraphs=list(diagnostic_notes), diagnostic=True))

    # -- results: per-seed trial rows are aggregated; summary rows (e.g. the tuner's own
    # selection table, hyperparameters as text) are shown as given.
    results_rows = list(results_rows)
    if results_rows and all(
        isinstance(r, SummaryRow) or (isinstance(r, Mapping) and "mean" in r) for r in results_rows
    ):
        summary = as_summary_rows(results_rows, higher=higher, best_only=False)
    else:
        summary = summarize(results_rows, higher)
    best = best_per_strategy(summary, higher)
    # Non-private rows (ε = ∞, the nodp baseline): exact functions of the private data, covered by
    # no guarantee; never in release/ (table, CSV, figure), only in the diagnostics.
    baseline = [r for r in best if not math.isfinite(r.epsilon)]
    best = [r for r in best if math.isfinite(r.epsilon)]
    # Every configuration (the losing candidates too) is a diagnostic: Liu–Talwar and
    # repeat-and-select cover only the selected one.
    every = summary if all_results is None else as_summary_rows(all_results, higher=higher, best_only=False)
    all_csv = write_labelled_csv(diag / "results_all.csv", summary_csv_rows(every))
    best_csv = write_csv(out / "results_best.csv", summary_csv_rows(best))
    if include_diagnostics and every:
        dsections.append(
            Section(
                "Every configuration tried",
                diagnostic=True,
                paragraphs=["Every candidate of the search with its metric, selected or not."],
                tables=[results_table(every, metric, higher, "All configurations (diagnostics).")],
                attachments=[all_csv],
            )
        )
    if baseline:
        base_csv = write_labelled_csv(diag / "results_nonprivate.csv", summary_csv_rows(baseline))
        dsections.append(
            Section(
                "Non-private baseline",
                diagnostic=True,
                paragraphs=[
                    "Trained without noise (ε = ∞): its scores are exact functions of the private data, "
                    f"covered by no guarantee ({NOT_DP_LABEL}). The release shows the private arms only."
                ],
                tables=[results_table(baseline, metric, higher, "Non-private baseline (diagnostics).")],
                attachments=[base_csv],
            )
        )
    direction = "higher" if higher else "lower"
    if best:
        fig = F.metric_vs_epsilon(best, fig_dir / "metric_vs_epsilon.png", metric=metric, higher=higher)
        sections.append(
            Section(
                "Results",
                paragraphs=[
                    (
                        f"Each point is the {metric} of the configuration the tuner selected for a strategy at that ε "
                        if all(r.selected for r in best)
                        else f"Each point is the {metric} of the best configuration of a strategy at that ε (or of the "
                        "one the tuner selected, where it marked one) "
                    )
                    + f"({direction} is better), averaged over seeds; bars are ± one standard deviation.",
                ],
                figures=[FigureRef(fig, f"{metric} vs ε per strategy, mean ± std over seeds ({direction} is better).")],
                tables=[
                    results_table(
                        best,
                        metric,
                        higher,
                        "One configuration per strategy and ε. Diverged seeds are excluded from the "
                        "mean; 'seeds' counts the finished ones.",
                    )
                ],
                attachments=[best_csv],
            )
        )
    else:
        sections.append(Section("Results", paragraphs=["No results were recorded."]))

    # -- trajectories: the selected runs' C_t and ρ_t are post-processing of their noisy
    # releases (release); train_loss and batch_size are computed in the clear, and losing
    # candidates are not covered by LT/RS (diagnostics).
    hs = coerce_histories(histories)
    if hs:
        full_rows = [{"selected": h.selected, **row} for h in hs for row in history_csv_rows([h])]
        diag_traj = write_labelled_csv(diag / "trajectories.csv", full_rows)
        # A non-private run's ρ_t is its configuration, selected on exact scores: diagnostics only
        # (ε = ∞, or, without ε, a strategy whose only results are non-private).
        nonprivate = {r.strategy for r in baseline} - {r.strategy for r in best}
        public = [
            replace(h, rows=release_history_rows(h.rows))
            for h in hs
            if h.selected and (math.isfinite(h.epsilon) if h.epsilon is not None else h.strategy not in nonprivate)
        ]
        if public:
            traj_csv = write_csv(out / "trajectories.csv", history_csv_rows(public))
            fig = F.trajectories(public, fig_dir / "trajectories.png")
            sections.append(
                Section(
                    "Clipping threshold and learning rate over training",
                    paragraphs=[
                        "C_t and ρ_t per iteration (log scale) of the selected runs, one line per run. Flat "
                        "lines are fixed hyperparameters; OSO, the quantile rule and ADADP adapt them during "
                        "training, from noisy releases only."
                    ],
                    figures=[FigureRef(fig, "C_t (top) and ρ_t (bottom) against the iteration t.")],
                    attachments=[traj_csv],
                )
            )
        if include_diagnostics:
            fig = F.trajectories(hs, diag_figs / "trajectories_all.png", title="C_t and ρ_t of every run")
            dsections.append(
                Section(
                    "Every run's history",
                    diagnostic=True,
                    paragraphs=[
                        "C_t and ρ_t of every run, selected or not; the CSV also has the loss on the "
                        "private batch (train_loss) and the realised Poisson batch sizes (batch_size), "
                        "computed in the clear."
                    ],
                    figures=[FigureRef(fig, "C_t (top) and ρ_t (bottom) of every run.")],
                    attachments=[diag_traj],
                )
            )

    # -- the ledger's totals are the budget (release); its rows per run are diagnostics:
    # they list the losing candidates and, for LT/RS, the number of runs drawn.
    budget_rows = _budget_rows(planned_b, spent_b, accountant, budgets)
    if budget_rows:
        budget_csv = write_csv(out / "budget.csv", budget_rows)
        sections.append(
            Section(
                "Privacy guarantee",
                paragraphs=[
                    "The (ε, δ) each tuning procedure planned and spent (search and selection included), "
                    "for adding or removing one training example. Everything on this page is covered by "
                    "it; the diagnostics (every candidate, per-run ledger, training loss, batch sizes) "
                    "are not and are kept apart."
                ],
                attachments=[budget_csv],
            )
        )
    lrows = coerce_ledger_rows(ledger_rows)
    if lrows:
        led_csv = write_labelled_csv(diag / "ledger.csv", ledger_csv_rows(lrows))
        if include_diagnostics:
            fig = F.ledger(
                lrows, diag_figs / "ledger.png", planned_epsilon=planned_b[0] if planned_b else _planned_lines(budgets)
            )
            dsections.append(
                Section(
                    "Privacy ledger per run",
                    diagnostic=True,
                    paragraphs=[
                        f"{len({r.run for r in lrows})} runs, {sum(int(r.releases) for r in lrows)} noisy "
                        "releases in total. Every release is recorded before its noise is drawn."
                    ],
                    figures=[FigureRef(fig, "Left: ε of each run alone. Right: noisy releases per query label.")],
                    tables=[ledger_table(lrows)],
                    attachments=[led_csv],
                )
            )

    # -- method figures: one section each, so a figure sits next to its table and files
    if cosine is not None:
        cos_csv = write_labelled_csv(diag / "cosine_vs_clip.csv", cosine.to_rows())
    if cosine is not None and include_diagnostics:
        p = F.cosine_similarity(cosine, diag_figs / "cosine_vs_clip.png")
        dsections.append(
            Section(
                "Clipping trade-off (non-private diagnostic)",
                diagnostic=True,
                paragraphs=[
                    "NON-PRIVATE diagnostic computed on raw data on this machine; it is not a DP "
                    "release and must not be published as one. Small C biases the clipped gradient, "
                    "large C drowns it in noise ν·C."
                ],
                figures=[
                    FigureRef(
                        p,
                        "Cosine similarity between the clipped, noised mean gradient and the true "
                        "mean gradient vs C, at several iterations (Galli et al. 2024, Fig. 1); "
                        "band: ± one std over the realizations.",
                    )
                ],
                attachments=[cos_csv],
            )
        )
    if pareto is not None:
        p = F.noise_pareto(pareto, fig_dir / "noise_pareto.png", relative_increase=relative_increase)
        choice_rows = []
        for e, nu in F.noise_pairs(pareto):
            nu_q, nu_g = F.pareto_choice(nu, relative_increase)
            choice_rows.append([e, nu, nu_q, nu_g, nu_q / nu])
        sections.append(
            Section(
                "Noise split of OSO's joint release",
                figures=[
                    FigureRef(
                        p,
                        "Pareto front of the noise multipliers of OSO's gradient (ν_g) and q-query "
                        "(ν_q) at the privacy of one Gaussian of multiplier ν; star: ν_g = "
                        f"{1 + relative_increase:g}·ν (Galli et al. 2024, Fig. 2).",
                    )
                ],
                tables=[
                    Table(
                        ["ε", "ν (joint)", "ν_q chosen", "ν_g chosen", "ν_q/ν"],
                        choice_rows,
                        caption="Chosen noise split per ε.",
                    )
                ],
            )
        )
    if lt_ma is not None:
        rows = coerce_lt_ma(lt_ma)
        p = F.lt_vs_ma(rows, fig_dir / "lt_vs_ma.png")
        k_star = F.ma_break_even(rows)
        tail = f" MA is no more expensive up to k = {k_star}." if k_star is not None else " LT is cheaper at every k."
        sections.append(
            Section(
                "Cost of tuning: Liu–Talwar vs moments accountant",
                figures=[
                    FigureRef(
                        p,
                        "ε of the whole search vs the number of candidates k: Liu–Talwar random "
                        "stopping vs composing every run with the moments accountant (Mohapatra "
                        "et al. 2022, Fig. 6)." + tail,
                    )
                ],
                attachments=[
                    write_csv(out / "lt_vs_ma.csv", [{"k": r.k, "eps_LT": r.eps_lt, "eps_MA": r.eps_ma} for r in rows])
                ],
            )
        )
    if linear_scaling is not None:
        p = F.linear_scaling(linear_scaling, fig_dir / "linear_scaling.png")
        sections.append(
            Section(
                "Linear scaling rule",
                figures=[
                    FigureRef(
                        p,
                        "r = η·T found by the cheap searches vs ε, the fitted line, and the value it "
                        "extrapolates to at the target ε (Panda et al. 2024, Fig. 3).",
                    )
                ],
            )
        )
    if extra_figures:
        sections.append(
            Section(
                "Additional figures",
                figures=[f if isinstance(f, FigureRef) else FigureRef(Path(f[0]), str(f[1])) for f in extra_figures],
            )
        )
    sections.extend(s for s in extra_sections if not s.diagnostic)
    dsections.extend(
        replace(s, diagnostic=True) for s in (*[s for s in extra_sections if s.diagnostic], *diagnostic_sections)
    )

    head = dict(
        selection_mode=selection_mode,
        planned=planned_b,
        spent=spent_b,
        accountant=accountant,
        selection_split=selection_split,
        budgets=budgets,
    )
    page = write_report(out, title, sections, subtitle=subtitle, **head)
    if include_diagnostics:
        write_report(
            diag,
            f"{title}: diagnostics",
            [*sections, *dsections],
            diagnostics=True,
            subtitle=f"{NOT_DP_LABEL}" + (f" · {subtitle}" if subtitle else ""),
            **head,
        )
    return page


def _planned_lines(budgets: Sequence[Mapping[str, Any]]) -> list[tuple[float, str]]:
    """The ledger figure's planned-ε lines of a study of several procedures: one per planned ε
    (equal to 3 significant digits: calibrated plans differ in the last digits), at the largest,
    naming how many procedures planned it."""
    by_eps: dict[str, list[float]] = {}
    for b in budgets:
        pl = b.get("planned")
        if pl and pl[0] is not None and math.isfinite(float(pl[0])):
            by_eps.setdefault(f"{float(pl[0]):.3g}", []).append(float(pl[0]))
    return sorted((max(v), f"planned, {len(v)} procedure{'s' if len(v) > 1 else ''}") for v in by_eps.values())


def _budget_rows(
    planned: tuple[float, float] | None,
    spent: tuple[float, float] | None,
    accountant: str | None,
    budgets: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """The guarantee and the ledger's totals: one row for the study and/or one per procedure."""
    rows = []
    if planned is not None or spent is not None:
        rows.append(
            {
                "procedure": "whole study",
                "planned_epsilon": planned[0] if planned else None,
                "planned_delta": planned[1] if planned else None,
                "spent_epsilon": spent[0] if spent else None,
                "spent_delta": spent[1] if spent else None,
                "accountant": accountant,
                "scope": "study",
            }
        )
    for b in budgets:
        pl, sp = b.get("planned"), b.get("spent")
        rows.append(
            {
                "procedure": b.get("label", ""),
                "planned_epsilon": pl[0] if pl else None,
                "planned_delta": pl[1] if pl else None,
                "spent_epsilon": sp[0] if sp else None,
                "spent_delta": sp[1] if sp else None,
                "accountant": accountant,
                "scope": b.get("note", ""),
            }
        )
    return rows


# ----------------------------------------------------------------------------- from a Ledger
def nu_q(event: dp_event.DpEvent) -> tuple[float | None, float | None]:
    if isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(event.event, dp_event.GaussianDpEvent):
        return float(event.event.noise_multiplier), float(event.sampling_probability)
    if isinstance(event, dp_event.GaussianDpEvent):
        return float(event.noise_multiplier), 1.0
    return None, None


def ledger_rows_from_ledger(
    ledger: Ledger,
    delta: float,
    accountant: str = "rdp",
    planned_epsilon: Mapping[str, float] | None = None,
) -> list[LedgerRow]:
    """One ``LedgerRow`` per (run, query label, event) of ``ledger``, with each run's own ε.

    The ε of a run composes that run's entries only (at ``delta`` with ``accountant``);
    the study's ε composes everything and is smaller than the sum of the runs' ε.
    """
    accounting.check_delta(delta)
    by_run: dict[str, list] = {}
    for e in ledger.entries:
        by_run.setdefault(e.run, []).append(e)
    rows = []
    for run, entries in by_run.items():
        ev = compose((e.event, e.count) for e in entries)
        if any(isinstance(e.event, dp_event.NonPrivateDpEvent) for e in entries):
            eps = math.inf
        else:
            eps = accounting.epsilon(ev, delta, accountant)
        merged: dict[tuple[str, dp_event.DpEvent], int] = {}
        for e in entries:
            merged[(e.label, e.event)] = merged.get((e.label, e.event), 0) + e.count
        for (label, event), count in merged.items():
            nu, q = nu_q(event)
            rows.append(LedgerRow(run, label, count, eps, (planned_epsilon or {}).get(run), nu, q))
    return rows
