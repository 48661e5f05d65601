"""What a private pass may run and keep: trusted code (``own_code``: the batched paths run only on models made of
torch's, Hugging Face's, peft's and dptune's calls), and your Python state kept from before a batch computed one
example at a time (``KeptState``). Why: docs/privacy.md, "The unit of privacy" and items 17, 19, 21-23."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dptune.errors import ConfigError
from dptune.gradients.persample import rng_preserved, rng_state, set_rng_state

# A module's own hooks, and torch's global ones (``register_module_*_hook``): they run on whatever a call sees.
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def global_module_hooks() -> tuple[tuple[Any, ...], ...]:
    """The keys of torch's global module hooks, per kind (all empty when none is registered)."""
    from torch.nn.modules import module as torch_module

    return tuple(tuple(getattr(torch_module, "_global" + h, {})) for h in MODULE_HOOKS)


# Code computing each row from that row alone (reviewed, tested): the batched paths run only on models made of it;
# your forward runs one example at a time unless its class declares ``dptune_rowwise = True`` (still probed).
TRUSTED_PACKAGES = ("torch", "transformers", "peft", "dptune")
TRUSTED_CODE = tuple(p + "." for p in TRUSTED_PACKAGES)
UNTRUSTED = ("torch.fx", "torch.export", "torch.jit", "torch._dynamo")  # they run a graph traced from your code
# HF families and peft tuners reviewed and tested row by row (tests/gradients/test_ghost_transformers.py; peft's shared
# tuners_utils, _buffer_dict: read); others are yours: NLLB-MoE's router mixes rows over the batch (1.46·C).
REVIEWED = {"transformers.models": {"bert", "roberta", "distilbert", "gpt2", "llama", "qwen2", "qwen3", "mistral",
                                    "phi3", "xlm_roberta", "electra", "modernbert", "phi", "gpt_neox", "stablelm",
                                    "olmo"}, "peft.tuners": {"lora", "tuners_utils", "_buffer_dict"}}  # fmt: skip


def own_code(model: nn.Module) -> str | None:
    """The first module whose call runs code of yours, named; None when every call is trusted or declared row-wise.
    Code is judged by its source file (not the name ``functools.wraps`` copies): the class's forward and call, an
    instance's forward or ``_call_impl``, hooks, the functions a layer holds or Hugging Face looks up by name (any
    registered function of yours makes its models yours)."""
    if any(global_module_hooks()):
        return "global module hooks"
    if patched := next((f for f in namespace_functions(model) if not trusted_code(f) and not _library(f)), None):
        return f"{getattr(patched, '__qualname__', patched)}: a function of yours in place of torch's or its layers'"
    hf_yours = any(not trusted_code(f) for f in registered_functions(every=False))
    for name, mod in model.named_modules():
        cls = type(mod)
        declared = getattr(cls, "dptune_rowwise", False) is True
        trusted = (
            declared
            or _trusted_module(cls.__module__)
            and all(trusted_code(getattr(cls, k)) for k in ("forward", "__call__", "_call_impl"))
        )
        if (
            not trusted
            or any(calls_made_of(mod)[0])
            or not declared
            and (any(not trusted_code(v) for v in _held(mod)) or hf_yours and hasattr(mod, "config"))
        ):
            unreviewed = not _trusted_module(cls.__module__) and cls.__module__.startswith(tuple(REVIEWED))
            why = "a model family not reviewed row by row" if unreviewed else "your own forward, hooks or functions"
            return f"{cls.__qualname__} ('{name or 'the model'}'): {why}"
    return None


def _trusted_module(where: str | None) -> bool:
    where = where or ""
    area = next((a for a in REVIEWED if where.startswith(a + ".")), None)
    reviewed = area is None or where[len(area) + 1 :].split(".")[0] in REVIEWED[area]
    return where in TRUSTED_PACKAGES or where.startswith(TRUSTED_CODE) and not where.startswith(UNTRUSTED) and reviewed


def _unreviewed(where: str | None) -> bool:  # a module of a Hugging Face family not reviewed
    return (where or "").startswith("transformers.models.") and not _trusted_module(where)


@functools.lru_cache(maxsize=4096)
def _module_of(filename: str, packages: tuple[tuple[str, str], ...]) -> str | None:  # its module in ``packages``
    where = os.path.realpath(filename)
    for name, file in packages:
        root = os.path.realpath(os.path.dirname(file))
        if where.startswith(root + os.sep):
            return ".".join((name, *os.path.splitext(where[len(root) + 1 :])[0].split(os.sep)))
    return None


