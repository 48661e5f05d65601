"""Issue 10, item 7: what the published outputs contain (release vs diagnostics).

The old outputs published, next to the guarantee, things it does not cover:

* ``history`` (the loss on the private batch, the realised Poisson batch sizes) in the train JSON,
  ``trajectories.csv`` and the HTML page (as an embedded CSV);
* K, the number of runs Liu–Talwar drew (in the arm notes printed and shown on the page), and
  every candidate's run (``runs.csv``, ``ledger.csv``, ``results_all.csv``) — Liu–Talwar covers
  only the selected candidate with K hidden;
* the private batch's loss in the progress bar.

Now every output folder has ``release/`` (what the guarantee covers) and ``diagnostics/``
(labelled "not differentially private: for the data owner only"). Each test below fails on the
old code (checked with a worktree of the previous commit).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import sys
from pathlib import Path

import pytest
from cli_helpers import invoke_train
from tune_helpers import linear_data, make_study
from typer.testing import CliRunner

from dptune.cli import app
from dptune.errors import ConfigError
from dptune.report import ReportInputs, Section, build_report, report_study, write_report
from dptune.tune import (
    MethodSpec,
    SelectionSpec,
    StrategyArm,
    TrainingSpec,
    run_study,
    study_table,
)
from dptune.tune.results import report_text, write_csvs
from dptune.tune.store import Store

# Stated here, not imported, so that the tests run (and fail) on the old code too.
NOT_DP_LABEL = "not differentially private: for the data owner only"
RELEASE_HISTORY_KEYS = ("step", "clip", "lr")
# study_table columns that must stay out of the release: run counts (K under Liu–Talwar), counts
# over every candidate, run ids, the linear-scaling fits' raw points.
NOT_RELEASE_COLUMNS = {"runs_done", "runs_total", "diverged", "failed", "selected_runs", "fits"}
RUN_ID = re.compile(r"/c\d{3}/s\d")  # the tuner's run ids number the candidates (…/p0/c003/s0)
BATCH = re.compile(r"(?<!expected_)batch_size")


def read_csv_rows(path: Path) -> list[dict[str, str]]:
    """CSV rows, skipping the label's leading '#' comment line of a diagnostics file."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if not line.startswith("#")]
    return list(csv.DictReader(lines))


def _page_text(page: Path) -> str:
    """The page and every CSV it embeds (attachments are base64 data: URIs)."""
    html = page.read_text(encoding="utf-8")
    csvs = [base64.b64decode(m).decode("utf-8") for m in re.findall(r"data:text/csv;base64,([A-Za-z0-9+/=]+)", html)]
    return "\n".join([html, *csvs])


