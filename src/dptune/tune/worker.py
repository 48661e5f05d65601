"""The worker side: execute one planned run (or a group of them) and return its result with its
own ledger. A worker receives the study (to rebuild data and model) and planned ``RunSpec``s; it
cannot change the budget: a run's ledger is created from its planned event, and the coordinator
checks the returned ledger against the plan again before merging it.

Checkpoint selection (Galli et al.: evaluate every 50 iterations, keep the best) scores the
selection split here, at the planned steps: exactly in public mode (the split is assumed public,
as in the papers); in private mode each score's sum (per-example scores clamped to [0, c]) is
released through ``NoisyRelease`` and divided by the split size m, so the best checkpoint is
chosen on noisy scores (post-processing) and exact validation scores never leave the worker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import torch
from torch.func import functional_call

from dptune.deliverable import full_state, model_identity
from dptune.devices import resolve_device
from dptune.errors import BudgetExceededError, DPTuneError
from dptune.gradients.persample import ScratchBuffers
from dptune.metrics import MSE, eval_mode, resolve, score_sums
from dptune.release.ledger import Ledger, atoms, compose
from dptune.release.mechanisms import NoiseSource, NoisyRelease, SumQuery
from dptune.release.sampling import stream_seed
from dptune.strategies import Strategy, make_strategy
from dptune.train import TrainResult, is_better, train
from dptune.tree import Tensors, clone, is_finite
from dptune.tune.data import StudyData, build_model, study_data
from dptune.tune.records import EVAL_LABEL, RunSpec
from dptune.tune.space import TRAINING_KEYS
from dptune.tune.spec import Study
from dptune.vectorized import train_many


def _with_checkpoints(strategy: Strategy, steps: set[int], hook: Callable[[int, Tensors], None]) -> Strategy:
    """The same strategy (same class behaviour, same hyperparameters) with a callback
    after the steps in ``steps``: it sees the parameters there (those the strategy evaluates:
    the running average of an averaging strategy), without touching the loop."""
    base = type(strategy)

    def step(self, params, state, ctx):  # noqa: ANN001
        params, state, info = base.step(self, params, state, ctx)
        if ctx.t in steps:
            hook(ctx.t, self.evaluated(params, state))
        return params, state, info

    cls = type(base.__name__, (base,), {"step": step, "__module__": base.__module__})
    return cls(**{f.name: getattr(strategy, f.name) for f in fields(strategy)})  # type: ignore[arg-type]


class Scorer:
    """Scores parameters on the selection split: exactly (public) or through the gateway (private)."""

    def __init__(self, model: torch.nn.Module, data: StudyData, metric: str, run: RunSpec, study: Study, device):
        self.model, self.metric, self.device = model, metric, device
        self.scratch = ScratchBuffers(model)  # the selection split may be private: no buffer writes
        self.x, self.y = data.x_val.to(device), data.y_val.to(device)
        self.m = int(self.x.shape[0])
        self.private = run.eval_noise_multiplier is not None
        # Per-example scores, clamped to [0, s] when released: accuracy s = 1, MSE s = the study's
        # mse_clip, your own dptune.Metric ("pkg.module:NAME") the sensitivity it declares.
        self.measure = resolve(metric, what="selection.metric")
        if self.measure is MSE:
            self.measure = self.measure.with_sensitivity(float(study.selection.mse_clip))
        if self.private:
            self.sensitivity = self.measure.require_sensitivity()
        else:
            self.sensitivity = float(self.measure.sensitivity or 1.0)
        self.ledger = Ledger.with_plan(_eval_event(run))
        # Private selection scores are releases too: secure mode covers their noise.
        self.gateway = NoisyRelease(
            self.ledger, 1.0, NoiseSource(stream_seed(run.run_seed, "selection"), device, secure=study.secure)
        )
        self.nu = run.eval_noise_multiplier

    def total(self, params: Tensors, x: torch.Tensor, y: torch.Tensor, clip: float | None) -> float:
        """Σ over examples of the per-example score (correct predictions, squared error, yours).

        ``clip`` (= the sensitivity c, private release): each score clamped to [0, c], a
        non-finite one counting as the worst (``Metric.scores``), so one example moves the sum by
        ≤ c; a non-finite prediction is a wrong one (``dptune.metrics.ACCURACY``)."""
        if not is_finite(params):
            return math.nan
        with eval_mode(self.model), self.scratch() as buffers:
            (total,), _ = score_sums(
                lambda xb: functional_call(self.model, (params, buffers), (xb,)),
                (x, y),
                self.measure,
                clip=clip is not None,
            )
        return total

    def score(self, params: Tensors) -> float:
        if not self.private:
            return self.total(params, self.x, self.y, None) / self.m
        s = self.total(params, self.x, self.y, self.sensitivity)
        if not math.isfinite(s):
            # Diverged parameters (only they: the per-example rules in ``total`` keep every
            # term finite): the released statistic is then that of a constant predictor
            # (0 correct / maximal error) — still released, so the ledger matches the plan.
            s = 0.0 if self.measure.higher_is_better else self.sensitivity * self.m
        (noisy,) = self.gateway.release(
            SumQuery(f"validation_{self.metric}_sum", torch.tensor(s, dtype=torch.float64), self.sensitivity, self.nu),
            label=EVAL_LABEL,
        )
        return float(noisy) / self.m

    def exact(self, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.total(params, x.to(self.device), y.to(self.device), None) / int(x.shape[0])


def _eval_event(run: RunSpec):
    from dp_accounting import dp_event

    n = len(run.eval_steps) + int(run.eval_final)
    if run.eval_noise_multiplier is None or n == 0:
        return dp_event.NoOpDpEvent()
    return compose([(dp_event.GaussianDpEvent(run.eval_noise_multiplier), n)])


def execute_run(study: Study, strategy_name: str, run_dict: dict[str, Any], metric: str) -> dict[str, Any]:
    """Train one planned run; return its metrics, history and ledger (as a dict). A pure function of
    its arguments on any executor, except in secure mode (OS-CSPRNG noise and batches)."""
    run = _configured(run_dict)
    with _threads(study.threads_per_run):
        device = resolve_device(study.training.device, "training.device")
        data = study_data(study.data, study.selection, study.seed)
        job = _RunJob(study, strategy_name, run, metric, data, device)
        result = train(
            job.model,
            (data.x_train, data.y_train),
            job.strategy,
            plan=job.plan,
            seed=run.run_seed,
            device=device,
            loss=study.training.loss,
            eval_data=None,
            progress=False,
            run_id="",
            secure_mode=study.secure,
        )
        return job.finish(result)


def _configured(run_dict: dict[str, Any]) -> RunSpec:
    run = RunSpec.from_dict(run_dict)
    if run.config is None:
        raise DPTuneError(f"run {run.run_id} has no configuration yet (adaptive stage not resolved)")
    return run


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch pinned to ``n`` threads while a task runs (``study.threads_per_run``)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class _RunJob:
    """One planned run on the worker side: its checkpoint-hooked strategy, its plan and its
    scorer before training; its result dict after."""

    def __init__(self, study: Study, strategy_name: str, run: RunSpec, metric: str, data: StudyData, device):
        self.t0 = time.perf_counter()
        self.run, self.data = run, data
        self.model = build_model(study.model, data, run.seed)
        self.model_spec = study.model
        self.test_public = study.data.test_public
        hp = {k: v for k, v in run.config.items() if k not in TRAINING_KEYS}
        base = make_strategy(strategy_name, **hp)
        self.scorer = Scorer(self.model, data, metric, run, study, device)
        self.higher = self.scorer.measure.higher_is_better
        self.evals: list[dict[str, Any]] = []
        self.best: dict[str, Any] = {"score": None, "step": None, "params": None}
        self.strategy = _with_checkpoints(base, set(run.eval_steps), self.consider)
        self.plan = run.run_plan(self.strategy, data.n_train, study.budget.accountant)
        if self.plan.event() != base.planned_event(run.noise_multiplier, run.sampling_rate, run.steps):
            raise BudgetExceededError(f"run {run.run_id}: the strategy's planned event differs from the study plan")

    def consider(self, t: int, params: Tensors, finalized: bool = False) -> None:
        s = self.scorer.score(params)
        self.evals.append({"step": t, "score": s, **({"finalized": True} if finalized else {})})
        if is_better(s, self.best["score"], self.higher):  # the rule of train.RunLoop's best checkpoint
            self.best.update(score=s, step=t, params=clone(params))

    def finish(self, result: TrainResult, seconds: float | None = None) -> dict[str, Any]:
        run, data = self.run, self.data
        if run.eval_final and not result.diverged:
            self.consider(run.steps, result.final_params, finalized=True)
        ledger = Ledger()
        ledger.extend(result.ledger)
        ledger.extend(self.scorer.ledger)
        test = None
        # An exact metric on a private test split (the user's, not declared public) would be published.
        if data.x_test is not None and self.best["params"] is not None and self.test_public:
            test = self.scorer.exact(self.best["params"], data.x_test, data.y_test)
        # The selected checkpoint's weights (CPU), for the coordinator to keep owner-only under
        # checkpoints/: the study's model is exported from them, never retrained (no new release).
        checkpoint = None
        if self.best["params"] is not None:
            checkpoint = {
                "state_dict": full_state(self.model, self.best["params"]),
                "model": model_identity(self.model_spec, data),
            }
        return {
            "run_id": run.run_id,
            "status": "diverged" if result.diverged else "done",
            "checkpoint": checkpoint,
            "score": self.best["score"],
            "best_step": self.best["step"],
            "test_metric": test,
            "evals": self.evals,
            "history": result.history,
            "ledger": ledger.to_dict(),
            "seconds": time.perf_counter() - self.t0 if seconds is None else seconds,
        }


def execute_group(
    study: Study, strategy_names: list[str], run_dicts: list[dict[str, Any]], metric: str
) -> dict[str, Any]:
    """Train a group of planned runs together with ``dptune.train_many``: ``{"results": [...]}``, each
    what ``execute_run`` would return up to float rounding (every run keeps its own seeds, streams,
    gateway, ledger and scorer)."""
    runs = [_configured(d) for d in run_dicts]
    with _threads(study.threads_per_run):
        t0 = time.perf_counter()
        device = resolve_device(study.training.device, "training.device")
        data = study_data(study.data, study.selection, study.seed)
        jobs = [_RunJob(study, name, run, metric, data, device) for name, run in zip(strategy_names, runs, strict=True)]
        results = train_many(
            [j.model for j in jobs],
            (data.x_train, data.y_train),
            [j.strategy for j in jobs],
            plans=[j.plan for j in jobs],
            seeds=[r.run_seed for r in runs],
            device=device,
            loss=study.training.loss,
            run_ids=[""] * len(jobs),
            fallback="sequential",
            secure_mode=study.secure,
        )
        seconds = (time.perf_counter() - t0) / len(jobs)  # the group's time, shared equally
        return {"results": [j.finish(r, seconds) for j, r in zip(jobs, results, strict=True)]}


def execute_task(kind: str, *args: Any) -> dict[str, Any]:
    """The executors' entry point: ``("run", study, strategy, run, metric)`` → ``execute_run``;
    ``("group", study, strategies, runs, metric)`` → ``execute_group``."""
    if kind == "run":
        return execute_run(*args)
    if kind == "group":
        return execute_group(*args)
    raise DPTuneError(f"unknown task kind {kind!r}")


def check_run_ledger(run: RunSpec, ledger: Ledger, status: str) -> None:
    """The coordinator's check of a returned ledger: exactly the run's plan (a diverged run,
    which stops early, may have released less — never more, never anything else)."""
    spent, planned = ledger.atoms(), atoms(run.planned_event)
    extra = spent - planned
    if extra:
        ev, n = next(iter(extra.items()))
        raise BudgetExceededError(
            f"run {run.run_id} returned releases that are not in its plan ({n} × {ev}); refusing to merge it."
        )
    if status == "done" and spent != planned:
        raise BudgetExceededError(
            f"run {run.run_id} is marked done but released less than planned; refusing to merge an inconsistent run."
        )
