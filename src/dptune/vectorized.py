"""Vectorised trials: K runs of the same architecture trained at once, each exactly the run
``dptune.train`` would make with its own hyperparameters, seed, Poisson batches, noise stream,
gateway and ledger (design: docs/performance.md, "Vectorised trials").

Only the identical-shape work is batched: forward, backward to every Linear output, per-sample
ghost norms and evaluation (parameters stacked to [K, p, d], batches padded to the largest;
padded rows carry zero loss weight, so zero output gradient). Everything with privacy meaning
stays per trial: each trial is stepped by its own ``dptune.train.RunLoop`` (own sampler,
strategy step on a view of its rows, ``NoisyRelease`` and plan-bound ledger), so "all noise via
the gateway, recorded first" holds trial by trial. Results equal K sequential ``train`` calls up
to float rounding (``tests/training/test_vectorized.py``). Scope: (nested) ``nn.Sequential`` of
``nn.Linear``, element-wise activations, ``Flatten`` and inactive ``Dropout``; anything else
runs through ``train`` (``fallback='sequential'``) or raises (``fallback='error'``).
"""

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
from dptune.errors import ConfigError
from dptune.gradients.ghost import GhostGrads, LinearRule, rank_one_parts
from dptune.gradients.oracle import GradientOracle, MaterializedGrads, batched_loss, check_model, upper_norms
from dptune.metrics import Metric
from dptune.release.sampling import stream_seed
from dptune.strategies import Strategy, make_strategy
from dptune.train import RunLoop, RunPlan, TaskTensors, TrainResult, checkpoint_rule, plan_run, resolve_task, train
from dptune.tree import Tensors

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.ELU,
    nn.SiLU,
    nn.Softplus,
    nn.Identity,
    nn.Hardtanh,
    nn.ReLU6,
    nn.Mish,
    nn.CELU,
    nn.SELU,
    nn.Softsign,
    nn.Tanhshrink,
)


class Unsupported(ConfigError):
    """The model cannot be stacked; the message says why."""


@dataclass(frozen=True)
class _Op:
    kind: str  # 'linear' | 'fn' | 'flatten'
    module: nn.Module
    prefix: str  # parameter-name prefix of a Linear ('' at top level)

    def signature(self) -> tuple[Any, ...]:
        """What the trials' models must share, op by op, to be stacked."""
        m = self.module
        if self.kind == "linear":
            return ("linear", self.prefix, tuple(m.weight.shape), m.bias is not None)
        return (self.kind, type(m).__name__, repr(m))


def stack_plan(model: nn.Module) -> list[_Op]:
    """The model as a flat list of stackable operations; raises ``Unsupported`` otherwise."""
    ops: list[_Op] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        if type(mod) is nn.Sequential:
            for name, child in mod.named_children():
                visit(child, f"{prefix}{name}.")
            return
        where = f"'{prefix[:-1] or type(mod).__name__}' ({type(mod).__name__})"
        if isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward:
            if not mod.weight.requires_grad or (mod.bias is not None and not mod.bias.requires_grad):
                raise Unsupported(f"layer {where} has frozen parameters")
            ops.append(_Op("linear", mod, prefix))
        elif type(mod) in ELEMENTWISE:
            if getattr(mod, "inplace", False):
                raise Unsupported(f"layer {where} is in-place")
            ops.append(_Op("fn", mod, prefix))
        elif type(mod) is nn.Flatten:
            if mod.start_dim != 1 or mod.end_dim != -1:
                raise Unsupported(f"layer {where} flattens other dimensions than all but the batch")
            ops.append(_Op("flatten", mod, prefix))
        elif isinstance(mod, nn.Dropout) and (mod.p == 0 or not mod.training):
            return
        else:
            raise Unsupported(
                f"layer {where} cannot be stacked: vectorised trials support nn.Sequential models of "
                "Linear layers, element-wise activations, Flatten and inactive Dropout"
            )

    visit(model, "")
    if not any(op.kind == "linear" for op in ops):
        raise Unsupported("the model has no Linear layer")
    return ops


