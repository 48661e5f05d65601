"""The process-pool executor (spawned workers) gives bit-identical runs and the same table as local."""

from __future__ import annotations

import pytest
from tune_helpers import tiny_dpsgd_study

from dptune.tune import (
    SelectionSpec,
    Study,
    run_study,
    study_table,
)
from dptune.tune.store import Store


def _study() -> Study:
    return tiny_dpsgd_study(
        data_seed=0,
        n=360,
        dim=8,
        n_train=270,
        lrs=[0.2, 1.0],
        steps=20,
        batch=40,
        eps=2.0,
        selection=SelectionSpec(mode="private", eval_every=10, noise_multiplier=30.0),
        seeds=(0,),
        name="pool",
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
