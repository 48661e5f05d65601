"""CUDA graphs of the ghost path: a run alone on a GPU is host-bound, so the forward, backward, rules and norms are
captured once as one graph, the weighted sum as a second, and both replayed each step. A Poisson batch of B rows is
padded to the captured size P ≥ B with copies of its first row at weight 0 (a padded row adds 0·g = 0 exactly:
docs/privacy.md, item 11). A non-finite norm, a probed step, a batch larger than P or a capture the model refuses (a
host read inside) run eagerly; ``DPTUNE_CUDA_GRAPHS=0`` turns graphs off."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dptune import inputs
from dptune.gradients.norm_bounds import weights_dtype
from dptune.gradients.persample import MaterializedGrads
from dptune.tree import Accumulated, Flat, Tensors, packed

Run = Callable[[Tensors, Any, torch.Tensor], Any]  # (params, x, y) → the ghost path's gradients (``GhostGrads``)
ENABLED = os.environ.get("DPTUNE_CUDA_GRAPHS", "1") != "0"
# Graphs only where padding adds at most half the work: a batch of 32 pads to 64 rows, twice the GPU work
# and twice the kept per-example state (a transformer's largest tensors), for the host time it saves.
try:
    MAX_PADDING = float(os.environ.get("DPTUNE_GRAPH_MAX_PADDING", "1.5"))
except ValueError:  # a mistyped knob: the default, said once
    MAX_PADDING = 1.5
    warnings.warn("dptune: DPTUNE_GRAPH_MAX_PADDING is not a number; using 1.5 (e.g. 3 forces graphs)", stacklevel=1)


def replayable(device: torch.device) -> bool:
    """Whether the ghost path on ``device`` is captured and replayed (CUDA, unless turned off)."""
    return ENABLED and device.type == "cuda"


def padded_size(batch: int) -> int:
    """The captured batch size for a batch of ``batch`` rows: ≈ 4 standard deviations of a Poisson batch
    above it, in multiples of 8 (a larger batch later is captured again, at its own size)."""
    return 8 * math.ceil((batch + 4 * math.sqrt(batch) + 8) / 8)


def capture(fn: Callable[[], None], pool: Any) -> Callable[[], None]:
    """``fn`` captured as a CUDA graph (pool given) and its replay; without a pool (the CPU, in tests) ``fn``
    itself, which recomputes the same outputs."""
    if pool is None:
        fn()
        return fn
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # a loader thread may copy
        fn()
    return graph.replay


class _Captured:
    """One bucket: static inputs and parameters, the two graphs and their outputs."""

    def __init__(self, run: Run, params: Tensors, x: Any, y: torch.Tensor, size: int):
        self.size, self.key = size, signature(params, x, y)
        self.loads = 0  # batches loaded: a Replayed's rows are those of the load it was made after
        self.params = {k: v.detach().clone() for k, v in params.items()}
        self.x = inputs.tmap(lambda t: t[:1].expand(size, *t.shape[1:]).clone(), x)
        self.y = y[:1].expand(size, *y.shape[1:]).clone()
        self._run = run
        cuda = self.y.device.type == "cuda"
        if cuda:  # warm-up (lazy initialisation, cuBLAS workspaces) on a side stream, off the capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward()
                    self.w = torch.zeros(size, dtype=weights_dtype(self.norms.dtype), device=self.y.device)
                    self._sum()
            torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle() if cuda else None
        self.forward = capture(self._forward, pool)
        self.w = torch.zeros(size, dtype=weights_dtype(self.norms.dtype), device=self.y.device)
        self.summing = capture(self._sum, pool)
        if cuda:  # the warm-up's blocks: back to the device, not kept beside the graph's pool
            torch.cuda.empty_cache()
        self.dtypes = {k: p.dtype for k, p in params.items()}

    def _forward(self) -> None:
        self.grads = self._run(self.params, self.x, self.y)
        self.norms = self.grads.norms

    def _sum(self) -> None:
        self.sums = self.grads.rows_sum(self.w)

    def load(self, params: Tensors, x: Any, y: torch.Tensor) -> None:
        B = y.shape[0]
        self.loads += 1
        torch._foreach_copy_(list(self.params.values()), [params[k] for k in self.params])
        for s, t in zip([*inputs.leaves(self.x), self.y], [*inputs.leaves(x), y], strict=True):
            s[:B].copy_(t)
            s[B:].copy_(t[:1].expand_as(s[B:]))


class Replayed(MaterializedGrads):
    """The replayed bucket's rows [:B]: norms and losses copied out, weighted sums by the second graph
    (weights of the padded rows 0). Per-example gradients, if asked for, from the bucket's tensors."""

    def __init__(self, cap: _Captured, batch: int):
        super().__init__({}, cap.grads.losses[:batch].clone())
        self._cap, self._b = cap, batch
        self._norms = cap.norms[:batch].clone()
        self._finite_norms = True  # checked over the whole bucket before this was made
        self._load = cap.loads

    def _live(self) -> _Captured:
        if self._load != self._cap.loads:  # the buffers now hold another batch's gradients, unbounded by these norms
            raise RuntimeError("dptune: replayed per-example gradients used after free() or another batch's replay")
        return self._cap

    def free(self) -> None:
        self._load = -1

    @property
    def grads(self) -> Tensors:  # type: ignore[override]
        self._live().grads._grads = None  # formed from this replay's tensors, not cached from an earlier one
        return {k: g[: self._b] for k, g in self._cap.grads.grads.items()}

    @grads.setter
    def grads(self, value: Tensors) -> None:
        pass  # MaterializedGrads.__init__'s empty dict

    def weighted_sum(self, weights: torch.Tensor, *, drop_nonfinite: bool = True) -> Accumulated:
        cap = self._live()
        cap.w.zero_()
        cap.w[: self._b].copy_(weights)
        cap.summing()
        wide = packed(cap.sums, torch.float64, cap.w.device)  # the next replay overwrites the sums
        return Accumulated(wide, cap.dtypes)


