"""``dptune.train``: one DP training run, from a model and tensors to a result with its ledger (created from the run's
plan first). ``RunLoop`` is the one run loop: ``train`` and the tuner's worker drive one, ``vectorized`` K in lockstep,
``make_private`` shares its set-up (``open_run``)."""

from __future__ import annotations

import copy
import difflib
import inspect
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any

import torch
from torch import nn

from dptune import accounting, metrics
from dptune.accounting.events import check_delta_for_n
from dptune.distributed import join, launched, parts, sync_model
from dptune.errors import ConfigError
from dptune.gradients.oracle import GradientOracle
from dptune.gradients.persample import rng_preserved
from dptune.metrics import Metric
from dptune.names import aliased
from dptune.outputs import NOT_DP_LABEL, Progress, checkpoint_rule, randomness_statement
from dptune.release.context import RunPlan, StepContext, snap_noise
from dptune.release.hypergradient import Later, collecting, read_with, settled
from dptune.release.ledger import Ledger
from dptune.release.mechanisms import NoiseSource, NoisyRelease
from dptune.release.sampling import (
    PoissonSampler,
    check_steps,
    default_batch_size,
    sampling_rate_for,
    steps_for_epochs,
    stream_seed,
)
from dptune.strategies import Strategy, make_strategy, strategy_signature
from dptune.task import OwnTask
from dptune.tree import Tensors, clone, sup_norm
from dptune.updates.defaults import starts_pretrained


def plan_run(
    strategy: Strategy,
    n: int,
    *,
    expected_batch_size: float | None = None,
    full_batch: bool = False,
    epochs: float | None = None,
    steps: int | None = None,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
    accountant: str = "auto",
    allow_large_delta: bool = False,
    pretrained: bool = False,
    **aliases: Any,
) -> RunPlan:
    """Resolve q, T and ν for one run; calibrate ν to (ε, δ) when a target is given.

    ``accountant='auto'``: the tightest valid one (``accounting.tightest_accountant``): exact μ-GDP at full batch, else
    PLD. δ ≥ 1/n is refused unless ``allow_large_delta``. No ``expected_batch_size``: ``default_batch_size(n)``. Warns
    (``SamplingWarning``) on q > 0.5 or T < 20. ``pretrained``: the model starts from pretrained weights (the
    fine-tuning defaults, ``updates.defaults``). ``aliases``: ``epsilon``, ``batch_size`` (``dptune.names``)."""
    target_epsilon, expected_batch_size = aliased(
        aliases, "plan_run", True, target_epsilon=target_epsilon, expected_batch_size=expected_batch_size
    )
    if not isinstance(pretrained, bool):
        raise ConfigError(f"pretrained must be True or False, got {pretrained!r}. Fix: e.g. pretrained=True.")
    if full_batch and expected_batch_size is not None:
        raise ConfigError("full_batch=True uses every example each step. Fix: drop expected_batch_size (--batch-size).")
    if not full_batch and expected_batch_size is None:  # DP-GD is full batch by definition (Panda et al., Alg. 1)
        full_batch = getattr(strategy, "name", None) == "dpgd"
        expected_batch_size = None if full_batch else default_batch_size(n)
    q = sampling_rate_for(n, expected_batch_size, full_batch)
    if (epochs is None) == (steps is None):
        raise ConfigError("give exactly one of epochs or steps.")
    T = steps_for_epochs(epochs, q) if epochs is not None else int(steps)  # type: ignore[arg-type]
    if T < 1:
        raise ConfigError(f"steps must be ≥ 1, got {steps}. Fix: e.g. steps=500.")
    check_steps(T, f"steps = {T}")
    if (0.5 < q < 1 or T < 20) and strategy.private:
        warnings.warn(SamplingWarning(q, T), stacklevel=3)
    accountant = accounting.tightest_accountant(q, T, delta or 1.0) if accountant == "auto" else accountant
    accounting.check_accountant(accountant)
    if accountant == "gdp" and q < 1 and strategy.private:
        raise ConfigError("accountant='gdp' is exact only for full batch (q = 1); use 'pld' (tight) or 'rdp'.")
    if strategy.private and delta is not None:  # where n and δ first meet: train, make_private, CLI
        check_delta_for_n(delta, n, allow_large_delta, "delta", "pass allow_large_delta=True (--allow-large-delta)")
    if not strategy.private:
        nu = math.inf
    elif noise_multiplier is not None:
        nu = accounting.check_noise_multiplier(noise_multiplier)
        if accountant == "pld":  # its ε is computed after training: refuse a PLD too large to compute now
            problem = accounting.pld_cost_problem(nu, accounting.releases_of(strategy.planned_event(nu, q, T)))
            if problem is not None:
                raise ConfigError(
                    f"the PLD accountant cannot account this run: {problem}. Fix: use accountant='rdp' "
                    "(--accountant rdp), or a larger noise multiplier / fewer steps."
                )
    elif target_epsilon is not None:
        if delta is None:
            raise ConfigError("target_epsilon needs delta too, e.g. delta=1e-5.")  # δ < 1/n: checked above
        releases = strategy.releases_per_run(T)
        nu = accounting.calibrate(target_epsilon, delta, q, releases, accountant=accountant).noise_multiplier
    else:
        raise ConfigError(f"strategy {strategy.name!r} is private: give noise_multiplier or target_epsilon (+ delta).")
    plan = RunPlan(strategy, n, q, T, nu, accountant, pretrained)
    return replace(plan, noise_multiplier=snap_noise(nu, [plan]))


