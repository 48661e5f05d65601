"""One self-contained HTML page per study (base64 figures, inline CSS, no scripts, nothing external), so
it can be mailed or opened offline. All text is HTML-escaped: callers pass plain strings."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptune.errors import ConfigError
from dptune.outputs import NOT_DP_LABEL, NOT_DP_NOTICE, up

# Attachments above this size stay beside the page instead of bloating it (figures are
# always embedded: they are what the page is for, and a PNG is small).
MAX_EMBED_BYTES = 2_000_000

SELECTION_SPLITS: dict[str, str] = {
    "test": (
        "Selection used the test split (as in the papers), so the reported metrics of the "
        "selected configurations are optimistically biased."
    ),
    "holdout": (
        "Selection used a holdout carved from the private training data (each example assigned by a "
        "keyed hash of its own content), so every score on it was released with Gaussian noise and "
        "charged (private mode only); metrics are reported on the test split."
    ),
}
SELECTION_MODES: dict[str, str] = {
    # Worded as an assumption: the selection split is only public if the data owner says so
    # (a holdout carved from the private training data is refused in this mode).
    "public": (
        "Hyperparameters were selected on validation data ASSUMED PUBLIC (never a holdout of the private "
        "training data): the selection is not charged, so only the training runs spend privacy. If that "
        "split is in fact private, the selection is NOT covered by the guarantee."
    ),
    "private": (
        "Hyperparameters were selected on PRIVATE validation data: the privacy cost of every run of "
        "the search and of the selection itself is included in the spent budget."
    ),
}


@dataclass(frozen=True)
class FigureRef:
    """A PNG to embed, with a caption saying what it shows."""

    path: Path
    caption: str = ""


@dataclass(frozen=True)
class Table:
    """A plain table: column names and rows of already formatted cells."""

    columns: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str = ""


@dataclass(frozen=True)
class Section:
    """A titled block of paragraphs, figures, tables and attached files (e.g. CSVs)."""

    title: str
    paragraphs: Sequence[str] = ()
    figures: Sequence[FigureRef] = ()
    tables: Sequence[Table] = ()
    attachments: Sequence[Path] = field(default_factory=tuple)
    # True: not covered by the guarantee (dptune.outputs); rendered under a red
    # banner, and only on a page written with write_report(..., diagnostics=True).
    diagnostic: bool = False


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;margin:0;
background:#f6f7f9;color:#1d2330;line-height:1.45}
main{max-width:1100px;margin:0 auto;padding:24px 28px 48px;background:#fff;min-height:100vh}
h1{font-size:1.7em;margin:0 0 4px} h2{font-size:1.25em;border-bottom:2px solid #dde3ea;
padding-bottom:4px;margin-top:34px} .meta{color:#5b6575;font-size:.9em;margin-bottom:14px}
.banner{border-left:6px solid #1f77b4;background:#eef5fb;padding:10px 14px;margin:12px 0}
.banner.private{border-color:#d62728;background:#fdf0f0}
.warn{border-left:6px solid #d62728;background:#ffe9e9;padding:10px 14px;margin:12px 0;font-weight:600}
table{border-collapse:collapse;margin:10px 0 18px;font-size:.9em}
th,td{border:1px solid #d5dbe3;padding:4px 9px;text-align:left;vertical-align:top}
th{background:#eef1f5} tr:nth-child(even) td{background:#fafbfc}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
figure{margin:14px 0 22px} figure img{max-width:100%;height:auto;border:1px solid #e3e7ec}
figcaption{color:#4a5363;font-size:.9em;margin-top:4px} caption{caption-side:bottom;color:#5b6575;
font-size:.85em;text-align:left;padding-top:4px} .files a{margin-right:14px}
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _data_uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def cell_text(v: Any) -> str:
    """Compact cell text: 4 significant digits for floats, ∞ for inf, — for missing."""
    if isinstance(v, float):
        return "∞" if math.isinf(v) else ("—" if math.isnan(v) else f"{v:.4g}")
    return "—" if v is None else str(v)


def _cell(v: Any) -> str:
    cls = ' class="num"' if isinstance(v, int | float) and not isinstance(v, bool) else ""
    return f"<td{cls}>{_esc(cell_text(v))}</td>"


def render_table(t: Table) -> str:
    head = "".join(f"<th>{_esc(c)}</th>" for c in t.columns)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in t.rows)
    cap = f"<caption>{_esc(t.caption)}</caption>" if t.caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _budget_text(pair: tuple[float, float] | None) -> tuple[str, str]:
    if pair is None:
        return "—", "—"
    eps, delta = pair
    return ("∞ (non-private)" if math.isinf(eps) else up(eps, 4)), up(delta)  # never read smaller than they are


def check_selection_mode(mode: str, split: str | None = None) -> None:
    """Before anything is written (found in review: a bad split was refused after the figures and CSVs)."""
    if mode not in SELECTION_MODES:
        raise ConfigError(
            f"selection_mode must be 'public' or 'private' (where the validation data that "
            f"picks hyperparameters comes from), got {mode!r}."
        )
    if split is not None and split not in SELECTION_SPLITS:
        raise ConfigError(f"selection_split must be 'test' or 'holdout' (or None), got {split!r}.")


def render_header(
    *,
    selection_mode: str | None,
    planned: tuple[float, float] | None,
    spent: tuple[float, float] | None,
    accountant: str | None = None,
    selection_split: str | None = None,
    budgets: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Selection-mode banner and planned vs spent (ε, δ); a red warning if spent exceeds planned."""
    parts = []
    if selection_mode is not None:
        check_selection_mode(selection_mode, selection_split)
        parts.append(
            f'<div class="banner {selection_mode}"><b>Selection mode: {_esc(selection_mode)} validation data.</b> '
            f"{_esc(SELECTION_MODES[selection_mode])} {_esc(SELECTION_SPLITS.get(selection_split or '', ''))}</div>"
        )
    if planned is not None or spent is not None:
        acct = f" (accountant: {accountant})" if accountant else ""
        rows = [["planned", *_budget_text(planned)], ["spent", *_budget_text(spent)]]
        parts.append(render_table(Table(["privacy budget", "ε", "δ"], rows)))
        parts.append(f'<p class="meta">Budget of the whole study, search included{_esc(acct)}.</p>')
        if _exceeds(planned, spent):
            parts.append(
                '<div class="warn">The spent budget EXCEEDS the plan. The study is not '
                "covered by its planned (ε, δ) guarantee; do not release its results.</div>"
            )
    if budgets:
        rows, over = [], []
        for b in budgets:
            label = str(b.get("label", ""))
            rows.append([label, *_budget_text(b.get("planned")), *_budget_text(b.get("spent")), str(b.get("note", ""))])
            if _exceeds(b.get("planned"), b.get("spent")):
                over.append(label)
        columns = ["tuning procedure", "planned ε", "planned δ", "spent ε", "spent δ", "scope"]
        parts.append(render_table(Table(columns, rows)))
        parts.append(
            '<p class="meta">Each row is one tuning procedure with its own budget (search and selection included).</p>'
        )
        if over:
            parts.append(
                f'<div class="warn">The spent budget EXCEEDS the plan for: {_esc(", ".join(over))}. '
                "Those results are not covered by their planned (ε, δ) guarantee.</div>"
            )
    return "\n".join(parts)


