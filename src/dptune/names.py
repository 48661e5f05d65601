"""One name per concept across Python, the CLI and study files; the other spellings are aliases. The canonical names
are the Python API's (Opacus's): ``target_epsilon``, ``expected_batch_size``, ``secure_mode``; study files keep their
stored keys (a study's fingerprint) and accept the canonical names. Aliases work, with a note (docs/your_data.md)."""

from __future__ import annotations

import warnings
from typing import Any

from dptune.errors import ConfigError

ALIASES = {"epsilon": "target_epsilon", "batch_size": "expected_batch_size", "secure": "secure_mode"}


def aliased(extra: dict[str, Any], where: str, strict: bool = False, **canonical: Any) -> tuple[Any, ...]:
    """The ``canonical`` arguments' values (in order), each taken from its alias in ``extra`` (popped,
    with a note) when given that way. Both spellings at once: an error; ``strict``: so is any other
    key left in ``extra`` (a function without ``**hyperparameters``)."""
    for alias, name in ALIASES.items():
        if alias in extra and name in canonical:
            if canonical[name] not in (None, False):
                raise ConfigError(f"{where}: {alias}= and {name}= name one setting. Fix: pass {name}= only.")
            note = f"{where}: {alias}= is an alias of {name}=, dptune's name for it (docs/your_data.md)."
            warnings.warn(note, DeprecationWarning, stacklevel=3)
            canonical[name] = extra.pop(alias)
    if strict and extra:
        raise ConfigError(f"{where}() got unexpected keyword arguments {sorted(extra)}.")
    return tuple(canonical.values())
