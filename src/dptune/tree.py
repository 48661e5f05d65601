"""Tiny helpers over dicts of tensors (a model's parameters, gradients, optimiser buffers)."""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensors = dict[str, torch.Tensor]


def tmap(fn: Callable[..., torch.Tensor], *trees: Tensors) -> Tensors:
    return {k: fn(*(t[k] for t in trees)) for k in trees[0]}


def zeros_like(tree: Tensors) -> Tensors:
    return {k: torch.zeros_like(v) for k, v in tree.items()}


def dot(a: Tensors, b: Tensors) -> float:
    # Native-precision dot products per tensor (no float64 copies: this sits on OSO's hot path).
    return float(sum(torch.dot(a[k].reshape(-1), b[k].reshape(-1)) for k in a))


def norm(a: Tensors) -> float:
    return dot(a, a) ** 0.5


def scale(a: Tensors, s: float) -> Tensors:
    return {k: v * s for k, v in a.items()}


def axpy(alpha: float, x: Tensors, y: Tensors) -> Tensors:
    """alpha·x + y."""
    return {k: y[k] + alpha * x[k] for k in y}


def is_finite(a: Tensors) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in a.values())


def clone(a: Tensors) -> Tensors:
    return {k: v.detach().clone() for k, v in a.items()}
