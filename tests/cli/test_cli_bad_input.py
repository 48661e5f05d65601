"""Bad input, refused early and clearly (issue 27, item 5): `dptune train`'s argument errors before
torch or the data load; --save into a folder that is not empty; unwritable paths before training;
Ctrl-C in `dptune tune` says how to resume; `dptune report` says when a study is unfinished; labels,
an empty dataset and a misspelt argument of `dptune.train` in Python."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import invoke_train, one_error_line
from conftest import ROOT
from test_cli_startup import HEAVY, RUN_CLI
from torch import nn
from tune_helpers import tiny_study_toml
from typer.testing import CliRunner

import dptune
from dptune.cli import app
from dptune.errors import ConfigError
from dptune.vectorized import train_many

PROC = Path("/proc/self").exists()


def _cli_in_fresh_python(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``dptune *argv`` in a fresh interpreter, and the heavy modules it imported (RUN_CLI prints them)."""
    import os

    env = {**os.environ, "PYTHONPATH": str(Path(dptune.__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", RUN_CLI, *argv], capture_output=True, text=True, timeout=120, env=env)
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY=")][-1]
    return proc, {m for m in line.removeprefix("HEAVY=").split(",") if m} & set(
        HEAVY
    )  # a folder where no file can be made, even by root


def _nonempty(tmp_path: Path) -> Path:
    d = tmp_path / "saved"
    d.mkdir()
    (d / "model.pt").write_bytes(b"an earlier model")
    return d


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epsilon", "0"], "--epsilon must be a finite number > 0, got 0.0. Fix: e.g. --epsilon 3"),
        (["--epsilon", "nan"], "--epsilon must be a finite number > 0"),
        (["--epochs", "-1"], "--epochs must be a finite number > 0"),
        (["--batch-size", "0"], "--batch-size must be a finite number > 0"),
        (["--noise-multiplier", "inf"], "--noise-multiplier must be a finite number > 0"),
        (["--delta", "1"], "--delta must lie in (0, 1)"),
        (["--eval-every", "0"], "--eval-every must be ≥ 1"),
        (["--accountant", "rpd"], "unknown --accountant 'rpd'"),
        (["--model-opt", "lora"], "--model-opt 'lora' is not key=value. Fix: write e.g. --model-opt mode=lora"),
        (["--model", "pkg.mod:fn", "--model-opt", "mode=lora"], "--model-opt sets a built-in model's options"),
        (["--seed", "-1"], "--seed must be an integer in [0, 2**63 - 1]"),
        (["--save", "NONEMPTY"], "is not empty (it holds model.pt)"),
        (["--checkpoint", "best", "--data", "m:f"], "checkpoint 'best' selects on evaluation data"),
        (["--checkpoint", "bst"], "checkpoint must be 'final' or 'best' (got 'bst')"),
        (["--out", "EXISTING"], "already holds a result. Fix: name a new file, or pass --overwrite"),
        (["--diagnostics-out", "EXISTING"], "already holds a result. Fix: name a new file, or pass --overwrite"),
        (["--out", "/dev/null", "--overwrite"], "'/dev/null' is not a regular file"),  # was replaced by a file, as root
        (["--test", "t.csv"], "--test and --schema describe a CSV: they go with --data FILE.csv"),  # was ignored
        *([(["--save", "/proc/x"], "--save '/proc/x' cannot be written")] if PROC else []),
        *([(["--out", "/proc/r.json"], "--out '/proc/r.json' cannot be written")] if PROC else []),
    ],
)
def test_train_argument_errors_come_before_torch_and_the_data(tmp_path: Path, argv: list[str], message: str) -> None:
    """Each error is one line, with neither torch nor dp_accounting imported (they took 3–9 s; a
    fresh interpreter's sys.modules is the deterministic guard, not a wall clock on a shared machine)."""
    argv = [str(_nonempty(tmp_path)) if a == "NONEMPTY" else a for a in argv]
    if "EXISTING" in argv:  # an earlier run's release, which a new run must not silently replace
        (earlier := tmp_path / "earlier.json").write_text("{}")
        argv[argv.index("EXISTING")] = str(earlier)
    out = [] if "--out" in argv else ["--out", str(tmp_path / "r.json")]
    proc, heavy = _cli_in_fresh_python("train", "--dataset", "digits", *out, *argv)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith("HEAVY=")]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Fix:" in lines[0], lines
    assert message in lines[0], lines[0]
    assert heavy == set()
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tune", "STUDY", "--workers", "0"], "workers must be an integer ≥ 1, got 0"),
        (["tune", "STUDY", "--executor", "bogus"], "unknown executor 'bogus'"),
        (["tune", "STUDY", "--address", "1.2.3.4:6379"], "does not use one"),
        (["resume", "DIR", "--executor", "bogus"], "unknown executor 'bogus'"),
        (["resume", "DIR", "--workers", "-2"], "workers must be an integer ≥ 1, got -2"),
        (["tune", "MISSING"], "does not exist. Fix: pass the path of a .toml or .yaml file"),
        *[
            ([cmd, "DIR"], "holds no study (study.sqlite is missing)")
            for cmd in ("status", "report", "export", "resume")
        ],
    ],
)
def test_study_command_argument_errors_come_before_torch(tmp_path: Path, argv: list[str], message: str) -> None:
    """Their executor options and the study's path are checked before ``dptune.tune`` (and torch)
    is imported: an error in a fraction of a second, not 3 s."""
    (tmp_path / "s.toml").write_text('[study]\nname = "x"\n')
    paths = {"STUDY": tmp_path / "s.toml", "DIR": tmp_path / "d", "MISSING": tmp_path / "no.toml"}
    argv = [str(paths[a]) if a in paths else a for a in argv]
    proc, heavy = _cli_in_fresh_python(*argv)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith("HEAVY=")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], lines
    assert heavy == set() and not (tmp_path / "d").exists()


