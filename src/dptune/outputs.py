"""What dptune publishes: **release** (covered by the guarantee) vs **diagnostics** (not DP, each file labelled
``NOT_DP_LABEL``: a CSV comment line, a JSON ``"privacy"`` field, a red HTML banner, a folder README.txt). What each
holds: docs/privacy.md, "What the published outputs contain". Output paths are checked before any work."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dptune._version import __version__
from dptune.errors import ConfigError
from dptune.rounding import round_up

NOT_DP_LABEL = "not differentially private: for the data owner only"
NOT_DP_NOTICE = (
    f"{NOT_DP_LABEL}. Computed from the raw private data outside the privacy guarantee, "
    "or revealing what the guarantee hides (losing candidates, the number of runs); do not publish."
)
RELEASE_DIR = "release"
DIAGNOSTICS_DIR = "diagnostics"

# History columns a release may show: the step and C_t, ρ_t, set by the strategy from noisy releases (post-processing).
# The rest stays in the diagnostics — a whitelist, so a new non-private column never leaks by default: e.g. train_loss
# (mean loss on the private batch, in the clear), batch_size (the realised |B_t|, a noiseless count of private data).
RELEASE_HISTORY_KEYS: tuple[str, ...] = ("step", "clip", "lr")

# Guarantees that cover only the selected candidate with the number of runs K hidden: the built-in kinds (Liu–Talwar,
# repeat-and-select) are fixed here, so hiding fails closed whatever was imported or unregistered; plug-in methods with
# ``hides_run_count`` add their name (= their guarantees' kind, checked by ``tune.plan``) when registered.
BUILTIN_HIDDEN_RUN_COUNT_KINDS: frozenset[str] = frozenset({"liu-talwar", "repeat-and-select"})
HIDDEN_RUN_COUNT_KINDS: set[str] = set(BUILTIN_HIDDEN_RUN_COUNT_KINDS)
_Rows = Sequence[Mapping[str, Any]]  # a CSV's rows

_README = """NOT DIFFERENTIALLY PRIVATE: FOR THE DATA OWNER ONLY.

Every file in this folder was computed from the raw private data outside the privacy
guarantee (training loss on the private batch, realised batch sizes, run times) or shows what
the guarantee does not cover (every candidate of the search, per-run ledgers, the number of
runs drawn by Liu-Talwar / repeat-and-select). Do not publish any of it.

What may be published is in the sibling folder ../release/ (see docs/privacy.md,
"What the published outputs contain").
"""


def release_dir(out: str | Path) -> Path:
    """``out/release`` (created)."""
    (d := Path(out) / RELEASE_DIR).mkdir(parents=True, exist_ok=True)
    return d


REPORT_FILES = ".report-files"  # in release/: what a study report wrote there, removed when its results change


def release_files(out: str | Path) -> dict[str, int]:
    """The files in ``out``/release/ but the tuner's own (``results.csv``, ``models/``), by name → mtime (ns)."""
    rel, own = Path(out) / RELEASE_DIR, {REPORT_FILES, "results.csv", "models"}
    files = (p for p in rel.rglob("*") if p.is_file() and p.relative_to(rel).parts[0] not in own)
    return {str(p.relative_to(rel)): p.stat().st_mtime_ns for p in files}


def note_report_files(out: str | Path, before: dict[str, int]) -> None:
    """After a study report: list the files it wrote in release/ (new or rewritten since ``before``), with their mtimes."""
    wrote = {n: t for n, t in release_files(out).items() if before.get(n) != t}
    (release_dir(out) / REPORT_FILES).write_text("".join(f"{t}\t{n}\n" for n, t in sorted(wrote.items())))


def drop_stale_report(out: str | Path) -> bool:
    """Remove the files a study report wrote from an earlier state of the study (found in review: its CSVs contradicted
    the new ``results.csv``), each only if unchanged since (a file of yours stays); True if there was one."""
    listing = Path(out) / RELEASE_DIR / REPORT_FILES
    if not listing.is_file():
        return False
    now = release_files(out)
    for line in listing.read_text(encoding="utf-8").splitlines():
        t, _, name = line.partition("\t")
        if name and now.get(name) == int(t):
            (listing.parent / name).unlink()
    listing.unlink()
    return True


