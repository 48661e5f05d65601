"""Issue 13, "no tracebacks, no silent acceptance": bad CLI input is ONE line naming the fix, exit
code 2, checked before any training, and nothing is left behind (no result file, no half-made
study directory)."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import one_error_line as _invoke
from tune_helpers import tiny_study_toml
from typer.testing import CliRunner

from dptune.cli import app
from dptune.errors import ConfigError

STUDY = tiny_study_toml("edges")


def _tree(d: Path) -> dict[str, int]:
    """Every file under d with its size: what a refused command must leave unchanged (but
    SQLite's -wal/-shm companions, which come and go whenever the store is opened)."""
    return {
        str(p.relative_to(d)): p.stat().st_size
        for p in sorted(d.rglob("*"))
        if p.is_file() and not p.name.endswith(("-wal", "-shm"))
    }


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any training (or, with the data check, data reading) fails the test: checks come first."""
    import importlib

    train_module = importlib.import_module("dptune.train")  # the package's `dptune.train` is the function

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started before the input was checked")

    monkeypatch.setattr(train_module, "train", refuse)


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """No training step: what ``dptune.train.train`` checks itself (plan, strategy) comes before its loop."""
    import importlib

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run started before its numbers were checked")

    monkeypatch.setattr(importlib.import_module("dptune.train"), "RunLoop", refuse)


@pytest.fixture
def no_data(monkeypatch: pytest.MonkeyPatch, no_training: None) -> None:
    from dptune import data as dpdata

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("data read before the output path was checked")

    monkeypatch.setattr(dpdata, "load", refuse)


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny finished study (a single 10-step run on digits)."""
    from dptune.tune import run_study

    d = tmp_path_factory.mktemp("edges")
    cfg = d / "study.toml"
    cfg.write_text(STUDY)
    assert run_study(cfg, d / "study", progress=False).complete
    return d / "study"


def _config(tmp_path: Path, text: str = STUDY) -> Path:
    p = tmp_path / "study.toml"
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------- 1. model vs inputs
@pytest.mark.parametrize("model", ["galli_cnn", "galli_autoencoder"])
def test_train_with_a_model_that_does_not_take_the_inputs_fails_before_training(
    tmp_path: Path, no_training: None, model: str
) -> None:
    out = tmp_path / "r.json"
    line = _invoke(["train", "--dataset", "digits", "--model", model, "--no-progress", "--out", str(out)])
    assert f"--model {model} does not take these inputs" in line and "(1, 8, 8)" in line
    assert "--model auto" in line
    assert list(tmp_path.iterdir()) == []


def test_the_issues_case_galli_cnn_on_adult_fails_before_training(tmp_path: Path, no_training: None) -> None:
    """The reported case: a tabular dataset (105 features) into a CNN was a shape error in step 1."""
    out = tmp_path / "r.json"
    line = _invoke(["train", "--dataset", "adult", "--model", "galli_cnn", "--no-progress", "--out", str(out)])
    assert "--model galli_cnn does not take these inputs" in line and "shape (105,)" in line
    assert "choose a model for the inputs of 'adult'" in line
    assert list(tmp_path.iterdir()) == []


def test_model_check_leaves_the_rng_and_the_mode_as_they_were() -> None:
    """The check's forward pass must not change the run a seed gives (dropout draws nothing)."""
    from dptune.models import check_fits

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5))
    x = torch.randn(5, 4)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    check_fits(net, x, torch.tensor([0, 1, 2, 0, 1]), "m", "fix it")
    assert torch.equal(torch.get_rng_state(), state) and net.training
    with pytest.raises(ConfigError, match=r"outputs shape \(3,\) per example, but the labels need 5 logits"):
        check_fits(net, x, torch.tensor([0, 1, 2, 3, 4]), "m", "fix it")


