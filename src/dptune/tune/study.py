"""The coordinator: plan the whole study before training, persist it (``study.sqlite``), dispatch runs to
an executor, check each against its plan and merge its ledger (nothing outside the plan). ``resume_study``
reruns interrupted runs with the same seeds; adaptive stages resolve from stored results only."""

from __future__ import annotations

import fcntl
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dptune.deliverable import save_checkpoint
from dptune.devices import check_device_name, resolve_device
from dptune.distributed import refuse_in_study
from dptune.errors import BudgetExceededError, ConfigError, DPTuneError
from dptune.gradients.oracle import check_model
from dptune.gradients.stacked import Stacked, stack_plan
from dptune.models import check_fits
from dptune.outputs import (
    NOT_DP_LABEL,
    Progress,
    check_output_dir,
    drop_stale_report,
    hides_run_count,
    refuse_inside_release,
)
from dptune.release.ledger import Ledger
from dptune.tune import results
from dptune.tune.data import build_model, study_data
from dptune.tune.executors import Executor, check_executor, check_workers, make_executor, require_ray
from dptune.tune.export import export_study, prune_checkpoints
from dptune.tune.groups import balanced, plan_groups
from dptune.tune.methods import get_method
from dptune.tune.plan import plan_study
from dptune.tune.records import RunSpec, StudyPlan
from dptune.tune.spec import Study, load_study_config, study_from_dict
from dptune.tune.store import Store
from dptune.tune.worker import check_run_ledger, execute_task


def study_metric(study: Study, task: str) -> str:
    return study.selection.metric or ("mse" if task == "reconstruction" else "accuracy")


class _StudyClaim:
    """Claims ``study_dir`` for one coordinator: makes the missing folders, takes an flock on ``.lock``
    (released even on SIGKILL) and, if the study fails before any run starts, removes exactly what THIS
    process made, never anything that appeared meanwhile or existed before."""

    FILES = ("study.sqlite", "study.sqlite-wal", "study.sqlite-shm", "study.sqlite-journal")

    def __init__(self, study_dir: str | os.PathLike[str]):
        # realpath: "e/m/.." is e (a missing e/m is not made just to be walked out of again)
        self.dir = Path(os.path.realpath(study_dir))
        self.made: list[Path] = []  # folders this process created, outermost first
        self.fd: int | None = None
        self.lock_is_ours = False  # .lock created by this process (O_EXCL)
        self.before: set[str] | None = None  # the folder's names once the lock is held
        self.started = False

    def __enter__(self) -> _StudyClaim:
        try:
            self._make_dirs()
            self._take_lock()
            self.before = set(os.listdir(self.dir))
        except BaseException:
            self._undo()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and not self.started:
            self._undo()
        elif self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _make_dirs(self) -> None:
        missing = []
        p = self.dir
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:  # made meanwhile by another process: not ours to remove
                continue
            self.made.append(d)
        if not self.dir.is_dir():
            raise ConfigError(
                f"study directory {str(self.dir)!r} is not a directory. Fix: give a directory (new or existing)."
            )

    def _take_lock(self) -> None:
        lock = self.dir / ".lock"
        for _ in range(10):
            try:
                fd, ours = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644), True
            except FileExistsError:
                try:
                    fd, ours = os.open(lock, os.O_RDWR), False
                except FileNotFoundError:  # removed in between by a coordinator that gave up: retry
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # its holder may be using the file we created: never removed by us
                raise ConfigError(
                    f"another process is running the study in {str(self.dir)!r}. "
                    "Fix: wait for it, or check `dptune status DIR`."
                ) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                same = False
            if same:
                self.fd, self.lock_is_ours = fd, ours
                return
            os.close(fd)  # we locked a .lock that its creator removed meanwhile: lock the current one
        raise ConfigError(  # pragma: no cover - ten removals in a row
            f"could not lock the study in {str(self.dir)!r}. Fix: check that no other process is using it."
        )

    def _undo(self) -> None:
        try:
            if self.before is not None and "study.sqlite" not in self.before:  # the lock is held
                for name in self.FILES:
                    if name not in self.before:
                        (self.dir / name).unlink(missing_ok=True)
            if self.before is not None and self.lock_is_ours:
                (self.dir / ".lock").unlink(missing_ok=True)
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            for d in reversed(self.made):
                try:
                    os.rmdir(d)
                except OSError:  # not empty (something else lives there now): kept, and its parents
                    break


