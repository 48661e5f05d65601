"""What dptune prints and what its study report shows a team.

* progress: a bar on a terminal, plain lines (or nothing) in a log: never ``\\r`` in a file;
* tables: stacked (``column: value``) when their words cannot fit the console;
* one unit for accuracy (a fraction, as in the CSV, JSON and HTML) in the demo's terminal and
  HTML; no empty "test" column; the demo says what may be published;
* the report of a one-ε, one-strategy study: the selected model with its guarantee, its learning
  curve (public evaluation only: private-mode curves stay in the diagnostics), what was tried,
  and no single-dot or flat-line figures;
* no internal issue numbers in any string of src/dptune.
"""

from __future__ import annotations

import ast
import csv
import io
import re
import sys
import tomllib
from html import unescape
from pathlib import Path

import pytest
from conftest import ROOT
from rich.console import Console
from rich.table import Table
from tune_helpers import make_study, tiny_study_toml

from dptune.outputs import NOT_DP_LABEL, Progress, print_table
from dptune.presets import _reproduce
from dptune.report import report_study
from dptune.tune import SelectionSpec, run_study


def _plain(html: str) -> str:
    html = re.sub(r"<img[^>]*>|<style.*?</style>", " ", html, flags=re.S)
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def test_progress_is_plain_lines_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert not sys.stderr.isatty()
    bar = Progress(3, "study", "run", 1, lines=True)
    bar.update(1, "dpsgd@eps=2")
    bar.update(1)
    bar.close()
    steps = Progress(5, "dpsgd", "step")  # a run's steps: nothing in a log
    steps.update(1, "clip=1")
    steps.close()
    err = capsys.readouterr().err
    assert err == "study: 2/3 runs (dpsgd@eps=2)\nstudy: 3/3 runs\n" and "\r" not in err


def test_progress_is_a_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    bar = Progress(2, "study", "run", lines=True)
    bar.update(1, "a")
    bar.close()
    assert bar.bar is not None and "\r" in tty.getvalue() and "1/2" in tty.getvalue()


def _wide_table() -> Table:
    t = Table(title="results")
    for c in ("strategy", "ε", "method", "selected configuration", "accuracy", "planned (ε, δ)"):
        t.add_column(c)
    t.add_row(
        "quantile", "3", "grid", "clip_lr=0.2, initial_clip=0.1, lr=1, target_quantile=0.5", "0.8123", "(3, 1e-05)"
    )
    return t


def test_a_table_that_cannot_fit_is_stacked() -> None:
    narrow = Console(file=io.StringIO(), width=60, color_system=None)
    print_table(narrow, _wide_table())
    text = narrow.file.getvalue()
    assert "selected configuration: clip_lr=0.2, initial_clip=0.1" in text and "accuracy: 0.8123" in text
    assert max(len(ln) for ln in text.splitlines()) <= 60 and "┃" not in text
    wide = Console(file=io.StringIO(), width=200, color_system=None)
    print_table(wide, _wide_table())
    assert "┃ strategy" in wide.file.getvalue()  # room enough: the table itself


def test_demo_one_unit_no_empty_column_and_what_to_publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's printing on a tiny study: accuracy as the HTML and CSV give it, no "test"
    column without a test metric, and the publishing rule."""
    monkeypatch.setattr(_reproduce, "demo_study", lambda: tomllib.loads(tiny_study_toml("demo-tiny", lrs=(0.5, 1.0))))
    console = Console(file=io.StringIO(), width=100, color_system=None)
    out = _reproduce.demo(tmp_path / "demo", progress=False, console=console)
    text = console.file.getvalue()
    assert "(%)" not in text and "│ test" not in text
    flat = " ".join(text.split())
    assert f"publish {out / 'release'}/ only; {out / 'diagnostics'}/ is for the data owner" in flat
    with open(out / "release" / "results.csv") as fh:
        value = float(next(csv.DictReader(fh))["value_mean"])
    assert 0 < value <= 1  # a fraction in the CSV ...
    shown = f"{value:.4g}"
    assert shown in text  # ... printed as it is ...
    assert shown in _plain((out / "release" / "report.html").read_text())  # ... and on the HTML page


def test_report_of_one_epsilon_one_strategy(tmp_path: Path) -> None:
    study = make_study(space={"lr": [0.3, 1.0]}, fixed={"clip": 1.0}, selection=SelectionSpec(eval_every=3))
    run_study(study, tmp_path / "s", progress=False)
    page = report_study(tmp_path / "s")
    text = _plain(page.read_text())
    rel = page.parent
    # The selected model with its guarantee and where it is; what was tried (the plan's grid).
    assert "Selected model" in text and "dpsgd (grid) at ε = 2: clip=1, lr=" in text
    assert re.search(r"Guarantee: \(ε, δ\) = \((2|1\.99\d*), 1e-05\) for the whole search, per study", text)
    assert "release/models/dpsgd@eps=2/" in text
    assert "What was tried" in text and "lr ∈ [0.3, 1.0]" in text and "--include-diagnostics" in text
    # The learning curve on the (public) selection split: its figure and CSV are published.
    assert "Learning curve" in text and (rel / "figures" / "learning_curves.png").is_file()
    with open(rel / "learning_curves.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [3, 6, 9, 10] and all(0 <= float(r["score"]) <= 1 for r in rows)
    # No single dot (one ε) and no flat lines (fixed C and ρ): a sentence says it instead.
    assert not (rel / "figures" / "metric_vs_epsilon.png").exists()
    assert not (rel / "figures" / "trajectories.png").exists()
    assert "kept C and ρ fixed over training" in text and "C = 1.0" in text
    # No empty "test" column in the tuner's selection table (no test metric here).
    assert "selection score test" not in text


def test_private_selection_curves_stay_in_the_diagnostics(tmp_path: Path) -> None:
    sel = SelectionSpec(mode="private", split="holdout", eval_every=5, noise_multiplier=30.0)
    run_study(make_study(selection=sel), tmp_path / "s", progress=False)
    page = report_study(tmp_path / "s", include_diagnostics=True)
    assert "Learning curve" not in _plain(page.read_text())
    assert not (page.parent / "learning_curves.csv").exists()
    diag = tmp_path / "s" / "diagnostics"
    assert (diag / "learning_curves.csv").read_text().startswith(f"# {NOT_DP_LABEL}")
    assert "Learning curve" in _plain((diag / "report.html").read_text())


def test_no_internal_issue_numbers_in_strings() -> None:
    """Messages, help, HTML and model cards come from string literals of src/dptune."""
    found = []
    for path in sorted((ROOT / "src" / "dptune").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
            if re.search(r"\bissue #?\d+", text, re.I):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found


def test_paper_comparison_in_our_unit() -> None:
    """The paper's accuracy in % is shown ÷ 100, beside ours and the difference, all fractions."""
    from dptune.presets._common import Part

    part = Part("p", "t", {}, paper_scores={("oso", 3.0): (91.19, 0.5), ("dpsgd", 3.0): (89.2, 1.0)}, paper_source="x")
    row = {
        "optimizer": "oso",
        "strategy": "oso",
        "epsilon": 3.0,
        "method": "grid",
        "value_mean": 0.9,
        "value_std": 0.01,
    }
    table = _reproduce.paper_comparison(part, [row])
    assert table.rows == [
        ["dpsgd", "3", "not run", "0.892 ± 0.01", "—", "—"],
        ["oso", "3", "0.9 ± 0.01", "0.9119 ± 0.005", "-0.0119", "no"],  # |−0.0119| > 2 × 0.005
    ]
