"""Norms as upper bounds of what is released, and the float arithmetic that keeps them so: γ_n, row norms with
their slack (``sq_rows_upper``, ``rank_one_parts``), per-sample norms (``upper_norms``), float64 sums across examples
(``wide_sum``, ``wide_mm``), the kernels a release assumes (``ieee_matmul``, ``same_kernel``), Gram-form norms over
tokens with their slack (``gram_parts``, ``token_norms``). Shared by ``persample`` and ``ghost``; derivation:
docs/privacy.md, "Norm bounds"."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch


def flat_rows(g: torch.Tensor) -> torch.Tensor:
    """[B, *shape] → [B, prod(shape)] (also for B = 0, where reshape(0, -1) is ambiguous)."""
    return g.reshape(g.shape[0], math.prod(g.shape[1:]))


# ----------------------------------------------------------------------------- norms as upper bounds
# Every norm below is an upper bound on what is released for the example (else clipping would not bound it by C), proved
# in the standard model of floating-point arithmetic: a sum of n products in ANY order is within γ_n·Σ|terms| of its
# value, γ_n = n·u/(1 − n·u); derivations and numbers: docs/privacy.md, item 1. Rows longer than NORM_BLOCK are summed
# in blocks, the block sums in float64; ``upper_norms`` applies one slack to all, γ_{2056} (float32: ≈ 6.1e-5).
NORM_BLOCK = 1024
# Gram norms (case (c)) are formed in float32; an example whose rounding slack² exceeds this
# fraction of its squared norm (cancellation across positions) is formed again in float64.
GRAM_TIGHT = 1e-3
# Added (squared) to every squared norm: covers the absolute underflow error of float32
# products (≤ n·2⁻¹⁴⁹ ≈ 1e-36 for n ≤ 2³¹ terms) and changes no norm above ~1e-12.
NORM_FLOOR = 1e-16
_HALF = (torch.float16, torch.bfloat16)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps/2 of a floating dtype (2⁻²⁴ for float32, 2⁻⁵³ for float64)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: float, u: float) -> float:
    """γ_n = n·u/(1 − n·u) (inf when n·u ≥ 1: no bound)."""
    nu = n * u
    return nu / (1.0 - nu) if nu < 1.0 else math.inf


def sq_rows_upper(g: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(s, ρ) with Σ_j g_ij² ≤ s_i·(1 + ρ) for every row i of g ([B, *shape]), exactly.

    Assumes only that ``vector_norm`` returns the square root of a float sum of the products x·x (any order): then s ≥
    Σx²·(1 − γ_n)(1 − u)³ ≥ Σx²·(1 − γ_{n+3}) for a row of n ≤ NORM_BLOCK (the root, and s = root² rounded: three more
    roundings; ρ uses n + 4). For longer rows each block of m obeys that, and the float64 sum of the k + 1 block squares
    costs (1 − γ⁶⁴_{k+3}) more."""
    flat = flat_rows(g)
    if flat.dtype in _HALF:  # bf16/fp16 sums would need a slack of ~n·2⁻⁸: sum in float32
        flat = flat.float()
    B, n = flat.shape
    u = unit_roundoff(flat.dtype)
    if n <= NORM_BLOCK:
        return torch.linalg.vector_norm(flat, dim=1).square_(), 1.0 / (1.0 - gamma(n + 4, u)) - 1.0
    m, k = NORM_BLOCK, n // NORM_BLOCK
    s = torch.linalg.vector_norm(flat[:, : k * m].reshape(B, k, m), dim=2).double().square_().sum(1)
    if k * m < n:
        s += torch.linalg.vector_norm(flat[:, k * m :], dim=1).double().square_()
    u64 = unit_roundoff(torch.float64)
    return s, 1.0 / ((1.0 - gamma(m + 4, u)) * (1.0 - gamma(k + 4, u64))) - 1.0


def weights_dtype(dt: torch.dtype) -> torch.dtype:
    """The dtype of per-example weights for norms or losses in ``dt``: float32 for half precision, where
    rounding C/N_i to nearest could raise a weight by 2⁻¹¹ (fp16) and its example's release above C."""
    return torch.float32 if dt in _HALF else dt