class Coordinator:
    """Owns the study ledger; the only place where run results enter the study."""

    def __init__(self, study: Study, store: Store, plan: StudyPlan):
        self.study, self.store, self.plan = study, store, plan
        self.ledger = Ledger.with_plan(plan.release_event)
        for e in store.ledger_entries():
            self.ledger.record(e.event, e.label, count=e.count, components=e.components, run=e.run)
        self.strategy_of = {rid: plan.arm(r.arm).strategy for rid, r in plan.runs.items()}
        self._groups: dict[str, tuple[str, ...]] | None = None
        # Runs planned unconfigured (before ``resolve``): the groups depend on this set, not on how far a resume got.
        self._unresolved = frozenset(rid for rid, r in plan.runs.items() if r.config is None)

    # -- the runner's gate
    def task_for(self, run: RunSpec) -> tuple[str, tuple[Any, ...]]:
        """Arguments for a worker. Refuses any run that is not exactly a planned one."""
        planned = self.plan.runs.get(run.run_id)
        if planned is None:
            raise BudgetExceededError(
                f"run {run.run_id!r} is not in the study's plan: a study cannot add runs, seeds or "
                "configurations after planning. Fix: plan a new study with the larger search (and budget)."
            )
        a, b = planned.to_dict(), run.to_dict()
        if a["config"] is None:  # adaptive: config resolved later, everything else fixed
            a["config"] = b["config"]
        if a != b:
            diff = sorted(k for k in a if a[k] != b[k])
            raise BudgetExceededError(
                f"run {run.run_id!r} differs from its plan in {diff}: ν, steps, sampling rate, seeds and "
                "releases are fixed before any training. Fix: re-plan the study instead."
            )
        return run.run_id, (self.study, self.strategy_of[run.run_id], run.to_dict(), self.plan.metric)

    def merge(self, run_id: str, result: dict[str, Any]) -> None:
        """Check a run against the plan, add its ledger and commit it all in one transaction."""
        run = self.plan.runs.get(run_id)
        if run is None:
            raise BudgetExceededError(f"result for unplanned run {run_id!r} refused.")
        run_ledger = Ledger.from_dict(result["ledger"])
        check_run_ledger(run, run_ledger, result["status"])
        for event, count in run_ledger.atoms().items():  # all-or-nothing: check before recording
            self.ledger.check(event, count)
        tagged = Ledger()
        for e in run_ledger.entries:
            tagged.record(e.event, e.label, count=e.count, components=e.components, run=run_id)
        # The selected checkpoint is written (atomically) BEFORE the run is committed: a committed run has its weights;
        # a crash in between reruns it on resume with the same seeds (secure mode: a fresh draw, the one merged).
        if result.get("checkpoint"):
            save_checkpoint(self.store.dir, run_id, result["checkpoint"])
        self.store.finish(run_id, result, tagged)
        self.ledger.extend(tagged, run=run_id)

    # -- adaptive stages
    def resolve(self) -> None:
        """Configure adaptive runs whose inputs finished, from stored results only (resume-safe)."""
        rows = {r["run_id"]: r for r in self.store.runs()}
        scores = {rid: r["score"] for rid, r in rows.items()}
        for arm in self.plan.arms:
            method = get_method(arm.method)
            if not method.adaptive:
                continue
            for rid, (config, fit) in method.resolve(self.plan, arm, rows, scores).items():
                self.store.set_config(rid, config, fit)
                self.plan.runs[rid].config = config

    def ready(self) -> list[RunSpec]:
        out = []
        for r in self.store.runs("planned"):
            spec = self.plan.runs[r["run_id"]]
            if r["config"] is None:
                continue
            if spec.config is None:
                spec.config = json.loads(r["config"])
            out.append(spec)
        return out

    # -- vectorised groups
    def groups(self) -> dict[str, tuple[str, ...]]:
        """run_id → the runs trained together with it (``groups.plan_groups``), fixed before
        execution: a run's result never depends on the executor, the workers or a resume."""
        if self._groups is None:
            size = self.study.trials_per_group
            even = balanced(self.store.get_meta("config"))
            self._groups = (
                plan_groups(self.plan, size, self._unresolved, even) if size > 1 and self._stackable() else {}
            )
        return self._groups

    def _stackable(self) -> bool:
        try:
            data = study_data(self.study.data, self.study.selection, self.study.seed)
            model = build_model(self.study.model, data, self.study.seeds[0])
            ops = stack_plan(model)
            check_model(model)
            Stacked(ops).check_input(model, data.x_train)  # type: ignore[arg-type]  # not a tensor: refused
        except Exception:  # Unsupported/ConfigError: not stackable; a failing model builder fails
            return False  # the runs in the workers instead, where the error is recorded
        return True

    def tasks(self, ready: list[RunSpec]) -> tuple[list[tuple[str, tuple[Any, ...]]], dict[str, list[str]]]:
        """Executor tasks for the ready runs, and task id → the ready runs it finishes. A partly finished
        group is retrained whole (same seeds, same numbers) and only its missing runs merged: no release twice."""
        groups = self.groups()
        tasks: list[tuple[str, tuple[Any, ...]]] = []
        members: dict[str, list[str]] = {}
        seen: set[tuple[str, ...]] = set()
        ready_ids = {r.run_id for r in ready}
        for run in ready:
            group = groups.get(run.run_id)
            if group is None:
                tid, args = self.task_for(run)
                tasks.append((tid, ("run", *args)))
                members[tid] = [tid]
                continue
            if group in seen:
                continue
            seen.add(group)
            specs = [self.plan.runs[rid] for rid in group]
            for spec in specs:  # members finished in an earlier session: their resolved config is stored
                if spec.config is None:
                    row = self.store.run(spec.run_id)
                    if row is None or row["config"] is None:  # pragma: no cover - a group resolves together
                        raise DPTuneError(f"group {group[0]!r} is only partly resolved")
                    spec.config = json.loads(row["config"])
            checked = [self.task_for(s)[1] for s in specs]
            tid = f"group[{group[0]}..{group[-1]}]"
            group_args = ("group", self.study, [a[1] for a in checked], [a[2] for a in checked], self.plan.metric)
            tasks.append((tid, group_args))
            members[tid] = [rid for rid in group if rid in ready_ids]
        tasks.sort(key=lambda t: -len(t[1][3]) if t[1][0] == "group" else -1)  # the longest first: no straggler
        return tasks, members

    def execute(self, executor: Executor, progress: bool = True) -> None:
        total = len(self.plan.runs)
        bar = None
        if progress:
            done = sum(n for s, n in self.store.counts().items() if s in ("done", "diverged"))
            desc = self.study.name
            if any(hides_run_count(a.guarantee.get("kind")) for a in self.plan.arms):
                # Its counts show K, which a Liu–Talwar / repeat-and-select guarantee keeps secret.
                desc += f" ({NOT_DP_LABEL}: shows the number of runs)"
            bar = Progress(total, desc, "run", done, lines=True)
        try:
            while True:
                self.resolve()
                ready = self.ready()
                if not ready:
                    break
                tasks, members = self.tasks(ready)

                def on_start(task_ids: list[str], members: dict[str, list[str]] = members) -> None:
                    self.store.mark_running([rid for tid in task_ids for rid in members[tid]])

                for tid, result, err in executor.run(execute_task, tasks, on_start=on_start):
                    if err is None and result is not None and "results" in result:
                        outcomes = [(r["run_id"], r, None) for r in result["results"] if r["run_id"] in members[tid]]
                    else:
                        outcomes = [(rid, result, err) for rid in members[tid]]
                    for rid, res, e in outcomes:
                        if e is not None:
                            self.store.fail(rid, e)
                        else:
                            try:
                                self.merge(rid, res)
                            except BudgetExceededError as exc:
                                self.store.fail(rid, f"refused by the coordinator: {exc}")
                                raise
                        if bar is not None:
                            bar.update(1, rid.split("/")[0])
        finally:
            if bar is not None:
                bar.close()


