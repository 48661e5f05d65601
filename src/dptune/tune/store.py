"""The study store: one SQLite database (``study.sqlite``; WAL, ``synchronous=FULL``, one writer). A run's
ledger rows are inserted in the SAME transaction that marks it done, so after a SIGKILL both or neither
are there; ``resume`` reruns a ``running`` run with the same seeds, so nothing is paid twice."""

from __future__ import annotations

import fcntl
import json
import math
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dptune.errors import ConfigError
from dptune.release.ledger import Ledger, LedgerEntry, event_to_dict
from dptune.study_args import no_study

DB_NAME = "study.sqlite"
SCHEMA_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    arm TEXT NOT NULL,
    stage TEXT NOT NULL,
    procedure INTEGER NOT NULL,
    replicate INTEGER NOT NULL,
    seed INTEGER NOT NULL,
    run_seed INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('planned', 'running', 'done', 'diverged', 'failed')),
    config TEXT,
    noise_multiplier REAL,
    steps INTEGER NOT NULL,
    sampling_rate REAL NOT NULL,
    planned_event TEXT NOT NULL,
    score REAL,
    best_step INTEGER,
    test_metric REAL,
    evals TEXT,
    history TEXT,
    fit TEXT,
    error TEXT,
    seconds REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    started REAL,
    finished REAL,
    position INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    label TEXT NOT NULL,
    event TEXT NOT NULL,
    count INTEGER NOT NULL,
    components TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_run ON ledger(run_id);
