"""The study directory and its store are never damaged by dptune itself: a failed or interrupted
plan removes only what its own process made (never a sibling study or a user's file that
appeared meanwhile), a damaged store is refused without a read-write open (which let SQLite
rewrite it and delete its -wal), readers say when a coordinator is planning right now, a
reused Ray executor works, dangling symlinks are refused before any work, the ETA counts a
group of runs once (and failed runs), `dptune tune` says so (exit code 1) when runs did not finish,
a store that lost its -wal commits is never planned again, and a full disk is one line."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import one_error_line as _refused
from tune_helpers import tiny_study_toml
from typer.testing import CliRunner

import dptune.tune.study as study_mod
from dptune.cli import app
from dptune.errors import ConfigError

STUDY = tiny_study_toml("safety")
BAD = STUDY.replace("expected_batch_size = 64", "expected_batch_size = 1e12")  # fails while planning


def _config(tmp_path: Path, text: str = STUDY, name: str = "study.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _failing_planner(monkeypatch: pytest.MonkeyPatch, meanwhile: Any, exc: BaseException) -> None:
    """The first plan_study call runs ``meanwhile()`` (what other processes or the user do while
    this study plans) and then fails with ``exc``; later calls plan normally."""
    real = study_mod.plan_study
    calls = []

    def plan(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            meanwhile()
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(study_mod, "plan_study", plan)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny finished study (a single 10-step run on digits)."""
    from dptune.tune import run_study

    d = tmp_path_factory.mktemp("safety")
    assert run_study(_config(d), d / "study", progress=False).complete
    return d / "study"


# ----------------------------------------------------------------------------- 1. undo of a failed plan
def test_a_file_dropped_into_the_new_top_folder_while_planning_survives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dptune.tune import run_study

    top = tmp_path / "new"
    _failing_planner(monkeypatch, lambda: (top / "notes.txt").write_text("keep"), ConfigError("plan failed"))
    with pytest.raises(ConfigError, match="plan failed"):
        run_study(_config(tmp_path), top / "study", progress=False)
    assert (top / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in top.iterdir()) == ["notes.txt"]  # its own folder and files are gone


