"""A study command's arguments (executor, workers, address, study file or folder) checked before torch
loads: an error in a fraction of a second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dptune.errors import ConfigError

EXECUTORS = ("local", "process", "ray")


def check_workers(workers: Any) -> int | None:
    """``workers`` as given (None: the executor's default), or a ``ConfigError`` for 0 or less."""
    if workers is None:
        return None
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(
            f"workers must be an integer ≥ 1, got {workers!r}. Fix: pass e.g. --workers 2, or leave it "
            "out (default: one per CPU core up to 4, or one per GPU on CUDA)."
        )
    return workers


def check_executor_name(name: str, address: str | None = None) -> None:
    """An executor's name and Ray address checked without torch (``tune.executors`` checks the rest)."""
    if name not in EXECUTORS:
        raise ConfigError(f"unknown executor {name!r}. Fix: choose one of {', '.join(EXECUTORS)}.")
    if address is not None and name != "ray":  # it was silently ignored
        raise ConfigError(
            f"address {address!r} is a Ray cluster's, but executor {name!r} does not use one. "
            "Fix: add --executor ray, or drop --address."
        )


def no_study(study_dir: Path) -> ConfigError:
    return ConfigError(
        f"{str(study_dir)!r} holds no study (study.sqlite is missing). Fix: pass the directory given to "
        "`dptune tune CONFIG --out DIR` (or run the study first)."
    )


def check_study_path(study: Path, is_file: bool = False) -> None:
    """A study file (``tune``) or folder (the other study commands), before torch loads; a folder
    without its database but with a coordinator's lock is left to the store (a study being made)."""
    if is_file and not study.exists():  # a folder is the spec's error (it names `dptune resume`)
        raise ConfigError(f"study file {str(study)!r} does not exist. Fix: pass the path of a .toml or .yaml file.")
    if not is_file and not (study / "study.sqlite").exists() and not (study / ".lock").exists():
        raise no_study(study)


def check_study_options(executor: str, workers: Any, address: str | None, study: Path, is_file: bool) -> None:
    """``dptune tune``/``resume``'s arguments, before torch loads."""
    check_workers(workers)
    check_executor_name(executor, address)
    check_study_path(study, is_file)
