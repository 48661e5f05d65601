"""``dptune.presets``: every experiment of the three papers in one command, at three scales.

>>> from dptune.presets import list_presets, reproduce, demo
>>> [p["name"] for p in list_presets()][:3]
['galli-mnist', 'galli-fmnist-ae', 'galli-agnews']
>>> reproduce("galli-agnews", "smoke", "runs/galli-agnews")      # doctest: +SKIP
>>> demo("runs/demo")                                             # doctest: +SKIP

Scales (``SCALES``): ``paper`` — the papers' settings (a GPU job; ``plan_preset`` plans it
without training); ``small`` — real data with reduced grids, epochs and seeds, ≤ 60 min per
preset on a 2-core CPU; ``smoke`` — tiny subsets and a few steps, run in CI.

Each preset is one or more tuner studies (``dptune.tune``: every run's privacy is planned
before training and counted in the study ledger) plus, where the paper has them, theory
tables and figures. ``reproduce`` writes into ``out_dir``:

* ``<part>/`` — each study's directory (``study.sqlite``; it can be resumed with ``dptune
  resume``): ``<part>/release/`` (``report.html``, the study's publishable report, figures,
  ``results.csv``) and ``<part>/diagnostics/`` (not differentially private: every run, per-run
  budgets, histories with training loss and batch sizes; for the data owner only);
* ``report.html`` — one page for the preset: every part's results table and figures, the
  theory sections; ``results.csv`` — every part's release table in one file (the full tables,
  labelled not DP, in ``diagnostics/results.csv``).

See ``docs/reproduce.md`` for each preset's exact settings, deviations and time estimates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from dptune.errors import ConfigError
from dptune.metrics import clip_to_range
from dptune.outputs import NOT_DP_LABEL, diagnostics_dir, write_csv_rows, write_labelled_csv
from dptune.presets import _report, galli, mohapatra, panda
from dptune.presets._common import SCALES, Part, Preset, check_scale, ensure_dir, log_grid
from dptune.presets._demo import demo_study
from dptune.report.html import FigureRef, Section, Table, write_report
from dptune.tune import plan_study, run_study, study_from_dict
from dptune.tune.data import study_data
from dptune.tune.executors import check_workers
from dptune.tune.results import private_rows, release_rows, render, render_nonprivate
from dptune.tune.spec import DataSpec
from dptune.tune.store import Store
from dptune.tune.study import check_study_device, study_metric

__all__ = [
    "PRESETS",
    "SCALES",
    "Preset",
    "Part",
    "list_presets",
    "presets_table",
    "get_preset",
    "preset_parts",
    "preset_study",
    "preset_studies",
    "plan_preset",
    "reproduce",
    "demo",
    "demo_study",
    "log_grid",
    "study_report",
]

PRESETS: dict[str, Preset] = {}


def _register(p: Preset) -> None:
    PRESETS[p.name] = p


_GALLI_EST = {
    "mnist": {
        "smoke": "≈ 10 s",
        "small": "≈ 30 min (51 runs × 71 steps × 256 examples of the Galli CNN; measured 32–38 s/run)",
        "paper": "GPU: 1,995 runs × 1,170 steps (k = 7); ≈ 2.9 h projected on one H100 (the gpu-slice's "
        "5.3 s of wall time per run at 8 workers)",
        "gpu-slice": "GPU: 5 min 42 s measured on one H100 with --executor process --workers 8 (65 runs × "
        "1,172 steps, full MNIST, k = 5, ε = 3; the GPU 98–99 % busy)",
    },
    "fmnist-ae": {
        "smoke": "≈ 10 s",
        "small": "≈ 35 min (51 runs × 59 steps × 128 examples of the autoencoder; 36–44 s/run)",
        "paper": "GPU: 1,995 runs × 1,170 steps (k = 7)",
    },
    "agnews": {
        "smoke": "≈ 5 s",
        "small": "≈ 10 min (297 runs × 119 steps × 512 examples, small FC net; 1.4–1.9 s/run)",
        "paper": "GPU (or a few CPU hours): 1,995 runs × 119 steps (k = 7)",
    },
}
for _ds, _paper_name in (("mnist", "MNIST"), ("fmnist-ae", "Fashion-MNIST autoencoder"), ("agnews", "AG News")):
    _register(
        Preset(
            name=f"galli-{_ds}",
            paper="Galli et al. 2024 (OSO-DPSGD)",
            summary=f"{_paper_name}: Online vs FixedThreshold vs FixedQuantile vs AdamWOSM vs NoDP, per-grid budgets",
            build=partial(galli.build, _ds),
            options={"k": None, "steps": None, "limit": None},
            estimates=_GALLI_EST[_ds],
            scales=(*SCALES, "gpu-slice") if _ds == "mnist" else SCALES,
        )
    )

_MOH_EST = {
    "mnist": {"smoke": "≈ 15 s", "small": "≈ 12 min (2 models × 180 runs × 600 steps)", "paper": "GPU"},
    "adult": {"smoke": "≈ 10 s", "small": "≈ 8 min (2 models × 180 runs × 600 steps)", "paper": "GPU"},
    "enron": {"smoke": "≈ 10 s", "small": "≈ 20 min (2 models × 180 runs × 300 steps, 5,512 inputs)", "paper": "GPU"},
}
for _ds, _paper_name in (("mnist", "MNIST"), ("adult", "Adult"), ("enron", "ENRON")):
    _register(
        Preset(
            name=f"mohapatra-{_ds}",
            paper="Mohapatra et al. 2022 (honest tuning, adaptive optimizers)",
            summary=f"{_paper_name}, LR and TLNN: DPSGD, DPMomentum, DPAdam, ADADP, DPAdamWOSM at σ ∈ {{2, 4, 8}}",
            build=partial(mohapatra.build, _ds),
            extra=lambda out, scale, options, parts, console: mohapatra.report_sections(out, scale, parts),
            estimates=_MOH_EST[_ds],
        )
    )

_register(
    Preset(
        name="mohapatra-lt-vs-ma",
        paper="Mohapatra et al. 2022, appendix F",
        summary="cost of Liu–Talwar vs moments accountant by number of candidates (no training)",
        build=lambda scale, options: [],
        extra=lambda out, scale, options, parts, console: mohapatra.lt_vs_ma_extra(out, scale),
        estimates={"smoke": "≈ 2 s", "small": "≈ 2 s", "paper": "≈ 2 s (no training at any scale)"},
    )
)
_register(
    Preset(
        name="panda-linear-scaling-mnist",
        paper="Panda et al. 2024 (linear scaling rule)",
        summary="MNIST CNN from scratch, full-batch DP-GD, linear scaling vs random search vs grid oracle",
        build=panda.build_mnist,
        options={"average": None},
        estimates={
            "smoke": "≈ 10 s",
            "small": "≈ 30 min (24 full-batch runs of 5–30 steps on 1,500 images; ≈ 3 s/step)",
            "paper": "GPU: full-batch DP-GD on 60,000 images",
        },
    )
)
_register(
    Preset(
        name="panda-linear-scaling-text",
        paper="Panda et al. 2024 (linear scaling rule)",
        summary="MiniLM features + zero-init linear probe on AG News and Enron, full-batch DP-GD, linear scaling",
        build=panda.build_text,
        options={"average": None},
        estimates={
            "smoke": "≈ 40 s (MiniLM embeds 80 texts on a cold cache)",
            "small": "≈ 15 min (MiniLM embeds 6,000 texts ≈ 6 min; 576 probe runs ≈ 5 min)",
            "paper": "≈ 30–45 CPU minutes for the embeddings (cached afterwards), training minutes",
        },
    )
)


def list_presets() -> list[dict[str, Any]]:
    """Name, paper, summary and per-scale time estimates of every preset."""
    return [
        {
            "name": p.name,
            "paper": p.paper,
            "summary": p.summary,
            "options": sorted(p.options),
            "scales": list(p.scales),
            "estimates": dict(p.estimates),
        }
        for p in PRESETS.values()
    ]


def presets_table() -> Any:
    """``dptune reproduce list``: a ``rich`` table of the presets (name, paper and summary, time
    estimate per scale) that fits 100 columns whatever the console width (long cells fold)."""
    from rich.markup import escape
    from rich.table import Table

    # 4 borders + 3×2 padding + these caps = 100 columns.
    t = Table(
        title="dptune reproduce NAME --scale smoke|small|paper",
        title_justify="left",
        show_lines=True,
        caption="Settings, deviations from the papers and measured times: docs/reproduce.md.",
        caption_justify="left",
        header_style="bold",
    )
    t.add_column("preset", style="cyan", overflow="fold", max_width=26)
    t.add_column("paper, what it runs", overflow="fold", max_width=34)
    t.add_column("time per scale", overflow="fold", max_width=30)
    for p in list_presets():
        opts = f"\n[dim]options: {', '.join('--' + o for o in p['options'])}[/]" if p["options"] else ""
        scales = [*SCALES, *(s for s in p["estimates"] if s not in SCALES)]  # extra scales too (gpu-slice)
        est = "\n".join(f"[bold]{s}[/]: {escape(p['estimates'].get(s, '?'))}" for s in scales)
        t.add_row(p["name"], escape(f"{p['paper']}: {p['summary']}") + opts, est)
    return t


def get_preset(name: Any) -> Preset:
    """The preset called ``name``, or a ``ConfigError`` listing the presets."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in PRESETS:
        import difflib

        close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown preset {name!r}.{hint} Fix: choose one of {', '.join(PRESETS)} "
            "(`dptune reproduce list` shows them)."
        )
    return PRESETS[key]


