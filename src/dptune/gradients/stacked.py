"""K models of one architecture as one: stacked parameters [K, p, d], one batched forward and
backward, per-example ghost norms of all K at once (``dptune.vectorized``'s trials).

Scope: (nested) ``nn.Sequential`` of ``nn.Linear``, element-wise activations, ``Flatten`` and
inactive ``Dropout`` (``stack_plan``); anything else raises ``Unsupported``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dptune.errors import ConfigError
from dptune.gradients.ghost import GhostGrads, LinearRule
from dptune.gradients.norm_bounds import rank_one_parts, upper_norms
from dptune.gradients.persample import MaterializedGrads
from dptune.tree import Tensors

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.ELU,
    nn.SiLU,
    nn.Softplus,
    nn.Identity,
    nn.Hardtanh,
    nn.ReLU6,
    nn.Mish,
    nn.CELU,
    nn.SELU,
    nn.Softsign,
    nn.Tanhshrink,
)


class Unsupported(ConfigError):
    """The model cannot be stacked; the message says why."""


@dataclass(frozen=True)
class StackOp:
    kind: str  # 'linear' | 'fn' | 'flatten'
    module: nn.Module
    prefix: str  # parameter-name prefix of a Linear ('' at top level)

    def signature(self) -> tuple[Any, ...]:
        """What the trials' models must share, op by op, to be stacked."""
        m = self.module
        if self.kind == "linear":
            return ("linear", self.prefix, tuple(m.weight.shape), m.bias is not None)
        return (self.kind, type(m).__name__, repr(m))


def stack_plan(model: nn.Module) -> list[StackOp]:
    """The model as a flat list of stackable operations; raises ``Unsupported`` otherwise."""
    ops: list[StackOp] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        if type(mod) is nn.Sequential:
            for name, child in mod.named_children():
                visit(child, f"{prefix}{name}.")
            return
        where = f"'{prefix[:-1] or type(mod).__name__}' ({type(mod).__name__})"
        if isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward:
            if not mod.weight.requires_grad or (mod.bias is not None and not mod.bias.requires_grad):
                raise Unsupported(f"layer {where} has frozen parameters")
            ops.append(StackOp("linear", mod, prefix))
        elif type(mod) in ELEMENTWISE:
            if getattr(mod, "inplace", False):
                raise Unsupported(f"layer {where} is in-place")
            ops.append(StackOp("fn", mod, prefix))
        elif type(mod) is nn.Flatten:
            if mod.start_dim != 1 or mod.end_dim != -1:
                raise Unsupported(f"layer {where} flattens other dimensions than all but the batch")
            ops.append(StackOp("flatten", mod, prefix))
        elif isinstance(mod, nn.Dropout) and (mod.p == 0 or not mod.training):
            return
        else:
            raise Unsupported(
                f"layer {where} cannot be stacked: vectorised trials support nn.Sequential models of "
                "Linear layers, element-wise activations, Flatten and inactive Dropout"
            )

    visit(model, "")
    if not any(op.kind == "linear" for op in ops):
        raise Unsupported("the model has no Linear layer")
    return ops


class Stacked:
    """Forward/backward of K copies of one architecture with stacked parameters."""

    def __init__(self, ops: list[StackOp]):
        self.ops = ops
        self.linears = [op for op in ops if op.kind == "linear"]

    def names(self, op: StackOp) -> dict[str, str]:
        names = {"weight": f"{op.prefix}weight"}
        if op.module.bias is not None:
            names["bias"] = f"{op.prefix}bias"
        return names

    def stack(self, params: Sequence[Tensors]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        out = []
        for op in self.linears:
            nm = self.names(op)
            W = torch.stack([p[nm["weight"]] for p in params])
            b = torch.stack([p[nm["bias"]] for p in params]) if "bias" in nm else None
            out.append((W, b))
        return out

    def forward(
        self, weights: list[tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor, record: bool
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """x: [K, B, *in] → out [K, B, *]; with ``record``, the (input, output) of each Linear."""
        h = x
        recs = []
        li = 0
        for op in self.ops:
            if op.kind == "flatten":
                h = h.reshape(h.shape[0], h.shape[1], -1)
            elif op.kind == "fn":
                h = op.module(h)
            else:
                W, b = weights[li]
                li += 1
                if h.dim() != 3:
                    raise Unsupported("a Linear layer receives per-example inputs of more than one dimension")
                z = (
                    torch.baddbmm(b.unsqueeze(1), h, W.transpose(1, 2))
                    if b is not None
                    else torch.bmm(h, W.transpose(1, 2))
                )
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
    ) -> list[tuple[torch.Tensor, MaterializedGrads]]:
        """One forward/backward for K parameter sets, each on its rows ``x[idxs[k]]``: per set, its
        batch (a view of the padded buffer) and its per-example statistics (ghost norms)."""
        K = len(params)
        sizes = [int(i.numel()) for i in idxs]
        B = max(sizes)
        # Gather each trial's batch straight into a padded [K, B, ...] buffer kept across steps
        # (allocating and zeroing ~K·B·d floats per step cost more than the forward pass). Rows
        # past a trial's batch hold stale real examples: finite, masked out of the loss, unread.
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
        out, recs = self.forward(leaves, X, record=True)
        losses = lossfn(out.reshape(K * B, *out.shape[2:]), Y.reshape(K * B, *Y.shape[2:])).reshape(K, B)
        losses = torch.where(mask, losses, torch.zeros_like(losses))
        zs = [z for _, z in recs]
        bs = torch.autograd.grad(losses.sum(), zs)
        losses = losses.detach()
        # Per-sample norms of all trials at once: Σ_layers ‖a‖²‖b‖² (+ ‖b‖² for the bias), as the
        # upper bounds of the ghost path (ghost.rank_one_parts, grads.upper_norms).
        parts: list[tuple[torch.Tensor, float]] = []
        acts = []
        for op, (h, _), b in zip(self.linears, recs, bs, strict=True):
            a = h.detach()
            acts.append(a)
            parts += rank_one_parts(a, b, op.module.bias is not None)
        norms = upper_norms(parts, losses, release_dtypes=[W.dtype for W, _ in weights])
        out_views: list[tuple[torch.Tensor, MaterializedGrads]] = []
        for k, p in enumerate(params):
            Bk = sizes[k]
            layers = [
                LinearRule(self.names(op), a[k, :Bk], b[k, :Bk], p[f"{op.prefix}weight"])
                for op, a, b in zip(self.linears, acts, bs, strict=True)
            ]
            if Bk == 0:
                g: MaterializedGrads = MaterializedGrads(
                    {kk: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for kk, p in p.items()},
                    torch.zeros(0, device=x.device),
                )
            else:
                g = GhostGrads(layers, losses[k, :Bk], p, norms=norms[k, :Bk])
            out_views.append((xs[k], g))
        return out_views


class PaddedBuffers(dict[int, torch.Tensor]):
    """Padded batch buffers per source tensor (by id), reused across steps (grown when needed)."""

    def padded(self, src: torch.Tensor, K: int, B: int) -> torch.Tensor:
        buf = self.get(id(src))
        if buf is None or buf.shape[0] < K or buf.shape[1] < B:
            cap_k = max(K, buf.shape[0] if buf is not None else 0)
            cap_b = max(int(B * 1.1) + 1, buf.shape[1] if buf is not None else 0)
            buf = self[id(src)] = src.new_zeros((cap_k, cap_b, *src.shape[1:]))
        return buf[:K, :B]
