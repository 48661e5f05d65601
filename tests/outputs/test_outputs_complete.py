"""Issue 13, item 4: outputs complete and readable.

`dptune reproduce list` is a table that fits 100 columns; `dptune train` records the model built,
the accountant used, the dptune version, the selection split and the randomness mode (the seed only
in the diagnostics); reports hold every configuration, fill the ledger's planned ε and mark it in
the ledger figure, write `runs.csv` for the demo/preset reports too, draw no matplotlib warning,
show noisy selection scores clipped to the metric's range (stored raw) and tell ε apart in the
trajectory figure; `dptune status` shows the time left and counts as running only started runs.
"""

from __future__ import annotations

import json
import math
import queue
import re
import shutil
import sqlite3
import statistics
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib.axes
import pytest
from cli_helpers import invoke_train
from rich.cells import cell_len
from rich.console import Console
from tune_helpers import linear_data, make_study
from typer.testing import CliRunner

import dptune
from dptune.cli import app
from dptune.metrics import clip_to_range
from dptune.outputs import NOT_DP_LABEL, read_csv_rows
from dptune.report import figures as F
from dptune.report.data import RunHistory
from dptune.tune import (
    SelectionSpec,
    StrategyArm,
    Study,
    TrainingSpec,
    run_study,
    study_status,
    study_table,
)
from dptune.tune import executors as E
from dptune.tune.results import report_text


def _lines(text: str) -> list[str]:
    return [ln.rstrip("\n") for ln in text.splitlines()]


# ----------------------------------------------------------------------------- reproduce list
def test_reproduce_list_is_a_table_that_fits_100_columns() -> None:
    from dptune.presets import list_presets, presets_table

    res = CliRunner().invoke(app, ["reproduce", "list"])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output and "{'name'" not in res.output and "'estimates'" not in res.output
    assert max(cell_len(ln) for ln in _lines(res.output)) <= 100
    flat = " ".join(res.output.split())
    for p in list_presets():
        assert p["name"] in res.output, p["name"]
    for scale in ("smoke:", "small:", "paper:"):
        assert flat.count(scale) == len(list_presets()), scale
    # A wide terminal gets the same 100 columns (the column caps add up to 100).
    wide = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    wide.print(presets_table())
    assert max(cell_len(ln) for ln in _lines(wide.export_text())) <= 100


# ----------------------------------------------------------------------------- dptune train
def test_train_json_and_table_record_model_accountant_version_split_and_mode(
    tmp_path: Path,
) -> None:
    from dptune import data as dpdata
    from dptune import models

    out = tmp_path / "run.json"
    res = invoke_train(out, "--seed", "987654", "--device", "cpu", epochs="0.1")
    assert res.exit_code == 0, (res.output, res.exception)
    text = out.read_text()
    rel = json.loads(text)
    expected_model = models.default_model_name(dpdata.load("digits", seed=987654))
    assert rel["model"] == expected_model != "auto"
    assert rel["accountant"] in ("pld", "rdp", "gdp") and rel["ledger_totals"]["accountant"] == rel["accountant"]
    assert rel["dptune_version"] == dptune.__version__
    assert rel["selection_split"] == "test" and rel["randomness"] == "seeded"
    # The seed is a secret key in seeded mode: not in the release, recorded in the diagnostics.
    assert "987654" not in text and "seed" not in rel and "diagnostics" in rel["seed_note"]
    diag = json.loads((tmp_path / "diagnostics" / "run.json").read_text())
    assert diag["seed"] == 987654 and NOT_DP_LABEL in diag["privacy"].lower()
    flat = " ".join(res.output.split())
    assert "987654" not in res.output
    for row in (
        f"model │ {expected_model}",
        "selection │ best checkpoint on the test split",
        f"dptune │ {dptune.__version__}",
        "randomness │ seeded",
        f"ε spent ({rel['accountant'].upper()})",
        "seed │ in the diagnostics JSON only",
    ):
        assert re.sub(r"\s+", " ", row) in re.sub(r"│\s+", "│ ", flat), row


