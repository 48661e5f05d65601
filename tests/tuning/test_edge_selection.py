"""Issue 10, items 4, 5 and 7 (LT/RS coins): privacy at the edges of the selection.

* Item 4 — with ``across_seeds = "mean"`` a Liu–Talwar / repeat-and-select candidate is its S seed
  runs: its privacy must be that of their composite. Checked against dp_accounting directly (the
  old planner calibrated one run and labelled the result "per study": ε = 2 was really ≈ 3.3).
* Item 5 — the released sum of per-example validation errors keeps sensitivity c when an example
  yields NaN (the old code released the constant c·m then), and a NaN prediction counts as wrong.
* Item 7 — Liu–Talwar's and repeat-and-select's K (and candidate configurations) come from the OS
  CSPRNG, not from the public study seed; the plan (with them) is stored, so resume reuses them.

Each check is also run against a mutant (``tests/mutants``) that restores the old behaviour.
"""

from __future__ import annotations

import collections
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import SHARED_DATA
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from mutants import coins_from_study_seed, mean_mode_seeds_unaccounted, mse_nonfinite_rule_removed
from tune_helpers import make_study, planning_data

from dptune.tune import (
    SelectionSpec,
    Study,
    TrainingSpec,
    plan_study,
    run_study,
    theory,
)
from dptune.tune.records import StudyPlan
from dptune.tune.store import Store
from dptune.tune.worker import Scorer

N, DELTA = 60000, 1e-5


def _study(
    method: str,
    opts: dict | None = None,
    *,
    space=None,
    seeds=(0, 1, 2),
    across="mean",
    account_seeds=False,
    eps=2.0,
    data=None,
    training=None,
    eval_every=100,
) -> Study:
    return make_study(
        data if data is not None else planning_data(),
        space=space if space is not None else {"lr": [0.01, 0.1, 1.0]},
        training=training or TrainingSpec(epochs=10, expected_batch_size=512),
        eps=eps,
        delta=DELTA,
        account_seeds=account_seeds,
        method=method,
        opts=opts,
        selection=SelectionSpec(eval_every=eval_every, across_seeds=across),
        seeds=seeds,
    )


def _rdp_epsilon(event: dp_event.DpEvent, delta: float) -> float:
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


def _candidates(plan: StudyPlan, arm) -> dict[tuple[int, int], list[dp_event.DpEvent]]:
    """(procedure, candidate index) → the planned events of ALL its runs (every seed it trains)."""
    out: dict[tuple[int, int], list[dp_event.DpEvent]] = collections.defaultdict(list)
    for rid in arm.runs:
        r = plan.runs[rid]
        out[(r.procedure, r.index)].append(r.planned_event)
    return out


def _true_lt_epsilon(plan: StudyPlan, arm) -> float:
    """Liu & Talwar Thm 3.4 applied to the REAL candidate mechanism (all its runs composed), with
    ε₁ from dp_accounting's RDP accountant directly: 3ε₁ + 3√(2δ₁), times the accounted procedures."""
    g = arm.guarantee
    cache: dict[str, float] = {}
    worst = 0.0
    for evs in _candidates(plan, arm).values():
        key = repr(sorted(map(repr, evs)))
        if key not in cache:
            cache[key] = _rdp_epsilon(dp_event.ComposedDpEvent(evs), g["delta1"])
        worst = max(worst, cache[key])
    return (3 * worst + 3 * math.sqrt(2 * g["delta1"])) * g["procedures_accounted"]


def check_lt_guarantee(plan: StudyPlan, target: float) -> None:
    for arm in plan.arms:
        if arm.method != "liu-talwar":
            continue
        assert _true_lt_epsilon(plan, arm) <= target * (1 + 1e-6), arm.arm
        assert arm.guarantee["epsilon"] <= target * (1 + 1e-9)


def check_rs_guarantee(plan: StudyPlan, target: float, mean: float, shape: float) -> None:
    arm = plan.arms[0]
    cands = _candidates(plan, arm)
    assert cands
    for evs in cands.values():  # every candidate has the same privacy (no searched run length)
        eps = _rdp_epsilon(dp_event.RepeatAndSelectDpEvent(dp_event.ComposedDpEvent(evs), mean, shape), DELTA)
        assert eps <= target * (1 + 1e-6)


# ----------------------------------------------------------------------------- item 4
def test_lt_mean_mode_candidate_is_its_seed_composite():
    plan = plan_study(_study("liu-talwar"), N, 10000, "accuracy")
    arm = plan.arms[0]
    assert all(len(evs) == 3 for evs in _candidates(plan, arm).values())
    true_eps = _true_lt_epsilon(plan, arm)
    assert 2.0 * (1 - 1e-3) < true_eps <= 2.0 * (1 + 1e-6)  # meets the target, tightly
    assert arm.guarantee["per"] == "study" and arm.guarantee["delta"] <= DELTA
    assert any("composite of its 3 seed runs" in n for n in arm.notes)
    # The same as accounting the seeds explicitly: account_seeds has no further effect here.
    counted = plan_study(_study("liu-talwar", account_seeds=True), N, 10000, "accuracy")
    assert counted.arms[0].extra["noise_multipliers"] == arm.extra["noise_multipliers"]


