"""Tests of ``dptune.report``: aggregation, figures, the HTML page (also rendered in headless
Chromium), the terminal table and the non-private cosine diagnostic (Galli Fig. 1)."""

from __future__ import annotations

import base64
import csv
import dataclasses
import math
import re
import shutil
import statistics
import subprocess
from html.parser import HTMLParser
from io import StringIO
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT
from dp_accounting import dp_event
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from rich.cells import cell_len
from rich.console import Console
from torch import nn
from tune_helpers import linear_data, make_study
from typer.testing import CliRunner

from dptune import accounting
from dptune.cli import app
from dptune.errors import ConfigError
from dptune.outputs import NOT_DP_LABEL, read_csv_rows
from dptune.release.ledger import Ledger
from dptune.report import (
    FigureRef,
    LinearScalingFit,
    ReportInputs,
    RunHistory,
    Section,
    TrialResult,
    best_per_strategy,
    build_report,
    cosine_vs_clip,
    figures,
    ledger_rows_from_ledger,
    render_terminal_table,
    summarize,
    write_report,
)
from dptune.report.data import metric_label

SRC = ROOT / "src" / "dptune"


# ----------------------------------------------------------------------------- synthetic study
def synthetic_trials() -> list[dict]:
    """4 strategies × 3 ε × 2 learning rates × 3 seeds, a NoDP baseline, one diverged seed."""
    rng = np.random.default_rng(0)
    base = {"oso": 0.95, "dpsgd": 0.93, "quantile": 0.92, "adamwosm": 0.945}
    rows = []
    for s, b in base.items():
        for eps in (1.0, 3.0, 8.0):
            for lr in (0.1, 1.0):
                for seed in range(3):
                    v = b - 0.3 / eps - (0.02 if lr == 0.1 else 0.0) + rng.normal(0, 0.004)
                    rows.append(
                        {
                            "strategy": s,
                            "epsilon": eps,
                            "value": float(v),
                            "seed": seed,
                            "hyperparameters": {"lr": lr, "clip": 0.1},
                        }
                    )
    for seed in range(3):
        rows.append(
            {
                "strategy": "nodp",
                "epsilon": math.inf,
                "value": 0.985 + 0.001 * seed,
                "seed": seed,
                "hyperparameters": {"lr": 0.003162},
            }
        )
    # the better lr of quantile at ε=1 loses a seed to divergence: the robust config must win
    rows.append(
        {"strategy": "quantile", "epsilon": 1.0, "value": None, "seed": 3, "hyperparameters": {"lr": 1.0, "clip": 0.1}}
    )
    return rows


def synthetic_histories() -> list[RunHistory]:
    out = []
    for s in ("oso", "dpsgd", "quantile"):
        clip, lr, rows = 1.0, 0.5, []
        for t in range(1, 201):
            if s != "dpsgd":
                clip *= math.exp(-0.005 + 0.02 * math.sin(t / 7))
            if s == "oso":
                lr *= math.exp(0.002 * math.cos(t / 11))
            rows.append({"step": t, "clip": clip, "lr": lr})
        out.append(RunHistory(f"{s}-0", s, rows))
    out.append(RunHistory("nodp-0", "nodp", [{"step": t, "lr": 0.01} for t in range(1, 50)]))  # no clip key
    return out


def synthetic_ledger() -> list[dict]:
    return [
        {
            "run": f"run{i}",
            "label": "oso/gradient+q" if i % 2 else "dpsgd/gradient",
            "releases": 500,
            "epsilon": 0.5 + 0.05 * i,
            "planned_epsilon": 1.0,
        }
        for i in range(8)
    ]