# ----------------------------------------------------------------------------- 2. train --out
def test_train_out_that_is_a_directory_is_refused_before_data_or_training(tmp_path: Path, no_data: None) -> None:
    target = tmp_path / "results"
    (target / "old").mkdir(parents=True)
    before = _tree(tmp_path)
    line = _invoke(["train", "--dataset", "digits", "--no-progress", "--out", str(target)])
    assert "is a directory" in line and "give a file path" in line
    assert _tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["results"]


@pytest.mark.parametrize("option", ["--out", "--diagnostics-out", "--save"])
def test_train_output_below_a_file_is_refused_before_data_or_training(
    tmp_path: Path, no_data: None, option: str
) -> None:
    (tmp_path / "a_file").write_text("keep")
    args = ["train", "--dataset", "digits", "--no-progress", "--out", str(tmp_path / "r.json")]
    if option != "--out":
        args += [option, str(tmp_path / "a_file" / "x")]
    else:
        args[-1] = str(tmp_path / "a_file" / "r.json")
    line = _invoke(args)
    assert option in line and "'a_file' is a file" in line.replace(str(tmp_path) + "/", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and (tmp_path / "a_file").read_text() == "keep"


def test_train_out_in_a_folder_without_write_permission_is_refused(
    tmp_path: Path, no_data: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    # os.access, not chmod: the tests may run as root, for whom every folder is writable.
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real(p, mode, **kw))
    line = _invoke(["train", "--dataset", "digits", "--no-progress", "--out", str(locked / "new" / "r.json")])
    assert "no write permission" in line and str(locked) in line
    assert list(locked.iterdir()) == []


# ----------------------------------------------------------------------------- 3. train --device
@pytest.mark.parametrize(("device", "message"), [("cuda", "CUDA is not available"), ("foo", "unknown device 'foo'")])
def test_train_device_that_is_not_here_is_refused(
    tmp_path: Path, no_data: None, monkeypatch: pytest.MonkeyPatch, device: str, message: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only build, whatever runs the test
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    line = _invoke(["train", "--dataset", "digits", "--device", device, "--out", str(tmp_path / "r.json")])
    assert message in line and "--device" in line
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 4. tune -o FILE
@pytest.mark.parametrize("target", ["a_file", "a_file/study"])
def test_tune_out_that_is_or_is_below_a_file_is_refused(tmp_path: Path, target: str) -> None:
    cfg = _config(tmp_path)
    (tmp_path / "a_file").write_text("keep")
    line = _invoke(["tune", str(cfg), "-o", str(tmp_path / target), "--no-progress"])
    assert "study directory" in line and "a_file" in line and ("is an existing file" in line or "is a file" in line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "study.toml"]
    assert (tmp_path / "a_file").read_text() == "keep"


# ----------------------------------------------------------------------------- 5. report --out FILE
def test_report_out_that_is_a_file_is_refused_before_anything_is_written(study_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "a_file"
    target.write_text("keep")
    before = _tree(study_dir)
    for out in (target, target / "sub"):
        line = _invoke(["report", str(study_dir), "--out", str(out)])
        assert "--out" in line and "a_file" in line
    assert _tree(study_dir) == before and target.read_text() == "keep"
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]


# ----------------------------------------------------------------------------- 6. damaged store
def _truncate(db: Path) -> None:
    with open(db, "r+b") as f:
        f.truncate(100)


def _garbage(db: Path) -> None:
    db.write_bytes(os.urandom(4096))


@pytest.mark.parametrize("damage", [_truncate, _garbage], ids=["truncated", "garbage"])
@pytest.mark.parametrize("command", ["status", "resume"])
def test_status_and_resume_on_a_damaged_store_say_so(study_dir: Path, tmp_path: Path, damage, command: str) -> None:
    d = tmp_path / "copy"
    shutil.copytree(study_dir, d)
    damage(d / "study.sqlite")
    before = _tree(d)
    line = _invoke([command, str(d)] + (["--no-progress"] if command == "resume" else []))
    assert "study.sqlite" in line and "is damaged" in line and "restore study.sqlite" in line
    assert _tree(d) == before  # nothing repaired or overwritten behind the user's back


def test_a_damaged_store_is_refused_by_the_library_too(study_dir: Path, tmp_path: Path) -> None:
    from dptune.tune import run_study, study_status
    from dptune.tune.store import DamagedStoreError

    d = tmp_path / "copy"
    shutil.copytree(study_dir, d)
    _truncate(d / "study.sqlite")
    with pytest.raises(DamagedStoreError, match="is damaged"):
        study_status(d)
    with pytest.raises(DamagedStoreError, match="is damaged"):  # not planned afresh over the damaged file
        run_study(_config(tmp_path), d, progress=False)
    assert (d / "study.sqlite").stat().st_size == 100


# ----------------------------------------------------------------------------- 7. failed plans
def test_impossible_batch_names_its_field_and_leaves_no_directory(tmp_path: Path) -> None:
    cfg = _config(tmp_path, STUDY.replace("expected_batch_size = 64", "expected_batch_size = 1e12"))
    line = _invoke(["tune", str(cfg), "-o", str(tmp_path / "new" / "study"), "--no-progress"])
    assert "training.expected_batch_size = 1e+12 is outside" in line and "strategies[" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]  # not even "new"


def test_a_batch_from_the_search_space_names_the_space(tmp_path: Path) -> None:
    cfg = _config(
        tmp_path,
        STUDY.replace("space = { lr = [0.5] }", "space = { lr = [0.5], expected_batch_size = [1e12] }"),
    )
    line = _invoke(["tune", str(cfg), "-o", str(tmp_path / "s"), "--no-progress"])
    assert "strategies[0].space: expected_batch_size = 1e+12" in line
    assert not (tmp_path / "s").exists()


def test_failed_plan_in_an_existing_folder_removes_only_what_it_created(tmp_path: Path) -> None:
    cfg = _config(tmp_path, STUDY.replace("expected_batch_size = 64", "expected_batch_size = 1e12"))
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    _invoke(["tune", str(cfg), "-o", str(d), "--no-progress"])
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("args", [["--executor", "foo"], ["--gpus-per-run", "0.5"]], ids=["unknown", "after-plan"])
def test_executor_that_cannot_start_leaves_no_directory(tmp_path: Path, args: list[str]) -> None:
    """An unknown name is refused before anything; an executor refused after planning (the
    plan was stored) still leaves nothing: no run had started."""
    line = _invoke(["tune", str(_config(tmp_path)), "-o", str(tmp_path / "s"), "--no-progress", *args])
    assert "executor" in line
    assert not (tmp_path / "s").exists()


def test_executor_refused_on_an_existing_study_keeps_the_study(study_dir: Path, tmp_path: Path) -> None:
    from dptune.tune import run_study, study_status

    d = tmp_path / "copy"
    shutil.copytree(study_dir, d)
    before = _tree(d)
    with pytest.raises(ConfigError, match="gpus_per_run is a Ray option"):
        run_study(_config(tmp_path), d, progress=False, gpus_per_run=0.5)
    assert _tree(d) == before and study_status(d)["complete"]


def test_status_of_a_study_that_was_never_planned_says_so(tmp_path: Path) -> None:
    from dptune.tune.store import Store

    d = tmp_path / "half"
    Store(d, create=True).close()  # what a failed plan used to leave: tables, no plan
    for command in ("status", "resume"):
        line = _invoke([command, str(d)])
        assert "never planned" in line and "no privacy budget was spent" in line and "delete the directory" in line


# ----------------------------------------------------------------------------- 8. Ray
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


def _tune_on_ray(tmp_path: Path, address: str) -> str:
    """The one error line of `dptune tune` on the Ray executor at ``address``, study directory tmp_path/s."""
    return _invoke(
        [
            "tune",
            str(_config(tmp_path)),
            "-o",
            str(tmp_path / "s"),
            "--executor",
            "ray",
            "--address",
            address,
            "--no-progress",
        ]
    )


def test_unreachable_ray_address_fails_fast_and_leaves_no_directory(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    start = time.monotonic()
    address = f"127.0.0.1:{_closed_port()}"
    line = _tune_on_ray(tmp_path, address)
    assert f"no Ray cluster answers at '{address}'" in line and "ray start --head" in line
    assert time.monotonic() - start < 20  # ray.init retried this address for minutes
    assert not (tmp_path / "s").exists()


def test_ray_address_check_accepts_a_listening_port_and_refuses_a_malformed_one() -> None:
    from dptune.tune.executors import check_ray_address

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_ray_address(f"127.0.0.1:{s.getsockname()[1]}")
        check_ray_address(f"ray://127.0.0.1:{s.getsockname()[1]}")
    with pytest.raises(ConfigError, match="is not host:port"):
        check_ray_address("127.0.0.1:port")


def test_ray_executor_without_ray_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    line = _tune_on_ray(tmp_path, "127.0.0.1:1")
    assert "pip install 'dptune[ray]'" in line
    assert not (tmp_path / "s").exists()


def test_study_sqlite_of_the_fixture_is_a_real_database(study_dir: Path) -> None:
    """Guards the damage tests: they must start from a readable store."""
    con = sqlite3.connect(f"file:{study_dir / 'study.sqlite'}?mode=ro", uri=True)
    try:
        assert con.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    finally:
        con.close()


# ----------------------------------------------------------------------------- 9. found by the CLI fuzzer
# tests/cli/test_faults.py::test_fuzzed_cli_arguments_never_raise_tracebacks feeds every command wrong file
# types, paths, devices, booleans, huge numbers, damaged stores and unreachable clusters; each case
# below was a traceback, a silent acceptance, a late refusal or a message without a fix.
def _junk_files(tmp_path: Path) -> None:
    (tmp_path / "garbage.toml").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (tmp_path / "yaml.toml").write_text("study:\n  name: edges\nbudget:\n  epsilon: 2.0\n")


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("garbage.toml", ["is not a text file", "pass the study's .toml or .yaml file"]),
        ("image.png", ["unknown file type '.png'", "use a .toml or .yaml file"]),
        ("yaml.toml", ["not valid TOML", "it reads as YAML: rename it to .yaml"]),
    ],
)
def test_a_study_file_of_the_wrong_type_is_named(tmp_path: Path, name: str, fragments: list[str]) -> None:
    """A binary file once gave "'utf-8' codec can't decode byte 0x99 in position 5"."""
    _junk_files(tmp_path)
    line = _invoke(["tune", str(tmp_path / name), "-o", str(tmp_path / "s"), "--no-progress"])
    assert all(f in line for f in fragments), line
    assert "codec" not in line and not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        ('full_batch = "maybe"', ["training.full_batch: must be true or false, got 'maybe'"]),
        ("full_batch = 2", ["training.full_batch: must be true or false, got 2"]),
        ("flatten = 2", ["data.options.flatten: must be true or false, got 2", "flatten = false"]),
        ('flatten = "yes"', ["data.options.flatten: must be true or false, got 'yes'"]),
        ("steps = 1000000000000", ["training.steps = 1000000000000 gives 1e+12 steps per run, more than 1e+07"]),
        ("expected_batch_size = 1e-320", ["training.expected_batch_size:", "sampling rate q", "below 1e-12"]),
    ],
)
def test_study_values_that_were_accepted_or_crashed_are_refused_before_the_study_folder(
    tmp_path: Path, edit: str, fragments: list[str]
) -> None:
    """full_batch = "maybe" was called exclusive with the batch; flatten = 2 was read as true; 10¹²
    steps were a MemoryError while planning; a batch of 1e-320 ran for a minute at q = 7e-324."""
    key = edit.split(" = ")[0]
    text = STUDY
    if key == "full_batch":
        text = text.replace("[training]\n", f"[training]\n{edit}\n")
    elif key == "flatten":
        text = text.replace("flatten = true", edit)
    else:
        text = text.replace("steps = 10" if key == "steps" else "expected_batch_size = 64", edit)
    cfg = _config(tmp_path, text)
    start = time.monotonic()
    line = _invoke(["tune", str(cfg), "-o", str(tmp_path / "new" / "s"), "--no-progress"])
    assert all(f in line for f in fragments), line
    assert time.monotonic() - start < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]