def test_repeat_and_select_mean_mode_candidate_is_its_seed_composite():
    plan = plan_study(_study("repeat-and-select", {"mean": 3, "distribution": "geometric"}), N, 10000, "accuracy")
    check_rs_guarantee(plan, 2.0, 3.0, 1.0)
    arm = plan.arms[0]
    assert arm.guarantee["per"] == "study"
    evs = next(iter(_candidates(plan, arm).values()))
    true_eps = _rdp_epsilon(dp_event.RepeatAndSelectDpEvent(dp_event.ComposedDpEvent(evs), 3.0, 1.0), DELTA)
    assert arm.guarantee["epsilon"] == pytest.approx(true_eps, rel=1e-9) and true_eps > 2.0 * (1 - 1e-3)


def test_per_seed_procedures_keep_one_run_per_candidate():
    """per-seed mode is unchanged: each replicate is its own procedure, labelled as such."""
    plan = plan_study(_study("liu-talwar", across="per-seed"), N, 10000, "accuracy")
    arm = plan.arms[0]
    assert all(len(evs) == 1 for evs in _candidates(plan, arm).values())
    assert arm.guarantee["per"] == "seed replicate" and len(arm.extra["runs_per_procedure"]) == 3
    check_lt_guarantee(plan, 2.0)


@pytest.mark.parametrize("method", ["liu-talwar", "repeat-and-select"])
def test_mutant_mean_mode_seeds_unaccounted_is_caught(method):
    """The old planner (one run per candidate in mean mode): ε = 2 is really ≈ 3.3."""
    opts = {"mean": 3, "distribution": "geometric"} if method == "repeat-and-select" else {}
    with mean_mode_seeds_unaccounted():
        plan = plan_study(_study(method, opts), N, 10000, "accuracy")
    with pytest.raises(AssertionError):
        if method == "liu-talwar":
            check_lt_guarantee(plan, 2.0)
        else:
            check_rs_guarantee(plan, 2.0, 3.0, 1.0)
    if method == "liu-talwar":
        assert _true_lt_epsilon(plan, plan.arms[0]) == pytest.approx(3.29, abs=0.02)


def test_lt_mean_mode_study_runs_and_its_ledger_equals_the_plan(tmp_path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(120, 4, generator=g)
    y = (x @ torch.randn(4, 2, generator=g)).argmax(1)
    s = _study(
        "liu-talwar",
        {"gamma": 0.5},
        seeds=(0, 1),
        data=(x[:100], y[:100], x[100:], y[100:]),
        training=TrainingSpec(steps=4, expected_batch_size=20),
        eval_every=2,
    )
    out = run_study(s, tmp_path / "lt", progress=False)
    assert out.complete and out.ledger_matches_plan
    with Store(tmp_path / "lt", readonly=True) as st:
        plan = StudyPlan.from_dict(st.get_meta("plan"))
    assert plan.arms[0].guarantee["per"] == "study"
    check_lt_guarantee(plan, 2.0)


@pytest.fixture
def data_env(monkeypatch):
    path = Path(os.environ.get("DPTUNE_DATA_DIR") or SHARED_DATA)
    if not (path / "adult").is_dir():
        pytest.skip(f"shared data directory not found at {path}")
    monkeypatch.setenv("DPTUNE_DATA_DIR", str(path))
    monkeypatch.setenv("DPTUNE_OFFLINE", "1")
    return path


def test_mohapatra_liu_talwar_arms_are_honest(data_env):
    """The Mohapatra presets used exactly the broken setting (mean over 3 seeds, seeds not
    accounted, Liu–Talwar for DPSGD/DPMomentum): adult/LR at ε = 3.36 was really 5.88. They now
    tune per seed; each LT candidate is one run and meets ε per seed replicate."""
    from dptune.presets import preset_parts
    from dptune.presets._catalog import _sizes
    from dptune.tune import study_from_dict
    from dptune.tune.study import study_metric

    part = preset_parts("mohapatra-adult", "paper")[0]
    study = study_from_dict(part.study_dict())
    n_tr, n_val, task = _sizes(part.study["data"], 0, study.selection)
    plan = plan_study(study, n_tr, n_val, study_metric(study, task))
    lt = [a for a in plan.arms if a.method == "liu-talwar"]
    assert len(lt) == 6
    for arm in plan.arms:
        assert arm.guarantee["per"] == "seed replicate"  # every arm: the same scope (equal comparison)
    for arm in lt:
        assert all(len(evs) == 1 for evs in _candidates(plan, arm).values())
        assert _true_lt_epsilon(plan, arm) <= arm.epsilon * (1 + 1e-6)


# ----------------------------------------------------------------------------- item 5
def _scorer(metric: str, x: torch.Tensor, y: torch.Tensor, clip: float = 0.5):
    torch.manual_seed(0)
    out_dim = y.shape[1] if metric == "mse" else 2
    model = torch.nn.Linear(x.shape[1], out_dim)
    run = SimpleNamespace(eval_noise_multiplier=10.0, eval_steps=(1,), eval_final=False, run_seed=7)
    study = SimpleNamespace(selection=SimpleNamespace(mse_clip=clip), secure=False)
    data = SimpleNamespace(x_val=x, y_val=y)
    scorer = Scorer(model, data, metric, run, study, torch.device("cpu"))  # type: ignore[arg-type]
    released: list[float] = []

    def release(*queries, label):  # the noiseless statistic handed to the gateway
        released.extend(float(q.value) for q in queries)
        return [q.value for q in queries]

    scorer.gateway.release = release  # type: ignore[method-assign]
    params = {k: v.detach() for k, v in model.named_parameters()}
    return scorer, params, released


def released_sum(metric: str, x: torch.Tensor, y: torch.Tensor, clip: float = 0.5) -> float:
    scorer, params, released = _scorer(metric, x, y, clip)
    scorer.score(params)
    assert len(released) == 1
    return released[0]


def _mse_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 6, generator=g) * 0.1
    y = torch.randn(50, 6, generator=g) * 0.1
    x_nan = x.clone()
    x_nan[17, 2] = math.nan  # one example whose prediction is NaN
    return x, y, x_nan


