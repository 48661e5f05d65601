"""Ghost norms and book-keeping: per-sample gradient norms and weighted sums from each layer's input a_i and output
gradient b_i = ∂ℓ_i/∂out_i, without a [B, #params] tensor; per layer a rule (Linear/Conv1D, convolutions, Embedding,
norms: docs/performance.md §1; the capture: ``ghost_layers``). **Norms are upper bounds**: what ``weighted_sum``
releases for example i with weight w has norm ≤ |w|·N_i whatever the rounding (docs/privacy.md, items 1 and 1b). Another
trainable layer, or a layer called twice, falls back to vmap."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vjp, vmap

from dptune import inputs
from dptune.gradients.ghost_layers import (  # noqa: F401 - unsupported_reason: re-exported
    CONV,
    GhostFallback,
    KeptRule,
    LayerGrads,
    LayerRule,
    base_type,
    is_conv1d,
    merge_kept,
    norm_layer_rule,
    recording,
    unsupported_reason,
)
from dptune.gradients.norm_bounds import (  # noqa: F401 - rank_one_parts: re-exported (``vectorized``)
    assemble,
    gamma,
    gram_bound,
    gram_stacks,
    ieee_matmul,
    rank_one_parts,
    same_kernel,
    sq_rows_upper,
    token_norms,
    unit_roundoff,
    upper_norms,
    wide_mm,
    wide_sum,
)
from dptune.gradients.persample import LossFn, ParamSwap
from dptune.tree import Tensors

# Per-sample gradients of a layer are kept (B x #layer-params floats) when at most this big for KEEP_BATCH examples,
# proportionally more for larger batches (``keep_limit``: flat per example, as the activations a pass stores anyway; a
# fixed cap made a layer past it recompute its per-sample gradients for every sum, the collapse above batch 1,024 of
# issue 25); otherwise only their norms are computed (chunk by chunk) and weighted sums recompute them.
MATERIALIZE_LIMIT_BYTES = 64 * 2**20
KEEP_BATCH = 1024
UNFOLD_CHUNK_BYTES = 32 * 2**20  # bound on the transient im2col buffers (B_chunk x d x T floats)
# Bound on the patch copy of a kept convolution's GEMM path (``use_unfold_products``): B_chunk x T x d
# floats (a layer whose single example exceeds it takes the grouped kernel instead).
UNFOLD_PRODUCT_BYTES = 256 * 2**20
GRAM_STACK_BYTES = 256 * 2**20  # bound on the temporaries of Linear layers' Gram forms, stacked across layers


def keep_limit(batch: int) -> int:
    """The bytes of per-sample gradients a layer may keep for a batch of ``batch`` examples."""
    return MATERIALIZE_LIMIT_BYTES * max(batch, KEEP_BATCH) // KEEP_BATCH


def use_unfold_products(device: torch.device, transposed: bool, patch_bytes: int) -> bool:
    """Whether a kept convolution's per-sample gradients come from patches + batched GEMM (``unfolded_weight``)
    rather than the grouped convolution backward, which is faster on a CPU."""
    return device.type == "cuda" and not transposed and patch_bytes <= UNFOLD_PRODUCT_BYTES


def out_size(shape: Sequence[int], geom: Any) -> tuple[int, int]:
    """A convolution's output (H', W') for inputs [..., H, W]; ``geom``: kernel size, stride, padding, dilation."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geom
    return (shape[-2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (shape[-1] + 2 * pw - dw * (kw - 1) - 1) // sw + 1


def patches(h: torch.Tensor, geom: Any) -> torch.Tensor:
    """[K, c, C, H, W] → each row's patches [K, c·H'·W', C·k_h·k_w] (strided views of its padded input, copied)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geom
    U = F.pad(h, (pw, pw, ph, ph)).unfold(3, (kh - 1) * dh + 1, sh).unfold(4, (kw - 1) * dw + 1, sw)[..., ::dh, ::dw]
    return U.permute(0, 1, 3, 4, 2, 5, 6).reshape(h.shape[0], -1, h.shape[2] * kh * kw)


def unfolded_weight(a: torch.Tensor, b: torch.Tensor, geom: Any) -> torch.Tensor:
    """Per-sample weight gradients [c, C_out, C_in·k_h·k_w] of a convolution from a chunk's inputs a [c, C_in, H, W]
    and output gradients b [c, C_out, H', W'], as b_i U_i with U_i [H'·W', C_in·k_h·k_w] the input's ``patches``,
    copied once into GEMM layout (F.unfold would launch one kernel per example on CUDA)."""
    (ho, wo), c = out_size(a.shape, geom), a.shape[0]
    if (ho, wo) != tuple(b.shape[2:]):
        raise GhostFallback("unfold geometry does not match the layer's output")
    U = patches(a.unsqueeze(0), geom)
    return torch.bmm(b.reshape(c, b.shape[1], ho * wo), U.view(c, ho * wo, U.shape[2]))


class LinearRule(LayerRule):
    """a, b are kept as [B, d], [B, p] when T = 1 (no position axis: fewer view ops on the
    hot path of small dense models), as [B, T, d], [B, T, p] otherwise. ``transposed``: the weight
    is stored [d, p] (GPT-2's Conv1D): the same G_i, handed out transposed (``_layout``)."""

    def __init__(
        self, names: dict[str, str], a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, transposed: bool = False
    ):
        super().__init__(names)
        self.transposed = transposed
        B, d, p = a.shape[0], a.shape[-1], b.shape[-1]
        self.T = math.prod(a.shape[1:-1])
        if self.T == 1:  # the same strides as a.reshape(B, -1, d)[:, 0]
            self.a = a if a.dim() == 2 else a.reshape(B, d)
            self.b = b if b.dim() == 2 else b.reshape(B, p)
        else:
            self.a, self.b = a.reshape(B, -1, d), b.reshape(B, -1, p)
        self.shape = torch.Size((p, d))  # G_i's, in nn.Linear's layout
        self.G: torch.Tensor | None = None
        # Bu et al.'s mixed ghost clipping: per-example products (~T·p·d) where cheaper than the Gram
        # form (~T²·(p+d)): kept when they fit, else their norms chunk by chunk (``_direct``).
        self._direct = "weight" in names and self.T > 1 and p * d <= self.T * (p + d)
        if self._direct and B * p * d * a.element_size() <= keep_limit(B):
            self.G, self._direct = torch.bmm(self.b.transpose(1, 2), self.a), False
        self.gb = (self.b if self.T == 1 else self.b.sum(1)) if "bias" in names else None
        self._gram: tuple[tuple[torch.Tensor, float], torch.Tensor] | None = None

    def sq_norms(self) -> list[tuple[torch.Tensor, float]]:
        if "weight" not in self.names:
            return [sq_rows_upper(self.gb)] if self.gb is not None else []
        if self.T == 1:  # case (b); the bias part reuses ‖b‖
            return rank_one_parts(self.a, self.b, self.gb is not None)
        parts = [sq_rows_upper(self.G) if self.G is not None else self._ghost()[0]]
        return parts + [sq_rows_upper(self.gb)] if self.gb is not None else parts

    def _ghost(self) -> tuple[tuple[torch.Tensor, float], torch.Tensor]:
        """Case (c): the Gram bound and the book-keeping release's error, once."""
        if self._gram is None:
            self._gram = self._direct_bound() if self._direct else gram_stacks([(self.a, self.b)], GRAM_STACK_BYTES)[0]
        return self._gram

    def gram_pending(self) -> bool:  # case (c) still to form (``GhostGrads.norms`` forms them together)
        return self._gram is None and self.G is None and not self._direct and self.T > 1 and "weight" in self.names

    def _direct_bound(self) -> tuple[tuple[torch.Tensor, float], torch.Tensor]:
        """Ĝ_i = fl(b_iᵀ a_i) chunk by chunk, their norms only (too big to keep). The release forms
        b_iᵀ a_i again, maybe rounded otherwise; each is within γ_{T+1}·M of G_i (Frobenius, as
        case (c)), so the norm is ‖Ĝ_i‖ + 2γ_{T+1}·M̂ (docs/privacy.md, item 1)."""
        a, b = self.a, self.b
        c = max(1, MATERIALIZE_LIMIT_BYTES // (self.shape.numel() * a.element_size()))
        sqs = [sq_rows_upper(torch.bmm(b[i : i + c].transpose(1, 2), a[i : i + c])) for i in range(0, a.shape[0], c)]
        na, nb, c2 = token_norms(a, b)
        e = (na * nb).sum(1).mul_(c2 * gamma(self.T + 1, unit_roundoff(a.dtype)))
        s = torch.cat([sq.double().mul_(1.0 + rho) for sq, rho in sqs])
        return assemble(s, torch.zeros_like(s), 2 * e, self.T), e

    def release_err(self) -> torch.Tensor | None:
        if self.T == 1 or self.G is not None or "weight" not in self.names:
            return None
        return self._ghost()[1]

    def weighted(self, w: torch.Tensor, rows: torch.Tensor | None = None) -> Tensors:
        """In float64 across examples (``persample.wide_sum``), each example's term formed from it alone."""
        a, b = (self.a, self.b) if rows is None else (self.a[rows], self.b[rows])
        out: Tensors = {}
        if "weight" in self.names:
            if self.G is not None:
                gw = wide_sum(w, (self.G if rows is None else self.G[rows]).flatten(1)).reshape(self.shape)
            elif self.T == 1:  # (diag(w) b)ᵀ a in float64: w·b exact, then one rounding per product
                gw = wide_mm(b.double() * w.double().view(-1, 1), a)
            else:  # per-example G_i = b_iᵀ a_i (T products: case (c)'s release error), then across examples
                c = max(1, MATERIALIZE_LIMIT_BYTES // (self.shape.numel() * a.element_size()))
                parts = [
                    wide_sum(w[i : i + c], torch.bmm(b[i : i + c].transpose(1, 2), a[i : i + c]).flatten(1))
                    for i in range(0, max(a.shape[0], 1), c)
                ]
                gw = sum(parts[1:], parts[0]).reshape(self.shape)
            out[self.names["weight"]] = self._layout(gw)
        if self.gb is not None:
            out[self.names["bias"]] = wide_sum(w, self.gb if rows is None else self.gb[rows])
        return out

    def split_bias(self) -> KeptRule | None:
        """Over tokens the bias gradient is a kept [B, p] (``merge_kept`` takes it with the others);
        T = 1 keeps it here, where its norm comes with the weight's (case (b))."""
        if self.T == 1 or self.gb is None:
            return None
        kept, self.gb = KeptRule({"bias": self.names["bias"]}, {self.names["bias"]: self.gb}), None
        self.names = {k: v for k, v in self.names.items() if k != "bias"}
        return kept

    def _layout(self, G: torch.Tensor) -> torch.Tensor:
        """[..., p, d] → the weight's layout ([..., d, p] for Conv1D)."""
        return G.transpose(-1, -2).contiguous() if self.transposed else G

    def per_sample(self) -> Tensors:
        out: Tensors = {}
        if "weight" in self.names:
            if self.G is not None:
                G = self.G
            elif self.T == 1:
                G = torch.bmm(self.b.unsqueeze(2), self.a.unsqueeze(1))
            else:
                G = torch.bmm(self.b.transpose(1, 2), self.a)
            out[self.names["weight"]] = self._layout(G)
        if self.gb is not None:
            out[self.names["bias"]] = self.gb
        return out


class _Conv(LayerRule):
    """Conv1d/Conv2d/ConvTranspose2d via im2col. ``U`` is the unfolded operand (input for
    convolutions, output gradient for transposed ones), ``V`` the other, both [B, ·, T]."""

    def __init__(self, names: dict[str, str], mod: nn.Module, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor):
        super().__init__(names)
        self.mod, self.weight = mod, weight
        self.transposed = isinstance(mod, nn.ConvTranspose2d)
        self.geom = {k: getattr(mod, k) for k in ("kernel_size", "dilation", "padding", "stride")}
        if isinstance(mod, nn.Conv1d):  # as a 2-d convolution of height 1
            a, b = a.unsqueeze(2), b.unsqueeze(2)
            self.geom = {k: (0 if k == "padding" else 1, *v) for k, v in self.geom.items()}
        self.a, self.b = a, b
        B = a.shape[0]
        self.gb = b.sum((2, 3)) if "bias" in names else None
        self.G: torch.Tensor | None = None
        self._wpart: tuple[torch.Tensor, float] | None = None  # the weight's (s, ρ)
        self._err: torch.Tensor | None = None
        self._gram_rule = False
        if "weight" not in names:
            return
        big, small = (b, a) if self.transposed else (a, b)  # big is unfolded
        T, p = small.shape[2] * small.shape[3], small.shape[1]
        d = big.shape[1] * math.prod(self.geom["kernel_size"])
        keep = B * p * d * a.element_size() <= keep_limit(B)
        if T * T * (p + d) < T * p * d and not keep:
            # Ghost norm (case (c)): Gram matrices of the unfolded operands, T x T per
            # example; the weighted sums are the same product over unfolded chunks.
            self._gram_rule = True
            self._chunk = max(1, UNFOLD_CHUNK_BYTES // max(1, 8 * (d * T + p * T + 2 * T * T)))

            def chunk(i: int) -> tuple[torch.Tensor, torch.Tensor]:
                U = F.unfold(big[i : i + self._chunk], **self.geom)  # [c, d, T]
                if U.shape[2] != T:
                    raise GhostFallback("unfold geometry does not match the layer's output")
                V = small[i : i + self._chunk].reshape(U.shape[0], p, T)
                return U.transpose(1, 2), V.transpose(1, 2)

            chunks = [lambda i=i: chunk(i) for i in range(0, B, self._chunk)]
            self._wpart, self._err = gram_bound(chunks, unit_roundoff(a.dtype))
            return
        # Direct: per-sample weight gradients, kept (B ≥ 1 here: grads returns before the ghost
        # path for an empty batch) or recomputed chunk by chunk.
        self._chunk = B if keep else max(1, MATERIALIZE_LIMIT_BYTES // max(1, p * d * a.element_size()))
        sqs, Gs, rho = [], [], 0.0
        per_example_patches = d * T * a.element_size()
        per_sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._per_sample_weight
        step, kernel = self._chunk, same_kernel(a.device) if not keep else nullcontext()
        if use_unfold_products(a.device, self.transposed, per_example_patches):
            # On CUDA patches + one batched GEMM per chunk beat cuDNN's grouped convolution with B
            # groups 5-12x, and its deterministic kernel (case (e)) ~30x at B = 4096 (docs/
            # performance.md, "Convolutions on a GPU"). cuBLAS repeats a GEMM of the same shape bit
            # for bit on one GPU, so case (e)'s recomputation releases the Ĝ_i whose norms were taken.
            step = max(1, UNFOLD_PRODUCT_BYTES // per_example_patches)
            step = step if keep else min(step, self._chunk)
            geom = tuple(self.geom[k] for k in ("kernel_size", "stride", "padding", "dilation"))
            per_sample = partial(unfolded_weight, geom=geom)
        self._chunk, self._per_sample = step, per_sample
        # Not kept: weighted sums recompute the same chunks (case (e)), so they release exactly
        # the Ĝ_i whose norms were taken; cuDNN must then pick the same kernel both times.
        with kernel:
            for i in range(0, B, step):
                G = per_sample(a[i : i + step], b[i : i + step])
                sq, rho = sq_rows_upper(G)
                sqs.append(sq)
                if keep:
                    Gs.append(G)
        self._wpart = (torch.cat(sqs), rho)
        if keep:
            self.G = torch.cat(Gs)  # [B, *, *] in the layout of weight
            self.a = self.b = None  # type: ignore[assignment]  # not needed any more

    def _per_sample_weight(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[c, weight.shape[0], rest] per-sample weight gradients of a chunk of c examples: the native convolution
        backward with the examples as channel groups (Rochette et al. 2019): input [1, c·C_in, H, W], groups = c."""
        c = a.shape[0]
        w = self.weight if self.weight.dim() == 4 else self.weight.unsqueeze(2)
        wb = w.expand(c, *w.shape).reshape(c * w.shape[0], *w.shape[1:])
        opad = list(self.mod.output_padding) if self.transposed else [0, 0]
        g = torch.ops.aten.convolution_backward(
            *(b.reshape(1, c * b.shape[1], *b.shape[2:]), a.reshape(1, c * a.shape[1], *a.shape[2:]), wb, None),
            *(list(self.geom[k]) for k in ("stride", "padding", "dilation")),
            *(self.transposed, opad, c, [False, True, False]),
        )[1]
        return g.reshape(c, w.shape[0], -1)

    def sq_norms(self) -> list[tuple[torch.Tensor, float]]:
        parts = [self._wpart] if self._wpart is not None else []
        return parts + [sq_rows_upper(self.gb)] if self.gb is not None else parts

    def release_err(self) -> torch.Tensor | None:
        return self._err

    def weighted(self, w: torch.Tensor, rows: torch.Tensor | None = None) -> Tensors:
        out: Tensors = {}
        if "weight" in self.names:
            if self.G is not None:
                gw = wide_sum(w, (self.G if rows is None else self.G[rows]).flatten(1))
            elif self._gram_rule:
                gw = self._unfolded_sum(w, rows)
            else:
                gw = self._chunked_sum(w, rows)
            out[self.names["weight"]] = gw.reshape(self.weight.shape)
        if self.gb is not None:
            out[self.names["bias"]] = wide_sum(w, self.gb if rows is None else self.gb[rows])
        return out

    def _unfolded_sum(self, w: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Σ_i w_i V_i U_iᵀ: per example over unfolded chunks (one float sum of T products per entry, so case (c)'s
        release error holds whatever kernel the backend would pick), then across examples in float64 (``wide_sum``)."""
        a, b = (self.a, self.b) if rows is None else (self.a[rows], self.b[rows])
        big, small = (b, a) if self.transposed else (a, b)
        n = self.weight.numel()
        c = max(1, min(self._chunk, MATERIALIZE_LIMIT_BYTES // (n * a.element_size())))
        total = torch.zeros(n, dtype=torch.float64, device=a.device)
        for i in range(0, big.shape[0], c):
            U = F.unfold(big[i : i + c], **self.geom)  # [c, d, T]
            V = small[i : i + c].reshape(U.shape[0], small.shape[1], -1)
            total += wide_sum(w[i : i + c], torch.bmm(V, U.transpose(1, 2)).flatten(1))
        return total

    def _chunked_sum(self, w: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Σ_i w_i Ĝ_i with Ĝ recomputed chunk by chunk exactly as for the norms (case (e));
        ``rows`` ascending (``nonzero``)."""
        B, c = self.a.shape[0], self._chunk
        total: torch.Tensor | None = None
        with same_kernel(self.a.device):
            for i in range(0, B, c):
                j = min(i + c, B)
                if rows is None:
                    wi, sel = w[i:j], None
                else:
                    lo, hi = torch.searchsorted(rows, torch.tensor([i, j], device=rows.device)).tolist()
                    if lo == hi:
                        continue
                    wi, sel = w[lo:hi], rows[lo:hi] - i
                G = self._per_sample(self.a[i:j], self.b[i:j]).reshape(j - i, -1)
                part = wide_sum(wi, G if sel is None else G[sel])
                total = part if total is None else total + part
        return total if total is not None else self.weight.new_zeros(self.weight.numel(), dtype=torch.float64)

    def per_sample(self) -> Tensors:
        out: Tensors = {}
        if "weight" in self.names:
            if self.G is not None:
                G = self.G
            elif self._gram_rule:
                G = self._per_sample_weight(self.a, self.b)
            else:  # the chunks of the norms and sums (case (e))
                a, b, c = self.a, self.b, self._chunk
                with same_kernel(a.device):
                    G = torch.cat([self._per_sample(a[i : i + c], b[i : i + c]) for i in range(0, a.shape[0], c)])
            out[self.names["weight"]] = G.reshape(G.shape[0], *self.weight.shape)
        if self.gb is not None:
            out[self.names["bias"]] = self.gb
        return out


class _Embedding(LayerRule):
    def __init__(
        self, names: dict[str, str], mod: nn.Embedding, idx: torch.Tensor, b: torch.Tensor, weight: torch.Tensor
    ):
        super().__init__(names)
        B = idx.shape[0]
        self.idx = idx.reshape(B, -1)
        b = b.reshape(B, self.idx.shape[1], -1)
        if mod.padding_idx is not None:  # the padding row never receives gradient
            b = b * (self.idx != mod.padding_idx).unsqueeze(-1).to(b.dtype)
        self.b = b
        self.shape = weight.shape
        self._cache: tuple[tuple[torch.Tensor, float], torch.Tensor] | None = None

    def sq_norms(self) -> list[tuple[torch.Tensor, float]]:
        return [sq_rows_upper(self.b[:, 0]) if self.idx.shape[1] == 1 else self._grouped()[0]]  # one row: case (a)

    def release_err(self) -> torch.Tensor | None:
        return None if self.idx.shape[1] == 1 else self._grouped()[1]

    def _grouped(self) -> tuple[tuple[torch.Tensor, float], torch.Tensor]:
        """Case (d): per example, float64 sums of b over the positions of each distinct token
        (tokens sorted, one segment per token): O(T·p), where the Gram form costs O(T²·p)."""
        if self._cache is None:
            (B, T), p = self.idx.shape, self.b.shape[2]
            chunk = max(1, UNFOLD_CHUNK_BYTES // max(1, 16 * T * p))
            S, mm, rep = [], [], []
            for i in range(0, B, chunk):
                idx, b = self.idx[i : i + chunk], self.b[i : i + chunk]
                c = idx.shape[0]
                tok, order = idx.sort(dim=1)
                new = torch.ones_like(tok, dtype=torch.bool)
                new[:, 1:] = tok[:, 1:] != tok[:, :-1]
                first = torch.arange(c, device=idx.device).unsqueeze(1) * T
                seg = torch.empty_like(order).scatter_(1, order, new.cumsum(1) - 1 + first).reshape(-1)
                b64 = b.reshape(c * T, p).double()
                sums = b64.new_zeros(c * T, p).index_add_(0, seg, b64)
                m = b64.new_zeros(c * T).index_add_(0, seg, torch.linalg.vector_norm(b64, dim=1))  # m_v
                n = torch.zeros_like(seg).index_add_(0, seg, torch.ones_like(seg))  # counts; bincount syncs
                S.append(sums.square_().sum(1).reshape(c, T).sum(1))
                mm.append(m.square().reshape(c, T).sum(1))
                rep.append(torch.where(n >= 2, m, 0.0).reshape(c, T).sum(1))
            u = unit_roundoff(torch.float64)
            cm = 1.0 / (1.0 - gamma(p + T + 4, u))  # m̂_v·cm ≥ m_v (a norm, then n_v additions)
            slack2 = torch.cat(mm).mul_(cm * cm * gamma((p + 2) * T, u))
            e = torch.cat(rep).mul_(cm * gamma(T, unit_roundoff(self.b.dtype)))
            self._cache = (assemble(torch.cat(S), slack2, e, T), e)
        return self._cache

    def weighted(self, w: torch.Tensor, rows: torch.Tensor | None = None) -> Tensors:
        """Per example, each token's positions summed first (in float64, from that example alone:
        case (d)'s release error), then the examples' rows added in float64 (≤ one per example)."""
        idx, b = (self.idx, self.b) if rows is None else (self.idx[rows], self.b[rows])
        (B, T), (vocab, p) = idx.shape, self.shape
        key = (idx + vocab * torch.arange(B, device=idx.device).unsqueeze(1)).reshape(-1)
        rows64 = b.reshape(B * T, p).double()
        seg = key
        if T > 1:  # (example, token) segments by sorting: fixed shapes (no ``unique``: a CUDA graph can hold it)
            ks, order = key.sort()
            new = torch.ones_like(ks, dtype=torch.bool)
            new[1:] = ks[1:] != ks[:-1]
            inv = torch.empty_like(order).scatter_(0, order, new.cumsum(0) - 1)
            rows64 = torch.zeros_like(rows64).index_add_(0, inv, rows64)  # unused segments stay 0
            seg = torch.zeros_like(key).scatter_(0, inv, key)
        rows64 *= w.double()[seg // vocab].unsqueeze(1)
        out = torch.zeros(self.shape, dtype=torch.float64, device=b.device).index_add_(0, seg % vocab, rows64)
        return {self.names["weight"]: out}

    def per_sample(self) -> Tensors:
        B, T = self.idx.shape
        out = torch.zeros((B, *self.shape), dtype=self.b.dtype, device=self.b.device)
        rows = torch.arange(B, device=self.idx.device).repeat_interleave(T)
        out.index_put_((rows, self.idx.reshape(-1)), self.b.reshape(B * T, -1), accumulate=True)
        return {self.names["weight"]: out}


# ----------------------------------------------------------------------------- the result
class GhostGrads(LayerGrads):
    """``PerSampleGrads`` from stored activations and output gradients: ``norms`` and
    ``weighted_sum`` never build per-sample gradients of Linear layers."""

    @property
    def norms(self) -> torch.Tensor:  # type: ignore[override]
        """Upper bounds: the released w·g_i has norm ≤ |w|·N_i (module docstring)."""
        if self._norms is None:
            with ieee_matmul(self.losses.device):
                rules = [r for r in self._layers if isinstance(r, LinearRule) and r.gram_pending()]
                for r, got in zip(rules, gram_stacks([(r.a, r.b) for r in rules], GRAM_STACK_BYTES), strict=True):
                    r._gram = got  # case (c) of all Linear layers at once: one host read
                parts = [part for layer in self._layers for part in layer.sq_norms()]
                self._norms = upper_norms(parts, self.losses, release_dtypes=[p.dtype for p in self._params.values()])
        return self._norms


# ----------------------------------------------------------------------------- the engine
class GhostEngine:
    """One forward pass recording the inputs and outputs of supported layers, one backward pass of
    Σ_i ℓ_i to their outputs (no parameter gradients are computed), then the layer rules. ``rowwise``:
    both passes run under vmap, each example alone (your forward: no batch-level branch can mix rows)."""

    def __init__(self, model: nn.Module, batched_loss: LossFn, rowwise: bool = False):
        """``batched_loss(out, y)`` returns the [B] per-example losses."""
        self.model, self.rowwise = model, rowwise
        self.layers: list[tuple[nn.Module, type[nn.Module], dict[str, str]]] = []
        for name, mod in model.named_modules():
            names = {k: f"{name}.{k}" if name else k for k, p in mod.named_parameters(recurse=False) if p.requires_grad}
            if names:
                cls = base_type(mod)
                assert cls is not None, "call unsupported_reason first"
                self.layers.append((mod, cls, names))
        self._loss, self._call = batched_loss, ParamSwap(model)

    def __call__(self, params: Tensors, x: torch.Tensor, y: torch.Tensor, buffers: Tensors) -> GhostGrads:
        """``buffers``: the model's buffers for this forward (``persample.ScratchBuffers``' copies)."""
        ps = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        x0, y0 = (inputs.dummy(x), y.new_zeros(1, *y.shape[1:])) if self.rowwise else (x, y)  # public: no private row
        try:
            with recording((mod for mod, _, _ in self.layers), inputs.batch_len(x0)) as records:
                losses = self._loss(self._call(ps, buffers, x0), y0)
        except Exception as exc:  # the dummy may be outside your forward's domain (ids − 1): vmap then
            if isinstance(exc, GhostFallback) or not self.rowwise:
                raise
            raise GhostFallback(f"your forward fails on a zeros dummy ({str(exc).splitlines()[0]})") from exc
        used = [(m, c, n) for m, c, n in self.layers if m in records]
        recs = [r for m, _, _ in used if (r := records[m]) is not None]  # all: ``recording`` refuses a None
        # A weight of a layer never called, used directly, has no rule: no gradient, silently (found in review).
        direct = [ps[k] for m, _, n in self.layers if m not in records for k in n.values() if k in ps]
        if direct and any(
            g is not None for g in torch.autograd.grad(losses.sum(), direct, retain_graph=True, allow_unused=True)
        ):
            raise GhostFallback("a weight is used outside its layer's call")
        bs: list[torch.Tensor | None]
        if self.rowwise:  # the pass above gave the outputs' shapes
            losses, acts, bs = self._rowwise(params, x, y, buffers, [m for m, _, _ in used], recs)
        else:
            bs = list(torch.autograd.grad(losses.sum(), [r[1] for r in recs], allow_unused=True)) if recs else []
            acts = [r[0].detach() for r in recs]
        layers: list[LayerRule] = []
        for i, (m, cls, names) in enumerate(used):
            a, rec, b = acts[i], recs[i], bs[i]
            b = b if b is not None else torch.zeros(rec[2][0], dtype=rec[2][1], device=rec[2][2])
            bs[i] = None  # free as we go
            weight = ps.get(names.get("weight", ""), getattr(m, "weight", None))
            if cls is nn.Linear or is_conv1d(m):
                rule = LinearRule(names, a, b, weight, transposed=cls is not nn.Linear)
                layers.extend(r for r in (rule, rule.split_bias()) if r is not None and r.names)
            elif cls in CONV:
                layers.append(_Conv(names, m, a, b, weight.detach()))
            elif cls is nn.Embedding:
                layers.append(_Embedding(names, m, a, b, weight))
            else:
                layers.append(norm_layer_rule(names, m, a, b))
        return GhostGrads(merge_kept(layers), losses.detach(), params)

    def _rowwise(
        self, params: Tensors, x: Any, y: torch.Tensor, buffers: Tensors, mods: list[nn.Module], recs: list[tuple]
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]:
        """Each example's layer inputs and the gradients of its loss to the layers' outputs, by vmap over examples
        of a vjp in zero shifts of the outputs: computed from that example alone, by construction."""
        ps = {k: v.detach() for k, v in params.items()}
        zs = [torch.zeros(r[2][0], dtype=r[2][1], device=r[2][2]) for r in recs]

        def one(xi: Any, yi: torch.Tensor, zs: list[torch.Tensor]) -> tuple:
            def shifted(zs: list[torch.Tensor]) -> tuple:
                with recording(mods, 1, dict(zip(mods, zs, strict=True))) as records:
                    loss = self._loss(self._call(ps, buffers, inputs.tmap(lambda t: t.unsqueeze(0), xi)), yi[None])
                if any(records.get(m) is None for m in mods):  # a layer the one-example pass had called
                    raise GhostFallback("a layer was not called when its example ran alone")
                return loss.sum(), [records[m][0] for m in mods]  # type: ignore[index]

            loss, pullback, acts = vjp(shifted, zs, has_aux=True)  # type: ignore[misc]
            return loss, acts, pullback(torch.ones_like(loss))[0]

        try:
            losses, acts, bs = vmap(one, in_dims=(0, 0, None), randomness="different")(x, y, zs)
        except (RuntimeError, ValueError) as exc:  # vmap refuses the model: vmap's own fallbacks apply
            why = str(exc).splitlines()[0]
            raise GhostFallback(f"the ghost path under vmap cannot run your forward: {why}") from exc
        return losses, [a.squeeze(1) for a in acts], [b.squeeze(1) for b in bs]