@dataclass
class StudyOutcome:
    """``rows`` (``study_table``'s) and ``counts`` state run counts, K of a hidden-K arm, and run ids: the owner's
    only; ``results.release_rows(rows)`` is the part the guarantee covers (docs/privacy.md, item 7)."""

    study_dir: Path
    complete: bool
    ledger_matches_plan: bool | None
    counts: dict[str, int]
    rows: list[dict[str, Any]]

    def __repr__(self) -> str:
        return (f"StudyOutcome({str(self.study_dir)!r}, complete={self.complete}, ledger_matches_plan="
                f"{self.ledger_matches_plan}, counts and rows: {NOT_DP_LABEL})")  # fmt: skip


def _open(study: Study, study_dir: Path) -> tuple[Store, StudyPlan]:
    store = Store(study_dir, create=True)
    try:  # closed on any failure, before run_study removes what it created
        if store.has_plan():
            if store.get_meta("fingerprint") != study.fingerprint():
                raise ConfigError(
                    f"{str(study_dir)!r} already holds a different study (its config differs: e.g. seeds, budget "
                    "or search space). A planned study cannot grow. Fix: use a new directory, or `dptune resume DIR` "
                    "to continue the stored study unchanged."
                )
            plan = StudyPlan.from_dict(store.get_meta("plan"))
            # The data the runs left will read must be the planned one (found in review: a relative csv
            # path read from another folder).
            data = study_data(study.data, study.selection, study.seed)
            planned = (store.get_meta("config") or {}).get("_meta", {}).get("data_digest") or {}  # {}: planned before
            now = data.digest() if planned else {}
            if (data.n_train, data.n_val) != (plan.n_train, plan.n_val) or any(planned[k] != now[k] for k in planned):
                raise ConfigError(
                    f"the study's data is not the one it was planned on: {data.n_train} training and {data.n_val} "
                    f"validation examples now, {plan.n_train} and {plan.n_val} planned (q and the guarantee assume "
                    f"them); rows that differ: {', '.join(k for k in planned if planned[k] != now[k]) or 'none'} (a "
                    "loader whose output changes with the thread count differs too). Fix: restore the data it was "
                    "planned on."
                )
            return store, plan
        data = study_data(study.data, study.selection, study.seed)
        _check_model_fits(study, data)
        metric = study_metric(study, data.task)
        if metric == "accuracy" and data.task == "reconstruction":
            raise ConfigError("selection.metric = 'accuracy' on a reconstruction task. Fix: metric = 'mse'.")
        plan = plan_study(study, data.n_train, data.n_val, metric)
        meta = {"python_study": study.from_python, "data_digest": data.digest(), "groups": "balanced"}  # since 2026-11
        config = {**study.to_dict(), "_meta": meta}
        store.initialize(config, study.fingerprint(), plan.to_dict(), [r.to_dict() for r in plan.runs.values()])
    except BaseException:
        store.close()
        raise
    return store, plan