"""


# sqlite's result codes of a file that is not (or no longer) a whole database: truncated, overwritten.
_DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB", "SQLITE_IOERR_SHORT_READ")


class DamagedStoreError(ConfigError):
    """``study.sqlite`` cannot be read: truncated, overwritten or otherwise corrupted."""


# study.sqlite → (device, inode, size, mtime, -wal size, -wal mtime) of its last passed quick_check
# in this process: the check reads the whole file (0.55 s for 585 MB), and a report opens the
# store a dozen times. Any write changes the key, so a changed file is checked again.
_CHECKED: dict[str, tuple[int, ...]] = {}


def _file_key(path: Path) -> tuple[int, ...]:
    st = os.stat(path)
    try:
        wal = os.stat(f"{path}-wal")
        w: tuple[int, int] = (wal.st_size, wal.st_mtime_ns) if wal.st_size else (0, 0)
    except FileNotFoundError:  # no -wal and an empty one (a reader may create it) hold the same: nothing
        w = (0, 0)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, *w)


def _uri(path: Path, **params: str) -> str:
    return f"file:{urllib.parse.quote(str(path))}?{urllib.parse.urlencode(params)}"


def lock_held(study_dir: Path) -> bool:
    """A coordinator holds the study's lock now (``study._StudyClaim``): it is planning or running it."""
    try:
        fd = os.open(Path(study_dir) / ".lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # pragma: no cover - a file system without flock
        return False
    finally:
        os.close(fd)  # releases the shared lock, if taken
    return False


class Store:
    """Thin wrapper over the study database. Only the coordinator writes."""

    def __init__(self, study_dir: str | Path, create: bool = False, readonly: bool = False):
        self.dir = Path(study_dir)
        self.path = self.dir / DB_NAME
        if not create and not self.path.exists():
            if lock_held(self.dir):
                raise self._busy()
            raise no_study(self.dir)
        try:
            # Checked on a read-only connection first: a read-write one to a damaged file lets
            # SQLite rewrite it and delete its -wal, which after a crash holds the last commits.
            if self.path.exists() and self.path.stat().st_size > 0:
                self._check()
            self._connect(create, readonly)
        except (sqlite3.DatabaseError, ConfigError) as exc:
            if getattr(self, "conn", None) is not None:
                self.conn.close()
            damaged = str(getattr(exc, "sqlite_errorname", "")).startswith(_DAMAGED)
            if isinstance(exc, sqlite3.DatabaseError) and damaged:
                raise self._damaged(str(exc)) from None
            raise  # e.g. locked: not a damaged file

    def _open_readonly(self) -> sqlite3.Connection:
        """A read-only connection (never writes the file or its -wal). On read-only media a WAL
        database without its -shm cannot be opened so (SQLITE_CANTOPEN): with no -wal there is
        nothing SQLite could miss, and it is read as immutable; otherwise one clear error."""
        conn = sqlite3.connect(_uri(self.path, mode="ro"), uri=True, timeout=30.0, isolation_level=None)
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()  # opens the file and its -wal
            return conn
        except sqlite3.OperationalError as exc:
            conn.close()
            if not str(getattr(exc, "sqlite_errorname", "")).startswith("SQLITE_CANTOPEN"):
                raise
        wal = Path(f"{self.path}-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise ConfigError(
                f"the study store {str(self.path)!r} cannot be opened here (read-only location, and its -wal "
                "file holds commits not yet in the main file). Fix: copy the study directory to a writable "
                "place and run the command on the copy."
            )
        return sqlite3.connect(_uri(self.path, mode="ro", immutable="1"), uri=True, isolation_level=None)

    def _check(self) -> None:
        """quick_check on a read-only connection (cached per file state): a truncated or overwritten
        file fails here, as one clear error, not in a later query or after a read-write open."""
        key, name = _file_key(self.path), os.path.realpath(self.path)
        if _CHECKED.get(name) == key:
            return
        conn = self._open_readonly()
        try:
            problems = [r[0] for r in conn.execute("PRAGMA quick_check")]
        finally:
            conn.close()
        if problems != ["ok"]:
            raise self._damaged("; ".join(problems[:3]))
        _CHECKED[name] = key

    def _busy(self) -> ConfigError:
        return ConfigError(
            f"{str(self.dir)!r} holds a study that is being planned (or run) right now by another process: "
            "no run result is stored yet. Fix: wait for it to finish (`dptune status DIR` shows its progress "
            "once the plan is stored)."
        )

    def _connect(self, create: bool, readonly: bool) -> None:
        if readonly:  # readers (status, tables) never take the write lock of a running coordinator
            self.conn = self._open_readonly()
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not {"meta", "runs", "ledger"} <= tables or not self.has_plan():  # read before anything is written
            if outputs := [f"{n}/" for n in ("checkpoints", "release", "diagnostics") if any((self.dir / n).glob("*"))]:
                raise ConfigError(  # found in an audit: read as never planned, and `tune` planned it again
                    f"{str(self.dir)!r} holds run outputs ({', '.join(outputs)}) but {DB_NAME} holds no plan: it lost "
                    f"its commits (was it copied without its {DB_NAME}-wal file?). Fix: restore that file beside it; "
                    "this directory is never planned again (that would overwrite its models)."
                )
            if not create:  # readers need a planned study (a failed plan once left tables without one)
                if lock_held(self.dir):
                    raise self._busy()
                raise ConfigError(
                    f"{str(self.dir)!r} holds a study that was never planned: its planning failed or was "
                    "interrupted, so no run started and no privacy budget was spent. Fix: "
                    "delete the directory and run `dptune tune CONFIG --out DIR` again."
                )
        if readonly:
            return
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.executescript(_SCHEMA)

    def _damaged(self, detail: str) -> DamagedStoreError:
        return DamagedStoreError(
            f"the study store {str(self.path)!r} is damaged ({detail}): it cannot be read. Fix: restore {DB_NAME} "
            "(with its -wal file, if any) from a backup; without it this study cannot be resumed or reported, "
            "and a new study on the same data spends a new privacy budget."
        )

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE … COMMIT (ROLLBACK on error): all-or-nothing writes."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # -- meta
    def get_meta(self, key: str) -> Any:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row["value"])

    def has_plan(self) -> bool:
        return self.get_meta("plan") is not None

    def initialize(
        self, config: Mapping[str, Any], fingerprint: str, plan: Mapping[str, Any], runs: Iterable[Mapping[str, Any]]
    ) -> None:
        """Write the config, the plan and every planned run in one transaction."""
        with self._tx() as c:
            meta = {"version": SCHEMA_VERSION, "config": config, "fingerprint": fingerprint, "plan": plan}
            for k, v in {**meta, "created": time.time()}.items():
                c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (k, json.dumps(v)))
            for pos, r in enumerate(runs):
                event, nu, cfg = r["planned_event"], r["noise_multiplier"], r["config"]
                row = [r[k] for k in ("run_id", "arm", "stage", "procedure", "replicate", "seed", "run_seed")]
                row += [json.dumps(cfg) if cfg is not None else None, nu if math.isfinite(nu) else None, r["steps"]]
                row += [r["sampling_rate"], json.dumps(event if isinstance(event, dict) else event_to_dict(event)), pos]
                c.execute(
                    "INSERT INTO runs(run_id, arm, stage, procedure, replicate, seed, run_seed, status, config, "
                    "noise_multiplier, steps, sampling_rate, planned_event, position) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, 'planned', ?, ?, ?, ?, ?, ?)",
                    row,
                )

    # -- runs
    def runs(self, status: str | None = None) -> list[sqlite3.Row]:
        if status is None:
            return list(self.conn.execute("SELECT * FROM runs ORDER BY position"))
        return list(self.conn.execute("SELECT * FROM runs WHERE status = ? ORDER BY position", (status,)))

    def run(self, run_id: str) -> sqlite3.Row | None:
        return self.conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()

    def counts(self) -> dict[str, int]:
        rows = self.conn.execute("SELECT status, COUNT(*) AS n FROM runs GROUP BY status")
        return {r["status"]: r["n"] for r in rows}

    def mark_running(self, run_ids: Iterable[str]) -> None:
        now = time.time()
        with self._tx() as c:
            c.executemany(
                "UPDATE runs SET status = 'running', started = ?, attempts = attempts + 1 "
                "WHERE run_id = ? AND status IN ('planned', 'failed')",
                [(now, rid) for rid in run_ids],
            )

    def reset_interrupted(self) -> None:
        """Runs left 'running' by a killed process go back to 'planned' (re-executed, same seeds)."""
        with self._tx() as c:
            c.execute("UPDATE runs SET status = 'planned' WHERE status = 'running'")

    def reset_failed(self) -> None:
        with self._tx() as c:
            c.execute("UPDATE runs SET status = 'planned', error = NULL WHERE status = 'failed'")

    def set_config(self, run_id: str, config: Mapping[str, Any], fit: Mapping[str, Any] | None) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE runs SET config = ?, fit = ? WHERE run_id = ? AND config IS NULL",
                (json.dumps(config), json.dumps(fit) if fit is not None else None, run_id),
            )

    def finish(self, run_id: str, result: Mapping[str, Any], ledger: Ledger) -> None:
        """Status + metrics + ledger entries, atomically."""
        with self._tx() as c:
            row = [result[k] for k in ("status", "score", "best_step", "test_metric")]
            row += [json.dumps(result["evals"]), json.dumps(result["history"]), result["seconds"], time.time(), run_id]
            cur = c.execute(
                "UPDATE runs SET status = ?, score = ?, best_step = ?, test_metric = ?, evals = ?, history = ?, "
                "seconds = ?, finished = ?, error = NULL WHERE run_id = ? AND status = 'running'",
                row,
            )
            if cur.rowcount != 1:
                raise ConfigError(f"run {run_id} was not running; its result is not merged twice.")
            if result.get("float_slack"):  # secure mode: each run's float slack, stated with its arm's guarantee
                slack = {**(self.get_meta("float_slack") or {}), run_id: result["float_slack"]}
                c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('float_slack', ?)", (json.dumps(slack),))
            for d in (e.to_dict() for e in ledger.entries):
                c.execute(
                    "INSERT INTO ledger(run_id, label, event, count, components) VALUES (?, ?, ?, ?, ?)",
                    (run_id, d["label"], json.dumps(d["event"]), d["count"], json.dumps(d["components"])),
                )

    def fail(self, run_id: str, error: str) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE runs SET status = 'failed', error = ?, finished = ? WHERE run_id = ?",
                (error[-4000:], time.time(), run_id),
            )

    # -- ledger
    def ledger_entries(self) -> list[LedgerEntry]:
        rows = self.conn.execute("SELECT label, event, count, components, run_id AS run FROM ledger ORDER BY id")
        return [
            LedgerEntry.from_dict({**r, "event": json.loads(r["event"]), "components": json.loads(r["components"])})
            for r in map(dict, rows)
        ]
