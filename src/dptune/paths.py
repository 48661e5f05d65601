"""Output paths checked before any work: a bad ``--out`` is one clear error, not a result lost
after training (nothing is created by these checks)."""

from __future__ import annotations

import os
from pathlib import Path

from dptune.errors import ConfigError


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