class SamplingWarning(UserWarning):
    """A plan whose sampling rate q > 0.5 (little amplification by subsampling) or T < 20 steps."""

    def __init__(self, q: float, steps: int):
        super().__init__(
            f"the run samples q = {q:.3g} of the data per step for T = {steps} steps (advised: q ≤ 0.5, T ≥ 20). "
            "Fix: a smaller batch (--batch-size, expected_batch_size) or more epochs."
        )


@dataclass
class TrainResult:
    history: list[dict[str, Any]]  # one row per step: step, train_loss*, batch_size, lr, clip, ...
    evals: list[dict[str, float]]  # rows: step, metric value
    metric: str
    best_metric: float | None
    best_step: int | None
    best_params: Tensors | None
    final_params: Tensors
    ledger: Ledger
    plan: RunPlan
    delta: float | None
    diverged: bool = False
    seconds: float = 0.0
    model: nn.Module | None = field(default=None, repr=False)
    secure_mode: bool = False  # noise and Poisson batches from the OS CSPRNG (else from the seed)
    steps_taken: int | None = None  # when fewer than planned (a user loop stopped early); None: plan.steps
    # Was the evaluation data declared public? If not, the model is the final iterate and the evaluations are the
    # owner's only (not DP): kept out of release outputs (outputs.train_outputs).
    eval_public: bool = True
    # Secure mode: the proven worst-case ε slack of the snapped float sampler (NoisyRelease.snap_slack), beside ε.
    float_slack: float = 0.0
    # ε per (δ, accountant, releases so far): accounted once, whoever asks (summary, JSON, table, deliverable).
    _epsilons: dict[tuple[float, str, int], float] = field(default_factory=dict, repr=False, compare=False)
    # * train_loss: the mean loss on the private batch, for the owner's eyes, NOT DP; dptune never selects on it.

    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> float:
        """ε spent at δ, by ``accountant`` (default: the plan's, the one ν was calibrated with)."""
        d = delta if delta is not None else self.delta
        if d is None:
            raise ConfigError("epsilon() needs a delta.")
        key = (d, accountant or self.plan.accountant, self.ledger.releases)
        if key not in self._epsilons:
            self._epsilons[key] = self.ledger.epsilon(key[0], key[1])
        return self._epsilons[key]

    @property
    def checkpoint(self) -> str:
        """The released parameters: "best" (selected on public evaluation data) or "final"."""
        return "best" if self.best_params is not None else "final"

    def model_with(self, which: str = "best") -> nn.Module:
        """A copy of the model loaded with the best (default) or final parameters."""
        if self.model is None:
            raise ConfigError("this result carries no model")
        params = self.best_params if which == "best" and self.best_params is not None else self.final_params
        m = copy.deepcopy(self.model)
        m.load_state_dict({**m.state_dict(), **params})
        return m

    def __repr__(self) -> str:  # the history (train loss, batch sizes) and run time are the owner's: not shown
        eps = self.epsilon() if self.delta and self.plan.strategy.private else None
        owner = "history, seconds" + ("" if self.eval_public else ", evals, best_metric")
        return f"TrainResult(epsilon={eps}, delta={self.delta}, steps={self.steps_taken or self.plan.steps}; {owner}: {NOT_DP_LABEL})"

    def summary(self) -> dict[str, Any]:
        """The run's plan and guarantee; ``seconds`` (and ``best_metric``/``best_step`` on evaluation data not declared
        public) are the owner's only: ``outputs.train_outputs`` keeps them out of the release."""
        return {
            "strategy": self.plan.strategy.config(),
            "n": self.plan.n,
            "sampling_rate": self.plan.sampling_rate,
            "expected_batch_size": self.plan.expected_batch_size,
            "steps": self.plan.steps,
            "noise_multiplier": self.plan.noise_multiplier,
            "delta": self.delta,
            # ε by the accountant of the plan, named: RDP's ε of a PLD-calibrated run exceeds the target.
            "epsilon": self.epsilon() if self.delta else None,
            "accountant": self.plan.accountant,
            "metric": self.metric,
            "best_metric": self.best_metric,
            "best_step": self.best_step,
            "checkpoint": self.checkpoint,
            "eval_public": self.eval_public if self.evals else None,
            "diverged": self.diverged,
            "seconds": self.seconds,
            **randomness_statement(self.secure_mode),
            **({"epsilon_float_slack": self.float_slack} if self.secure_mode else {}),
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "history": self.history, "evals": self.evals, "ledger": self.ledger.to_dict()}