def preset_parts(name: str, scale: str, **options: Any) -> list[Part]:
    """The parts (one tuner study each, as ``study_from_dict`` dicts) of a preset at a scale.

    Mohapatra presets read the dataset's size (their budgets depend on q = L/n): the data
    must be available (``DPTUNE_DATA_DIR``)."""
    preset = get_preset(name)
    return preset.parts(check_scale(scale, preset.scales), **options)


def preset_studies(name: str, scale: str, **options: Any) -> dict[str, Any]:
    """``{part name: dptune.tune.Study}`` of a preset (empty for theory-only presets)."""
    return {p.name: study_from_dict(p.study_dict()) for p in preset_parts(name, scale, **options)}


def preset_study(name: str, scale: str, part: str | None = None, **options: Any) -> Any:
    """The ``dptune.tune.Study`` of a one-part preset, or of part ``part`` of a larger one."""
    studies = preset_studies(name, scale, **options)
    if not studies:
        raise ConfigError(
            f"preset {name!r} trains nothing (it computes theory tables and figures). "
            f"Fix: run it with reproduce({name!r}, scale, out_dir)."
        )
    if part is None:
        if len(studies) == 1:
            return next(iter(studies.values()))
        raise ConfigError(f"preset {name!r} has several studies: {', '.join(studies)}. Fix: pass part=<one of them>.")
    if part not in studies:
        raise ConfigError(f"preset {name!r} has no part {part!r}. Fix: choose one of {', '.join(studies)}.")
    return studies[part]