def refuse_inside_release(out: str | os.PathLike[str], what: str) -> None:
    """Diagnostics inside a release/ folder (published whole) refused (review: ``report S --out S/release``)."""
    if RELEASE_DIR in Path(os.path.realpath(out)).parts:
        raise ConfigError(
            f"{what} {str(out)!r} is inside a '{RELEASE_DIR}' folder, which is published whole: the diagnostics "
            "(not differentially private) must not be. Fix: name a path outside it."
        )


def diagnostics_dir(out: str | Path) -> Path:
    """``out/diagnostics`` (created), with its README.txt stating the label; never inside a release/ folder."""
    refuse_inside_release(out, "the output folder")
    (d := Path(out) / DIAGNOSTICS_DIR).mkdir(parents=True, exist_ok=True)
    if not (d / "README.txt").is_file():
        (d / "README.txt").write_text(_README, encoding="utf-8")
    return d


# ----------------------------------------------------------------------------- paths, checked first
# A bad ``--out`` is one clear error before any work, not a result lost after training (nothing is
# created by these checks); ``dptune train``'s output paths; ``--data-dir``.
def _refuse_dangling_link(p: Path, what: str, path: Path) -> None:
    """Refuse a dangling symbolic link: it looks creatable but fails when written (after training)."""
    if p.is_symlink() and not p.exists():
        raise ConfigError(
            f"{what} {str(path)!r} cannot be created: {str(p)!r} is a symbolic link to {os.readlink(p)!r}, "
            "which does not exist. Fix: create the link's target, remove the link, or choose another path."
        )


def _check_creatable(folder: Path, what: str, path: Path) -> None:
    """``folder`` can hold ``path``: its nearest existing ancestor is a writable directory."""
    anc = folder
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    _refuse_dangling_link(anc, what, path)
    if not anc.is_dir():
        raise ConfigError(
            f"{what} {str(path)!r} cannot be created: {str(anc)!r} is a file, not a directory. "
            "Fix: choose a path whose parent folders are directories (or remove that file)."
        )
    try:  # os.access says yes to root, and to /proc: a file really made (and removed) says what will work
        if not os.access(anc, os.W_OK | os.X_OK):
            raise PermissionError("no write permission")
        tempfile.TemporaryFile(dir=anc).close()
    except OSError as exc:
        raise ConfigError(
            f"{what} {str(path)!r} cannot be written: {exc.strerror or exc} in {str(anc)!r}. "
            "Fix: choose a folder you can write to."
        ) from None


def check_output_file(path: str | os.PathLike[str], what: str) -> None:
    """``path`` may be written as a file (an existing file is replaced)."""
    p = Path(path)
    _refuse_dangling_link(p, what, p)
    if p.is_dir():
        raise ConfigError(
            f"{what} {str(p)!r} is a directory, but it names the file to write. "
            f"Fix: give a file path, e.g. {what} {str(p / 'result.json')!r}."
        )
    if p.exists() and not p.is_file():  # found in review: --out /dev/null, as root, replaced the device by a file
        raise ConfigError(f"{what} {str(p)!r} is not a regular file (a device or a pipe): dptune writes a new file "
                          "there. Fix: give a file path (the JSON is small; delete it if you do not want it).")  # fmt: skip
    _check_creatable(p.parent, what, p)
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{what} {str(p)!r} cannot be written (no write permission). Fix: choose another path.")


def check_output_dir(path: str | os.PathLike[str] | None, what: str) -> None:
    """``path`` is, or can be made, a directory we may write in (None: not asked for)."""
    if path is None:
        return
    p = Path(path)
    _refuse_dangling_link(p, what, p)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{what} {str(p)!r} is an existing file, not a directory. Fix: give a directory (new or "
                          "existing), or remove that file.")  # fmt: skip
    _check_creatable(p, what, p)


def refuse_foreign_dir(path: str | os.PathLike[str], ours: list[str], what: str, fix: str) -> None:
    """Refuse a non-empty directory holding none of ``ours`` (relative paths an earlier run of ours left): its files
    would be mixed with (or overwritten by) ours (found in review)."""
    p = Path(os.path.realpath(path))  # "e/missing/.." is e, where the run would write
    if p.is_dir() and not any((p / o).exists() for o in ours) and any(c.name != ".lock" for c in p.iterdir()):
        raise ConfigError(
            f"{what} {str(p)!r} is not empty and holds no earlier run. Fix: a new or empty directory, {fix}"
        )


