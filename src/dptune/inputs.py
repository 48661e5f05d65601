"""A model's input batch: a tensor, a tuple (``model(*x)``) or a dict of tensors (``model(**x)``: ``input_ids=...``);
every tensor's first dimension is the example index (a Poisson batch, a chunk, one example: a slice of each)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree

from dptune.errors import ConfigError

Inputs = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]


def is_structured(x: Any) -> bool:
    """A tuple, list or dict of tensors (several inputs); nested Python lists of numbers are not."""
    if isinstance(x, Mapping):
        return len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x.values())
    return isinstance(x, tuple | list) and len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x)


def as_inputs(x: Any, what: str = "x") -> Inputs:
    """A tensor from array-like numbers, or a checked tuple/dict of tensors; else one clear error."""
    if is_structured(x) or isinstance(x, Mapping):  # a dict of non-tensors: check's error names the fix
        return check(x, what)
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(
            f"{what} must be a tensor (or array-like numbers), a tuple of tensors (positional "
            f"inputs) or a dict of tensors (keyword inputs), got {type(x).__name__}."
        ) from None


def check(x: Any, what: str = "x") -> Inputs:
    """``x`` as a tensor, a tuple or a dict of tensors with one batch size; else one clear error."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, list):
        x = tuple(x)
    if isinstance(x, tuple | Mapping) and len(x) > 0:
        leaves = list(x.values()) if isinstance(x, Mapping) else list(x)
        if all(isinstance(t, torch.Tensor) for t in leaves):
            sizes = {int(t.shape[0]) if t.ndim else -1 for t in leaves}
            if len(sizes) == 1 and -1 not in sizes:
                return dict(x) if isinstance(x, Mapping) else x
            raise ConfigError(
                f"every tensor of {what} needs the same first (batch) dimension, got "
                f"{sorted(sizes)}. Fix: stack each input along dimension 0, one row per example."
            )
    raise ConfigError(
        f"{what} must be a tensor, a tuple of tensors (positional inputs) or a dict of tensors "
        f"(keyword inputs), got {type(x).__name__}."
    )


def leaves(x: Inputs) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return list(x.values()) if isinstance(x, Mapping) else list(x)


def batch_len(x: Inputs) -> int:
    return int(leaves(x)[0].shape[0])


def device_of(x: Inputs) -> torch.device:
    return leaves(x)[0].device


def tmap(fn: Callable[[torch.Tensor], torch.Tensor], x: Inputs) -> Inputs:
    return fn(x) if torch.is_tensor(x) else _pytree.tree_map(lambda t: fn(t) if torch.is_tensor(t) else _leaf(t), x)


def _leaf(t: Any) -> None:  # a model output's cache (nothing batch-wide reaches a per-example loss): dropped
    if t is not None and not type(t).__name__.endswith("Cache"):  # a dataclass of yours: not None (found in review)
        raise ConfigError(f"the model's output holds a value of type {type(t).__name__}: a per-example loss takes "
                          "tensors. Fix: return a tensor, a tuple or dict of tensors, or a ModelOutput.")  # fmt: skip


def dummy(x: Inputs, n: int = 1, fill: float = 0) -> Inputs:
    """``n`` public rows shaped as ``x``'s, all ``fill``: what a forward of yours sees outside a private pass."""
    return tmap(lambda t: t.new_full((n, *t.shape[1:]), fill), x)


def indices_to(idx: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host index tensor on ``device``. To a GPU the copy goes through pinned memory and is
    queued, not waited for: a copy from pageable memory is a host sync, which empties the
    kernel queue once a step. PyTorch keeps the pinned block until the queued copy is done."""
    device = torch.device(device)
    if idx.device.type == "cpu" and device.type == "cuda":
        return idx.pin_memory().to(device, non_blocking=True)
    return idx.to(device)


def take(x: Inputs, idx: torch.Tensor) -> Inputs:
    """The examples ``idx`` (a 1-d index tensor on x's device)."""
    return tmap(lambda t: t.index_select(0, idx), x)


def rows(x: Inputs, start: int, stop: int) -> Inputs:
    return tmap(lambda t: t[start:stop], x)


def to(x: Inputs, device: torch.device) -> Inputs:
    return tmap(lambda t: t.to(device), x)


def cat(parts: list[Inputs]) -> Inputs:
    """Concatenate batches along the example dimension."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)  # type: ignore[arg-type]
    if isinstance(first, Mapping):
        return {k: torch.cat([p[k] for p in parts]) for k in first}  # type: ignore[index]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(first)))  # type: ignore[index]


def args_kwargs(x: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's call arguments for the batch ``x`` (module docstring)."""
    if isinstance(x, torch.Tensor):
        return (x,), {}
    if isinstance(x, Mapping):
        return (), dict(x)
    return tuple(x), {}


def call(fn: Callable[..., Any], x: Inputs) -> Any:
    args, kwargs = args_kwargs(x)
    return fn(*args, **kwargs)