def _code_module(f: Any) -> str | None:  # a function's file's module, in the trusted packages imported so far
    files = tuple((n, p) for n in TRUSTED_PACKAGES if (p := getattr(sys.modules.get(n), "__file__", None)))
    return _module_of(f.__code__.co_filename, files) if hasattr(f, "__code__") else None


def trusted_code(f: Any) -> bool:
    """Whether a callable runs only trusted code: its (a partial's, a method's, ``__call__``'s) function's source
    file in the trusted packages, not what ``functools.wraps`` names; a built-in by its module; or declared row-wise."""
    while isinstance(f, functools.partial):
        f = f.func
    f = getattr(f, "__func__", f)
    if getattr(f, "dptune_rowwise", False) is True:  # your word that it computes each row from that row alone
        return True
    if hasattr(f, "__code__"):  # judged by its file's module name, as a class by its module
        return _trusted_module(_code_module(f))
    if isinstance(f, type):  # a class registered or held: its own module
        return _trusted_module(f.__module__)
    if inspect.isbuiltin(f) or isinstance(f, (types.BuiltinFunctionType, types.WrapperDescriptorType)):
        return _trusted_module(getattr(f, "__module__", None) or "torch.")  # C code: not yours
    call = getattr(type(f), "__call__", None)  # noqa: B004 - the class's method, for its code
    return inspect.isfunction(call) and trusted_code(call) or _trusted_module(type(f).__module__)


def _held(mod: nn.Module) -> list[Any]:
    """The functions a module's call may run besides its class's: its hooks and the callables it holds."""
    hooks = [h for k in MODULE_HOOKS for h in getattr(mod, k, {}).values()]
    return hooks + [v for v in vars(mod).values() if callable(v) and not isinstance(v, (nn.Module, type))]


_REGISTRIES: list[Any] = [0]  # [len(sys.modules) when found, (mapping, held by unreviewed families only)...]


def registered_functions(every: bool = True) -> list[Any]:
    """Every function registered in Hugging Face's lookup tables by name (``GeneralInterface``: attention, masks,
    experts, ...), global and per table (found again when more modules load). ``every=False``: not an unreviewed
    family's own function in a table only such families hold (Doge's: only its models, yours anyway, look it up)."""
    base = getattr(sys.modules.get("transformers.utils.generic"), "GeneralInterface", None)
    if base is None:
        return []
    if _REGISTRIES[0] != len(sys.modules):
        subs, todo = [], [base]
        while todo:
            subs += (todo := [c for t in todo for c in t.__subclasses__()])
        found = [(v, n) for n, m in list(sys.modules.items()) if n.startswith("transformers.") for v in vars(m).values()
                 if isinstance(v, base)]  # fmt: skip
        tables = {id(v): (v._local_mapping, all(_unreviewed(k) for u, k in found if u is v)) for v, _ in found}
        _REGISTRIES[:] = [len(sys.modules), *((c._global_mapping, False) for c in subs), *tables.values()]
    return [f for m, theirs in _REGISTRIES[1:] for f in list(m.values())
            if every or not (theirs and _unreviewed(_code_module(f)))]  # fmt: skip


def namespace_functions(model: nn.Module) -> list[Any]:
    """The Python functions a trusted layer looks up: torch's, ``F``'s, Tensor's, its own module's (one replaced by
    yours, ``F.relu = f``, runs on the whole batch inside a stock layer: found in review, up to 28·C)."""
    names = {type(m).__module__ for m in model.modules() if _trusted_module(type(m).__module__)}
    spaces = [torch, torch.nn.functional, torch.Tensor, *(sys.modules[n] for n in sorted(names) if n in sys.modules)]
    return [v for ns in spaces for v in list(vars(ns).values()) if inspect.isfunction(v)]


# Libraries the trusted packages import into their namespaces: not yours, and not called on a batch by a layer.
LIBRARIES = ("typing_extensions", "accelerate", "huggingface_hub", "safetensors")


def _library(f: Any) -> bool:
    """A function of Python's standard library or of ``LIBRARIES`` (``typing.get_origin`` in a torch module)."""
    paths = sysconfig.get_paths()
    site = tuple(os.path.realpath(paths[k]) + os.sep for k in ("purelib", "platlib"))
    where = os.path.realpath(f.__code__.co_filename)
    if where.startswith(os.path.realpath(paths["stdlib"]) + os.sep) and not where.startswith(site):
        return True
    files = [os.path.realpath(x) for n in LIBRARIES if (x := getattr(sys.modules.get(n), "__file__", None))]
    return where in files or where.startswith(tuple(os.path.dirname(x) + os.sep for x in files if "__init__" in x))


