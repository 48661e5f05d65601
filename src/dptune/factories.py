"""``"pkg.module:name"`` → the object it names: the one importer of user code, with one clear error.
Torch-free. The current folder is searched last (never shadowing an installed package), as ``python -c``
would; spawned workers and a local Ray inherit the path."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from dptune.errors import ConfigError


def import_factory(path: str, what: str = "factory", require_callable: bool = True) -> Any:
    """``"pkg.module:name"`` → the callable ``pkg.module.name`` (dots after ':' walk attributes)."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ConfigError(
            f"{what} {path!r} is not of the form 'pkg.module:function'. Fix: write e.g. "
            "'mypkg.models:build' (the module must be importable: on sys.path or PYTHONPATH)."
        )
    mod_name, attr = path.split(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(
            f"{what} {path!r}: cannot import module {mod_name!r} ({exc}). Fix: install the "
            "package, run from its folder, or put the folder on PYTHONPATH (every worker needs it too)."
        ) from None
    except Exception as exc:  # the user's module raised while importing
        raise ConfigError(
            f"{what} {path!r}: importing {mod_name!r} failed ({type(exc).__name__}: {exc}). Fix the module."
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{what} {path!r}: module {mod_name!r} has no attribute {attr!r}. Fix: check the name after ':'."
            )
        obj = getattr(obj, part)
    if require_callable and not callable(obj):
        raise ConfigError(f"{what} {path!r} is not callable. Fix: point at a function or class.")
    return obj


def call_factory(fn: Any, path: str, what: str, **kwargs: Any) -> Any:
    """``fn(**kwargs)`` for your factory ``path``: any error of it is one ConfigError naming it (chained)."""
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"your {what} {path!r}: {exc}. Fix its options.") from None
    except ValueError:  # no signature to check (a builtin): the call says
        pass
    try:
        return fn(**kwargs)
    except Exception as exc:
        raise ConfigError(f"your {what} {path!r} raised {type(exc).__name__}: {exc}") from exc


def is_factory_path(s: Any) -> bool:
    return isinstance(s, str) and ":" in s
