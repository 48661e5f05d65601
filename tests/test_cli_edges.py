"""Issue 13, "no tracebacks, no silent acceptance": bad CLI input is ONE line naming the fix, exit
code 2, checked before any training, and nothing is left behind (no result file, no half-made
study directory)."""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dptune.cli import app
from dptune.errors import ConfigError

STUDY = textwrap.dedent("""
    [study]
    name = "edges"
    seeds = [0]

    [data]
    name = "digits"
    options = { flatten = true }

    [model]
    name = "logistic_regression"

    [training]
    steps = 10
    expected_batch_size = 64

    [budget]
    epsilon = 2.0
    delta = 1e-5
    accountant = "rdp"

    [method]
    name = "grid"

    [[strategies]]
    name = "dpsgd"
    space = { lr = [0.5] }
    fixed = { clip = 1.0 }
""")


def _invoke(args: list[str]) -> str:
    """The output of a CLI call that must fail with exactly one clear line (exit code 2)."""
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Fix:" in lines[0], res.output
    return lines[0]


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


def test_unreachable_ray_address_fails_fast_and_leaves_no_directory(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    start = time.monotonic()
    address = f"127.0.0.1:{_closed_port()}"
    line = _invoke(
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
    line = _invoke(
        [
            "tune",
            str(_config(tmp_path)),
            "-o",
            str(tmp_path / "s"),
            "--executor",
            "ray",
            "--address",
            "127.0.0.1:1",
            "--no-progress",
        ]
    )
    assert "pip install 'dptune[ray]'" in line
    assert not (tmp_path / "s").exists()


def test_study_sqlite_of_the_fixture_is_a_real_database(study_dir: Path) -> None:
    """Guards the damage tests: they must start from a readable store."""
    con = sqlite3.connect(f"file:{study_dir / 'study.sqlite'}?mode=ro", uri=True)
    try:
        assert con.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    finally:
        con.close()