def train_output_paths(out: Path, diagnostics_out: Path | None, save: Path | None, overwrite: bool = False) -> Path:
    """The diagnostics JSON's path (default: diagnostics/<out name> beside --out, or beside the release/
    folder holding it: it holds the seed). Every output path is checked before training; none is created.
    An existing ``out`` or diagnostics file, or a ``save`` folder holding anything, is refused unless ``overwrite``."""
    beside = out.parent.parent if out.parent.resolve().name == RELEASE_DIR else out.parent
    diag_path = diagnostics_out or beside / DIAGNOSTICS_DIR / out.name
    refuse_inside_release(diag_path.parent, "--diagnostics-out")
    if diag_path.resolve() == out.resolve():
        raise ConfigError(
            "--diagnostics-out must differ from --out: the diagnostics are not differentially private. "
            "Fix: leave out --diagnostics-out (default: diagnostics/<out name> beside --out), or name another file."
        )
    check_output_file(out, "--out")  # a bad path once failed after training, losing the result
    check_output_file(diag_path, "--diagnostics-out")
    check_output_dir(save, "--save")
    for flag, p in (("--out", out), ("--diagnostics-out", diag_path)):  # an earlier run's release (its budget spent)
        if p.is_file() and not overwrite:  # or diagnostics (its seed, a secret key) would be lost; found in an audit
            raise ConfigError(f"{flag} {str(p)!r} already holds a result. Fix: name a new file, or pass --overwrite.")
    if save is not None and save.is_dir() and not overwrite and (held := sorted(p.name for p in save.iterdir())):
        raise ConfigError(
            f"--save {str(save)!r} is not empty (it holds {', '.join(held[:3])}{', …' if len(held) > 3 else ''}): "
            "saving there would overwrite or mix with those files. Fix: choose a new or empty folder, or pass "
            "--overwrite."
        )
    return diag_path


def checkpoint_rule(checkpoint: str | None, has_eval: bool, eval_public: bool) -> str:
    """``"best"`` (the default) only on evaluation data declared public: selecting on private data
    is an unaccounted release. Without evaluation data "best" keeps the final parameters."""
    if checkpoint not in (None, "best", "final"):
        raise ConfigError(
            f"checkpoint must be 'final' or 'best' (got {checkpoint!r}). Fix: --checkpoint final or best."
        )
    if checkpoint == "best" and has_eval and not eval_public:
        raise ConfigError(
            "checkpoint 'best' selects on evaluation data, which must then be declared public. Fix: eval_public=True "
            "(--eval-public) if that data truly is public, or checkpoint='final' (--checkpoint final)."
        )
    return checkpoint or ("best" if has_eval and eval_public else "final")


def check_train_options(o: Any) -> None:
    """``dptune train``'s options (``o``: them by name) that need neither torch nor the data, checked
    first: an argument error in well under a second, not after seconds of imports and data loading."""
    numbers = [
        ("--epsilon", None if o.noise_multiplier is not None else o.epsilon, "3"),
        ("--noise-multiplier", o.noise_multiplier, "1.0"),
        ("--epochs", o.epochs, "5"),
        ("--batch-size", None if o.full_batch else o.batch_size, "256"),
    ]
    for flag, v, example in numbers:
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{flag} must be a finite number > 0, got {v!r}. Fix: e.g. {flag} {example}.")
    if not 0 < o.delta < 1:
        raise ConfigError(f"--delta must lie in (0, 1), got {o.delta!r}. Fix: e.g. --delta 1e-5 (below 1/n).")
    if o.eval_every < 1:
        raise ConfigError(f"--eval-every must be ≥ 1, got {o.eval_every}. Fix: e.g. --eval-every 50.")
    if o.accountant not in ("auto", "rdp", "pld", "gdp"):
        raise ConfigError(f"unknown --accountant {o.accountant!r}. Fix: choose auto, rdp, pld or gdp.")
    if parse_hyperparameters(getattr(o, "model_opt", []), "--model-opt", "mode=lora") and ":" in str(o.model):
        raise ConfigError("--model-opt sets a built-in model's options. Fix: give your factory its defaults instead.")
    if (bool(o.data) and str(o.data).lower().endswith(".csv")) != (getattr(o, "label", None) is not None):
        raise ConfigError("--data FILE.csv and --label COLUMN go together (the file's name ends in .csv). Fix: pass "
                          "both, or neither.")  # fmt: skip
    if not str(o.data or "").lower().endswith(".csv") and (getattr(o, "test", None) or getattr(o, "schema", None)):
        raise ConfigError("--test and --schema describe a CSV: they go with --data FILE.csv (found in review: ignored "
                          "without it, training on the default dataset). Fix: add --data FILE.csv --label COLUMN.")  # fmt: skip
    # torch.manual_seed takes at most a 64-bit integer; the data splits need ≥ 0 (-1 and 10**24 were tracebacks).
    if not 0 <= o.seed <= 2**63 - 1:
        raise ConfigError(f"--seed must be an integer in [0, 2**63 - 1], got {o.seed}. Fix: e.g. --seed 0.")


