"""Tiny helpers over dicts of tensors. Arithmetic returns NEW tensors (strategies may keep the inputs): one
kernel on one buffer where the tensors are a ``Flat`` (or can be copied into one: one dtype, one device),
else one ``torch._foreach_*`` call. ``scale``, ``axpy``, ``lincomb`` round exactly like the per-tensor
expressions; ``add_scaled`` and ``ema`` are fused (one rounding, last bits differ)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]
Layout = tuple[tuple[str, torch.Size], ...]


class Flat(dict[str, torch.Tensor]):
    """Views of one 1-D buffer ``base``, back to back in key order: an elementwise update is one kernel and one
    allocation on ``base``, where a foreach allocates every output (a transformer's ~100 tensors: ~4 ms of host time a
    step on a GPU). Replacing or removing a key drops ``base`` (a plain dict then); pickled as a plain dict."""

    def __init__(self, base: torch.Tensor, layout: Layout):
        if torch._C._functorch.is_functorch_wrapped_tensor(base):  # vmap/grad: views by split
            views = base.split([s.numel() for _, s in layout])
            super().__init__((k, v.view(s)) for (k, s), v in zip(layout, views, strict=True))
        else:  # one as_strided a key (split + view: 2.3× the host time, ~0.35 ms for a transformer's 100)
            at = base.storage_offset()
            super().__init__((k, base.as_strided(s, st, at + off)) for k, s, st, off in _strides(layout))
        self.base: torch.Tensor | None = base
        self.layout = layout

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


@functools.lru_cache(maxsize=64)
def _strides(layout: Layout) -> tuple[tuple[str, torch.Size, tuple[int, ...], int], ...]:
    """(key, shape, contiguous strides, offset) of each view of a ``Flat`` buffer in ``layout``."""
    out, off = [], 0
    for k, s in layout:
        out.append((k, s, tuple(math.prod(s[i + 1 :]) for i in range(len(s))), off))
        off += s.numel()
    return tuple(out)


def _unflat(name: str) -> Callable[..., Any]:
    def method(self: Flat, *a: Any, **k: Any) -> Any:
        self.base = None
        return getattr(dict, name)(self, *a, **k)

    return method


# torch.func (vmap, grad, functional_call) sees a Flat as the dict it is.
torch.utils._pytree.register_pytree_node(
    Flat,
    lambda f: (list(f.values()), list(f)),
    lambda vs, ks: dict(zip(ks, vs, strict=True)),
    serialized_type_name="dptune.Flat",
)
for _name in ("__setitem__", "__delitem__", "__ior__", "update", "pop", "popitem", "setdefault", "clear"):
    setattr(Flat, _name, _unflat(_name))


def _flat_base(t: Tensors, layout: Layout, like: torch.Tensor) -> torch.Tensor | None:
    """``t`` as one buffer in ``layout``'s order: its own ``base``, a copy (one ``cat``), or None (mixed
    dtypes or devices)."""
    if isinstance(t, Flat) and t.base is not None and (t.layout is layout or t.layout == layout):
        return t.base
    vs = [t[k] for k, _ in layout]
    if any(v.dtype != like.dtype or v.device != like.device for v in vs):
        return None
    return torch.cat([v.reshape(-1) for v in vs])


def flat_map(fn: Callable[..., Any], *trees: Tensors) -> Any:
    """{k: fn(*(t[k] for t in trees))} in the first tree's key order (a tuple of dicts when fn returns a
    tuple), computed ONCE on flat buffers when all tensors share a dtype and a device (``Flat`` results)."""
    first = trees[0]
    if isinstance(first, Flat) and first.base is not None:
        layout, like = first.layout, first.base
    else:
        layout = layout_of(first)
        like = next(iter(first.values()), None)  # type: ignore[assignment]
    bases = [_flat_base(t, layout, like) for t in trees] if like is not None else [None]
    if all(b is not None for b in bases):
        got = fn(*bases)
        return tuple(Flat(g, layout) for g in got) if isinstance(got, tuple) else Flat(got, layout)
    per = {k: fn(*(t[k] for t in trees)) for k in first}
    if per and isinstance(next(iter(per.values())), tuple):
        return tuple({k: v[i] for k, v in per.items()} for i in range(len(next(iter(per.values())))))
    return per


class Accumulated(dict[str, torch.Tensor]):
    """A weighted sum over examples in the parameters' dtypes, with ``wide`` the float64 accumulators: the
    gateway adds the noise to ``wide`` and rounds only then (docs/privacy.md, item 1b)."""

    def __init__(self, wide: Tensors, dtypes: dict[str, torch.dtype]):
        super().__init__(cast(wide, dtypes))
        self.wide = wide


def layout_of(tree: Tensors) -> Layout:
    return tuple((k, v.shape) for k, v in tree.items())


def packed(src: Tensors, dtype: torch.dtype, device: torch.device) -> Flat:
    """A copy of ``src`` in one new buffer of ``dtype`` on ``device``: one fused (converting) copy."""
    got = Flat(torch.empty(sum(v.numel() for v in src.values()), dtype=dtype, device=device), layout_of(src))
    torch._foreach_copy_(list(got.values()), list(src.values()))
    return got


def cast(src: Tensors, dtypes: dict[str, torch.dtype]) -> Tensors:
    """{k: src[k] in dtypes[k]}: the conversions to one dtype on one device as one fused copy into one
    buffer (views of it), not one kernel per tensor (a transformer has ~100)."""
    if isinstance(src, Flat) and src.base is not None and len(set(dtypes.values())) == 1:
        (dt,) = set(dtypes.values())  # one buffer to one dtype: one conversion, no per-tensor lists
        return src if src.base.dtype == dt else Flat(src.base.to(dt), src.layout)
    out = {k: v for k, v in src.items() if v.dtype == dtypes[k]}
    groups: dict[tuple, list[str]] = {}
    for k, v in src.items():
        if k not in out:
            groups.setdefault((dtypes[k], v.device), []).append(k)
    for (dt, dev), ks in groups.items():
        got = packed({k: src[k] for k in ks}, dt, dev)
        if len(ks) == len(src):
            return got
        out.update(got)
    return {k: out[k] for k in src}


def tmap(fn: Callable[..., torch.Tensor], *trees: Tensors) -> Tensors:
    return {k: fn(*(t[k] for t in trees)) for k in trees[0]}


def zeros_like(tree: Tensors) -> Tensors:
    vs = list(tree.values())
    if vs and all(v.dtype == vs[0].dtype and v.device == vs[0].device for v in vs):
        return Flat(torch.zeros(sum(v.numel() for v in vs), dtype=vs[0].dtype, device=vs[0].device), layout_of(tree))
    return {k: torch.zeros_like(v) for k, v in tree.items()}


def bases(a: object, b: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The buffers of two ``Flat``s of one layout (elementwise work on them is work on every tensor), or None."""
    if isinstance(a, Flat) and isinstance(b, Flat) and a.base is not None and b.base is not None:
        return (a.base, b.base) if a.layout == b.layout else None
    return None


