"""Tiny helpers over dicts of tensors. Arithmetic runs one ``torch._foreach_*`` call over all tensors and
returns NEW tensors (strategies may keep the inputs). ``scale``, ``axpy``, ``lincomb`` round exactly like
the per-tensor expressions; ``add_scaled`` and ``ema`` are fused (one rounding, last bits differ)."""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensors = dict[str, torch.Tensor]


class Accumulated(dict[str, torch.Tensor]):
    """A weighted sum over examples in the parameters' dtypes, with ``wide`` the float64 accumulators: the
    gateway adds the noise to ``wide`` and rounds only then (docs/privacy.md, item 1b)."""

    def __init__(self, wide: Tensors, dtypes: dict[str, torch.dtype]):
        super().__init__({k: v if v.dtype == dtypes[k] else v.to(dtypes[k]) for k, v in wide.items()})
        self.wide = wide


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
    """{k: a[k] * s}."""
    if not a:
        return {}
    return dict(zip(a, torch._foreach_mul(list(a.values()), s), strict=True))


def axpy(alpha: float, x: Tensors, y: Tensors) -> Tensors:
    """alpha·x + y: {k: y[k] + alpha * x[k]} (keys in y's order); with alpha = −lr exactly θ − lr·g."""
    if not y:
        return {}
    ys = list(y.values())
    return dict(zip(y, torch._foreach_add(ys, torch._foreach_mul([x[k] for k in y], alpha)), strict=True))


def lincomb(alpha: float, x: Tensors, beta: float, y: Tensors) -> Tensors:
    """{k: alpha * x[k] + beta * y[k]} (keys in x's order), e.g. an EMA β·m + (1−β)·g."""
    if not x:
        return {}
    xs = torch._foreach_mul(list(x.values()), alpha)
    ys = torch._foreach_mul([y[k] for k in x], beta)
    return dict(zip(x, torch._foreach_add(xs, ys), strict=True))


def _fits(alpha: float, t: torch.Tensor) -> bool:
    """Can ``alpha`` be a fused ``alpha=`` for tensors like ``t``? (torch refuses out-of-range scalars.)"""
    return not t.is_floating_point() or abs(alpha) <= torch.finfo(t.dtype).max


def add_scaled(y: Tensors, alpha: float, x: Tensors) -> Tensors:
    """y + alpha·x, fused (keys in y's order): e.g. θ − (lr/L)·S in one pass over θ and S."""
    if not y:
        return {}
    ys = list(y.values())
    if not _fits(alpha, ys[0]):  # e.g. lr = 1e300: overflow to inf, as the unfused update would
        return axpy(alpha, x, y)
    return dict(zip(y, torch._foreach_add(ys, [x[k] for k in y], alpha=alpha), strict=True))


def ema(beta: float, m: Tensors, alpha: float, x: Tensors) -> Tensors:
    """beta·m + alpha·x (keys in m's order), the addition fused: two passes instead of three."""
    if not m:
        return {}
    scaled = torch._foreach_mul(list(m.values()), beta)
    if not _fits(alpha, scaled[0]):
        return dict(zip(m, torch._foreach_add(scaled, torch._foreach_mul([x[k] for k in m], alpha)), strict=True))
    return dict(zip(m, torch._foreach_add(scaled, [x[k] for k in m], alpha=alpha), strict=True))


def finite_flag(a: Tensors) -> torch.Tensor:
    """A 0-dim bool tensor, on the tensors' device: all entries finite? One host sync when read."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for v in a.values():
        by_device.setdefault(v.device, []).append(torch.isfinite(v).all())
    if not by_device:
        return torch.ones((), dtype=torch.bool)
    flags = [torch.stack(f).all() for f in by_device.values()]
    out = flags[0]
    for f in flags[1:]:  # tensors spread over devices (rare): one sync per extra device
        out = out & f.to(out.device)
    return out


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: do a and b (same shape, dtype, device) differ anywhere, NaN counting
    as equal to NaN (a missing target, a NaN buffer)? Computed where they are: one host read."""
    ne = a != b
    if a.is_floating_point() or a.is_complex():
        ne &= ~(a.isnan() & b.isnan())
    return ne.any()


def is_finite(a: Tensors) -> bool:
    return bool(finite_flag(a))


def clone(a: Tensors) -> Tensors:
    return {k: v.detach().clone() for k, v in a.items()}