def parse_hyperparameters(pairs: list[str], flag: str = "--hp", example: str = "lr=0.1") -> dict[str, Any]:
    """``key=value`` pairs; values parsed as JSON when possible (numbers, true/false, null)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"{flag} {pair!r} is not key=value. Fix: write e.g. {flag} {example}.")
        k, v = pair.split("=", 1)
        with contextlib.suppress(json.JSONDecodeError):
            v = json.loads(v)
        out[k.strip()] = v
    return out


def wrap_to_terminal(text: str) -> str:
    """``text`` in lines that fit the terminal, or ``COLUMNS`` when stderr is a file (a warning)."""
    return textwrap.fill(text, shutil.get_terminal_size().columns, break_on_hyphens=False)


@contextlib.contextmanager
def resume_hint(study_dir: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Ctrl-C in ``dptune tune``/``resume``: ``say`` how to continue, then exit with 130 (SIGINT's code)."""
    try:
        yield
    except KeyboardInterrupt:
        stored = (Path(study_dir) / "study.sqlite").exists()  # else stopped while planning: nothing to resume
        say(f"continue with `dptune resume {study_dir}`." if stored else "nothing stored: run `dptune tune` again.")
        raise SystemExit(130) from None


def check_data_dir(data_dir: str | None) -> None:
    """A --data-dir that is not a folder was silently ignored (the data came from the cache or a download)."""
    if data_dir is not None and not Path(data_dir).is_dir():
        what = "is a file" if Path(data_dir).exists() else "does not exist"
        raise ConfigError(
            f"--data-dir {data_dir!r} {what}: it names the folder holding the datasets (<data-dir>/<name>/...). "
            "Fix: pass that folder, or leave out --data-dir to use $DPTUNE_DATA_DIR or the download cache."
        )


def release_history_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """History rows reduced to ``RELEASE_HISTORY_KEYS`` (no train_loss, no batch_size)."""
    return [{k: r[k] for k in RELEASE_HISTORY_KEYS if k in r} for r in rows]


def hides_run_count(guarantee_kind: str | None) -> bool:
    """Does this guarantee hold only with the number of runs (K) kept secret?"""
    return guarantee_kind in HIDDEN_RUN_COUNT_KINDS or guarantee_kind in BUILTIN_HIDDEN_RUN_COUNT_KINDS


# Stated instead of the planner's note for arms whose guarantee needs K secret.
HIDDEN_K_NOTE = (
    "only the selected candidate is released; the number of runs drawn and the other candidates "
    "are kept private (they are not covered by the guarantee)."
)


def split_arm_notes(plan: Any, name: Any = None) -> tuple[list[str], list[str]]:
    """(release, diagnostics) notes of a study plan's arms, with ``sampling_note``: an arm whose guarantee
    keeps K secret publishes ``HIDDEN_K_NOTE`` only (its planner notes state K); ``name(arm)`` labels them."""
    label = name or (lambda a: a.arm)
    notes = {id(a): [*a.notes, *sampling_note([plan.runs[r] for r in a.runs if r in plan.runs])] for a in plan.arms}
    hidden = [a for a in plan.arms if hides_run_count(a.guarantee.get("kind"))]
    release = [f"{label(a)}: {n}" for a in plan.arms if a not in hidden for n in notes[id(a)]]
    release += [f"{label(a)}: {HIDDEN_K_NOTE}" for a in hidden]
    return release, [f"{label(a)}: {n}" for a in hidden for n in notes[id(a)]]