def calls_made_of(mod: nn.Module) -> tuple:
    """What a module's call runs besides its class's code: an instance's (compiled) call or forward; what it holds."""
    own = tuple(k for k in ("forward", "_call_impl", "_compiled_call_impl") if vars(mod).get(k) is not None)
    return own, tuple(id(v) for v in vars(mod).values() if callable(v) and not isinstance(v, (nn.Module, type)))


def check_modes() -> None:
    """Refuse a torch mode (it sees the batch) or saved-tensor hooks (19.4·C in review) of yours around a pass."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack()):
        if not _trusted_module(type(mode).__module__) and getattr(type(mode), "dptune_rowwise", False) is not True:
            raise ConfigError(
                f"a torch mode of yours ({type(mode).__qualname__}) is active around a private pass: it sees the "
                "whole batch, so one example could move the others. Fix: leave it first, or declare "
                "dptune_rowwise = True on its class (your word that it computes each row from that row alone)."
            )
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and not all(trusted_code(h) for h in hooks):
        raise ConfigError("saved-tensor hooks of yours (torch.autograd.graph.saved_tensors_hooks) are active around "
                          "a private pass: they see the whole batch. Fix: leave them first.")  # fmt: skip


# What torch keeps in a module's __dict__ and ``ParamSwap`` holds: not part of a model module's kept state.
_TORCH_DICTS = frozenset(("_parameters", "_buffers", "_modules"))
_Item = tuple[Callable[[], Any], Callable[[Any], None]]  # (read the state, put a state in place)


class KeptState:
    """The Python state of a model and of ``others`` (your loss, your metric), deep-copied before a batch computed
    one example at a time; ``again(fn)`` computes with it in place, then puts the current one back (docs/privacy.md,
    items 17, 23). Kept: model modules' attributes but tensors and submodules, as they pickle; your loss's and
    metric's modules whole; objects' attributes and slots; functions' cells, attributes and defaults; your classes'
    data attributes. Not kept: module-level globals."""

    def __init__(self, model: nn.Module | None, tensors: Iterable[torch.Tensor] = (), others: Iterable[Any] = ()):
        self._items: list[_Item] = []
        self._seen: dict[int, Any] = {}  # everything collected, by id: kept as itself inside the copies
        shared = [*tensors, *(model.parameters() if model is not None else ()), *(model.buffers() if model else ())]
        for m in model.modules() if model is not None else ():
            self._collect(m, 0, whole=False)
        for o in others:
            self._collect(o, 0, whole=True)
        memo = {id(t): t for t in shared} | self._seen
        try:
            self._kept = copy.deepcopy([read() for read, _ in self._items], memo)
        except Exception as exc:  # noqa: BLE001 - a lock, a file: the check needs the copy
            raise ConfigError(f"the model (or your loss or metric) cannot be deep-copied ({exc}). Fix: keep no lock or "
                              "file in it.") from None  # fmt: skip

    def _collect(self, o: Any, depth: int, whole: bool) -> None:
        if id(o) in self._seen or depth > 4 or o is None or isinstance(o, (torch.Tensor, type, types.ModuleType)):
            return
        if isinstance(o, functools.partial):
            for v in (o.func, *o.args, *o.keywords.values()):
                if _stateful(v):
                    self._collect(v, depth + 1, whole)
                elif isinstance(v, (dict, list, set)) and id(v) not in self._seen:  # a state given as an argument
                    self._seen[id(v)] = v
                    self._items.append(_container_item(v))
            return
        if inspect.ismethod(o):
            return self._collect(o.__self__, depth + 1, whole)
        self._seen[id(o)] = o
        if isinstance(o, nn.Module):  # a model's module shares the model's tensors; your loss's is kept whole
            self._items.append(_dict_item(o) if whole else _module_item(o))
            for m in o.children():
                self._collect(m, depth, whole)
        elif inspect.isfunction(o):
            self._items.append(_function_item(o))
            for cell in o.__closure__ or ():
                try:
                    v = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                self._collect(v, depth + 1, whole) if _stateful(v) else self._items.append(_cell_item(cell))
            return
        elif hasattr(o, "__dict__"):
            self._items.append(_dict_item(o))
        elif slots := [
            n for c in type(o).__mro__ for n in getattr(c, "__slots__", ()) if n not in ("__dict__", "__weakref__")
        ]:
            self._items.append(_slots_item(o, slots))
        for v in list(getattr(o, "__dict__", {}).values()):  # functions and objects a layer holds: theirs too
            if inspect.isfunction(v) or inspect.ismethod(v) or isinstance(v, functools.partial):
                self._collect(v, depth + 1, whole)
        for c in type(o).__mro__:
            if id(c) not in self._seen and _yours(c):
                self._seen[id(c)] = c
                self._items.append(_class_item(c))

    def mark(self, device: torch.device) -> None:
        """The random streams now, at the last row's turn: ``again`` computes from them too."""
        self._turn = device, rng_state(device)

    def again(self, fn: Callable[[], Any]) -> Any:
        now, turn = [read() for read, _ in self._items], getattr(self, "_turn", None)
        try:
            for (_, put), v in zip(self._items, self._kept, strict=True):
                put(v)
            with rng_preserved(turn[0]) if turn else contextlib.nullcontext():
                if turn:
                    set_rng_state(*turn)
                return fn()
        finally:
            for (_, put), v in zip(self._items, now, strict=True):
                put(v)