def evaluate(
    oracle: GradientOracle,
    params: Tensors,
    x: torch.Tensor,
    y: torch.Tensor,
    metric: str | Metric,
    batch: int | None = None,
) -> float:
    """The metric of ``params`` on (x, y): accuracy, mean squared error or a ``dptune.Metric``
    (``dptune.metrics.score_sums``, in batches of ``batch`` rows, default ``EVAL_BATCH``)."""
    forward = partial(oracle.forward, params)
    with metrics.eval_mode(oracle.model):
        return metrics.mean_scores(forward, metrics.batches(x, y, batch), metrics.resolve(metric))[0]


@dataclass(frozen=True)
class EvalSchedule:
    """When a run is scored: after the steps in ``steps``, and on the finalised parameters if ``final``."""

    steps: tuple[int, ...] = ()
    final: bool = False

    @classmethod
    def every(cls, steps: int, every: int, finalizes: bool, checkpoint: str = "best") -> EvalSchedule:
        """``best``: every ``every`` steps and the last (Galli: every 50), plus the finalised parameters
        when the strategy post-processes them (DP-GD's free step); ``final``: what the run ends with."""
        if checkpoint == "final":
            return cls((), True) if finalizes else cls((steps,), False)
        ts = tuple(range(every, steps + 1, every))
        return cls(ts if ts and ts[-1] == steps else (*ts, steps), finalizes)

    @cached_property
    def _due(self) -> frozenset[int]:
        return frozenset(self.steps)

    def due(self, t: int) -> bool:
        return t in self._due