class _Refs(HTMLParser):
    """Collects every src/href attribute value and every tag name of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for k, v in attrs:
            if k in ("src", "href", "srcset", "action", "poster", "data"):
                self.refs.append((tag, k, v or ""))


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    extra = figures.linear_scaling(
        LinearScalingFit([(0.1, 2.0), (0.2, 3.5)], 15.0, 0.5, 1.0),
        out / "extra" / "my_extra.png",
        title="an extra figure",
    )
    inputs = ReportInputs(
        synthetic_trials(),
        histories=synthetic_histories(),
        ledger=synthetic_ledger(),
        selection_mode="private",
        planned=(8.0, 1e-5),
        spent=(7.93, 1e-5),
        accountant="rdp",
        title="Synthetic <study> & co",
        notes=["A synthetic study for the test suite."],
        pareto={1.0: 1.16, 3.0: 0.74, 8.0: 0.55},
        lt_ma=[(k, 1.8 + 0.01 * k, 0.5 * math.sqrt(k)) for k in range(1, 31)],
        linear_scaling={"points": [(0.1, 2.0), (0.2, 3.5)], "slope": 15.0, "intercept": 0.5, "target_epsilon": 1.0},
        extra_figures=[(extra, "an extra figure passed by the caller")],
    )
    return build_report(out, inputs, include_diagnostics=True)


# the publishable page's figures (release/); the per-run ledger is a diagnostic (diagnostics/)
EXPECTED_PNGS = ["metric_vs_epsilon", "trajectories", "noise_pareto", "lt_vs_ma", "linear_scaling"]


# ----------------------------------------------------------------------------- files and HTML
def test_report_writes_figures_and_csvs(study: Path) -> None:
    out = study.parent
    for name in EXPECTED_PNGS:
        png = out / "figures" / f"{name}.png"
        assert png.is_file(), f"missing {png}"
        assert png.stat().st_size > 15_000, f"{png.name} is suspiciously small ({png.stat().st_size} B)"
        with Image.open(png) as im:
            assert im.format == "PNG" and im.width >= 600 and im.height >= 400
            assert len(im.convert("RGB").getcolors(1 << 20) or []) > 50, f"{png.name} looks blank"
    for name in ("results_best.csv", "trajectories.csv", "lt_vs_ma.csv", "budget.csv"):
        assert (out / name).is_file(), name
    diag = out.parent / "diagnostics"
    for name in ("results_all.csv", "ledger.csv", "trajectories.csv", "figures/ledger.png", "report.html"):
        assert (diag / name).is_file(), name


def test_results_csv_holds_mean_and_std_over_seeds(study: Path) -> None:
    with (study.parent / "results_best.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    # 4 strategies × 3 ε, one row each: the NoDP baseline (ε = ∞) is not published
    assert len(rows) == 12 and {r["strategy"] for r in rows} == {"oso", "dpsgd", "quantile", "adamwosm"}
    trials = synthetic_trials()
    oso3 = [
        r["value"]
        for r in trials
        if r["strategy"] == "oso" and r["epsilon"] == 3.0 and r["hyperparameters"]["lr"] == 1.0
    ]
    row = next(r for r in rows if r["strategy"] == "oso" and float(r["epsilon"]) == 3.0)
    assert float(row["mean"]) == pytest.approx(float(np.mean(oso3)), rel=1e-12)
    assert float(row["std"]) == pytest.approx(float(np.std(oso3, ddof=1)), rel=1e-12)
    assert float(row["hp_lr"]) == 1.0
    # quantile at ε=1: lr=1 has a diverged seed, so the fully converged lr=0.1 is reported
    q1 = next(r for r in rows if r["strategy"] == "quantile" and float(r["epsilon"]) == 1.0)
    assert float(q1["hp_lr"]) == 0.1 and q1["n_diverged"] == "0"


def test_nonprivate_baseline_is_only_in_the_labelled_diagnostics(study: Path) -> None:
    """ε = ∞ rows (NoDP) are exact functions of the private data: no file under release/ holds their
    score or name; diagnostics/results_nonprivate.csv and the diagnostics page do, labelled."""
    nodp_mean = f"{np.mean([0.985, 0.986, 0.987]):.4g}"  # 0.986, as the tables print it
    assert nodp_mean == "0.986"
    for f in study.parent.rglob("*"):
        if f.is_file() and f.suffix in (".csv", ".html"):
            text = f.read_text(encoding="utf-8")
            assert "nodp" not in text and "0.986" not in text, f
    diag = study.parent.parent / "diagnostics"
    base = (diag / "results_nonprivate.csv").read_text(encoding="utf-8")
    assert base.startswith(f"# {NOT_DP_LABEL}") and "nodp" in base and "0.986" in base
    page = (diag / "report.html").read_text(encoding="utf-8")
    assert "Non-private baseline" in page and "nodp" in page


def test_html_is_self_contained_and_states_the_budget(study: Path) -> None:
    page = study.read_text(encoding="utf-8")
    p = _Refs()
    p.feed(page)
    assert p.refs, "no images or links at all"
    external = [(t, k, v[:60]) for t, k, v in p.refs if not v.startswith("data:")]
    assert not external, f"the page references outside files: {external}"
    assert "script" not in p.tags and "link" not in p.tags and "iframe" not in p.tags
    assert not re.search(r"url\(\s*['\"]?(?!data:)", page), "CSS pulls an external resource"
    imgs = [v for t, k, v in p.refs if t == "img"]
    assert len(imgs) == len(EXPECTED_PNGS) + 1  # + the caller's extra figure
    # the embedded bytes are exactly the PNG written to disk
    want = (study.parent / "figures" / "metric_vs_epsilon.png").read_bytes()
    assert any(base64.b64decode(v.split(",", 1)[1]) == want for v in imgs)
    csv_links = [v for t, k, v in p.refs if t == "a"]
    assert any(v.startswith("data:text/csv;base64,") for v in csv_links)
    # header: selection mode and planned vs spent (ε, δ)
    assert "Selection mode: private validation data." in page
    assert re.search(r"<td>planned</td><td[^>]*>8</td><td[^>]*>1e-05</td>", page)
    assert re.search(r"<td>spent</td><td[^>]*>7.93</td><td[^>]*>1e-05</td>", page)
    assert "EXCEEDS" not in page
    # text is escaped, never interpreted as markup
    assert "Synthetic &lt;study&gt; &amp; co" in page and "<study>" not in page
    assert "Accuracy (higher is better)" in page


def _screenshot_is_blank(path: Path) -> bool:
    """Blank: fewer than 200 distinct colours or a pixel std below 15 (a white page has 1 and 0)."""
    with Image.open(path) as im:
        rgb = np.asarray(im.convert("RGB"), dtype=np.uint32)
    packed = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]
    return len(np.unique(packed)) < 200 or float(rgb.std()) < 15.0


def test_blank_check_rejects_blank_and_accepts_a_figure(tmp_path: Path, study: Path) -> None:
    blank = tmp_path / "blank.png"
    Image.new("RGB", (1200, 2000), "white").save(blank)
    assert _screenshot_is_blank(blank)
    assert not _screenshot_is_blank(study.parent / "figures" / "metric_vs_epsilon.png")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (Debian: apt-get update && apt-get install -y chromium)",
)
def test_report_renders_in_headless_chromium(study: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1200,2000",
        study.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert shot.is_file(), f"chromium wrote no screenshot (rc={proc.returncode}): {proc.stderr[-2000:]}"
    with Image.open(shot) as im:
        assert im.size == (1200, 2000)
    assert not _screenshot_is_blank(shot), "the rendered report is blank"


# ----------------------------------------------------------------------------- header checks
def test_header_warns_when_spent_exceeds_plan(tmp_path: Path) -> None:
    page = write_report(tmp_path, "t", [], selection_mode="public", planned=(1.0, 1e-5), spent=(1.2, 1e-5))
    text = page.read_text()
    assert "EXCEEDS" in text and "Selection mode: public validation data." in text
    ok = write_report(
        tmp_path, "t", [], selection_mode="public", planned=(1.0, 1e-5), spent=(1.0, 1e-5), filename="ok.html"
    )
    assert "EXCEEDS" not in ok.read_text()
    split = write_report(tmp_path, "t", [], selection_mode="public", selection_split="test", filename="s.html")
    assert "optimistically biased" in split.read_text()
    with pytest.raises(ConfigError, match="selection_split"):
        write_report(tmp_path, "t", [], selection_mode="public", selection_split="train")


def test_large_attachments_stay_beside_the_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dptune.report import html as H

    small, big = tmp_path / "small.csv", tmp_path / "big.csv"
    small.write_text("a,b\n1,2\n")
    big.write_text("a,b\n" + "1,2\n" * 100)
    monkeypatch.setattr(H, "MAX_EMBED_BYTES", 100)
    page = write_report(tmp_path, "t", [Section("files", attachments=[small, big])]).read_text()
    assert 'download="small.csv"' in page and 'download="big.csv"' not in page
    assert "Too large to embed; next to this page: big.csv." in page


def test_bad_inputs_raise_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="selection_mode"):
        ReportInputs(synthetic_trials(), selection_mode="test-set", planned=(1, 1e-5), spent=(1, 1e-5))
    with pytest.raises(ConfigError, match="selection_split"):  # at once, not after the figures (found in review)
        ReportInputs(synthetic_trials(), selection_mode="public", planned=None, spent=None, selection_split="val")
    with pytest.raises(ConfigError, match="planned"):
        ReportInputs([], selection_mode="public", planned=(1.0,), spent=None)
    with pytest.raises(ConfigError, match="higher_is_better"):
        ReportInputs([], selection_mode="public", planned=None, spent=None, metric="auc")
    with pytest.raises(ConfigError, match="lacks"):
        rows = [{"strategy": "oso", "value": 0.9}]
        build_report(tmp_path, ReportInputs(rows, selection_mode="public", planned=None, spent=None))
    with pytest.raises(ConfigError, match="does not exist"):
        write_report(tmp_path, "t", [Section("s", figures=[FigureRef(tmp_path / "nope.png")])])
    with pytest.raises(ConfigError, match=".png"):
        figures.lt_vs_ma([(1, 1.0, 0.5)], tmp_path / "fig.jpg")


def test_mse_report_says_lower_is_better(tmp_path: Path) -> None:
    trials = [
        {"strategy": "oso", "epsilon": e, "value": 0.02 / e + 0.001 * s, "seed": s, "hyperparameters": {"lr": 0.1}}
        for e in (1.0, 2.0)
        for s in range(2)
    ]
    inputs = ReportInputs(trials, selection_mode="public", planned=(2.0, 1e-5), spent=(2.0, 1e-5), metric="mse")
    page = build_report(tmp_path, inputs).read_text()
    assert "MSE (lower is better)" in page and "higher is better" not in page
    assert metric_label("mse", False) == "MSE (lower is better)"


# ----------------------------------------------------------------------------- aggregation
@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=6), min_size=2, max_size=5),
    higher=st.booleans(),
)
def test_summary_matches_numpy_and_best_is_extreme(values: list[list[float]], higher: bool) -> None:
    trials = [TrialResult("s", 2.0, v, seed, {"cfg": i}) for i, vs in enumerate(values) for seed, v in enumerate(vs)]
    summary = summarize(trials, higher)
    assert len(summary) == len(values)
    for r in summary:
        vs = values[r.hyperparameters["cfg"]]
        assert r.mean == pytest.approx(float(np.mean(vs)), abs=1e-12)
        assert r.std == pytest.approx(float(np.std(vs, ddof=1)), abs=1e-12)
        assert r.n_seeds == len(vs) and r.n_diverged == 0
    (best,) = best_per_strategy(summary, higher)
    means = [statistics.fmean(vs) for vs in values]
    assert best.mean == pytest.approx(max(means) if higher else min(means), abs=1e-12)


def test_selected_configuration_overrides_the_best() -> None:
    trials = [TrialResult("s", 1.0, 0.9, 0, {"lr": 1}), TrialResult("s", 1.0, 0.5, 0, {"lr": 2}, selected=True)]
    (row,) = best_per_strategy(summarize(trials), True)
    assert row.hyperparameters == {"lr": 2} and row.selected
    (row,) = best_per_strategy(
        summarize([TrialResult("s", 1.0, 0.9, 0, {"lr": 1}), TrialResult("s", 1.0, 0.5, 0, {"lr": 2})]), True
    )
    assert row.hyperparameters == {"lr": 1}


def test_flat_csv_rows_are_understood() -> None:
    rows = [
        {"strategy": "oso", "epsilon": "inf", "value": "0.5", "seed": "0", "lr": "0.1", "selected": "False"},
        {"strategy": "oso", "epsilon": "inf", "value": "", "seed": "1", "lr": "0.1", "selected": "False"},
        {"strategy": "oso", "epsilon": "inf", "value": "0.7", "seed": "0", "lr": "1", "selected": "True"},
    ]
    summary = summarize(rows)
    cfg01 = next(r for r in summary if r.hyperparameters == {"lr": "0.1"})
    assert (cfg01.mean, cfg01.n_seeds, cfg01.n_diverged, cfg01.selected) == (0.5, 2, 1, False)
    (best,) = best_per_strategy(summary)
    assert best.hyperparameters == {"lr": "1"} and best.selected and math.isinf(best.epsilon)
    with pytest.raises(ConfigError, match="value"):
        summarize([{"strategy": "oso", "epsilon": 1, "value": "high"}])


def test_all_diverged_configuration_is_reported_as_diverged() -> None:
    trials = [TrialResult("quantile", 1.0, None, s, {"g": 0.1}) for s in range(3)]
    (row,) = best_per_strategy(summarize(trials), True)
    assert row.mean is None and row.n_diverged == 3
    text = _render(render_terminal_table(trials), 100)
    assert "diverged" in text and "0/3" in text
    # No score and nothing diverged: an arm not finished yet (found in review: shown as "diverged")
    from dptune.report.tables import fmt_metric

    assert fmt_metric(dataclasses.replace(row, n_diverged=0)) == "not finished"


def test_a_study_report_counts_the_diverged_selected_seeds() -> None:
    """The study report said 0 diverged for every row, under a caption saying diverged seeds were left out
    of the mean (found in review: "0 ± 0 | 2/2" for two diverged seeds)."""
    from dptune.report.study import _selected_row
    from dptune.report.tables import results_table

    row = {"strategy": "dpsgd", "method": "grid", "epsilon": 2.0, "selected": "lr=3e+38", "replicates": 2,
           "test_mean": 0.0, "test_std": 0.0, "value_mean": 0.0, "value_std": 0.0, "selected_runs": ["r1", "r2"]}  # fmt: skip
    got = _selected_row(row, True, {"r1", "r2", "r9"})  # r9: a losing candidate's, not counted
    assert got.n_seeds == 2 and got.n_diverged == 2
    assert "0/2 (2 diverged)" in str(results_table([got], "accuracy", True).rows)


# ----------------------------------------------------------------------------- terminal table
def _render(table, width: int) -> str:
    console = Console(width=width, file=StringIO(), record=True, color_system=None)
    console.print(table)
    return console.export_text()


@pytest.mark.parametrize("width", [100, 200])
def test_terminal_table_fits_100_columns(width: int) -> None:
    trials = synthetic_trials() + [
        {
            "strategy": "a-very-long-custom-strategy-name",
            "epsilon": 0.25,
            "value": 0.8765,
            "seed": 0,
            "hyperparameters": {f"hyperparameter_{i}": 10.0**-i for i in range(8)},
        },
        {
            "strategy": "a-very-long-custom-strategy-name",
            "epsilon": 0.25,
            "value": 0.8811,
            "seed": 1,
            "hyperparameters": {f"hyperparameter_{i}": 10.0**-i for i in range(8)},
        },
    ]
    text = _render(render_terminal_table(trials), width)
    lines = text.splitlines()
    assert max(cell_len(line.rstrip()) for line in lines) <= 100
    assert "0.8788 ± 0.0033" in text  # mean ± std of (0.8765, 0.8811), never cut
    oso8 = [
        r["value"]
        for r in synthetic_trials()
        if r["strategy"] == "oso" and r["epsilon"] == 8.0 and r["hyperparameters"]["lr"] == 1.0
    ]
    assert f"{np.mean(oso8):.4g} ± {np.std(oso8, ddof=1):.2g}" in text
    assert "Accuracy ↑" in text and "∞" in text


# ----------------------------------------------------------------------------- method figures
@settings(max_examples=50, deadline=None)
@given(nu=st.floats(0.3, 50.0), ratio=st.floats(1.01, 100.0))
def test_pareto_front_has_the_privacy_of_one_gaussian(nu: float, ratio: float) -> None:
    (nu_g,) = figures.pareto_front(nu, np.array([nu * ratio]))
    assert accounting.joint_noise_multiplier([nu_g, nu * ratio]) == pytest.approx(nu, rel=1e-9)


def test_pareto_choice_is_galli_one_percent_rule(tmp_path: Path) -> None:
    nu_q, nu_g = figures.pareto_choice(1.3)
    assert nu_g == pytest.approx(1.01 * 1.3, rel=1e-12)
    assert nu_q / 1.3 == pytest.approx(7.124, abs=5e-4)  # Galli §Privacy Analysis: ν_q ≈ 7.124·ν
    with pytest.raises(ConfigError):
        figures.pareto_front(1.0, np.array([0.9]))
    with pytest.raises(ConfigError, match="ν"):
        figures.noise_pareto({1.0: -1.0}, tmp_path / "p.png")


def test_ma_break_even() -> None:
    rows = [(k, 2.0, 0.5 * math.sqrt(k)) for k in range(1, 31)]  # MA ≤ LT ⇔ k ≤ 16
    assert figures.ma_break_even(rows) == 16
    assert figures.ma_break_even(list(reversed(rows))) == 16  # order of the rows is irrelevant
    assert figures.ma_break_even([(1, 1.0, 2.0)]) is None
    with pytest.raises(ConfigError, match="k"):
        figures.ma_break_even([(0, 1.0, 1.0)])


# ----------------------------------------------------------------------------- ledger adapter
def test_ledger_rows_compose_each_run_alone() -> None:
    led = Ledger()
    ev_a = accounting.gaussian_step_event(1.1, 0.01)
    ev_b = accounting.gaussian_step_event(2.0, 0.02)
    led.record(ev_a, "dpsgd/gradient", count=300, run="a")
    led.record(ev_b, "oso/gradient+q", count=100, run="b")
    led.record(ev_b, "oso/gradient+q", count=100, run="b")
    rows = {r.run: r for r in ledger_rows_from_ledger(led, 1e-5, "rdp", planned_epsilon={"a": 3.0})}
    assert rows["a"].releases == 300 and rows["b"].releases == 200
    assert rows["a"].epsilon == pytest.approx(accounting.epsilon(accounting.dpsgd_event(1.1, 0.01, 300), 1e-5))
    assert rows["b"].epsilon == pytest.approx(accounting.epsilon(accounting.dpsgd_event(2.0, 0.02, 200), 1e-5))
    assert (rows["b"].noise_multiplier, rows["b"].sampling_rate) == (2.0, 0.02)
    assert rows["a"].planned_epsilon == 3.0 and rows["b"].planned_epsilon is None
    nodp = Ledger()
    nodp.record(dp_event.NonPrivateDpEvent(), "nodp/step", count=5, run="n")
    assert math.isinf(ledger_rows_from_ledger(nodp, 1e-5)[0].epsilon)


# ----------------------------------------------------------------------------- cosine diagnostic
def _linear_problem(n: int = 120, d: int = 40, classes: int = 25, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g) * 2 - 1
    y = torch.randint(0, classes, (n,), generator=g)
    torch.manual_seed(seed)
    model = nn.Linear(d, classes)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return model, x, y, params


def _per_example_grads(model: nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Reference per-example gradients by a plain autograd loop (independent of GradientOracle)."""
    rows = []
    for i in range(x.shape[0]):
        w = params["weight"].clone().requires_grad_(True)
        b = params["bias"].clone().requires_grad_(True)
        loss = nn.functional.cross_entropy((x[i : i + 1] @ w.T + b), y[i : i + 1])
        gw, gb = torch.autograd.grad(loss, (w, b))
        rows.append(torch.cat([gw.reshape(-1), gb.reshape(-1)]).double())
    return torch.stack(rows)


