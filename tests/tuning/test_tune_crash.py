"""Crash safety: a study process killed with SIGKILL mid-run, then resumed, gives exactly the study
an uninterrupted process gives (same table, same runs, ledger equal to the plan)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter

import pytest
from tune_helpers import tiny_study_toml

from dptune.release.ledger import event_to_dict
from dptune.tune import resume_study, run_study, study_status, study_table
from dptune.tune.store import Store

CONFIG = tiny_study_toml(
    "crash",
    steps=160,
    seeds=(0, 1),
    lrs=(0.3, 1.0),
    selection="""
[selection]
mode = "private"
split = "holdout"
eval_every = 40
noise_multiplier = 30.0
""",
)


def _status(db) -> Counter:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return Counter(s for (s,) in con.execute("SELECT status FROM runs"))
    except sqlite3.OperationalError:  # tables not created yet
        return Counter()
    finally:
        con.close()


def _runs(d):
    with Store(d) as s:
        rows = {r["run_id"]: dict(r) for r in s.runs()}
        ledger = Counter(
            (e.run, e.label, json.dumps(event_to_dict(e.event), sort_keys=True), e.count) for e in s.ledger_entries()
        )
    keep = ("status", "score", "best_step", "test_metric", "evals", "history", "config", "noise_multiplier")
    return {k: {f: v[f] for f in keep} for k, v in rows.items()}, ledger


@pytest.mark.parametrize("group", [1, 2], ids=["one-run-per-task", "vectorised-groups-of-2"])
def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path, group):
    cfg = tmp_path / "crash.toml"
    cfg.write_text(CONFIG.replace("seeds = [0, 1]", f"seeds = [0, 1]\ntrials_per_group = {group}"))
    crashed = tmp_path / "crashed"
    code = f"from dptune.tune import run_study; run_study({str(cfg)!r}, {str(crashed)!r}, progress=False)"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "0"})
    db = crashed / "study.sqlite"
    deadline = time.time() + 120
    killed_at = None
    try:
        while time.time() < deadline and proc.poll() is None:
            st = _status(db) if db.exists() else Counter()
            if st["done"] >= 1 and st["running"] == group:
                # At once: a task can take less than 0.1 s on a quiet machine, so any wait could
                # let it finish (then nothing would be mid-run).
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = st
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None and killed_at is None:
            proc.kill()
        proc.wait()
    assert killed_at is not None, "the study finished or stalled before it could be killed mid-run"
    assert proc.returncode == -signal.SIGKILL
    after = _status(db)
    # Killed inside a task (running == group) or, for a group, between the merges of its runs
    # (the checkpoint writes make merges take a while): both are crash points resume must handle.
    assert 1 <= after["running"] <= group and after["done"] >= 1 and after["done"] <= 4 - after["running"]
    interrupted = [r["run_id"] for r in Store(crashed).runs("running")]

    status = study_status(crashed)
    assert not status["complete"] and status["counts"]["running"] == after["running"]

    resumed = resume_study(crashed, progress=False)
    assert resumed.complete and resumed.ledger_matches_plan
    reference = run_study(cfg, tmp_path / "reference", progress=False)
    assert reference.complete and reference.ledger_matches_plan

    # Same final table, same runs (scores, checkpoints, histories: the same noise was re-drawn),
    # the same ledger: nothing released twice.
    assert study_table(crashed) == study_table(tmp_path / "reference")
    runs_a, ledger_a = _runs(crashed)
    runs_b, ledger_b = _runs(tmp_path / "reference")
    assert runs_a == runs_b
    assert ledger_a == ledger_b
    with Store(crashed) as s:
        assert all(s.run(r)["attempts"] == 2 for r in interrupted)
        assert all(r["attempts"] == 1 for r in s.runs() if r["run_id"] not in interrupted)


def test_group_interrupted_between_merges_resumes_to_the_same_study(tmp_path, monkeypatch):
    """A crash after some members of a vectorised group were merged: the resumed session trains
    the whole group again (same composition, same numbers) and merges only the missing runs."""
    from dptune.tune.study import Coordinator

    cfg = tmp_path / "c.toml"
    cfg.write_text(
        CONFIG.replace("steps = 160", "steps = 40").replace("seeds = [0, 1]", "seeds = [0, 1]\ntrials_per_group = 4")
    )
    original = Coordinator.merge
    merged: list[str] = []

    def merge_then_crash(self, run_id, result):
        if len(merged) == 2:
            raise KeyboardInterrupt("simulated crash between two merges of one group")
        original(self, run_id, result)
        merged.append(run_id)

    monkeypatch.setattr(Coordinator, "merge", merge_then_crash)
    with pytest.raises(KeyboardInterrupt):
        run_study(cfg, tmp_path / "crashed", progress=False)
    monkeypatch.setattr(Coordinator, "merge", original)
    with Store(tmp_path / "crashed") as s:
        assert Counter(r["status"] for r in s.runs()) == Counter({"done": 2, "running": 2})
    resumed = resume_study(tmp_path / "crashed", progress=False)
    reference = run_study(cfg, tmp_path / "reference", progress=False)
    assert resumed.complete and resumed.ledger_matches_plan and reference.complete
    runs_a, ledger_a = _runs(tmp_path / "crashed")
    runs_b, ledger_b = _runs(tmp_path / "reference")
    assert runs_a == runs_b  # bit for bit, the two already-merged runs included
    assert ledger_a == ledger_b  # the retrained members' releases were not merged twice


def test_resume_of_a_finished_study_is_a_no_op(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.replace("steps = 160", "steps = 20").replace("seeds = [0, 1]", "seeds = [0]"))
    first = run_study(cfg, tmp_path / "s", progress=False)
    again = resume_study(tmp_path / "s", progress=False)
    assert first.rows == again.rows and again.complete
    with Store(tmp_path / "s") as s:
        assert all(r["attempts"] == 1 for r in s.runs())


def test_a_second_coordinator_is_locked_out(tmp_path):
    from tune_helpers import study_lock

    from dptune.errors import ConfigError

    d = tmp_path / "locked"
    with study_lock(d), pytest.raises(ConfigError, match="another process"), study_lock(d):
        pass


def test_results_cut_short_by_a_kill_are_written_again_and_a_stale_report_is_removed(tmp_path) -> None:
    """Found in review: a session killed after its last run but before writing the results left `dptune resume`
    saying "already complete" beside stale CSVs and no models; a report written while the study was unfinished stayed
    in release/ beside the new results.csv once it finished. Now resume writes the results again, and the finishing
    run_study removes the stale report (with a warning naming `dptune report`)."""
    from typer.testing import CliRunner

    from dptune.cli import app
    from dptune.report import report_study

    (tmp_path / "s.toml").write_text(tiny_study_toml("fin", steps=4, lrs=(0.5, 0.1)))
    d = tmp_path / "d"
    run_study(str(tmp_path / "s.toml"), d, progress=False)
    with sqlite3.connect(d / "study.sqlite") as con:  # as if killed before the last run finished (nothing committed)
        (rid,) = con.execute("SELECT run_id FROM runs LIMIT 1").fetchone()
        con.execute("UPDATE runs SET status = 'planned' WHERE run_id = ?", (rid,))
        con.execute("DELETE FROM ledger WHERE run_id = ?", (rid,))
    (d / "release" / "mine").mkdir()
    (d / "release" / "mine" / "notes.txt").write_text("yours")  # found in review: listed, then deleted
    report_study(d)
    stale = {p.relative_to(d / "release") for p in (d / "release").rglob("*") if p.is_file()}
    assert {"report.html", "results_best.csv"} <= {str(p) for p in stale} and (d / "release/.report-files").is_file()
    with pytest.warns(UserWarning, match="showed earlier results: removed.*dptune report"):
        resume_study(d, progress=False)
    left = {str(p.relative_to(d / "release")) for p in (d / "release").rglob("*") if p.is_file()}
    assert "report.html" not in left and "results_best.csv" not in left and "results.csv" in left
    assert "mine/notes.txt" in left  # a file of yours in release/ stays
    assert any(p.startswith("models") for p in left)
    for name in ("results.csv", "models"):  # cut short by a kill: written again by a resume that runs nothing
        target = d / "release" / name
        target.unlink() if target.is_file() else __import__("shutil").rmtree(target)
    res = CliRunner().invoke(app, ["resume", str(d), "--no-progress"])
    assert res.exit_code == 0 and "already complete" in res.output, res.output
    assert (d / "release/results.csv").is_file() and any((d / "release/models").rglob("*.pt"))
    report_study(d)
    resume_study(d, progress=False)  # nothing ran: the report of these results stays
    assert (d / "release/report.html").is_file()