def sampling_note(runs: Iterable[Any]) -> list[str]:
    """``train.SamplingWarning`` for a study, as a plan note (a warning per study fired on every short preset
    sweep): the arm's private runs that sample q > 0.5 of the data or take < 20 steps (public plan choices)."""
    odd = [r for r in runs if math.isfinite(r.noise_multiplier) and (0.5 < r.sampling_rate < 1 or r.steps < 20)]
    if not odd:
        return []
    q, T = max(r.sampling_rate for r in odd), min(r.steps for r in odd)
    return [
        f"{len(odd)} of its runs sample q > 0.5 of the data a step or take fewer than 20 steps (up to q = {q:.3g}, "
        f"down to T = {T}; advised: q ≤ 0.5, T ≥ 20): little privacy amplification by subsampling, or few noisy "
        "steps to learn from. Fix: a smaller batch or more epochs, unless intended (a short sweep)."
    ]


def epsilon_text(eps: float) -> str:
    """ε as the reports write it: ``3``, ``0.5``, ``∞`` for a non-private run (6 digits, rounded up)."""
    return "∞" if math.isinf(eps) else up(eps, 6)


def up(x: float, digits: int = 3) -> str:
    """A stated ε or δ to ``digits`` significant digits rounded UP (7.5431 → 7.55): never read smaller than it is."""
    return f"{round_up(x, digits):.{digits}g}".replace("inf", "∞")


def public_run_name(arm: Any, run: Mapping[str, Any]) -> str:
    """A selected run's release name: procedure and seed replicate, never the run id (it bounds K from below)."""
    return f"{arm.label} @ ε = {epsilon_text(arm.epsilon)}, procedure {run['procedure']}, replicate {run['replicate']}"


