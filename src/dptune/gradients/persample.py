"""Per-example gradients as the strategies see them, shared by both paths (``grads`` for vmap, ``ghost`` for ghost
norms): the ``PerSampleGrads`` interface (norms ‖g_i‖ and weighted sums Σ_i w_i g_i, all a privatizer reads), the vmap
path's materialised container, the model checks, the built-in losses, ``ParamSwap`` (functional calls without the module
walk), the buffer, mode and random-stream guards of a private pass; the float bounds are in ``norm_bounds``.
``oracle.GradientOracle`` chooses the path; this module imports neither, so neither imports the other."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.parametrizations import _SpectralNorm as _ParametrizedSpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm as _HookSpectralNorm

from dptune import inputs
from dptune.errors import ConfigError
from dptune.gradients.norm_bounds import flat_rows, ieee_matmul, sq_rows_upper, upper_norms, wide_sum
from dptune.tree import Accumulated, Tensors, differs

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


_CROSS_SAMPLE = (nn.modules.batchnorm._BatchNorm,)


def check_model(model: nn.Module) -> None:
    """Reject layers whose output for one example depends on the others (e.g. BatchNorm), and
    layers that keep running statistics of their inputs (``track_running_stats=True``): those
    would store exact, un-noised statistics of the private batches in the model's buffers, which
    the saved model publishes (every forward on private data is also guarded: ``ScratchBuffers``)."""
    for name, mod in model.named_modules():
        where = f"layer '{name or type(mod).__name__}' ({type(mod).__name__})"
        if isinstance(mod, _CROSS_SAMPLE):
            raise ConfigError(
                f"{where} mixes examples across the batch, so per-example gradients (and DP) are "
                "undefined. Fix: replace it with nn.GroupNorm or nn.LayerNorm (e.g. nn.GroupNorm(min(32, C), C))."
            )
        if getattr(mod, "track_running_stats", False) is True:
            raise ConfigError(
                f"{where} has track_running_stats=True: in training it stores running statistics of the "
                "private batches in its buffers, which are not differentially private and would be saved with the "
                "model. Fix: build it with track_running_stats=False, or use nn.GroupNorm / nn.LayerNorm."
            )
        if getattr(mod, "max_norm", None) is not None:  # renormalises its weight's rows in place: the batch's tokens
            raise ConfigError(f"{where} has max_norm set: it rescales the rows of the tokens in each private batch "
                              "in place, without noise. Fix: max_norm=None.")  # fmt: skip
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


def batched_loss(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The [B] vector of ``per_example_loss(name)`` over a batch, without vmap (faster)."""
    F = nn.functional
    if name == "cross_entropy":
        return lambda out, y: F.cross_entropy(out, y, reduction="none")
    if name == "mse":
        return lambda out, y: F.mse_loss(out, y, reduction="none").reshape(out.shape[0], -1).mean(1)
    if name == "bce":
        return lambda out, y: F.binary_cross_entropy_with_logits(
            out.reshape(out.shape[0]), y.float().reshape(out.shape[0]), reduction="none"
        )
    raise ConfigError(f"unknown loss {name!r}; choose cross_entropy, mse or bce")


class PerSampleGrads(Protocol):
    """What strategies may read from one batch's per-example gradients."""

    losses: torch.Tensor  # [B]
    norms: torch.Tensor  # [B], L2 norm over all trainable parameters

    def weighted_sum(self, weights: torch.Tensor, *, drop_nonfinite: bool = True) -> Tensors:
        """Σ_i weights[i] · g_i, per parameter; rows with a non-finite g_i contribute 0."""