def test_cosine_without_noise_is_the_clipping_bias_in_closed_form() -> None:
    model, x, y, params = _linear_problem()
    n = x.shape[0]
    G = _per_example_grads(model, params, x, y)
    true = G.mean(0)
    norms = G.norm(dim=1)
    clips = [1e-3, float(norms.median()), 1e3]
    res = cosine_vs_clip(model, (x, y), {0: params}, clips, noise_multiplier=0.0, expected_batch_size=n, repeats=2)
    for c, got in zip(clips, res.mean[0], strict=True):
        clipped = (G * torch.clamp(c / norms, max=1.0)[:, None]).sum(0)
        want = float(clipped @ true / (clipped.norm() * true.norm()))
        assert got == pytest.approx(want, abs=1e-5)
    assert res.mean[0][2] == pytest.approx(1.0, abs=1e-6)  # C ≥ every norm: no clipping at all
    assert res.mean[0][0] < 0.999  # tiny C: normalised gradients, biased direction
    assert res.std[0] == pytest.approx((0.0, 0.0, 0.0), abs=1e-9)  # full batch, no noise: deterministic


def test_cosine_with_noise_matches_the_high_dimensional_prediction() -> None:
    # Full batch, no clipping (C ≥ every ‖g_i‖): g̃ = g + e/n with e ~ N(0, ν²C²·I_d). In d ≈ 1000
    # dimensions ‖e‖² concentrates at dν²C², so cos ≈ ‖g‖ / sqrt(‖g‖² + d(νC/n)²).
    model, x, y, params = _linear_problem()
    n = x.shape[0]
    G = _per_example_grads(model, params, x, y)
    true = G.mean(0)
    d = G.shape[1]
    clip = float(G.norm(dim=1).max()) * 1.01
    nu = math.sqrt(3.0) * float(true.norm()) * n / (clip * math.sqrt(d))  # predicts cos = 0.5
    res = cosine_vs_clip(
        model, (x, y), {5: params}, [clip], noise_multiplier=nu, expected_batch_size=n, repeats=20, seed=3
    )
    pred = float(true.norm()) / math.sqrt(float(true.norm()) ** 2 + d * (nu * clip / n) ** 2)
    assert pred == pytest.approx(0.5, abs=1e-9)
    assert res.mean[5][0] == pytest.approx(pred, abs=0.03)
    assert 0.0 < res.std[5][0] < 0.05
    # a twice larger ν gives the correspondingly smaller cosine, so the test can tell them apart
    res2 = cosine_vs_clip(
        model, (x, y), {5: params}, [clip], noise_multiplier=2 * nu, expected_batch_size=n, repeats=20, seed=3
    )
    pred2 = float(true.norm()) / math.sqrt(float(true.norm()) ** 2 + d * (2 * nu * clip / n) ** 2)
    assert res2.mean[5][0] == pytest.approx(pred2, abs=0.03) and abs(pred2 - pred) > 0.2