def _sizes(data: Mapping[str, Any], seed: int, selection: Any) -> tuple[int, int, str]:
    """(n_train, n_val, task) of a data section without computing text embeddings: the loader's
    splits do not depend on the representation, so MiniLM sections are sized with 'counts'
    (not with a holdout: it is assigned by a hash of each example's features)."""
    opts = dict(data.get("options", {}))
    if opts.get("representation") == "minilm" and selection.split != "holdout":
        opts["representation"] = "counts"
    d = study_data(DataSpec(name=data["name"], options=opts), selection, seed)
    return d.n_train, d.n_val, d.task


def plan_preset(name: str, scale: str, **options: Any) -> dict[str, Any]:
    """``{part name: dptune.tune.StudyPlan}``: every run's noise multiplier, steps and planned
    privacy event, computed without training (``paper`` scale included)."""
    plans = {}
    for p in preset_parts(name, scale, **options):
        st = study_from_dict(p.study_dict())
        n_tr, n_val, task = _sizes(p.study["data"], st.seed, st.selection)
        plans[p.name] = plan_study(st, n_tr, n_val, study_metric(st, task))
    return plans


@contextmanager
def data_dir_env(data_dir: str | os.PathLike[str] | None) -> Iterator[None]:
    """Point ``DPTUNE_DATA_DIR`` at ``data_dir`` for the duration (inherited by process workers)."""
    if data_dir is None:
        yield
        return
    p = Path(data_dir).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"data directory {str(p)!r} does not exist. Fix: pass the folder that holds "
            "mnist/, fashion_mnist/, ... (e.g. shared/data), or omit --data-dir to download."
        )
    old = os.environ.get("DPTUNE_DATA_DIR")
    os.environ["DPTUNE_DATA_DIR"] = str(p.resolve())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DPTUNE_DATA_DIR", None)
        else:
            os.environ["DPTUNE_DATA_DIR"] = old