def dot(a: Tensors, b: Tensors) -> torch.Tensor:
    """Σ_k ⟨a_k, b_k⟩ as a 0-d tensor on the device (no host read), in native precision (no float64
    copies: this sits on OSO's hot path)."""
    if (ab := bases(a, b)) is not None:
        return torch.dot(*ab)
    total: torch.Tensor = sum(torch.dot(a[k].reshape(-1), b[k].reshape(-1)) for k in a)  # type: ignore[assignment]
    return total


def scale(a: Tensors, s: float) -> Tensors:
    """{k: a[k] * s}."""
    return flat_map(lambda x: x * s, a) if a else {}


def axpy(alpha: float, x: Tensors, y: Tensors) -> Tensors:
    """alpha·x + y: {k: y[k] + alpha * x[k]} (keys in y's order); with alpha = −lr exactly θ − lr·g."""
    return flat_map(lambda y_, x_: y_ + x_ * alpha, y, x) if y else {}


def lincomb(alpha: float, x: Tensors, beta: float, y: Tensors) -> Tensors:
    """{k: alpha * x[k] + beta * y[k]} (keys in x's order), e.g. an EMA β·m + (1−β)·g."""
    return flat_map(lambda x_, y_: x_ * alpha + y_ * beta, x, y) if x else {}


def _fits(alpha: float, t: torch.Tensor) -> bool:
    """Can ``alpha`` be a fused ``alpha=`` for tensors like ``t``? (torch refuses out-of-range scalars.)"""
    return not t.is_floating_point() or abs(alpha) <= torch.finfo(t.dtype).max


def add_scaled(y: Tensors, alpha: float, x: Tensors) -> Tensors:
    """y + alpha·x, fused (keys in y's order): e.g. θ − (lr/L)·S in one pass over θ and S."""
    if not y:
        return {}
    if not _fits(alpha, next(iter(y.values()))):  # e.g. lr = 1e300: overflow to inf, as the unfused update would
        return axpy(alpha, x, y)
    return flat_map(lambda y_, x_: torch.add(y_, x_, alpha=alpha), y, x)


def ema(beta: float, m: Tensors, alpha: float, x: Tensors) -> Tensors:
    """beta·m + alpha·x (keys in m's order), the addition fused: two passes instead of three."""
    if not m:
        return {}
    if not _fits(alpha, next(iter(m.values()))):
        return flat_map(lambda m_, x_: m_ * beta + x_ * alpha, m, x)
    return flat_map(lambda m_, x_: torch.add(m_ * beta, x_, alpha=alpha), m, x)


def finite_flag(a: Tensors) -> torch.Tensor:
    """A 0-dim bool tensor, on the tensors' device: all entries finite? One host sync when read."""
    if isinstance(a, Flat) and a.base is not None:
        return torch.isfinite(a.base).all()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for v in a.values():
        by_device.setdefault(v.device, []).append(torch.isfinite(v).all())
    if not by_device:
        return torch.ones((), dtype=torch.bool)
    flags = [torch.stack(f).all() for f in by_device.values()]
    # tensors spread over devices (rare): one sync per extra device
    return functools.reduce(lambda out, f: out & f.to(out.device), flags)


def sup_norm(a: Tensors) -> torch.Tensor:
    """max |entry| over all tensors, 0-dim on their device, NaN if any entry is NaN: finite iff every entry
    is. One pass for the loop's divergence check (``finite_flag``'s isfinite is four kernels and a reduction)."""
    if isinstance(a, Flat) and a.base is not None:
        return torch.linalg.vector_norm(a.base, math.inf)
    per = [torch.linalg.vector_norm(v, math.inf).double() for v in a.values() if v.numel()]
    if not per:
        return torch.zeros((), dtype=torch.float64)
    dev = per[0].device
    return torch.stack([n.to(dev) for n in per]).amax()


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
    if isinstance(a, Flat) and a.base is not None:
        return Flat(a.base.detach().clone(), a.layout)
    return {k: v.detach().clone() for k, v in a.items()}
