"""Per-sample gradients with ``torch.func`` (``functional_call`` + ``vmap(grad)``).

Strategies never touch raw per-sample tensors. They ask a ``PerSampleGrads`` for
the per-sample norms ‖g_i‖ and for weighted sums Σ_i w_i g_i (clipping, OSO's
q-query and plain sums are all weighted sums). That is the seam where a
ghost-norm / book-keeping implementation (no materialised per-sample gradients)
replaces the vmap one without touching any strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from dptune.errors import ConfigError

Tensors = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Layers that mix examples of a batch: per-example gradients are undefined for them.
_CROSS_SAMPLE = (nn.modules.batchnorm._BatchNorm,)


def check_model(model: nn.Module) -> None:
    """Reject layers whose output for one example depends on the others (e.g. BatchNorm)."""
    for name, mod in model.named_modules():
        if isinstance(mod, _CROSS_SAMPLE):
            raise ConfigError(
                f"layer '{name or type(mod).__name__}' ({type(mod).__name__}) mixes examples across the "
                "batch, so per-example gradients (and DP) are undefined. Replace it with "
                "nn.GroupNorm or nn.LayerNorm (e.g. nn.GroupNorm(min(32, C), C))."
            )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("the model has no trainable parameters (requires_grad=True).")


def per_example_loss(name: str) -> LossFn:
    """Loss of ONE example (unbatched output and target) as a scalar."""
    if name == "cross_entropy":
        return lambda out, y: nn.functional.cross_entropy(out.unsqueeze(0), y.unsqueeze(0))
    if name == "mse":
        return lambda out, y: nn.functional.mse_loss(out, y)
    if name == "bce":
        return lambda out, y: nn.functional.binary_cross_entropy_with_logits(out.reshape(()), y.float().reshape(()))
    raise ConfigError(f"unknown loss {name!r}; choose cross_entropy, mse or bce")


class PerSampleGrads(Protocol):
    """What strategies may read from one batch's per-example gradients."""

    losses: torch.Tensor  # [B]
    norms: torch.Tensor  # [B], L2 norm over all trainable parameters

    def weighted_sum(self, weights: torch.Tensor) -> Tensors:
        """Σ_i weights[i] · g_i, per parameter."""
        ...


class MaterializedGrads:
    """Per-sample gradients held in memory as [B, *param.shape] tensors."""

    def __init__(self, grads: Tensors, losses: torch.Tensor):
        self.grads = grads
        self.losses = losses
        self._norms: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.losses.shape[0])

    @property
    def norms(self) -> torch.Tensor:
        if self._norms is None:
            sq = None
            for g in self.grads.values():
                s = g.reshape(g.shape[0], -1).pow(2).sum(1)
                sq = s if sq is None else sq + s
            self._norms = sq.sqrt()
        return self._norms

    def weighted_sum(self, weights: torch.Tensor) -> Tensors:
        out = {}
        for k, g in self.grads.items():
            flat = g.reshape(g.shape[0], -1)
            out[k] = (weights.to(flat.dtype) @ flat).reshape(g.shape[1:])
        return out


class GradientOracle:
    """Computes per-example losses and gradients of ``model`` at given parameters.

    ``chunk_size`` bounds memory: per-sample gradients take B × (#params) floats.
    """

    def __init__(self, model: nn.Module, loss: str | LossFn = "cross_entropy", chunk_size: int | None = None):
        check_model(model)
        self.model = model
        self.loss_fn = per_example_loss(loss) if isinstance(loss, str) else loss
        self.buffers = {k: v for k, v in model.named_buffers()}
        self.chunk_size = chunk_size
        self.param_names = [k for k, p in model.named_parameters() if p.requires_grad]

        def one(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.model, (params, self.buffers), (x.unsqueeze(0),))
            return self.loss_fn(out.squeeze(0), y)

        self._per_sample = vmap(grad_and_value(one), in_dims=(None, 0, 0), randomness="different", chunk_size=chunk_size)

    def __call__(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> MaterializedGrads:
        if x.shape[0] == 0:  # an empty Poisson batch: no contribution, but the step (and its noise) still happen
            return MaterializedGrads(
                {k: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for k, p in params.items()},
                torch.zeros(0, device=x.device),
            )
        grads, losses = self._per_sample(params, x, y)
        return MaterializedGrads(grads, losses.detach())

    def loss_and_grad(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        """Mean loss and its (non-private) gradient: one ordinary backward pass."""
        ps = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        out = functional_call(self.model, (ps, self.buffers), (x,))
        losses = torch.vmap(self.loss_fn)(out, y) if out.shape[0] else out.sum() * 0
        loss = losses.mean() if out.shape[0] else losses
        g = torch.autograd.grad(loss, list(ps.values()), allow_unused=True)
        return loss.detach(), {k: (gi if gi is not None else torch.zeros_like(ps[k])) for k, gi in zip(ps, g, strict=True)}

    def forward(self, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, (params, self.buffers), (x,))
