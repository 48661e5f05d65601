"""What a private pass may run and keep: trusted code (``own_code``: the batched paths run only on models made of
torch's, Hugging Face's, peft's and dptune's calls; ``calls_made_of``, ``check_modes``), and your Python state kept
from before a batch computed one example at a time (``KeptState``). Derivations and the review findings behind each
rule: docs/privacy.md, "The unit of privacy" and items 17, 19, 21-23.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dptune.errors import ConfigError

# A module's own hooks, and torch's global ones (``register_module_*_hook``): they run on whatever a call sees.
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def global_module_hooks() -> tuple[tuple[Any, ...], ...]:
    """The keys of torch's global module hooks, per kind (all empty when none is registered)."""
    from torch.nn.modules import module as torch_module

    return tuple(tuple(getattr(torch_module, "_global" + h, {})) for h in MODULE_HOOKS)


# Code whose forwards compute each row from that row alone (reviewed, tested): the batched paths (ghost,
# DP-ZO's batched losses) run only on models made of it; your own forward runs one example at a time,
# unless its class declares ``dptune_rowwise = True`` (your word, still probed: docs/privacy.md).
TRUSTED_CODE = ("torch.", "transformers.", "peft.", "dptune.")
UNTRUSTED = ("torch.fx", "torch.export", "torch.jit", "torch._dynamo")  # they run a graph traced from your code


def own_code(model: nn.Module) -> str | None:
    """The first module whose call runs code of yours (its class's forward, an instance forward or ``_call_impl``, a
    compiled call, a hook, a function of yours it holds: an activation, Hugging Face's attention or mask function by
    its registered name), named; None when every call is torch's, Hugging Face's, peft's or dptune's, or declared
    row-wise."""
    if any(global_module_hooks()):
        return "global module hooks"
    for name, mod in model.named_modules():
        where = type(mod).__module__ or ""  # the class's own: a subclass of yours may override any method
        declared = getattr(type(mod), "dptune_rowwise", False) is True
        trusted = where.startswith(TRUSTED_CODE) and not where.startswith(UNTRUSTED) or declared
        if (
            not trusted
            or {"forward", "_call_impl"} & set(vars(mod))
            or getattr(mod, "_compiled_call_impl", None) is not None
            or any(getattr(mod, h, None) for h in MODULE_HOOKS)
            or not declared
            and any(_foreign(v) for v in (*vars(mod).values(), *_hf_functions(mod)))
        ):
            return f"{type(mod).__qualname__} ('{name or 'the model'}'): your own forward, hooks or functions"
    return None


def _foreign(v: Any) -> bool:
    """A function (or callable object) a trusted layer holds and calls, from code that is not trusted."""
    if not callable(v) or isinstance(v, (nn.Module, type)):
        return False
    v = getattr(v.func if isinstance(v, functools.partial) else v, "__func__", v)
    where = getattr(v, "__module__", None) or type(v).__module__ or ""
    return not where.startswith(TRUSTED_CODE) or where.startswith(UNTRUSTED)


def _hf_functions(mod: nn.Module) -> list[Any]:
    """The attention and mask functions a Hugging Face layer looks up by ``config._attn_implementation``: anyone may
    register one under any name (``AttentionInterface.register``), and it sees the whole batch."""
    impl = getattr(getattr(mod, "config", None), "_attn_implementation", None)
    hf = sys.modules.get("transformers.modeling_utils"), sys.modules.get("transformers.masking_utils")
    tables = [getattr(hf[0], "ALL_ATTENTION_FUNCTIONS", {}), getattr(hf[1], "ALL_MASK_ATTENTION_FUNCTIONS", {})]
    return [t[impl] for t in tables if isinstance(impl, str) and impl in t]


def calls_made_of(mod: nn.Module) -> tuple:
    """What a module's call runs besides its class's code (for a change after ``make_private``): an instance
    forward or ``_call_impl``, a compiled call, the functions it holds and Hugging Face's by name."""
    held = (*vars(mod).values(), *_hf_functions(mod))
    return tuple(k for k in ("forward", "_call_impl", "_compiled_call_impl") if vars(mod).get(k) is not None), tuple(
        id(v) for v in held if callable(v) and not isinstance(v, (nn.Module, type))
    )