def _check_model_fits(study: Study, data: Any) -> None:
    """One forward of the initial model on one example before anything is stored (found in review: a model that does
    not take the data failed in every run, and the half-made study blocked the corrected file). A builder that raises
    is left to the runs, which record its error."""
    try:
        with torch.random.fork_rng(devices=[]):  # build_model seeds torch: your random stream stays as it was
            model = build_model(study.model, data, study.seeds[0])
    except Exception:  # noqa: BLE001 - recorded per run, as before
        return
    fix = 'choose a model that takes this data\'s inputs (e.g. [model] name = "mlp" for flat features)'
    check_fits(model, data.x_train, data.y_train, "[model]", fix)


def plan_only(config: str | os.PathLike[str] | Study) -> StudyPlan:
    """The plan of a study without running it (for inspection and tests)."""
    study = load_study_config(config)
    data = study_data(study.data, study.selection, study.seed)
    return plan_study(study, data.n_train, data.n_val, study_metric(study, data.task))


def check_study_device(device: str, executor: str | Executor, address: str | None) -> None:
    """Refuse, before any directory is made, a device the runs cannot use (or executor 'ray' without
    Ray installed). Runs on this machine (local, process, a Ray started here) need the device here;
    a remote Ray cluster's workers check it themselves (``worker``), since the driver may have no GPU."""
    device = check_device_name(device, "training.device")
    name = getattr(executor, "name", executor)
    if name == "ray" and device.startswith("cuda:"):
        raise ConfigError(
            f"training.device = {device!r} with executor 'ray': Ray gives each task its own "
            "GPU(s) through CUDA_VISIBLE_DEVICES. Fix: use device = 'cuda'."
        )
    if not (name == "ray" and address):
        resolve_device(device, "training.device")
    if name == "ray" and not isinstance(executor, Executor):
        require_ray()  # an optional extra: its absence is one clear line, not a half-made study