@functools.cache
def _norm_factor(
    rho: float, terms: int, dtype: torch.dtype, model_dtype: torch.dtype, extra_rounding: bool = False
) -> float:
    """The smallest float K of ``dtype`` with K ≥ (1+γ'_2)·√((1+ρ)/(1−γ_{terms+1}))/(1−u)².

    (1 − γ_{terms+1}): the conversions and terms additions (τ² included) of ``upper_norms``'s sum of non-negative terms;
    (1 − u)²: its square root and the multiplication by K; (1 + γ'_2): the two roundings (w·b, then ·a) of the weighted
    sum's own scaling of a single example's terms, in the model's dtype (a released w_i·g_i has norm ≤
    |w_i|·(1+γ'_2)·‖g_i‖); γ'_3 with ``extra_rounding`` (w cast to the model's dtype first)."""
    u = unit_roundoff(dtype)
    g = gamma(terms + 1, u)
    if g >= 1:
        return math.inf
    k = (1.0 + gamma(3 if extra_rounding else 2, unit_roundoff(model_dtype))) * math.sqrt((1.0 + rho) / (1.0 - g))
    k /= (1.0 - u) ** 2
    if not math.isfinite(k):
        return k
    k *= 1.0 + 4 * unit_roundoff(torch.float64)  # this Python arithmetic's own roundings
    t = torch.tensor(k, dtype=torch.float64).to(dtype)
    if float(t) < k:
        t = torch.nextafter(t, torch.tensor(math.inf, dtype=dtype))
    return float(t)


def upper_norms(
    parts: list[tuple[torch.Tensor, float]],
    like: torch.Tensor,
    dtype: torch.dtype | None = None,
    release_dtypes: Iterable[torch.dtype] = (),
) -> torch.Tensor:
    """Per-sample norms N_i ≥ (1+γ_2)·(Σ_l s_li·(1+ρ_l) + NORM_FLOOR²)^½, shaped like ``like``, in ``dtype``
    (default: ``like``'s), from ``parts`` (s_l, ρ_l) with ‖part_l of g_i‖² ≤ s_li·(1+ρ_l) (``sq_rows_upper``, the
    ghost rules). ``release_dtypes``: the weighted sums' dtypes; the least precise one sets the rounding allowance
    (docs/privacy.md, item 1)."""
    out_dt = dtype if dtype is not None else like.dtype
    dt = torch.float32 if out_dt in _HALF else out_dt  # half-precision models: computed in float32
    sq: torch.Tensor | None = None
    # One slack for every path: the largest a float sum of squares here can need (rows of ≤ NORM_BLOCK, or two of them
    # multiplied: ‖a‖²‖b‖²), so the ghost, vmap and vectorised paths give the same norms up to float noise (~1e-7).
    rho = 1.0 / (1.0 - gamma(2 * NORM_BLOCK + 8, unit_roundoff(dt))) - 1.0
    groups: dict[tuple, list[torch.Tensor]] = {}
    for s, r in parts:  # summed per dtype and shape in one reduction each (any order: the same γ)
        groups.setdefault((s.dtype, s.shape), []).append(s)
        rho = max(rho, r)
    for g in groups.values():
        s = (torch.stack(g).sum(0) if len(g) > 1 else g[0]).to(dt)
        sq = s if sq is None else sq + s
    if sq is None:
        sq = torch.zeros(like.shape, dtype=dt, device=like.device)
    rel_dt = max(release_dtypes, key=unit_roundoff, default=out_dt)
    if unit_roundoff(rel_dt) <= unit_roundoff(out_dt):
        rel_dt = out_dt
    k = _norm_factor(rho, len(parts), dt, rel_dt, extra_rounding=rel_dt != out_dt)
    n = sq.add(NORM_FLOOR**2).sqrt_().mul_(k)
    if out_dt == dt:
        return n
    low = n.to(out_dt)  # rounded to nearest: step up where that went down
    return torch.where(low.to(dt) < n, torch.nextafter(low, torch.full_like(low, math.inf)), low)


@contextmanager
def ieee_matmul(device: torch.device) -> Iterator[None]:
    """Full-precision float32 products for the duration: matrix products without TF32 / bf16 operands and, on CUDA,
    cuDNN convolutions without TF32 (PyTorch's default there) and cuBLAS sums of half products without reduced-precision
    partial sums (they can overflow), which the bounds on a release assume. Determinism is not forced (only ghost case
    (e) needs it, and sets it itself): the model's own passes keep cuDNN's fastest kernels (docs/privacy.md, item 1).
    Also off: nn.MultiheadAttention's fast path, whose nested tensors one example's padding switches on for the whole
    batch (found in review: 2.8·C), and your ``torch.autocast``, which ran the bounds' float32 products in bfloat16
    (found in review: 1.70·C); an autocast inside your forward still applies there (``ghost_layers`` checks it)."""
    mha = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with _ieee_matmul(device), _exact_cuda(device), torch.autocast("cpu", enabled=False), _no_autocast(device):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(mha)