def test_cosine_poisson_batches_are_seeded_and_plot(tmp_path: Path) -> None:
    model, x, y, params = _linear_problem()
    later = {k: v * 0.5 for k, v in params.items()}
    args = (model, (x, y), {10: params, 250: later}, [0.01, 0.1, 1.0, 10.0], 1.0, 30.0)
    a = cosine_vs_clip(*args, repeats=4, seed=1)
    b = cosine_vs_clip(*args, repeats=4, seed=1)
    c = cosine_vs_clip(*args, repeats=4, seed=2)
    assert a.mean == b.mean and a.mean != c.mean
    assert a.iterations == (10, 250) and all(-1.0 <= v <= 1.0 for t in a.iterations for v in a.mean[t])
    assert len(a.to_rows()) == 8
    png = figures.cosine_similarity(a, tmp_path / "cos.png")
    assert png.stat().st_size > 15_000


def test_cosine_rejects_bad_input() -> None:
    model, x, y, params = _linear_problem(n=10)
    with pytest.raises(ConfigError, match="clip"):
        cosine_vs_clip(model, (x, y), {0: params}, [], 1.0, 5)
    with pytest.raises(ConfigError, match="noise_multiplier"):
        cosine_vs_clip(model, (x, y), {0: params}, [1.0], -1.0, 5)
    with pytest.raises(ConfigError, match="expected_batch_size"):
        cosine_vs_clip(model, (x, y), {0: params}, [1.0], 1.0, 50)
    with pytest.raises(ConfigError, match="repeats"):
        cosine_vs_clip(model, (x, y), {0: params}, [1.0], 1.0, 5, repeats=0)
    with pytest.raises(ConfigError, match="lack"):
        cosine_vs_clip(model, (x, y), {0: {"weight": params["weight"]}}, [1.0], 1.0, 5)