@pytest.mark.parametrize("target", ["a_file", "a_file/sub"])
@pytest.mark.parametrize("command", ["export", "reproduce", "demo"])
def test_out_that_is_or_is_below_a_file_is_refused_by_export_reproduce_and_demo(
    study_dir: Path, tmp_path: Path, command: str, target: str
) -> None:
    """Below a file it was a NotADirectoryError traceback (export also for the file itself)."""
    (tmp_path / "a_file").write_text("keep")
    before = _tree(study_dir)
    args = {
        "export": ["export", str(study_dir)],
        "reproduce": ["reproduce", "galli-mnist", "--steps", "1", "--limit", "64"],
        "demo": ["demo"],
    }[command]
    line = _invoke([*args, "--out", str(tmp_path / target), *([] if command == "export" else ["--no-progress"])])
    assert "a_file" in line and ("is an existing file" in line or "is a file" in line)
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"] and (tmp_path / "a_file").read_text() == "keep"
    assert _tree(study_dir) == before


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--device", ""], "unknown device ''"),  # '' was read as "not given": the smoke preset ran
        (["--data-dir", "DIR/a_file"], "--data-dir 'DIR/a_file' is a file"),
        (["--data-dir", "DIR/missing"], "--data-dir 'DIR/missing' does not exist"),
        (["--steps", "1000000000000"], "--steps 1000000000000 gives 1e+12 steps per run"),  # left runs/ behind
    ],
)
def test_reproduce_refuses_bad_options_before_the_output_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], fragment: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("keep")
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    line = _invoke(["reproduce", "galli-mnist", "--scale", "smoke", "--limit", "64", *args, "--no-progress"])
    assert fragment.replace("DIR", str(tmp_path)) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no runs/


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--seed", "-1"], "--seed must be an integer in [0, 2**63 - 1], got -1"),
        (["--seed", str(10**24)], "--seed must be an integer in [0, 2**63 - 1]"),
        (["--data-dir", "DIR/a_file"], "is a file: it names the folder holding the datasets"),
        (["--data-dir", "DIR/missing"], "does not exist: it names the folder holding the datasets"),
    ],
)
def test_train_refuses_a_bad_seed_or_data_folder_before_reading_data(
    tmp_path: Path, no_data: None, args: list[str], fragment: str
) -> None:
    """--seed -1 said "expected non-negative integer"; a --data-dir that is a file was ignored."""
    (tmp_path / "a_file").write_text("keep")
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    line = _invoke(["train", "--dataset", "digits", *args, "--out", str(tmp_path / "r.json"), "--no-progress"])
    assert fragment in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--epochs", "1e308"], "epochs = 1e+308 at q = 0.1 gives inf steps per run, more than 1e+07"),
        (["--epochs", "nan"], "epochs must be a finite number > 0, got nan"),
        (["--batch-size", "1e-320"], "gives a sampling rate q = 4.94e-324, below 1e-12"),
        (["--noise-multiplier", "1e-320"], "noise_multiplier = 1e-320 is outside [1e-06, 1e+09]"),
        (["--noise-multiplier", "1e308"], "noise_multiplier = 1e+308 is outside [1e-06, 1e+09]"),
        (["--noise-multiplier", "0.01"], "the PLD accountant cannot account this run: ν = 0.01 is below 0.1"),
        (["--epsilon", "1e308"], "calibrating ν to ε = 1e+308 at δ = 1e-05 with the PLD accountant"),
    ],
)
def test_train_refuses_out_of_range_numbers_before_training(
    tmp_path: Path, no_run: None, args: list[str], fragment: str
) -> None:
    """1e308 epochs and a batch of 1e-320 were OverflowErrors, ν = 1e308 a ZeroDivisionError, ε = 1e308
    calibrated for minutes; ν = 0.01 would have built a PLD of gigabytes after training."""
    start = time.monotonic()
    line = _invoke(["train", "--dataset", "digits", *args, "--out", str(tmp_path / "r.json"), "--no-progress"])
    assert fragment in line, line
    assert "Fix:" in line and time.monotonic() - start < 30
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--epsilon", "1e308", "--sampling-rate", "0.1", "--steps", "10"], "use the 'rdp' accountant"),
        (["--epsilon", "1", "--sampling-rate", "1e-320", "--steps", "10"], "q = 1e-320 is below 1e-12"),
        (
            ["--epsilon", "1", "--sampling-rate", "0.1", "--steps", str(10**12), "--accountant", "pld"],
            "1e+12 releases are more than 1e+06",
        ),
        (
            ["--epsilon", "1", "--sampling-rate", "0.1", "--steps", "10", "--runs", str(10**12), "--accountant", "pld"],
            "1e+13 releases",
        ),
        (
            ["--epsilon", "1", "--sampling-rate", "0.1", "--steps", "10", "--delta", "1e-320", "--accountant", "pld"],
            "check δ",
        ),
    ],
)
def test_calibrate_refuses_what_it_cannot_compute_quickly(args: list[str], fragment: str) -> None:
    """ε = 1e308 and q = 1e-320 calibrated for minutes, 10¹² steps were a MemoryError (37 TiB), and
    δ = 1e-320 asked "is a step non-private?"."""
    start = time.monotonic()
    line = _invoke(["calibrate", *args])
    assert fragment in line, line
    assert "non-private?" not in line and time.monotonic() - start < 30