def check_mse_sensitivity(clip: float = 0.5) -> None:
    x, y, x_nan = _mse_data()
    keep = torch.arange(50) != 17
    with_nan = released_sum("mse", x_nan, y, clip)
    without = released_sum("mse", x[keep], y[keep], clip)
    assert math.isfinite(with_nan)
    # add/remove one example moves the released sum by at most c (up to float32 rounding of the sum)
    assert abs(with_nan - without) <= clip + 1e-5
    assert with_nan - without == pytest.approx(clip, abs=1e-5)  # NaN counts as the maximal error


def test_private_mse_sum_keeps_sensitivity_c_with_a_nan_example():
    check_mse_sensitivity(0.5)
    # and an overflowing (infinite) error counts as c too
    x, y, _ = _mse_data()
    x_inf = x.clone()
    x_inf[3] = 1e30
    keep = torch.arange(50) != 3
    assert released_sum("mse", x_inf, y) - released_sum("mse", x[keep], y[keep]) == pytest.approx(0.5, abs=1e-5)


def test_mutant_mse_nonfinite_rule_removed_is_caught():
    with mse_nonfinite_rule_removed(), pytest.raises(AssertionError):
        check_mse_sensitivity(0.5)
    x, y, x_nan = _mse_data()
    with mse_nonfinite_rule_removed():
        assert released_sum("mse", x_nan, y) == pytest.approx(0.5 * 50)  # the old constant c·m


def test_private_accuracy_counts_a_nan_prediction_as_wrong():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 3, generator=g)
    x[5] = math.nan
    scorer, params, _ = _scorer("accuracy", x, torch.zeros(40, dtype=torch.long))
    y = torch.zeros(40, dtype=torch.long)
    y[5] = int(torch.nn.functional.linear(x[5:6], params["weight"], params["bias"]).argmax(1))  # argmax(NaN)
    keep = torch.arange(40) != 5
    assert released_sum("accuracy", x, y) == released_sum("accuracy", x[keep], y[keep])


# ----------------------------------------------------------------------------- item 7: LT/RS coins
_CONT = {"lr": {"log_uniform": [1e-3, 1.0]}}


def _draws(plan: StudyPlan) -> tuple:
    arm = plan.arms[0]
    return (tuple(arm.extra["runs_per_procedure"]), tuple(plan.runs[r].config["lr"] for r in arm.runs))


def check_draws_are_secret(method: str, opts: dict) -> None:
    s = _study(method, opts, space=_CONT, seeds=(0,), across="per-seed", eps=4.0)
    draws = {_draws(plan_study(s, N, 10000, "accuracy")) for _ in range(4)}
    assert len(draws) == 4  # the same study and seed: K and the configurations differ every time


@pytest.mark.parametrize(
    ("method", "opts"),
    [("liu-talwar", {"gamma": 0.3}), ("repeat-and-select", {"mean": 3, "distribution": "geometric"})],
)
def test_lt_rs_draws_do_not_come_from_the_study_seed(method, opts):
    check_draws_are_secret(method, opts)
    with coins_from_study_seed(), pytest.raises(AssertionError):
        check_draws_are_secret(method, opts)


