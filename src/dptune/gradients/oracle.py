"""Per-sample gradients with ``torch.func`` (``functional_call`` + ``vmap(grad)``). Strategies never touch raw
per-sample tensors: they ask a ``PerSampleGrads`` for norms ‖g_i‖ and weighted sums Σ_i w_i g_i, the seam where
the ghost path replaces vmap. ``GradientOracle(..., method=)``: ``'vmap'`` (any model; one example at a time
where vmap cannot run it), ``'ghost'`` (``dptune.gradients.ghost``) or ``'auto'`` (ghost on trusted code the
ghost rules cover, else vmap); default ``DEFAULT_METHOD`` (env ``DPTUNE_GRAD_METHOD``; ``set_default_method``)."""

from __future__ import annotations

import math
import os
import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from dptune import inputs
from dptune.errors import OWNER_ERROR, ConfigError
from dptune.gradients import ghost, graphed
from dptune.gradients.isolation import KeptState, check_modes, own_code  # noqa: F401 - own_code re-exported
from dptune.gradients.persample import (  # noqa: F401 - re-exported: ``dptune.gradients.oracle`` is where users look
    LossFn,
    MaterializedGrads,
    ParamSwap,
    PerSampleGrads,
    RngState,
    ScratchBuffers,
    batched_loss,
    check_model,
    eval_mode,
    ieee_matmul,
    nonfinite_rows,
    per_example_loss,
    rng_preserved,
    rng_state,
    set_rng_state,
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


def _rows_alone(loss_fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A user loss on each row alone: vmapped (its random draws per row), else row by row where vmap refuses it
    (a Python branch on a value): never on the batch (``own.user_loss``). Row by row, the last row is computed
    again with your loss's Python state from before the batch (a flag one row sets must not reach the next)."""
    vmapped, looped = torch.vmap(loss_fn, randomness="different"), [False]
    refused: list[ConfigError] = []

    def losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if refused:  # final, as the oracle's refusals
            raise refused[0]
        if not looped[0]:
            try:
                return vmapped(inputs.tmap(lambda t: t, out), y)  # tensors only (vmap's need; tmap drops a cache)
            except RuntimeError:
                looped[0] = True
        kept, row = KeptState(None, others=(loss_fn,)), lambda i: loss_fn(inputs.tmap(lambda t: t[i], out), y[i])
        rows = [row(i) for i in range(len(y) - 1)]
        kept.mark(y.device)
        rows.append(row(-1))
        again = kept.again(lambda: row(-1))
        if not torch.allclose(again, rows[-1].detach(), rtol=0.0, atol=0.0, equal_nan=True):
            refused.append(ConfigError("computed one example at a time, an example's loss depends on the examples before "
                                       "it (the last one, recomputed as before the batch, changed). Fix: keep no state in your loss."))  # fmt: skip
            raise refused[0]
        return torch.stack(rows)

    return losses


def _as_weights(x: Any, params: Tensors) -> Any:
    """Under your autocast (off inside, ``ieee_matmul``), half-precision inputs of a float32 model in its dtype, as
    autocast would have computed them (found in review: refused as a model failing on one example)."""
    dt = next((p.dtype for p in params.values() if p.is_floating_point()), None)
    if dt is None or not any(torch.is_autocast_enabled(d) for d in ("cpu", inputs.device_of(x).type)):
        return x
    return inputs.tmap(lambda t: t.to(dt) if t.is_floating_point() and t.itemsize < dt.itemsize else t, x)


class GradientOracle:
    """Per-example losses and gradients of ``model`` at given parameters. ``method``: 'auto' | 'vmap' | 'ghost'
    (None: ``DEFAULT_METHOD``); ``chunk_size`` bounds the vmap path's memory (B × #params floats). Every private
    forward runs on scratch buffers. A batched forward (trusted code only: the ghost path, DP-ZO's losses) is
    probed for per-example isolation (``_probe``); until a probe has passed, a batch is computed on vmap (or one
    example at a time); a refusal is final. A forward of yours runs the ghost path under vmap (docs/privacy.md)."""

    PROBE_MIN_BATCH = 3  # one or two rows cannot show mixing reliably
    PROBE_EVERY = 32  # after a pass, each call is the next probe with chance 1/32 (OS entropy: no call count evades it)

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
        # A user loss is vmapped over single examples (``own.user_loss`` says why).
        self._batched_loss = batched_loss(loss) if isinstance(loss, str) else _rows_alone(self.loss_fn)
        self._scratch = ScratchBuffers(model)
        self.buffers = self._scratch.originals  # never passed to a forward: copies are (ScratchBuffers)
        self._refused: ConfigError | None = None
        self._rows = random.SystemRandom()  # the probed row and the next probe: OS entropy, not the run's streams
        self._calls = {"grads": 0, "losses": 0}
        self._looked: bool | int | None = False  # the fill of the dummy your forward ran on; None: none ran (``_look``)
        self._next_probe = {"grads": 0, "losses": 0}  # call count at which a probe is due; 0: none passed
        self._call = ParamSwap(model)
        self.chunk_size = chunk_size
        self.param_names = [k for k, p in model.named_parameters() if p.requires_grad]
        self.requested_method = _check_method(method if method is not None else DEFAULT_METHOD)
        self._ghost = None
        self._graphs: graphed.Graphs | None = None  # CUDA graphs of the ghost path, made on the first replayable step
        self.fallback_reason: str | None = None
        self.alone_reason: str | None = None  # why vmap cannot run the model (then: ``_one_at_a_time``)
        # Batched forwards only on trusted code: one outlier could switch on a batch-level branch of yours past
        # any probe (5–23·C in review); your forward runs under vmap, the ghost path's too (docs/privacy.md).
        self.own_code = own_code(model)
        if self.requested_method != "vmap":
            if (reason := ghost.unsupported_reason(model)) is None:  # your forward: the ghost path under vmap
                self._ghost = ghost.GhostEngine(model, self._batched_loss, rowwise=self.own_code is not None)
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
            one: Any = inputs.tmap(lambda t: t.squeeze(0), out)  # a tensor, or a structure (a ModelOutput)
            return self.loss_fn(one, y)

        self._per_sample = vmap(
            grad_and_value(one), in_dims=(None, None, 0, 0), randomness="different", chunk_size=chunk_size
        )
        self._losses_alone = vmap(one, in_dims=(None, None, 0, 0), randomness="different", chunk_size=chunk_size)

    @property
    def method(self) -> str:
        """The implementation in use: 'ghost' or 'vmap'."""
        return "ghost" if self._ghost is not None else "vmap"

    def _fall_back(self, reason: str) -> None:
        if self.requested_method == "ghost" and not self.own_code:  # under vmap: any refusal falls back
            raise ConfigError(f"method='ghost' cannot handle this model: {reason}. Use method='auto' or 'vmap'.")
        warnings.warn(f"dptune: per-sample gradients fall back to vmap ({reason}).", RuntimeWarning, stacklevel=3)
        self.fallback_reason = reason
        self._ghost = None

    def __call__(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> MaterializedGrads:
        # Exact products for the whole private computation (ieee_matmul says why); the lazy
        # ghost norms and sums enter it again when they are computed.
        check_modes()
        if not torch.is_grad_enabled():  # found in review: else a misleading BatchNorm "Fix" (one at a time)
            raise ConfigError("per-example gradients need autograd, which torch.no_grad() (or set_grad_enabled(False)) "
                              "turns off around this step. Fix: call it outside torch.no_grad().")  # fmt: skip
        if self._refused is not None:  # a refusal is final, on every path
            raise self._refused
        x = _as_weights(x, params)
        if self.own_code and self._looked is False:
            self._look(params, x)
        with ieee_matmul(inputs.device_of(x)):
            got = self._compute(params, x, y)
        if self.own_code:
            self._look(params, x)
        return got

    def _look(self, params: Tensors, x: Any) -> None:
        """Your forward on a public dummy (one row of zeros, else ones) before the first private pass (its own buffers: a
        lazy init sees no row) and after each (a kept per-example tensor is refused before the release): item 22."""
        public, passed = self._looked is False, type(self._looked) is int  # public: before any private pass
        for fill in (int(self._looked or 0),) if passed else (0, 1):
            try:
                with torch.no_grad(), rng_preserved(inputs.device_of(x)), self._scratch(public) as buffers:
                    self._call(params, buffers, inputs.dummy(x, fill=fill))
                self._looked = fill  # the dummy that passed: later looks use it
                return
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - functorch's words for a tensor that left its vmap, or any
                if "escaped" in str(exc) or passed:  # a failure where the same dummy passed before
                    self._refused = ConfigError("your forward keeps a per-example tensor across calls (an attribute, a "
                                                "container, a global). Fix: do not store tensors computed from the inputs.")  # fmt: skip
                    raise self._refused from None
        self._looked = None  # no dummy passed: later looks run on scratch buffers

    def _compute(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> MaterializedGrads:
        if (B := inputs.batch_len(x)) == 0:  # an empty Poisson batch: the step (and its noise) still happen
            return MaterializedGrads(
                {k: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for k, p in params.items()},
                torch.zeros(0, device=inputs.device_of(x)),
            )
        due = self._ghost is not None and self._due("grads", B)
        ghost_ok = self._ghost is not None and B >= self.PROBE_MIN_BATCH  # 1-2 rows: never probed, so vmap
        replayable = ghost_ok and not self.own_code and graphed.replayable(inputs.device_of(x))  # not under vmap
        if replayable and not due and self._next_probe["grads"]:
            if self._graphs is None:
                self._graphs = graphed.Graphs(self._run_ghost, self.model)
            if self._graphs is not None and (replayed := self._graphs(params, x, y)) is not None:
                return replayed
        if ghost_ok and (due or self._next_probe["grads"]):
            before = self._swap_state(inputs.device_of(x)) if due else None
            first = due and not self._next_probe["grads"]
            try:
                got = self._run_ghost(params, x, y)
                if due:
                    self._probe("grads", x, y, before, lambda xs, ys: self._run_ghost(params, xs, ys), got)
            except (ghost.GhostFallback, RuntimeError) as exc:  # nothing of this batch was released
                if not isinstance(exc, ghost.GhostFallback) and self.requested_method != "auto" and not self.own_code:
                    raise
                self._fall_back(str(exc).split("\n")[0])
            else:
                if first and self.requested_method == "auto":
                    self._compare_alone(params, x, y)
                elif first and not self.own_code:  # forced ghost: no vmap comparison (rounding), the loss alone
                    self._loss_alone(params, x, y, "grads")
                if self._ghost is not None:
                    return got
        grads, losses = self._vmap(params, x, y)
        return MaterializedGrads(grads, losses.detach())

    def check_model(self) -> None:
        """At a run's end: no frozen parameter written during it (``ScratchBuffers.check_frozen``)."""
        self._scratch.check_frozen()

    def _run_ghost(self, params: Tensors, x: Any, y: torch.Tensor) -> ghost.GhostGrads:
        assert self._ghost is not None
        with self._scratch() as buffers:
            return self._ghost(params, x, y, buffers)

    def _vmap(self, params: Tensors, x: Any, y: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        if self.alone_reason is None:
            try:
                with self._scratch() as buffers:
                    return self._per_sample(params, buffers, x, y)
            except torch.OutOfMemoryError:
                raise ConfigError("per-example gradients ran out of memory. Fix: chunk_size=... (e.g. 16).") from None
            except (RuntimeError, ValueError) as exc:
                if isinstance(exc, ConfigError):  # a refusal from inside (a buffer write): as it is
                    raise
                if isinstance(exc.__cause__, KeyboardInterrupt):  # Ctrl-C during an import vmap made, wrapped
                    raise exc.__cause__ from None
                # functorch refuses most in-place writes to a buffer (a batched value into an
                # unbatched tensor); a plain forward tells whether that was it, in one line. Any other
                # refusal (data-dependent control flow, nn.GRU's shapes) is retried one example at a time.
                if self.buffers:
                    self._probe_buffers(params, x)
                self.alone_reason = str(exc).split(". ")[0]
                warnings.warn(
                    f"dptune: torch.func.vmap cannot run this model ({self.alone_reason}); per-example "
                    "gradients are computed one example at a time (exact, slower).",
                    RuntimeWarning,
                    stacklevel=3,
                )
        try:
            with self._scratch() as buffers:
                return self._one_at_a_time(params, buffers, x, y)
        except ConfigError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(
                f"the model fails on one example alone ({str(exc).splitlines()[0]}{OWNER_ERROR}): per-example gradients "
                "need each example computed by itself. Fix: replace what needs several examples (BatchNorm: "
                "GroupNorm or LayerNorm) or writes into the model during the forward; nn.Embedding(sparse=True): "
                "sparse=False."
            ) from exc

    def _one_at_a_time(
        self, params: Tensors, buffers: Tensors, x: Any, y: torch.Tensor
    ) -> tuple[Tensors, torch.Tensor]:
        """What ``_per_sample`` computes, by each example's own forward and backward pass: for models vmap refuses (a
        Python branch on a value, as Hugging Face's ``if attention_mask.all():``; docs/privacy.md)."""
        ps = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        B, dev = inputs.batch_len(x), inputs.device_of(x)
        grads = {k: torch.empty((B, *p.shape), dtype=p.dtype, device=p.device) for k, p in params.items()}
        kept = KeptState(self.model, (*ps.values(), *buffers.values()), (self.loss_fn,)) if B > 1 else None
        losses: list[torch.Tensor] = []

        def grad(j: int) -> list[torch.Tensor]:
            out: Any = inputs.tmap(lambda t: t.squeeze(0), self._call(ps, buffers, inputs.rows(x, j, j + 1)))
            loss = self.loss_fn(out, y[j])
            losses.append(loss.detach())
            gs = torch.autograd.grad(loss, list(ps.values()), allow_unused=True)
            return [torch.zeros_like(p) if g is None else g for p, g in zip(ps.values(), gs, strict=True)]

        for j in range(B):
            last = self._swap_state(dev) if j == B - 1 else None
            for k, g in zip(ps, grad(j), strict=True):
                grads[k][j] = g  # memory touched once (zeros first: twice)
        if kept is not None:
            self._last_again(kept, dev, last, [g[-1] for g in grads.values()], lambda: grad(B - 1), "gradient")
            losses.pop()
        return grads, torch.stack(losses)

    def _last_again(
        self, kept: KeptState, dev: torch.device, rng: Any, got: list[torch.Tensor], value: Callable[[], Any], what: str
    ) -> None:
        """Refuse unless the last example's ``value()`` (its gradient, or loss) agrees with ``got``, computed again with
        the model's Python state as ``kept`` before the batch and the streams and buffers ``rng`` of its turn."""
        now = self._swap_state(dev, rng)
        try:
            again = kept.again(value)
        finally:
            self._swap_state(dev, now)
        if not self._same(got, again, 0.0):
            self._refused = ConfigError(f"computed one example at a time, an example's {what} depends on the examples "
                                        "before it (the last one, recomputed as before the batch, changed). Fix: keep no state.")  # fmt: skip
            raise self._refused

    def _probe_buffers(self, params: Tensors, x: Any) -> None:
        """Raise ``ScratchBuffers``' ConfigError if a plain forward of one example writes a buffer."""
        try:
            with torch.no_grad(), rng_preserved(inputs.device_of(x)), self._scratch() as buffers:
                self._call(params, buffers, inputs.rows(x, 0, 1))
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - the original error is the one to report
            return

    # ------------------------------------------------------------------ the isolation probe
    def _due(self, kind: str, B: int) -> bool:  # whether this call is probed; a refusal is raised again
        if self._refused is not None:
            raise self._refused
        self._calls[kind] += 1
        return B >= self.PROBE_MIN_BATCH and self._calls[kind] >= self._next_probe[kind]

    @torch.no_grad()
    def _swap_state(self, dev: torch.device, state: Any = None) -> tuple[RngState, Tensors]:
        """What a forward reads besides its inputs (torch's random streams, the buffers updated in
        place: spectral norm's vectors): returns the current one, then installs ``state`` if given."""
        now = rng_state(dev), {k: self._scratch.originals[k].clone() for k in self._scratch.passthrough}
        if state is not None:
            set_rng_state(dev, state[0])
            for k, v in state[1].items():
                self._scratch.originals[k].copy_(v)
        return now

    def _probe(self, kind: str, x: Any, y: torch.Tensor, before: Any, again: Any, got: Any) -> None:
        """Refuse unless the rows kept (a random half, row i among them) release the same values when
        every other row is replaced by a copy of row i, recomputed by ``again(x', y')`` in the release's
        mode, from its state ``before`` (same masks), with the same batch shape: each kept row's loss or
        norm bound, and row i's gradient. The random streams and buffers are left as the release left them."""
        B, dev = inputs.batch_len(x), inputs.device_of(x)
        order = self._rows.sample(range(B), B)
        i, kept = order[0], torch.tensor(sorted(order[: (B + 1) // 2]), device=dev)
        idx = torch.full((B,), i, dtype=torch.long, device=dev).index_copy_(0, kept, kept)
        after = self._swap_state(dev, before)
        try:
            theirs = again(inputs.take(x, idx), y[idx])
        finally:
            self._swap_state(dev, after)
        mine, other = ((r if isinstance(r, torch.Tensor) else r.norms)[kept] for r in (got, theirs))  # losses or norms
        if not (
            self._same_rows(mine, other, _scale(got))
            and self._same(_row_values(got, i), _row_values(theirs, i), _scale(got))
        ):
            # `auto`'s first probe, before any ghost release: when the forward isolates the kept rows
            # (their losses did not move), only the ghost path mixes (a parameter applied across the
            # batch, e.g. position embeddings of ids [1, T]): vmap runs each example alone.
            first_auto = kind == "grads" and self.requested_method == "auto" and not self._next_probe[kind]
            if first_auto and self._same_rows(got.losses[kept], theirs.losses[kept], _scale(got.losses)):
                raise ghost.GhostFallback("a parameter's ghost gradient mixes examples (used across the batch?)")
            self._refuse(kind)
        self._next_probe[kind] = self._calls[kind] + self._gap()

    def _gap(self) -> int:  # calls to the next probe: geometric, mean PROBE_EVERY (memoryless: no phase to hide in)
        return 1 + int(math.log1p(-self._rows.random()) / math.log1p(-1 / self.PROBE_EVERY))

    def _same_rows(self, a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
        """``_same`` row by row (each kept row's loss or norm bound on its own scale)."""
        u, v = a.detach().double(), b.detach().double()
        tol = 16 * max(torch.finfo(t.dtype).eps for t in (a, *self.model.parameters()) if t.is_floating_point())
        bound = tol * torch.maximum(torch.maximum(u.abs(), v.abs()).nan_to_num(0.0, 0.0, 0.0), torch.tensor(scale))
        return bool(((u == v) | (u.isnan() & v.isnan()) | ((u - v).abs() <= bound)).all())

    def _same(self, a: list[torch.Tensor], b: list[torch.Tensor], scale: float, same_shape: bool = True) -> bool:
        """‖a − b‖ ≤ tol·max(‖a‖, ‖b‖, scale) over the concatenated values, NaN equal to NaN, with eps
        of the coarsest dtype computed in (a bf16 model whose loss upcasts rounds like bf16). Same
        batch shape (the probe): the same kernels run on row i, so only non-deterministic GPU
        reductions may differ: tol = 16·eps (exact equality on CPU). Another shape (an example
        alone): kernel blocking changes the rounding: tol = √eps."""
        dtypes = {p.dtype for p in self.model.parameters() if p.is_floating_point()} | {t.dtype for t in a}
        eps = max(torch.finfo(dt).eps for dt in dtypes)
        u, v = (torch.cat([t.detach().reshape(-1).double() for t in ts]) for ts in (a, b))
        d = torch.where((u == v) | (u.isnan() & v.isnan()), torch.zeros_like(u), u - v)
        size = max(float(t.nan_to_num(0.0, 0.0, 0.0).norm()) for t in (u, v))
        return bool(d.norm() <= (16 * eps if same_shape else math.sqrt(eps)) * max(size, scale))

    def _refuse(self, kind: str) -> None:
        # No values in the message: they are private (and not differentially private).
        what, fix = ("loss", ".") if kind == "losses" else ("gradient", ", or use grad_method='vmap'.")
        self._refused = ConfigError(
            f"the {what} of an example depends on other examples of the batch (recomputed with the other "
            f"examples replaced, it changed): the clipping bound C holds only if each example's {what} is its "
            "own (batch statistics such as x - x.mean(0), a loss reweighted across the batch, with in-batch "
            "negatives or divided by the batch size break that). Fix: return each example's own loss, e.g. "
            f"F.cross_entropy(out, y, reduction='none'), without batch statistics or batch weights{fix}"
        )
        raise self._refused

    def _compare_alone(self, params: Tensors, x: Any, y: torch.Tensor) -> None:
        """'auto', first probe: row i of the ghost path's batch against vmap's row i alone, both in
        eval mode (masks off). A disagreement (a parameter used outside its layer, a loss that
        depends on the batch size) switches to vmap for good."""
        i = self._rows.randrange(inputs.batch_len(x))
        with rng_preserved(inputs.device_of(x)), eval_mode(self.model):
            got = self._run_ghost(params, x, y)
            ref_g, ref_l = self._vmap(params, inputs.rows(x, i, i + 1), y[i : i + 1])
        (n, *mine), (r, *theirs) = _row_values(got, i), _row_values(MaterializedGrads(ref_g, ref_l.detach()), 0)
        # Both norms are upper bounds; ghost norms and sums may differ from vmap's by the release
        # term E_i (``GhostGrads.release_err``: large only for ill-conditioned examples).
        err = got.release_err()
        e = 2 * float(err[i]) if err is not None else 0.0
        ok = bool((n - r).abs() <= 1e-3 * r + 1e-6 + e) or bool(n.isnan() & r.isnan())
        if not ok or not all(
            torch.allclose(a, b, rtol=1e-3, atol=1e-6 + 1e-3 * float(b.abs().nan_to_num().max()) + e, equal_nan=True)
            for a, b in zip(mine, theirs, strict=True)
        ):
            self._fall_back("the ghost path disagreed with vmap on an example alone (is a parameter used outside "
                            "its layer, or does the loss depend on the batch size?)")  # fmt: skip

    def loss_and_grad(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        """Mean loss and its (non-private) gradient: one ordinary backward pass."""
        ps = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with self._scratch() as buffers:
            out = self._call(ps, buffers, x)
        losses = self._batched_loss(out, y) if out.shape[0] else out.sum() * 0
        loss = losses.mean() if out.shape[0] else losses
        g = torch.autograd.grad(loss, list(ps.values()), allow_unused=True)
        return loss.detach(), {k: torch.zeros_like(ps[k]) if gi is None else gi for k, gi in zip(ps, g, strict=True)}

    def forward(self, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        with self._scratch() as buffers:
            return self._call(params, buffers, x)

    def losses(self, params: Tensors, x: Any, y: torch.Tensor) -> torch.Tensor:
        """The [B] per-example losses at ``params``, no gradient (zeroth-order privatizers).
        Private per-example values: only privatizers may read them. One batched forward once a
        probe has passed (``_probe``; the first also compares one row with it alone, in eval
        mode: a loss divided by the batch size); before that, one example at a time."""
        B, dev = inputs.batch_len(x), inputs.device_of(x)
        check_modes()
        due = self._due("losses", B)
        if B == 0:
            return torch.zeros(0, device=dev)
        with torch.no_grad(), ieee_matmul(dev):
            if self.own_code is not None and self.alone_reason is None:  # your forward: under vmap, each row alone
                if self._looked is False:
                    self._look(params, x)
                try:
                    with self._scratch() as buffers:
                        got = self._losses_alone(params, buffers, x, y).detach()
                    self._look(params, x)
                    return got
                except (RuntimeError, ValueError) as exc:
                    if isinstance(exc, ConfigError):
                        raise
                    self.alone_reason = str(exc).split(". ")[0]
            if self.own_code or not (due or self._next_probe["losses"]) or B < self.PROBE_MIN_BATCH:  # unprobed
                kept = KeptState(self.model, params.values(), (self.loss_fn,)) if self.own_code and B > 1 else None
                rows = [self._plain_losses(params, inputs.rows(x, j, j + 1), y[j : j + 1]) for j in range(B - 1)]
                last = self._swap_state(dev)
                rows.append(self._plain_losses(params, inputs.rows(x, B - 1, B), y[B - 1 :]))
                if kept is not None:  # no row's state reached the next
                    again = lambda: [self._plain_losses(params, inputs.rows(x, B - 1, B), y[B - 1 :])]  # noqa: E731
                    self._last_again(kept, dev, last, rows[-1:], again, "loss")
                return torch.cat(rows)
            first, before = not self._next_probe["losses"], self._swap_state(dev) if due else None
            out = self._plain_losses(params, x, y)
            if due:
                self._probe("losses", x, y, before, lambda xs, ys: self._plain_losses(params, xs, ys), out)
            if due and first:
                self._loss_alone(params, x, y, "losses")
        return out

    @torch.no_grad()
    def _loss_alone(self, params: Tensors, x: Any, y: torch.Tensor, kind: str) -> None:
        """Refuse unless a random row's batched loss equals its loss computed alone (eval mode, streams
        preserved): what no same-shape probe sees, a dependence on the batch size alone (ℓ_i·10/B)."""
        i, dev = self._rows.randrange(inputs.batch_len(x)), inputs.device_of(x)
        with rng_preserved(dev), eval_mode(self.model):  # any training-mode randomness off
            full = self._plain_losses(params, x, y)[i : i + 1]
            alone = self._plain_losses(params, inputs.rows(x, i, i + 1), y[i : i + 1]).reshape(1)
        # Rounding differs with the batch shape (kernel blocking): a floor of 1 (+ |ℓ|).
        if not self._same([full], [alone], 1.0, same_shape=False):
            self._refuse(kind)

    def _plain_losses(self, params: Tensors, x: Any, y: torch.Tensor) -> torch.Tensor:
        with self._scratch() as buffers:
            return self._batched_loss(self._call(params, buffers, x), y).detach()


def _row_values(result: torch.Tensor | MaterializedGrads, i: int) -> list[torch.Tensor]:
    """What is released for row i: its loss (DP-ZO), or its norm bound N_i and its gradient g_i
    (formed as the weighted sums form it, from row i alone: ``rows_sum`` over that row)."""
    if isinstance(result, torch.Tensor):
        return [result[i : i + 1]]
    one = torch.ones(1, dtype=result.losses.dtype, device=result.losses.device)
    return [result.norms[i : i + 1], *result.rows_sum(one, torch.tensor([i], device=one.device)).values()]


def _scale(result: torch.Tensor | MaterializedGrads) -> float:
    """The median finite |loss| or norm of the batch: the tolerance's floor for small rows."""
    v = result if isinstance(result, torch.Tensor) else result.norms
    return float(v.detach().double().abs().nan_to_num(0.0, 0.0, 0.0).median())
