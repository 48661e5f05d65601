"""Per-sample gradients with ``torch.func`` (``functional_call`` + ``vmap(grad)``).

Strategies never touch raw per-sample tensors. They ask a ``PerSampleGrads`` for
the per-sample norms ‖g_i‖ and for weighted sums Σ_i w_i g_i (clipping, OSO's
q-query and plain sums are all weighted sums). That is the seam where a
ghost-norm / book-keeping implementation (no materialised per-sample gradients)
replaces the vmap one without touching any strategy.

``GradientOracle(..., method=)`` picks the implementation: ``'vmap'`` (materialised
per-sample gradients, any model), ``'ghost'`` (``dptune.ghost``: ghost norms and
book-keeping from one backward pass; Linear, Conv1d/2d, ConvTranspose2d, Embedding,
LayerNorm, GroupNorm) or ``'auto'`` (ghost when the model allows it, else vmap). The
default comes from ``DEFAULT_METHOD`` (env ``DPTUNE_GRAD_METHOD``; ``set_default_method``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from dptune import ghost, inputs
from dptune.errors import ConfigError
from dptune.persample import (  # noqa: F401 - re-exported: ``dptune.grads`` is where users look
    NORM_BLOCK,
    NORM_FLOOR,
    LossFn,
    MaterializedGrads,
    ParamSwap,
    PerSampleGrads,
    ScratchBuffers,
    active_dropout,
    batched_loss,
    check_model,
    eval_mode,
    gamma,
    ieee_matmul,
    nonfinite_rows,
    per_example_loss,
    rng_preserved,
    sq_rows_upper,
    unit_roundoff,
    upper_norms,
)
from dptune.tree import Tensors

GRAD_METHODS = ("auto", "vmap", "ghost")
DEFAULT_METHOD: str = os.environ.get("DPTUNE_GRAD_METHOD", "auto")


def _check_method(method: str) -> str:
    if method not in GRAD_METHODS:
        raise ConfigError(f"unknown gradient method {method!r}; choose one of {', '.join(GRAD_METHODS)}.")
    return method


def set_default_method(method: str) -> None:
    """Set the method every ``GradientOracle`` built without ``method=`` uses."""
    global DEFAULT_METHOD
    DEFAULT_METHOD = _check_method(method)


@contextmanager
def default_method(method: str) -> Iterator[None]:
    """Temporarily change ``DEFAULT_METHOD`` (e.g. to run ``train`` on the vmap path)."""
    global DEFAULT_METHOD
    old, DEFAULT_METHOD = DEFAULT_METHOD, _check_method(method)
    try:
        yield
    finally:
        DEFAULT_METHOD = old


# Layers that mix examples of a batch: per-example gradients are undefined for them.
class GradientOracle:
    """Computes per-example losses and gradients of ``model`` at given parameters.

    ``chunk_size`` bounds memory of the vmap path: per-sample gradients take B × (#params)
    floats. ``method``: 'auto' | 'vmap' | 'ghost' (None: ``DEFAULT_METHOD``). With 'auto',
    the first batch is also computed on the vmap path for a few examples and compared;
    a disagreement (e.g. a parameter used outside its layer) switches to vmap for good.
    That probe guards utility, not privacy: on either path the norms bound what is released
    for each example, batch after batch (``upper_norms``; ``dptune.ghost``'s proof).

    Every forward on private data runs on scratch copies of the model's buffers and refuses a
    write (``ScratchBuffers``). ``losses`` (DP-ZO's batched forward) checks on its first batch
    that each example's loss depends on that example alone (``_check_isolation``).
    """

    SELF_CHECK_EXAMPLES = 3

    def __init__(
        self,
        model: nn.Module,
        loss: str | LossFn = "cross_entropy",
        chunk_size: int | None = None,
        method: str | None = None,
    ):
        check_model(model)
        self.model = model
        self.loss_fn = per_example_loss(loss) if isinstance(loss, str) else loss
        # The [B] losses without vmap for the built-in losses (vmapping the per-example loss
        # costs more than the loss itself on small models: docs/performance.md §1).
        # A user loss from ``dptune.own.user_loss`` carries its own batched form (``.batched``).
        self._batched_loss = (
            batched_loss(loss) if isinstance(loss, str) else getattr(loss, "batched", None) or torch.vmap(self.loss_fn)
        )
        self._scratch = ScratchBuffers(model)
        self.buffers = self._scratch.originals  # never passed to a forward: copies are (ScratchBuffers)
        self._isolation_checked = False
        self._isolation_refused: ConfigError | None = None
        self._call = ParamSwap(model)
        self.chunk_size = chunk_size
        self.param_names = [k for k, p in model.named_parameters() if p.requires_grad]
        self.requested_method = _check_method(method if method is not None else DEFAULT_METHOD)
        self._ghost = None
        self._checked = self.requested_method != "auto"
        self.fallback_reason: str | None = None
        if self.requested_method != "vmap":
            reason = ghost.unsupported_reason(model)
            if reason is None:
                self._ghost = ghost.GhostEngine(model, self._batched_loss)
            elif self.requested_method == "ghost":
                raise ConfigError(
                    f"method='ghost' cannot handle this model: {reason}. Use method='auto' (falls "
                    "back to vmap) or method='vmap'."
                )
            else:
                self.fallback_reason = reason

        def one(params: Tensors, buffers: Tensors, x: Any, y: torch.Tensor) -> torch.Tensor:
            args, kwargs = inputs.args_kwargs(inputs.tmap(lambda t: t.unsqueeze(0), x))
            out = functional_call(self.model, (params, buffers), args, kwargs)
            return self.loss_fn(out.squeeze(0), y)

        self._per_sample = vmap(
            grad_and_value(one), in_dims=(None, None, 0, 0), randomness="different", chunk_size=chunk_size
        )

    @property
    def method(self) -> str:
        """The implementation in use: 'ghost' or 'vmap'."""
        return "ghost" if self._ghost is not None else "vmap"

    def _fall_back(self, reason: str) -> None:
        if self.requested_method == "ghost":
            raise ConfigError(f"method='ghost' cannot handle this model: {reason}. Use method='auto' or 'vmap'.")
        warnings.warn(f"dptune: per-sample gradients fall back to vmap ({reason}).", RuntimeWarning, stacklevel=3)
        self.fallback_reason = reason
        self._ghost = None

    def __call__(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> MaterializedGrads:
        # Exact products for the whole private computation (ieee_matmul says why); the lazy
        # ghost norms and sums enter it again when they are computed.
        with ieee_matmul(inputs.device_of(x)):
            return self._compute(params, x, y)

    def _compute(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> MaterializedGrads:
        if (
            inputs.batch_len(x) == 0
        ):  # an empty Poisson batch: no contribution, but the step (and its noise) still happen
            return MaterializedGrads(
                {k: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for k, p in params.items()},
                torch.zeros(0, device=inputs.device_of(x)),
            )
        if self._ghost is not None:
            try:
                with self._scratch() as buffers:
                    got = self._ghost(params, x, y, buffers)
            except ghost.GhostFallback as exc:
                self._fall_back(str(exc))
            else:
                if self._checked or self._self_check(got, params, x, y):
                    return got
        grads, losses = self._vmap(params, x, y)
        return MaterializedGrads(grads, losses.detach())

    def _vmap(self, params: Tensors, x: Any, y: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        with self._scratch() as buffers:
            try:
                return self._per_sample(params, buffers, x, y)
            except RuntimeError:
                # functorch refuses most in-place writes to a buffer (a batched value into an
                # unbatched tensor); a plain forward tells whether that was it, in one line.
                if self.buffers:
                    self._probe_buffers(params, x)
                raise

    def _probe_buffers(self, params: Tensors, x: Any) -> None:
        """Raise ``ScratchBuffers``' ConfigError if a plain forward of one example writes a buffer."""
        try:
            with torch.no_grad(), rng_preserved(inputs.device_of(x)), self._scratch() as buffers:
                self._call(params, buffers, inputs.rows(x, 0, 1))
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - the original error is the one to report
            return

    def _self_check(self, got: ghost.GhostGrads, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Compare the ghost path with vmap on the first few examples (once per oracle)."""
        self._checked = True
        if active_dropout(self.model):
            return True  # random masks differ between the two paths: nothing to compare
        k = min(self.SELF_CHECK_EXAMPLES, inputs.batch_len(x))
        ref_g, ref_l = self._vmap(params, inputs.rows(x, 0, k), y[:k])
        ref = MaterializedGrads(ref_g, ref_l.detach())
        w = torch.zeros_like(got.norms)
        w[:k] = torch.linspace(0.5, 1.5, k, dtype=w.dtype, device=w.device)
        mine, theirs = got.weighted_sum(w), ref.weighted_sum(w[:k])
        got.reset_reuse()  # this probe must not seed the reuse of weighted sums
        # Both norms are upper bounds (never a privacy check: each path bounds what it releases
        # on its own, docs/privacy.md); ghost norms and sums may differ from vmap's by the release
        # term E_i (``GhostGrads.release_err``: large only for ill-conditioned examples).
        err = got.release_err()
        e = err[:k].to(ref.norms.dtype) if err is not None else torch.zeros_like(ref.norms)
        diff = (got.norms[:k] - ref.norms).abs()
        ok = bool(((diff <= 1e-3 * ref.norms + 1e-6 + 2 * e) | (got.norms[:k].isnan() & ref.norms.isnan())).all())
        e_sum = 2 * float((w[:k].abs() * e).sum())
        ok = ok and all(
            torch.allclose(mine[n], theirs[n], rtol=1e-3, atol=1e-6 * (1 + float(theirs[n].abs().max())) + e_sum)
            for n in theirs
        )
        if not ok:
            self._fall_back("the ghost path disagreed with vmap on a probe (is a parameter used outside its layer?)")
        return ok

    def loss_and_grad(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        """Mean loss and its (non-private) gradient: one ordinary backward pass."""
        ps = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with self._scratch() as buffers:
            out = self._call(ps, buffers, x)
        losses = self._batched_loss(out, y) if out.shape[0] else out.sum() * 0
        loss = losses.mean() if out.shape[0] else losses
        g = torch.autograd.grad(loss, list(ps.values()), allow_unused=True)
        return loss.detach(), {
            k: (gi if gi is not None else torch.zeros_like(ps[k])) for k, gi in zip(ps, g, strict=True)
        }

    def forward(self, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        with self._scratch() as buffers:
            return self._call(params, buffers, x)

    def losses(self, params: Tensors, x: Any, y: torch.Tensor) -> torch.Tensor:
        """The [B] per-example losses at ``params``, no gradient (zeroth-order privatizers).
        Private per-example values: only privatizers may read them."""
        if self._isolation_refused is not None:  # final: a retried step is refused again
            raise self._isolation_refused
        if inputs.batch_len(x) == 0:
            return torch.zeros(0, device=inputs.device_of(x))
        with torch.no_grad(), ieee_matmul(inputs.device_of(x)):
            out = self._plain_losses(params, x, y)
            if not self._isolation_checked and inputs.batch_len(x) > 1:
                self._check_isolation(params, x, y)
        return out

    def _plain_losses(self, params: Tensors, x: Any, y: torch.Tensor) -> torch.Tensor:
        with self._scratch() as buffers:
            return self._batched_loss(self._call(params, buffers, x), y).detach()

    def _check_isolation(self, params: Tensors, x: Any, y: torch.Tensor) -> None:
        """Refuse a batched loss whose row i depends on other examples (once, on the first batch of ≥ 2).

        DP-ZO's sensitivity C assumes that adding an example changes one term clip_C(d_i) only;
        the per-sample gradient paths run each example alone (vmap) or are checked against that
        (ghost), but ``losses`` is one batched forward and the user's batched loss. So the first
        few rows are recomputed one example at a time and compared (in eval mode for both: masks
        are drawn per batch shape; torch's random streams left as they were). A refusal is final
        for this oracle (a retried step is refused again). What it cannot see:
        mixing below the tolerance, on later batches only, or in rows beyond the first few
        (docs/privacy.md, DP-ZO)."""
        k = min(self.SELF_CHECK_EXAMPLES, inputs.batch_len(x))
        # Eval mode for both (any training-mode randomness off: nn.Dropout, F.dropout(training=...),
        # DropPath), torch's random streams left as they were.
        with rng_preserved(inputs.device_of(x)), eval_mode(self.model):
            full = self._plain_losses(params, x, y)[:k]
            alone = torch.cat(
                [self._plain_losses(params, inputs.rows(x, i, i + 1), y[i : i + 1]).reshape(-1) for i in range(k)]
            )
        # Float rounding differs with the batch shape (kernel blocking): allow √eps of the coarsest
        # dtype computed in (a bf16 model whose loss upcasts rounds like bf16), relative.
        dtypes = {t.dtype for t in params.values() if t.is_floating_point()} | {full.dtype}
        tol = math.sqrt(max(torch.finfo(d).eps for d in dtypes)) * (1 + full.abs())
        same = ((full - alone).abs() <= tol) | (full == alone) | (full.isnan() & alone.isnan())
        if bool(same.all()):
            self._isolation_checked = True
        else:
            # No values in the message: they are private (and not differentially private).
            self._isolation_refused = ConfigError(
                "the loss of an example depends on other examples of the batch (on the first batch, an "
                "example's loss computed within the batch differs from its loss computed alone): "
                "DP-ZO bounds one example's influence by C only if each example's loss is its own (a "
                "batch-centred or in-batch contrastive loss, or a layer that mixes examples, breaks "
                "that). Fix: return each example's own loss, e.g. F.cross_entropy(out, y, reduction='none'), "
                "without batch statistics or in-batch negatives."
            )
            raise self._isolation_refused
