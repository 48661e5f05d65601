"""The ghost path (``ghost``) around its memory-bounded rules (Linear, convolutions, Embedding): which models it takes
(``unsupported_reason``), how a forward records a layer's input and output (``recording``), a rule's interface
(``LayerRule``), the rule of kept per-sample gradients (``KeptRule``, ``norm_layer_rule``) and the gradients assembled
from rules (``LayerGrads``; ``ghost.GhostGrads`` adds the norms). OSO's q-query is a second weighted sum over the same
stored tensors, its weights affine in the clipping weights (w_q = (w_clip − 1[‖g‖ ≤ C])/C): ``LayerGrads.weighted_sum``
reuses the previous sum and adds the residual over the rows where the two are not proportional (row-sparse)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from dptune.gradients.norm_bounds import ieee_matmul, sq_rows_upper, unit_roundoff, weights_dtype, wide_sum
from dptune.gradients.persample import MaterializedGrads, nonfinite_rows
from dptune.tree import Accumulated, Tensors

# Rows whose weights are proportional to the previous weighted sum's, within this relative
# tolerance, are taken from that sum (float32 rounding of w is ~1e-7).
REUSE_RTOL = 1e-6

CONV = (nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d)
SUPPORTED: tuple[type[nn.Module], ...] = (nn.Linear, *CONV, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
# transformers' own layers with a ghost rule, matched by module and class name (dptune does not import it):
# GPT-2's Conv1D (a transposed Linear), Llama's RMSNorm (as nn.RMSNorm, computed in float32).
HF_LAYERS = {("transformers.pytorch_utils", "Conv1D")} | {  # the RMSNorms whose forward is Llama's, word for word
    (f"transformers.models.{m}.modeling_{m}", f"{c}RMSNorm")
    for m, c in [("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("mistral", "Mistral"), ("phi3", "Phi3")]
}


def is_conv1d(mod: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` itself (GPT-2): ``x @ W + b`` with W [d_in, d_out]."""
    return (type(mod).__module__, type(mod).__name__) == ("transformers.pytorch_utils", "Conv1D")