def open_run(
    plan: RunPlan, *, seed: int, device: torch.device, secure_mode: bool, run_id: str, distributed: bool = False
) -> tuple[Ledger, NoisyRelease, PoissonSampler]:
    """A run's set-up (``RunLoop``, ``make_private``): the plan checked by its strategy, its ledger
    (created with the plan: no release beyond it), its privacy gateway (own noise stream) and its
    Poisson sampler at the plan's q. ``distributed``: this rank's parts (``dptune.distributed``)."""
    plan.strategy.validate_run(plan)
    noise, gateway_cls, sampler_cls = (
        parts(plan, secure_mode) if distributed else (NoiseSource, NoisyRelease, PoissonSampler)
    )
    ledger = Ledger.with_plan(plan.event())
    source = noise(stream_seed(seed, "noise"), device, secure_mode)
    planned = plan.noise_multiplier if plan.strategy.private else None
    gateway = gateway_cls(ledger, plan.sampling_rate, source, run_id, planned_multiplier=planned)
    # Secure mode covers the batches too: a seeded sampler lets anyone holding the seed
    # regenerate every batch, which voids the amplification by subsampling.
    sampler = sampler_cls(plan.n, plan.sampling_rate, seed, secure=secure_mode)
    return ledger, gateway, sampler


@dataclass
class StepRead:
    """A step begun (``RunLoop.begin``): what its one host read brings, then ``RunLoop.end``."""

    t: int
    batch_size: int
    info: dict[str, Any]
    pending: list[Later]  # the sign rules' released scalars (``hypergradient.later``)
    first: list[torch.Tensor]  # the parameters' sup norm (finite?), the train loss (data owner only) if computed