def _console(console: Any) -> Any:
    if console is not None:
        return console
    from rich.console import Console

    return Console(width=100)


def _default_device(scale: str) -> str:
    if scale not in ("paper", "gpu-slice"):
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if scale == "gpu-slice":
        raise ConfigError(
            "the gpu-slice scale needs a CUDA GPU, and this PyTorch build sees none "
            f"(torch {torch.__version__}, cuda available: False). Fix: run it on a GPU machine, or "
            "check it here with --device cpu --steps 3 --limit 2000 (not comparable with the paper)."
        )
    return "cpu"


def _run_part(
    part: Part,
    study_dir: Path,
    *,
    executor: str,
    workers: int | None,
    progress: bool,
    device: str,
    console: Any,
    figures: Any = None,
) -> tuple[list[dict[str, Any]], Path]:
    d = part.study_dict()
    d["training"]["device"] = device
    study = study_from_dict(d)
    if (study_dir / "study.sqlite").is_file():  # a re-run resumes: retry failed runs, keep finished ones
        with Store(study_dir) as store:
            if store.has_plan() and store.get_meta("fingerprint") == study.fingerprint():
                store.reset_failed()
    outcome = run_study(study, study_dir, executor=executor, progress=progress, workers=workers)
    console.print()
    render(study_dir, console)
    render_nonprivate(study_dir, console)  # the NoDP ceiling: exact scores, under the label only
    extra = list(figures(study_dir)) if figures is not None else []
    html = _report.study_report(
        study_dir, title=f"{study.name}: {part.title}", notes=list(part.notes), extra_figures=extra
    )
    if not outcome.complete:
        console.print(
            f"[yellow]some runs failed ({outcome.counts}): re-run the same command (or "
            f"`dptune resume {study_dir}`) to retry them.[/yellow]"
        )
    return outcome.rows, html