def _exceeds(planned: tuple[float, float] | None, spent: tuple[float, float] | None) -> bool:
    if planned is None or spent is None:
        return False
    return spent[0] > planned[0] * (1 + 1e-9) or spent[1] > planned[1] * (1 + 1e-9)


def render_section(s: Section) -> str:
    out = [f"<section><h2>{_esc(s.title)}</h2>"]
    if s.diagnostic:
        out.append(f'<div class="warn diagnostics">Diagnostics: {_esc(NOT_DP_LABEL)}.</div>')
    out += [f"<p>{_esc(p)}</p>" for p in s.paragraphs]
    for f in s.figures:
        p = Path(f.path)
        if not p.is_file():
            raise ConfigError(f"figure {str(p)!r} does not exist; create it before writing the report.")
        alt = _esc(f.caption or p.stem)
        cap = f"<figcaption>{_esc(f.caption)}</figcaption>" if f.caption else ""
        out.append(f'<figure><img alt="{alt}" src="{_data_uri(p, "image/png")}">{cap}</figure>')
    out += [render_table(t) for t in s.tables]
    links, big = [], []
    for a in map(Path, s.attachments):
        if a.stat().st_size > MAX_EMBED_BYTES:
            big.append(a.name)
        else:
            mime = "text/csv" if a.suffix == ".csv" else "application/octet-stream"
            links.append(f'<a download="{_esc(a.name)}" href="{_data_uri(a, mime)}">{_esc(a.name)}</a>')
    if links:
        out.append('<p class="files">Download: ' + " ".join(links) + "</p>")
    if big:
        out.append(f'<p class="meta">Too large to embed; next to this page: {_esc(", ".join(big))}.</p>')
    out.append("</section>")
    return "\n".join(out)


def write_report(
    out_dir: str | Path,
    title: str,
    sections: Sequence[Section],
    *,
    selection_mode: str | None = None,
    planned: tuple[float, float] | None = None,
    spent: tuple[float, float] | None = None,
    accountant: str | None = None,
    selection_split: str | None = None,
    budgets: Sequence[Mapping[str, Any]] = (),
    subtitle: str = "",
    filename: str = "report.html",
    diagnostics: bool = False,
) -> Path:
    """Write ``out_dir/filename``: the header (selection mode, planned vs spent, one ``budgets`` row per
    procedure), then the sections. Only a ``diagnostics=True`` page (red banner) may hold diagnostic sections."""
    leaked = [s.title for s in sections if s.diagnostic]
    if leaked and not diagnostics:
        raise ConfigError(
            f"sections {leaked} are diagnostics (not differentially private): write them on a "
            "page with write_report(..., diagnostics=True), never on the publishable page."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    meta = _esc(f"{subtitle} · generated {stamp} by dptune" if subtitle else f"generated {stamp} by dptune")
    body = [f"<h1>{_esc(title)}</h1>", f'<div class="meta">{meta}</div>']
    if diagnostics:
        body.append(
            f'<div class="warn diagnostics">{_esc(NOT_DP_NOTICE[:1].upper() + NOT_DP_NOTICE[1:])} The sections '
            "marked as diagnostics are not covered by the guarantee; publish only the page in the release/ "
            "folder.</div>"
        )
    budget: dict[str, Any] = dict(planned=planned, spent=spent, accountant=accountant, budgets=budgets)
    body.append(render_header(selection_mode=selection_mode, selection_split=selection_split, **budget))
    body += [render_section(s) for s in sections]
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head>\n<body><main>\n"
        + "\n".join(body)
        + "\n</main></body></html>\n"
    )
    path = out / filename
    path.write_text(page, encoding="utf-8")
    return path
