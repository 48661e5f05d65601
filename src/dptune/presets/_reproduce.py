"""``reproduce`` (run a preset's studies and write its report) and ``demo`` (the README's main job)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from rich.table import Table as RichTable

from dptune.errors import ConfigError
from dptune.outputs import (
    NOT_DP_LABEL,
    diagnostics_dir,
    print_table,
    publish_note,
    refuse_foreign_dir,
    refuse_inside_release,
    terminal_console,
    up,
    write_csv_rows,
    write_labelled_csv,
)
from dptune.presets import _report, panda
from dptune.presets._catalog import get_preset
from dptune.presets._common import Part, check_scale, ensure_dir
from dptune.presets._demo import demo_study
from dptune.report.html import FigureRef, Section, Table, write_report
from dptune.tune import results, run_study, study_from_dict
from dptune.tune.executors import check_workers
from dptune.tune.results import metric_text, private_rows, release_rows, render, render_nonprivate
from dptune.tune.store import Store
from dptune.tune.study import check_study_device


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


def _default_device(scale: str) -> str:
    if scale not in ("paper", "gpu-slice"):
        return "cpu"
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
    part: Part, study_dir: Path, device: str, run: dict[str, Any], console: Any, figures: Any = None
) -> tuple[list[dict[str, Any]], Path]:
    """Run one part's study (``run``: ``run_study``'s options), print its tables, write its report."""
    d = part.study_dict()
    d["training"]["device"] = device
    study = study_from_dict(d)
    if (study_dir / "study.sqlite").is_file():  # a re-run resumes: retry failed runs, keep finished ones
        with Store(study_dir) as store:
            if store.has_plan() and store.get_meta("fingerprint") == study.fingerprint():
                store.reset_failed()
    outcome = run_study(study, study_dir, **run)
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


MARK = ".dptune-reproduce"


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
    """Run preset ``name`` at ``scale`` into ``out_dir`` (resumable), print its tables, return ``out_dir``.
    ``data_dir``: else ``DPTUNE_DATA_DIR``, else downloads; ``device``: default cuda at the paper scale
    when available; ``options``: the preset's (Galli: ``k``; Panda: ``average``)."""
    preset = get_preset(name)
    scale = check_scale(scale, preset.scales)
    if executor not in ("local", "process", "ray"):
        raise ConfigError(f"unknown executor {executor!r}. Fix: choose local, process or ray.")
    device = device or _default_device(scale)
    with data_dir_env(data_dir):  # options checked before any folder is made (a part may load its data)
        ours = [f"{part.name}/study.sqlite" for part in preset.parts(scale, **options)] + [MARK]
    refuse_foreign_dir(out_dir, ours, "--out", f"or the --out of an earlier `dptune reproduce {name}` (it resumes).")
    refuse_inside_release(out_dir, "--out")
    check_workers(workers)
    check_study_device(device, executor, None)  # before any folder is made
    created = not os.path.lexists(out_dir)
    out = ensure_dir(out_dir)
    (out / MARK).write_text(name + "\n")  # this folder is a reproduction's: a later run may resume into it
    try:
        console = console or terminal_console()
        t0 = time.perf_counter()
        with data_dir_env(data_dir):
            parts = preset.parts(scale, **options)
            console.print(
                f"[bold]{preset.name}[/bold] ({scale}): {preset.summary}. Estimated time: "
                f"{preset.estimates.get(scale, '?')}."
            )
            run = {"executor": executor, "progress": progress, "workers": workers}
            figures = panda.report_figures if preset.name.startswith("panda-") else None
            sections = _run_parts(parts, out, console, device=device, run=run, figures=figures)
            extra = list(preset.extra(out, scale, dict(options), parts, console)) if preset.extra is not None else []
        mode = parts[0].study.get("selection", {}).get("mode", "public") if parts else None
        # No run time on the published page: it grows with the secret K of Liu–Talwar arms and
        # with the realised batch sizes. It is printed below, under the label.
        subtitle = f"{preset.paper} · reproduced at the {scale} scale"
        write_report(out, f"{preset.name} ({scale})", [*sections, *extra], selection_mode=mode, subtitle=subtitle)
        for sec in extra:  # theory tables (LT vs MA, the cost of each grid at fixed σ)
            for t in sec.tables:
                _print_table(console, sec.title, t)
        console.print(f"\nreport: {out / 'report.html'}")
        console.print(f"[dim]run time ({NOT_DP_LABEL}): {time.perf_counter() - t0:.0f} s[/dim]", highlight=False)
        return out
    except BaseException:
        if created:  # a plan that failed leaves no folder behind (rmdir: only if nothing else is in it)
            with contextlib.suppress(OSError):
                if [c.name for c in out.iterdir()] == [MARK]:
                    (out / MARK).unlink()
                out.rmdir()
        raise


