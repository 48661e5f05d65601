"""`dptune train`'s files and a study's progress bar, as an output audit found them.

* `--out DIR/release/run.json` put the owner-only diagnostics (the seed, the training loss, the
  realised batch sizes) inside `release/`: they now go beside it, `DIR/diagnostics/`, and an
  explicit `--diagnostics-out` inside a release folder is refused;
* a non-private run (`--strategy nodp`) was written like a release, unlabelled: its JSON, its
  model card and its terminal table now carry the label;
* the tuner's progress bar counts the runs, which a Liu–Talwar guarantee keeps secret: labelled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import invoke_train, one_error_line

from dptune.outputs import NOT_DP_LABEL


def test_diagnostics_go_beside_a_release_folder_not_inside_it(tmp_path: Path) -> None:
    out = tmp_path / "release" / "run.json"
    res = invoke_train(out)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "release").iterdir()) == ["run.json"]
    diag = json.loads((tmp_path / "diagnostics" / "run.json").read_text())
    assert NOT_DP_LABEL in diag["privacy"] and "seed" in diag
    assert "seed" not in json.loads(out.read_text())


def test_diagnostics_out_inside_a_release_folder_is_refused(tmp_path: Path) -> None:
    line = one_error_line(
        ["train", "--dataset", "digits", "--out", str(tmp_path / "r.json"),
         "--diagnostics-out", str(tmp_path / "release" / "d.json")]
    )  # fmt: skip
    assert "release" in line and not (tmp_path / "release").exists() and not (tmp_path / "r.json").exists()


def test_a_non_private_run_is_labelled_everywhere(tmp_path: Path) -> None:
    out, save = tmp_path / "run.json", tmp_path / "model"
    res = invoke_train(out, "--strategy", "nodp", "--save", str(save), hps=("lr=0.5",))
    assert res.exit_code == 0, res.output
    assert NOT_DP_LABEL in json.loads(out.read_text())["privacy"]
    cards = list(save.rglob("*.json"))
    assert cards and all(NOT_DP_LABEL in json.loads(c.read_text()).get("privacy", "") for c in cards)
    assert NOT_DP_LABEL in " ".join(res.output.split())  # the terminal table's title


def test_a_private_run_is_not_labelled_as_owner_only(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    assert invoke_train(out).exit_code == 0
    assert "privacy" not in json.loads(out.read_text())


@pytest.mark.parametrize(("method", "labelled"), [("liu-talwar", True), ("grid", False)])
def test_the_progress_bar_is_labelled_when_it_shows_a_secret_run_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str, labelled: bool
) -> None:
    import dataclasses

    from tune_helpers import tiny_dpsgd_study

    from dptune.tune import MethodSpec, SelectionSpec, run_study

    study = tiny_dpsgd_study(
        data_seed=0, n=200, dim=5, n_train=150, lrs=[0.1, 1.0], steps=4, batch=20, eps=2.0,
        selection=SelectionSpec(eval_every=2), seeds=(0,), name="bar",
    )  # fmt: skip
    if method == "liu-talwar":
        study = dataclasses.replace(study, method=MethodSpec("liu-talwar", {"gamma": 0.5}))
    run_study(study, tmp_path / "s", progress=True)
    err = " ".join(capsys.readouterr().err.split())
    assert (NOT_DP_LABEL in err) == labelled, err[-400:]