def reproduce(
    name: str,
    scale: str,
    out_dir: str | os.PathLike[str],
    *,
    data_dir: str | os.PathLike[str] | None = None,
    executor: str = "local",
    progress: bool = True,
    workers: int | None = None,
    device: str | None = None,
    console: Any = None,
    **options: Any,
) -> Path:
    """Run preset ``name`` at ``scale`` into ``out_dir``; print its tables; return ``out_dir``.

    ``data_dir``: the datasets folder (else ``DPTUNE_DATA_DIR``, else downloads);
    ``executor``: local | process | ray (``workers`` processes); ``device``: torch device of
    every run (default: cuda at the paper scale when available, else cpu); ``options``:
    preset options (Galli presets: ``k``, the grid granularity, paper default 7; Panda presets:
    ``average`` = "ema" | "swa", the iterate-averaging ablation arm).
    Re-running with the same ``out_dir`` resumes: finished runs are kept, failed ones retried.
    """
    preset = get_preset(name)
    scale = check_scale(scale, preset.scales)
    if executor not in ("local", "process", "ray"):
        raise ConfigError(f"unknown executor {executor!r}. Fix: choose local, process or ray.")
    device = device or _default_device(scale)
    preset.parts(scale, **options)  # options checked before any folder is made
    check_workers(workers)
    check_study_device(device, executor, None)  # before any folder is made
    created = not os.path.lexists(out_dir)
    out = ensure_dir(out_dir)
    try:
        console = _console(console)
        t0 = time.perf_counter()
        with data_dir_env(data_dir):
            parts = preset.parts(scale, **options)
            console.print(
                f"[bold]{preset.name}[/bold] ({scale}): {preset.summary}. Estimated time: "
                f"{preset.estimates.get(scale, '?')}."
            )
            figures = panda.report_figures if preset.name.startswith("panda-") else None
            all_rows, sections, extra_sections = [], [], []
            for part in parts:
                console.print(f"\n[bold]{part.title}[/bold] → {out / part.name}")
                rows, html = _run_part(
                    part,
                    out / part.name,
                    executor=executor,
                    workers=workers,
                    progress=progress,
                    device=device,
                    console=console,
                    figures=figures,
                )
                all_rows.extend({"part": part.name, **r} for r in rows)
                sections.append(_part_section(part, rows, html, out))
                comparison = paper_comparison(part, rows)
                if comparison is not None:
                    sections[-1] = dataclasses.replace(sections[-1], tables=[*sections[-1].tables, comparison])
                    _print_table(console, f"{part.title}: ours beside the paper", comparison)
            if preset.extra is not None:
                extra_sections = list(preset.extra(out, scale, dict(options), parts, console))
                sections.extend(extra_sections)
        if all_rows:
            # release: the selected configurations and guarantees of the private arms; the rest is
            # not DP (run counts, run ids, diverged counts over every candidate, the NoDP baseline).
            write_csv_rows(
                out / "results.csv",
                [{"part": r["part"], **release_rows([r])[0]} for r in private_rows(all_rows)],
            )
            write_labelled_csv(diagnostics_dir(out) / "results.csv", all_rows)
        mode = None
        if parts:
            mode = parts[0].study.get("selection", {}).get("mode", "public")
        write_report(
            out,
            f"{preset.name} ({scale})",
            sections,
            selection_mode=mode,
            # No run time on the published page: it grows with the secret K of Liu–Talwar arms and
            # with the realised batch sizes. It is printed below, under the label.
            subtitle=f"{preset.paper} · reproduced at the {scale} scale",
        )
        for sec in extra_sections:  # theory tables (LT vs MA, the cost of each grid at fixed σ)
            for t in sec.tables:
                _print_table(console, sec.title, t)
        console.print(f"\nreport: {out / 'report.html'}")
        console.print(f"[dim]run time ({NOT_DP_LABEL}): {time.perf_counter() - t0:.0f} s[/dim]", highlight=False)
        return out
    except BaseException:
        if created:  # a plan that failed leaves no folder behind (rmdir: only if nothing is in it)
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _print_table(console: Any, title: str, t: Any) -> None:
    from rich.table import Table as RichTable

    rt = RichTable(title=title)
    for c in t.columns:
        rt.add_column(str(c), overflow="fold")
    for r in t.rows:
        rt.add_row(*(str(v) for v in r))
    console.print(rt)


def _fmt_metric(m: float | None, s: float | None, metric: str) -> str:
    if m is None:
        return "—"
    m = clip_to_range(m, metric)  # a noisy private score can leave the metric's range: shown clipped
    scale = 100.0 if metric == "accuracy" else 1.0
    out = f"{m * scale:.2f}" if metric == "accuracy" else f"{m:.4g}"
    if s is not None:
        out += f" ± {s * scale:.2f}" if metric == "accuracy" else f" ± {s:.2g}"
    return out


