"""Vectorised trials: K runs of the same architecture trained at once, each exactly the run ``dptune.train`` would make
with its own hyperparameters, seed, Poisson batches, noise stream, gateway and ledger (design: docs/performance.md,
"Vectorised trials"). Only identical-shape work is batched (``gradients.stacked``); everything with privacy meaning
stays per trial, in its own ``RunLoop`` (sampler, step, gateway, ledger). Else ``train`` runs it (``fallback``)."""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import torch
from torch import nn

from dptune import inputs, metrics
from dptune.distributed import refuse_in_study
from dptune.errors import ConfigError
from dptune.gradients.isolation import check_modes
from dptune.gradients.oracle import GradientOracle, MaterializedGrads, batched_loss, check_model
from dptune.gradients.persample import rng_preserved
from dptune.gradients.stacked import PaddedBuffers, Stacked, StackOp, Unsupported, stack_plan
from dptune.metrics import Metric
from dptune.release.hypergradient import read_with
from dptune.release.sampling import stream_seed
from dptune.strategies import Strategy, make_strategy
from dptune.task import OwnTask, TaskTensors, resolve_task
from dptune.train import EvalSchedule, RunLoop, RunPlan, TrainResult, checkpoint_rule, plan_run, read_dtype, train
from dptune.tree import Tensors