def test_lt_draws_come_from_the_os_csprng(monkeypatch):
    """Every LT draw goes through secrets.SystemRandom: replaced by a recording stub, the plan is
    exactly the stub's draws; random search stays a function of the study seed."""
    import random
    import secrets

    calls = []

    class Stub(random.Random):
        def __init__(self):
            super().__init__(99)
            calls.append(1)

    monkeypatch.setattr(secrets, "SystemRandom", Stub)
    s = _study("liu-talwar", {"gamma": 0.3}, space=_CONT, seeds=(0,), across="per-seed", eps=4.0)
    a, b = plan_study(s, N, 10000, "accuracy"), plan_study(s, N, 10000, "accuracy")
    assert calls and _draws(a) == _draws(b)
    assert _draws(a) == _draws(plan_study(s, N, 10000, "accuracy", coins=theory.SecretCoins(seed=99)))
    rs = _study("random", {"n": 4}, space=_CONT, seeds=(0,), across="per-seed", eps=4.0)
    monkeypatch.undo()
    assert plan_study(rs, N, 10000, "accuracy").to_dict() == plan_study(rs, N, 10000, "accuracy").to_dict()


def test_secret_seed_gives_a_reproducible_search():
    s = _study(
        "repeat-and-select",
        {"mean": 4, "distribution": "poisson"},
        space=_CONT,
        seeds=(0, 1),
        across="per-seed",
        eps=4.0,
    )
    a = plan_study(s, N, 10000, "accuracy", coins=theory.SecretCoins(seed=12345))
    b = plan_study(s, N, 10000, "accuracy", coins=theory.SecretCoins(seed=12345))
    assert a.to_dict() == b.to_dict()
    assert not theory.SecretCoins(seed=1).secure and theory.SecretCoins().secure


def test_resume_reuses_the_stored_draws(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(120, 4, generator=g)
    y = (x @ torch.randn(4, 2, generator=g)).argmax(1)
    s = _study(
        "liu-talwar",
        {"gamma": 0.4},
        space={"lr": {"log_uniform": [0.01, 1.0]}},
        seeds=(0,),
        across="per-seed",
        data=(x[:100], y[:100], x[100:], y[100:]),
        training=TrainingSpec(steps=3, expected_batch_size=20),
        eval_every=3,
    )
    d = tmp_path / "lt"
    first = run_study(s, d, progress=False)
    with Store(d, readonly=True) as st:
        plan1 = st.get_meta("plan")
        n_rows = len(st.runs())

    def no_new_draws(*a, **k):
        raise AssertionError("resume must not draw K again")

    monkeypatch.setattr(theory.SecretCoins, "__init__", no_new_draws)
    again = run_study(s, d, progress=False)  # re-opening: the stored plan, nothing re-drawn or re-run
    with Store(d, readonly=True) as st:
        assert st.get_meta("plan") == plan1 and len(st.runs()) == n_rows
    assert again.complete and again.ledger_matches_plan and again.rows == first.rows
    assert sum(StudyPlan.from_dict(plan1).arms[0].extra["runs_per_procedure"]) == n_rows


def test_secret_coins_distributions():
    """SecretCoins implements numpy's draws exactly in law: χ² against the pmf (Poisson, geometric
    stopping), and it must also reject a wrong parameter (a test with power)."""
    from scipy import stats

    c = theory.SecretCoins(seed=7)
    n = 20000
    ks = [c.poisson(4.0) for _ in range(n)]
    counts = collections.Counter(ks)
    cells = list(range(0, 12))

    def chi2_p(lam):
        obs = [counts.get(k, 0) for k in cells] + [sum(v for k, v in counts.items() if k >= 12)]
        pmf = [stats.poisson.pmf(k, lam) for k in cells] + [stats.poisson.sf(11, lam)]
        return stats.chisquare(obs, [p * n for p in pmf]).pvalue

    assert chi2_p(4.0) > 1e-3 and chi2_p(4.3) < 1e-6
    stops = collections.Counter(theory.lt_stops(0.25, 6, c) for _ in range(n))
    pmf = [0.25 * 0.75 ** (k - 1) for k in range(1, 6)] + [0.75**5]
    assert stats.chisquare([stops[k] for k in range(1, 7)], [p * n for p in pmf]).pvalue > 1e-3
    assert all(0 <= c.integers(5) < 5 for _ in range(200)) and {c.integers(2, 4) for _ in range(200)} == {2, 3}
    assert all(0.5 <= c.uniform(0.5, 2.0) < 2.0 for _ in range(200))
    assert c.poisson(800.0) == pytest.approx(800, abs=200)