@pytest.mark.parametrize("steps_runs", [(10**12, 1), (2710, 2710)])
def test_calibrate_auto_takes_rdp_where_pld_would_take_minutes(steps_runs: tuple[int, int]) -> None:
    """Found by the CLI fuzz: 2,710 steps × 2,710 runs (7.3·10⁶ releases) calibrated by PLD for minutes and
    17 GB; 'auto' is PLD up to 10⁶ releases (20 s), RDP beyond (seconds, a valid upper bound)."""
    start = time.monotonic()
    steps, runs = steps_runs
    res = CliRunner().invoke(app, ["calibrate", "--epsilon", "8", "--sampling-rate", "0.5", "--steps", str(steps),
                                   "--runs", str(runs)])  # fmt: skip
    assert res.exit_code == 0 and ", rdp)" in res.output, res.output
    assert time.monotonic() - start < 30


def test_auto_takes_rdp_below_the_deltas_pld_resolves() -> None:
    """Found in review: dp_accounting's PLD answers ε = ∞ from δ = 1e-15 on; `auto` then printed ∞, or refused a
    calibration that RDP does in a second."""
    from dptune import accounting

    res = CliRunner().invoke(app, ["calibrate", "--epsilon", "3", "--delta", "1e-20", "--sampling-rate", "0.01",
                                   "--steps", "100"])  # fmt: skip
    assert res.exit_code == 0 and ", rdp)" in res.output, res.output
    res = CliRunner().invoke(app, ["account", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--steps", "10",
                                   "--delta", "1e-16"], terminal_width=200)  # fmt: skip
    assert "not computed (δ below 1e-14" in res.output and " inf " not in res.output, res.output
    assert (
        accounting.tightest_accountant(0.1, 100, 1e-16) == "rdp"
        and accounting.tightest_accountant(0.1, 100, 1e-5) == "pld"
    )


