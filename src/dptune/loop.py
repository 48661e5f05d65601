"""A private step inside your own training loop (Opacus's ``make_private``, rebuilt on privatizers; the example is in
README.md): dptune takes over the Poisson batches, the per-sample gradients, clipping and noise and the number of
steps; everything else is yours. What each check refuses, and why: docs/your_data.md ("Your own training loop")."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dptune import inputs
from dptune.distributed import join, launched, sync_model
from dptune.errors import BudgetExceededError, ConfigError
from dptune.gradients.isolation import (
    MODULE_HOOKS,
    calls_made_of,
    global_module_hooks,
    namespace_functions,
    registered_functions,
)
from dptune.gradients.oracle import GradientOracle
from dptune.gradients.persample import version_of
from dptune.names import aliased
from dptune.release.context import StepContext
from dptune.release.privatizers import FixedClip, Privatizer, Released
from dptune.strategies.base import Chain
from dptune.task import OwnTask
from dptune.train import RunPlan, TrainResult, open_run, plan_run
from dptune.tree import Tensors, clone, differs
from dptune.updates import UpdateRule
from dptune.updates.defaults import starts_pretrained


@dataclass(frozen=True)
class YourOptimizer(UpdateRule):
    """Stands for the user's torch optimizer in the plan and the model card: the update is
    applied outside dptune (post-processing of the released gradient)."""

    description: str = "torch.optim"
    name = "external"
    hyperparameters = ("description",)

    def init(self, params: Tensors, run: RunPlan) -> dict[str, Any]:
        return {}

    def update(self, params, state, released):
        raise ConfigError("the update is your optimizer's: call optimizer.step() after PrivateTraining.backward().")

    def rate(self, state: dict[str, Any]) -> float:
        return float("nan")


def _same_tensor(a: Any, b: torch.Tensor) -> bool:
    """A tensor of ``b``'s shape, dtype, device and values (NaN equal to NaN: a target may be missing)."""
    if not isinstance(a, torch.Tensor) or (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
        return False
    return not bool(differs(a, b))


_NOT_YIELDED = (
    "backward()/step() takes the batch that private.batches() just yielded, as yielded and once: the "
    "accountant assumes dptune's Poisson batches, and an x or y of your choosing (even of the same size) "
    "voids the guarantee. Fix: write `for x, y in private.batches(): private.step(x, y)`; put a per-example "
    "transform (augmentation) in your Dataset's __getitem__, which batches() calls for every example it draws."
)

_Shown = tuple[tuple[Any, torch.Tensor], list[torch.Tensor], list[int]]  # a yielded batch, its leaves, versions


def _like(x: Any, ref: Any) -> list[Any] | None:
    """``x``'s leaves in the order of ``ref``'s (a tensor, or a tuple/list/dict of them), or None
    when ``x`` has another structure."""
    if isinstance(ref, torch.Tensor):
        return [x]
    if isinstance(ref, Mapping):
        ok = isinstance(x, Mapping) and x.keys() == ref.keys()
        parts = [_like(x[k], ref[k]) for k in ref] if ok else [None]
    else:
        ok = isinstance(x, tuple | list) and len(x) == len(ref)
        parts = [_like(a, r) for a, r in zip(x, ref, strict=True)] if ok else [None]
    return None if any(p is None for p in parts) else [t for p in parts for t in p]  # type: ignore[union-attr]


def _optimizer_and_rule(optimizer: Any) -> tuple[torch.optim.Optimizer | None, UpdateRule]:
    if isinstance(optimizer, UpdateRule):
        return None, optimizer
    if isinstance(optimizer, torch.optim.LBFGS):
        # Its step() re-evaluates the loss through a closure (several times, with a line search):
        # each evaluation would be an exact gradient on the private batch, outside the ledger.
        raise ConfigError(
            "L-BFGS is not supported by make_private: it needs a closure that recomputes the exact, "
            "non-private gradient inside optimizer.step(). Fix: use a first-order optimizer (SGD, Adam, "
            "AdamW, ...): private.backward(x, y), then optimizer.step() without a closure."
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, YourOptimizer(f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    raise ConfigError(
        "optimizer must be a torch.optim.Optimizer over the model's parameters or a "
        f"dptune update rule (dptune.updates.SGD(...)), got {type(optimizer).__name__}."
    )


class PrivateTraining:
    """One private run driven by your loop. Build it with ``make_private``."""

    def __init__(
        self,
        model: nn.Module,
        data: Any,
        optimizer: torch.optim.Optimizer | UpdateRule,
        *,
        privatizer: Privatizer | None,
        loss: str | Callable | None,
        plan_kwargs: dict[str, Any],
        delta: float | None,
        seed: int,
        secure_mode: bool,
        device: str | torch.device | None,
        grad_method: str | None,
        chunk_size: int | None,
        run_id: str,
        distributed: bool = False,
    ):
        privatizer = FixedClip(1.0) if privatizer is None else privatizer
        if not isinstance(privatizer, Privatizer):
            raise ConfigError(
                f"privatizer must be a dptune.release.privatizers.Privatizer (e.g. FixedClip(1.0)), got {privatizer!r}."
            )
        asked = [k for k in ("target_epsilon", "noise_multiplier") if plan_kwargs.get(k) is not None]
        if not privatizer.private and asked:
            raise ConfigError(
                "the NonPrivate privatizer adds no noise (ε = ∞): drop target_epsilon/noise_multiplier, "
                "or choose a private privatizer (FixedClip, QuantileClip, OSOClip)."
            )
        self.optimizer, self.update = _optimizer_and_rule(optimizer)
        if device is None:  # keep the model where it is (e.g. cuda:1), rather than the default device
            device = next((p.device for p in model.parameters()), None)
        self.task = OwnTask.resolve(data, None, join(device) if distributed else device, None, loss)
        self.model = model.to(self.task.device)
        if distributed:
            sync_model(self.model, self.task.digest())
        self._named = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
        mine = {id(p) for p in self.model.parameters()}  # frozen ones included: they get no .grad
        if self.optimizer is not None and not {id(p) for g in self.optimizer.param_groups for p in g["params"]} <= mine:
            raise ConfigError(
                "the optimizer holds tensors that are not parameters of the model; build it from "
                "model.parameters() after moving the model to its device."
            )
        self.task.check_loss(self.model)
        self.strategy = Chain(privatizer, self.update)
        self.plan: RunPlan = plan_run(self.strategy, self.task.n, delta=delta, **plan_kwargs)
        self.delta = delta
        self.privatizer = privatizer
        self._p_state = privatizer.init(self.plan)
        self._u_state = self.update.init(self._params(), self.plan) if self.optimizer is None else {}
        self.ledger, self.gateway, self.sampler = open_run(
            self.plan, seed=seed, device=self.task.device, secure_mode=secure_mode, run_id=run_id,
            distributed=distributed,
        )  # fmt: skip
        self.oracle = GradientOracle(self.model, self.task.loss, chunk_size=chunk_size, method=grad_method)
        self.secure_mode = secure_mode
        self.t = 0  # steps taken (releases made)
        self._pending: tuple[Any, torch.Tensor] | None = None  # the drawn batch of step t + 1: released
        self._shown: _Shown | None = None  # what batches() yields: a copy of _pending, its leaves, their versions
        self._released: dict[int, tuple[torch.Tensor, int]] = {}  # id(parameter) → the .grad backward set
        # A backward reaching a trainable parameter puts its exact gradient in .grad, which any optimizer (a
        # second one, for the head) may step: refused where it lands, for the planned steps (found in review).
        self._hooks = [p.register_post_accumulate_grad_hook(self._exact_grad) for p in self._named.values()]
        if self.optimizer is not None:  # last: a refused make_private leaves no hook on your optimizer
            self._hooks.append(self.optimizer.register_step_pre_hook(self._check_grads))
            self._hooks.append(self.optimizer.register_step_post_hook(self._after_step))
        # A frozen parameter given a gradient (unfrozen, a backward(inputs=...) on private data, a second optimizer,
        # refrozen: found in review): refused at the next check, and by result(). Your writes (an EMA) stay yours.
        self._frozen = {
            k: (p, p.grad, version_of(p.grad)) for k, p in self.model.named_parameters() if not p.requires_grad
        }
        self._final: Tensors | None = None  # the parameters when the run ended (close): what result() certifies
        self._structure = structure(self.model)
        self.history: list[dict[str, Any]] = []
        self._started = time.perf_counter()

    def _params(self) -> Tensors:
        return {k: p.detach() for k, p in self._named.items()}

    def close(self) -> None:
        """End the run (early stopping): no more releases; its hooks leave your model and optimizer, which are yours
        again; ``result()`` certifies the parameters of now, whatever you train after (found in review). At the end of
        the plan this happens by itself, after the last release's step."""
        if self._final is None:
            self._final = clone(self._params() if self.optimizer is not None else self._finalized())
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _finalized(self) -> Tensors:
        return self.update.finalize(self._params(), self._u_state)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.t >= self.plan.steps:  # the last release's step taken: the model and optimizer are yours again
            self.close()

    def _moved_frozen(self) -> list[str]:  # frozen parameters given a gradient since make_private
        return [k for k, (p, g, v) in self._frozen.items() if p.grad is not g or version_of(g) != v]

    def _exact_grad(self, p: torch.Tensor) -> None:
        if self.t >= self.plan.steps:  # the run is over: the model is yours again
            return self.close()
        p.grad = None  # the exact gradient never stays in .grad (added in place: the released one is lost too)
        raise ConfigError(
            "a backward pass reached a trainable parameter during a make_private run: its exact, non-private "
            "gradient would be stepped (by any optimizer holding it). Fix: only private.backward(x, y) (or "
            "private.step) computes gradients of the trainable parameters; for a second optimizer, build it on "
            "the same parameters and step it after private.backward."
        )

    def _check_trainable(self) -> None:
        """The trainable set is fixed at make_private (the released gradient's keys): a parameter
        unfrozen later would get no released gradient, and a loss.backward() would train it exactly.
        So is the model's structure: a module swapped in or a hook added later (e.g. a batch mean) would
        mix examples between two isolation probes (found in review)."""
        if structure(self.model) != self._structure:
            raise ConfigError(
                "the model changed since make_private (a module replaced or added, a hook, or a forward set on a "
                "module): per-example gradients are only checked for the model as it was. Fix: make every "
                "change before make_private, then call it again: a new run with its own plan and budget."
            )
        now = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
        moved = self._moved_frozen()
        if changed := sorted(
            {*moved, *(k for k in now.keys() | self._named.keys() if now.get(k) is not self._named.get(k))}
        ):
            raise ConfigError(
                f"the trainable parameters changed since make_private ({', '.join(changed[:3])}: requires_grad "
                "turned on or off, parameters added or replaced, or a frozen one given a gradient). Fix: call make_private again after "
                "(un)freezing, with a new optimizer: a new run with its own plan. Each run spends its own "
                "privacy budget on the data: together they cost the composition of both."
            )

    # ------------------------------------------------------------------ the loop
    @property
    def steps(self) -> int:
        """T, fixed by the plan: ``batches()`` yields exactly this many."""
        return self.plan.steps

    def batches(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """The remaining planned Poisson batches (x, y), on the run's device, for the whole run (all
        epochs: iterate once). Pass each, as yielded and unchanged, to ``backward``/``step`` before
        asking for the next. Breaking out and calling it again resumes with the unused batch.

        Their realised sizes are private (not differentially private: for the data owner only)."""
        if self.t >= self.plan.steps:
            raise ConfigError(
                f"all {self.plan.steps} planned steps were taken: make_private plans the whole run (epochs="
                f"{self.plan.steps * self.plan.sampling_rate:.3g}); iterate private.batches() once, not once per "
                "epoch. Fix: one loop `for x, y in private.batches():`, or make_private again for a new run "
                "(its own budget)."
            )
        return self._batches()

    def _batches(self) -> Iterator[tuple[Any, torch.Tensor]]:
        while self.t < self.plan.steps:
            if self._pending is None:
                self._pending, self._shown = self.task.batch(self.sampler.sample()), None
            if self._shown is None or any(a._version != v for a, v in zip(*self._shown[1:], strict=True)):
                # The user's own copy: the release reads _pending, which no user code holds.
                shown = (inputs.tmap(torch.clone, self._pending[0]), self._pending[1].clone())
                leaves: list[torch.Tensor] = _like(shown, shown)  # type: ignore[assignment]
                self._shown = (shown, leaves, [a._version for a in leaves])
            t = self.t
            yield self._shown[0]
            if self.t == t:
                raise ConfigError(
                    f"the batch of step {t + 1} was not passed to backward()/step() before the next one was "
                    "asked for; skipping a batch is not supported (the accountant assumes every planned "
                    "Poisson batch is used)."
                )

    def _check_batch(self, x: Any, y: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """dptune's copy of the batch ``(x, y)`` stands for: the yielded tensors, unchanged, or equal copies."""
        if self._pending is None or self._shown is None:
            raise ConfigError(_NOT_YIELDED)
        batch, leaves, versions = self._shown
        got, own = _like((x, y), batch), _like(self._pending, batch) or []  # own: batch's structure, always
        if got is not None and any(a is s and s._version != v for a, s, v in zip(got, leaves, versions, strict=True)):
            raise ConfigError(
                "the batch private.batches() yielded was changed in place (x[:] = ..., x.sub_(...)) before "
                "backward()/step(): a batch-level edit is not per-example, and a batch of your choosing voids "
                "the guarantee. Fix: compute on a copy (x.clone()) and pass the yielded batch unchanged; put "
                "a per-example transform (augmentation) in your Dataset's __getitem__."
            )
        if got is None or not all(a is s or _same_tensor(a, o) for a, s, o in zip(got, leaves, own, strict=True)):
            raise ConfigError(_NOT_YIELDED)
        return self._pending

    def _lr(self) -> float:
        if self.optimizer is not None:
            return float(self.optimizer.param_groups[0].get("lr", float("nan")))
        return self.update.rate(self._u_state)

    def _release(self, x: Any, y: torch.Tensor) -> tuple[Released | None, dict[str, Any]]:
        if self._final is not None and self.t < self.plan.steps:
            raise ConfigError("this run was closed: it releases nothing more. Fix: make_private again for a new run "
                              "(its budget composes with this one's).")  # fmt: skip
        if self.t >= self.plan.steps:
            raise BudgetExceededError(
                f"the plan has {self.plan.steps} steps and all were taken; make_private(..., steps=...) plans more."
            )
        if torch.is_inference_mode_enabled():  # found in review: a release spent, then torch's error on every step
            raise ConfigError("private.backward ran inside torch.inference_mode(): no gradient can be computed there. "
                              "Fix: call it outside (torch.no_grad() for your own evaluation).")  # fmt: skip
        self._check_trainable()
        x, y = self._check_batch(x, y)
        t, releases = self.t + 1, self.ledger.releases
        try:
            ctx = StepContext(t=t, x=x, y=y, oracle=self.oracle, release=self.gateway, run=self.plan)
            lr = self._lr()
            released, self._p_state, info = self.privatizer.privatize(
                self._params(), self._p_state, ctx, lr=lr, label=self.strategy.name
            )
        finally:
            # The step is taken, and its batch spent, once its release is recorded; a failure before
            # (out of memory, say) leaves both, so steps_taken never exceeds the ledger's releases and
            # batches() yields the same batch again.
            if self.ledger.releases != releases:
                self._pending = self._shown = None
                self.t = t
        row = {"step": t, "lr": lr, **info}
        self.history.append(row)
        return released, row

    def backward(self, x: Any, y: torch.Tensor) -> dict[str, Any]:
        """Release this batch's private gradient and store it in each parameter's ``.grad`` (the mean over the expected
        batch size L; it replaces, never adds to, ``.grad``). Returns the step's public row (step, lr, C_t, ...)."""
        released, row = self._release(x, y)
        g = released.gradient() if released is not None else {k: torch.zeros_like(p) for k, p in self._named.items()}
        self._released = {}
        for k, p in self._named.items():
            p.grad = grad = g[k].detach().to(p.dtype)
            self._released[id(p)] = (grad, grad._version)
        return row

    def _check_grads(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the optimizer's step: no closure, and every ``.grad`` is still the released one
        (a ``loss.backward()`` in between would add the exact, non-private gradient)."""
        # args[0] is the optimizer itself. A closure runs inside step(), after this hook: its
        # loss.backward() would replace the released gradient unseen, so it is refused here.
        if any(callable(a) for a in (*args[1:], *kwargs.values())):
            raise ConfigError(
                "optimizer.step() was given a closure: it runs inside step(), after make_private's check, "
                "and its loss.backward() would train on the exact, non-private gradient. Fix: call "
                "private.backward(x, y), then optimizer.step() without a closure (optimizers that need one, "
                "such as L-BFGS, are not supported; a framework that passes one itself, such as PyTorch "
                "Lightning, needs its manual loop driven by you)."
            )
        self._check_trainable()
        for p in (p for group in optimizer.param_groups for p in group["params"]):  # every tensor it steps
            grad, version = self._released.get(id(p), (None, -1))
            if p.grad is not None and (p.grad is not grad or grad._version != version):
                name = next((k for k, q in self.model.named_parameters() if q is p), "a tensor outside the model")
                raise ConfigError(
                    f"the gradient of {name!r} is not the one private.backward() released (a loss.backward() or an "
                    "in-place change since, e.g. clip_grad_norm_?): the optimizer would use non-private gradients. "
                    "Fix: drop clip_grad_norm_ (each example is clipped already), and call optimizer.zero_grad() "
                    "and private.backward(x, y) right before optimizer.step()."
                )

    def step(self, x: Any, y: torch.Tensor) -> dict[str, Any]:
        """``backward`` then the optimizer's step; or, with a dptune update rule, the rule
        applied to the model's parameters in place."""
        if self.optimizer is not None:
            row = self.backward(x, y)
            self.optimizer.step()
            return row
        released, row = self._release(x, y)
        if released is not None:
            # Copies: a rule may keep the parameters it was given in its state (ADADP's θ₀),
            # and the model's tensors are overwritten in place below.
            params = {k: p.detach().clone() for k, p in self._named.items()}
            new, self._u_state, info = self.update.update(params, self._u_state, released)
            with torch.no_grad():
                for k, p in self._named.items():
                    p.copy_(new[k])
            row.update(info)
        if self.t >= self.plan.steps:
            self.close()
        return row

    # ------------------------------------------------------------------ what it spent
    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> float:
        """ε spent so far (the executed ledger: fewer steps than planned spend less)."""
        d = delta if delta is not None else self.delta
        if d is None:
            raise ConfigError("epsilon() needs a delta (make_private(..., delta=...)).")
        return self.ledger.epsilon(d, accountant or self.plan.accountant)

    def result(self) -> TrainResult:
        """A ``TrainResult`` of the run so far (final parameters), for ``dptune.save_model``."""
        if moved := self._moved_frozen():  # what it certifies: this run's model
            raise ConfigError(f"frozen parameter(s) {', '.join(moved[:3])} got a gradient during the run: the model is "
                              "not this run's alone. Fix: keep them frozen, and out of every backward, until result().")  # fmt: skip
        final = self._final if self._final is not None else self._params() if self.optimizer is not None else (
            self._finalized())  # fmt: skip
        return TrainResult(
            history=list(self.history), evals=[], metric=self.task.metric.name, best_metric=None, best_step=None,
            best_params=None, final_params=clone(final), ledger=self.ledger, plan=self.plan, delta=self.delta,
            seconds=time.perf_counter() - self._started, model=self.model, secure_mode=self.secure_mode,
            steps_taken=self.t, float_slack=self.gateway.snap_slack,
        )  # fmt: skip


def structure(model: nn.Module) -> tuple:
    """The modules (by identity and type), their hooks, what their calls run (``calls_made_of``), torch's global
    module hooks, the functions Hugging Face looks up by name and those torch's layers look up (``namespace_functions``)."""
    mods = tuple(
        (name, id(m), type(m), *(tuple(getattr(m, h, {})) for h in MODULE_HOOKS), calls_made_of(m))
        for name, m in model.named_modules()
    )
    registered, looked_up = tuple(map(id, registered_functions())), tuple(map(id, namespace_functions(model)))
    return mods, global_module_hooks(), registered, looked_up


def make_private(
    model: nn.Module,
    data: Any,
    optimizer: torch.optim.Optimizer | UpdateRule,
    *,
    privatizer: Privatizer | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    expected_batch_size: float | None = None,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
    accountant: str = "auto",
    loss: str | Callable | None = None,
    seed: int = 0,
    secure_mode: bool = False,
    device: str | torch.device | None = None,
    grad_method: str | None = None,
    chunk_size: int | None = None,
    run_id: str = "",
    allow_large_delta: bool = False,
    distributed: bool | None = None,
    pretrained: bool | None = None,
    **aliases: Any,
) -> PrivateTraining:
    """Plan a private run of ``model`` on ``data`` and return the object your loop drives.

    ``optimizer``: a torch optimizer over ``model.parameters()`` (call ``optimizer.step()`` after ``backward``;
    ``step`` does both) or a dptune update rule. ``privatizer``: the clipping/noise rule (default ``FixedClip(1.0)``;
    ``QuantileClip()``, ``OSOClip()``). Exactly one of ``noise_multiplier`` and ``target_epsilon`` (+ ``delta``); the
    plan (T, q, ν) is fixed here and the ledger refuses anything beyond it. ``data``: tensors (x, y), a map-style
    dataset or a DataLoader (its dataset only: docs/your_data.md). The seed is a secret key in seeded mode;
    ``secure_mode=True`` draws noise and batches from the OS CSPRNG. ``aliases``: ``epsilon``, ``batch_size``,
    ``secure`` (``dptune.names``). ``distributed`` (default: on under ``torchrun``): each rank's ``batches()`` are its
    shard of one Poisson batch (``dptune.distributed``). ``pretrained``: as in ``dptune.train``."""
    target_epsilon, expected_batch_size, secure_mode = aliased(
        aliases, "make_private", True, target_epsilon=target_epsilon, expected_batch_size=expected_batch_size,
        secure_mode=secure_mode,
    )  # fmt: skip
    plan_kwargs = dict(
        epochs=epochs, steps=steps, expected_batch_size=expected_batch_size, noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon, accountant=accountant, allow_large_delta=allow_large_delta,  # δ ≥ 1/n: refused
        pretrained=starts_pretrained(model) if pretrained is None else pretrained,  # the fine-tuning defaults
    )  # fmt: skip
    return PrivateTraining(
        model, data, optimizer, privatizer=privatizer, loss=loss, plan_kwargs=plan_kwargs, delta=delta, seed=seed,
        secure_mode=secure_mode, device=device, grad_method=grad_method, chunk_size=chunk_size, run_id=run_id,
        distributed=launched() if distributed is None else distributed,
    )  # fmt: skip
