"""OSO's hypergradient sign rules (Galli et al., eqs. 13–21), shared by the online clipping
threshold (``privatizers.OSOClip``) and the online learning rate (``updates.OSORate``); reads of
the released statistics they use deferred to the loop's one host read a step (``later``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

import torch

from dptune.errors import ConfigError
from dptune.release.context import RunPlan
from dptune.tree import dot

# OSO's hyperparameter rates, horizon-aware (docs/strategies.md, "Horizon-aware rates"): under the sign rule C and ρ
# move by a factor of at most exp(ρ_c·T); Galli et al.'s ρ_c = ρ_r = 2.5e-3 at their T ≈ 1,172 steps (MNIST, 5 epochs)
# allow exp(2.93) ≈ 19×. A rate left unset gives every run that same range: ρ = OSO_LOG_RANGE / T.
OSO_LOG_RANGE = 2.5e-3 * 1172


def horizon_rate(rate: float | None, run: RunPlan) -> float:
    """An OSO rate: the given one, or OSO_LOG_RANGE / T (public: T is planned)."""
    return float(rate) if rate is not None else OSO_LOG_RANGE / max(run.steps, 1)


def check_rate(name: str, rate: float | None) -> None:
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0
    ):
        raise ConfigError(f"{name} must be a finite number ≥ 0 or None (horizon-aware), got {rate!r}.")


Rule = Literal["exp", "additive", "normalized"]
RULES = ("exp", "additive", "normalized")


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ConfigError(f"unknown OSO rule {rule!r}; choose exp, additive or normalized.")


def _sign(x: float) -> float:
    return 0.0 if x == 0 or math.isnan(x) else math.copysign(1.0, x)


def hypergradient_step(
    rule: Rule, value: float, rate: float, dir_dot: float, cos: float, scale: float, floor: float
) -> float:
    """One OSO hyperparameter update from a hypergradient's dot product (Galli eqs. 13–21):
    ``exp``: v·exp(rate·sign(dot)); ``normalized``: v(1 + rate·cos); ``additive``: v + rate·scale·dot.
    Each floored at ``floor`` so that v stays a valid C (or ρ): under ``exp`` C fell into float32's subnormals."""
    if rule == "exp":
        return max(value * math.exp(rate * _sign(dir_dot)), floor)
    if rule == "normalized":
        return max(value * (1.0 + rate * cos), floor)
    return max(value + rate * scale * dir_dot, floor)


# ----------------------------------------------------------------------------- deferred host reads
class Later:
    """A next step's value (C_{t+1}, ρ_{t+1}) or a history cell: ``then`` of released device scalars, once read."""

    __slots__ = ("tensor", "then", "value")
    value: float | None

    def __init__(self, tensor: torch.Tensor, then: Callable[[list[float]], float]):
        self.tensor, self.then, self.value = tensor, then, None


_PENDING: ContextVar[list[Later] | None] = ContextVar("dptune_pending_reads", default=None)


def later(values: torch.Tensor | float, then: Callable[[list[float]], float]) -> Any:
    """``then`` of ``values`` (released statistics: post-processing) once on the host. A read mid-step would
    stall a GPU's queue (the goal: ≤ 2 host reads a step), so while ``collecting`` (``RunLoop.step``) this
    is a ``Later`` that the loop's own read settles (``read_with``); otherwise it reads now. Same float."""
    pending = _PENDING.get()
    if pending is None or not isinstance(values, torch.Tensor):
        return then(values.reshape(-1).tolist() if isinstance(values, torch.Tensor) else [float(values)])
    pending.append(box := Later(values, then))
    return box


@contextmanager
def collecting() -> Iterator[list[Later]]:
    boxes: list[Later] = []
    token = _PENDING.set(boxes)
    try:
        yield boxes
    finally:
        _PENDING.reset(token)


def read_with(boxes: list[Later], first: list[torch.Tensor], dtype: torch.dtype) -> list[float]:
    """ONE host read of ``first`` (scalars on one device) and the boxes' tensors (each once): the boxes get
    their values; returns ``first``'s."""
    tensors = list({id(b.tensor): b.tensor for b in boxes}.values())
    dev = first[0].device
    flat = [t.reshape(-1) if t.device == dev else t.reshape(-1).to(dev) for t in (*first, *tensors)]
    got = torch.cat(flat).to(dtype).tolist()  # cat promotes (exactly) to the widest dtype: one conversion
    at, i = {}, len(first)
    for t in tensors:
        at[id(t)], i = got[i : i + t.numel()], i + t.numel()
    for box in boxes:
        box.value = box.then(at[id(box.tensor)])
    return got[: len(first)]


def rule_step(rule: Rule, value: float, rate: float, d: Any, pair: tuple[Any, Any], scale: float, floor: float) -> Any:
    """(``hypergradient_step`` from the device dot product ``d``, ``d`` for the history row) as ``later``
    values, one read for both; ``normalized`` also reads the norms of the ``pair`` whose cosine it takes."""
    if rule == "normalized":
        d = torch.stack([torch.as_tensor(d).double(), dot(pair[0], pair[0]).double(), dot(pair[1], pair[1]).double()])

    def then(v: list[float]) -> float:
        cos = v[0] / max(v[1] ** 0.5 * v[2] ** 0.5, 1e-30) if rule == "normalized" else 0.0
        return hypergradient_step(rule, value, rate, v[0], cos, scale, floor)

    return later(d, then), later(d, lambda v: v[0])


def settled(tree: Any) -> Any:
    """``tree`` (plain dicts of dicts; a ``Flat`` or other dict subclass holds tensors) with each ``Later``
    replaced by its value; the same object where there is none."""
    if isinstance(tree, Later):
        if tree.value is None:
            raise RuntimeError("a deferred value was used before the loop's read settled it (read_with)")
        return tree.value
    if type(tree) is not dict:
        return tree
    out = None
    for k, v in tree.items():
        got = settled(v) if isinstance(v, Later) or type(v) is dict else v
        if got is not v:
            out = dict(tree) if out is None else out
            out[k] = got
    return tree if out is None else out