class ParamSwap:
    """``torch.func.functional_call``'s reparametrisation with the module walk done once (docs/performance.md §1): the
    slots (each module's ``_parameters`` / ``_buffers`` entries, under every name the model lists, tied ones included)
    are collected once; a call swaps the given tensors in, runs the model and swaps the originals back. Same semantics
    as ``functional_call(..., tie_weights=True, strict=False)``. When the model changed since, the slots are rebuilt; a
    name still unknown is left to ``functional_call`` itself."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._slots, self._known = self._build()

    def _build(self) -> tuple[list[tuple[dict, str, Any, tuple[str, ...]]], set[str]]:
        named = [
            *self.model.named_parameters(remove_duplicate=False),
            *self.model.named_buffers(remove_duplicate=False),
        ]
        names: dict[int, list[str]] = {}
        for n, t in named:
            names.setdefault(id(t), []).append(n)
        slots: list[tuple[dict, str, Any, tuple[str, ...]]] = []
        for mod in self.model.modules():
            for store in (mod._parameters, mod._buffers):
                for k, t in store.items():
                    if t is not None:  # the slot holds t, so id(t) stays valid
                        slots.append((store, k, t, tuple(names[id(t)])))
            # Submodules are checked, never swapped: a replaced layer must not keep old slots.
            slots.extend((mod._modules, k, m, ()) for k, m in mod._modules.items())
        return slots, {n for n, _ in named}

    def swap_in(self, *dicts: Tensors) -> list[tuple[dict, str, torch.Tensor]] | None:
        """Put the tensors of ``dicts`` into the model; what ``restore`` needs, or None when
        the model has no slot for some given name (then use ``functional_call``)."""
        for rebuild in (False, True):
            if rebuild:
                self._slots, self._known = self._build()
            if not all(d.keys() <= self._known for d in dicts):
                continue
            swapped: list[tuple[dict, str, torch.Tensor]] = []
            for store, k, t, ns in self._slots:
                if store.get(k) is not t:  # a tensor of the model was replaced since _build
                    self.restore(swapped)
                    break
                v = _lookup(dicts, ns) if ns else None
                if v is not None:
                    store[k] = v
                    swapped.append((store, k, t))
            else:
                return swapped
        return None

    @staticmethod
    def restore(swapped: list[tuple[dict, str, torch.Tensor]]) -> None:
        for store, k, t in swapped:
            store[k] = t

    def __call__(self, tensors: Tensors, buffers: Tensors, x: Any) -> torch.Tensor:
        """``functional_call(model, (tensors, buffers), x)``, x a tensor, tuple or dict (``dptune.inputs``)."""
        args, kwargs = inputs.args_kwargs(x)
        swapped = self.swap_in(tensors, buffers)
        if swapped is None:
            return functional_call(self.model, (tensors, buffers), args, kwargs)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.restore(swapped)


def _lookup(dicts: tuple[Tensors, ...], names: tuple[str, ...]) -> torch.Tensor | None:
    return next((d[n] for d in dicts for n in names if d.get(n) is not None), None)


# Incremented whenever any module registers or re-binds a buffer (a global torch hook, set once): ScratchBuffers then
# re-reads its model's buffers, and a registration during a private forward is refused.
_BUFFER_GENERATION = [0]


def _count_registration(module: nn.Module, name: str, buffer: torch.Tensor | None) -> None:
    _BUFFER_GENERATION[0] += 1


torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)
torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)  # a Parameter made in forward


def _data_independent_buffers(model: nn.Module) -> set[str]:
    """Buffers whose in-forward updates depend on the weights only, never on the inputs: spectral
    normalisation's power-iteration vectors (both torch APIs). They keep being updated in place."""
    out: set[str] = set()
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(mod, _ParametrizedSpectralNorm):
            out.update(prefix + b for b in mod._buffers)
        for hook in mod._forward_pre_hooks.values():
            if isinstance(hook, _HookSpectralNorm):
                out.update({f"{prefix}{hook.name}_u", f"{prefix}{hook.name}_v"})
    return out