def test_report_package_draws_noise_only_through_the_sanctioned_source() -> None:
    pattern = re.compile(r"torch\.randn|torch\.normal|\.normal_\(|np\.random|random\.gauss")
    offenders = [str(p) for p in (SRC / "report").rglob("*.py") if pattern.search(p.read_text())]
    assert not offenders, offenders


def test_trajectories_skip_missing_and_nonpositive_values(tmp_path: Path) -> None:
    hist = [
        RunHistory(
            "r",
            "oso",
            [{"step": 1, "clip": 0.0, "lr": 1.0}, {"step": 2, "clip": -1, "lr": "x"}, {"step": 3, "clip": 0.5}],
        )
    ]
    x, y = figures._series(hist[0].rows, "clip")
    assert list(x) == [3.0] and list(y) == [0.5]
    assert figures.trajectories(hist, tmp_path / "t.png").is_file()
    long = [{"step": t, "clip": 1.0 + t} for t in range(1, 10_001)]
    x, y = figures._series(long, "clip", max_points=2000)
    assert len(x) <= 2001 and x[0] == 1 and x[-1] == 10_000 and np.all(y == x + 1)
    with pytest.raises(ConfigError, match="lacks"):
        figures.trajectories([{"run": "r", "rows": []}], tmp_path / "t2.png")


