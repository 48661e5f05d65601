"""The table of tuning methods: name → method, and aliases. Imports nothing of ``tune`` (``tune.spec``
validates through it), so entries are typed loosely."""

from __future__ import annotations

from typing import Any

from dptune.errors import ConfigError
from dptune.outputs import BUILTIN_HIDDEN_RUN_COUNT_KINDS, HIDDEN_RUN_COUNT_KINDS

_METHODS: dict[str, Any] = {}  # name → TuningMethod instance, in registration order
_ALIASES: dict[str, str] = {}  # alias → name
_BUILTINS: set[str] = set()  # names registered by dptune itself (tune.methods.__init__)


def names() -> tuple[str, ...]:
    """The registered method names, in registration order."""
    return tuple(_METHODS)


def register(cls: type, *, builtin: bool = False) -> type:
    """Make a ``TuningMethod`` subclass available under ``cls.name`` and ``cls.aliases``; returns ``cls`` (a class
    decorator). ``builtin``: dptune's own, which ``unregister`` refuses to remove."""
    name = getattr(cls, "name", "")
    aliases = tuple(getattr(cls, "aliases", ()))
    for key in (name, *aliases):  # looked up lower-cased and stripped
        if not isinstance(key, str) or not key or key != key.strip().lower():
            raise ConfigError(
                f"{cls.__name__}: method names and aliases are lower-case strings, got {key!r}. "
                "Fix: e.g. name = 'my-method', aliases = ('mine',)."
            )
    taken = set(_METHODS) | set(_ALIASES)
    if clash := sorted(({name, *aliases}) & taken):
        raise ConfigError(
            f"tuning method name {clash[0]!r} is already registered. Fix: choose another name, or "
            f"unregister({clash[0]!r}) first."
        )
    _METHODS[name] = cls()
    if builtin:
        _BUILTINS.add(name)
    for alias in aliases:
        _ALIASES[alias] = name
    if getattr(cls, "hides_run_count", False):
        HIDDEN_RUN_COUNT_KINDS.add(name)
    return cls


def unregister(name: str) -> None:
    """Remove a plug-in method and its aliases (e.g. one registered by a test). The built-ins stay:
    a stored study names them, and K-hiding must not depend on what a process unregistered."""
    key = canonical_method(name)
    if key in _BUILTINS:
        raise ConfigError(
            f"{key!r} is a built-in tuning method and cannot be unregistered. Fix: register yours under another name."
        )
    del _METHODS[key]
    if key not in BUILTIN_HIDDEN_RUN_COUNT_KINDS:
        HIDDEN_RUN_COUNT_KINDS.discard(key)
    for alias in [a for a, n in _ALIASES.items() if n == key]:
        del _ALIASES[alias]


def canonical_method(name: Any, path: str = "method.name") -> str:
    """The registered name that ``name`` (a name or an alias, any case) stands for."""
    if not isinstance(name, str):
        raise ConfigError(f"{path}: must be a string, got {name!r}. Fix: choose one of {', '.join(_METHODS)}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _METHODS:
        raise ConfigError(
            f"{path}: unknown tuning method {name!r}. Fix: choose one of {', '.join(_METHODS)} (a study that "
            "used a plug-in method needs it registered in this process: the CLI knows only the built-ins)"
        )
    return key


def get_method(name: str) -> Any:
    """The ``TuningMethod`` registered as ``name`` or an alias (any case), else a ``ConfigError``."""
    return _METHODS[canonical_method(name)]