def _assert_release_clean(text: str, losers: list[str], where: str) -> None:
    assert "train_loss" not in text, f"{where}: the loss on the private batch is published"
    assert not BATCH.search(text), f"{where}: realised batch sizes are published"
    assert "runs drawn per procedure" not in text, f"{where}: Liu–Talwar's K is published"
    assert not RUN_ID.search(text), f"{where}: run ids (candidate numbers) are published"
    for rid in losers:
        assert rid not in text, f"{where}: losing candidate {rid} is published"


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A grid arm (2 candidates: one loses) and a Liu–Talwar arm, public selection."""
    study = make_study(
        linear_data(5, n=140, dim=5, n_train=100),
        arms=(
            StrategyArm("dpsgd", space={"lr": [0.05, 1.0]}, fixed={"clip": 1.0}, label="dpsgd-grid"),
            StrategyArm(
                "dpsgd",
                space={"lr": [0.05, 1.0]},
                fixed={"clip": 1.0},
                label="dpsgd-lt",
                method=MethodSpec("liu-talwar", {"gamma": 0.5}),
            ),
        ),
        training=TrainingSpec(steps=6, expected_batch_size=20),
        eps=4.0,
        selection=SelectionSpec(eval_every=3),
        name="edge-outputs",
    )
    d = tmp_path_factory.mktemp("edge") / "study"
    run_study(study, d, executor="local", progress=False)
    return d


def _losers(d: Path) -> tuple[list[str], list[str]]:
    """(every run id, the run ids that were not selected)."""
    with Store(d, readonly=True) as st:
        ids = [r["run_id"] for r in st.runs()]
    chosen = {rid for r in study_table(d) for rid in r["selected_runs"]}
    return ids, [i for i in ids if i not in chosen]


# ----------------------------------------------------------------------------- the study report
def test_published_study_page_hides_loss_batch_sizes_k_and_losers(study_dir: Path) -> None:
    ids, losers = _losers(study_dir)
    assert losers, "the grid arm must have a losing candidate"
    with Store(study_dir, readonly=True) as st:  # the store does hold the non-private columns
        hist = json.loads(next(r for r in st.runs() if r["history"])["history"])
    assert "train_loss" in hist[0] and "batch_size" in hist[0]

    page = report_study(study_dir)
    _assert_release_clean(_page_text(page), losers, "the published page")
    assert "dpsgd-lt" in page.read_text() and "only the selected candidate is released" in page.read_text()
    # every file of the release folder
    release = page.parent
    assert release.name == "release"
    for f in release.rglob("*"):
        if f.suffix in (".csv", ".html", ".json", ".txt"):
            _assert_release_clean(f.read_text(encoding="utf-8"), losers, str(f.relative_to(study_dir)))
    traj = read_csv_rows(release / "trajectories.csv")
    assert traj and set(traj[0]) <= {"run", "strategy", *RELEASE_HISTORY_KEYS}


def test_diagnostics_hold_the_rest_and_carry_the_label(study_dir: Path) -> None:
    ids, losers = _losers(study_dir)
    report_study(study_dir)
    diag = study_dir / "diagnostics"
    assert NOT_DP_LABEL in (diag / "README.txt").read_text().lower()
    for name in ("trajectories.csv", "ledger.csv", "runs.csv", "results_all.csv"):
        first = (diag / name).read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("#") and NOT_DP_LABEL in first.lower(), name
    traj = read_csv_rows(diag / "trajectories.csv")
    assert {"train_loss", "batch_size"} <= set(traj[0])
    assert {r["run_id"] for r in read_csv_rows(diag / "runs.csv")} == set(ids)
    assert all(rid in (diag / "runs.csv").read_text() for rid in losers)


def test_include_diagnostics_writes_a_separate_page_under_a_banner(study_dir: Path) -> None:
    ids, losers = _losers(study_dir)
    page = report_study(study_dir, include_diagnostics=True)
    _assert_release_clean(_page_text(page), losers, "the published page (with --include-diagnostics)")
    dpage = study_dir / "diagnostics" / "report.html"
    text = _page_text(dpage)
    assert 'class="warn diagnostics"' in text and NOT_DP_LABEL in text.lower()
    assert "runs drawn per procedure" in text and all(rid in text for rid in losers) and "train_loss" in text
    # the CLI flag (the old CLI has none: exit code 2)
    res = CliRunner().invoke(app, ["report", str(study_dir), "--include-diagnostics"])
    assert res.exit_code == 0, res.output
    assert NOT_DP_LABEL in res.output.lower() and "diagnostics" in res.output


def test_study_csvs_and_terminal_split_release_and_diagnostics(study_dir: Path) -> None:
    ids, losers = _losers(study_dir)
    write_csvs(study_dir)
    rel = read_csv_rows(study_dir / "release" / "results.csv")
    assert len(rel) == 2 and not set(rel[0]) & NOT_RELEASE_COLUMNS
    assert {"selected", "value_mean", "planned_epsilon", "spent_epsilon", "accountant"} <= set(rel[0])
    _assert_release_clean((study_dir / "release" / "results.csv").read_text(), losers, "release/results.csv")
    for name in ("results.csv", "budget_runs.csv", "budget_labels.csv"):
        assert NOT_DP_LABEL in (study_dir / "diagnostics" / name).read_text().splitlines()[0].lower()
    text = " ".join(report_text(study_dir).split())
    assert "runs drawn per procedure" not in text and "where the budget went" not in text and "dpsgd-lt" in text
    full = " ".join(report_text(study_dir, diagnostics=True).split())  # rich folds long lines
    assert NOT_DP_LABEL in full.lower() and "runs drawn per procedure" in full
    status = CliRunner().invoke(app, ["status", str(study_dir)])
    assert status.exit_code == 0 and NOT_DP_LABEL in status.output.lower()


# ----------------------------------------------------------------------------- the generic builder
def test_build_report_publishes_only_selected_histories_without_loss(tmp_path: Path) -> None:
    rows = [{"step": t, "clip": 1.0, "lr": 0.5, "train_loss": 2.0 - t / 10, "batch_size": 17 + t} for t in range(1, 6)]
    trials = [
        {"strategy": "dpsgd", "epsilon": 1.0, "value": v, "seed": 0, "hyperparameters": {"lr": lr}, "selected": sel}
        for lr, v, sel in ((0.5, 0.9, True), (0.1, 0.7, False))
    ]
    histories = [
        {"run": "winner", "strategy": "dpsgd", "rows": rows},
        {"run": "loser-run", "strategy": "dpsgd", "rows": rows, "selected": False},
    ]
    ledger = [{"run": "loser-run", "label": "dpsgd/gradient", "releases": 5}]
    inputs = ReportInputs(trials, "public", (1.0, 1e-5), (1.0, 1e-5), histories=histories, ledger=ledger)
    page = build_report(tmp_path, inputs)
    text = _page_text(page)
    _assert_release_clean(text, ["loser-run"], "build_report's page")
    assert "0.7" not in read_csv_rows(page.parent / "results_best.csv")[0].values()
    diag = tmp_path / "diagnostics"
    assert "loser-run" in (diag / "trajectories.csv").read_text() and "loser-run" in (diag / "ledger.csv").read_text()
    assert {r["mean"] for r in read_csv_rows(diag / "results_all.csv")} == {"0.9", "0.7"}
    assert not (diag / "report.html").exists()  # the diagnostics page only on request


def test_publishable_page_refuses_diagnostic_sections(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="diagnostics"):
        write_report(tmp_path, "t", [Section("every run", paragraphs=["x"], diagnostic=True)])
    page = write_report(tmp_path, "t", [Section("every run", paragraphs=["x"], diagnostic=True)], diagnostics=True)
    assert page.read_text().lower().count(NOT_DP_LABEL) >= 2  # page banner + section banner


# ----------------------------------------------------------------------------- one run
def test_train_cli_release_json_has_no_history_and_diagnostics_are_labelled(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    res = invoke_train(out)
    assert res.exit_code == 0, (res.output, res.exception)
    text = out.read_text()
    assert "train_loss" not in text and not BATCH.search(text) and '"seconds"' not in text
    rel = json.loads(text)
    assert rel["epsilon"] > 0 and rel["evals"] and rel["ledger_totals"]["releases"] > 0
    assert rel["trajectory"] and set(rel["trajectory"][0]) <= set(RELEASE_HISTORY_KEYS)
    diag = json.loads((tmp_path / "diagnostics" / "run.json").read_text())
    assert NOT_DP_LABEL in diag["privacy"].lower()
    assert "train_loss" in diag["history"][0] and "batch_size" in diag["history"][0]
    assert NOT_DP_LABEL in res.output.lower()


def test_progress_bar_shows_no_private_batch_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    from dptune.train import _Bar

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Tty())  # a terminal: the bar is drawn
    bar = _Bar(10, "dpsgd")
    try:
        bar.step({"step": 1, "train_loss": 2.345, "batch_size": 19, "clip": 0.5, "lr": 0.25})
        post, drawn = str(bar.bar.postfix), str(bar.bar)
    finally:
        bar.close()
    assert "clip" in post and "lr" in post
    assert "loss" not in post and "batch" not in post and "2.34" not in post
    assert "1/10, clip=0.5, lr=0.25" in drawn and "s/step" not in drawn and "<" not in drawn  # no run time (review)


def test_python_results_name_what_is_the_owners(study_dir: Path) -> None:
    """The Python API's result objects name what the guarantee does not cover (found in review: the repr of a
    TrainResult printed every step's train loss and batch size; run_study's outcome and study_status held K)."""
    import torch

    import dptune
    from dptune.tune import study_status

    x = torch.randn(120, 4)
    res = dptune.train(torch.nn.Linear(4, 2), (x, (x[:, 0] > 0).long()), "dpsgd", steps=3, expected_batch_size=30,
                       target_epsilon=3.0, delta=1e-5, lr=0.1)  # fmt: skip
    shown = repr(res)
    assert NOT_DP_LABEL in shown and "history" in shown and "train_loss" not in shown and "batch_size" not in shown
    assert study_status(study_dir)["privacy"] == NOT_DP_LABEL
    from dptune.tune.study import StudyOutcome

    outcome = StudyOutcome(study_dir, True, True, {"done": 3}, study_table(study_dir))
    assert NOT_DP_LABEL in repr(outcome) and "runs_total" not in repr(outcome) and not RUN_ID.search(repr(outcome))


def test_a_label_value_quoted_in_an_error_is_labelled() -> None:
    import torch

    from dptune.models import check_fits

    with pytest.raises(ConfigError) as err:
        check_fits(torch.nn.Linear(3, 2), torch.randn(4, 3), torch.tensor([0, 1, 41, 1]), "the model", "more outputs")
    assert "0..41" in str(err.value) and NOT_DP_LABEL in str(err.value)


def test_a_diagnostic_figure_carries_the_label(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    from dptune.report.figures import _save

    for part, labelled in (("diagnostics", True), ("release", False)):
        fig = Figure()
        fig.add_subplot().plot([0, 1])
        _save(fig, tmp_path / part / "figures" / "f.png")
        assert any(NOT_DP_LABEL in t.get_text() for t in fig.texts) is labelled