# ----------------------------------------------------------------------------- adapter: a stored study
def test_report_study_reads_a_stored_study(tmp_path: Path) -> None:
    from dptune.report import report_study
    from dptune.tune import (
        SelectionSpec,
        TrainingSpec,
        run_study,
    )
    from dptune.tune import study_table as tuner_table

    study = make_study(
        linear_data(3, n=240, dim=6, n_train=180, uniform=True),
        space={"lr": [0.3, 1.0]},
        fixed={"clip": 1.0},
        training=TrainingSpec(steps=12, expected_batch_size=30),
        selection=SelectionSpec(mode="private", split="holdout", eval_every=6, noise_multiplier=20.0),
        name="tiny-dpsgd",
    )
    sdir = tmp_path / "study"
    run_study(study, sdir, executor="local", progress=False)
    (row,) = tuner_table(sdir)
    page = report_study(sdir, include_diagnostics=True)
    assert page == sdir / "release" / "report.html"
    text = page.read_text()
    p = _Refs()
    p.feed(text)
    assert all(v.startswith("data:") for _, _, v in p.refs)
    assert "Study report: tiny-dpsgd" in text and "Selection mode: private validation data." in text
    assert "optimistically" not in text  # holdout split
    assert f"{row['planned_epsilon']:.4g}" in text and "dpsgd @ ε = 2 (grid)" in text
    assert row["selected"] in text
    for name in ("metric_vs_epsilon", "trajectories"):  # one ε, fixed C and ρ: no single dot, no flat lines
        assert not (page.parent / "figures" / f"{name}.png").exists(), name
    assert "kept C and ρ fixed over training" in text
    # private selection: the learning curve is computed on private data, so it is a diagnostic
    assert (sdir / "diagnostics" / "figures" / "learning_curves.png").stat().st_size > 10_000
    assert (sdir / "diagnostics" / "figures" / "ledger.png").stat().st_size > 10_000
    with (page.parent / "results_best.csv").open() as fh:
        (best,) = list(csv.DictReader(fh))
    assert row["runs_done"] == 2 and best["configuration"] == row["selected"]
    assert float(best["mean"]) == pytest.approx(row["test_mean"])
    assert [b["accountant"] for b in read_csv_rows(page.parent / "budget.csv")] == [row["accountant"]]  # was empty
    led = read_csv_rows(sdir / "diagnostics" / "ledger.csv")  # labelled: a comment line first
    assert len({r["run"] for r in led}) == 2  # both grid runs released
    assert all(r["label"] for r in led) and sum(int(r["releases"]) for r in led) >= 2 * 12
    with pytest.raises(ConfigError, match="holds no study"):
        report_study(tmp_path / "nothing-here")
    # Found in review: a report (or a study) inside a release/ folder put its diagnostics in the published folder.
    for out in (sdir / "release", tmp_path / "release" / "sub"):
        with pytest.raises(ConfigError, match="inside a 'release' folder"):
            report_study(sdir, out)
        assert not (out / "diagnostics").exists()
    res = CliRunner().invoke(app, ["report", str(sdir), "--out", str(sdir / "release")])
    assert res.exit_code == 2 and "inside a 'release' folder" in res.output, res.output
    assert not (sdir / "release" / "diagnostics").exists() and not (sdir / "release" / "release").exists()
    with pytest.raises(ConfigError, match="inside a 'release' folder"):
        run_study(study, tmp_path / "release" / "s2", executor="local", progress=False)
    assert not (tmp_path / "release" / "s2").exists()


