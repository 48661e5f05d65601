"""The tuner trains the runs of a stage together (``dptune.train_many``) when the model stacks:
the groups are fixed by the plan, every run keeps its own plan, seeds and ledger, and the study
equals the one-run-per-task study up to float rounding."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tune_helpers import tiny_dpsgd_study

from dptune.tune import SelectionSpec, Study, run_study
from dptune.tune.data import study_data
from dptune.tune.plan import plan_study
from dptune.tune.spec import study_from_dict
from dptune.tune.store import Store
from dptune.tune.study import Coordinator


def _study(group: int, **kw) -> Study:
    return tiny_dpsgd_study(
        data_seed=3,
        n=400,
        dim=10,
        n_train=300,
        lrs=[0.1, 0.3, 1.0],
        steps=30,
        batch=40,
        eps=2.0,
        selection=SelectionSpec(mode="private", eval_every=10, noise_multiplier=20.0),
        seeds=(0, 1),
        name="vec",
        trials_per_group=group,
        **kw,
    )


def _rows(d):
    with Store(d) as s:
        return {r["run_id"]: dict(r) for r in s.runs()}, s.ledger_entries()


def _coordinator(study: Study, tmp_path) -> Coordinator:
    data = study_data(study.data, study.selection, study.seed)
    plan = plan_study(study, data.n_train, data.n_val, "accuracy")
    store = Store(tmp_path / "s", create=True)
    store.initialize(study.to_dict(), study.fingerprint(), plan.to_dict(), [r.to_dict() for r in plan.runs.values()])
    return Coordinator(study, store, plan)


def test_groups_are_plan_order_chunks_of_one_arm_and_stage(tmp_path):
    coord = _coordinator(_study(4), tmp_path)
    groups = coord.groups()
    order = list(coord.plan.runs)
    assert set(groups) == set(order)  # 6 runs → chunks of 4 and 2
    distinct = sorted(set(groups.values()), key=lambda g: order.index(g[0]))
    assert [len(g) for g in distinct] == [4, 2]
    assert [rid for g in distinct for rid in g] == order
    for g in distinct:
        assert len({(coord.plan.runs[r].arm, coord.plan.runs[r].stage) for r in g}) == 1
    tasks, members = coord.tasks(coord.ready())
    assert [t[1][0] for t in tasks] == ["group", "group"]
    assert sorted(r for m in members.values() for r in m) == sorted(order)
    tasks, members = coord.tasks(coord.ready()[::-1])  # the largest group first, whatever the ready order
    assert [len(members[t[0]]) for t in tasks] == [4, 2]
    coord.store.close()


def test_a_new_study_groups_in_balanced_chunks_an_older_one_as_it_was_planned(tmp_path):
    """6 runs by 4: a study planned now trains 3 + 3 (no straggler group), one planned before (its config
    without the marker) keeps 4 + 2 on resume; the status's ETA counts the same groups."""
    from dptune.tune.results import study_status
    from dptune.tune.study import _open

    store, plan = _open(_study(4), tmp_path / "new")
    coord = Coordinator(_study(4), store, plan)
    assert sorted(len(g) for g in set(coord.groups().values())) == [3, 3]
    store.close()
    assert study_status(tmp_path / "new")["eta"] is not None
    old = _coordinator(_study(4), tmp_path / "old")  # the config as older versions stored it
    assert sorted(len(g) for g in set(old.groups().values())) == [2, 4]
    old.store.close()


def test_no_groups_for_a_model_that_cannot_be_stacked_or_when_disabled(tmp_path):
    from torch import nn

    def conv_model() -> nn.Module:
        return nn.Sequential(nn.Unflatten(1, (1, 10)), nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(16, 3))

    coord = _coordinator(_study(4, model=conv_model), tmp_path / "a")
    assert coord.groups() == {}
    assert {t[1][0] for t in coord.tasks(coord.ready())[0]} == {"run"}
    coord.store.close()
    coord = _coordinator(_study(1), tmp_path / "b")
    assert coord.groups() == {}
    coord.store.close()


def test_grouped_study_equals_one_run_per_task_study(tmp_path):
    seq = run_study(_study(1), tmp_path / "seq", progress=False)
    vec = run_study(_study(8), tmp_path / "vec", progress=False)
    assert seq.complete and vec.complete and seq.ledger_matches_plan and vec.ledger_matches_plan
    rows_s, ledger_s = _rows(tmp_path / "seq")
    rows_v, ledger_v = _rows(tmp_path / "vec")
    # The same releases, run by run: same events, labels, counts.
    key = lambda e: (e.run, e.label, repr(e.event), e.count)  # noqa: E731
    assert sorted(map(key, ledger_s)) == sorted(map(key, ledger_v))
    assert rows_s.keys() == rows_v.keys()
    for rid, a in rows_s.items():
        b = rows_v[rid]
        assert a["status"] == b["status"] == "done"
        assert a["best_step"] == b["best_step"]
        # Noisy count / m with the same noise draw: equal unless rounding flipped a prediction
        # (a jump of 1/m), which does not happen on this task.
        assert math.isclose(a["score"], b["score"], abs_tol=1e-9)
        assert a["test_metric"] == b["test_metric"]  # None here: the selection split is the test split
        ha, hb = json.loads(a["history"]), json.loads(b["history"])
        assert [r["batch_size"] for r in ha] == [r["batch_size"] for r in hb]  # same Poisson batches
        la = torch.tensor([r["train_loss"] for r in ha if "train_loss" in r])
        lb = torch.tensor([r["train_loss"] for r in hb if "train_loss" in r])
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
    assert seq.rows == vec.rows  # the results table


def test_trials_per_group_is_validated_and_round_trips():
    from dptune.errors import ConfigError

    with pytest.raises(ConfigError, match="trials_per_group"):
        _study(0)
    s = _study(5)
    d = s.to_dict()
    assert d["study"]["trials_per_group"] == 5
    assert _study(5).fingerprint() != _study(6).fingerprint()
    assert "trials_per_group" not in _study(16).to_dict()["study"]  # the default: fingerprints of older studies hold
    named = d | {"data": {"name": "digits", "options": {}}, "model": {"name": "logistic_regression", "options": {}}}
    assert study_from_dict(named).trials_per_group == 5
