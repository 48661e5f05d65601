"""The Ray executor on a real local Ray instance gives the same study as the local executor."""

from __future__ import annotations

import math

import pytest
from tune_helpers import tiny_dpsgd_study

from dptune.tune import (
    SelectionSpec,
    Study,
    budget_rows,
    run_study,
    study_table,
)
from dptune.tune.store import Store

ray = pytest.importorskip("ray")


def _study() -> Study:
    return tiny_dpsgd_study(
        data_seed=3,
        n=400,
        dim=8,
        n_train=300,
        lrs=[0.3, 1.0],
        steps=25,
        batch=40,
        eps=2.0,
        selection=SelectionSpec(mode="private", split="holdout", eval_every=10, noise_multiplier=30.0),
        seeds=(0, 1),
        name="ray-vs-local",
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
