"""K models of one architecture as one: stacked parameters [K, p, d], one batched forward and
backward, per-example ghost norms of all K at once (``dptune.vectorized``'s trials).

Scope (``stack_plan``, else ``Unsupported``): docs/privacy.md's table, "vectorised trials". The K trials' convolutions
are one grouped convolution (trial k's channels are group k); their per-example gradients are kept and released as they
are (ghost case (a))."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrize import is_parametrized

from dptune.errors import ConfigError
from dptune.gradients.ghost import GhostGrads, LinearRule, out_size, patches, rank_one_parts, unfolded_weight
from dptune.gradients.ghost_layers import KeptRule, LayerRule
from dptune.gradients.isolation import MODULE_HOOKS, calls_made_of, global_module_hooks
from dptune.gradients.norm_bounds import ieee_matmul, sq_rows_upper, upper_norms, weights_dtype, wide_bmm
from dptune.gradients.persample import MaterializedGrads
from dptune.tree import Tensors

# fmt: off
ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.ELU, nn.SiLU, nn.Softplus,
    nn.Identity, nn.Hardtanh, nn.ReLU6, nn.Mish, nn.CELU, nn.SELU, nn.Softsign, nn.Tanhshrink,
)
# fmt: on
POOLS = (nn.MaxPool2d, nn.AvgPool2d)
PATCH_BYTES = 256 * 2**20  # bound on one chunk's patch copy (``conv_per_sample``)


class Unsupported(ConfigError):
    """The model cannot be stacked; the message says why."""


@dataclass(frozen=True)
class StackOp:
    kind: str  # 'linear' | 'conv' | 'pool' | 'fn' | 'flatten'
    module: nn.Module
    prefix: str  # parameter-name prefix of a Linear or Conv2d ('' at top level)

    def signature(self) -> tuple[Any, ...]:
        """What the trials' models must share, op by op, to be stacked."""
        m = self.module
        return (self.kind, self.prefix, type(m).__name__, repr(m), tuple(p.shape for p in m.parameters()))


def stack_plan(model: nn.Module) -> list[StackOp]:
    """The model as a flat list of stackable operations; raises ``Unsupported`` otherwise."""
    ops: list[StackOp] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        if _hooked(mod):  # a hook runs on the stacked [K, B, ...] tensors (mixing rows or trials) or is skipped
            raise Unsupported(f"layer '{prefix[:-1] or type(mod).__name__}' has a hook or its own forward")
        if type(mod) is nn.Sequential:
            # every use: named_children() lists a module used twice once, and its second use was dropped
            for name, child in mod._modules.items():  # (found in review)
                if child is not None:
                    visit(child, f"{prefix}{name}.")
            return
        where = f"'{prefix[:-1] or type(mod).__name__}' ({type(mod).__name__})"
        linear = isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward and not is_parametrized(mod)
        if linear or type(mod) is nn.Conv2d:
            if any(op.module is mod for op in ops):  # one example's gradient sums both uses: not per layer
                raise Unsupported(f"layer {where} is used twice (shared weights)")
            if not all(p.requires_grad for p in mod.parameters()):
                raise Unsupported(f"layer {where} has frozen parameters")
            if not linear and (mod.groups != 1 or mod.padding_mode != "zeros" or isinstance(mod.padding, str)):
                raise Unsupported(f"layer {where} cannot be stacked: only groups=1 and numeric zero padding")
            ops.append(StackOp("linear" if linear else "conv", mod, prefix))
        elif type(mod) in POOLS and not getattr(mod, "return_indices", False):
            ops.append(StackOp("pool", mod, prefix))
        elif type(mod) in ELEMENTWISE:
            if getattr(mod, "inplace", False):
                raise Unsupported(f"layer {where} is in-place")
            ops.append(StackOp("fn", mod, prefix))
        elif type(mod) is nn.Flatten:
            if mod.start_dim != 1 or mod.end_dim != -1:
                raise Unsupported(f"layer {where} flattens other dimensions than all but the batch")
            ops.append(StackOp("flatten", mod, prefix))
        elif type(mod) is nn.Dropout and (mod.p == 0 or not mod.training):
            return
        else:
            raise Unsupported(
                f"layer {where} cannot be stacked: vectorised trials support nn.Sequential models of "
                "Linear and Conv2d layers, MaxPool2d/AvgPool2d, element-wise activations, Flatten and inactive Dropout"
            )

    if any(global_module_hooks()):
        raise Unsupported("global module hooks are registered (torch.nn.modules.module.register_module_*_hook)")
    visit(model, "")
    if not any(op.kind in ("linear", "conv") for op in ops):
        raise Unsupported("the model has no Linear or Conv2d layer")
    planned = [f"{op.prefix}{k}" for op in ops for k, v in op.module.named_parameters(recurse=False)]
    if sorted(planned) != sorted(n for n, _ in model.named_parameters()):  # tied weights are listed once
        raise Unsupported("the model shares parameters between layers, or holds parameters outside its layers")
    return ops