class ScratchBuffers:
    """Every forward on private data runs on fresh copies of the model's buffers (``with scratch() as buffers``),
    discarded after it; a write (also from a backward hook, undone), a buffer registered during the forward
    (removed) or a frozen parameter written is refused with a ``ConfigError`` before the step's release, also
    when the forward then failed. A refusal is final. Buffers changed between steps are picked up before the next
    forward; spectral norm's vectors pass through. Free without buffers. docs/privacy.md, "Sharp edges"."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._refused: ConfigError | None = None
        self._frozen: list[nn.Parameter] = []
        self._print: torch.Tensor | None = None
        self._calls = 0
        self._refresh()

    def _refresh(self) -> None:
        self._generation = _BUFFER_GENERATION[0]
        self.originals: Tensors = dict(self.model.named_buffers())
        self._known = {n for n, _ in (*self.model.named_parameters(remove_duplicate=False),
                                      *self.model.named_buffers(remove_duplicate=False))}  # fmt: skip
        self._slots = [(mod, b, t) for mod in self.model.modules() for b, t in mod._buffers.items() if t is not None]
        self.passthrough = _data_independent_buffers(self.model) if self.originals else set()
        frozen = [p for p in self.model.parameters() if not p.requires_grad]
        if [id(p) for p in frozen] != [id(p) for p in self._frozen]:  # else keep the run's baseline
            self._frozen, self._calls = frozen, 0
            self._print = self._fingerprint()

    def _fingerprint(self) -> torch.Tensor | None:
        """The frozen parameters' float64 sums and norms: a write through ``.data`` moves no version counter."""
        with torch.no_grad():
            two = [torch.stack([p.sum(dtype=torch.float64), p.norm(dtype=torch.float64)]).cpu() for p in self._frozen]
        return torch.stack(two) if two else None

    def check_frozen(self, before: torch.Tensor | None = None) -> None:
        """Refuse a frozen parameter written without autograd seeing it (``p.data.mul_``: found in review), against
        ``before`` (a private forward's start: your own changes between steps stay yours), else the run's start."""
        now, then = self._fingerprint(), self._print if before is None else before
        if now is not None and then is not None and not torch.allclose(now, then, rtol=0, atol=0, equal_nan=True):
            moved = [n for (n, _), a, b in zip(self._frozen_names(), now, then, strict=True) if not a.equal(b)]
            self._refuse(moved, "frozen parameter(s)")

    def _current(self) -> None:
        if self._generation != _BUFFER_GENERATION[0] or any(mod._buffers.get(b) is not t for mod, b, t in self._slots):
            self._refresh()  # the user's change between steps: accepted

    @contextmanager
    def __call__(self, public: bool = False) -> Iterator[Tensors]:  # public: a dummy before any private pass
        if self._refused is not None:
            raise self._refused
        self._current()
        if public:
            yield self.originals
            return self._refresh()
        generation = _BUFFER_GENERATION[0]
        frozen = [version_of(p) for p in self._frozen]
        self._calls += 1  # the frozen values compared around forwards 1, 2, 4, …, then every 64th
        due = self._calls & (self._calls - 1) == 0 or self._calls % 64 == 0
        start = self._fingerprint() if due else None
        before = {k: version_of(v) for k, v in self.originals.items()}
        copies = {k: v if k in self.passthrough else v.detach().clone() for k, v in self.originals.items()}
        versions = {k: version_of(v) for k, v in copies.items()}
        try:
            yield copies if self.originals else self.originals
        finally:  # also when the forward failed: a write before the failure is refused as such
            self._check(copies, versions, before)
            if generation != _BUFFER_GENERATION[0]:
                self._refuse_new()
            if due:
                self.check_frozen(start)
            if any(version_of(p) != v for p, v in zip(self._frozen, frozen, strict=True)):
                moved = [n for (n, p), v in zip(self._frozen_names(), frozen, strict=True) if version_of(p) != v]
                self._refuse(moved, "frozen parameter(s)")

    def _check(self, copies: Tensors, versions: dict[str, int], before: dict[str, int]) -> None:
        written = [
            k
            for k, v in copies.items()
            if k not in self.passthrough
            and (version_of(v) != versions[k] or version_of(self.originals[k]) != before[k] or versions[k] < 0)
        ]
        if written and not _same_values(self.originals, copies, written):
            with torch.no_grad():  # a write to the model's own buffer (a backward hook): undone
                for k in written:
                    if version_of(self.originals[k]) != before[k] and version_of(copies[k]) == versions[k] >= 0:
                        self.originals[k].copy_(copies[k])  # the copy still holds the value from before
            self._refuse(written)

    def _frozen_names(self) -> list[tuple[str, torch.Tensor]]:
        ids = {id(p) for p in self._frozen}
        named = {id(p): n for n, p in self.model.named_parameters() if id(p) in ids}
        return [(named.get(id(p), "?"), p) for p in self._frozen]

    def _refuse_new(self) -> None:
        """Buffers or parameters registered during the forward (a lazily created cache) are removed, then refused."""
        new = [
            (store, name, b)
            for mod_name, mod in self.model.named_modules()
            for store in (mod._buffers, mod._parameters)
            for b in list(store)  # a shared tensor's second name is known (found in review: a mask was deleted)
            if (name := f"{mod_name}.{b}" if mod_name else b) not in self._known
        ]
        if new:
            for store, _, b in new:
                del store[b]
            self._refuse([name for _, name, _ in new])
        self._refresh()  # another model's registration (same process): nothing of ours changed

    def _refuse(self, names: list[str], what: str = "buffer(s)") -> None:
        self._refused = ConfigError(
            f"the model wrote its {what} {', '.join(names)} during a pass on private data (a layer that "
            "keeps running statistics or a cache of its inputs): those values are not differentially private and "
            "would be saved with the model. Fix: make the layer's forward leave its buffers and frozen parameters "
            "unchanged (for a normalisation layer: nn.GroupNorm / nn.LayerNorm, or track_running_stats=False)."
        )
        raise self._refused


def version_of(t: torch.Tensor | None) -> int:
    """t's in-place write counter; -1 for no tensor or an inference tensor (none kept: values are compared)."""
    return -1 if t is None or t.is_inference() else t._version


def _same_values(a: Tensors, b: Tensors, names: list[str]) -> bool:
    """Do a[k] and b[k] hold the same values for every k in names (NaN equal to NaN)? One host read."""
    flags: list[torch.Tensor] = []
    for k in names:
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            return False
        flag = differs(x, y)
        flags.append(flag.to(flags[0].device) if flags else flag)
    return not bool(torch.stack(flags).any())