def run_study(
    config: str | os.PathLike[str] | Study | Mapping[str, Any],
    study_dir: str | os.PathLike[str],
    executor: str | Executor = "local",
    address: str | None = None,
    progress: bool = True,
    workers: int | None = None,
    retry_failed: bool = False,
    gpus_per_run: float | None = None,
) -> StudyOutcome:
    """Plan (or re-open) the study in ``study_dir``, run every planned run, write the results (docs/tuning.md)."""
    refuse_in_study()  # under torchrun: N copies of every trial
    study = load_study_config(config)
    device = study.training.device
    check_workers(workers)  # before any directory is made
    check_study_device(device, executor, address)
    check_executor(executor, address)
    path = Path(study_dir)
    check_output_dir(path, "study directory")
    refuse_inside_release(path, "study directory")  # its diagnostics/ would be published
    if ".." in path.parts:  # "e/m/.." with e/m missing: the kernel cannot walk it; the folder meant is e
        path = Path(os.path.realpath(path))
    with _StudyClaim(path) as claim:
        store, plan = _open(study, path)
        try:
            store.reset_interrupted()
            if retry_failed:
                store.reset_failed()
            before = store.counts()
            coord = Coordinator(study, store, plan)
            ex = make_executor(executor, workers, address, device=device, gpus_per_run=gpus_per_run)
            claim.started = True  # from here on, runs may be released: the study stays
            interrupted = False
            try:
                coord.execute(ex, progress)
            except KeyboardInterrupt:
                interrupted = True  # found in review: the pool waited 91 s for runs in flight, then lost them
                raise
            finally:
                ex.close(interrupted=True) if interrupted else ex.close()
            counts = store.counts()
            complete = set(counts) <= {"done", "diverged"}
            matches = coord.ledger.matches(plan.release_event) if complete else None
            if complete and "diverged" not in counts and not matches:  # pragma: no cover - guarded by merge()
                raise BudgetExceededError("the study's ledger does not equal its plan")
        finally:
            store.close()
    if counts != before and drop_stale_report(path):
        warnings.warn(f"the report in {path / 'release'} showed earlier results: removed. Fix: `dptune report {path}`.",
                      stacklevel=2)  # fmt: skip
    return StudyOutcome(path, complete, matches, counts, finish_study(path, complete))


def finish_study(path: Path, complete: bool) -> list[dict[str, Any]]:
    """The results written from the store, again (a session killed before this step left them stale: found in
    review); once complete, the deliverable: each arm's selected model + card in release/models/, from the stored
    checkpoints (no retraining, no release), the other runs' weights deleted. Returns ``study_table``'s rows."""
    rows = results.study_table(path)
    results.write_csvs(path)
    if complete:
        export_study(path, skip_missing=True)
        prune_checkpoints(path)
    return rows


def load_stored_study(study_dir: str | os.PathLike[str], study: Study | None = None) -> Study:
    """The Study of a stored directory (pass ``study`` for Python-built studies with tensors/callables)."""
    with Store(study_dir, readonly=True) as store:
        cfg = store.get_meta("config")
        fp = store.get_meta("fingerprint")
    if study is not None:
        if study.fingerprint() != fp:
            raise ConfigError("the given study differs from the stored one. Fix: pass the same Study object.")
        return study
    if cfg.get("_meta", {}).get("python_study"):
        raise ConfigError(
            "this study was built in Python (tensors or a model callable): resume it with "
            "resume_study(dir, study=the_same_study)."
        )
    return study_from_dict({k: v for k, v in cfg.items() if k != "_meta"})


def resume_study(
    study_dir: str | os.PathLike[str],
    executor: str | Executor = "local",
    address: str | None = None,
    progress: bool = True,
    workers: int | None = None,
    study: Study | None = None,
    retry_failed: bool = True,
    gpus_per_run: float | None = None,
) -> StudyOutcome:
    """Continue a stored study: keep every finished run, re-execute interrupted (and, by
    default, failed) runs with the same seeds and noise streams, run what is left."""
    study = load_stored_study(study_dir, study)
    return run_study(study, study_dir, executor, address, progress, workers, retry_failed, gpus_per_run)