def _run_parts(parts: list[Part], out: Path, console: Any, **run_part: Any) -> list[Section]:
    """Run every part (``_run_part``), write the preset's results CSVs, return one report section per part."""
    all_rows: list[dict[str, Any]] = []
    sections = []
    for part in parts:
        console.print(f"\n[bold]{part.title}[/bold] → {out / part.name}")
        rows, html = _run_part(part, out / part.name, console=console, **run_part)
        all_rows.extend({"part": part.name, **r} for r in rows)
        comparison = paper_comparison(part, rows)
        if comparison is not None:
            _print_table(console, f"{part.title}: ours beside the paper", comparison)
        sections.append(_part_section(part, rows, html, out, comparison))
    if all_rows:
        # release: the selected configurations and guarantees of the private arms; the rest is
        # not DP (run counts, run ids, diverged counts over every candidate, the NoDP baseline).
        write_csv_rows(
            out / "results.csv", [{"part": r["part"], **release_rows([r])[0]} for r in private_rows(all_rows)]
        )
        write_labelled_csv(diagnostics_dir(out) / "results.csv", all_rows)
    return sections


def _print_table(console: Any, title: str, t: Any) -> None:
    rt = RichTable(title=title)
    for c in t.columns:
        rt.add_column(str(c), overflow="fold")
    for r in t.rows:
        rt.add_row(*(str(v) for v in r))
    print_table(console, rt)


def paper_comparison(part: Part, rows: list[dict[str, Any]]) -> Any:
    """Ours beside the paper's published number for every (strategy, ε) cell the paper reports
    (``Part.paper_scores``, in its unit: ÷ ``paper_unit`` gives ours), with the difference, all in
    our unit (accuracy as a fraction); None if it reports none."""
    if not part.paper_scores:
        return None
    unit = part.paper_unit
    # Ours for the private arms only: a non-private arm's exact score is not published (the paper's may be).
    ours = {(r["optimizer"], float(r["epsilon"])): r for r in private_rows(rows) if r.get("method") != "random"}
    body = []
    for (arm, eps), (p_mean, p_std) in sorted(part.paper_scores.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        r, p_mean, p_std = ours.get((arm, eps)), p_mean / unit, p_std / unit
        paper = f"{p_mean:.4g} ± {p_std:.2g}"
        if r is None or r.get("value_mean") is None:
            body.append([arm, f"{eps:g}", "not run", paper, "—", "—"])
            continue
        m, s = float(r["value_mean"]), r.get("value_std")
        diff = m - p_mean
        within = "yes" if abs(diff) <= 2 * p_std else "no"
        ours_txt = f"{m:.4g}" + (f" ± {float(s):.2g}" if s is not None else "")
        body.append([r["strategy"], f"{eps:g}", ours_txt, paper, f"{diff:+.3g}", within])
    return Table(
        ["strategy", "ε", "ours", "paper", "ours − paper", "within 2 paper std"],
        body,
        caption=f"Paper: {part.paper_source} (its numbers ÷ {unit:g}, in our unit). Both are the selected "
        "configuration's score; ours from this run's seeds.",
    )


def _part_section(part: Part, rows: list[dict[str, Any]], html: Path, out: Path, comparison: Any) -> Section:
    metric = rows[0]["metric"] if rows else "accuracy"
    table = Table(
        ["strategy", "ε", "method", "selected configuration", metric, "planned ε", "spent ε"],
        [
            [r["strategy"], up(r["epsilon"], 4), r["method"], r["selected"] or "—"]
            + [metric_text(r["value_mean"], r["value_std"], metric), up(r["planned_epsilon"], 4)]
            + [up(r["spent_epsilon"], 4)]
            for r in private_rows(rows)  # the NoDP ceiling: in the diagnostics only
        ],
        caption="Selected configuration per strategy and ε (mean ± std over seeds).",
    )
    fig_dir = html.parent / "figures"
    figures = [
        FigureRef(fig_dir / fname, caption)
        for fname, caption in (
            ("metric_vs_epsilon.png", f"{metric} vs ε per strategy"),
            ("r_vs_epsilon.png", "r = η·T vs ε (linear scaling)"),
            (panda.HEATMAP_FILE, "η × T heatmaps per ε (every grid-oracle run; covered at the grid's composed ε)"),
        )
        if (fig_dir / fname).is_file()
    ]
    paragraphs = [*part.notes, f"Full report (trajectories, budgets): {os.path.relpath(html, out)}"]
    return Section(part.title, paragraphs, figures, [table] if comparison is None else [table, comparison])


def demo(
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    *,
    executor: str = "local",
    workers: int | None = None,
    console: Any = None,
) -> Path:
    """The README's main job (``presets._demo``): print the table, write the report, return the study directory."""
    check_workers(workers)  # before the folder is made
    refuse_foreign_dir(out_dir, ["study.sqlite"], "--out", "or the --out of an earlier `dptune demo` (it resumes).")
    refuse_inside_release(out_dir, "--out")
    out = ensure_dir(out_dir)
    console = console or terminal_console()
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
    console.print(publish_note(out), highlight=False)
    console.print(results.release_note(results.load_study(out)[1]) or "", highlight=False)  # arms published together
    # The run time grows with the realised batch sizes: a diagnostic, printed under the label.
    console.print(f"[dim]run time ({NOT_DP_LABEL}): {time.perf_counter() - t0:.0f} s[/dim]", highlight=False)
    return out
