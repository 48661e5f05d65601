"""The process-pool executor (spawned workers) gives bit-identical runs and the same table as local."""

from __future__ import annotations

import pytest
import torch

from dptune.tune import (
    BudgetSpec,
    MethodSpec,
    SelectionSpec,
    StrategyArm,
    Study,
    TrainingSpec,
    run_study,
    study_table,
)
from dptune.tune.store import Store


def _study() -> Study:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(360, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(1)
    return Study(
        data=(x[:270], y[:270], x[270:], y[270:]), model="logistic_regression",
        strategies=(StrategyArm("dpsgd", space={"lr": [0.2, 1.0]}, fixed={"clip": 1.0}),),
        training=TrainingSpec(steps=20, expected_batch_size=40),
        budget=BudgetSpec(epsilon=(2.0,), delta=1e-5, accountant="rdp"), method=MethodSpec("grid"),
        selection=SelectionSpec(mode="private", eval_every=10, noise_multiplier=30.0), seeds=(0,), name="pool",
    )


def _rows(d):
    with Store(d) as s:
        return {r["run_id"]: dict(r) for r in s.runs()}


@pytest.mark.slow
def test_process_pool_matches_local(tmp_path):
    s = _study()
    run_study(s, tmp_path / "local", progress=False)
    run_study(s, tmp_path / "pool", executor="process", workers=2, progress=False)
    keep = ("score", "best_step", "history", "evals", "status")
    a = {k: [v[f] for f in keep] for k, v in _rows(tmp_path / "local").items()}
    b = {k: [v[f] for f in keep] for k, v in _rows(tmp_path / "pool").items()}
    assert a == b
    assert study_table(tmp_path / "local") == study_table(tmp_path / "pool")