def paper_comparison(part: Part, rows: list[dict[str, Any]]) -> Any:
    """Ours beside the paper's published number for every (strategy, ε) cell the paper reports
    (``Part.paper_scores``), with the difference in the paper's unit; None if it reports none."""
    if not part.paper_scores:
        return None
    unit = part.paper_unit
    # Ours for the private arms only: a non-private arm's exact score is not published (the paper's may be).
    ours = {(r["optimizer"], float(r["epsilon"])): r for r in private_rows(rows) if r.get("method") != "random"}
    body = []
    for (arm, eps), (p_mean, p_std) in sorted(part.paper_scores.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        r = ours.get((arm, eps))
        if r is None or r.get("value_mean") is None:
            body.append([arm, f"{eps:g}", "not run", f"{p_mean:.2f} ± {p_std:.2f}", "—", "—"])
            continue
        m = float(r["value_mean"]) * unit
        s = r.get("value_std")
        ours_txt = f"{m:.2f}" + (f" ± {float(s) * unit:.2f}" if s is not None else "")
        diff = m - p_mean
        within = "yes" if abs(diff) <= 2 * p_std else "no"
        body.append([r["strategy"], f"{eps:g}", ours_txt, f"{p_mean:.2f} ± {p_std:.2f}", f"{diff:+.2f}", within])
    return Table(
        ["strategy", "ε", "ours", "paper", "ours − paper", "within 2 paper std"],
        body,
        caption=f"Paper: {part.paper_source}. Both are the selected configuration's score "
        f"(×{unit:g}); ours from this run's seeds.",
    )


def _part_section(part: Part, rows: list[dict[str, Any]], html: Path, out: Path) -> Any:
    metric = rows[0]["metric"] if rows else "accuracy"
    table = Table(
        [
            "strategy",
            "ε",
            "method",
            "selected configuration",
            f"{metric}" + (" (%)" if metric == "accuracy" else ""),
            "planned ε",
            "spent ε",
        ],
        [
            [
                r["strategy"],
                "∞" if not math.isfinite(r["epsilon"]) else f"{r['epsilon']:.4g}",
                r["method"],
                r["selected"] or "—",
                _fmt_metric(r["value_mean"], r["value_std"], metric),
                "∞" if not math.isfinite(r["planned_epsilon"]) else f"{r['planned_epsilon']:.4g}",
                "∞" if not math.isfinite(r["spent_epsilon"]) else f"{r['spent_epsilon']:.4g}",
            ]
            for r in private_rows(rows)  # the NoDP ceiling: in the diagnostics only
        ],
        caption="Selected configuration per strategy and ε (mean ± std over seeds).",
    )
    figs = []
    fig_dir = html.parent / "figures"
    for fname, cap in (
        ("metric_vs_epsilon.png", f"{metric} vs ε per strategy"),
        ("r_vs_epsilon.png", "r = η·T vs ε (linear scaling)"),
        (panda.HEATMAP_FILE, "η × T heatmaps per ε (every grid-oracle run; covered at the grid's composed ε)"),
    ):
        if (fig_dir / fname).is_file():
            figs.append(FigureRef(fig_dir / fname, cap))
    rel = os.path.relpath(html, out)
    return Section(
        part.title,
        paragraphs=[*part.notes, f"Full report (trajectories, budgets): {rel}"],
        figures=figs,
        tables=[table],
    )


def demo(
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    *,
    executor: str = "local",
    workers: int | None = None,
    console: Any = None,
) -> Path:
    """The README's main job: an honest study on embedded MNIST (5k) comparing Online,
    FixedThreshold, FixedQuantile and AdamWOSM at ε ∈ {3, 8} with per-grid budgets (plus a
    NoDP ceiling). Prints the table, writes ``out_dir/release/report.html``; returns ``out_dir``
    (the study directory: ``dptune status``/``resume``/``report`` work on it)."""
    check_workers(workers)  # before the folder is made
    out = ensure_dir(out_dir)
    console = _console(console)
    t0 = time.perf_counter()
    study = study_from_dict(demo_study())
    console.print(
        "[bold]dptune demo[/bold]: honest tuning on MNIST (5,000 embedded images), ε ∈ {3, 8}, "
        "δ = 1e-5, every configuration of every grid paid for."
    )
    run_study(study, out, executor=executor, progress=progress, workers=workers)
    console.print()
    render(out, console)
    render_nonprivate(out, console)  # the NoDP ceiling: exact scores, under the label only
    html = _report.study_report(
        out,
        title="dptune demo: honest tuning on MNIST (5k)",
        notes=[
            "Each strategy's whole grid fits in the stated ε (per-grid budget): a larger grid "
            "means more noise per run. Seeds are not accounted (one seed here).",
            "Selection on the test split, treated as public (as in the papers).",
        ],
    )
    console.print(f"\nreport: {html}")
    # The run time grows with the realised batch sizes: a diagnostic, printed under the label.
    console.print(f"[dim]run time ({NOT_DP_LABEL}): {time.perf_counter() - t0:.0f} s[/dim]", highlight=False)
    return out


def study_report(study_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None, **kw: Any) -> Path:
    """HTML report of any stored study directory (see ``dptune.presets._report.study_report``)."""
    return _report.study_report(study_dir, out_dir, **kw)