def base_type(mod: nn.Module) -> type[nn.Module] | None:
    if (type(mod).__module__, type(mod).__name__) in HF_LAYERS:
        return type(mod)
    for cls in SUPPORTED:
        if isinstance(mod, cls) and type(mod).forward is cls.forward:
            return cls
    return None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the ghost path cannot handle ``model`` (None when it can)."""
    owner: dict[int, str] = {}
    for name, mod in model.named_modules():
        own = [(k, p) for k, p in mod.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        where = f"layer '{name or type(mod).__name__}' ({type(mod).__name__})"
        for k, p in own:  # a tied weight's gradient sums two layers' terms: no rule bounds the sum
            if owner.setdefault(id(p), where) != where:
                return f"{where} shares its {k} with {owner[id(p)]} (tied weights)"
        cls = base_type(mod)
        if cls is None:
            return f"{where} has trainable parameters and no ghost rule"
        if any(k not in ("weight", "bias") for k, _ in own):
            return f"{where} has parameters other than weight/bias"
        if cls in CONV and (mod.padding_mode != "zeros" or isinstance(mod.padding, str) or mod.groups != 1):
            return f"{where}: only zero padding given as numbers and groups=1 are supported"
        if cls is nn.Embedding and (mod.max_norm is not None or mod.sparse or mod.scale_grad_by_freq):
            return f"{where}: max_norm / sparse / scale_grad_by_freq are not supported"
    return None


class GhostFallback(Exception):
    """Raised while computing when this batch/model needs the vmap path."""


class LayerRule:
    """Per-layer statistics from (a, b). ``names`` maps 'weight'/'bias' → parameter name."""

    def __init__(self, names: dict[str, str]):
        self.names = names

    def sq_norms(self) -> list[tuple[torch.Tensor, float]]:
        """(s, ρ) parts: the layer's released part of w·g_i has norm ≤ |w|(1+γ_2)·(Σ s_i(1+ρ))^½
        (``ghost``'s docstring, "Norms are upper bounds"); ``norm_bounds.upper_norms`` combines them."""
        raise NotImplementedError

    def release_err(self) -> torch.Tensor | None:
        """e_i ≥ 0 (float64, per unit weight): how far the released w·g_i may be from the exact
        w·G_i beyond the relative (1+γ_2); already inside ``sq_norms``. None when 0."""
        return None

    def weighted(self, w: torch.Tensor, rows: torch.Tensor | None = None) -> Tensors:
        """Σ_i w_i g_i over ``rows`` (all when None); w is indexed like rows."""
        raise NotImplementedError

    def per_sample(self) -> Tensors:
        raise NotImplementedError


class KeptRule(LayerRule):
    """Per-sample gradients kept in memory (small layers: norms, biases, convolutions)."""

    def __init__(self, names: dict[str, str], grads: Tensors):
        super().__init__(names)
        self.grads = grads  # param name → [B, *shape]

    def sq_norms(self) -> list[tuple[torch.Tensor, float]]:
        return [sq_rows_upper(g) for g in self.grads.values()]

    def weighted(self, w: torch.Tensor, rows: torch.Tensor | None = None) -> Tensors:
        return {
            k: wide_sum(w, (g if rows is None else g[rows]).flatten(1)).reshape(g.shape[1:])
            for k, g in self.grads.items()
        }

    def per_sample(self) -> Tensors:
        return self.grads


def merge_kept(rules: list[LayerRule]) -> list[LayerRule]:
    """The ``KeptRule``s of one dtype and device as one rule over a [B, N] block, each row the concatenation of
    an example's kept gradients: one norm and one float64 sum for all of them instead of one per parameter
    (a transformer's biases and LayerNorms: ~60 tensors, ~400 kernel launches a step). The row norm bounds
    the concatenation, hence every part (``sq_rows_upper``: blocked sums past NORM_BLOCK)."""
    groups: dict[tuple, list[KeptRule]] = {}
    for r in rules:
        if type(r) is KeptRule and r.grads:
            g = next(iter(r.grads.values()))
            groups.setdefault((g.dtype, g.device), []).append(r)
    blocks = {id(g[0]): _KeptBlock(g) for g in groups.values() if len(g) > 1}
    drop = {id(r) for g in groups.values() if len(g) > 1 for r in g[1:]}
    return [blocks.get(id(r), r) for r in rules if id(r) not in drop]


class _KeptBlock(KeptRule):
    def __init__(self, rules: list[KeptRule]):
        parts = [(k, g) for r in rules for k, g in r.grads.items()]
        self.shapes = {k: g.shape[1:] for k, g in parts}
        self.block = torch.cat([g.flatten(1) for _, g in parts], 1)
        super().__init__({}, self._split(self.block))  # views: per parameter, as a KeptRule's

    def _split(self, flat: torch.Tensor) -> Tensors:
        lead = flat.shape[:-1]
        views = flat.split([s.numel() for s in self.shapes.values()], -1)
        return {k: v.reshape(*lead, *s) for (k, s), v in zip(self.shapes.items(), views, strict=True)}

    def sq_norms(self) -> list[tuple[torch.Tensor, float]]:
        return [sq_rows_upper(self.block)]

    def weighted(self, w: torch.Tensor, rows: torch.Tensor | None = None) -> Tensors:
        return self._split(wide_sum(w, self.block if rows is None else self.block[rows]))


def norm_layer_rule(names: dict[str, str], mod: nn.Module, a: torch.Tensor, b: torch.Tensor) -> KeptRule:
    """LayerNorm / GroupNorm / RMSNorm: per-sample affine gradients Σ_positions b ∘ x̂ and Σ_positions b."""
    with torch.no_grad():
        if isinstance(mod, nn.LayerNorm):
            xhat = F.layer_norm(a, mod.normalized_shape, None, None, mod.eps)
            dims = tuple(range(1, a.ndim - len(mod.normalized_shape)))
        elif isinstance(mod, nn.GroupNorm):
            xhat = F.group_norm(a, mod.num_groups, None, None, mod.eps)
            dims = tuple(range(2, a.ndim))
        else:  # nn.RMSNorm, or Llama's: x·rsqrt(mean(x²) + eps) in float32, back to the input's dtype
            shape = getattr(mod, "normalized_shape", a.shape[-1:])
            eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
            xhat = F.rms_norm(a.float(), shape, None, eps).to(a.dtype)
            dims = tuple(range(1, a.ndim - len(shape)))
        grads: Tensors = {}
        if "weight" in names:
            grads[names["weight"]] = (b * xhat).sum(dims) if dims else b * xhat
        if "bias" in names:
            grads[names["bias"]] = b.sum(dims) if dims else b
    return KeptRule(names, grads)


@contextmanager
def recording(
    mods: Iterable[nn.Module], batch: int, shift: dict[nn.Module, torch.Tensor] | None = None
) -> Iterator[dict[nn.Module, tuple | None]]:
    """Each of ``mods``' call in the block as (input, the output's autograd edge, its (shape, dtype, device),
    the input's version), by an instance-level ``forward`` wrapper (a forward hook would take
    ``Module._call_impl``'s slow path, ~25 µs a call). GhostFallback if a module was called twice, without a
    positional input whose first dimension is the ``batch``, or had its input changed in place. Ids of batch
    1 shared by the batch (HF's position ids [1, T]) are expanded to the batch first, so that each example's
    output gradient is its own (a forward that the expansion breaks falls back). ``shift``: a tensor added to
    each module's output (zeros: the row-wise path differentiates by it), no edge recorded."""
    records: dict[nn.Module, tuple | None] = {}
    patched: list[tuple[nn.Module, bool, object]] = []
    expanded: list[nn.Module] = []

    def wrap(mod: nn.Module, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(*args: object, **kwargs: object) -> torch.Tensor:
            a = args[0] if args else None
            if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dim() and a.shape[0] == 1 < batch:
                a = a.expand(batch, *a.shape[1:])
                args = (a, *args[1:])
                expanded.append(mod)
            out = inner(*args, **kwargs)
            w = getattr(mod, "weight", None)
            if isinstance(w, torch.Tensor) and isinstance(out, torch.Tensor) and out.dtype != w.dtype:
                # autocast inside the model: the rules' bounds assume the weights' dtype (found in review)
                raise GhostFallback(
                    f"a {type(mod).__name__} computed in {out.dtype} with {w.dtype} weights (autocast?)"
                )
            first, records[mod] = mod not in records, None
            if not (first and isinstance(a, torch.Tensor) and isinstance(out, torch.Tensor)):
                return out
            if shift is not None and a.dim() and out.dim() and a.shape[0] == batch == out.shape[0]:
                records[mod] = (a, None, None, a._version)
                return out + shift[mod]
            if a.dim() and out.dim() and a.shape[0] == batch == out.shape[0] and out.requires_grad:
                # The output by its autograd edge, not the tensor: what the backward does not need is freed
                # during it (the gradient is the one into the layer's own output, in-place changes after or not).
                records[mod] = (a, get_gradient_edge(out), (out.shape, out.dtype, out.device), a._version)
            return out

        return forward

    try:
        for mod in mods:
            patched.append((mod, "forward" in mod.__dict__, mod.__dict__.get("forward")))
            mod.__dict__["forward"] = wrap(mod, mod.forward)
        yield records
    except (RuntimeError, ValueError) as exc:  # the expanded output did not fit where the shared one did
        if expanded:
            raise GhostFallback(f"a layer's input of batch 1, expanded to the batch, broke the forward: {exc}") from exc
        raise
    finally:
        for mod, had, old in patched:
            if had:
                mod.__dict__["forward"] = old
            else:
                del mod.__dict__["forward"]
    for rec in records.values():
        if rec is None or rec[0]._version != rec[3]:
            raise GhostFallback(
                "a layer was called twice, on an input whose first dimension is not the batch, or its "
                "input was modified in place"
            )


class LayerGrads(MaterializedGrads):
    """Weighted sums and release errors from the layer rules; the materialised [B, *shape] ``grads``
    only on demand, for code that asks for them. The norms are ``ghost.GhostGrads``'."""

    def __init__(
        self, layers: Sequence[LayerRule], losses: torch.Tensor, params: Tensors, norms: torch.Tensor | None = None
    ):
        """``norms``: upper bounds already computed by the caller (the vectorized engine computes
        those of all trials at once, with the same ``upper_norms``); None computes them on demand."""
        self.losses = losses
        self._layers = layers
        self._params = params  # for shapes and zero gradients of unused parameters
        self._norms: torch.Tensor | None = norms
        self._grads: Tensors | None = None
        self._last: tuple[torch.Tensor, Tensors] | None = None
        self._pre: tuple[float, torch.Tensor, Tensors] | None = None

    def free(self) -> None:
        self._layers, self._grads, self._last, self._pre = None, None, None, None  # type: ignore[assignment]

    def presum(self, clip: float, w: torch.Tensor, sums: Tensors) -> None:
        """Σ_i w_i g_i (float64) for w = min(1, C/N_i), formed elsewhere from these rows alone (``stacked``: all
        trials' at once), for ``clipped`` to serve at this exact C (a privatizer asking another C computes)."""
        self._pre = (clip, w, sums)

    def clipped(self, clip: float) -> Accumulated | None:
        if self._pre is None or self._pre[0] != clip:
            return None
        self._last = self._pre[1:]  # as ``weighted_sum`` leaves it (OSO's q-sum reuses it)
        return Accumulated(self._pre[2], {k: p.dtype for k, p in self._params.items()})

    def release_err(self) -> torch.Tensor | None:
        """E_i (float64): ‖released w·g_i − w·G_i‖ ≤ |w|·E_i beyond the relative (1 + γ_2) part,
        as (Σ_l e_l²)^½ over the layers that have such an error; None when none has."""
        errs = [e for e in (layer.release_err() for layer in self._layers) if e is not None]
        if not errs:
            return None
        return torch.stack(errs).square_().sum(0).sqrt_() if len(errs) > 1 else errs[0]

    @property
    def grads(self) -> Tensors:  # type: ignore[override]
        if self._grads is None:
            got = {k: g for layer in self._layers for k, g in layer.per_sample().items()}
            B = self.batch_size
            self._grads = {k: got.get(k, p.new_zeros((B, *p.shape))) for k, p in self._params.items()}
        return self._grads

    def rows_sum(self, w: torch.Tensor, rows: torch.Tensor | None = None) -> Tensors:
        w = w.double()  # exact (w is in the model's dtype): once, not in every layer's sum
        got = {k: s for layer in self._layers for k, s in layer.weighted(w, rows).items()}
        return {k: got[k] if k in got else torch.zeros_like(p, dtype=torch.float64) for k, p in self._params.items()}

    def weighted_sum(self, weights: torch.Tensor, *, drop_nonfinite: bool = True) -> Accumulated:
        w = weights.to(weights_dtype(self.losses.dtype))  # itself when of that dtype
        with ieee_matmul(w.device):
            out = self._residual(w)
            if out is None:
                out = self.rows_sum(w)
            bad = nonfinite_rows(self, out) if drop_nonfinite else None
            if bad is not None:  # leave non-finite rows out (grads.nonfinite_rows says why)
                w = torch.where(bad, torch.zeros_like(w), w)
                keep = (~bad).nonzero().squeeze(1)
                out = self.rows_sum(w[keep], keep)
        self._last = (w, out)
        return Accumulated(out, {k: p.dtype for k, p in self._params.items()})

    def reset_reuse(self) -> None:
        """Forget the last weighted sum, so that the next one is computed directly rather than
        from it (``_residual``): for a probe whose weights must not seed later sums."""
        self._last = None

    def _residual(self, w: torch.Tensor) -> Tensors | None:
        """Σ w_i g_i = α S_prev + Σ_{i ∈ R} r_i g_i, when w = α w_prev + r with r row-sparse: α the median ratio
        w_i / w_prev_i, R the rows not proportional to REUSE_RTOL (at most half). The direct sum instead where a
        layer's release error could push a row of R past max_j |w_j|·N_j (docs/privacy.md, item 1)."""
        if self._last is None:
            return None
        prev_w, prev_sum = self._last
        both = (w != 0) & (prev_w != 0)
        # One host read (the rows' nonzero): a batch where fewer than half the rows have both
        # weights non-zero marks every row, which the size check below refuses.
        ratio = torch.where(both, w.double() / prev_w.double(), torch.nan)
        alpha = ratio.nanmedian().nan_to_num(0.0)  # the median of the rows of ``both``
        r = w.double() - alpha * prev_w.double()
        scale = torch.maximum(w.double().abs(), (alpha * prev_w.double()).abs())
        few = both.sum() * 2 < w.shape[0]
        rows = ((r.abs() > REUSE_RTOL * scale) | few).nonzero().squeeze(1)
        if rows.numel() * 2 > w.shape[0]:
            return None
        err = self.release_err() if rows.numel() else None
        if err is not None:
            n = self.norms.double()
            u = unit_roundoff(self.losses.dtype)
            ea = err[rows] + 4 * u * n[rows]  # + the relative part (1+γ_2), the α scaling, the addition
            need = w.double()[rows].abs() * n[rows] + ((alpha * prev_w.double()[rows]).abs() + r[rows].abs()) * ea
            if bool((need > (1 + REUSE_RTOL) * (w.double().abs() * n).max()).any()):
                return None
        out = {k: v * alpha for k, v in prev_sum.items()}  # float64 (docs/privacy.md, item 1b)
        if rows.numel():
            extra = self.rows_sum(r[rows].to(w.dtype), rows)
            out = {k: out[k] + extra[k] for k in out}
        return out