def signature(params: Tensors, x: Any, y: torch.Tensor) -> tuple:
    """What a capture's static buffers are shaped and typed by: each input's shape past the batch and dtype
    (a batch padded to its longest text changes T), each parameter's shape and dtype (``model.double()``)."""
    ins = tuple((t.shape[1:], t.dtype) for t in (*inputs.leaves(x), y))
    if isinstance(params, Flat) and params.base is not None:  # one buffer: its layout and dtype (no walk)
        return ins, params.layout, params.base.dtype
    return ins, tuple((p.shape, p.dtype) for p in params.values())


def fingerprint(mods: list[nn.Module]) -> tuple:
    """What a captured graph reads besides its inputs and trainable parameters, by address (buffers, frozen
    weights), and the modules' training flags (dropout): a change between steps makes a new capture.
    ``mods``: the model's modules, listed at the capture (``model.modules()`` each step: ~8 µs a module)."""
    fixed = (t for m in mods for t in (*m._buffers.values(), *m._parameters.values()) if t is not None)
    return tuple(m.training for m in mods), tuple(t.data_ptr() for t in fixed if not t.requires_grad)


class Graphs:
    """The captured bucket of one ``GradientOracle``, sized from the largest batch it has seen (a batch above the size
    is captured again at ``padded_size`` of it: a few times a run, Poisson batches being concentrated)."""

    def __init__(self, run: Run, model: nn.Module):
        self._run, self._model = run, model
        self._cap: _Captured | None = None
        self._fingerprint: tuple = ()
        self._mods: list[nn.Module] = []
        self.off_reason: str | None = None  # why graphs are off for this oracle (then every step is eager)
        self.replays = self.eager = 0

    def __call__(self, params: Tensors, x: Any, y: torch.Tensor) -> Replayed | None:
        """The replayed gradients of this batch, or None: compute it eagerly."""
        B = y.shape[0]
        # The model changed between steps (a buffer re-bound, eval mode), or a larger batch than any before
        # came (sizes only grow): captured again.
        key = signature(params, x, y)
        if self._cap is not None and (
            fingerprint(self._mods) != self._fingerprint or self._cap.size < B or self._cap.key != key
        ):
            self._cap = None
        if self._cap is None and self.off_reason is None:
            if padded_size(B) > MAX_PADDING * B:
                self.off_reason = f"a batch of {B} would be padded to {padded_size(B)} rows (> {MAX_PADDING}×)"
            else:
                try:
                    self._mods = list(self._model.modules())
                    self._fingerprint = fingerprint(self._mods)
                    self._cap = _Captured(self._run, params, x, y, padded_size(B))
                except Exception as exc:  # noqa: BLE001 - any refusal of the capture: this oracle runs eagerly
                    self.off_reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    warnings.warn(
                        f"dptune: CUDA graphs off for this model ({self.off_reason}).", RuntimeWarning, stacklevel=4
                    )
        if self._cap is None:  # not captured: graphs are off for this oracle (``off_reason``, set above or before)
            self.eager += 1
            return None
        cap = self._cap
        cap.load(params, x, y)
        cap.forward()
        if not bool(torch.isfinite(cap.norms).all()):  # the step's one host read; a non-finite row: eager
            self.eager += 1
            return None
        self.replays += 1
        return Replayed(cap, B)