def check_modes() -> None:
    """Refuse a torch function or dispatch mode of yours around a private pass: it sees (and may mix) the batch."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack()):
        where = type(mode).__module__ or ""
        trusted = where.startswith(TRUSTED_CODE) and not where.startswith(UNTRUSTED)
        if not trusted and getattr(type(mode), "dptune_rowwise", False) is not True:
            raise ConfigError(
                f"a torch mode of yours ({type(mode).__qualname__}) is active around a private pass: it sees the "
                "whole batch, so one example could move the others. Fix: leave it first, or declare "
                "dptune_rowwise = True on its class (your word that it computes each row from that row alone)."
            )


# What torch keeps in a module's __dict__ and ``ParamSwap`` holds: not part of ``KeptState``'s Python state.
_TORCH_DICTS = frozenset(("_parameters", "_buffers", "_modules"))


class KeptState:
    """The Python state of a model and of ``others`` (your loss, your metric), kept by a deep copy sharing their
    tensors and ``tensors``: each module's attributes besides its parameters, buffers and submodules, as it pickles
    (``__getstate__``, e.g. an RNN's weight list refreshed: a vocabulary, a lazily set shift, a counter); an object's
    attributes; a function's closure cells (a bound method: its object). Taken before a batch computed one example at
    a time; ``again(fn)`` computes with it back in place (a module as unpickling puts it, ``__setstate__``), then puts
    the state of now back (docs/privacy.md, items 17 and 23: the last example again, as before the batch)."""

    def __init__(self, model: nn.Module | None, tensors: Iterable[torch.Tensor] = (), others: Iterable[Any] = ()):
        self._mods: list[nn.Module] = list(model.modules()) if model is not None else []
        self._objs: list[Any] = []
        self._cells: list[Any] = []
        for o in others:
            self._collect(o, 0)
        # Your classes' data attributes too (a vocabulary kept on the class is shared by every instance).
        self._classes = list(dict.fromkeys(c for o in (*self._mods, *self._objs) for c in type(o).__mro__ if _yours(c)))
        memo: dict[int, Any] = {id(t): t for m in self._mods for t in (*m.parameters(), *m.buffers())}
        memo.update((id(t), t) for t in tensors)
        memo.update((id(m), m) for m in (*self._mods, *self._objs, *self._classes))
        try:
            self._kept = [copy.deepcopy(_python_attrs(m.__getstate__()), memo) for m in self._mods]
            self._kept_objs = [copy.deepcopy(dict(vars(o)), memo) for o in self._objs]
            self._kept_cells = [copy.deepcopy(c.cell_contents, memo) for c in self._cells]
            self._kept_classes = [copy.deepcopy(_class_data(c), memo) for c in self._classes]
        except Exception as exc:  # noqa: BLE001 - a lock, a file: the check needs the copy
            raise ConfigError(f"the model (or your loss or metric) cannot be deep-copied ({exc}). Fix: keep no lock or "
                              "file in it.") from None  # fmt: skip

    def _collect(self, o: Any, depth: int) -> None:
        o = o.__self__ if inspect.ismethod(o) else o
        if isinstance(o, nn.Module):
            ids = {id(m) for m in self._mods}
            self._mods += [m for m in o.modules() if id(m) not in ids]
        elif inspect.isfunction(o) and depth < 4:  # closures of closures, a few levels deep
            for c in o.__closure__ or ():
                try:
                    v = c.cell_contents
                except ValueError:  # an empty cell
                    continue
                if inspect.isfunction(v) or inspect.ismethod(v) or _stateful_object(v):
                    self._collect(v, depth + 1)
                else:
                    self._cells.append(c)
        elif _stateful_object(o) and all(o is not k for k in self._objs):
            self._objs.append(o)

    def again(self, fn: Callable[[], Any]) -> Any:
        now = [_python_attrs(vars(m)) for m in self._mods], [dict(vars(o)) for o in self._objs]
        cells, classes = [c.cell_contents for c in self._cells], [_class_data(c) for c in self._classes]
        try:
            for c, d in zip(self._classes, self._kept_classes, strict=True):
                _put_class_data(c, d)
            for m, attrs in zip(self._mods, self._kept, strict=True):
                _put_attrs(m, {})
                m.__setstate__({**vars(m), **attrs})
            for o, d in zip(self._objs, self._kept_objs, strict=True):
                vars(o).clear()
                vars(o).update(copy.copy(d))
            for c, v in zip(self._cells, self._kept_cells, strict=True):
                c.cell_contents = v
            return fn()
        finally:
            for m, attrs in zip(self._mods, now[0], strict=True):
                _put_attrs(m, attrs)
            for o, d in zip(self._objs, now[1], strict=True):
                vars(o).clear()
                vars(o).update(d)
            for c, v in zip(self._cells, cells, strict=True):
                c.cell_contents = v
            for c, d in zip(self._classes, classes, strict=True):
                _put_class_data(c, d)


def _yours(cls: type) -> bool:
    where = cls.__module__ or ""
    return not where.startswith(TRUSTED_CODE) and where != "builtins"


def _class_data(cls: type) -> dict[str, Any]:
    """A class's own data attributes (not its methods, properties or dunders)."""
    return {
        k: v for k, v in vars(cls).items()
        if not k.startswith("__") and not inspect.isroutine(v) and not isinstance(v, (property, classmethod, staticmethod, type))
    }  # fmt: skip


def _put_class_data(cls: type, data: dict[str, Any]) -> None:
    for k in _class_data(cls).keys() - data.keys():
        delattr(cls, k)
    for k, v in data.items():
        setattr(cls, k, v)


def _stateful_object(o: Any) -> bool:
    """An instance with attributes of its own (your loss object), not a class or a Python module."""
    return isinstance(o, nn.Module) or (
        hasattr(o, "__dict__") and not isinstance(o, (type, types.ModuleType)) and not inspect.isroutine(o)
    )


def _python_attrs(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in _TORCH_DICTS}


def _put_attrs(m: nn.Module, attrs: dict[str, Any]) -> None:
    """``attrs`` as m's whole Python state (an attribute made since is removed)."""
    d = vars(m)
    for k in [k for k in d if k not in _TORCH_DICTS and k not in attrs]:
        del d[k]
    d.update(attrs)
