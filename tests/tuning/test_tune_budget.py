"""A study cannot exceed its budget: extra runs, extra (accounted) seeds, extra steps are refused."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from tune_helpers import tiny_dpsgd_study

from dptune.errors import BudgetExceededError, ConfigError
from dptune.release.ledger import Ledger
from dptune.tune import (
    Coordinator,
    SelectionSpec,
    Study,
    run_study,
)
from dptune.tune.records import StudyPlan
from dptune.tune.store import Store
from dptune.tune.worker import execute_run


def _study(seeds=(0, 1), account_seeds=True) -> Study:
    return tiny_dpsgd_study(
        data_seed=0,
        n=300,
        dim=6,
        n_train=240,
        lrs=[0.5, 1.0],
        steps=12,
        batch=30,
        eps=1.5,
        selection=SelectionSpec(eval_every=6),
        seeds=seeds,
        name="budget",
        account_seeds=account_seeds,
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    d = tmp_path_factory.mktemp("budget") / "study"
    out = run_study(_study(), d, progress=False)
    assert out.complete and out.ledger_matches_plan
    return d


def _coordinator(d) -> Coordinator:
    store = Store(d)
    return Coordinator(_study(), store, StudyPlan.from_dict(store.get_meta("plan")))


def test_adding_a_run_is_refused(finished):
    c = _coordinator(finished)
    run = copy.deepcopy(next(iter(c.plan.runs.values())))
    extra = dataclasses.replace(run, run_id=run.run_id.replace("c000", "c099"), config={"lr": 3.0, "clip": 1.0})
    with pytest.raises(BudgetExceededError, match="not in the study's plan"):
        c.task_for(extra)
    changed = dataclasses.replace(run, config={"lr": 3.0, "clip": 1.0})  # same id, other configuration
    with pytest.raises(BudgetExceededError, match="differs from its plan"):
        c.task_for(changed)
    c.store.close()


def test_an_accounted_extra_seed_is_refused(finished, tmp_path):
    c = _coordinator(finished)
    run = next(iter(c.plan.runs.values()))
    seed2 = dataclasses.replace(run, run_id=run.run_id.replace("/s0", "/s2"), seed=2, replicate=2)
    with pytest.raises(BudgetExceededError):
        c.task_for(seed2)
    # Re-merging a finished run's releases (e.g. a duplicate result) is over budget: the study
    # ledger's plan is exhausted once every run is in.
    result = execute_run(_study(), "dpsgd", run.to_dict(), "accuracy")
    with pytest.raises(BudgetExceededError):
        c.merge(run.run_id, result)
    c.store.close()
    # The stored study cannot grow a seed either: its directory refuses a changed config.
    with pytest.raises(ConfigError, match="different study"):
        run_study(_study(seeds=(0, 1, 2)), finished, progress=False)


def test_more_steps_than_planned_are_refused(finished):
    c = _coordinator(finished)
    run = next(iter(c.plan.runs.values()))
    with pytest.raises(BudgetExceededError, match="differs from its plan"):
        c.task_for(dataclasses.replace(run, steps=run.steps + 1))
    # A worker that returned one more release than planned is refused before anything is merged.
    result = execute_run(_study(), "dpsgd", run.to_dict(), "accuracy")
    led = Ledger.from_dict(result["ledger"])
    e = led.entries[0]
    led.record(e.event, e.label, count=1)
    before = c.ledger.releases
    with pytest.raises(BudgetExceededError, match="not in its plan"):
        c.merge(run.run_id, {**result, "ledger": led.to_dict()})
    assert c.ledger.releases == before
    c.store.close()


def test_the_run_itself_cannot_release_beyond_its_plan():
    # The worker's run ledger is created from the planned event: one release too many raises
    # before any noise is drawn.
    from dptune.tune.records import RunSpec

    study = _study(seeds=(0,))
    from dptune.tune import plan_study

    plan = plan_study(study, 240, 60, "accuracy")
    run: RunSpec = next(iter(plan.runs.values()))
    led = Ledger.with_plan(run.planned_event)
    ev = next(iter(led.plan))
    led.record(ev, "x", count=led.plan[ev])
    with pytest.raises(BudgetExceededError):
        led.record(ev, "x")


def test_unaccounted_seeds_keep_the_per_replicate_guarantee(tmp_path):
    out = run_study(_study(account_seeds=False), tmp_path / "s", progress=False)
    row = out.rows[0]
    assert row["guarantee_per"] == "seed replicate"
    assert row["spent_epsilon"] <= 1.5 and row["spent_epsilon"] == pytest.approx(1.5, rel=2e-3)
    acc = _study(account_seeds=True)
    row2 = run_study(acc, tmp_path / "t", progress=False).rows[0]
    assert row2["guarantee_per"] == "study" and row2["spent_epsilon"] == pytest.approx(1.5, rel=2e-3)