def test_account_refuses_a_sampling_rate_below_the_accountants_range() -> None:
    """q = 1e-320 said "a must be greater than b. Got a=inf and b=inf."."""
    line = _invoke(["account", "--noise-multiplier", "1", "--sampling-rate", "1e-320", "--steps", "10"])
    assert "sampling rate q = 1e-320 is below 1e-12" in line


def test_account_skips_pld_where_its_grid_would_be_huge() -> None:
    res = CliRunner().invoke(
        app, ["account", "--noise-multiplier", "0.05", "--sampling-rate", "1e-9", "--steps", "10"], terminal_width=200
    )
    assert res.exit_code == 0, res.output
    assert "not computed (ν = 0.05 is below 0.1" in res.output


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--out", "DIR/adir"], "--out 'DIR/adir' is a directory"),
        (["--out", "DIR/a_file/a.json"], "'DIR/a_file' is a file"),
        (["--eps", "1e308"], "eps = 1e+308 cannot be audited"),
        (["--canaries", str(10**12)], "canaries = 1,000,000,000,000 is more than 20,000"),
        (["--method", "two-world", "--canaries", str(10**12)], "is more than 200,000"),
    ],
)
def test_audit_refuses_bad_output_and_huge_numbers_before_auditing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], fragment: str
) -> None:
    """A bad --out failed after the audit (losing it); ε = 1e308 calibrated for minutes; 10¹²
    canaries asked numpy for 7 TiB."""
    import dptune.audit.runner as runner

    (tmp_path / "adir").mkdir()
    (tmp_path / "a_file").write_text("keep")

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the audit trained before its arguments were checked")

    monkeypatch.setattr(runner._Audit, "train", refuse)
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    line = _invoke(["audit", "--strategy", "dpsgd", *args])
    assert fragment.replace("DIR", str(tmp_path)) in line, line
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "adir"] and list((tmp_path / "adir").iterdir()) == []
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--executor", "ray", "--address", ""], "Ray address '' is not host:port"),  # started a local Ray
        (["--executor", "local", "--address", "127.0.0.1:1"], "executor 'local' does not use one"),  # ignored
    ],
)
def test_an_empty_or_unused_ray_address_is_refused(tmp_path: Path, args: list[str], fragment: str) -> None:
    pytest.importorskip("ray")
    line = _invoke(["tune", str(_config(tmp_path)), "-o", str(tmp_path / "s"), *args, "--no-progress"])
    assert fragment in line and "Fix:" in line
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "args", [["--executor", "bogus"], ["--executor", "ray", "--address", "127.0.0.1:1"]], ids=["unknown", "ray"]
)
def test_resume_of_a_complete_study_still_refuses_a_bad_executor(study_dir: Path, args: list[str]) -> None:
    """It answered "already complete" with exit code 0 whatever the executor."""
    pytest.importorskip("ray")
    before = _tree(study_dir)
    line = _invoke(["resume", str(study_dir), *args, "--no-progress"])
    assert "executor" in line or "no Ray cluster answers" in line
    assert _tree(study_dir) == before


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--strategy", "oso", "--hp", "adapt_lr=2"],
            "adapt_lr must be bool, got 2 (int). Fix: e.g. --hp adapt_lr=true",
        ),
        (["--strategy", "oso", "--hp", "adapt_lr=maybe"], "adapt_lr must be bool, got 'maybe' (str). Fix:"),
        (["--hp", "nope=3"], "has no hyperparameter(s) ['nope']. Fix: use those it takes:"),
        (["--model", "no_such_model"], "unknown model 'no_such_model'. Fix: choose one of"),
        (["--dataset", "no_such_data"], "unknown dataset 'no_such_data'. Fix: choose one of"),
    ],
)
def test_unknown_or_mistyped_names_name_the_fix(tmp_path: Path, no_run: None, args: list[str], fragment: str) -> None:
    if "--dataset" not in args:
        args = ["--dataset", "digits", *args]
    line = _invoke(["train", *args, "--out", str(tmp_path / "r.json"), "--no-progress"])
    assert fragment in line, line
    assert list(tmp_path.iterdir()) == []
