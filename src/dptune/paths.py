"""Paths checked before any work: a bad ``--out`` is one clear error, not a result lost after
training (nothing is created by these checks); ``dptune train``'s output paths; ``--data-dir``."""

from __future__ import annotations

import os
from pathlib import Path

from dptune.errors import ConfigError
from dptune.outputs import DIAGNOSTICS_DIR, RELEASE_DIR


def _refuse_dangling_link(p: Path, what: str, path: Path) -> None:
    """A symbolic link whose target does not exist looks creatable (``exists()`` follows links)
    but fails when written: a FileExistsError for a folder, a result lost after training."""
    if p.is_symlink() and not p.exists():
        raise ConfigError(
            f"{what} {str(path)!r} cannot be created: {str(p)!r} is a symbolic link to {os.readlink(p)!r}, "
            "which does not exist. Fix: create the link's target, remove the link, or choose another path."
        )


def _check_creatable(folder: Path, what: str, path: Path) -> None:
    """``folder`` (existing or not) can hold ``path``: its nearest existing ancestor is a directory
    we may write in."""
    anc = folder
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    _refuse_dangling_link(anc, what, path)
    if not anc.is_dir():
        raise ConfigError(
            f"{what} {str(path)!r} cannot be created: {str(anc)!r} is a file, not a directory. "
            "Fix: choose a path whose parent folders are directories (or remove that file)."
        )
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{what} {str(path)!r} cannot be written: no write permission in {str(anc)!r}. "
            "Fix: choose a folder you can write to."
        )


def check_output_file(path: str | os.PathLike[str], what: str) -> None:
    """``path`` may be written as a file (an existing file is replaced)."""
    p = Path(path)
    _refuse_dangling_link(p, what, p)
    if p.is_dir():
        raise ConfigError(
            f"{what} {str(p)!r} is a directory, but it names the file to write. "
            f"Fix: give a file path, e.g. {what} {str(p / 'result.json')!r}."
        )
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
        raise ConfigError(
            f"{what} {str(p)!r} is an existing file, not a directory. "
            "Fix: give a directory (new or existing), or remove that file."
        )
    _check_creatable(p, what, p)


def train_output_paths(out: Path, diagnostics_out: Path | None, save: Path | None) -> Path:
    """The diagnostics JSON's path (default: diagnostics/<out name> beside --out, or beside the release/
    folder holding it: it holds the seed). Every output path is checked before training; none is created."""
    beside = out.parent.parent if out.parent.resolve().name == RELEASE_DIR else out.parent
    diag_path = diagnostics_out or beside / DIAGNOSTICS_DIR / out.name
    if RELEASE_DIR in diag_path.resolve().parent.parts:
        raise ConfigError(
            f"--diagnostics-out {diag_path} is inside a '{RELEASE_DIR}' folder: the diagnostics (the seed, the "
            "training loss) are not differentially private and must not be published with the release. "
            "Fix: name a file outside it (default: diagnostics/ beside the release folder)."
        )
    if diag_path.resolve() == out.resolve():
        raise ConfigError(
            "--diagnostics-out must differ from --out: the diagnostics are not differentially private. "
            "Fix: leave out --diagnostics-out (default: diagnostics/<out name> beside --out), or name another file."
        )
    check_output_file(out, "--out")  # a bad path once failed after training, losing the result
    check_output_file(diag_path, "--diagnostics-out")
    check_output_dir(save, "--save")
    return diag_path


def check_data_dir(data_dir: str | None) -> None:
    """A --data-dir that is not a folder was silently ignored (the data came from the cache or a download)."""
    if data_dir is None:
        return
    p = Path(data_dir)
    if not p.is_dir():
        what = "is a file" if p.exists() else "does not exist"
        raise ConfigError(
            f"--data-dir {data_dir!r} {what}: it names the folder holding the datasets (<data-dir>/<name>/...). "
            "Fix: pass that folder, or leave out --data-dir to use $DPTUNE_DATA_DIR or the download cache."
        )