_ALLOW = "allow_fp16_accumulation allow_fp16_reduced_precision_reduction allow_bf16_reduced_precision_reduction"
_MM, _DNN = torch.backends.cuda.matmul, torch.backends.cudnn
# What torch has of cuBLAS's reduced-precision sums of half products, each with its split-K half (a bool set resets
# it); cuDNN's per-operator precisions.
_REDUCED = [(f, hasattr(_MM, f + "_split_k")) for f in _ALLOW.split() if hasattr(_MM, f)]
_DNN_OPS: list[Any] = [getattr(_DNN, op) for op in ("conv", "rnn")]


@contextmanager
def _exact_cuda(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    flags = {f: (getattr(_MM, f), getattr(_MM, f + "_split_k")) if k else getattr(_MM, f) for f, k in _REDUCED}
    old_prec = [op.fp32_precision for op in _DNN_OPS]  # as resolved: 'tf32' also where inherited
    # The legacy switch, as long as nobody used torch ≥ 2.9's per-operator one: once the two APIs
    # are mixed, PyTorch raises wherever the legacy flag is read (some of its own ops read it).
    try:
        old_tf32: bool | None = _DNN.allow_tf32
    except RuntimeError:  # the user set per-operator precisions: keep to that API
        old_tf32 = None
    if old_tf32 is not None:
        _DNN.allow_tf32 = False
    for op in _DNN_OPS:  # explicitly: the legacy switch leaves 'none', which inherits backends.(cudnn.)fp32_precision
        op.fp32_precision = "ieee"
    for f in flags:
        setattr(_MM, f, False)
    try:
        yield
    finally:
        for f, v in flags.items():
            setattr(_MM, f, v)
        if old_tf32 is not None:
            _DNN.allow_tf32 = old_tf32
        for op, prec in zip(_DNN_OPS, old_prec, strict=True):
            if op.fp32_precision != prec:  # not restored by the legacy switch (or mixed APIs)
                op.fp32_precision = prec


@contextmanager
def _overriding(obj: Any, **values: Any) -> Iterator[None]:
    """``obj``'s attributes set to ``values`` for the duration, then back to what they were."""
    old = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def _no_autocast(device: torch.device) -> AbstractContextManager[None]:
    return torch.autocast(device.type, enabled=False) if device.type in ("cuda", "xpu", "mps") else nullcontext()


def _ieee_matmul(device: torch.device) -> AbstractContextManager[None]:
    be: Any = torch.backends.cuda.matmul if device.type == "cuda" else getattr(torch.backends.mkldnn, "matmul", None)
    old = getattr(be, "fp32_precision", "ieee")  # as resolved (an inherited 'tf32' too); torch ≥ 2.9
    return nullcontext() if old in ("none", "ieee") else _overriding(be, fp32_precision="ieee")


def same_kernel(device: torch.device) -> AbstractContextManager[None]:
    """Deterministic cuDNN kernels for the duration: case (e) recomputes per-sample gradients
    that must equal, bit for bit, those whose norms were taken (CPU kernels are deterministic; every
    private computation also runs under ``ieee_matmul``, which turns cuDNN's TF32 off)."""
    if device.type != "cuda":
        return nullcontext()
    return _overriding(torch.backends.cudnn, deterministic=True, benchmark=False)


# Rows per float64 block of ``wide_sum``/``wide_mm`` at most (on CUDA fewer for long rows: ≤ WIDE_FLOATS floats
# a block). On the host the float64 copies are made and used in column pieces of ≤ HOST_FLOATS floats, in
# cache: converting a whole block first cost 3-8× (a fresh buffer written, then read again from memory).
WIDE_BLOCK = 2048
WIDE_FLOATS = 1 << 24
HOST_FLOATS = 1 << 18


def wide_sum(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i g_i over the rows of g [B, n], in float64 ([n]).

    Each example's term w_i·g_ij is formed from that example alone (exact for float32 and half-precision operands: a
    product of two 24-bit significands fits in 53 bits), and the terms are summed across examples in float64, by blocks
    of m ≤ WIDE_BLOCK rows: the error is ≤ γ⁶⁴_{m+⌈B/m⌉}·Σ_i |w_i g_i| entrywise, whatever the order (docs/privacy.md,
    item 1b), instead of γ³²_B for a float32 product."""
    return wide_mm(w.double().unsqueeze(1), g).squeeze(0)


def wide_mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """xᵀ y over the rows of x [B, p] (float64) and y [B, d], in float64 by blocks of m ≤ WIDE_BLOCK rows
    (the bound of ``wide_sum``); on the host by column pieces of y (the same sums, in cache)."""
    B, d = y.shape
    wide: Callable[[torch.Tensor], torch.Tensor] = _host_double
    if y.is_cuda or torch._C._functorch.is_functorch_wrapped_tensor(y):
        m, c, wide = max(1, min(WIDE_BLOCK, WIDE_FLOATS // max(1, d))), d, torch.Tensor.double
    else:
        m = max(1, min(B, WIDE_BLOCK))
        c = max(1, HOST_FLOATS // m)
    out = x.new_empty(x.shape[1], d)
    for j in range(0, d, c):
        piece = x[:m].t() @ wide(y[:m, j : j + c])
        for i in range(m, B, m):
            piece += x[i : i + m].t() @ wide(y[i : i + m, j : j + c])
        if c >= d:  # one piece (the usual case for short rows)
            return piece
        out[:, j : j + c] = piece
    return out


def wide_bmm(x: torch.Tensor, y: torch.Tensor, batched: bool) -> torch.Tensor:
    """``wide_mm`` of K stacked pairs, x [K, B, p] (float64) and y [K, B, d] → [K, p, d]: ``batched`` (CUDA), one
    batched product a block of m rows (≤ WIDE_BLOCK, ≤ WIDE_FLOATS floats: the same bound); else per pair."""
    if not batched:
        return torch.stack([wide_mm(xk, yk) for xk, yk in zip(x, y, strict=True)])
    K, B, d = y.shape
    m = max(1, min(WIDE_BLOCK, WIDE_FLOATS // max(1, K * d)))
    out = x[:, :m].transpose(1, 2) @ y[:, :m].double()
    for i in range(m, B, m):
        out += x[:, i : i + m].transpose(1, 2) @ y[:, i : i + m].double()
    return out


_SCRATCH = threading.local()


def _host_double(t: torch.Tensor) -> torch.Tensor:
    """t in float64 in one reused host buffer per thread, to be used at once (≤ HOST_FLOATS floats): a fresh
    buffer page-faults on its first writes, which cost 10-60× the conversion itself."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < t.numel() or buf.is_inference():  # made in inference mode: read-only outside
        buf = _SCRATCH.buf = torch.empty(max(t.numel(), HOST_FLOATS), dtype=torch.float64)
    return buf[: t.numel()].view(t.shape).copy_(t.detach())


def rank_one_parts(a: torch.Tensor, b: torch.Tensor, bias: bool) -> list[tuple[torch.Tensor, float]]:
    """Case (b), Linear with T = 1: ‖b aᵀ‖² = ‖a‖²‖b‖² (and ‖b‖² for the bias) over the last
    dimension of a [..., d], b [..., p], as (s, ρ) parts (also [K, B, ·] for ``vectorized``).

    s = fl(fl(n̂_a·n̂_b)²), n̂ = ``vector_norm`` (≥ ‖·‖·(1−γ_n)^½(1−u) less its underflow: squares below the smallest
    subnormal η are lost, an absolute ‖·‖² error ≤ n·η that ‖b‖ ~ 10¹⁹ would scale past any floor: found in review) plus
    √(n·η), ≥ ‖a‖²‖b‖²·(1 − γ_{d+5})(1 − γ_{p+5}); rows longer than NORM_BLOCK go through ``sq_rows_upper`` (blocked
    sums), their squares plus n·η in float64."""
    d, p = a.shape[-1], b.shape[-1]
    if a.dtype in _HALF:  # half precision: sum in float32
        a, b = a.float(), b.float()
    u, tiny = unit_roundoff(a.dtype), torch.finfo(a.dtype).tiny * torch.finfo(a.dtype).eps
    if d > NORM_BLOCK or p > NORM_BLOCK:
        (sa, ra), (sb, rb) = sq_rows_upper(a.reshape(-1, d)), sq_rows_upper(b.reshape(-1, p))
        sa, sb = sa.double().add_(d * tiny), sb.double().add_(p * tiny)
        s = (sa * sb).reshape(a.shape[:-1])
        parts = [(s, (1.0 + ra) * (1.0 + rb) / (1.0 - gamma(3, unit_roundoff(torch.float64))) - 1.0)]
        return parts + [(sb.reshape(b.shape[:-1]), rb)] if bias else parts
    nb = torch.linalg.vector_norm(b, dim=-1).add_(math.sqrt(p * tiny))
    s = (torch.linalg.vector_norm(a, dim=-1).add_(math.sqrt(d * tiny)) * nb).square_()
    parts = [(s, 1.0 / ((1.0 - gamma(d + 5, u)) * (1.0 - gamma(p + 5, u))) - 1.0)]
    return parts + [(nb.square_(), 1.0 / (1.0 - gamma(p + 5, u)) - 1.0)] if bias else parts


def gram_parts(A: torch.Tensor, Bm: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(Ŝ, slack², M̂), float64 [c], from Gram matrices in ``dt`` (u its unit roundoff).

    Ŝ = Σ_t fl(Σ_s X̂_ts Ŷ_ts) with X̂ = fl(A Aᵀ), Ŷ = fl(Bm Bmᵀ), the sum over t in float64: |Ŝ − ‖G‖²| ≤ γ_{d+p+2T}·M²
    (docs/privacy.md, item 1), so slack² = γ_{d+p+2T+2}·M̂² plus the absolute underflow error η·(d·(Σ_t‖B_t‖)² +
    p·(Σ_t‖A_t‖)² + 2T²), η the smallest subnormal. M̂ = Σ_t n̂(A_t)·n̂(B_t) ≥ M = Σ_t ‖A_t‖‖B_t‖, n̂ = ``vector_norm``
    plus √(n·η), scaled by 1/(1 − γ_{d+p+T+8}) (its own roundings and underflow). An overflow makes the norm inf or NaN,
    never a finite under-estimate."""
    T, d, p = A.shape[1], A.shape[2], Bm.shape[2]
    A, Bm = A.to(dt), Bm.to(dt)
    S = torch.bmm(A, A.transpose(1, 2)).mul_(torch.bmm(Bm, Bm.transpose(1, 2))).sum(2).double().sum(1)
    u, tiny = unit_roundoff(dt), torch.finfo(dt).tiny * torch.finfo(dt).eps
    na, nb, c2 = token_norms(A, Bm)
    m = (na * nb).sum(1).mul_(c2)
    under = (nb.sum(1).square_().mul_(d) + na.sum(1).square_().mul_(p)).mul_(c2).add_(2 * T * T)
    return S, m.square().mul_(gamma(d + p + 2 * T + 2, u)).add_(under.mul_(tiny * (1 + gamma(T + 8, u)))), m


def token_norms(A: torch.Tensor, Bm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(n̂(A_t), n̂(B_t), c²), float64 [c, T]: ``vector_norm``s plus √(n·η) (underflow, η the smallest
    subnormal) with c·n̂ ≥ ‖·‖ exactly, c = 1/(1 − γ_{d+p+T+8}) (their roundings, and T float64 ones)."""
    T, d, p = A.shape[1], A.shape[2], Bm.shape[2]
    u, tiny = unit_roundoff(A.dtype), torch.finfo(A.dtype).tiny * torch.finfo(A.dtype).eps
    na = torch.linalg.vector_norm(A, dim=2).double().add_(math.sqrt(d * tiny))
    nb = torch.linalg.vector_norm(Bm, dim=2).double().add_(math.sqrt(p * tiny))
    return na, nb, (1.0 / (1.0 - gamma(d + p + T + 8, u))) ** 2


Bound = tuple[tuple[torch.Tensor, float], torch.Tensor]


def gram_stacks(pairs: list[tuple[torch.Tensor, torch.Tensor]], budget: int) -> list[Bound]:
    """``gram_bound`` of several layers' (a [B, T, d], b [B, T, p]) at once, one Bound each: rows of layers of
    one shape stacked (≤ ``budget`` bytes of temporaries a stack), each one example of one layer."""
    stacks: dict[tuple, list[list[tuple[int, int, int]]]] = {}  # shape → stacks of (pair, lo, hi)
    for k, (a, b) in enumerate(pairs):
        (B, T, d), p = a.shape, b.shape[2]
        rows = max(1, budget // max(1, 8 * (T * (d + p) + 2 * T * T)))
        sts = stacks.setdefault((T, d, p, a.dtype, a.device), [[]])
        for lo in range(0, max(B, 1), rows):
            if sts[-1] and sum(j - i for _, i, j in sts[-1]) + min(rows, B - lo) > rows:
                sts.append([])
            sts[-1].append((k, lo, min(lo + rows, B)))
    flat = [st for sts in stacks.values() for st in sts]
    if not flat:  # no pairs
        return []
    made = [lambda st=st: tuple(_cat([pairs[k][n][i:j] for k, i, j in st]) for n in (0, 1)) for st in flat]
    u = max(unit_roundoff(a.dtype) for a, _ in pairs)  # the least precise release (mixed dtypes: for all)
    (s, rho), e = gram_bound(made, u)  # type: ignore[arg-type]
    at: list[list[slice]] = [[] for _ in pairs]
    o = 0
    for k, i, j in (piece for st in flat for piece in st):
        at[k].append(slice(o, o + j - i))
        o += j - i
    return [((_cat([s[x] for x in r]), rho), _cat([e[x] for x in r])) for r in at]


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def fast_fp64(device: torch.device) -> bool:
    """Does ``device`` multiply float64 as fast as float32 (data-centre GPUs: A100, H100, H200, B200)? Gram
    forms are then formed in float64 directly: no float32 pass, no host read for cancellation, no recompute."""
    return device.type == "cuda" and _fp64_rate_is_fp32s(
        torch.cuda.current_device() if device.index is None else device.index
    )


@functools.cache
def _fp64_rate_is_fp32s(index: int) -> bool:
    return torch.cuda.get_device_capability(index) in ((8, 0), (9, 0), (10, 0))


def gram_bound(chunks: Sequence[Callable[[], tuple[torch.Tensor, torch.Tensor]]], u_release: float) -> Bound:
    """Case (c) of ``ghost``'s docstring from chunks (A [c, T, d], Bm [c, T, p], G_i = Bm_iᵀ A_i; any shapes; made by
    calls): ((s, ρ), e), e = γ_{T+1}·M̂ (``u_release``: the release's dtype), s = (√(max(Ŝ, 0) + slack²) + e)²
    (``gram_parts``) in float32 (float64 where ``fast_fp64``); examples with slack² > GRAM_TIGHT·Ŝ (cancellation) again
    in float64, within ~GRAM_TIGHT/2 of exact (the oracle's vmap comparison allows 1e-3), found by ONE host read for all
    chunks. ρ (``assemble``, the largest T)."""
    parts, loose, T = [], [], 1
    for make in chunks:
        A, Bm = make()
        fast = fast_fp64(A.device)
        s, q, m = gram_parts(A, Bm, torch.float64 if fast else torch.promote_types(A.dtype, torch.float32))
        parts.append([s, q, m.mul_(gamma(A.shape[1] + 1, u_release))])
        if not fast:
            loose.append((q > GRAM_TIGHT * s) & (A.dtype != torch.float64))
        T = max(T, A.shape[1])
    flags = torch.cat(loose).tolist() if loose else []  # the one host read (none in float64)
    o = 0
    for make, got in zip(chunks, parts, strict=True):
        rows = [i for i, f in enumerate(flags[o : o + got[0].shape[0]]) if f]
        o += got[0].shape[0]
        if rows:
            A, Bm = make()
            ix = torch.tensor(rows, device=A.device)
            s, q, m = gram_parts(A[ix], Bm[ix], torch.float64)
            got[0][ix], got[1][ix], got[2][ix] = s, q, m.mul_(gamma(A.shape[1] + 1, u_release))
    S, Q, E = (torch.cat(x) for x in zip(*parts, strict=True)) if len(parts) != 1 else parts[0]
    return assemble(S, Q, E, T), E


def assemble(S: torch.Tensor, slack2: torch.Tensor, e: torch.Tensor, T: int) -> tuple[torch.Tensor, float]:
    """(s, ρ) with s = (√(max(Ŝ, 0) + slack²) + e)², all float64 [B]. ρ = γ⁶⁴_{T+32} covers the
    float64 roundings of this assembly and of the ≤ T-term sums inside slack² and e.
    NaN stays NaN (``clamp_min`` propagates it): a non-finite example keeps a non-finite norm."""
    return S.clamp_min_(0.0).add_(slack2).sqrt_().add_(e).square_(), gamma(T + 32, unit_roundoff(torch.float64))