def test_study_conclusions_state_the_winner_the_margin_and_the_noise_cost() -> None:
    """The report opens with conclusions computed from the tuner's table (issue 12)."""
    from dptune.report.study import conclusions

    table = [
        {
            "strategy": "oso",
            "optimizer": "oso",
            "method": "online",
            "epsilon": 3.0,
            "test_mean": 0.852,
            "value_mean": 0.85,
            "runs_total": 3,
            "arm": "oso@eps=3",
        },
        {
            "strategy": "dpsgd",
            "optimizer": "dpsgd",
            "method": "grid",
            "epsilon": 3.0,
            "test_mean": 0.798,
            "value_mean": 0.8,
            "runs_total": 9,
            "arm": "dpsgd@eps=3",
        },
        {
            "strategy": "nodp",
            "optimizer": "nodp",
            "method": "grid",
            "epsilon": float("inf"),
            "test_mean": 0.91,
            "value_mean": 0.91,
            "runs_total": 1,
            "arm": "nodp",
        },
    ]
    noise = {"oso@eps=3": {"runs": 3, "nu": 1.3}, "dpsgd@eps=3": {"runs": 9, "nu": 2.99}}
    lines = conclusions(table, noise, True, "accuracy", hidden_k=False)
    assert lines[0] == (
        "At ε = 3, oso (online, 3 runs) is best: accuracy 0.852, ahead of dpsgd (grid, 9 runs) at "
        "0.798 by 0.054 (one seed each: no spread measured). Splitting the budget over its runs cost dpsgd "
        "2.3× the noise per run of oso (ν = 2.99 against 1.3)."
    )
    # Found in review: "best" was said within the seeds' spread (0.69 ± 0.28 against 0.57 ± 0.075, 2 seeds).
    spread = [dict(table[0], replicates=2, test_std=0.28), dict(table[1], replicates=2, test_std=0.075)]
    assert (
        "within the seeds' spread of dpsgd (grid, 9 runs) at 0.798 (standard error 0.2)"
        in conclusions(spread, noise, True, "accuracy", hidden_k=False)[0]
    )
    narrow = [dict(r, test_std=0.01) for r in spread]
    assert (
        "is best: accuracy 0.852, ahead of dpsgd (grid, 9 runs) at 0.798 by 0.054 (standard error 0.01)"
        in (conclusions(narrow, noise, True, "accuracy", hidden_k=False)[0])
    )
    # The non-private baseline (ε = ∞, exact scores) is in no published sentence.
    assert len(lines) == 1 and not any("nodp" in x or "0.91" in x or "∞" in x for x in lines)
    # Under Liu–Talwar / repeat-and-select the number of runs is secret: no counts, no noise ratio.
    secret = conclusions(table, noise, True, "accuracy", hidden_k=True)[0]
    assert "runs" not in secret and "noise" not in secret
    # Lower is better (mse): the smallest wins.
    mse = [dict(r, test_mean=1 - r["test_mean"]) for r in table[:2]]
    assert conclusions(mse, noise, False, "mse", hidden_k=False)[0].startswith("At ε = 3, oso")
    # A relative tie for small MSEs: 0.012 against 0.0124 is not a tie (3 % apart).
    small = [dict(table[0], test_mean=0.012), dict(table[1], test_mean=0.0124)]
    assert "tied" not in conclusions(small, noise, False, "mse", hidden_k=False)[0]
    # One procedure alone "scores"; an oracle arm (search not accounted) is not ranked.
    alone = conclusions(table[:1] + [dict(table[1], method="oracle")], noise, True, "accuracy", hidden_k=False)
    assert alone == ["At ε = 3, oso (online, 3 runs) scores accuracy 0.852."]