def read_dtype(device: torch.device) -> torch.dtype:
    """The loop's host read: float64 except on MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


class RunLoop:
    """One run: its plan-bound pieces (parameters, strategy state; ledger, gateway and sampler from
    ``open_run``), its ``EvalSchedule`` and score callback, its bookkeeping and best checkpoint
    (``consider``). ``drive`` runs it; ``dptune.vectorized`` (K runs, its own batches and gradients)
    per step: ``step`` → (``diverged``? stop) → ``eval_due`` → ``record``; at the end ``finish``."""

    def __init__(
        self,
        model: nn.Module,
        strategy: Strategy,
        plan: RunPlan,
        *,
        seed: int,
        device: torch.device,
        secure_mode: bool,
        run_id: str,
        metric: str | Metric,
        schedule: EvalSchedule,
        score: Callable[[Tensors], float] | None,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
        higher: bool | None = None,
        keep_best: bool = True,
        eval_public: bool = True,
        distributed: bool = False,
    ):
        """``score(params)``: the metric of one parameter set (None: no evaluation; the tuner's: scores
        released through their own gateway). ``keep_best``: only on public evaluation data or on
        released scores. The model must be on ``device``."""
        self.model, self.strategy, self.plan = model, strategy, plan
        # ``metric``: the evaluations' name, or a ``dptune.Metric`` (its name and direction).
        self.higher = metrics.higher_is_better(metric) if higher is None else higher
        self.metric, self.schedule = metric if isinstance(metric, str) else metric.name, schedule
        self.score, self.on_step = score, on_step
        self.keep_best, self.eval_public = keep_best, eval_public
        self.params = strategy.prepare({k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad})
        self.ledger, self.gateway, self.sampler = open_run(
            plan, seed=seed, device=device, secure_mode=secure_mode, run_id=run_id, distributed=distributed
        )
        self.state, self.secure_mode = strategy.init(self.params, plan), secure_mode
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, float]] = []
        self.best_metric: float | None = None
        self.best_step: int | None = None
        self.best_params: Tensors | None = None
        self.diverged, self.started = False, time.perf_counter()

    def drive(self, task: OwnTask, oracle: GradientOracle, delta: float | None, progress: bool = False) -> TrainResult:
        """Drive the run to its end (or its divergence) on ``task``'s Poisson batches; ``finish``."""
        bar = _Bar(self.plan.steps, self.strategy.name) if progress else None
        try:
            for t in range(1, self.plan.steps + 1):
                row = self.step(t, *task.batch(self.sampler.sample()), oracle)
                if self.diverged:
                    break
                self.record(t, row, self.scored() if self.eval_due(t) else None)
                if bar is not None:
                    bar.step(row)
        finally:
            if bar is not None:
                bar.close()
        oracle.check_model()  # nothing written into the model that the releases do not cover
        return self.finish(delta)

    def step(self, t: int, x: torch.Tensor, y: torch.Tensor, oracle: GradientOracle) -> dict[str, Any]:
        """The strategy's step ``t`` on the batch (x, y); returns the step's history row. A row that made the
        parameters non-finite is recorded here and sets ``diverged``: the caller stops the run. Otherwise the
        caller evaluates if ``eval_due`` and ``record``s it."""
        read = self.begin(t, x, y, oracle)
        return self.end(read, read_with(read.pending, read.first, read_dtype(read.first[0].device)))

    def begin(self, t: int, x: torch.Tensor, y: torch.Tensor, oracle: GradientOracle) -> StepRead:
        """``step`` up to its one host read (which ``end`` takes): K stacked trials read once for all."""
        ctx = StepContext(t=t, x=x, y=y, oracle=oracle, release=self.gateway, run=self.plan)
        with collecting() as pending:  # the sign rules' released scalars, read with the loop's own
            self.params, self.state, info = self.strategy.step(self.params, self.state, ctx)
        losses = ctx.computed_losses
        # Divergence is judged on the parameters only: they are post-processing of noisy
        # releases, so stopping on them leaks nothing (a stop on the private batch loss would).
        sup = sup_norm(self.params)  # finite iff every parameter is (checked on the host, in ``end``)
        first = [sup] if losses is None or not ctx.batch_size else [sup, losses.mean().to(sup.device)]
        return StepRead(t, ctx.batch_size, info, pending, first)

    def end(self, read: StepRead, values: list[float]) -> dict[str, Any]:
        """The step's row from the host values of ``read.first`` (the parameters' sup norm, train loss)."""
        self.state, info = settled(self.state), settled(read.info)
        row: dict[str, Any] = {"step": read.t, "batch_size": read.batch_size, **info}
        if len(values) == 2:
            row["train_loss"] = values[1]
        if not math.isfinite(values[0]):
            self.diverged = True
            self.history.append(row)
        return row

    @property
    def eval_params(self) -> Tensors:
        """The parameters an evaluation scores: the iterate, or its running average when the
        strategy averages its iterates (``Strategy.evaluated``: post-processing)."""
        return self.strategy.evaluated(self.params, self.state)

    def scored(self) -> float:
        assert self.score is not None
        return self.score(self.eval_params)

    def eval_due(self, t: int) -> bool:
        return self.score is not None and self.schedule.due(t)

    def record(self, t: int, row: dict[str, Any], value: float | None = None) -> None:
        """Record step ``t``'s row, with ``value``, the score of ``eval_params`` when an evaluation was due (kept if
        the best so far), then call ``on_step``."""
        if value is not None:
            row["eval_" + self.metric] = value
            self.evals.append({"step": t, self.metric: value})
            self.consider(value, t, self.eval_params)
        self.history.append(row)
        if self.on_step is not None:
            self.on_step(t, row)

    def consider(self, value: float, t: int, params: Tensors) -> None:
        """The best-checkpoint rule: keep ``params`` if their score ``value`` is a finite improvement on the best."""
        best = self.best_metric
        if math.isfinite(value) and (best is None or metrics.better(value, best, self.higher)):
            self.best_metric, self.best_step = value, t
            self.best_params = clone(params) if self.keep_best else None

    def finish(self, delta: float | None, seconds: float | None = None) -> TrainResult:
        """``finalize`` (unless diverged) and its evaluation when the schedule has it; load the
        final parameters into the model. ``seconds``: default, since construction."""
        if not self.diverged:
            self.params = self.strategy.finalize(self.params, self.state)
            if self.score is not None and self.schedule.final:
                value = self.score(self.params)
                self.evals.append({"step": self.plan.steps, self.metric: value, "finalized": 1.0})
                self.consider(value, self.plan.steps, self.params)
        self.model.load_state_dict({**self.model.state_dict(), **self.params})
        return TrainResult(
            history=self.history, evals=self.evals, metric=self.metric, best_metric=self.best_metric,
            best_step=self.best_step, best_params=self.best_params, final_params=clone(self.params),
            ledger=self.ledger, plan=self.plan, delta=delta, diverged=self.diverged, secure_mode=self.secure_mode,
            seconds=time.perf_counter() - self.started if seconds is None else seconds, model=self.model,
            eval_public=self.eval_public, float_slack=self.gateway.snap_slack,
            steps_taken=self.history[-1]["step"] if self.diverged and self.history else None,  # a card said T (review)
        )  # fmt: skip