def write_csv_rows(
    path: str | Path, rows: _Rows, columns: Sequence[str] | None = None, *, comment: str | None = None
) -> Path:
    """The one CSV writer of the reports: optional ``# <comment>`` line, header, rows (list/dict cells as JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if columns is None:  # every key, in order of first appearance
        columns = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="", encoding="utf-8") as fh:
        if comment is not None:
            fh.write(f"# {comment}\n")
        w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows({k: json.dumps(v) if isinstance(v := r.get(k), list | dict) else v for k in columns} for r in rows)
    return path


def write_labelled_csv(path: str | Path, rows: _Rows, columns: Sequence[str] | None = None) -> Path:
    """A diagnostics CSV: first line ``# <NOT_DP_LABEL> ...``, then header and rows; read it back with
    ``read_csv_rows`` (or ``pandas.read_csv(path, comment='#')``)."""
    return write_csv_rows(path, rows, columns, comment=NOT_DP_NOTICE)


def read_csv_rows(path: str | Path) -> list[dict[str, str]]:
    """Rows of a dptune CSV, release or diagnostics (leading ``#`` comment lines skipped)."""
    with Path(path).open(newline="", encoding="utf-8") as fh:
        lines = [line for line in fh if not line.startswith("#")]
    return list(csv.DictReader(lines))


def strict_json(x: Any, **kwargs: Any) -> str:
    """Standard JSON: a non-finite float as the string "inf", "-inf" or "nan" (not ``Infinity``), else ``str``."""

    def finite(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, Mapping):
            return {k: finite(w) for k, w in v.items()}
        return [finite(w) for w in v] if isinstance(v, list | tuple) else v

    return json.dumps(finite(x), default=str, allow_nan=False, **kwargs)


def labelled_json(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A diagnostics JSON object: ``{"privacy": NOT_DP_NOTICE, ...payload}``."""
    return {"privacy": NOT_DP_NOTICE, **payload}


def write_train_outputs(
    result: Any, out: Path, diagnostics: Path, *, label_folder: bool, **context: Any
) -> dict[str, Any]:
    """Write ``dptune train``'s release JSON to ``out``, its diagnostics JSON to ``diagnostics`` (``train_outputs``);
    return the release. ``label_folder``: ``diagnostics`` is in the default diagnostics/ folder (gets its README.txt)."""
    release, diag = train_outputs(result, **context)
    if label_folder:
        diagnostics_dir(diagnostics.parent.parent)
    for path, payload in ((out, release), (diagnostics, diag)):  # atomic: an interrupted --overwrite keeps the old
        path.parent.mkdir(parents=True, exist_ok=True)
        (tmp := path.with_name(f".{path.name}.part")).write_text(strict_json(payload))
        os.replace(tmp, path)
    return release


# ----------------------------------------------------------------------------- randomness
SEEDED_WARNING = (
    "seeded (reproducible) randomness: the seed is a secret key. Anyone who knows it can regenerate "
    "every noise draw and every Poisson batch and subtract them: the privacy guarantee then does not "
    "hold. Keep the seed secret, or train with secure mode (the OS CSPRNG) before publishing."
)
SECURE_STATEMENT = (
    "secure mode: the noise and the Poisson batches were drawn from the operating system's CSPRNG, not from the seed "
    "(not reproducible). Each noisy value is snapped to a grid (no floating-point holes); the float sampler's proven "
    "worst-case error adds up to 4e-11 to ε per released coordinate (a run's or a composition's total, "
    "epsilon_float_slack: stated here), not in ε (docs/privacy.md, item 1b)."
)


def randomness_statement(secure: bool) -> dict[str, str]:
    """The ``randomness`` mode and its note, for every report of a run or study."""
    note = SECURE_STATEMENT if secure else SEEDED_WARNING
    return {"randomness": "secure" if secure else "seeded", "randomness_note": note}


# ----------------------------------------------------------------------------- one run (dptune train)
# The seed drives the noise and the Poisson batches in seeded mode: a secret key (docs/privacy.md,
# "Secure mode"). Like the model card, a release never holds it, in either mode; the diagnostics do.
SEED_NOTE = (
    "withheld from the release (one rule for both modes: in seeded mode it is a secret key); recorded in "
    "the diagnostics JSON"
)


def train_outputs(
    result: Any, *, seed: int | None = None, selection_split: str | None = None, **context: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(release, diagnostics) dicts of one ``TrainResult`` (fields: docs/privacy.md, "Private by default"):
    evaluations in the release only on public evaluation data, no run time, no seed; ``context`` goes to both."""
    summary = dict(result.summary())
    seconds = summary.pop("seconds", None)  # timing: a side channel on the realised batch sizes
    # Metrics on evaluation data not declared public were computed in the clear: the owner's only.
    owner_evals = {} if result.eval_public else {k: summary.pop(k) for k in ("best_metric", "best_step")}
    private = bool(result.plan.strategy.private)
    eps = (result.epsilon(result.delta) if result.delta else None) if private else math.inf
    release = {
        **context,
        **summary,
        "dptune_version": __version__,
        "selection_split": selection_split if result.checkpoint == "best" else None,
        "seed_note": SEED_NOTE,
        **({"evals": result.evals} if result.eval_public else {}),
        "ledger_totals": {
            "releases": sum(e.count for e in result.ledger.entries),
            "epsilon": eps,
            "delta": result.delta,
            "accountant": getattr(result.plan, "accountant", "rdp"),
        },
        "trajectory": release_history_rows(result.history),
    }
    if not private:  # no guarantee covers a non-private run: everything in it is the owner's only
        release = labelled_json(release)
    diagnostics = {
        **context,
        "seed": seed,
        "randomness": summary.get("randomness"),
        "dptune_version": __version__,
        "seconds": seconds,
        **({"private_evaluation": {**owner_evals, "evals": result.evals}} if owner_evals else {}),
        "history": result.history,
        "ledger": result.ledger.to_dict(),
    }
    return release, labelled_json(diagnostics)


def train_table_rows(result: Any, release: Mapping[str, Any], target: float | None) -> list[tuple[str, Any]]:
    """``dptune train``'s table: what the ``train_outputs`` release says, rows on a private test split labelled."""
    from dptune import accounting

    plan, delta = result.plan, result.delta

    def eps_of(v: float) -> float:
        event = plan.strategy.planned_event(v, plan.sampling_rate, plan.steps)
        return accounting.epsilon(event, delta, plan.accountant)

    # ν rounded up (copied back with --noise-multiplier it cannot overshoot); ε by the
    # accountant ν was calibrated with, named and rounded up (it is a privacy claim).
    eps = f"{accounting.round_up(release['epsilon'], 6):.6g}" if plan.strategy.private else "∞"
    owner = "" if result.eval_public else f" ({NOT_DP_LABEL})"  # metrics on a private test split
    split, last = release["selection_split"], result.evals[-1:]  # the final parameters' score, where released
    final = [(f"final {result.metric}{owner}", f"{last[0][result.metric]:.4f}")] if last and not split else []
    return [
        ("steps T", release["steps"]),
        ("sampling rate q", f"{release['sampling_rate']:.4g}"),
        ("noise multiplier ν", accounting.noise_multiplier_text(plan.noise_multiplier, eps_of, target)[0]),
        *effective_hyperparameters(plan.strategy.config(), result.history[:1]).items(),
        *([("defaults", "fine-tuning: pretrained model")] if plan.pretrained else []),
        (f"best {result.metric}{owner}", "-" if result.best_metric is None else f"{result.best_metric:.4f}"),
        (f"best step{owner}", result.best_step),
        *final,
        ("diverged", result.diverged),
        (f"ε spent ({plan.accountant.upper()})", eps),
        ("δ", delta),
        ("randomness", release["randomness"]),
        *([("ε float slack (secure mode)", up(x))] if (x := release.get("epsilon_float_slack")) is not None else []),
        ("model", release["model"]),
        ("selection", f"best checkpoint on the {split} split (public)" if split else "final parameters"),
        ("seed", "in the diagnostics JSON only" + ("" if result.secure_mode else " (a secret key)")),
        ("dptune", release["dptune_version"]),
    ]


def effective_hyperparameters(config: Mapping[str, Any], first: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """A run's hyperparameters as used: ``config`` with the defaults computed at the start (lr, clip of
    the ``first`` step's history row, a function of public quantities), and SGD's effective step
    η = lr·C/(1 − μ): a clipped batch moves θ by lr·C, momentum multiplies it by 1/(1 − μ)."""
    hp: dict[str, Any] = {k: first[0].get(k) if v is None and first else v for k, v in config.items()}
    hp.pop("strategy", None)
    if all(isinstance(hp.get(k), int | float) for k in ("lr", "clip", "momentum")) and hp["momentum"] < 1:
        hp["step lr·C/(1−μ)"] = hp["lr"] * hp["clip"] / (1 - hp["momentum"])
    return {k: f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in hp.items() if v is not None}


def publish_note(out: str | Path) -> str:
    """What may be published from an output folder, printed by ``tune`` and ``demo``."""
    return f"publish {Path(out) / RELEASE_DIR}/ only; {Path(out) / DIAGNOSTICS_DIR}/ is for the data owner ({NOT_DP_LABEL})."


def terminal_console(stderr: bool = False) -> Any:
    """A rich console that fits where it prints: the terminal's width (``COLUMNS`` when set); when
    piped to a file without ``COLUMNS``, 100 columns and no colour. Tables fold their cells to fit."""
    from rich.console import Console

    tty = (sys.stderr if stderr else sys.stdout).isatty()
    width = None if tty or os.environ.get("COLUMNS", "").isdigit() else 100
    return Console(stderr=stderr, width=width, color_system="auto" if tty else None)


def print_table(console: Any, table: Any) -> None:
    """Print a rich table, stacked (one ``column: value`` line per cell) when it cannot fit without cutting."""
    from rich.cells import cell_len
    from rich.console import Console

    for c in table.columns:  # rich would rather cut a word with "…" than overflow: never cut
        c.min_width = max([c.min_width or 0] + [cell_len(w) for t in (c.header, *c.cells) for w in str(t).split()])
    buf = io.StringIO()
    Console(file=buf, width=console.width, color_system=None).print(table, crop=False)
    if all(cell_len(line) <= console.width for line in buf.getvalue().splitlines()):
        console.print(table)
        return
    if table.title:
        console.print(table.title, style="bold", highlight=False)
    for row in zip(*(list(c.cells) for c in table.columns), strict=True):
        console.print()
        for c, v in zip(table.columns, row, strict=True):
            if str(v):
                console.print(f"{c.header}: {v}", highlight=False)  # markup, as in the table


class Progress:
    """A progress bar on a terminal (tqdm on stderr); when stderr is not a terminal, no ``\\r`` bars:
    one plain line per update if ``lines``, else nothing (a log file gets no control characters)."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, *, lines: bool = False, leave: bool = True):
        from tqdm.auto import tqdm

        self.n, self.total, self.desc, self.unit, self.lines = initial, total, desc, unit, lines
        tty = sys.stderr.isatty()
        # No elapsed time, rate or ETA: run time grows with the realised batch sizes (docs/privacy.md, item 7).
        fmt = "{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}"
        self.bar = (
            tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=leave, bar_format=fmt) if tty else None
        )

    def update(self, n: int = 1, postfix: str = "") -> None:
        self.n += n
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(n)
        elif self.lines:
            tail = f" ({postfix})" if postfix else ""
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}s{tail}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