class _TrialOracle:
    """What a trial's strategy sees as ``ctx.oracle``: the batched statistics of its own rows,
    served when asked at the trial's current parameters and batch; anything else (another
    point, another batch) goes to a real ``GradientOracle`` of the trial's model."""

    def __init__(self, base: Callable[[], GradientOracle]):
        self._make_base = base
        self.params: Tensors | None = None
        self.x: torch.Tensor | None = None
        self.grads: MaterializedGrads | None = None

    @cached_property
    def base(self) -> GradientOracle:
        return self._make_base()

    def serve(self, params: Tensors, x: torch.Tensor, grads: MaterializedGrads) -> None:
        self.params, self.x, self.grads = params, x, grads

    def _mine(self, params: Tensors, x: torch.Tensor) -> bool:
        return self.grads is not None and params is self.params and x is self.x

    def __call__(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> MaterializedGrads:
        return self.grads if self._mine(params, x) else self.base(params, x, y)  # type: ignore[return-value]

    def loss_and_grad(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        """Mean loss and Σ_i g_i / B (the gradient of the mean loss, as ``GradientOracle``)."""
        if (g := self.grads) is not None and self._mine(params, x) and (B := int(x.shape[0])):
            w = torch.full((B,), 1.0 / B, dtype=g.losses.dtype, device=g.losses.device)
            return g.losses.mean(), g.weighted_sum(w, drop_nonfinite=False)
        return self.base.loss_and_grad(params, x, y)

    def forward(self, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        return self.base.forward(params, x)

    def losses(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-example losses at any point (DP-ZO's θ ± μz): the trial's own model."""
        return self.base.losses(params, x, y)


@dataclass
class _Trial:
    loop: RunLoop  # the trial's run: params, state, gateway, ledger, sampler, history, best
    oracle: _TrialOracle  # serves the batched statistics of the trial's rows


def trial_seeds(seed: int, K: int) -> list[int]:
    """The seeds ``train_many(..., seeds=seed)`` gives its K trials: ``stream_seed(seed, f"trial{k}")``;
    result k equals ``train(..., seed=trial_seeds(seed, K)[k])``. Distinct seeds, not one: trials
    with the same seed share batches and noise, which cancel in combinations of their releases."""
    return [stream_seed(int(seed), f"trial{k}") for k in range(K)]


def _seed_list(seeds: int | Sequence[int], K: int, allow_shared_seeds: bool) -> list[int]:
    """Per-trial seeds: derived from one base seed, or the given list (duplicates refused)."""
    if isinstance(seeds, str | bytes) or not isinstance(seeds, Sequence):
        out = trial_seeds(int(seeds), K)  # type: ignore[arg-type]
    else:
        out = [int(s) for s in _per_trial(seeds, K, "seeds")]
    if not allow_shared_seeds and len(set(out)) < len(out):
        dup = sorted({s for s in out if out.count(s) > 1})
        raise ConfigError(
            f"seeds {dup} are given to several trials: those trials would share their Poisson batches "
            "and their noise, so combining their releases cancels the noise (with clips 1 and 3, "
            "A/1 − B/3 is the noiseless S₁ − S₃/3) and the accounted ε does not hold. Give every "
            "trial its own seed (or one base seed: seeds=0 derives distinct per-trial seeds), or "
            "pass allow_shared_seeds=True for deliberate replicas whose releases stay private."
        )
    return out


def _per_trial(value: Any, K: int, name: str) -> list[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        return [value] * K
    if len(value) != K:
        raise ConfigError(f"{name} has {len(value)} entries for {K} trials; give one per trial or a single value.")
    return list(value)


def train_many(
    models: Callable[[int], nn.Module] | nn.Module | Sequence[nn.Module],
    data: Any,
    strategy: str | Strategy | Sequence[Strategy] = "dpsgd",
    configs: Sequence[Mapping[str, Any]] | None = None,
    seeds: int | Sequence[int] = 0,
    *,
    noise_multiplier: float | Sequence[float] | None = None,
    target_epsilon: float | Sequence[float] | None = None,
    delta: float | None = None,
    accountant: str = "auto",
    epochs: float | None = None,
    steps: int | None = None,
    expected_batch_size: float | None = None,
    full_batch: bool = False,
    plans: Sequence[RunPlan] | None = None,
    eval_data: Any = None,
    eval_public: bool = False,
    checkpoint: str | None = None,
    eval_every: int = 50,
    metric: str | Metric | None = None,
    loss: str | None = None,
    device: str | torch.device | None = None,
    secure_mode: bool = False,
    run_ids: Sequence[str] | None = None,
    on_step: Callable[[int, int, dict[str, Any]], None] | None = None,
    block_size: int | None = None,
    fallback: str = "sequential",
    allow_shared_seeds: bool = False,
) -> list[TrainResult]:
    """Train K trials at once; result k equals ``train(model_k, data, strategy_k, seed=seeds[k], noise_multiplier=ν_k,
    ..., **configs[k])`` up to float rounding.

    ``seeds``: one distinct seed per trial (trials sharing a seed share their batches and noise, which cancels in
    combinations of their releases: refused unless ``allow_shared_seeds``), or one base seed, trial k then getting
    ``trial_seeds(seed, K)[k]``. ``models``: ``model_fn(seed)``, one module (copied per trial) or one per trial.
    ``strategy``: a name with ``configs`` (one dict per trial), or one ``Strategy`` per trial. ``noise_multiplier``,
    ``target_epsilon``: one value or one per trial; ``plans``: one ``RunPlan`` per trial instead of the run settings.
    ``on_step(k, t, row)``: after every step of trial k. ``block_size``: the most trials stacked at once (memory).
    Models that cannot be stacked run sequentially (``fallback='sequential'``) or raise ``ConfigError`` (``'error'``).
    ``eval_data`` is private unless ``eval_public``: as in ``train``, the final iterates then (``checkpoint``)."""
    _check_arguments(fallback, eval_every, loss)
    refuse_in_study("train_many", "train_many")
    checkpoint = checkpoint_rule(checkpoint, eval_data is not None, eval_public)
    K = _trial_count(configs, seeds, noise_multiplier, target_epsilon, plans, run_ids, strategy, models)
    if K == 0:
        return []
    seed_list = _seed_list(seeds, K, allow_shared_seeds)
    nus, epss = _per_trial(noise_multiplier, K, "noise_multiplier"), _per_trial(target_epsilon, K, "target_epsilon")
    settings: dict[str, Any] = dict(epochs=epochs, steps=steps, expected_batch_size=expected_batch_size)
    settings.update(full_batch=full_batch, accountant=accountant)
    runs = [{**settings, "noise_multiplier": nu, "target_epsilon": eps} for nu, eps in zip(nus, epss, strict=True)]
    common = dict(delta=delta, eval_data=eval_data, eval_every=eval_every, metric=metric, loss=loss, device=device)
    common.update(eval_public=eval_public, checkpoint=checkpoint, secure_mode=secure_mode)
    trials = _Settings(
        _trial_models(models, seed_list, K),
        _trial_strategies(strategy, configs, plans, K),
        seed_list,
        list(run_ids) if run_ids is not None else [""] * K,
        [{"plan": p} for p in plans] if plans is not None else runs,
        [partial(on_step, k) if on_step is not None else None for k in range(K)],  # on_step(k, t, row)
        common,
    )
    task = resolve_task(data, eval_data, device, metric, loss)
    try:
        if not isinstance(task.x, torch.Tensor):  # several inputs: the stacked forward takes one tensor
            raise Unsupported("a model with several inputs (tuple/dict batches) cannot be stacked")
        stacked = Stacked(_stack_ops(trials.strategies, trials.models, task.x))
    except Unsupported as exc:
        if fallback == "error":
            raise
        return _sequentially(exc, trials, data)
    with rng_preserved(task.device):  # each step reseeds the global streams (sampling.forward_rng): the caller's back
        return _train_stacked(trials, stacked, task, block_size)


@dataclass
class _Settings:
    """Each trial's own settings, resolved from ``train_many``'s per-trial arguments, and those they share."""

    models: list[nn.Module]
    strategies: list[Strategy]
    seeds: list[int]
    run_ids: list[str]
    runs: list[dict[str, Any]]  # {"plan": RunPlan}, or plan_run's arguments besides strategy, n and δ
    hooks: list[Callable[[int, dict[str, Any]], None] | None]
    common: dict[str, Any]  # ``train``'s arguments shared by every trial (delta, eval_every, secure_mode, ...)


def _warn_sequential(reason: object) -> None:
    warnings.warn(f"dptune.train_many: running the trials sequentially ({reason}).", RuntimeWarning, stacklevel=4)


def _sequentially(reason: object, trials: _Settings, data: Any) -> list[TrainResult]:
    """The trials one by one through ``dptune.train``, which plans each run itself (after reading
    the data, whatever its kind)."""
    _warn_sequential(reason)
    each = zip(trials.models, trials.strategies, trials.seeds, trials.run_ids, trials.runs, trials.hooks, strict=True)
    return [
        train(model, data, strategy, seed=seed, run_id=run_id, on_step=hook, **run, **trials.common)
        for model, strategy, seed, run_id, run, hook in each
    ]


def _train_stacked(trials: _Settings, stacked: Stacked, task: TaskTensors, block_size: int | None) -> list[TrainResult]:
    x, ex, ey, metric, common = task.x, task.ex, task.ey, task.metric, trials.common
    assert isinstance(x, torch.Tensor)
    n = int(x.shape[0])
    scores = partial(_evaluate, stacked, x=ex, y=ey, metric=metric) if ex is not None and ey is not None else None

    def score(params: Tensors) -> float:
        assert scores is not None
        return scores([params])[0]

    loops: list[RunLoop] = []
    for k, run in enumerate(trials.runs):
        strategy = trials.strategies[k]
        plan = run["plan"] if "plan" in run else plan_run(strategy, n, delta=common["delta"], **run)
        if plan.n != n:
            raise ConfigError(f"trial {k}: the plan is for n = {plan.n} examples but the data has {n}.")
        loops.append(RunLoop(
            trials.models[k].to(task.device), strategy, plan, seed=trials.seeds[k], device=task.device,
            secure_mode=common["secure_mode"], run_id=trials.run_ids[k], metric=metric,
            schedule=EvalSchedule.every(plan.steps, common["eval_every"], strategy.finalizes),
            score=score if scores is not None else None, on_step=trials.hooks[k],
            keep_best=common["checkpoint"] == "best", eval_public=common["eval_public"],
        ))  # fmt: skip
    return _Lockstep(stacked, x, task.y, task.loss, scores).train(loops, block_size, common["delta"])


def train_loops(loops: Sequence[RunLoop], task: OwnTask, block_size: int | None = None) -> list[TrainResult]:
    """Prepared runs on in-memory tensors, each with its own score callback (the tuner's trials), in
    lockstep when their models can be stacked, else one after the other (``RunLoop.drive``)."""
    try:
        if not isinstance(task.train, tuple) or not isinstance(task.train[0], torch.Tensor):
            raise Unsupported("a model with several inputs (tuple/dict batches) cannot be stacked")
        if not isinstance(task.loss, str):
            raise Unsupported("a loss callable cannot be stacked")
        stacked = Stacked(_stack_ops([lp.strategy for lp in loops], [lp.model for lp in loops], task.train[0]))
    except Unsupported as exc:
        _warn_sequential(exc)
        return [lp.drive(task, GradientOracle(lp.model, task.loss), None) for lp in loops]
    x, y = task.train
    return _Lockstep(stacked, x, y, task.loss).train(list(loops), block_size, None)


@dataclass
class _Lockstep:
    """Runs stepped together on the training tensors (x, y), a batched forward/backward a step for all;
    ``scores``: the due evaluations of a step at once (else each run's own ``score``)."""

    stacked: Stacked
    x: torch.Tensor
    y: torch.Tensor
    loss: str
    scores: Callable[[list[Tensors]], list[float]] | None = None

    def __post_init__(self) -> None:
        self.lossfn = batched_loss(self.loss)  # the per-example losses of a batch, without vmap

    def train(self, loops: list[RunLoop], block_size: int | None, delta: float | None) -> list[TrainResult]:
        """The runs in blocks of ``block_size``, each block in lockstep. The time is shared equally."""
        runs = [_Trial(lp, _TrialOracle(lambda m=lp.model: GradientOracle(m, self.loss))) for lp in loops]
        size = block_size or len(runs)
        t0 = time.perf_counter()
        for start in range(0, len(runs), size):
            self._block(runs[start : start + size])
        seconds = (time.perf_counter() - t0) / len(runs)
        return [tr.loop.finish(delta, seconds) for tr in runs]

    def _block(self, trials: list[_Trial]) -> None:
        """Step the trials in lockstep: one batched forward/backward per step, then each trial's
        ``RunLoop`` step; the evaluations due at a step run as one stacked forward (``scores``)."""
        buffers = PaddedBuffers()
        T = max(tr.loop.plan.steps for tr in trials)
        for t in range(1, T + 1):
            active = [tr for tr in trials if not tr.loop.diverged and t <= tr.loop.plan.steps]
            if not active:
                break
            idxs = [inputs.indices_to(tr.loop.sampler.sample(), self.x.device) for tr in active]
            self._grads(active, idxs, buffers)
            reads = []
            for tr, idx in zip(active, idxs, strict=True):
                reads.append(tr.loop.begin(t, tr.oracle.x, self.y[idx], tr.oracle))  # type: ignore[arg-type]
                tr.oracle.serve({}, self.x[:0], None)  # type: ignore[arg-type]  # release the batch's tensors
            # All K trials' loop reads (parameters finite, train loss, sign rules' scalars) in ONE host read
            # (on a GPU a read waits for the queued kernels: one a trial kept the queue short).
            firsts = [f for r in reads for f in r.first]
            values = read_with([b for r in reads for b in r.pending], firsts, read_dtype(firsts[0].device))
            to_eval: list[tuple[_Trial, dict[str, Any]]] = []
            for tr, r in zip(active, reads, strict=True):
                row = tr.loop.end(r, values[: len(r.first)])
                values = values[len(r.first) :]
                if tr.loop.diverged:
                    continue
                if tr.loop.eval_due(t):
                    to_eval.append((tr, row))  # evaluated below, all together
                else:
                    tr.loop.record(t, row)
            if to_eval:
                params = [tr.loop.eval_params for tr, _ in to_eval]
                values = self.scores(params) if self.scores is not None else [tr.loop.scored() for tr, _ in to_eval]
                for (tr, row), value in zip(to_eval, values, strict=True):
                    tr.loop.record(t, row, value)

    def _grads(self, active: list[_Trial], idxs: list[torch.Tensor], buffers: PaddedBuffers) -> None:
        """One forward/backward for all active trials; hand each trial's oracle its view."""
        if not any(int(i.numel()) for i in idxs):
            for tr in active:
                xi = self.x[:0]
                tr.oracle.serve(tr.loop.params, xi, tr.oracle.base(tr.loop.params, xi, self.y[:0]))
            return
        clips = [_clip_of(tr.loop) for tr in active]
        check_modes()  # the stacked trials' batched passes: no mode of yours sees them
        views = self.stacked.grads([tr.loop.params for tr in active], idxs, self.lossfn, self.x, self.y, buffers, clips)
        for tr, (xk, g) in zip(active, views, strict=True):
            tr.oracle.serve(tr.loop.params, xk, g)


def _check_arguments(fallback: str, eval_every: int, loss: Any) -> None:
    if fallback not in ("sequential", "error"):
        raise ConfigError(f"fallback must be 'sequential' or 'error', got {fallback!r}.")
    if eval_every < 1:
        raise ConfigError(f"eval_every must be ≥ 1, got {eval_every}. Fix: e.g. eval_every=50.")
    if loss is not None and not isinstance(loss, str):
        raise ConfigError(
            "train_many takes a built-in loss name (cross_entropy, mse or bce); a loss callable "
            "works with dptune.train (docs/your_data.md)."
        )


_PER_TRIAL = ("configs", "seeds", "noise_multiplier", "target_epsilon", "plans", "run_ids", "strategy", "models")


def _trial_count(*values: Any) -> int:
    """K: the length that every per-trial argument given as a list (``_PER_TRIAL``) agrees on; 1 if none is."""
    lengths = {
        name: len(v)
        for name, v in zip(_PER_TRIAL, values, strict=True)
        if isinstance(v, Sequence) and not isinstance(v, str | Strategy | nn.Module)
    }
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"per-trial arguments disagree on the number of trials: {lengths}.")
    return next(iter(lengths.values()), 1)


def _trial_models(
    models: Callable[[int], nn.Module] | nn.Module | Sequence[nn.Module], seeds: list[int], K: int
) -> list[nn.Module]:
    if isinstance(models, nn.Module):
        return [copy.deepcopy(models) for _ in range(K)]
    out = [models(s) for s in seeds] if callable(models) else list(models)
    if len({id(m) for m in out}) < len(out):  # trial k would start where trial k - 1 ended (found in review)
        raise ConfigError("one model object serves several trials. Fix: one model per trial, or a factory.")
    return out


def _trial_strategies(
    strategy: str | Strategy | Sequence[Strategy],
    configs: Sequence[Mapping[str, Any]] | None,
    plans: Sequence[RunPlan] | None,
    K: int,
) -> list[Strategy]:
    if plans is not None:
        return [p.strategy for p in plans]  # type: ignore[misc]  # a plan's strategy is a Strategy
    if isinstance(strategy, str):
        return [make_strategy(strategy, **dict(c)) for c in (configs if configs is not None else [{}] * K)]
    if configs is not None:
        raise ConfigError("configs go with a strategy name; otherwise give one Strategy instance per trial.")
    return [strategy] * K if isinstance(strategy, Strategy) else list(strategy)


def _stack_ops(strategies: list[Strategy], models: list[nn.Module], x: torch.Tensor) -> list[StackOp]:
    """The shared stack plan of the trials' models on inputs like ``x``; ``Unsupported`` when they cannot be stacked."""
    for s in strategies:
        parts = s.parts() if hasattr(s, "parts") else ()
        if blocked := [p.name for p in (s, *parts) if not getattr(p, "stackable", True)]:
            raise Unsupported(
                f"{blocked[0]!r} cannot be stacked (its steps are not vectorised): "
                "Fix: train its trials one by one (fallback='sequential')"
            )
    ops = stack_plan(models[0])
    for m in models[1:]:
        if [op.signature() for op in stack_plan(m)] != [op.signature() for op in ops]:
            raise Unsupported("the trials' models differ in architecture")
    for m in models:
        check_model(m)
    Stacked(ops).check_input(models[0], x)
    return ops


def _clip_of(loop: RunLoop) -> float | None:
    """The C the run's privatizer clips this step's sum at (a fixed ``clip``, or its state's C_t), if any: the
    stacked engine forms that sum for all trials at once (``stacked.presum_clipped``); a wrong guess costs
    only the work (the privatizer's ``clipped_sum`` asks its exact C)."""
    clip = getattr(getattr(loop.strategy, "privatizer", None), "clip", None)
    if clip is None and isinstance(loop.state, dict):
        clip = loop.state.get("privatizer", {}).get("clip")
    return float(clip) if isinstance(clip, int | float) and not isinstance(clip, bool) else None


def _evaluate(stacked: Stacked, params: list[Tensors], x: torch.Tensor, y: torch.Tensor, metric: Metric) -> list[float]:
    """``dptune.train.evaluate`` for several parameter sets at once: ``metrics.score_sums`` with
    the stacked forward (one pass of every batch for all K sets, EVAL_BATCH / K rows a batch)."""
    K = len(params)
    with torch.no_grad():
        weights = stacked.stack(params)

    def forward(xb: torch.Tensor) -> torch.Tensor:
        return stacked.forward(weights, xb.unsqueeze(0).expand(K, *xb.shape), record=False)[0]

    return metrics.mean_scores(forward, metrics.batches(x, y, max(1, metrics.EVAL_BATCH // K)), metric, trials=K)