def _stateful(v: Any) -> bool:
    """A value whose own state is collected (a module, an object, a function), not kept as a whole."""
    return (
        inspect.isfunction(v)
        or inspect.ismethod(v)
        or isinstance(v, (nn.Module, functools.partial))
        or (hasattr(v, "__dict__") and not isinstance(v, (type, types.ModuleType)) and not inspect.isroutine(v))
    )


def _yours(cls: type) -> bool:
    top = (cls.__module__ or "").split(".")[0]
    return not _trusted_module(cls.__module__) and top not in sys.stdlib_module_names and top != "builtins"


def _module_item(m: nn.Module) -> _Item:
    """A model module: its attributes as it pickles, put back by ``__setstate__`` (one made since removed)."""

    def read() -> dict[str, Any]:
        try:
            state = m.__getstate__()
        except Exception:  # noqa: BLE001 - torch's parametrized modules refuse pickling
            state = vars(m)
        return {k: v for k, v in state.items() if k not in _TORCH_DICTS}

    def put(attrs: dict[str, Any]) -> None:
        for k in [k for k in vars(m) if k not in _TORCH_DICTS]:
            del vars(m)[k]
        m.__setstate__({**vars(m), **attrs})

    return read, put


def _dict_item(o: Any) -> _Item:
    def put(d: dict[str, Any]) -> None:
        vars(o).clear()
        vars(o).update(d)

    return lambda: dict(vars(o)), put


def _slots_item(o: Any, names: list[str]) -> _Item:
    def read() -> dict[str, Any]:
        return {n: getattr(o, n) for n in names if hasattr(o, n)}

    def put(d: dict[str, Any]) -> None:
        for n in names:
            if n in d:
                setattr(o, n, d[n])
            elif hasattr(o, n):
                delattr(o, n)

    return read, put


def _function_item(f: Any) -> _Item:
    def read() -> tuple[Any, ...]:
        return dict(f.__dict__), f.__defaults__, f.__kwdefaults__

    def put(v: tuple[Any, ...]) -> None:
        f.__dict__.clear()
        f.__dict__.update(v[0])
        f.__defaults__, f.__kwdefaults__ = v[1], v[2]

    return read, put


def _container_item(c: dict | list | set) -> _Item:
    """A dict, list or set given to a partial: its items, put back in place."""

    def put(v: Any) -> None:
        c.clear()
        c.update(v) if isinstance(c, (dict, set)) else c.extend(v)

    return lambda: copy.copy(c), put


def _cell_item(c: Any) -> _Item:
    def put(v: Any) -> None:
        c.cell_contents = v

    return lambda: c.cell_contents, put


def _class_item(cls: type) -> _Item:
    """Your class's own data attributes (not its methods, properties, dunders or ABCMeta's registry)."""

    def read() -> dict[str, Any]:
        return {
            k: v for k, v in vars(cls).items()
            if not k.startswith(("__", "_abc_")) and not inspect.isroutine(v)
            and not isinstance(v, (property, classmethod, staticmethod, type))
        }  # fmt: skip

    def put(d: dict[str, Any]) -> None:
        for k in read().keys() - d.keys():
            delattr(cls, k)
        for k, v in d.items():
            setattr(cls, k, v)

    return read, put
