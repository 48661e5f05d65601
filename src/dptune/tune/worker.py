"""The worker side: execute one planned run (or a group) and return it with its own ledger, created from the planned
event (the coordinator re-checks it). Checkpoint selection scores the selection split at the planned steps: exactly in
public mode; in private mode each clamped score sum is released through ``NoisyRelease`` (exact scores stay here)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.func import functional_call

from dptune import inputs
from dptune.deliverable import full_state, model_identity
from dptune.devices import resolve_device
from dptune.errors import BudgetExceededError, DPTuneError
from dptune.gradients.oracle import GradientOracle
from dptune.gradients.persample import ScratchBuffers
from dptune.metrics import MSE, eval_mode, resolve, score_sums
from dptune.release.ledger import Ledger, atoms, compose
from dptune.release.mechanisms import NoiseSource, NoisyRelease, SumQuery
from dptune.release.sampling import stream_seed
from dptune.strategies import make_strategy
from dptune.task import OwnTask
from dptune.train import EvalSchedule, RunLoop, TrainResult
from dptune.tree import Tensors, is_finite
from dptune.tune.data import StudyData, build_model, study_data
from dptune.tune.records import EVAL_LABEL, RunSpec
from dptune.tune.space import TRAINING_KEYS
from dptune.tune.spec import Study
from dptune.vectorized import train_loops


class Scorer:
    """Scores parameters on the selection split: exactly (public) or through the gateway (private)."""

    def __init__(self, model: torch.nn.Module, data: StudyData, metric: str, run: RunSpec, study: Study, device):
        self.model, self.metric, self.device = model, metric, device
        self.scratch = ScratchBuffers(model)  # the selection split may be private: no buffer writes
        self.x, self.y = inputs.to(data.x_val, device), data.y_val.to(device)
        self.m = int(self.y.shape[0])
        self.private = run.eval_noise_multiplier is not None
        # Per-example scores, clamped to [0, s] when released: accuracy s = 1, MSE s = the study's
        # mse_clip, your own dptune.Metric ("pkg.module:NAME") the sensitivity it declares.
        self.measure = resolve(metric, what="selection.metric")
        if self.measure is MSE:
            self.measure = self.measure.with_sensitivity(float(study.selection.mse_clip))
        self.sensitivity = (
            self.measure.require_sensitivity() if self.private else float(self.measure.sensitivity or 1.0)
        )
        self.ledger = Ledger.with_plan(_eval_event(run))
        # Private selection scores are releases too: secure mode covers their noise.
        self.gateway = NoisyRelease(
            self.ledger, 1.0, NoiseSource(stream_seed(run.run_seed, "selection"), device, secure=study.secure)
        )
        self.nu = run.eval_noise_multiplier

    def total(self, params: Tensors, x: inputs.Inputs, y: torch.Tensor, clip: float | None) -> float:
        """Σ over examples of the per-example score; ``clip`` (the sensitivity c): each score clamped to
        [0, c], a non-finite one the worst, so one example moves the sum by ≤ c."""
        if not is_finite(params):
            return math.nan
        with eval_mode(self.model), self.scratch() as buffers:
            (total,), _ = score_sums(
                lambda xb: functional_call(self.model, (params, buffers), *inputs.args_kwargs(xb)),
                (x, y),
                self.measure,
                clip=clip is not None,
                model=self.model,
            )
        return total

    def score(self, params: Tensors) -> float:
        if not self.private:
            return self.total(params, self.x, self.y, None) / self.m
        s = self.total(params, self.x, self.y, self.sensitivity)
        if not math.isfinite(s):
            # Diverged parameters (only they: the per-example rules in ``total`` keep every term finite): a constant
            # predictor's statistic (0 correct / maximal error), still released so the ledger matches the plan.
            s = 0.0 if self.measure.higher_is_better else self.sensitivity * self.m
        (noisy,) = self.gateway.release(
            SumQuery(f"validation_{self.metric}_sum", torch.tensor(s, dtype=torch.float64), self.sensitivity, self.nu),
            label=EVAL_LABEL,
        )
        return float(noisy) / self.m

    def exact(self, params: Tensors, x: inputs.Inputs, y: torch.Tensor) -> float:
        return self.total(params, inputs.to(x, self.device), y.to(self.device), None) / int(y.shape[0])


def _eval_event(run: RunSpec):
    from dp_accounting import dp_event

    n = len(run.eval_steps) + int(run.eval_final)  # the steps of the run's EvalSchedule
    if run.eval_noise_multiplier is None or n == 0:
        return dp_event.NoOpDpEvent()
    return compose([(dp_event.GaussianDpEvent(run.eval_noise_multiplier), n)])


def execute_run(study: Study, strategy_name: str, run_dict: dict[str, Any], metric: str) -> dict[str, Any]:
    """Train one planned run; return its metrics, history and ledger: pure on any executor (but secure mode)."""
    run = _configured(run_dict)
    with _threads(study.threads_per_run):
        job, task = _jobs(study, [strategy_name], [run], metric)
        loop = job[0].loop
        return job[0].finish(loop.drive(task, GradientOracle(loop.model, task.loss), None))


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
    """One planned run on the worker side: its scored ``RunLoop`` before training, its result dict after."""

    def __init__(self, study: Study, strategy_name: str, run: RunSpec, metric: str, data: StudyData, task: OwnTask):
        self.t0 = time.perf_counter()
        self.run, self.data = run, data
        model = build_model(study.model, data, run.seed)
        self.model_spec, self.test_public = study.model, study.data.test_public
        strategy = make_strategy(strategy_name, **{k: v for k, v in run.config.items() if k not in TRAINING_KEYS})
        self.scorer = Scorer(model, data, metric, run, study, task.device)
        plan = run.run_plan(strategy, data.n_train, study.budget.accountant)
        model, _ = task.prepare(model)
        self.loop = RunLoop(
            model, strategy, plan, seed=run.run_seed, device=task.device, secure_mode=study.secure, run_id="",
            metric="score", schedule=EvalSchedule(tuple(run.eval_steps), run.eval_final), score=self.scorer.score,
            higher=self.scorer.measure.higher_is_better,
        )  # fmt: skip

    def finish(self, result: TrainResult, seconds: float | None = None) -> dict[str, Any]:
        run, data, best = self.run, self.data, result.best_params
        ledger = Ledger()
        ledger.extend(result.ledger)
        ledger.extend(self.scorer.ledger)
        # An exact metric on a private test split (the user's, not declared public) would be published.
        test = None
        if data.x_test is not None and best is not None and self.test_public:
            test = self.scorer.exact(best, data.x_test, data.y_test)
        # The selected checkpoint's weights (CPU), for the coordinator to keep owner-only under
        # checkpoints/: the study's model is exported from them, never retrained (no new release).
        checkpoint = None
        if best is not None:
            checkpoint = {
                "state_dict": full_state(self.loop.model, best),
                "model": model_identity(self.model_spec, data),
            }
        return {
            "run_id": run.run_id,
            "status": "diverged" if result.diverged else "done",
            "checkpoint": checkpoint,
            "score": result.best_metric,
            "best_step": result.best_step,
            "test_metric": test,
            # The store's formats: scores in evals only, a finalised one marked True.
            "evals": [{**e, "finalized": True} if "finalized" in e else e for e in result.evals],
            "history": [{k: v for k, v in row.items() if k != "eval_score"} for row in result.history],
            "ledger": ledger.to_dict(),
            "float_slack": result.float_slack + self.scorer.gateway.snap_slack,  # secure: the stated slack (item 1b)
            "seconds": time.perf_counter() - self.t0 if seconds is None else seconds,
        }


def _jobs(study: Study, names: list[str], runs: list[RunSpec], metric: str) -> tuple[list[_RunJob], OwnTask]:
    device = resolve_device(study.training.device, "training.device")
    data = study_data(study.data, study.selection, study.seed)
    task = OwnTask.resolve((data.x_train, data.y_train), None, device, None, study.training.loss)
    return [_RunJob(study, name, run, metric, data, task) for name, run in zip(names, runs, strict=True)], task


def execute_group(
    study: Study, strategy_names: list[str], run_dicts: list[dict[str, Any]], metric: str
) -> dict[str, Any]:
    """Train a group of planned runs together (``train_loops``): ``{"results": [...]}``, each what
    ``execute_run`` returns up to float rounding (own seeds, streams, gateway, ledger, scorer)."""
    runs = [_configured(d) for d in run_dicts]
    with _threads(study.threads_per_run):
        t0 = time.perf_counter()
        jobs, task = _jobs(study, strategy_names, runs, metric)
        results = train_loops([j.loop for j in jobs], task)
        seconds = (time.perf_counter() - t0) / len(jobs)  # the group's time, shared equally
        return {"results": [j.finish(r, seconds) for j, r in zip(jobs, results, strict=True)]}


def execute_task(kind: str, *args: Any) -> dict[str, Any]:
    """The executors' entry point: a ``"run"`` or ``"group"`` task → ``execute_run``/``execute_group``."""
    if kind == "run":
        return execute_run(*args)
    if kind == "group":
        return execute_group(*args)
    raise DPTuneError(f"unknown task kind {kind!r}")


def check_run_ledger(run: RunSpec, ledger: Ledger, status: str) -> None:
    """The coordinator's check of a returned ledger: exactly the run's plan (a diverged run,
    which stops early, may have released less — never more, never anything else)."""
    spent, planned = ledger.atoms(), atoms(run.planned_event)
    if extra := spent - planned:
        ev, n = next(iter(extra.items()))
        raise BudgetExceededError(
            f"run {run.run_id} returned releases that are not in its plan ({n} × {ev}); refusing to merge it."
        )
    if status == "done" and spent != planned:
        raise BudgetExceededError(
            f"run {run.run_id} is marked done but released less than planned; refusing to merge an inconsistent run."
        )