RngState = tuple[torch.Tensor, list[torch.Tensor] | torch.Tensor | None]


def rng_state(device: torch.device) -> RngState:
    """torch's global CPU generator state and that of ``device``'s kind (every CUDA device: a model split over several
    draws on each; or MPS): what random layers such as dropout draw from. Host-side state only (no device sync)."""
    dev: list[torch.Tensor] | torch.Tensor | None = None
    if device.type == "cuda":
        dev = torch.cuda.get_rng_state_all()
    elif device.type == "mps":
        dev = torch.mps.get_rng_state()
    return torch.get_rng_state(), dev


def set_rng_state(device: torch.device, state: RngState) -> None:
    torch.set_rng_state(state[0])
    if isinstance(state[1], list):
        torch.cuda.set_rng_state_all(state[1])
    elif state[1] is not None:
        torch.mps.set_rng_state(state[1])


@contextmanager
def rng_preserved(device: torch.device) -> Iterator[None]:
    """Run a block without moving torch's, numpy's, ``random``'s streams (a probe; a run: its secret mask seeds)."""
    state, np_state, py_state = rng_state(device), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        set_rng_state(device, state)
        np.random.set_state(np_state)
        random.setstate(py_state)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block (dropout and any other training-mode randomness off),
    each module's own mode restored afterwards (a module the user froze in eval mode stays so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class MaterializedGrads:
    """Per-sample gradients held in memory as [B, *param.shape] tensors."""

    def __init__(self, grads: Tensors, losses: torch.Tensor):
        self.grads = grads
        self.losses = losses
        self._norms: torch.Tensor | None = None
        self._finite_norms: bool | None = None  # ``nonfinite_rows``' verdict on the norms

    @property
    def batch_size(self) -> int:
        return int(self.losses.shape[0])

    def free(self) -> None:
        """Drop the per-example state once the step's sums are formed (``StepContext.publish``); the norms
        (computed by then) and losses stay. A later sum is a bug: it fails, never returns a partial one."""
        self.grads = None  # type: ignore[assignment]

    @property
    def norms(self) -> torch.Tensor:
        """Upper bounds N_i ≥ ‖g_i‖ of the stored g_i (``upper_norms``): w_i·g_i as released by
        ``weighted_sum`` has norm ≤ |w_i|·N_i, whatever the rounding."""
        if self._norms is None:
            # In the gradients' dtype (float64 gradients keep float64 norms, as before).
            dts = [g.dtype for g in self.grads.values()]
            dt = functools.reduce(torch.promote_types, dts) if dts else self.losses.dtype
            self._norms = upper_norms([sq_rows_upper(g) for g in self.grads.values()], self.losses, dt, dts)
        return self._norms

    def weighted_sum(self, weights: torch.Tensor, *, drop_nonfinite: bool = True) -> Accumulated:
        """Σ_i w_i g_i, accumulated in float64 (``wide_sum``). Rows with a non-finite gradient are
        left out (``nonfinite_rows``) unless ``drop_nonfinite=False`` (a non-private gradient)."""
        with ieee_matmul(weights.device):
            out = self.rows_sum(weights, None)
            bad = nonfinite_rows(self, out) if drop_nonfinite else None
            if bad is not None:
                keep = (~bad).nonzero().squeeze(1)
                out = self.rows_sum(weights[keep], keep)
        return Accumulated(out, {k: g.dtype for k, g in self.grads.items()})

    def rows_sum(self, weights: torch.Tensor, rows: torch.Tensor | None) -> Tensors:
        """Σ_j weights_j g_{rows_j} in float64 (all rows when ``rows`` is None), as ``GhostGrads.rows_sum``."""
        return {
            k: wide_sum(weights, flat_rows(g) if rows is None else flat_rows(g)[rows]).reshape(g.shape[1:])
            for k, g in self.grads.items()
        }


def nonfinite_rows(grads: MaterializedGrads, out: Tensors) -> torch.Tensor | None:
    """The rows whose gradient is not finite, left out of a weighted sum (a per-example rule: the sensitivity
    holds; docs/privacy.md, item 10), or None. One check of the norms or the sum when all is well."""
    norms = grads._norms
    if norms is not None:  # the verdict is kept with the norms: OSO's second sum reads nothing
        ok = getattr(grads, "_finite_norms", None)
        if ok is None:
            ok = grads._finite_norms = bool(torch.isfinite(norms).all())
    else:
        total = sum((v.sum() for v in out.values()), torch.zeros((), dtype=grads.losses.dtype))
        ok = bool(torch.isfinite(total))
    if ok:
        return None
    bad = ~torch.isfinite(grads.norms)
    return bad if bool(bad.any()) else None