def train(
    model: nn.Module,
    data: Any,
    strategy: Strategy | str = "dpsgd",
    *,
    epochs: float | None = None,
    steps: int | None = None,
    expected_batch_size: float | None = None,
    full_batch: bool = False,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
    accountant: str = "auto",
    eval_data: Any = None,
    eval_public: bool = False,
    checkpoint: str | None = None,
    eval_every: int = 50,
    metric: str | Metric | None = None,
    loss: str | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    secure_mode: bool = False,
    run_id: str = "",
    plan: RunPlan | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    progress: bool = False,
    chunk_size: int | None = None,
    grad_method: str | None = None,
    allow_large_delta: bool = False,
    distributed: bool | None = None,
    pretrained: bool | None = None,
    **hyperparameters: Any,
) -> TrainResult:
    """Train ``model`` privately with ``strategy`` and return a ``TrainResult``.

    Exactly one of ``noise_multiplier`` and ``target_epsilon`` (+ ``delta``) is needed for a private strategy. Sampling
    is Poisson at q = expected_batch_size / n (or full batch). The same ``seed`` reproduces the run bit for bit on CPU;
    the seed is then a secret key (whoever knows it can regenerate the noise and the batches). ``secure_mode=True``
    draws the noise and the Poisson batches from the OS CSPRNG instead (not reproducible). ``grad_method``: 'auto'
    (ghost norms where every layer is supported, else vmap), 'ghost' or 'vmap'. ``eval_data`` is private unless
    ``eval_public=True``: then the model is the final iterate (``checkpoint='final'``) and the evaluations are the
    owner's only; ``checkpoint='best'`` (the default when public) keeps the best evaluated parameters. ``distributed``
    (default: on when ``torchrun`` started several processes): one run on every process, each clipping its shard of the
    batch (``dptune.distributed``); every rank returns the same result. ``pretrained`` (default:
    ``updates.defaults.starts_pretrained(model)``, a Hugging Face model loaded by ``from_pretrained``): the fine-tuning
    defaults (docs/strategies.md, "Defaults for fine-tuning")."""
    checkpoint = checkpoint_rule(checkpoint, eval_data is not None, eval_public)
    target_epsilon, expected_batch_size, secure_mode = aliased(  # epsilon=, batch_size=, secure=: dptune.names
        hyperparameters, "train", target_epsilon=target_epsilon, expected_batch_size=expected_batch_size,
        secure_mode=secure_mode,
    )  # fmt: skip
    strategy, distributed = _strategy(strategy, hyperparameters), launched() if distributed is None else distributed
    task = OwnTask.resolve(data, eval_data, join(device) if distributed else device, metric, loss)
    with rng_preserved(task.device):  # the caller's streams back: each step reseeds them from a secret (sampling.py)
        plan = _run_plan(
            plan, strategy, task.n, eval_every, expected_batch_size=expected_batch_size, full_batch=full_batch,
            epochs=epochs, steps=steps, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, delta=delta,
            accountant=accountant, allow_large_delta=allow_large_delta,
            pretrained=starts_pretrained(model) if pretrained is None else pretrained,
        )  # fmt: skip
        model, oracle = task.prepare(model, chunk_size, grad_method)
        if distributed:
            sync_model(model, task.digest())
        loop = RunLoop(
            model, strategy, plan, seed=seed, device=task.device, secure_mode=secure_mode, run_id=run_id,
            metric=task.metric, schedule=EvalSchedule.every(plan.steps, eval_every, strategy.finalizes),
            score=partial(task.evaluate, oracle) if eval_data is not None else None, on_step=on_step,
            keep_best=checkpoint == "best", eval_public=eval_public, distributed=distributed,
        )  # fmt: skip
        return loop.drive(task, oracle, delta, progress)


