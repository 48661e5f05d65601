"""The Ray executor on a real local Ray instance gives the same study as the local executor."""

from __future__ import annotations

import math

import pytest
import torch

from dptune.tune import (
    BudgetSpec,
    MethodSpec,
    SelectionSpec,
    StrategyArm,
    Study,
    TrainingSpec,
    budget_rows,
    run_study,
    study_table,
)
from dptune.tune.store import Store

ray = pytest.importorskip("ray")


def _study() -> Study:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(1)
    return Study(
        data=(x[:300], y[:300], x[300:], y[300:]), model="logistic_regression",
        strategies=(StrategyArm("dpsgd", space={"lr": [0.3, 1.0]}, fixed={"clip": 1.0}),),
        training=TrainingSpec(steps=25, expected_batch_size=40),
        budget=BudgetSpec(epsilon=(2.0,), delta=1e-5, accountant="rdp"), method=MethodSpec("grid"),
        selection=SelectionSpec(mode="private", split="holdout", eval_every=10, noise_multiplier=30.0),
        seeds=(0, 1), name="ray-vs-local",
    )


def _runs(d):
    with Store(d) as s:
        return {r["run_id"]: (r["score"], r["best_step"], r["test_metric"], r["history"]) for r in s.runs()}


@pytest.mark.slow
def test_ray_executor_matches_local(tmp_path):
    study = _study()
    local = run_study(study, tmp_path / "local", executor="local", progress=False)
    remote = run_study(study, tmp_path / "ray", executor="ray", workers=2, progress=False)
    assert not ray.is_initialized(), "the executor must shut down the Ray instance it started"
    assert local.complete and remote.complete
    assert local.ledger_matches_plan and remote.ledger_matches_plan
    # Same seeds → bit-identical runs (scores, checkpoints, per-step histories) and the same table.
    assert _runs(tmp_path / "local") == _runs(tmp_path / "ray")
    a, b = study_table(tmp_path / "local"), study_table(tmp_path / "ray")
    assert a == b
    assert math.isfinite(a[0]["value_mean"]) and a[0]["spent_epsilon"] == pytest.approx(2.0, rel=1e-3)
    assert budget_rows(tmp_path / "local") == budget_rows(tmp_path / "ray")