def test_grid_heatmap_of_a_two_axis_grid_goes_to_the_diagnostics(tmp_path) -> None:
    """Every configuration of a lr × C grid (losing candidates included): diagnostics only."""
    import json
    from types import SimpleNamespace

    from dptune.report.study import grid_heatmaps

    runs = [
        {
            "arm": "dpsgd@eps=3",
            "score": 0.5 + 0.1 * i + 0.01 * j,
            "config": json.dumps({"lr": lr, "clip": c, "momentum": 0.0}),
        }
        for i, lr in enumerate([0.1, 1.0, 10.0])
        for j, c in enumerate([0.1, 1.0])
    ]
    runs.append({"arm": "oso@eps=3", "score": 0.8, "config": json.dumps({"lr": 1.0})})  # one axis: no map
    arms = {
        "dpsgd@eps=3": SimpleNamespace(label="dpsgd", epsilon=3.0),
        "oso@eps=3": SimpleNamespace(label="oso", epsilon=3.0),
    }
    figs = grid_heatmaps(runs, arms, tmp_path, "accuracy", True)
    assert len(figs) == 1
    path = figs[0].path
    assert path.exists() and "diagnostics" in path.parts and "release" not in path.parts
    assert "lr" in figs[0].caption and "clip" in figs[0].caption


def test_every_configuration_keeps_a_run_with_an_empty_configuration() -> None:
    """A non-private arm with no space and no fixed values has config {} (parsed from the store):
    its row must stay in diagnostics/results_all.csv, as when configs were JSON strings."""
    from types import SimpleNamespace

    from dptune.report.study import every_configuration

    arm = SimpleNamespace(label="nodp", method="grid", epsilon=math.inf)
    runs = [
        {
            "run_id": f"nodp@nodp/main/p0/c000/s{s}",
            "arm": "nodp@nodp",
            "stage": "main",
            "status": "done",
            "config": {},
            "score": 0.5 + s / 10,
            "test_metric": None,
        }
        for s in (0, 1)
    ]
    rows = every_configuration(runs, {"nodp@nodp": arm}, {runs[0]["run_id"]}, use_test=False, name=lambda a: a.label)
    assert len(rows) == 1 and rows[0].n_seeds == 2 and rows[0].selected
    assert rows[0].mean == pytest.approx(0.55)


def test_oso_joint_noise_is_the_smallest_run_nu_per_epsilon() -> None:
    """One rule for the Pareto figure's ν in study and preset reports: per finite ε, the smallest ν
    among the OSO arms' runs (other strategies, ε = ∞ and missing ν are ignored)."""
    from types import SimpleNamespace as NS

    from dptune.report.study import oso_joint_noise

    runs = {"a": NS(noise_multiplier=1.4), "b": NS(noise_multiplier=1.2), "c": NS(noise_multiplier=0.9)}
    runs |= {"d": NS(noise_multiplier=None), "e": NS(noise_multiplier=2.0), "f": NS(noise_multiplier=0.5)}
    plan = NS(
        runs=runs,
        arms=[
            NS(
                strategy="oso",
                epsilon=3.0,
                runs=["a", "b", "d"],
                method="grid",
                extra={},
                guarantee={"kind": "composition"},
            ),
            NS(strategy="oso", epsilon=3.0, runs=["e"], method="grid", extra={}, guarantee={"kind": "composition"}),
            NS(strategy="dpsgd", epsilon=3.0, runs=["c"], method="grid", extra={}, guarantee={"kind": "composition"}),
            NS(strategy="oso", epsilon=1.0, runs=["e"], method="grid", extra={}, guarantee={"kind": "composition"}),
            NS(
                strategy="oso",
                epsilon=float("inf"),
                runs=["f"],
                method="grid",
                extra={},
                guarantee={"kind": "composition"},
            ),
        ],
    )
    assert oso_joint_noise(plan) == {3.0: 1.2, 1.0: 2.0}
    # A Liu–Talwar arm's runs are secret draws: its [training] geometry's ν instead (found in review).
    lt = NS(
        strategy="oso",
        epsilon=2.0,
        runs=["c"],
        method="liu-talwar",
        guarantee={"kind": "liu-talwar"},
        extra={"public_geometry": {"noise_multiplier": 1.7}},
    )
    plan.arms.append(lt)
    assert oso_joint_noise(plan)[2.0] == 1.7


def test_stated_epsilons_in_figures_and_sentences_are_rounded_up() -> None:
    """Found in review: a figure's ε and a conclusion's "At ε = ..." were rounded to nearest (0.3222582694523013
    as 0.322258), a Mohapatra note's budget 1.4703590809876563 as 1.47: a privacy claim never reads smaller."""
    from dptune.report.figures import _eps_text
    from dptune.report.study import conclusions

    assert _eps_text(0.3222582694523013) == "0.322259" and _eps_text(float("inf")) == "∞"
    row = {"strategy": "dpsgd", "method": "grid", "epsilon": 0.3222582694523013, "test_mean": 0.8, "arm": "a"}
    assert conclusions([row], {}, True, "accuracy", hidden_k=True)[0].startswith("At ε = 0.322259,")
