"""Per-example gradients as the strategies see them, and the arithmetic that bounds them.

The pieces that both gradient paths share (``grads`` for vmap, ``ghost`` for ghost norms): the
``PerSampleGrads`` interface (norms ‖g_i‖ and weighted sums Σ_i w_i g_i, the only things a
privatizer reads), the materialised container of the vmap path, the model checks, the built-in
per-example losses, ``ParamSwap`` (functional calls without the module walk) and the float bounds
that make every norm an upper bound of what is released (``upper_norms``, ``ieee_matmul``;
derivation: docs/privacy.md, "Norm bounds"). ``grads.GradientOracle`` chooses the path; this
module imports neither, so neither imports the other.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.parametrizations import _SpectralNorm as _ParametrizedSpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm as _HookSpectralNorm

from dptune import inputs
from dptune.errors import ConfigError
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
                "private batches in its buffers, which are not differentially private and would be saved "
                "with the model. Fix: build it with track_running_stats=False, or use nn.GroupNorm / "
                "nn.LayerNorm."
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
        ...


class ParamSwap:
    """``torch.func.functional_call``'s reparametrisation with the module walk done once
    (docs/performance.md §1): the slots (each module's ``_parameters`` / ``_buffers`` entries,
    under every name the model lists, tied ones included) are collected once; a call swaps the
    given tensors in, runs the model and swaps the originals back. Same semantics as
    ``functional_call(..., tie_weights=True, strict=False)``. When the model changed since, the
    slots are rebuilt; a name still unknown is left to ``functional_call`` itself.
    """

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
    for d in dicts:
        for n in names:
            v = d.get(n)
            if v is not None:
                return v
    return None


# Incremented whenever any module registers or re-binds a buffer (a global torch hook, set once):
# ScratchBuffers then re-reads its model's buffers, and a registration during a private forward is
# refused. Cheap: one integer per registration.
_BUFFER_GENERATION = [0]


def _count_registration(module: nn.Module, name: str, buffer: torch.Tensor | None) -> None:
    _BUFFER_GENERATION[0] += 1


torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)


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
    """Every forward pass on private data runs on fresh copies of the model's buffers.

    A layer that writes a buffer in its forward (running statistics, a cache) would otherwise
    store exact statistics of a private batch in the model (published with it) and carry them
    into later steps. ``with scratch() as buffers:`` hands out copies made just before the
    forward and discarded after it, so nothing written into them can reach the model or a later
    step (a write to the model's own buffer, from a backward hook, is undone); on leaving, a write
    is refused (``ConfigError``, before the step's release): such a
    model does not train as its author expects, and a value written and read within one batched
    forward mixes examples. Also refused: a buffer registered during the forward (removed from
    the model again), and a write to a frozen parameter (``requires_grad=False``, used as a
    statistic). A refusal is final for this model: a retried step is refused again.

    Buffers the user registers or re-binds between steps (or moves with ``.to``) are picked up
    before the next forward. Spectral normalisation's vectors (weights only) are passed through.
    Free for a model without buffers (the same empty dict); otherwise one clone per buffer and
    forward, and integer version counters compared; the values (one host read) only when a
    counter moved, so a write of the unchanged value is accepted.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._refused: ConfigError | None = None
        self._refresh()

    def _refresh(self) -> None:
        self._generation = _BUFFER_GENERATION[0]
        self.originals: Tensors = dict(self.model.named_buffers())
        self._slots = [(mod, b, t) for mod in self.model.modules() for b, t in mod._buffers.items() if t is not None]
        self._passthrough = _data_independent_buffers(self.model) if self.originals else set()
        self._frozen = [p for p in self.model.parameters() if not p.requires_grad]

    def _current(self) -> None:
        if self._generation != _BUFFER_GENERATION[0] or any(mod._buffers.get(b) is not t for mod, b, t in self._slots):
            self._refresh()  # the user's change between steps: accepted

    @contextmanager
    def __call__(self) -> Iterator[Tensors]:
        if self._refused is not None:
            raise self._refused
        self._current()
        generation = _BUFFER_GENERATION[0]
        frozen = [_version(p) for p in self._frozen]
        if not self.originals:
            yield self.originals
        else:
            before = {k: _version(v) for k, v in self.originals.items()}
            copies = {k: v if k in self._passthrough else v.detach().clone() for k, v in self.originals.items()}
            versions = {k: _version(v) for k, v in copies.items()}
            yield copies
            written = [
                k
                for k, v in copies.items()
                if k not in self._passthrough
                and (_version(v) != versions[k] or _version(self.originals[k]) != before[k] or versions[k] < 0)
            ]
            if written and not _same_values(self.originals, copies, written):
                with torch.no_grad():  # a write to the model's own buffer (a backward hook): undone
                    for k in written:
                        if _version(self.originals[k]) != before[k] and _version(copies[k]) == versions[k] >= 0:
                            self.originals[k].copy_(copies[k])  # the copy still holds the value from before
                self._refuse(written)
        if generation != _BUFFER_GENERATION[0]:
            self._refuse_new()
        if any(_version(p) != v for p, v in zip(self._frozen, frozen, strict=True)):
            moved = [n for (n, p), v in zip(self._frozen_names(), frozen, strict=True) if _version(p) != v]
            self._refuse(moved, "frozen parameter(s)")

    def _frozen_names(self) -> list[tuple[str, torch.Tensor]]:
        ids = {id(p) for p in self._frozen}
        named = {id(p): n for n, p in self.model.named_parameters() if id(p) in ids}
        return [(named.get(id(p), "?"), p) for p in self._frozen]

    def _refuse_new(self) -> None:
        """Buffers registered during the forward (a lazily created cache) are removed, then refused."""
        new = [
            (mod, name, b)
            for mod_name, mod in self.model.named_modules()
            for b in list(mod._buffers)
            if (name := f"{mod_name}.{b}" if mod_name else b) not in self.originals
        ]
        if new:
            for mod, _, b in new:
                del mod._buffers[b]
            self._refuse([name for _, name, _ in new])
        self._refresh()  # another model's registration (same process): nothing of ours changed

    def _refuse(self, names: list[str], what: str = "buffer(s)") -> None:
        self._refused = ConfigError(
            f"the model wrote its {what} {', '.join(names)} during a pass on private data (a layer that "
            "keeps running statistics or a cache of its inputs): those values are not differentially "
            "private and would be saved with the model. Fix: make the layer's forward leave its buffers "
            "and frozen parameters unchanged (for a normalisation layer: nn.GroupNorm / nn.LayerNorm, "
            "or track_running_stats=False)."
        )
        raise self._refused


def _version(t: torch.Tensor) -> int:
    """t's in-place write counter; -1 for an inference tensor (none kept: values are compared)."""
    return -1 if t.is_inference() else t._version


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
    """torch's global CPU generator state and that of ``device``'s kind (every CUDA device: a
    model split over several draws on each; or MPS): what random layers such as dropout draw
    from. Host-side state only (no device sync)."""
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
    """Run a block without moving torch's random streams (a probe must not shift a run's masks)."""
    state = rng_state(device)
    try:
        yield
    finally:
        set_rng_state(device, state)


def active_dropout(model: nn.Module) -> list[nn.Module]:
    """The dropout layers of ``model`` that draw masks now (training mode, p > 0)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0]


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


def _rows(g: torch.Tensor) -> torch.Tensor:
    """[B, *shape] → [B, prod(shape)] (also for B = 0, where reshape(0, -1) is ambiguous)."""
    return g.reshape(g.shape[0], math.prod(g.shape[1:]))


# ----------------------------------------------------------------------------- norms as upper bounds
# Every norm below is an upper bound on what is released for the example (else clipping would
# not bound it by C), proved in the standard model of floating-point arithmetic: a sum of n
# products in ANY order is within γ_n·Σ|terms| of its value, γ_n = n·u/(1 − n·u) (Higham 2002,
# Lemma 3.1); derivations and numbers: docs/privacy.md, item 1. Rows longer than NORM_BLOCK are
# summed in blocks (torch's fused vector_norm), the block sums in float64; ``upper_norms`` applies
# one slack to all, γ_{2056}: every float32 norm is ≈ 6.1e-5 above exact (float64: 1.1e-13).
NORM_BLOCK = 1024
# Added (squared) to every squared norm: covers the absolute underflow error of float32
# products (≤ n·2⁻¹⁴⁹ ≈ 1e-36 for n ≤ 2³¹ terms) and changes no norm above ~1e-12.
NORM_FLOOR = 1e-16


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps/2 of a floating dtype (2⁻²⁴ for float32, 2⁻⁵³ for float64)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: float, u: float) -> float:
    """γ_n = n·u/(1 − n·u) (inf when n·u ≥ 1: no bound)."""
    nu = n * u
    return nu / (1.0 - nu) if nu < 1.0 else math.inf


def sq_rows_upper(g: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(s, ρ) with Σ_j g_ij² ≤ s_i·(1 + ρ) for every row i of g ([B, *shape]), exactly.

    Assumes only that ``vector_norm`` returns the square root of a float sum of the products
    x·x (any order): then s ≥ Σx²·(1 − γ_n)(1 − u)³ ≥ Σx²·(1 − γ_{n+3}) for a row of
    n ≤ NORM_BLOCK (the root, and s = root² rounded: three more roundings; ρ uses n + 4). For
    longer rows each block of m obeys that, and the float64 sum of the k + 1 block squares
    costs (1 − γ⁶⁴_{k+3}) more.
    """
    flat = _rows(g)
    if flat.dtype in _HALF:  # bf16/fp16 sums would need a slack of ~n·2⁻⁸: sum in float32
        flat = flat.float()
    B, n = flat.shape
    u = unit_roundoff(flat.dtype)
    if n <= NORM_BLOCK:
        return torch.linalg.vector_norm(flat, dim=1).square_(), 1.0 / (1.0 - gamma(n + 4, u)) - 1.0
    m = NORM_BLOCK
    k = n // m
    s = torch.linalg.vector_norm(flat[:, : k * m].reshape(B, k, m), dim=2).double().square_().sum(1)
    if k * m < n:
        s += torch.linalg.vector_norm(flat[:, k * m :], dim=1).double().square_()
    u64 = unit_roundoff(torch.float64)
    return s, 1.0 / ((1.0 - gamma(m + 4, u)) * (1.0 - gamma(k + 4, u64))) - 1.0


_K_CACHE: dict[tuple[float, int, torch.dtype, torch.dtype], float] = {}
_HALF = (torch.float16, torch.bfloat16)


def _norm_factor(
    rho: float, terms: int, dtype: torch.dtype, model_dtype: torch.dtype, extra_rounding: bool = False
) -> float:
    """The smallest float K of ``dtype`` with K ≥ (1+γ'_2)·√((1+ρ)/(1−γ_{terms+1}))/(1−u)².

    (1 − γ_{terms+1}): the conversions and terms additions (τ² included) of ``upper_norms``'s
    sum of non-negative terms; (1 − u)²: its square root and the multiplication by K;
    (1 + γ'_2): the two roundings (w·b, then ·a) of the weighted sum's own scaling of a
    single example's terms, in the model's dtype (a released w_i·g_i has norm
    ≤ |w_i|·(1+γ'_2)·‖g_i‖); γ'_3 with ``extra_rounding`` (w cast to the model's dtype first).
    """
    key = (rho, terms, dtype, model_dtype, extra_rounding)
    got = _K_CACHE.get(key)
    if got is None:
        u = unit_roundoff(dtype)
        g = gamma(terms + 1, u)
        k = (
            (1.0 + gamma(3 if extra_rounding else 2, unit_roundoff(model_dtype)))
            * math.sqrt((1.0 + rho) / (1.0 - g))
            / (1.0 - u) ** 2
            if g < 1
            else math.inf
        )
        if math.isfinite(k):
            k *= 1.0 + 4 * unit_roundoff(torch.float64)  # this Python arithmetic's own roundings
            t = torch.tensor(k, dtype=torch.float64).to(dtype)
            if float(t) < k:
                t = torch.nextafter(t, torch.tensor(math.inf, dtype=dtype))
            k = float(t)
        got = _K_CACHE[key] = k
    return got


def upper_norms(
    parts: list[tuple[torch.Tensor, float]],
    like: torch.Tensor,
    dtype: torch.dtype | None = None,
    release_dtypes: Iterable[torch.dtype] = (),
) -> torch.Tensor:
    """Per-sample norms N_i ≥ (1+γ_2)·(Σ_l s_li·(1+ρ_l) + NORM_FLOOR²)^½, shaped like ``like``,
    in ``dtype`` (default: ``like``'s).

    ``release_dtypes``: the dtypes the weighted sums are computed in (the parameters'). The
    release's rounding allowance is that of the least precise one, with one more rounding (w
    cast to it) when it is less precise than the norms: a bf16 model whose loss is float32
    releases in bf16.

    ``parts``: (s_l, ρ_l) pairs, one per parameter (or per layer part), with ‖part_l of g_i‖²
    ≤ s_li·(1+ρ_l) and ‖released part_l of w·g_i‖ ≤ |w|·(1+γ_2)·(s_li(1+ρ_l))^½ (see
    ``sq_rows_upper`` and the layer rules of ``dptune.ghost``). Cost: the sum, a root and one
    multiplication per batch, as for the plain Euclidean norm.
    """
    out_dt = dtype if dtype is not None else like.dtype
    dt = torch.float32 if out_dt in _HALF else out_dt  # half-precision models: computed in float32
    sq: torch.Tensor | None = None
    # One slack for every path: the largest a float sum of squares in this module can need
    # (rows of ≤ NORM_BLOCK, or two of them multiplied: ‖a‖²‖b‖²), so that the ghost, vmap
    # and vectorised paths give the same norms up to their own float differences (~1e-7).
    rho = 1.0 / (1.0 - gamma(2 * NORM_BLOCK + 8, unit_roundoff(dt))) - 1.0
    for s, r in parts:
        if s.dtype != dt:
            s = s.to(dt)
        sq = s if sq is None else sq + s
        rho = max(rho, r)
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
    """Full-precision float32 products for the duration: matrix products without TF32 / bf16
    operands and, on CUDA, cuDNN convolutions without TF32 (PyTorch's default there), which the
    bounds on a release assume. Determinism is not forced (only ghost case (e) needs it, and sets
    it itself): the model's own passes keep cuDNN's fastest kernels (docs/privacy.md, item 1).
    """
    with _ieee_matmul(device), _exact_cudnn(device):
        yield


@contextmanager
def _exact_cudnn(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    # The legacy switch, as long as nobody used torch ≥ 2.9's per-operator one: once the two APIs
    # are mixed, PyTorch raises wherever the legacy flag is read (some of its own ops read it).
    try:
        old_tf32: bool | None = cudnn.allow_tf32
    except RuntimeError:  # the user set per-operator precisions: keep to that API
        old_tf32 = None
    ops = [] if old_tf32 is not None else [getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)]
    ops = [op for op in ops if hasattr(op, "fp32_precision")]
    old_prec = [op.fp32_precision for op in ops]
    if old_tf32 is not None:
        cudnn.allow_tf32 = False
    for op in ops:
        op.fp32_precision = "ieee"
    try:
        yield
    finally:
        for op, prec in zip(ops, old_prec, strict=True):
            op.fp32_precision = prec
        if old_tf32 is not None:
            cudnn.allow_tf32 = old_tf32


@contextmanager
def _ieee_matmul(device: torch.device) -> Iterator[None]:
    be = torch.backends.cuda.matmul if device.type == "cuda" else getattr(torch.backends.mkldnn, "matmul", None)
    old = getattr(be, "fp32_precision", None)
    if old is None:  # torch before the per-backend API (2.9): the legacy global switch
        legacy = torch.get_float32_matmul_precision()
        if legacy == "highest":
            yield
            return
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(legacy)
        return
    if old in ("none", "ieee"):
        yield
        return
    be.fp32_precision = "ieee"
    try:
        yield
    finally:
        be.fp32_precision = old


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
            out = self._sum(weights, None)
            bad = nonfinite_rows(self, out) if drop_nonfinite else None
            if bad is not None:
                keep = (~bad).nonzero().squeeze(1)
                out = self._sum(weights[keep], keep)
        return Accumulated(out, {k: g.dtype for k, g in self.grads.items()})

    def _sum(self, weights: torch.Tensor, rows: torch.Tensor | None) -> Tensors:
        """Σ_j weights_j g_{rows_j} in float64 (all rows when ``rows`` is None), as ``GhostGrads._sum``."""
        return {
            k: wide_sum(weights, _rows(g) if rows is None else _rows(g)[rows]).reshape(g.shape[1:])
            for k, g in self.grads.items()
        }


# Rows per float64 block of ``wide_sum`` at most (fewer for long rows: ≤ 2²² floats per block).
WIDE_BLOCK = 2048


def wide_sum(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i g_i over the rows of g [B, n], in float64 ([n]).

    Each example's term w_i·g_ij is formed from that example alone (exact for float32 and
    half-precision operands: a product of two 24-bit significands fits in 53 bits), and the
    terms are summed across examples in float64, by blocks of m ≤ WIDE_BLOCK rows: the error
    is ≤ γ⁶⁴_{m+⌈B/m⌉}·Σ_i |w_i g_i| entrywise, whatever the order (docs/privacy.md, item
    1b), instead of γ³²_B for a float32 product."""
    B, n = g.shape
    m = max(1, min(WIDE_BLOCK, (1 << 22) // max(1, n)))
    out = torch.zeros(n, dtype=torch.float64, device=g.device)
    for i in range(0, B, m):
        out += w[i : i + m].double() @ g[i : i + m].double()
    return out


def nonfinite_rows(grads: MaterializedGrads, out: Tensors) -> torch.Tensor | None:
    """The rows to leave out of a weighted sum: those whose gradient is not finite, or None.

    One example with an inf/NaN gradient (an overflow, a NaN feature) would otherwise turn
    the whole sum into NaN — a release that depends on one example far beyond its clipped
    contribution. Leaving such rows out is a per-example rule (example i contributes
    w_i g_i if ‖g_i‖ is finite, else 0), so every contribution stays within the clipping
    bound and the sensitivity is unchanged. Cheap when all is well: one check of the norms
    (when computed) or of the sum; the norms are only computed when something is wrong.
    """
    norms = grads._norms
    if norms is not None:
        ok = bool(torch.isfinite(norms).all())
    else:
        total = sum((v.sum() for v in out.values()), torch.zeros((), dtype=grads.losses.dtype))
        ok = bool(torch.isfinite(total))
    if ok:
        return None
    bad = ~torch.isfinite(grads.norms)
    return bad if bool(bad.any()) else None