def test_a_sibling_study_started_alongside_survives_a_failed_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dptune tune` into sweep/bad and sweep/good at once: bad's failed plan once removed sweep/
    with good's finished study (and the budget it spent) in it."""
    from dptune.tune import run_study, study_status

    cfg, sweep = _config(tmp_path), tmp_path / "sweep"
    _failing_planner(
        monkeypatch,
        lambda: run_study(cfg, sweep / "good", progress=False),
        ConfigError("training.expected_batch_size = 1e+12 is outside"),
    )
    with pytest.raises(ConfigError, match="is outside"):
        run_study(cfg, sweep / "bad", progress=False)
    assert (sweep / "good" / "study.sqlite").is_file() and study_status(sweep / "good")["complete"]
    assert sorted(p.name for p in sweep.iterdir()) == ["good"]


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_a_failed_plan_into_a_dotdot_path_leaves_nothing(tmp_path: Path, existing: bool) -> None:
    """`e/m/..` is e: its store went into e, but only e/m was removed (e/study.sqlite and .lock stayed). An e holding
    files of yours is refused before the plan (a second review: the folder check read e/m/.. as missing)."""
    cfg = _config(tmp_path, BAD)
    if existing:
        (tmp_path / "e").mkdir()
        (tmp_path / "e" / "notes.txt").write_text("keep")
    line = _refused(["tune", str(cfg), "-o", str(tmp_path / "e" / "m" / ".."), "--no-progress"])
    assert ("is not empty and holds no earlier run" if existing else "expected_batch_size") in line
    assert sorted(p.name for p in tmp_path.iterdir()) == (["e", "study.toml"] if existing else ["study.toml"])
    if existing:
        assert sorted(p.name for p in (tmp_path / "e").iterdir()) == ["notes.txt"]


def test_a_dotdot_path_stores_the_study_in_the_folder_it_names(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        app, ["tune", str(_config(tmp_path)), "-o", str(tmp_path / "e" / "m" / ".."), "--no-progress"]
    )
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert (tmp_path / "e" / "study.sqlite").is_file() and not (tmp_path / "e" / "m").exists()


def test_ctrl_c_while_planning_removes_only_its_own_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dptune.tune import run_study

    d = tmp_path / "new" / "study"
    _failing_planner(monkeypatch, lambda: (d / "user.txt").write_text("keep"), KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run_study(_config(tmp_path), d, progress=False)
    assert sorted(p.name for p in d.iterdir()) == ["user.txt"]  # no study.sqlite*, no .lock
    assert (d / "user.txt").read_text() == "keep"


def test_ctrl_c_while_planning_in_an_existing_folder_keeps_what_was_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dptune.tune import run_study

    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    _failing_planner(monkeypatch, lambda: None, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        run_study(_config(tmp_path), d, progress=False)
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


# ----------------------------------------------------------------------------- 2. damaged store + WAL
def _md5(p: Path) -> str:
    return hashlib.md5(p.read_bytes()).hexdigest()


def test_a_damaged_store_with_a_wal_is_refused_and_left_byte_for_byte(finished: Path, tmp_path: Path) -> None:
    d = tmp_path / "copy"
    shutil.copytree(finished, d)
    db = d / "study.sqlite"
    # A coordinator killed after a commit: the commit is in the -wal only (no checkpoint ran).
    write = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA wal_autocheckpoint=0')\n"
        "c.execute(\"INSERT INTO meta(key, value) VALUES ('latest', '1')\")\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", write, str(db)], check=True)
    wal = d / "study.sqlite-wal"
    assert wal.stat().st_size > 0
    with open(db, "r+b") as f:
        f.write(b"\0" * 16)  # the header overwritten
    before = (_md5(db), _md5(wal))
    cfg = _config(tmp_path)
    for args in (
        ["tune", str(cfg), "-o", str(d), "--no-progress"],
        ["status", str(d)],
        ["resume", str(d), "--no-progress"],
        ["report", str(d)],
    ):
        line = _refused(args)
        assert "is damaged" in line and "restore study.sqlite" in line, args
        assert (_md5(db), _md5(wal)) == before, f"{args[0]} changed the store or deleted its -wal"


def test_a_store_copied_without_its_wal_is_refused_and_never_planned_again(finished: Path, tmp_path: Path) -> None:
    """Found in an audit: a study.sqlite copied without its -wal (the commits since the last checkpoint) read as "never
    planned ... no privacy budget was spent. Fix: delete the directory", and `dptune tune` planned it again,
    overwriting its model. Beside checkpoints/, release/ or diagnostics/, status, resume and tune now refuse it."""
    d = tmp_path / "copy"
    shutil.copytree(finished, d)
    (d / "study.sqlite").unlink()
    with sqlite3.connect(d / "study.sqlite") as con:  # the main file of a store killed before its first checkpoint
        con.execute("PRAGMA journal_mode=WAL")
    models = {p: _md5(p) for p in d.rglob("*.pt")}
    assert any("release" in p.parts for p in models)
    for args in (
        ["status", str(d)],
        ["resume", str(d), "--no-progress"],
        ["tune", str(_config(tmp_path)), "-o", str(d), "--no-progress"],
    ):
        line = _refused(args)
        assert "lost its commits" in line and "study.sqlite-wal" in line and "budget" not in line, args
    assert {p: _md5(p) for p in d.rglob("*.pt")} == models


def test_the_integrity_check_runs_once_per_file_state(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dptune.tune.store import Store

    d = tmp_path / "copy"
    shutil.copytree(finished, d)
    checks = []
    real = Store._open_readonly

    def counting(self: Store) -> sqlite3.Connection:
        conn = real(self)
        checks.append(1)
        return conn

    monkeypatch.setattr(Store, "_open_readonly", counting)
    for _ in range(3):
        with Store(d, readonly=True):
            pass
    assert len(checks) == 1 + 3  # one quick_check, then each reader's own connection
    with Store(d) as s:  # a write changes the file: checked again
        s.conn.execute("INSERT INTO meta(key, value) VALUES ('touched', '1')")
    checks.clear()
    with Store(d, readonly=True):
        pass
    assert len(checks) == 2


def _cantopen_unless_immutable(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a WAL store on read-only media without its -shm gives a read-only open."""
    real = sqlite3.connect

    class Refusing:
        def __init__(self, conn: sqlite3.Connection):
            self.conn = conn

        def execute(self, *a: Any) -> Any:
            err = sqlite3.OperationalError("unable to open database file")
            err.sqlite_errorname = "SQLITE_CANTOPEN"  # type: ignore[attr-defined]
            raise err

        def close(self) -> None:
            self.conn.close()

    def connect(database: Any, *a: Any, **kw: Any) -> Any:
        conn = real(database, *a, **kw)
        if kw.get("uri") and "mode=ro" in str(database) and "immutable=1" not in str(database):
            return Refusing(conn)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)


def test_a_store_on_read_only_media_is_read_as_immutable(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dptune.tune import study_status

    d = tmp_path / "copy"
    shutil.copytree(finished, d)
    for companion in ("study.sqlite-wal", "study.sqlite-shm"):
        (d / companion).unlink(missing_ok=True)
    _cantopen_unless_immutable(monkeypatch)
    assert study_status(d)["complete"]


def test_a_store_with_a_wal_on_read_only_media_is_one_clear_error(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "copy"
    shutil.copytree(finished, d)
    (d / "study.sqlite-wal").write_bytes(b"x" * 100)  # commits the immutable reading would not see
    _cantopen_unless_immutable(monkeypatch)
    line = _refused(["status", str(d)])
    assert "read-only location" in line and "copy the study directory" in line


# ----------------------------------------------------------------------------- 6. a coordinator planning now
@pytest.mark.parametrize("stage", ["no store yet", "tables, no plan yet"])
def test_status_while_another_process_plans_says_wait_not_delete(tmp_path: Path, stage: str) -> None:
    from tune_helpers import study_lock

    from dptune.tune.store import Store

    d = tmp_path / "planning"
    with study_lock(d):
        if stage != "no store yet":
            Store(d, create=True).close()
        for command in ("status", "resume"):
            line = _refused([command, str(d)])
            assert "being planned (or run) right now" in line and "wait" in line
            assert "delete" not in line
    if stage != "no store yet":  # no coordinator any more: a failed plan, which may be deleted
        line = _refused(["status", str(d)])
        assert "never planned" in line and "delete the directory" in line


# ----------------------------------------------------------------------------- 3. Ray executor reused
@pytest.mark.slow
def test_a_ray_executor_can_run_two_studies(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from tune_helpers import tiny_dpsgd_study

    from dptune.tune import SelectionSpec, run_study
    from dptune.tune.executors import RayExecutor

    study = tiny_dpsgd_study(
        data_seed=3,
        n=200,
        dim=4,
        n_train=150,
        lrs=[0.5],
        steps=5,
        batch=30,
        eps=2.0,
        selection=SelectionSpec(mode="public"),
        seeds=(0,),
        name="reuse",
    )
    ex = RayExecutor(workers=1)  # starts (and, at close, stops) its own Ray
    for name in ("a", "b"):
        out = run_study(study, tmp_path / name, executor=ex, progress=False)
        assert out.complete and out.counts == {"done": 1}, out.counts
    assert not ray.is_initialized()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # a Ray that outlives the studies
    try:
        ex = RayExecutor()
        for name in ("c", "d"):
            out = run_study(study, tmp_path / name, executor=ex, progress=False)
            assert out.complete and out.counts == {"done": 1}, out.counts
        assert ray.is_initialized()
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------- 4. dangling symlinks
def test_tune_into_a_dangling_symlink_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "dang"
    link.symlink_to(tmp_path / "nowhere" / "study")
    line = _refused(["tune", str(_config(tmp_path)), "-o", str(link), "--no-progress"])
    assert "symbolic link" in line and str(tmp_path / "nowhere" / "study") in line
    assert not (tmp_path / "nowhere").exists() and link.is_symlink()


def test_train_out_that_is_a_dangling_symlink_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dptune import data as dpdata

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("data read before the output path was checked")

    monkeypatch.setattr(dpdata, "load", refuse)
    for out, target in (("r.json", "gone/r.json"), ("dir/r.json", "gone")):
        link = tmp_path / out.split("/")[0]
        link.symlink_to(tmp_path / target)
        line = _refused(["train", "--dataset", "digits", "--no-progress", "--out", str(tmp_path / out)])
        assert "--out" in line and "symbolic link" in line and str(tmp_path / target) in line
        link.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 5. ETA of grouped runs
def test_eta_counts_a_running_group_once() -> None:
    from dptune.tune.results import eta

    group = tuple(f"g{i}" for i in range(4))
    rows = [{"run_id": f"d{i}", "status": "done", "seconds": 2.5, "started": 1.0} for i in range(4)]
    rows += [{"run_id": r, "status": "running", "seconds": None, "started": 50.0} for r in group]
    rows += [{"run_id": f"p{i}", "status": "planned", "seconds": None, "started": None} for i in range(4)]
    # One group task (4 runs, 10 s: 2.5 s stored per run) keeps one worker busy: 8 runs × 2.5 s.
    seconds, text = eta(rows, dict.fromkeys(group, group))
    assert seconds == pytest.approx(20.0) and "8 runs left" in text and "÷" not in text
    # Two single runs on two workers: ÷ 2.
    rows2 = [dict(r, started=50.0 + i) if r["status"] == "running" else r for i, r in enumerate(rows)]
    rows2 = [r for r in rows2 if r["run_id"] not in ("g2", "g3")]
    seconds, text = eta(rows2)
    assert seconds == pytest.approx(6 * 2.5 / 2) and "÷ 2 running" in text


def test_status_eta_counts_a_running_group_once(tmp_path: Path) -> None:
    """A real grouped study (trials_per_group = 2: two tasks of two runs) with its second group
    marked running as the coordinator does it (both members, one ``started``)."""
    from dptune.tune import run_study, study_status

    text = STUDY.replace("seeds = [0]", "seeds = [0]\ntrials_per_group = 2").replace(
        "lr = [0.5]", "lr = [0.25, 0.5, 1.0, 2.0]"
    )
    d = tmp_path / "s"
    assert run_study(_config(tmp_path, text), d, progress=False).complete
    with sqlite3.connect(d / "study.sqlite") as con:
        rows = list(con.execute("SELECT run_id, started, seconds FROM runs ORDER BY position"))
        assert rows[2][1] == rows[3][1] and rows[0][2] == rows[1][2]  # trained as groups
        con.executemany(
            "UPDATE runs SET status = 'running', seconds = NULL WHERE run_id = ?", [(r[0],) for r in rows[2:]]
        )
    st = study_status(d)
    assert st["counts"] == {"done": 2, "running": 2}
    assert st["eta_seconds"] == pytest.approx(2 * rows[0][2])  # one busy worker, not two
    assert "÷" not in st["eta"]


# ----------------------------------------------------------------------------- 8. failed runs
def test_tune_with_failed_runs_says_so_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def killed(*args: object, **kwargs: object) -> None:  # a path in brackets: printed as is, not read as markup
        raise RuntimeError("worker process failed: killed [/models/base.pt]")

    monkeypatch.setattr(study_mod, "execute_task", killed)
    d = tmp_path / "s"
    res = CliRunner().invoke(app, ["tune", str(_config(tmp_path)), "-o", str(d), "--no-progress"])
    assert res.exit_code == 1, (res.output, res.exception)
    assert "Traceback" not in res.output
    out = " ".join(res.output.split())
    assert (
        "1 of 1 runs did not finish (1 failed, the first: RuntimeError: worker process failed: killed "
        "[/models/base.pt]; not differentially private: for the data owner only)" in out
    )
    assert f"dptune status {d}" in out and f"dptune resume {d}" in out
    assert (d / "study.sqlite").is_file()  # the study is kept: resume retries the run


def test_resume_with_runs_that_fail_again_says_so_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def killed(*args: object, **kwargs: object) -> None:
        raise RuntimeError("worker process failed: killed")

    monkeypatch.setattr(study_mod, "execute_task", killed)
    d = tmp_path / "s"
    assert CliRunner().invoke(app, ["tune", str(_config(tmp_path)), "-o", str(d), "--no-progress"]).exit_code == 1
    res = CliRunner().invoke(app, ["resume", str(d), "--no-progress"])  # the run fails again
    assert res.exit_code == 1, (res.output, res.exception)
    assert "Traceback" not in res.output
    out = " ".join(res.output.split())
    assert (
        "1 of 1 runs did not finish (1 failed, the first: RuntimeError: worker process failed: killed; "
        "not differentially private: for the data owner only)" in out
    )


def test_status_counts_failed_runs_as_left_and_runs_csv_names_their_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in an audit: `dptune status` said "time left: no run left" while a failed run waited for `dptune
    resume`; diagnostics/runs.csv (labelled not DP) now has each run's error."""
    from dptune.outputs import NOT_DP_LABEL, read_csv_rows
    from dptune.report.study import read_study, write_runs_csv

    def killed(*args: object, **kwargs: object) -> None:
        raise RuntimeError("worker process died (exit code 3) while running this run")

    monkeypatch.setattr(study_mod, "execute_task", killed)
    d = tmp_path / "s"
    assert CliRunner().invoke(app, ["tune", str(_config(tmp_path)), "-o", str(d), "--no-progress"]).exit_code == 1
    res = CliRunner().invoke(app, ["status", str(d)])
    assert res.exit_code == 0 and "time left: unknown until a run finishes (1 runs left)" in res.output, res.output
    s = read_study(d)
    csv = write_runs_csv(tmp_path / "report", s.runs, s.arm_of)
    assert NOT_DP_LABEL in csv.read_text().splitlines()[0].lower()
    [row] = read_csv_rows(csv)
    assert row["status"] == "failed" and row["error"].startswith("RuntimeError: worker process died (exit code 3)")


@pytest.mark.parametrize("where", ["store", "checkpoint"])
def test_a_full_disk_is_one_line_naming_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Found in an audit: a full disk (`ulimit -f`) ended `dptune tune` in a traceback (sqlite3.OperationalError:
    disk I/O error). Now one line, and `dptune resume` then finishes the study."""
    import errno

    from dptune.tune.store import Store

    def full(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("disk I/O error") if where == "store" else OSError(errno.ENOSPC, "No space left")

    monkeypatch.setattr(*((Store, "finish") if where == "store" else (study_mod, "save_checkpoint")), full)
    d = tmp_path / "s"
    line = _refused(["tune", str(_config(tmp_path)), "-o", str(d), "--no-progress"])
    fix = f"the disk is full or not writable; nothing finished is lost. Fix: free space, then `dptune resume {d}`."
    assert line.endswith(fix), line
    monkeypatch.undo()
    res = CliRunner().invoke(app, ["resume", str(d), "--no-progress"])
    assert res.exit_code == 0, (res.output, res.exception)


def test_only_a_full_disk_is_called_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: every OSError and sqlite3.OperationalError read "the disk is full ...; nothing finished is
    lost": a dataset's PermissionError mid-training, a locked store. They propagate as before; `train`'s full disk
    does not say that nothing is lost."""
    import errno

    import own_factories
    from cli_helpers import OWN_FACTORIES, invoke_train

    from dptune.tune.store import Store

    real = own_factories.Points.__getitem__

    def denied(self: Any, i: int) -> Any:
        if i >= 100:
            raise PermissionError(errno.EACCES, "Permission denied", f"/mnt/images/{i}.png")
        return real(self, i)

    def locked(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database is locked")

    def over_quota(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with monkeypatch.context() as m:
        m.setattr(own_factories.Points, "__getitem__", denied)
        res = invoke_train(tmp_path / "r.json", data=OWN_FACTORIES)
    assert isinstance(res.exception, PermissionError) and "disk is full" not in res.output, res.output
    with monkeypatch.context() as m:
        m.setattr(Store, "finish", locked)
        res = CliRunner().invoke(app, ["tune", str(_config(tmp_path)), "-o", str(tmp_path / "s"), "--no-progress"])
    assert isinstance(res.exception, sqlite3.OperationalError) and "disk is full" not in res.output, res.output
    monkeypatch.setattr("dptune.cli.write_train_outputs", over_quota)
    line = _refused(["train", "--dataset", "digits", "--epochs", "0.1", "--no-progress", "--out", str(tmp_path / "q")])
    assert line.endswith("the disk is full or not writable. Fix: free space, then the command again."), line
