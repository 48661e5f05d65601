"""``build_report``: plain study data in, figures + CSVs + one self-contained HTML page out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dp_accounting import dp_event

from dptune import accounting
from dptune.errors import ConfigError
from dptune.ledger import Ledger, compose
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
    pareto: Mapping[float, float] | Sequence[tuple[float, float]] | None = None,
    relative_increase: float = 0.01,
    lt_ma: Sequence[Any] | None = None,
    linear_scaling: LinearScalingFit | Mapping[str, Any] | None = None,
    cosine: CosineResult | None = None,
    extra_figures: Sequence[FigureRef | tuple[str | Path, str]] = (),
    extra_sections: Sequence[Section] = (),
) -> Path:
    """Write figures (PNG), CSVs and ``report.html`` into ``out_dir``; return the HTML path.

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
      ``CosineResult`` from ``cosine_vs_clip``; Galli Fig. 1), ``extra_figures``.
    """
    if selection_mode not in SELECTION_MODES:
        raise ConfigError(
            f"selection_mode must be 'public' or 'private' (where the validation data that picks "
            f"hyperparameters comes from), got {selection_mode!r}."
        )
    planned_b = check_budget("planned", planned)
    spent_b = check_budget("spent", spent)
    higher = resolve_direction(metric, higher_is_better)
    out = Path(out_dir)
    fig_dir = out / "figures"
    out.mkdir(parents=True, exist_ok=True)

    sections: list[Section] = []
    if notes:
        sections.append(Section("Notes", paragraphs=list(notes)))

    # -- results: per-seed trial rows are aggregated; summary rows (e.g. the tuner's own
    # selection table, hyperparameters as text) are shown as given.
    results_rows = list(results_rows)
    if results_rows and all(isinstance(r, SummaryRow) or (isinstance(r, Mapping) and "mean" in r)
                            for r in results_rows):
        summary = as_summary_rows(results_rows, higher=higher, best_only=False)
    else:
        summary = summarize(results_rows, higher)
    best = best_per_strategy(summary, higher)
    all_csv = write_csv(out / "results_all.csv", summary_csv_rows(summary))
    best_csv = write_csv(out / "results_best.csv", summary_csv_rows(best))
    direction = "higher" if higher else "lower"
    if best:
        fig = F.metric_vs_epsilon(best, fig_dir / "metric_vs_epsilon.png", metric=metric, higher=higher)
        sections.append(Section(
            "Results",
            paragraphs=[
                (f"Each point is the {metric} of the configuration the tuner selected for a strategy at that ε "
                 if all(r.selected for r in best) else
                 f"Each point is the {metric} of the best configuration of a strategy at that ε (or of the "
                 "one the tuner selected, where it marked one) ")
                + f"({direction} is better), averaged over seeds; bars are ± one standard deviation.",
            ],
            figures=[FigureRef(fig, f"{metric} vs ε per strategy, mean ± std over seeds ({direction} is better).")],
            tables=[results_table(best, metric, higher,
                                  "One configuration per strategy and ε. Diverged seeds are excluded from the "
                                  "mean; 'seeds' counts the finished ones.")],
            attachments=[best_csv, all_csv],
        ))
    else:
        sections.append(Section("Results", paragraphs=["No results were recorded."]))

    # -- trajectories
    hs = coerce_histories(histories)
    if hs:
        traj_csv = write_csv(out / "trajectories.csv", history_csv_rows(hs))
        fig = F.trajectories(hs, fig_dir / "trajectories.png")
        sections.append(Section(
            "Clipping threshold and learning rate over training",
            paragraphs=["C_t and ρ_t per iteration (log scale), one line per run. Flat lines are fixed "
                        "hyperparameters; OSO, the quantile rule and ADADP adapt them during training."],
            figures=[FigureRef(fig, "C_t (top) and ρ_t (bottom) against the iteration t.")],
            attachments=[traj_csv],
        ))

    # -- ledger
    lrows = coerce_ledger_rows(ledger_rows)
    if lrows:
        led_csv = write_csv(out / "ledger.csv", ledger_csv_rows(lrows))
        fig = F.ledger(lrows, fig_dir / "ledger.png", planned_epsilon=planned_b[0] if planned_b else None)
        sections.append(Section(
            "Privacy ledger",
            paragraphs=[f"{len({r.run for r in lrows})} runs, {sum(int(r.releases) for r in lrows)} noisy "
                        "releases in total. Every release is recorded before its noise is drawn."],
            figures=[FigureRef(fig, "Left: ε of each run alone. Right: noisy releases per query label.")],
            tables=[ledger_table(lrows)],
            attachments=[led_csv],
        ))

    # -- method figures: one section each, so a figure sits next to its table and files
    if cosine is not None:
        p = F.cosine_similarity(cosine, fig_dir / "cosine_vs_clip.png")
        sections.append(Section(
            "Clipping trade-off (non-private diagnostic)",
            paragraphs=["NON-PRIVATE diagnostic computed on raw data on this machine; it is not a DP "
                        "release and must not be published as one. Small C biases the clipped gradient, "
                        "large C drowns it in noise ν·C."],
            figures=[FigureRef(p, "Cosine similarity between the clipped, noised mean gradient and the true "
                                  "mean gradient vs C, at several iterations (Galli et al. 2024, Fig. 1); "
                                  "band: ± one std over the realizations.")],
            attachments=[write_csv(out / "cosine_vs_clip.csv", cosine.to_rows())],
        ))
    if pareto is not None:
        p = F.noise_pareto(pareto, fig_dir / "noise_pareto.png", relative_increase=relative_increase)
        choice_rows = []
        for e, nu in F._noise_pairs(pareto):
            nu_q, nu_g = F.pareto_choice(nu, relative_increase)
            choice_rows.append([e, nu, nu_q, nu_g, nu_q / nu])
        sections.append(Section(
            "Noise split of OSO's joint release",
            figures=[FigureRef(p, "Pareto front of the noise multipliers of OSO's gradient (ν_g) and q-query "
                                  "(ν_q) at the privacy of one Gaussian of multiplier ν; star: ν_g = "
                                  f"{1 + relative_increase:g}·ν (Galli et al. 2024, Fig. 2).")],
            tables=[Table(["ε", "ν (joint)", "ν_q chosen", "ν_g chosen", "ν_q/ν"], choice_rows,
                          caption="Chosen noise split per ε.")],
        ))
    if lt_ma is not None:
        rows = coerce_lt_ma(lt_ma)
        p = F.lt_vs_ma(rows, fig_dir / "lt_vs_ma.png")
        k_star = F.ma_break_even(rows)
        tail = f" MA is no more expensive up to k = {k_star}." if k_star is not None else " LT is cheaper at every k."
        sections.append(Section(
            "Cost of tuning: Liu–Talwar vs moments accountant",
            figures=[FigureRef(p, "ε of the whole search vs the number of candidates k: Liu–Talwar random "
                                  "stopping vs composing every run with the moments accountant (Mohapatra "
                                  "et al. 2022, Fig. 6)." + tail)],
            attachments=[write_csv(out / "lt_vs_ma.csv",
                                   [{"k": r.k, "eps_LT": r.eps_lt, "eps_MA": r.eps_ma} for r in rows])],
        ))
    if linear_scaling is not None:
        p = F.linear_scaling(linear_scaling, fig_dir / "linear_scaling.png")
        sections.append(Section(
            "Linear scaling rule",
            figures=[FigureRef(p, "r = η·T found by the cheap searches vs ε, the fitted line, and the value it "
                                  "extrapolates to at the target ε (Panda et al. 2024, Fig. 3).")],
        ))
    if extra_figures:
        sections.append(Section("Additional figures", figures=[
            f if isinstance(f, FigureRef) else FigureRef(Path(f[0]), str(f[1])) for f in extra_figures]))
    sections.extend(extra_sections)

    return write_report(out, title, sections, selection_mode=selection_mode, planned=planned_b, spent=spent_b,
                        accountant=accountant, selection_split=selection_split, budgets=budgets,
                        subtitle=subtitle)


# ----------------------------------------------------------------------------- from a Ledger
def _nu_q(event: dp_event.DpEvent) -> tuple[float | None, float | None]:
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
            nu, q = _nu_q(event)
            rows.append(LedgerRow(run, label, count, eps, (planned_epsilon or {}).get(run), nu, q))
    return rows
