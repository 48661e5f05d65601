"""End-to-end studies on tiny data: every method runs, its ledger equals its plan, selection and
tables are what the rules say, private selection is in the ledger, the process pool agrees."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter

import pytest
from torch import nn
from tune_helpers import linear_data, make_study

from dptune.outputs import up
from dptune.release.ledger import atoms
from dptune.report import report_study
from dptune.tune import (
    MethodSpec,
    SelectionSpec,
    StrategyArm,
    Study,
    TrainingSpec,
    budget_rows,
    report_text,
    rerr_rows,
    run_study,
    study_status,
    study_table,
)
from dptune.tune.methods.linear_scaling import resolve_final_config
from dptune.tune.records import EVAL_LABEL, StudyPlan
from dptune.tune.store import Store
from dptune.tune.study import Coordinator

DATA = linear_data(0, n=360, dim=8, n_train=270)


def _study(
    method="grid", opts=None, strategies=None, selection=None, training=None, eps=(2.0,), seeds=(0, 1), **kw
) -> Study:
    return make_study(
        DATA,
        arms=strategies,
        space={"lr": [0.2, 1.0]},
        fixed={"clip": 1.0},
        training=training or TrainingSpec(steps=20, expected_batch_size=40),
        eps=eps,
        method=method,
        opts=opts,
        selection=selection or SelectionSpec(eval_every=10),
        seeds=seeds,
        name=kw.pop("name", method),
        **kw,
    )


def _rows(d):
    with Store(d) as s:
        return {r["run_id"]: dict(r) for r in s.runs()}


def _plan(d) -> StudyPlan:
    with Store(d) as s:
        return StudyPlan.from_dict(s.get_meta("plan"))


def test_grid_per_seed_selection_and_outputs(tmp_path):
    out = run_study(_study(eps=(1.0, 3.0)), tmp_path / "g", progress=False)
    assert out.complete and out.ledger_matches_plan and out.counts == {"done": 8}
    rows = _rows(tmp_path / "g")
    table = study_table(tmp_path / "g")
    assert [r["epsilon"] for r in table] == [1.0, 3.0]
    for row in table:
        # per-seed: each replicate's pick is the argmax of its stored scores
        picks = []
        for rep in (0, 1):
            mine = [r for r in rows.values() if r["arm"] == row["arm"] and r["replicate"] == rep]
            picks.append(max(mine, key=lambda r: r["score"]))
        assert row["selected_runs"] == [p["run_id"] for p in picks]
        scores = [p["score"] for p in picks]
        assert row["value_mean"] == pytest.approx(sum(scores) / 2)
        assert row["value_std"] == pytest.approx(abs(scores[0] - scores[1]) / math.sqrt(2))
        assert row["planned_epsilon"] <= row["epsilon"] and row["spent_epsilon"] == pytest.approx(
            row["epsilon"], rel=2e-3
        )
    # CSV files, status, terminal rendering within 100 columns
    with open(tmp_path / "g" / "release" / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    per_run, per_label = budget_rows(tmp_path / "g")
    assert len(per_run) == 8 and {r["label"] for r in per_label} == {"dpsgd/gradient"}
    assert (tmp_path / "g" / "diagnostics" / "budget_labels.csv").exists()
    st = study_status(tmp_path / "g")
    assert st["complete"] and st["counts"] == {"done": 8}
    text = report_text(tmp_path / "g")
    assert "PUBLIC validation data" in text and all(len(line) <= 100 for line in text.splitlines())
    html = report_study(tmp_path / "g")
    assert html.exists() and "public" in html.read_text().lower()


def test_rerr_rows_pair_linear_scaling_with_random_and_oracle():
    base = {"optimizer": "dpgd", "epsilon": 1.0}
    rows = [
        {**base, "strategy": "ls", "method": "linear-scaling", "value_mean": 0.8763},
        {**base, "strategy": "rand", "method": "random", "value_mean": 0.832},
        {**base, "strategy": "grid", "method": "oracle", "value_mean": 0.886},
        {**base, "strategy": "other", "optimizer": "dpsgd", "method": "random", "value_mean": 0.1},
    ]
    (r,) = rerr_rows(rows)
    assert r["rerr"] == pytest.approx((0.8763 - 0.832) / (0.886 - 0.832)) and r["random"] == "rand"
    assert rerr_rows(rows[:2]) == []  # no oracle: no RERR


def test_mean_selection_over_seeds(tmp_path):
    s = _study(selection=SelectionSpec(eval_every=10, across_seeds="mean"), seeds=(0, 1, 2))
    run_study(s, tmp_path / "m", progress=False)
    rows = _rows(tmp_path / "m")
    by_cfg: dict[str, list[float]] = {}
    for r in rows.values():
        by_cfg.setdefault(r["config"], []).append(r["score"])
    best = max(by_cfg.values(), key=lambda v: sum(v) / len(v))
    row = study_table(tmp_path / "m")[0]
    assert row["value_mean"] == pytest.approx(sum(best) / 3) and row["replicates"] == 3
    assert "[" not in row["selected"]  # one configuration, chosen by its mean
    # One seed's runs are accounted (the papers' convention), but the selection read all three: the ε
    # that covers it is their composition, from dp_accounting alone: 2 candidates × 3 seeds × T steps.
    from dp_accounting import dp_event, rdp

    run = next(iter(_plan(tmp_path / "m").runs.values()))
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(run.sampling_rate, dp_event.GaussianDpEvent(run.noise_multiplier)),
                2 * 3 * run.steps)  # fmt: skip
    assert row["selection_epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)
    assert row["selection_epsilon"] > 1.5 * row["planned_epsilon"]
    assert f"ε = {up(row['selection_epsilon'], 4)}" in " ".join(_plan(tmp_path / "m").arms[0].notes)
    # The model card, published alone, states that composition: the weights are the run chosen on all the scores
    # (found in review: it stated one replicate's ε for the weights).
    (card,) = [json.loads(p.read_text()) for p in (tmp_path / "m" / "release" / "models").rglob("model_card.json")]
    assert card["guarantee"]["epsilon"] == row["selection_epsilon"] and card["guarantee"]["per"] == "study"
    assert f"ε = {up(row['selection_epsilon'], 4)}" in card["title"]
    run_study(_study(seeds=(0, 1, 2)), tmp_path / "ps", progress=False)
    per_seed = study_table(tmp_path / "ps")[0]
    assert per_seed["selection_epsilon"] == per_seed["planned_epsilon"]  # each seed its own procedure


def test_private_selection_releases_are_in_the_ledger(tmp_path):
    sel = SelectionSpec(mode="private", split="holdout", eval_every=10, noise_multiplier=25.0)
    out = run_study(_study(selection=sel), tmp_path / "p", progress=False)
    assert out.ledger_matches_plan
    _, per_label = budget_rows(tmp_path / "p")
    labels = {r["label"]: r for r in per_label}
    # 2 configurations × (evaluations at steps 10 and 20) in the accounted replicate
    assert labels[EVAL_LABEL]["releases"] == 2 * 2
    with Store(tmp_path / "p") as st:
        n_eval = sum(e.count for e in st.ledger_entries() if e.label == EVAL_LABEL)
    assert n_eval == 4 * 2  # all runs of both seeds
    row = study_table(tmp_path / "p")[0]
    assert row["selection"] == "private" and row["test_mean"] is not None
    assert "PRIVATE validation data" in report_text(tmp_path / "p")


def test_liu_talwar_and_repeat_and_select_run_their_planned_runs(tmp_path):
    lt = run_study(_study("liu-talwar", {"gamma": 0.5}), tmp_path / "lt", progress=False)
    rs = run_study(
        _study("repeat-and-select", {"mean": 2, "distribution": "geometric"}), tmp_path / "rs", progress=False
    )
    for d, out in ((tmp_path / "lt", lt), (tmp_path / "rs", rs)):
        plan = _plan(d)
        arm = plan.arms[0]
        assert out.complete and out.ledger_matches_plan
        assert sum(arm.extra["runs_per_procedure"]) == len(arm.runs) == len(_rows(d))
        row = out.rows[0]
        assert row["spent_epsilon"] == pytest.approx(arm.guarantee["epsilon"]) and row["spent_epsilon"] <= 2.0
        assert "must not be published" in " ".join(arm.notes)


def _linear_scaling_study(**kw) -> Study:
    return _study(
        "linear-scaling",
        {"runs_per_sweep": 2},
        strategies=(
            StrategyArm("dpgd", space={"lr": {"log_uniform": [0.05, 2.0]}, "steps": {"int_uniform": [4, 16]}}),
        ),
        training=TrainingSpec(steps=8, full_batch=True),
        eps=(1.0,),
        accountant="auto",
        selection=SelectionSpec(eval_every=4),
        **kw,
    )


def test_linear_scaling_resolves_the_final_run_from_the_sweeps(tmp_path):
    s = _linear_scaling_study()
    out = run_study(s, tmp_path / "ls", progress=False)
    assert out.complete and out.ledger_matches_plan
    plan = _plan(tmp_path / "ls")
    arm = plan.arms[0]
    assert arm.accountant == "gdp"
    rows = _rows(tmp_path / "ls")
    scores = {k: v["score"] for k, v in rows.items()}
    for p in (0, 1):
        final = next(r for r in rows.values() if r["stage"] == "final" and r["procedure"] == p)
        config, fit = resolve_final_config(plan, arm, p, scores)
        assert json.loads(final["config"]) == config and json.loads(final["fit"]) == fit
        # r* lies on the fitted line (clipped to the search range), η_f = r*/T_f
        lo, hi = arm.extra["r_bounds"]
        assert lo <= fit["r_star"] <= hi and config["steps"] == 16
        if fit["coef"] is not None:
            a, b = fit["coef"]
            assert fit["r_star"] == pytest.approx(min(max(a * fit["x_final"] + b, lo), hi))
    row = out.rows[0]
    assert row["selected_runs"] == [r for r in arm.runs if plan.runs[r].stage == "final"]
    assert row["spent_epsilon"] == pytest.approx(1.0, abs=2e-3) and row["spent_epsilon"] <= 1.0 + 1e-9


def test_a_resumed_study_groups_its_adaptive_runs_as_a_fresh_one(tmp_path):
    """The runs trained together (``train_many``) are fixed by the plan. A resumed session
    resolves the final runs before it first asks for the groups; it must still group them per
    procedure, as a fresh session did, so that its numbers equal an uninterrupted study's (a
    group equals its runs trained one by one only up to float rounding)."""
    s = _linear_scaling_study(trials_per_group=4)
    run_study(s, tmp_path / "ls", progress=False)
    with Store(tmp_path / "ls") as store:
        fresh = Coordinator(s, store, StudyPlan.from_dict(store.get_meta("plan")))
        expected = fresh.groups()
        resumed = Coordinator(s, store, StudyPlan.from_dict(store.get_meta("plan")))
        finals = [rid for rid, r in resumed.plan.runs.items() if r.stage == "final"]
        # What a resumed session does before its first tasks: the final runs resolved in the
        # earlier session take their stored configurations (``Coordinator.ready``).
        for rid in finals:
            resumed.plan.runs[rid].config = json.loads(store.run(rid)["config"])
        assert len(finals) == 2 and all(resumed.plan.runs[rid].config is not None for rid in finals)
        assert expected and resumed.groups() == expected
        assert not any(rid in expected for rid in finals)  # one final run per procedure: alone


def test_online_oracle_and_nodp_baseline(tmp_path):
    s = _study(
        strategies=(
            StrategyArm("online", space={"lr": [0.2, 1.0]}, method=MethodSpec("online")),
            StrategyArm("dpsgd", space={"lr": [0.2, 1.0]}, fixed={"clip": 1.0}, method=MethodSpec("oracle")),
            StrategyArm("nodp", space={"lr": [0.5]}),
        ),
        seeds=(0,),
    )
    out = run_study(s, tmp_path / "o", progress=False)
    by = {r["strategy"]: r for r in out.rows}
    assert by["oso"]["method"] == "online" and by["oso"]["spent_epsilon"] == pytest.approx(2.0, rel=2e-3)
    # oracle: each run alone at ε; the honest composed total is larger and is what is shown
    assert by["dpsgd"]["planned_epsilon"] > 2.0
    assert by["nodp"]["epsilon"] == math.inf and by["nodp"]["spent_epsilon"] == math.inf
    assert out.ledger_matches_plan


def test_diverged_runs_spend_at_most_their_plan(tmp_path):
    # lr = 1e300 overflows the float32 parameters at the first step. (A merely huge lr such as
    # 3e38 no longer need diverge: once every example's gradient overflows, those rows are left
    # out of the sums and the parameters move by noise alone; docs/privacy.md, item 10.)
    s = _study(strategies=(StrategyArm("dpsgd", space={"lr": [0.5, 1e300]}, fixed={"clip": 1.0}),), seeds=(0,))
    out = run_study(s, tmp_path / "d", progress=False)
    assert out.complete and out.counts.get("diverged") == 1
    plan = _plan(tmp_path / "d")
    with Store(tmp_path / "d") as st:
        spent = Counter()
        for e in st.ledger_entries():
            spent[e.event] += e.count
    assert not (spent - atoms(plan.release_event))  # never more than planned
    assert out.ledger_matches_plan is False  # and honestly reported as less
    assert out.rows[0]["diverged"] == 1 and math.isfinite(out.rows[0]["value_mean"])


class _AE(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 8))

    def forward(self, x):
        return self.net(x)


def make_autoencoder() -> nn.Module:
    return _AE()


def test_reconstruction_metric_private(tmp_path):
    x = DATA[0].clamp(-1, 1)
    xt = DATA[2].clamp(-1, 1)
    s = make_study(
        (x, x, xt, xt),
        model=make_autoencoder,
        space={"lr": [0.1, 0.5]},
        fixed={"clip": 1.0},
        eps=3.0,
        selection=SelectionSpec(mode="private", eval_every=5, noise_multiplier=40.0),
    )
    out = run_study(s, tmp_path / "ae", progress=False)
    assert out.ledger_matches_plan and out.rows[0]["metric"] == "mse"
    rows = _rows(tmp_path / "ae")
    best = min(rows.values(), key=lambda r: r["score"])  # lower is better
    assert out.rows[0]["selected_runs"] == [best["run_id"]]


FAIL = {"on": True}


def flaky_model() -> nn.Module:
    if FAIL["on"]:
        raise RuntimeError("simulated worker failure")
    return nn.Sequential(nn.Linear(8, 3))


def test_failed_runs_are_recorded_and_retried_on_resume(tmp_path):
    from dptune.errors import ConfigError
    from dptune.tune import resume_study

    s = make_study(DATA, model=flaky_model, fixed={"clip": 1.0})
    FAIL["on"] = True
    out = run_study(s, tmp_path / "f", progress=False)
    assert not out.complete and out.counts == {"failed": 1} and out.ledger_matches_plan is None
    with Store(tmp_path / "f") as st:
        assert "simulated worker failure" in st.runs()[0]["error"]
        assert st.ledger_entries() == []  # a failed run released nothing into the study
    with pytest.raises(ConfigError, match="built in Python"):
        resume_study(tmp_path / "f", progress=False)
    FAIL["on"] = False
    again = resume_study(tmp_path / "f", study=s, progress=False)
    assert again.complete and again.ledger_matches_plan


def test_secure_study_states_its_float_slack(tmp_path):
    """Found in review: secure-mode cards said the float sampler's slack was "stated here" and no study stated it.
    Each DP-SGD step snaps d = 27 released coordinates at 2ξ each (ξ = 2e-11, docs/privacy.md item 1b), each private
    score one: a grid arm of 2 runs × (20 steps + 2 scores) states 2·(20·27 + 2)·4e-11, in results.csv and on the
    card; a seeded study states none (a Liu–Talwar arm neither: its runs would reveal K)."""
    from dptune.tune.export import export_study

    sel = SelectionSpec(mode="private", split="holdout", eval_every=10)
    run_study(_study(eps=(1.0,), seeds=(0,), secure=True, selection=sel), tmp_path / "s", progress=False)
    (row,) = study_table(tmp_path / "s")
    assert row["epsilon_float_slack"] == pytest.approx(2 * (20 * 27 + 2) * 4e-11, rel=1e-9)  # + 2 private scores
    (card,) = [json.loads((p / "model_card.json").read_text()) for p in export_study(tmp_path / "s")]
    assert card["guarantee"]["epsilon_float_slack"] == row["epsilon_float_slack"]
    with open(tmp_path / "s" / "release" / "results.csv") as f:
        assert float(next(csv.DictReader(f))["epsilon_float_slack"]) == pytest.approx(row["epsilon_float_slack"])
    run_study(_study(eps=(1.0,), seeds=(0,)), tmp_path / "p", progress=False)
    assert "epsilon_float_slack" not in study_table(tmp_path / "p")[0]


def test_release_as_a_whole_states_the_composition_of_its_procedures(tmp_path):
    """Found in review: two arms (ε = 1 and 2) each had a card 'per study', while release/ held both, covered
    only at their composition. The plan's runs, composed by dp_accounting alone, give that ε; every card says
    it, and an oracle arm's card title carries its guarantee's ε, not the per-run target."""
    from dp_accounting import dp_event, rdp

    from dptune.tune.export import export_study
    from dptune.tune.results import release_guarantee

    run_study(_study(eps=(1.0, 2.0), seeds=(0,)), tmp_path / "two", progress=False)
    plan = _plan(tmp_path / "two")
    acc = rdp.RdpAccountant()
    for r in plan.runs.values():
        acc.compose(
            dp_event.PoissonSampledDpEvent(r.sampling_rate, dp_event.GaussianDpEvent(r.noise_multiplier)), r.steps
        )
    eps, delta = release_guarantee(plan)
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3) and delta == 1e-5 and eps > 2.0
    cards = [json.loads((p / "model_card.json").read_text()) for p in export_study(tmp_path / "two")]
    assert len(cards) == 2 and all(f"({up(eps, 4)}, 1e-05)-DP" in c["guarantee"]["release_folder"] for c in cards)
    from dptune.report import report_study

    page = report_study(tmp_path / "two").read_text()  # the HTML report states it too
    assert f"release/ as a whole (all its procedures published together) is ({up(eps, 4)}, 1e-05)-DP" in page
    run_study(_study("oracle", eps=(1.0,), seeds=(0,)), tmp_path / "or", progress=False)
    assert release_guarantee(_plan(tmp_path / "or")) is None  # one procedure: its card says it all
    (card,) = [json.loads((p / "model_card.json").read_text()) for p in export_study(tmp_path / "or")]
    honest = study_table(tmp_path / "or")[0]["planned_epsilon"]
    assert honest > 1.0 and f"at ε = {up(honest, 4)}" in card["title"]