# ----------------------------------------------------------------------------- a stored study
def _study() -> Study:
    return make_study(
        linear_data(3, n=240, dim=6, n_train=180, uniform=True),
        arms=(
            StrategyArm("dpsgd", space={"lr": [0.3, 1.0]}, fixed={"clip": 1.0}),
            StrategyArm("oso", space={"lr": [0.5]}),
            StrategyArm("nodp", space={"lr": [0.5]}),
        ),
        training=TrainingSpec(steps=12, expected_batch_size=30),
        eps=(2.0, 4.0),
        # Much noise on the scores of a 36-example holdout: noisy accuracies leave [0, 1].
        selection=SelectionSpec(mode="private", split="holdout", eval_every=6, noise_multiplier=20.0),
        name="outputs",
    )


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A finished 7-run study (dpsgd × 2 lr and oso at ε = 2 and 4, nodp), its `dptune report
    --include-diagnostics` and its preset-style (demo) report, both made with every warning an
    error, and the vertical lines and plotted lines of their figures."""
    from dptune.presets import study_report
    from dptune.report import report_study

    root = tmp_path_factory.mktemp("outputs")
    sdir = root / "study"
    run_study(_study(), sdir, executor="local", progress=False)
    vlines: list[tuple[float, str]] = []
    plots: list[dict[str, Any]] = []
    axvline, plot = matplotlib.axes.Axes.axvline, matplotlib.axes.Axes.plot

    def spy_axvline(self: Any, x: float = 0, *a: Any, **kw: Any) -> Any:
        vlines.append((float(x), str(kw.get("label"))))
        return axvline(self, x, *a, **kw)

    def spy_plot(self: Any, *a: Any, **kw: Any) -> Any:
        plots.append(dict(kw))
        return plot(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's RuntimeWarning / "No artists with labels"
        mp.setattr(matplotlib.axes.Axes, "axvline", spy_axvline)
        mp.setattr(matplotlib.axes.Axes, "plot", spy_plot)
        page = report_study(sdir, include_diagnostics=True)
        demo = study_report(sdir, root / "demo", include_diagnostics=True)
    return {"dir": sdir, "page": page, "demo": demo, "vlines": vlines, "plots": plots}


def test_results_all_holds_every_configuration_in_the_diagnostics(study: dict[str, Any]) -> None:
    sdir = study["dir"]
    for out in (sdir, study["demo"].parent.parent):
        path = out / "diagnostics" / "results_all.csv"
        assert NOT_DP_LABEL in path.read_text().splitlines()[0].lower()
        rows = read_csv_rows(path)
        # dpsgd: 2 lr × 2 ε, oso: 2 ε, nodp: 1 — every configuration, the losing ones too.
        assert len(rows) == 7, rows
        assert {r["selected"] for r in rows} == {"True", "False"}
        assert {r["configuration"] for r in rows if r["strategy"].startswith("dpsgd")} == {
            "clip=1, lr=0.3",
            "clip=1, lr=1",
        }
    # the release: selected only, private arms only (the nodp baseline, ε = ∞, is not covered)
    best = read_csv_rows(sdir / "release" / "results_best.csv")
    assert len(best) == 4 and not any(r["strategy"].startswith("nodp") for r in best)
    (base,) = read_csv_rows(sdir / "diagnostics" / "results_nonprivate.csv")
    assert base["strategy"].startswith("nodp") and base["epsilon"] == "inf"
    assert "results_all" not in {p.stem for p in (sdir / "release").rglob("*.csv")}


def test_ledger_csv_has_each_runs_planned_epsilon(study: dict[str, Any]) -> None:
    for out in (study["dir"], study["demo"].parent.parent):
        rows = read_csv_rows(out / "diagnostics" / "ledger.csv")
        assert rows and all(r["planned_epsilon"] for r in rows)
        for r in rows:
            planned, spent = float(r["planned_epsilon"]), float(r["epsilon"])
            if r["run"].startswith("nodp"):
                assert math.isinf(planned) and math.isinf(spent)
            else:  # a finished run spent exactly its plan
                assert 0 < planned < 4.0 + 1e-9 and spent == pytest.approx(planned, rel=1e-9)


def test_ledger_figure_marks_the_planned_epsilon_of_each_procedure(study: dict[str, Any]) -> None:
    table = study_table(study["dir"])
    planned = sorted({round(r["planned_epsilon"], 3) for r in table if math.isfinite(r["planned_epsilon"])})
    assert planned == [2.0, 4.0]
    drawn = [x for x, label in study["vlines"] if "planned" in label]
    for e in planned:
        assert any(abs(x - e) < 1e-3 for x in drawn), (e, study["vlines"])
    assert (study["dir"] / "diagnostics" / "figures" / "ledger.png").stat().st_size > 10_000


def test_ledger_figure_draws_non_private_runs_and_many_runs_without_warnings(
    tmp_path: Path,
) -> None:
    rows = [
        {"run": f"r{i}", "label": "dpsgd/gradient", "releases": 10, "epsilon": 0.5 + 0.01 * i} for i in range(45)
    ] + [{"run": "nodp", "label": "nodp/gradient", "releases": 10, "epsilon": math.inf}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.ledger(rows[-5:], tmp_path / "bars.png")  # ε = ∞ as a bar was NaN in matplotlib's transforms
        F.ledger(rows, tmp_path / "hist.png")  # a histogram and no planned ε: no legend to draw
        F.ledger(rows, tmp_path / "hist_planned.png", planned_epsilon=[(1.0, "a"), (2.0, "b")])
    assert all((tmp_path / f).stat().st_size > 5_000 for f in ("bars.png", "hist.png", "hist_planned.png"))


def test_demo_report_writes_runs_csv(study: dict[str, Any]) -> None:
    diag = study["demo"].parent.parent / "diagnostics"
    rows = read_csv_rows(diag / "runs.csv")
    assert NOT_DP_LABEL in (diag / "runs.csv").read_text().splitlines()[0].lower()
    with sqlite3.connect(study["dir"] / "study.sqlite") as con:
        ids = {r for (r,) in con.execute("SELECT run_id FROM runs")}
    assert {r["run_id"] for r in rows} == ids and len(ids) == 7
    assert all(r["status"] == "done" and r["score"] for r in rows)
    assert "runs.csv" in (diag / "report.html").read_text()


def test_noisy_selection_scores_are_shown_clipped_and_stored_raw(study: dict[str, Any]) -> None:
    sdir = study["dir"]
    raw = [r["value_mean"] for r in study_table(sdir) if r["value_mean"] is not None]
    assert max(raw) > 1.0  # the premise: a noisy accuracy above 100 %
    text = report_text(sdir)  # accuracy as a fraction: a clipped score prints as 1
    assert "clipped" in text and not any(f"{v:.4g}" in text for v in raw if v > 1)
    assert re.search(r"│ 1 ", text)
    page = study["page"].read_text()
    for v in raw:
        if v > 1:
            assert f"{v:.4g}" not in page
            stored = [float(r["value_mean"]) for r in read_csv_rows(sdir / "release" / "results.csv")]
            assert any(s == pytest.approx(v) for s in stored)  # raw in the stored data
    assert "clipped" in page


def test_clip_to_range() -> None:
    assert clip_to_range(1.08, "accuracy") == 1.0 and clip_to_range(-0.1, "accuracy") == 0.0
    assert clip_to_range(0.7, "accuracy") == 0.7
    assert clip_to_range(-0.2, "mse") == 0.0 and clip_to_range(5.0, "mse") == 5.0 and clip_to_range(-1, "loss") == 0
    assert clip_to_range(1.5, "my_metric") == 1.5 and clip_to_range(None, "accuracy") is None


def test_trajectory_figure_tells_epsilons_apart(study: dict[str, Any], tmp_path: Path) -> None:
    # The study report: dpsgd and oso at ε = 2 and 4, each (strategy, ε) named and styled.
    labels = {p["label"]: p.get("ls") for p in study["plots"] if p.get("label")}
    for name in ("dpsgd", "oso"):
        assert f"{name}, ε = 2" in labels and f"{name}, ε = 4" in labels, labels
        assert labels[f"{name}, ε = 2"] != labels[f"{name}, ε = 4"]
    # Directly: one strategy at two ε, identical values: only the line style tells them apart.
    rows = [{"step": t, "clip": 1.0, "lr": 0.1} for t in range(1, 6)]
    seen: list[dict[str, Any]] = []
    plot = matplotlib.axes.Axes.plot
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            matplotlib.axes.Axes,
            "plot",
            lambda self, *a, **kw: (seen.append(kw), plot(self, *a, **kw))[1],
        )
        F.trajectories(
            [
                RunHistory("a", "dpsgd", rows, epsilon=1.0),
                RunHistory("b", "dpsgd", rows, epsilon=8.0),
            ],
            tmp_path / "t.png",
        )
    styles = {kw["label"]: kw["ls"] for kw in seen if kw.get("label")}
    assert set(styles) == {"dpsgd, ε = 1", "dpsgd, ε = 8"} and len(set(styles.values())) == 2


# ----------------------------------------------------------------------------- dptune status
def test_status_shows_the_time_left_from_finished_runs(study: dict[str, Any], tmp_path: Path) -> None:
    assert study_status(study["dir"])["eta"] == "no run left"
    sdir = tmp_path / "unfinished"
    shutil.copytree(study["dir"], sdir, ignore=shutil.ignore_patterns("release", "diagnostics", "checkpoints"))
    with sqlite3.connect(sdir / "study.sqlite") as con:
        ids = [r for (r,) in con.execute("SELECT run_id FROM runs ORDER BY position")]
        con.executemany(
            "UPDATE runs SET status = 'planned', seconds = NULL WHERE run_id = ?",
            [(i,) for i in ids[:3]],
        )
        con.executemany(
            "UPDATE runs SET status = 'running', seconds = NULL WHERE run_id = ?",
            [(i,) for i in ids[3:5]],
        )
        took = [s for (s,) in con.execute("SELECT seconds FROM runs WHERE status = 'done'")]
    st = study_status(sdir)
    assert st["counts"] == {"planned": 3, "running": 2, "done": 2}
    assert st["eta_seconds"] == pytest.approx(5 * statistics.fmean(took) / 2)
    assert "5 runs left" in st["eta"] and "÷ 2 running" in st["eta"]
    res = CliRunner().invoke(app, ["status", str(sdir)])
    assert res.exit_code == 0 and "Traceback" not in res.output
    assert "time left: ≈" in res.output and "eta_seconds" not in res.output


def test_status_counts_diverged_runs_as_finished(study: dict[str, Any], tmp_path: Path) -> None:
    """The done/runs column showed 2/4 for a complete study with 2 diverged runs (found in review)."""
    sdir = tmp_path / "diverged"
    shutil.copytree(study["dir"], sdir, ignore=shutil.ignore_patterns("release", "diagnostics", "checkpoints"))
    with sqlite3.connect(sdir / "study.sqlite") as con:
        ids = [r for (r,) in con.execute("SELECT run_id FROM runs ORDER BY position")]
        con.execute("UPDATE runs SET status = 'diverged' WHERE run_id = ?", (ids[0],))
    st = study_status(sdir)
    assert st["complete"] and st["counts"].get("diverged") == 1
    res = CliRunner().invoke(app, ["status", str(sdir)], terminal_width=200)
    rows = [line for line in res.output.splitlines() if any(f" {a['arm']} " in line for a in st["arms"])]
    assert res.exit_code == 0 and len(rows) == len(st["arms"])
    assert sum(f" {a['runs']}/{a['runs']} " in r for a in st["arms"] for r in rows if f" {a['arm']} " in r) == len(rows)


def _collect(ex: E.Executor, n: int, seconds: float) -> tuple[list[list[str]], int, list[str]]:
    """Run n sleeping tasks; return the on_start calls, the most runs 'running' at once, the outcomes."""
    calls: list[list[str]] = []
    running: set[str] = set()
    peak = 0
    done: list[str] = []

    def on_start(ids: list[str]) -> None:
        nonlocal peak
        calls.append(list(ids))
        running.update(ids)
        peak = max(peak, len(running))

    for rid, _, err in ex.run(time.sleep, [(f"r{i}", (seconds,)) for i in range(n)], on_start=on_start):
        assert err is None and rid in running  # started (store: 'running') before its outcome
        running.discard(rid)
        done.append(rid)
    return calls, peak, done


def test_pool_marks_running_only_the_runs_a_worker_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process pool's loop, with two threads for its two processes: 6 queued tasks, never more
    than 2 reported running (it reported all 6 at submission)."""
    started: queue.Queue = queue.Queue()
    monkeypatch.setattr(E, "_STARTED", started)
    ex = E.ProcessExecutor.__new__(E.ProcessExecutor)
    ex.workers, ex.started_queue, ex.pool = 2, started, ThreadPoolExecutor(2)
    try:
        calls, peak, done = _collect(ex, 6, 0.15)
    finally:
        ex.pool.shutdown()
    assert sorted(done) == [f"r{i}" for i in range(6)]
    assert len(calls[0]) <= 2 and peak <= 2
    assert sorted(r for c in calls for r in c) == sorted(done)  # each run reported started once


@pytest.mark.slow
def test_spawned_process_pool_reports_starts() -> None:
    ex = E.ProcessExecutor(workers=2)
    try:
        calls, peak, done = _collect(ex, 6, 0.3)
    finally:
        ex.close()
    assert sorted(done) == [f"r{i}" for i in range(6)] and peak <= 2 and len(calls[0]) <= 2
