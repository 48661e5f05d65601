"""``"pkg.module:name"`` → the object it names: how dptune imports your code.

One importer for every user-code path (``--model``/``--data``, ``[model]``/``[data] factory``, a
study's ``selection.metric``), with one clear error when the path is wrong. Torch-free, so the
metric table (``dptune.metrics``) and the report layer can use it without loading torch.
"""

from __future__ import annotations

import importlib
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
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(
            f"{what} {path!r}: cannot import module {mod_name!r} ({exc}). Fix: install the "
            "package or put its folder on PYTHONPATH (every worker needs it too)."
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


def is_factory_path(s: Any) -> bool:
    return isinstance(s, str) and ":" in s