def _run_plan(plan: RunPlan | None, strategy: Strategy, n: int, eval_every: int, **planning: Any) -> RunPlan:
    """``train``'s plan: the one given (for these n examples), else ``plan_run(strategy, n, **planning)``."""
    if eval_every < 1:
        raise ConfigError(f"eval_every must be ≥ 1, got {eval_every}. Fix: e.g. eval_every=50.")
    if plan is None:
        return plan_run(strategy, n, **planning)
    if plan.n != n:
        raise ConfigError(f"the plan is for n = {plan.n} examples but the data has {n}.")
    if planning.get("delta") is not None:  # the δ a given plan's ε will be reported at: refused as plan_run would
        allow = "pass allow_large_delta=True (--allow-large-delta)"
        check_delta_for_n(planning["delta"], n, planning.get("allow_large_delta", False), "delta", allow)
    return plan


def _strategy(strategy: Strategy | str, hyperparameters: dict[str, Any]) -> Strategy:
    own = [p for p in inspect.signature(train).parameters if p != "hyperparameters"]
    hps = strategy_signature(strategy)[1] if isinstance(strategy, str) else ()
    for k in hyperparameters:  # a misspelt argument of train() (target_eps) is not a hyperparameter
        close = difflib.get_close_matches(k, [*own, *hps], n=1, cutoff=0.6) if k not in hps else []
        if close and close[0] in own:
            raise ConfigError(f"train() has no argument {k!r}. Fix: did you mean {close[0]}=...?")
    if isinstance(strategy, str):
        built = make_strategy(strategy, **hyperparameters)
        mu = getattr(built, "momentum", 0.0)
        if "lr" in hyperparameters and "momentum" not in hyperparameters and mu:  # a ported run's trap
            warnings.warn(f"lr = {hyperparameters['lr']} with {strategy}'s default momentum μ = {mu}: the effective "
                          f"step is lr·C/(1−μ), {1 / (1 - mu):.3g}× lr·C. Fix: momentum=0 for plain SGD (Opacus's).",
                          UserWarning, stacklevel=3)  # fmt: skip
        return built
    if hyperparameters:
        raise ConfigError(
            f"unexpected keyword arguments {sorted(hyperparameters)} (hyperparameters go into the strategy)."
        )
    return strategy


class _Bar(Progress):
    """Steps of one run: a bar on a terminal, nothing when stderr is a file (no ``\\r`` in logs)."""

    def __init__(self, total: int, desc: str):
        super().__init__(total, desc, "step", leave=False)

    def step(self, row: dict[str, Any]) -> None:
        # C_t and ρ_t only: train_loss (the private batch's loss) and batch_size are not DP.
        self.update(1, ", ".join(f"{k}={row[k]:.3g}" for k in ("clip", "lr") if isinstance(row.get(k), float)))