def test_a_bad_strategy_is_refused_before_the_data_load(tmp_path: Path, monkeypatch) -> None:
    import dptune.models

    def no_load(*a, **k):
        raise AssertionError("the data was loaded before the strategy was checked")

    monkeypatch.setattr(dptune.models, "for_training", no_load)
    for hp, message in [("lr=0.1", "unknown strategy 'dpsgdd'"), ("nope=3", "no hyperparameter(s) ['nope']")]:
        strategy = "dpsgdd" if hp == "lr=0.1" else "dpsgd"
        argv = ["train", "--strategy", strategy, "--hp", hp, "--out", str(tmp_path / "r")]
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 2 and "Traceback" not in res.output and message in res.output, res.output


def test_the_release_json_is_written_after_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JSON marks a finished run: a crash while saving the model leaves no JSON that looks complete (found in
    review: the model was lost while the JSON said the run was done)."""
    import dptune.deliverable

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(dptune.deliverable, "save_trained", crash)
    res = invoke_train(tmp_path / "r.json", "--save", str(tmp_path / "m"))
    assert res.exit_code != 0 and not (tmp_path / "r.json").exists() and not (tmp_path / "release").exists()


def test_a_nodp_run_writes_standard_json(tmp_path: Path) -> None:
    """ε = ∞ is the string "inf", not the ``Infinity`` token that strict JSON parsers reject (found in review)."""
    import json

    def refuse(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    argv = ["train", "--dataset", "digits", "--strategy", "nodp", "--epochs", "0.2", "--out", str(tmp_path / "r.json")]
    res = CliRunner().invoke(app, [*argv, "--save", str(tmp_path / "m")])
    assert res.exit_code == 0, res.output
    for path in (tmp_path / "r.json", tmp_path / "m" / "model_card.json", *tmp_path.glob("diagnostics/*.json")):
        json.loads(path.read_text(), parse_constant=refuse)
    assert json.loads((tmp_path / "r.json").read_text())["epsilon"] == "inf"


def test_save_into_a_folder_that_is_not_empty_needs_overwrite(tmp_path: Path) -> None:
    saved = _nonempty(tmp_path)
    res = invoke_train(tmp_path / "r.json", "--save", str(saved))
    assert res.exit_code == 2 and "--overwrite" in res.output
    assert (saved / "model.pt").read_bytes() == b"an earlier model"  # untouched
    res = invoke_train(tmp_path / "r.json", "--save", str(saved), "--overwrite")
    assert res.exit_code == 0, res.output
    assert (saved / "model.pt").read_bytes() != b"an earlier model" and (saved / "model_card.json").exists()
    # An empty folder, or a new one, needs no --overwrite.
    (tmp_path / "empty").mkdir()
    assert invoke_train(tmp_path / "r2.json", "--save", str(tmp_path / "empty")).exit_code == 0


def test_an_earlier_runs_diagnostics_are_not_replaced(tmp_path: Path) -> None:
    """Found in an audit: `--out release/run.json`, then `--out run.json` (both: diagnostics/run.json) replaced the
    first run's diagnostics, losing its seed (a secret key); refused before training, as an existing --out is."""
    (diag := tmp_path / "diagnostics" / "run.json").parent.mkdir()
    diag.write_text('{"seed": 11}')
    for out in (tmp_path / "run.json", tmp_path / "release" / "run.json"):
        line = one_error_line(["train", "--dataset", "digits", "--seed", "22", "--out", str(out)])
        assert f"--diagnostics-out {str(diag)!r} already holds a result" in line and "--overwrite" in line, line
    assert diag.read_text() == '{"seed": 11}' and not (tmp_path / "run.json").exists()