class _Stacked:
    """Forward/backward of K copies of one architecture with stacked parameters."""

    def __init__(self, ops: list[_Op]):
        self.ops = ops
        self.linears = [op for op in ops if op.kind == "linear"]

    def names(self, op: _Op) -> dict[str, str]:
        names = {"weight": f"{op.prefix}weight"}
        if op.module.bias is not None:
            names["bias"] = f"{op.prefix}bias"
        return names

    def stack(self, params: Sequence[Tensors]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        out = []
        for op in self.linears:
            nm = self.names(op)
            W = torch.stack([p[nm["weight"]] for p in params])
            b = torch.stack([p[nm["bias"]] for p in params]) if "bias" in nm else None
            out.append((W, b))
        return out

    def forward(
        self, weights: list[tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor, record: bool
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """x: [K, B, *in] → out [K, B, *]; with ``record``, the (input, output) of each Linear."""
        h = x
        recs = []
        li = 0
        for op in self.ops:
            if op.kind == "flatten":
                h = h.reshape(h.shape[0], h.shape[1], -1)
            elif op.kind == "fn":
                h = op.module(h)
            else:
                W, b = weights[li]
                li += 1
                if h.dim() != 3:
                    raise Unsupported("a Linear layer receives per-example inputs of more than one dimension")
                z = (
                    torch.baddbmm(b.unsqueeze(1), h, W.transpose(1, 2))
                    if b is not None
                    else torch.bmm(h, W.transpose(1, 2))
                )
                if record:
                    recs.append((h, z))
                h = z
        return h, recs


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
        if self._mine(params, x):
            return self.grads  # type: ignore[return-value]
        return self.base(params, x, y)

    def loss_and_grad(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Tensors]:
        """Mean loss and Σ_i g_i / B (the gradient of the mean loss, as ``GradientOracle``)."""
        if self._mine(params, x) and x.shape[0]:
            g = self.grads
            assert g is not None
            B = int(x.shape[0])
            return g.losses.mean(), g.weighted_sum(
                torch.full((B,), 1.0 / B, dtype=g.losses.dtype), drop_nonfinite=False
            )
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
    """Train K trials at once; result k equals ``train(model_k, data, strategy_k, seed=seeds[k],
    noise_multiplier=ν_k, ..., **configs[k])`` up to float rounding.

    ``seeds``: one distinct seed per trial (trials sharing a seed share their batches and noise,
    which cancels in combinations of their releases: refused unless ``allow_shared_seeds``), or
    one base seed, trial k then getting ``trial_seeds(seed, K)[k]``. ``models``: ``model_fn(seed)``,
    one module (copied per trial) or one per trial. ``strategy``: a name with ``configs`` (one dict
    per trial), or one ``Strategy`` per trial. ``noise_multiplier``, ``target_epsilon``: one value
    or one per trial; ``plans``: one ``RunPlan`` per trial instead of the run settings.
    ``on_step(k, t, row)``: after every step of trial k. ``block_size``: the most trials stacked at
    once (memory). Models that cannot be stacked run sequentially (``fallback='sequential'``) or
    raise ``ConfigError`` (``'error'``). ``eval_data`` is private unless ``eval_public``: as in
    ``train``, the final iterates then (``checkpoint``)."""
    _check_arguments(fallback, eval_every, loss)
    checkpoint = checkpoint_rule(checkpoint, eval_data is not None, eval_public)
    K = _trial_count(configs, seeds, noise_multiplier, target_epsilon, plans, run_ids, strategy, models)
    if K == 0:
        return []
    seed_list = _seed_list(seeds, K, allow_shared_seeds)
    nus = _per_trial(noise_multiplier, K, "noise_multiplier")
    epss = _per_trial(target_epsilon, K, "target_epsilon")
    settings = dict(epochs=epochs, steps=steps, expected_batch_size=expected_batch_size, full_batch=full_batch)
    trials = _Settings(
        _trial_models(models, seed_list, K),
        _trial_strategies(strategy, configs, plans, K),
        seed_list,
        list(run_ids) if run_ids is not None else [""] * K,
        [
            {"plan": plans[k]}
            if plans is not None
            else {**settings, "noise_multiplier": nus[k], "target_epsilon": epss[k], "accountant": accountant}
            for k in range(K)
        ],
        [partial(on_step, k) if on_step is not None else None for k in range(K)],  # on_step(k, t, row)
    )
    common = dict(delta=delta, eval_data=eval_data, eval_every=eval_every, metric=metric, loss=loss, device=device)
    common.update(eval_public=eval_public, checkpoint=checkpoint)
    try:
        stacked = _Stacked(_stack_ops(trials.strategies, trials.models))
    except Unsupported as exc:
        if fallback == "error":
            raise
        return _sequentially(exc, trials, data, secure_mode=secure_mode, **common)
    task = resolve_task(data, eval_data, device, metric, loss)
    if not isinstance(task.x, torch.Tensor):  # several inputs: the stacked forward takes one tensor
        if fallback == "error":
            raise Unsupported("a model with several inputs (tuple/dict batches) cannot be stacked")
        return _sequentially("several model inputs", trials, data, secure_mode=secure_mode, **common)
    return _train_stacked(trials, stacked, task, delta, eval_every, secure_mode, block_size, (checkpoint, eval_public))


@dataclass
class _Settings:
    """Each trial's own settings, resolved from ``train_many``'s per-trial arguments."""

    models: list[nn.Module]
    strategies: list[Strategy]
    seeds: list[int]
    run_ids: list[str]
    runs: list[dict[str, Any]]  # {"plan": RunPlan}, or plan_run's arguments besides strategy, n and δ
    hooks: list[Callable[[int, dict[str, Any]], None] | None]


def _sequentially(reason: object, trials: _Settings, data: Any, **common: Any) -> list[TrainResult]:
    """The trials one by one through ``dptune.train``, which plans each run itself (after reading
    the data, whatever its kind)."""
    warnings.warn(f"dptune.train_many: running the trials sequentially ({reason}).", RuntimeWarning, stacklevel=3)
    return [
        train(model, data, strategy, seed=seed, run_id=run_id, on_step=hook, **run, **common)
        for model, strategy, seed, run_id, run, hook in zip(
            trials.models, trials.strategies, trials.seeds, trials.run_ids, trials.runs, trials.hooks, strict=True
        )
    ]


def _train_stacked(
    trials: _Settings,
    stacked: _Stacked,
    task: TaskTensors,
    delta: float | None,
    eval_every: int,
    secure_mode: bool,
    block_size: int | None,
    selection: tuple[str, bool],  # (checkpoint, eval_public)
) -> list[TrainResult]:
    x, y, ex, ey, metric = task.x, task.y, task.ex, task.ey, task.metric
    assert isinstance(x, torch.Tensor)
    n = int(x.shape[0])

    def score(params: Tensors) -> float:
        assert ex is not None and ey is not None
        return _evaluate(stacked, [params], ex, ey, metric)[0]

    runs: list[_Trial] = []
    for k, run in enumerate(trials.runs):
        strategy = trials.strategies[k]
        plan = run["plan"] if "plan" in run else plan_run(strategy, n, delta=delta, **run)
        if plan.n != n:
            raise ConfigError(f"trial {k}: the plan is for n = {plan.n} examples but the data has {n}.")
        model = trials.models[k].to(task.device)
        loop = RunLoop(
            model,
            strategy,
            plan,
            seed=trials.seeds[k],
            device=task.device,
            secure_mode=secure_mode,
            run_id=trials.run_ids[k],
            metric=metric.name,
            eval_every=eval_every,
            score=score if ex is not None else None,
            on_step=trials.hooks[k],
            higher=metric.higher_is_better,
            keep_best=selection[0] == "best",
            eval_public=selection[1],
        )
        runs.append(_Trial(loop, _TrialOracle(lambda m=model: GradientOracle(m, task.loss))))
    lossfn = batched_loss(task.loss)
    size = block_size or len(runs)
    t0 = time.perf_counter()
    for start in range(0, len(runs), size):
        _run_block(runs[start : start + size], stacked, lossfn, x, y, ex, ey, metric)
    seconds = (time.perf_counter() - t0) / len(runs)
    return [tr.loop.finish(delta, seconds) for tr in runs]


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
    if callable(models):
        return [models(s) for s in seeds]
    return list(models)


def _trial_strategies(
    strategy: str | Strategy | Sequence[Strategy],
    configs: Sequence[Mapping[str, Any]] | None,
    plans: Sequence[RunPlan] | None,
    K: int,
) -> list[Strategy]:
    if plans is not None:
        return [p.strategy for p in plans]
    if isinstance(strategy, str):
        return [make_strategy(strategy, **dict(c)) for c in (configs if configs is not None else [{}] * K)]
    if configs is not None:
        raise ConfigError("configs go with a strategy name; otherwise give one Strategy instance per trial.")
    return [strategy] * K if isinstance(strategy, Strategy) else list(strategy)


def _stack_ops(strategies: list[Strategy], models: list[nn.Module]) -> list[_Op]:
    """The shared stack plan of the trials' models; ``Unsupported`` when they cannot be stacked."""
    for s in strategies:
        parts = s.parts() if hasattr(s, "parts") else ()
        blocked = [p.name for p in (s, *parts) if not getattr(p, "stackable", True)]
        if blocked:
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
    return ops


def _run_block(
    trials: list[_Trial],
    stacked: _Stacked,
    lossfn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    ex: torch.Tensor | None,
    ey: torch.Tensor | None,
    metric: Metric,
) -> None:
    """Step the trials in lockstep: one batched forward/backward per step, then each trial's
    ``RunLoop`` step; the evaluations due at a step run as one stacked forward."""
    buffers = _Buffers()
    T = max(tr.loop.plan.steps for tr in trials)
    for t in range(1, T + 1):
        active = [tr for tr in trials if not tr.loop.diverged and t <= tr.loop.plan.steps]
        if not active:
            break
        idxs = [inputs.indices_to(tr.loop.sampler.sample(), x.device) for tr in active]
        _batched_grads(active, idxs, stacked, lossfn, x, y, buffers)
        to_eval: list[tuple[_Trial, dict[str, Any]]] = []
        for tr, idx in zip(active, idxs, strict=True):
            row = tr.loop.step(t, tr.oracle.x, y[idx], tr.oracle)  # type: ignore[arg-type]
            tr.oracle.serve({}, x[:0], None)  # type: ignore[arg-type]  # release the batch's tensors
            if tr.loop.diverged:
                continue
            if tr.loop.eval_due(t):
                to_eval.append((tr, row))  # evaluated below, all together
            else:
                tr.loop.record(t, row)
        if to_eval:
            values = _evaluate(stacked, [tr.loop.eval_params for tr, _ in to_eval], ex, ey, metric)  # type: ignore[arg-type]
            for (tr, row), value in zip(to_eval, values, strict=True):
                tr.loop.record(t, row, value)


class _Buffers(dict[int, torch.Tensor]):
    """Padded batch buffers per source tensor (by id), reused across steps (grown when needed)."""

    def padded(self, src: torch.Tensor, K: int, B: int) -> torch.Tensor:
        buf = self.get(id(src))
        if buf is None or buf.shape[0] < K or buf.shape[1] < B:
            cap_k = max(K, buf.shape[0] if buf is not None else 0)
            cap_b = max(int(B * 1.1) + 1, buf.shape[1] if buf is not None else 0)
            buf = self[id(src)] = src.new_zeros((cap_k, cap_b, *src.shape[1:]))
        return buf[:K, :B]


def _batched_grads(
    active: list[_Trial],
    idxs: list[torch.Tensor],
    stacked: _Stacked,
    lossfn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    buffers: _Buffers,
) -> None:
    """One forward/backward for all active trials; hand each trial's oracle its view."""
    K = len(active)
    sizes = [int(i.numel()) for i in idxs]
    B = max(sizes)
    if B == 0:
        for tr in active:
            xi = x[:0]
            tr.oracle.serve(tr.loop.params, xi, tr.oracle.base(tr.loop.params, xi, y[:0]))
        return
    # Gather each trial's batch straight into a padded [K, B, ...] buffer kept across steps
    # (allocating and zeroing ~K·B·d floats per step cost more than the forward pass). Rows
    # past a trial's batch hold stale real examples: finite, masked out of the loss, unread.
    X, Y = buffers.padded(x, K, B), buffers.padded(y, K, B)
    mask = torch.zeros(K, B, dtype=torch.bool, device=x.device)
    xs = []
    for k, i in enumerate(idxs):
        torch.index_select(x, 0, i, out=X[k, : sizes[k]])
        torch.index_select(y, 0, i, out=Y[k, : sizes[k]])
        mask[k, : sizes[k]] = True
        xs.append(X[k, : sizes[k]])
    weights = stacked.stack([tr.loop.params for tr in active])
    leaves = [(W.requires_grad_(True), b.requires_grad_(True) if b is not None else None) for W, b in weights]
    out, recs = stacked.forward(leaves, X, record=True)
    losses = lossfn(out.reshape(K * B, *out.shape[2:]), Y.reshape(K * B, *Y.shape[2:])).reshape(K, B)
    losses = torch.where(mask, losses, torch.zeros_like(losses))
    zs = [z for _, z in recs]
    bs = torch.autograd.grad(losses.sum(), zs)
    losses = losses.detach()
    # Per-sample norms of all trials at once: Σ_layers ‖a‖²‖b‖² (+ ‖b‖² for the bias), as the
    # upper bounds of the ghost path (ghost.rank_one_parts, grads.upper_norms).
    parts: list[tuple[torch.Tensor, float]] = []
    acts = []
    for op, (h, _), b in zip(stacked.linears, recs, bs, strict=True):
        a = h.detach()
        acts.append(a)
        parts += rank_one_parts(a, b, op.module.bias is not None)
    norms = upper_norms(parts, losses, release_dtypes=[W.dtype for W, _ in weights])
    for k, tr in enumerate(active):
        Bk = sizes[k]
        layers = [
            LinearRule(stacked.names(op), a[k, :Bk], b[k, :Bk], tr.loop.params[f"{op.prefix}weight"])
            for op, a, b in zip(stacked.linears, acts, bs, strict=True)
        ]
        if Bk == 0:
            g: MaterializedGrads = MaterializedGrads(
                {kk: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for kk, p in tr.loop.params.items()},
                torch.zeros(0, device=x.device),
            )
        else:
            g = GhostGrads(layers, losses[k, :Bk], tr.loop.params, norms=norms[k, :Bk])
        tr.oracle.serve(tr.loop.params, xs[k], g)


def _evaluate(
    stacked: _Stacked, params: list[Tensors], x: torch.Tensor, y: torch.Tensor, metric: Metric
) -> list[float]:
    """``dptune.train.evaluate`` for several parameter sets at once: ``metrics.score_sums`` with
    the stacked forward (one pass of every batch for all K sets)."""
    K = len(params)
    with torch.no_grad():
        weights = stacked.stack(params)

    def forward(xb: torch.Tensor) -> torch.Tensor:
        return stacked.forward(weights, xb.unsqueeze(0).expand(K, *xb.shape), record=False)[0]

    return metrics.mean_scores(forward, (x, y), metric, trials=K)
