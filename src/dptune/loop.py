"""A private step inside your own training loop (Opacus's ``make_private``, rebuilt on privatizers).

    private = dptune.make_private(model, data, optimizer, target_epsilon=3.0, delta=1e-5, epochs=3)
    for x, y in private.batches():          # Poisson batches at q = L/n, exactly as planned
        optimizer.zero_grad()
        private.backward(x, y)              # p.grad ← the released (clipped, noisy) mean gradient
        optimizer.step()                    # any torch optimizer or scheduler: post-processing
    private.epsilon()                       # what the executed ledger spent

What is replaced and why (docs/your_data.md): the batches come from dptune's Poisson
sampler (the accountant assumes Poisson sampling at q and normalisation by the expected L),
the per-sample gradients and their clipping come from the privatizer (the only code that
reads them), and the number of steps is fixed up front (the ledger refuses a step beyond
the plan). Everything else is yours: the optimizer, its schedule, logging, evaluation on
public data, early stopping, checkpoints. ``step(x, y)`` is ``backward`` + the optimizer's
step; with a dptune update rule (``dptune.updates``) instead of a torch optimizer, it
applies that rule to the model's parameters in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dptune import inputs
from dptune.errors import BudgetExceededError, ConfigError
from dptune.grads import GradientOracle
from dptune.privatizers import FixedClip, Privatizer, Released
from dptune.steps import RunInfo, StepContext
from dptune.strategies.base import Chain
from dptune.train import OwnTask, RunPlan, TrainResult, open_run, plan_run
from dptune.tree import Tensors, clone, differs
from dptune.updates import UpdateRule


@dataclass(frozen=True)
class YourOptimizer(UpdateRule):
    """Stands for the user's torch optimizer in the plan and the model card: the update is
    applied outside dptune (post-processing of the released gradient)."""

    description: str = "torch.optim"
    name = "external"
    hyperparameters = ("description",)

    def init(self, params: Tensors, run: RunInfo) -> dict[str, Any]:
        return {}

    def update(self, params, state, released):
        raise ConfigError("the update is your optimizer's: call optimizer.step() after PrivateTraining.backward().")

    def rate(self, state: dict[str, Any]) -> float:
        return float("nan")


def _same_tensor(a: Any, b: torch.Tensor) -> bool:
    """``a`` is ``b``, or a tensor of the same shape, dtype, device and values (NaN equal to NaN:
    a target may be missing)."""
    if a is b:
        return True  # the usual case, and no read of the values (no host sync)
    if not isinstance(a, torch.Tensor) or (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
        return False
    return not bool(differs(a, b))


def _same_inputs(x: Any, yielded: inputs.Inputs) -> bool:
    """``x`` is the yielded batch: the same tensor, or a tuple/dict of the same tensors (or equal
    copies), leaf by leaf."""
    if x is yielded or isinstance(yielded, torch.Tensor):
        return _same_tensor(x, yielded)
    if isinstance(yielded, Mapping):
        return (
            isinstance(x, Mapping)
            and x.keys() == yielded.keys()
            and all(_same_tensor(x[k], v) for k, v in yielded.items())
        )
    return (
        isinstance(x, tuple | list)
        and len(x) == len(yielded)
        and all(_same_tensor(a, b) for a, b in zip(x, yielded, strict=True))
    )


def _describe(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


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
    ):
        privatizer = FixedClip(1.0) if privatizer is None else privatizer
        if not isinstance(privatizer, Privatizer):
            raise ConfigError(
                f"privatizer must be a dptune.privatizers.Privatizer (e.g. FixedClip(1.0)), got {privatizer!r}."
            )
        if not privatizer.private and (
            plan_kwargs.get("target_epsilon") is not None or plan_kwargs.get("noise_multiplier") is not None
        ):
            raise ConfigError(
                "the NonPrivate privatizer adds no noise (ε = ∞): drop target_epsilon/noise_multiplier, "
                "or choose a private privatizer (FixedClip, QuantileClip, OSOClip)."
            )
        if isinstance(optimizer, UpdateRule):
            self.optimizer, self.update = None, optimizer
        elif isinstance(optimizer, torch.optim.LBFGS):
            # Its step() re-evaluates the loss through a closure (several times, with a line search):
            # each evaluation would be an exact gradient on the private batch, outside the ledger.
            raise ConfigError(
                "L-BFGS is not supported by make_private: it needs a closure that recomputes the exact, "
                "non-private gradient inside optimizer.step(). Fix: use a first-order optimizer (SGD, Adam, "
                "AdamW, ...): private.backward(x, y), then optimizer.step() without a closure."
            )
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer, self.update = optimizer, YourOptimizer(_describe(optimizer))
        else:
            raise ConfigError(
                "optimizer must be a torch.optim.Optimizer over the model's parameters or a "
                f"dptune update rule (dptune.updates.SGD(...)), got {type(optimizer).__name__}."
            )
        if device is None:  # keep the model where it is (e.g. cuda:1), rather than the default device
            device = next((p.device for p in model.parameters()), None)
        self.task = OwnTask.resolve(data, None, device, None, loss)
        self.model = model.to(self.task.device)
        self._named = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
        if self.optimizer is not None:
            self._check_optimizer_params()
        self.task.check_loss(self.model)
        self.strategy = Chain(privatizer, self.update)
        self.plan: RunPlan = plan_run(self.strategy, self.task.n, delta=delta, **plan_kwargs)
        self.delta = delta
        params = self._params()
        self.run = RunInfo(
            self.plan.noise_multiplier,
            self.plan.sampling_rate,
            self.plan.expected_batch_size,
            self.plan.steps,
            sum(p.numel() for p in params.values()),
        )
        self.strategy.validate_run(self.run)
        self.privatizer = privatizer
        self._p_state = privatizer.init(self.run)
        self._u_state = self.update.init(params, self.run) if self.optimizer is None else {}
        self.ledger, self.gateway, self.sampler = open_run(
            self.plan, seed=seed, device=self.task.device, secure_mode=secure_mode, run_id=run_id
        )
        self.oracle = GradientOracle(self.model, self.task.loss, chunk_size=chunk_size, method=grad_method)
        self.secure_mode = secure_mode
        self.t = 0  # steps taken (releases made)
        self._pending: tuple[Any, torch.Tensor] | None = None  # the drawn batch of step t + 1
        self._released: dict[str, tuple[torch.Tensor, int]] = {}  # the .grad tensors backward set
        if self.optimizer is not None:
            self.optimizer.register_step_pre_hook(self._check_grads)
        self.history: list[dict[str, Any]] = []
        self._started = time.perf_counter()

    def _check_optimizer_params(self) -> None:
        assert self.optimizer is not None
        mine = {id(p) for p in self.model.parameters()}  # frozen ones included: they get no .grad
        theirs = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if not theirs <= mine:
            raise ConfigError(
                "the optimizer holds tensors that are not parameters of the model; build it from "
                "model.parameters() after moving the model to its device."
            )

    def _params(self) -> Tensors:
        return {k: p.detach() for k, p in self._named.items()}

    # ------------------------------------------------------------------ the loop
    @property
    def steps(self) -> int:
        """T, fixed by the plan: ``batches()`` yields exactly this many."""
        return self.plan.steps

    def batches(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """The remaining planned Poisson batches (x, y), on the run's device. Pass each, as
        yielded, to ``backward``/``step`` before asking for the next (skipping a batch, changing
        it or passing one of your own choosing is refused: the accountant assumes every one of
        these Poisson batches is used as drawn, and a skip decided on a batch's content would
        depend on private data). A per-example transform (augmentation) belongs in the map-style
        Dataset's ``__getitem__``: the batches are read from it by index, example by example.
        Breaking out and calling ``batches()`` again resumes with the batch not yet used (also
        after a step that failed before its release).

        Their realised sizes are private (not differentially private: for the data owner only)."""
        while self.t < self.plan.steps:
            if self._pending is None:
                self._pending = self.task.batch(self.sampler.sample())
            t = self.t
            yield self._pending
            if self.t == t:
                raise ConfigError(
                    f"the batch of step {t + 1} was not passed to backward()/step() before the next one was "
                    "asked for; skipping a batch is not supported (the accountant assumes every planned "
                    "Poisson batch is used)."
                )

    def _lr(self) -> float:
        if self.optimizer is not None:
            return float(self.optimizer.param_groups[0].get("lr", float("nan")))
        return self.update.rate(self._u_state)

    def _release(self, x: Any, y: torch.Tensor) -> tuple[Released | None, dict[str, Any]]:
        if self.t >= self.plan.steps:
            raise BudgetExceededError(
                f"the plan has {self.plan.steps} steps and all were taken; make_private(..., steps=...) plans more."
            )
        pending = self._pending
        if pending is None or not _same_inputs(x, pending[0]) or not _same_tensor(y, pending[1]):
            raise ConfigError(
                "backward()/step() takes the batch that private.batches() just yielded, as yielded and once: "
                "the accountant assumes dptune's Poisson batches, and an x or y of your choosing (even of the "
                "same size) voids the guarantee. Fix: write `for x, y in private.batches(): private.step(x, y)`; "
                "put a per-example transform (augmentation) in your Dataset's __getitem__, which batches() "
                "calls for every example it draws."
            )
        t = self.t + 1
        releases = self.ledger.releases
        try:
            ctx = StepContext(t=t, x=x, y=y, oracle=self.oracle, release=self.gateway, run=self.run)
            lr = self._lr()
            released, self._p_state, info = self.privatizer.privatize(
                self._params(), self._p_state, ctx, lr=lr, label=self.strategy.name
            )
        finally:
            # The step is taken, and its batch spent, once its release is recorded; a failure before
            # (out of memory, say) leaves both, so steps_taken never exceeds the ledger's releases and
            # batches() yields the same batch again.
            if self.ledger.releases != releases:
                self._pending = None
                self.t = t
        row = {"step": t, "lr": lr, **info}
        self.history.append(row)
        return released, row

    def backward(self, x: Any, y: torch.Tensor) -> dict[str, Any]:
        """Release this batch's private gradient and store it in each parameter's ``.grad``
        (the mean over the expected batch size L; it replaces, never adds to, ``.grad``).
        Returns the step's public row (step, lr, C_t, ...)."""
        released, row = self._release(x, y)
        if released is None:
            g = {k: torch.zeros_like(p) for k, p in self._named.items()}
        else:
            g = released.gradient()
        self._released = {}
        for k, p in self._named.items():
            grad = g[k].detach().to(p.dtype)
            p.grad = grad
            self._released[k] = (grad, grad._version)
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
        for k, p in self._named.items():
            if p.grad is None:
                continue
            grad, version = self._released.get(k, (None, -1))
            if p.grad is not grad or grad._version != version:
                raise ConfigError(
                    f"the gradient of {k!r} is not the one private.backward() released (a loss.backward() "
                    "or an in-place change since?): the optimizer would use non-private gradients. Call "
                    "optimizer.zero_grad() and private.backward(x, y) right before optimizer.step()."
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
        if self.optimizer is None:
            final = self.update.finalize(self._params(), self._u_state)
        else:
            final = self._params()
        return TrainResult(
            history=list(self.history),
            evals=[],
            metric=self.task.metric_name,
            best_metric=None,
            best_step=None,
            best_params=None,
            final_params=clone(final),
            ledger=self.ledger,
            plan=self.plan,
            delta=self.delta,
            seconds=time.perf_counter() - self._started,
            model=self.model,
            secure_mode=self.secure_mode,
            steps_taken=self.t,
        )


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
) -> PrivateTraining:
    """Plan a private run of ``model`` on ``data`` and return the object your loop drives.

    ``optimizer``: a torch optimizer over ``model.parameters()`` (call ``optimizer.step()``
    after ``backward``; ``step`` does both) or a dptune update rule. ``privatizer``: the
    clipping/noise rule (default ``FixedClip(1.0)``; ``QuantileClip()``, ``OSOClip()``).
    Exactly one of ``noise_multiplier`` and ``target_epsilon`` (+ ``delta``); the plan (T,
    q, ν) is fixed here and the ledger refuses anything beyond it. ``data``: tensors (x, y),
    a map-style dataset or a DataLoader (its dataset only: docs/your_data.md). The seed is a
    secret key in seeded mode; ``secure_mode=True`` draws noise and batches from the OS CSPRNG.
    """
    plan_kwargs = {
        "epochs": epochs,
        "steps": steps,
        "expected_batch_size": expected_batch_size,
        "noise_multiplier": noise_multiplier,
        "target_epsilon": target_epsilon,
        "accountant": accountant,
        "allow_large_delta": allow_large_delta,  # δ ≥ 1/n is refused by plan_run unless this
    }
    return PrivateTraining(
        model,
        data,
        optimizer,
        privatizer=privatizer,
        loss=loss,
        plan_kwargs=plan_kwargs,
        delta=delta,
        seed=seed,
        secure_mode=secure_mode,
        device=device,
        grad_method=grad_method,
        chunk_size=chunk_size,
        run_id=run_id,
    )