def test_ctrl_c_in_train_says_nothing_was_written(tmp_path: Path, monkeypatch) -> None:
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["dptune.train"], "train", interrupted)
    res = invoke_train(tmp_path / "r.json")
    assert res.exit_code == 130 and "Traceback" not in res.output, res.output
    assert (
        "interrupted: files it had not finished were not written" in res.output and not (tmp_path / "r.json").exists()
    )


def test_full_batch_with_a_batch_size_is_refused() -> None:
    x, y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    with pytest.raises(ConfigError, match="full_batch=True uses every example each step. Fix: drop expected_batch"):
        dptune.train(nn.Linear(3, 2), (x, y), "dpgd", full_batch=True, expected_batch_size=8, steps=2,
                     noise_multiplier=1.0, delta=1e-3)  # fmt: skip


@pytest.mark.parametrize("stored", [True, False])
def test_ctrl_c_in_tune_says_how_to_resume(tmp_path: Path, monkeypatch, stored: bool) -> None:
    import dptune.tune

    study_dir = tmp_path / "s"

    def interrupted(study, d, **kw):
        if stored:  # interrupted while running: the store exists
            Path(d).mkdir(parents=True)
            (Path(d) / "study.sqlite").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(dptune.tune, "run_study", interrupted)
    (tmp_path / "s.toml").write_text(tiny_study_toml("s"))
    res = CliRunner().invoke(app, ["tune", str(tmp_path / "s.toml"), "-o", str(study_dir), "--no-progress"])
    assert res.exit_code == 130 and "Traceback" not in res.output
    assert "interrupted" in res.output
    assert (f"dptune resume {study_dir}" in res.output) == stored
    assert ("nothing stored" in res.output) != stored


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_in_a_real_tune_exits_130_with_the_resume_command(tmp_path: Path) -> None:
    import os
    import signal
    import time

    from dptune.tune import study_status

    (tmp_path / "s.toml").write_text(tiny_study_toml("s", steps=100000))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dptune.__file__).parents[1]), str(ROOT / "tests")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dptune", "tune", str(tmp_path / "s.toml"), "-o", str(tmp_path / "d"), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the plan is stored (Ctrl-C while planning stores nothing)
        try:
            if study_status(tmp_path / "d").get("total"):
                break
        except Exception:
            pass
        time.sleep(0.3)
    time.sleep(1.0)  # into the run
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    # 130, or killed by SIGINT (-2, which a shell also reports as $? = 130): about 1 run in 5 here, the
    # interpreter ends by re-raising SIGINT after the hint was printed (not understood; seen with torch loaded).
    assert proc.returncode in (130, -signal.SIGINT), out
    assert f"dptune resume {tmp_path / 'd'}" in out and "Traceback" not in out


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_to_the_coordinator_alone_does_not_wait_for_the_process_pools_runs(tmp_path: Path) -> None:
    """kill -INT to the coordinator only (a scheduler, a notebook's interrupt; a terminal's Ctrl-C reaches the
    workers too): found in review, the pool waited for the runs in flight (91 s there, forever here), then
    dropped them. Now its workers are stopped at once; the runs stay `running` and re-run on resume."""
    import os
    import signal
    import time

    from dptune.tune import study_status

    (tmp_path / "s.toml").write_text(tiny_study_toml("s", steps=10**7))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dptune.__file__).parents[1]), str(ROOT / "tests")])}
    cmd = [sys.executable, "-m", "dptune", "tune", str(tmp_path / "s.toml"), "-o", str(tmp_path / "d"), "--no-progress"]
    proc = subprocess.Popen([*cmd, "--executor", "process", "--workers", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # until a worker reports a run started
        try:
            if study_status(tmp_path / "d")["counts"].get("running"):
                break
        except Exception:  # noqa: BLE001 - not planned yet
            pass
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert time.monotonic() - sent < 30, out
    assert proc.returncode in (130, -signal.SIGINT) and f"dptune resume {tmp_path / 'd'}" in out, out


def test_a_study_whose_model_does_not_take_the_data_is_one_error_and_leaves_nothing(tmp_path: Path) -> None:
    """Found in review: digits (flat) with the Galli CNN failed in every run with torch's shape error, exit 1, and the
    half-made study refused the corrected file. Now one error at planning, exit 2, no directory."""
    study = tiny_study_toml("bad", steps=2).replace('name = "logistic_regression"', 'name = "galli_cnn"')
    (tmp_path / "s.toml").write_text(study)
    res = CliRunner().invoke(app, ["tune", str(tmp_path / "s.toml"), "-o", str(tmp_path / "d"), "--no-progress"])
    assert res.exit_code == 2 and "[model] does not take these inputs" in res.output and "Fix:" in res.output, (
        res.output
    )
    assert "Traceback" not in res.output and not (tmp_path / "d").exists()


def test_report_of_an_unfinished_study_says_so(tmp_path: Path) -> None:
    from dptune.tune import load_study_config, run_study

    (tmp_path / "s.toml").write_text(tiny_study_toml("s", steps=2, lrs=(0.5, 0.1)))
    d = tmp_path / "d"
    run_study(load_study_config(tmp_path / "s.toml"), d, progress=False)
    res = CliRunner().invoke(app, ["report", str(d)])
    assert res.exit_code == 0 and "the study is unfinished" not in res.output, res.output
    with sqlite3.connect(d / "study.sqlite") as con:
        con.execute("UPDATE runs SET status = 'planned' WHERE run_id = (SELECT run_id FROM runs LIMIT 1)")
    res = CliRunner().invoke(app, ["report", str(d)])
    assert res.exit_code == 0, res.output
    assert "the study is unfinished" in res.output and f"dptune resume {d}" in res.output


# ----------------------------------------------------------------------------- Python: labels, empty data, names
X = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
Y = torch.arange(40) % 3


def _train(data, **kw):
    return dptune.train(nn.Linear(3, 3), data, "dpsgd", epochs=1, expected_batch_size=10, noise_multiplier=1.0, **kw)


@pytest.mark.parametrize(
    ("y", "message"),
    [
        (Y - 1, "class labels must be integers 0..C-1, got -1 (a value of your data"),  # labels -1..1
        (Y.float(), "got dtype torch.float32. Fix: y.long()"),  # whole numbers stored as floats
        (Y.float() + 0.5, "Fix: loss='mse' for regression targets"),
        (Y == 1, "got dtype torch.bool"),
    ],
)
def test_bad_class_labels_are_refused_before_training(y: torch.Tensor, message: str) -> None:
    with pytest.raises(ConfigError, match="class labels") as err:
        _train((X, y))
    assert message in str(err.value)
    with pytest.raises(ConfigError, match="class labels"):  # the same in an evaluation split
        _train((X, Y), eval_data=(X, y))
    with pytest.raises(ConfigError, match="class labels"):  # and for train_many
        train_many(
            lambda s: nn.Linear(3, 3),
            (X, y),
            "dpsgd",
            [{"lr": 0.1}],
            epochs=1,
            expected_batch_size=10,
            noise_multiplier=1.0,
        )


def test_a_label_beyond_the_models_outputs_is_refused_before_training() -> None:
    """torch would fail mid-run ("Target 5 is out of bounds") after releases were made."""
    y = Y.clone()
    y[7] = 5
    with pytest.raises(
        ConfigError,
        match=r"class label 5 \(a value of your data.*\) but the model has 3 outputs .* Fix: build the model with 6",
    ):
        _train((X, y))
    assert _train((X, Y)).plan.n == 40  # labels 0..2 on 3 outputs pass


def test_labels_torch_accepts_are_accepted() -> None:
    """-100 is cross_entropy's ignore_index; float targets of several dims are class probabilities."""
    y = Y.clone()
    y[0] = -100
    assert _train((X, y)).plan.n == 40
    probs = torch.nn.functional.one_hot(Y, 3).float()
    assert _train((X, probs)).plan.n == 40


def test_an_empty_dataset_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="data has no examples. Fix") as err:
        _train((X[:0], Y[:0]))
    assert "batch of at most 0" not in str(err.value)
    with pytest.raises(ConfigError, match="has no examples"):  # a map-style dataset too
        _train(torch.utils.data.TensorDataset(X[:0], Y[:0]))


@pytest.mark.parametrize(
    ("wrong", "right"), [("target_eps", "target_epsilon"), ("epoch", "epochs"), ("dleta", "delta")]
)
def test_a_misspelt_argument_of_train_suggests_the_argument(wrong: str, right: str) -> None:
    with pytest.raises(ConfigError, match=f"train\\(\\) has no argument '{wrong}'. Fix: did you mean {right}="):
        dptune.train(nn.Linear(3, 3), (X, Y), "dpsgd", epochs=1, expected_batch_size=10, **{wrong: 3})


def test_a_misspelt_hyperparameter_still_lists_the_strategys() -> None:
    with pytest.raises(ConfigError, match=r"no hyperparameter\(s\) \['clp'\]. Fix: use those it takes: \['clip'"):
        _train((X, Y), clp=1.0)


def test_a_study_on_your_tensors_checks_the_labels_before_planning() -> None:
    from tune_helpers import make_study

    from dptune.tune import plan_only

    with pytest.raises(ConfigError, match=r"data \(training split\): class labels must be integers 0..C-1, got -1"):
        plan_only(make_study(data=(X, Y - 1, X, Y)))
    with pytest.raises(ConfigError, match="the training set is empty"):  # refused when the study is built
        plan_only(make_study(data=(X[:0], Y[:0], X, Y)))


def test_tune_into_a_folder_that_is_not_empty_and_holds_no_study_is_refused(tmp_path: Path) -> None:
    """The study's files would be mixed with the folder's (found in review); nothing is created in it."""
    from tune_helpers import tiny_study_toml

    cfg = tmp_path / "s.toml"
    cfg.write_text(tiny_study_toml("mixed"))
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("hi")
    line = one_error_line(["tune", str(cfg), "--out", str(folder), "--no-progress"])
    assert "not empty and holds no earlier run" in line
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("argv", [["reproduce", "galli-mnist", "--scale", "smoke"], ["demo"]])
def test_reproduce_and_demo_into_a_folder_of_yours_are_refused(tmp_path: Path, argv: list[str]) -> None:
    """They wrote results.csv and report.html over your files in a non-empty folder (found in review)."""
    folder = tmp_path / "mine"
    (folder / "study").mkdir(parents=True)  # a folder named as one of galli-mnist's parts (second review)
    (folder / "results.csv").write_text("my notes")
    for out in (folder, folder / "missing" / ".."):  # "mine/missing/.." is mine (second review)
        line = one_error_line([*argv, "--out", str(out), "--no-progress"])
        assert "is not empty and holds no earlier run" in line
    assert (folder / "results.csv").read_text() == "my notes" and len(list(folder.iterdir())) == 2


def test_reproduce_resumes_into_its_own_output_without_parts(tmp_path: Path, monkeypatch) -> None:
    """mohapatra-lt-vs-ma has no study: its own earlier output was refused (second review); a marker says it is ours."""
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(tmp_path))  # no data needed
    for _ in range(2):
        res = CliRunner().invoke(
            app, ["reproduce", "mohapatra-lt-vs-ma", "--scale", "smoke", "--out", str(tmp_path / "o")]
        )
        assert res.exit_code == 0, res.output


