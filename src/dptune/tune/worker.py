"""The worker side: execute one planned run and return its result with its own ledger.

A worker receives the study (dataset/model specs to rebuild them) and ONE planned
``RunSpec`` — configuration, ν, seeds. It cannot change the budget: the run's ledger
is created from the run's planned event, and the coordinator checks the returned
ledger against the plan again before merging it.

Checkpoint selection (Galli et al. evaluate every 50 iterations and keep the best):
the scores are computed here, on the selection split, at the planned steps.

* public mode: the exact metric (the split is assumed public, as in the papers);
* private mode: each score is released through ``NoisyRelease.release`` — the sum
  of per-example scores (count of correct predictions: sensitivity 1 under
  add/remove; per-example MSE clipped to [0, c], a non-finite error counting as c and a
  non-finite prediction as wrong: sensitivity c) plus Gaussian noise
  of std ν_sel·sensitivity, divided by the split size m (treated as public, like n in
  q = L/n). The best checkpoint is chosen on the noisy scores (post-processing);
  exact validation scores never leave the worker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
from torch.func import functional_call

from dptune.deliverable import full_state, model_identity
from dptune.devices import resolve_device
from dptune.errors import BudgetExceededError, DPTuneError
from dptune.ledger import Ledger, atoms, compose
from dptune.mechanisms import NoiseSource, NoisyRelease, SumQuery
from dptune.metrics import MSE, eval_mode, resolve, score_sums
from dptune.persample import ScratchBuffers
from dptune.sampling import stream_seed
from dptune.strategies import Strategy, make_strategy
from dptune.train import RunPlan, TrainResult, train
from dptune.tree import Tensors, clone, is_finite
from dptune.tune.data import StudyData, build_model, study_data
from dptune.tune.planners import EVAL_LABEL, RunSpec
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
    """Train one planned run; return its metrics, history and ledger (as a dict).

    Pure function of its arguments: the same run gives the same result on any executor
    (torch threads are pinned to ``study.threads_per_run``), except in secure mode
    (``study.secure``), where noise and batches come from the OS CSPRNG."""
    run = RunSpec.from_dict(run_dict)
    if run.config is None:
        raise DPTuneError(f"run {run.run_id} has no configuration yet (adaptive stage not resolved)")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(study.threads_per_run)
    try:
        return _execute(study, strategy_name, run, metric)
    finally:
        torch.set_num_threads(old_threads)


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
        self.plan = RunPlan(self.strategy, data.n_train, run.sampling_rate, run.steps, run.noise_multiplier)
        if self.plan.event() != base.planned_event(run.noise_multiplier, run.sampling_rate, run.steps):
            raise BudgetExceededError(f"run {run.run_id}: the strategy's planned event differs from the study plan")

    def consider(self, t: int, params: Tensors, finalized: bool = False) -> None:
        s = self.scorer.score(params)
        self.evals.append({"step": t, "score": s, **({"finalized": True} if finalized else {})})
        best = self.best
        if math.isfinite(s) and (best["score"] is None or (s > best["score"] if self.higher else s < best["score"])):
            best.update(score=s, step=t, params=clone(params))

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


def _execute(study: Study, strategy_name: str, run: RunSpec, metric: str) -> dict[str, Any]:
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


def execute_group(
    study: Study, strategy_names: list[str], run_dicts: list[dict[str, Any]], metric: str
) -> dict[str, Any]:
    """Train a group of planned runs together with ``dptune.train_many`` (vectorised trials).

    Each run keeps everything that is its own — configuration, seeds, sampling and noise
    streams, gateway, ledger, checkpoint scorer — so each result is the one ``execute_run``
    would return, up to float rounding of the batched matrix products (tested). Returns
    ``{"results": [one execute_run-style dict per run, in order]}``."""
    runs = [RunSpec.from_dict(d) for d in run_dicts]
    for run in runs:
        if run.config is None:
            raise DPTuneError(f"run {run.run_id} has no configuration yet (adaptive stage not resolved)")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(study.threads_per_run)
    try:
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
    finally:
        torch.set_num_threads(old_threads)


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