def _hooked(mod: nn.Module) -> bool:
    """A module whose call is not its class's forward alone: hooks, a forward or call of its own (class or instance:
    a Linear subclass overriding ``__call__`` was stacked as a plain Linear, found in review), a compiled call."""
    own_call = type(mod).__call__ is not nn.Module.__call__ or type(mod)._call_impl is not nn.Module._call_impl
    return any(getattr(mod, h, None) for h in MODULE_HOOKS) or own_call or any(calls_made_of(mod)[0])


def trials_first(h: torch.Tensor, K: int) -> torch.Tensor:
    """[B, K·C, ...] (a grouped convolution's or a pool's output) → a [K, B, C, ...] view."""
    return h.view(h.shape[0], K, -1, *h.shape[2:]).transpose(0, 1)


def geometry(mod: nn.Module) -> tuple[tuple[int, int], ...]:
    """A Conv2d's kernel size, stride, padding and dilation (``stack_plan`` refuses string padding)."""
    return cast(tuple[tuple[int, int], ...], (mod.kernel_size, mod.stride, mod.padding, mod.dilation))


def gemm_patches(device: torch.device) -> bool:
    return device.type == "cuda"


class PatchConv(torch.autograd.Function):
    """K trials' Conv2d as batched products over patches, by chunks of rows of at most ``PATCH_BYTES`` of
    patches (forward and backward): h [K, B, C, H, W], Wt [K, C·k_h·k_w, C_out], bias [K, C_out] → [K, B,
    C_out, H', W']. Only h's gradient is formed (the outputs are the backward's targets). On CUDA cuDNN
    runs a grouped convolution group by group, a one-channel group on a slow depthwise kernel."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, Wt: torch.Tensor, bias: torch.Tensor | None, geom: Any) -> torch.Tensor:
        assert not any(ctx.needs_input_grad[1:3]), "PatchConv forms no weight gradient"
        ctx.geom, ctx.shape = geom, h.shape
        ctx.save_for_backward(Wt)
        (K, B), (ho, wo), step = h.shape[:2], out_size(h.shape, geom), patch_rows(h.shape, geom, Wt)
        z = torch.empty(B, K, Wt.shape[2], ho, wo, dtype=Wt.dtype, device=h.device)  # the grouped layout
        for i in range(0, B, step):
            U = patches(h[:, i : i + step], geom)
            zi = torch.baddbmm(bias.unsqueeze(1), U, Wt) if bias is not None else torch.bmm(U, Wt)
            z[i : i + step] = zi.view(K, -1, ho, wo, Wt.shape[2]).permute(1, 0, 4, 2, 3)
        return z.transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, dz: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (Wt,), shape = ctx.saved_tensors, ctx.shape
        dzt, dh, step = dz.permute(0, 1, 3, 4, 2), dz.new_empty(shape), patch_rows(shape, ctx.geom, Wt)
        for i in range(0, shape[1], step):
            dU = torch.bmm(dzt[:, i : i + step].reshape(shape[0], -1, Wt.shape[2]), Wt.transpose(1, 2))
            dh[:, i : i + step] = patches_adjoint(dU, (shape[0], min(step, shape[1] - i), *shape[2:]), ctx.geom)
        return dh, None, None, None


def patches_adjoint(dU: torch.Tensor, shape: Sequence[int], geom: Any) -> torch.Tensor:
    """The adjoint of ``patches`` (the patch map is linear): dU [K, c·H'·W', C·k_h·k_w] → [K, c, C, H, W]."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geom
    K, c, C, H, W = shape
    (ho, wo), ekh, ekw = out_size(shape, geom), (kh - 1) * dh + 1, (kw - 1) * dw + 1
    g = dU.view(K, c, ho, wo, C, kh, kw).permute(0, 1, 4, 2, 3, 5, 6)
    if dh > 1 or dw > 1:  # a dilated kernel's taps in its full extent
        full = g.new_zeros(K, c, C, ho, wo, ekh, ekw)
        full[..., ::dh, ::dw] = g
        g = full
    g = torch.ops.aten.unfold_backward(g, [K, c, C, ho, W + 2 * pw, ekh], 4, ekw, sw)
    g = torch.ops.aten.unfold_backward(g, [K, c, C, H + 2 * ph, W + 2 * pw], 3, ekh, sh)
    return g[..., ph : ph + H, pw : pw + W]