def test_a_bad_hyperparameter_value_names_one_fix(tmp_path: Path) -> None:
    """A wrapped message that named its fix got a second "Fix:" (found in review)."""
    import tomllib

    from dptune.tune import study_from_dict

    cfg = tomllib.loads(tiny_study_toml("bad-lr"))
    cfg["strategies"][0]["space"] = {"lr": ["a"]}
    with pytest.raises(ConfigError) as err:
        study_from_dict(cfg)
    assert "lr must be float" in str(err.value) and str(err.value).count("Fix:") == 1 and ".." not in str(err.value)


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path: Path) -> None:
    from dptune.data.tabular import load_csv
    from dptune.errors import DataError

    f = tmp_path / "d.csv"
    f.write_text("age,age,outcome\n30,50000,1\n40,60000,0\n")
    with pytest.raises(DataError, match=r"names \['age'\] more than once"):
        load_csv(str(f), label="outcome")


def test_tune_says_why_its_runs_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A factory that raises inside every run: the terminal gave "4 failed" and no reason (found in review);
    the first failure's line is printed, labelled for the data owner."""
    from tune_helpers import tiny_study_toml

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = tmp_path / "s.toml"
    cfg.write_text(tiny_study_toml("boom").replace('name = "logistic_regression"', 'factory = "own_factories:explode"'))
    res = CliRunner().invoke(app, ["tune", str(cfg), "--out", str(tmp_path / "st"), "--no-progress"])
    assert res.exit_code == 1 and "factory exploded" in res.output and "not differentially private" in res.output