def patch_rows(shape: Sequence[int], geom: Any, Wt: torch.Tensor) -> int:
    ho, wo = out_size(shape, geom)
    return max(1, PATCH_BYTES // (shape[0] * Wt.shape[1] * ho * wo * Wt.element_size()))


def conv_per_sample(mod: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients [N, C_out, C_in·k_h·k_w] of a Conv2d from its inputs a [N, C_in, H, W] and output
    gradients b [N, C_out, H', W'], each from its own row alone. CPU: the convolution backward with the rows as groups
    (Rochette et al. 2019), 64 at a time; CUDA: ``ghost.unfolded_weight`` by chunks (the ghost path's kernels,
    ``ghost.use_unfold_products``: 10x faster on a CPU, resp. on a GPU)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geometry(mod)
    N, C, ho, wo = a.shape[0], a.shape[1], b.shape[2], b.shape[3]
    w, out = cast(torch.Tensor, mod.weight).detach(), []
    cuda = gemm_patches(a.device)
    step = max(1, PATCH_BYTES // (C * kh * kw * ho * wo * a.element_size())) if cuda else 64
    for i in range(0, N, step):
        ai, bi = a[i : i + step], b[i : i + step]
        c = ai.shape[0]
        if not cuda:
            g = torch.ops.aten.convolution_backward(
                *(bi.reshape(1, -1, ho, wo), ai.reshape(1, -1, *ai.shape[2:]), w.repeat(c, 1, 1, 1), None),
                *([sh, sw], [ph, pw], [dh, dw], False, [0, 0], c, [False, True, False]),
            )[1]
            out.append(g.view(c, w.shape[0], -1))
            continue
        out.append(unfolded_weight(ai, bi, geometry(mod)))
    return torch.cat(out)


class Stacked:
    """Forward/backward of K copies of one architecture with stacked parameters."""

    def __init__(self, ops: list[StackOp]):
        self.ops = ops
        self.layers = [op for op in ops if op.kind in ("linear", "conv")]

    def check_input(self, model: nn.Module, x: torch.Tensor) -> None:
        """A forward of a zero example like ``x`` while planning: a layout or dtype it refuses sends the trials one by
        one before any release (found in review: refused mid-run, skipping the fallback)."""
        weights = self.stack([dict(model.named_parameters())])
        try:
            with torch.no_grad():
                self.forward(weights, torch.zeros_like(x[:1]).unsqueeze(0), record=False)
        except RuntimeError as exc:  # the model does not take the data as stacked: run alone, the error is train's
            raise Unsupported(f"the stacked forward fails on the data: {exc}") from exc

    def names(self, op: StackOp) -> dict[str, str]:
        return {k: f"{op.prefix}{k}" for k in ("weight", "bias") if getattr(op.module, k) is not None}

    def stack(self, params: Sequence[Tensors]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        out = []
        for op in self.layers:
            nm = self.names(op)
            W = torch.stack([p[nm["weight"]] for p in params])
            b = torch.stack([p[nm["bias"]] for p in params]) if "bias" in nm else None
            out.append((W, b))
        return out

    def forward(
        self, weights: list[tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor, record: bool
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """x: [K, B, *in] → out [K, B, *]; with ``record``, the (input, output) of each Linear/Conv2d."""
        h, li, K = x, 0, x.shape[0]
        recs = []
        for op in self.ops:
            if op.kind == "flatten":
                h = h.reshape(h.shape[0], h.shape[1], -1)
            elif op.kind == "fn":
                h = type(op.module).forward(op.module, h)
            elif op.kind in ("pool", "conv") and h.dim() != 5:
                raise Unsupported(f"a {type(op.module).__name__} receives per-example inputs other than [C, H, W]")
            elif op.kind == "pool":  # per channel: the [B, K·C, H, W] layout of the convolutions
                h = trials_first(type(op.module).forward(op.module, h.transpose(0, 1).flatten(1, 2)), K)
            else:  # a Conv2d or a Linear layer
                W, b = weights[li]
                li += 1
                if op.kind == "conv" and min(out_size(h.shape, geometry(op.module))) < 1:
                    raise Unsupported(
                        f"the Conv2d {op.prefix[:-1]!r}: its kernel is larger than its input {tuple(h.shape[3:])}. "
                        "Fix: pad the input or use a smaller kernel"
                    )
                if op.kind == "conv" and gemm_patches(h.device):
                    bias = b.detach() if b is not None else None
                    z = PatchConv.apply(h, W.detach().flatten(2).transpose(1, 2), bias, geometry(op.module))
                    z = z.requires_grad_() if record and not z.requires_grad else z  # a target of the backward
                elif op.kind == "conv":
                    _, stride, padding, dilation = geometry(op.module)
                    xg = h.transpose(0, 1).flatten(1, 2)  # [B, K·C_in, H, W]: trial k's channels are group k
                    bias = b.flatten() if b is not None else None
                    z = trials_first(F.conv2d(xg, W.flatten(0, 1), bias, stride, padding, dilation, K), K)
                elif h.dim() != 3:
                    raise Unsupported("a Linear layer receives per-example inputs of more than one dimension")
                elif b is not None:
                    z = torch.baddbmm(b.unsqueeze(1), h, W.transpose(1, 2))
                else:
                    z = torch.bmm(h, W.transpose(1, 2))
                if record:
                    recs.append((h, z))
                h = z
        return h, recs

    def grads(
        self,
        params: Sequence[Tensors],
        idxs: Sequence[torch.Tensor],
        lossfn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        buffers: PaddedBuffers,
        clips: Sequence[float | None] = (),
    ) -> list[tuple[torch.Tensor, MaterializedGrads]]:
        """One forward/backward for K parameter sets, each on its rows ``x[idxs[k]]``: per set, its
        batch (a view of the padded buffer) and its per-example statistics (ghost norms). ``clips``: the C
        each set's privatizer will clip at (``presum_clipped``)."""
        K = len(params)
        sizes = [int(i.numel()) for i in idxs]
        B = max(sizes)
        # Each trial's batch goes straight into a padded [K, B, ...] buffer kept across steps (fresh ~K·B·d zeros a
        # step cost more than the forward). Rows past a trial's batch: stale real examples, finite, masked out, unread.
        X, Y = buffers.padded(x, K, B), buffers.padded(y, K, B)
        mask = torch.zeros(K, B, dtype=torch.bool, device=x.device)
        xs = []
        for k, i in enumerate(idxs):
            torch.index_select(x, 0, i, out=X[k, : sizes[k]])
            torch.index_select(y, 0, i, out=Y[k, : sizes[k]])
            mask[k, : sizes[k]] = True
            xs.append(X[k, : sizes[k]])
        weights = self.stack(params)
        leaves = [(W.requires_grad_(True), b.requires_grad_(True) if b is not None else None) for W, b in weights]
        with ieee_matmul(x.device):  # exact float32 passes, as ``train``'s (norm_bounds.ieee_matmul)
            out, recs = self.forward(leaves, X, record=True)
            losses = lossfn(out.reshape(K * B, *out.shape[2:]), Y.reshape(K * B, *Y.shape[2:])).reshape(K, B)
            losses = torch.where(mask, losses, torch.zeros_like(losses))
            bs = torch.autograd.grad(losses.sum(), [z for _, z in recs])
        losses = losses.detach()
        # Per-sample norms of all trials at once, the ghost path's upper bounds: Σ_layers ‖a‖²‖b‖² (+ ‖b‖² for the bias:
        # norm_bounds.rank_one_parts, upper_norms); a Conv2d's kept per-example gradients by ``sq_rows_upper``.
        parts: list[tuple[torch.Tensor, float]] = []
        rules: list[Callable[[int, int, Tensors], LayerRule]] = []
        sums: list[Callable[[torch.Tensor], Tensors]] = []  # each layer's K weighted sums at once
        batched = gemm_patches(x.device)
        for op, (h, _), b in zip(self.layers, recs, bs, strict=True):
            a, nm = h.detach(), self.names(op)
            if op.kind == "linear":
                parts += rank_one_parts(a, b, op.module.bias is not None)
                rules.append(partial(linear_rule, nm, a, b))
                sums.append(partial(linear_sums, nm, a, b, batched))
                continue
            kept = conv_grads(op.module, nm, a, b)
            parts += [(s.view(K, B), r) for s, r in (sq_rows_upper(g.flatten(0, 1)) for g in kept.values())]
            rules.append(partial(kept_rule, nm, kept))
            sums.append(partial(kept_sums, kept, batched))
        norms = upper_norms(parts, losses, release_dtypes=[W.dtype for W, _ in weights])
        finite = torch.isfinite(norms).cpu().numpy()  # all K verdicts of ``nonfinite_rows``: one host read, not K
        out_views: list[tuple[torch.Tensor, MaterializedGrads]] = []
        for k, p in enumerate(params):
            Bk = sizes[k]
            layers = [rule(k, Bk, p) for rule in rules]
            if Bk == 0:
                empty = {n: torch.zeros((0, *v.shape), dtype=v.dtype, device=v.device) for n, v in p.items()}
                g: MaterializedGrads = MaterializedGrads(empty, torch.zeros(0, device=x.device))
            else:
                g = GhostGrads(layers, losses[k, :Bk], p, norms=norms[k, :Bk])
                g._finite_norms = bool(finite[k, :Bk].all())  # numpy: no device op
            out_views.append((xs[k], g))
        if clips and None not in clips and finite.all():
            presum_clipped(out_views, sums, norms, mask, cast(list[float], clips))
        return out_views


def presum_clipped(
    views: list[tuple[torch.Tensor, MaterializedGrads]],
    sums: list[Callable[[torch.Tensor], Tensors]],
    norms: torch.Tensor,
    mask: torch.Tensor,
    clips: list[float],
) -> None:
    """Every trial's Σ_i min(1, C_k/N_i)·g_i at the C_k its privatizer will ask (``clipped_sum``), all K in
    one product a layer instead of K (on a GPU, K trials' sums were K× the launches). The weights are ``clip_weights``'
    (the same float32 operations, a subnormal one 0), the padded rows' 0; each trial's sum is over its own rows in
    float64 (``norm_bounds.wide_bmm``: the same bound). Only when every row's norm is finite (a padded row's
    gradient is then finite too: 0·g adds nothing), else each trial sums alone."""
    n = norms.to(weights_dtype(norms.dtype))
    C = torch.tensor(clips, dtype=n.dtype, device=n.device).unsqueeze(1)
    w = n.clamp_min(1e-12).reciprocal_().mul_(C).clamp_(max=1.0)
    W = torch.where(mask & (w >= torch.finfo(w.dtype).tiny), w, 0.0)
    got = {name: s for f in sums for name, s in f(W.double()).items()}
    for k, (_, g) in enumerate(views):
        if isinstance(g, GhostGrads):
            p = g._params
            own = {n: got[n][k] if n in got else torch.zeros_like(v, dtype=torch.float64) for n, v in p.items()}
            g.presum(clips[k], W[k, : g.batch_size], own)


def linear_sums(nm: dict[str, str], a: torch.Tensor, b: torch.Tensor, batched: bool, w: torch.Tensor) -> Tensors:
    """A stacked Linear's K weighted sums (w [K, B] float64), as ``LinearRule.weighted`` forms each (T = 1)."""
    out = {nm["weight"]: wide_bmm(b.double() * w.unsqueeze(-1), a, batched)}
    if "bias" in nm:
        out[nm["bias"]] = wide_bmm(w.unsqueeze(-1), b, batched).squeeze(1)
    return out


def kept_sums(kept: Tensors, batched: bool, w: torch.Tensor) -> Tensors:
    """A stacked Conv2d's K weighted sums of its kept per-example gradients, as ``KeptRule.weighted``."""
    return {n: wide_bmm(w.unsqueeze(-1), g.flatten(2), batched).view(g.shape[0], *g.shape[2:]) for n, g in kept.items()}


def linear_rule(nm: dict[str, str], a: torch.Tensor, b: torch.Tensor, k: int, n: int, p: Tensors) -> LayerRule:
    return LinearRule(nm, a[k, :n], b[k, :n], p[nm["weight"]])


def kept_rule(nm: dict[str, str], kept: Tensors, k: int, n: int, p: Tensors) -> LayerRule:
    return KeptRule(nm, {q: g[k, :n] for q, g in kept.items()})


def conv_grads(mod: nn.Module, names: dict[str, str], a: torch.Tensor, b: torch.Tensor) -> Tensors:
    """A stacked Conv2d's kept per-example gradients [K, B, *shape] from its inputs a [K, B, C, H, W] and
    output gradients b [K, B, C_out, H', W']: each row from its own input and output gradient alone."""
    K, B = a.shape[:2]
    with ieee_matmul(a.device):  # exact float32, as every private computation (norm_bounds.ieee_matmul)
        rows = conv_per_sample(mod, a.transpose(0, 1).flatten(0, 1), b.transpose(0, 1).flatten(0, 1))
    out = {names["weight"]: rows.view(B, K, *cast(torch.Tensor, mod.weight).shape).transpose(0, 1).contiguous()}
    if "bias" in names:
        out[names["bias"]] = b.sum((3, 4))
    return out


class PaddedBuffers(dict[int, torch.Tensor]):
    """Padded batch buffers per source tensor (by id), reused across steps (grown when needed)."""

    def padded(self, src: torch.Tensor, K: int, B: int) -> torch.Tensor:
        buf = self.get(id(src))
        if buf is None or buf.shape[0] < K or buf.shape[1] < B:
            cap_k = max(K, buf.shape[0] if buf is not None else 0)
            cap_b = max(int(B * 1.1) + 1, buf.shape[1] if buf is not None else 0)
            buf = self[id(src)] = src.new_zeros((cap_k, cap_b, *src.shape[1:]))
        return buf[:K, :B]
