"""Iterate averaging for DP-GD (``dpgd``'s ``average = "none" | "ema" | "swa"``; Panda et al.
2024 §A.5, Fig. 11): post-processing of the iterates, so

* the ledger of an averaged run is exactly the plan, and exactly the ledger of the same run
  without averaging (same releases, same noise, same iterates);
* the evaluated, best and final parameters are the hand-computed EMA / SWA of the iterates
  (the free step's iterate included), in ``train``, in ``train_many`` and at the tuner's
  checkpoints.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gateway, params_of, run_plan
from torch import nn

import dptune
from dptune.gradients.oracle import GradientOracle
from dptune.release.context import StepContext
from dptune.release.sampling import stream_seed
from dptune.strategies import make_strategy
from dptune.task import OwnTask
from dptune.train import EvalSchedule, RunLoop, evaluate
from dptune.tree import clone
from dptune.updates import default_ema_decay, swa_first_step

pytestmark = pytest.mark.usefixtures("one_thread")

T, NU, LR = 7, 2.0, 0.4


def _problem(n: int = 60, d: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()
    torch.manual_seed(seed)
    return nn.Linear(d, 2), x, y


def _iterates(strategy, seed: int = 5):
    """Drive ``strategy`` T full-batch steps through a real gateway: (iterates θ_1..θ_T,
    what ``evaluated`` gave after each step, the finalised parameters, the last state, gateway)."""
    model, x, y = _problem()
    params = params_of(model)
    run = run_plan(NU, 1.0, float(x.shape[0]), T)
    state = strategy.init(params, run)
    gw = gateway(1.0, seed=seed, plan=strategy.planned_event(NU, 1.0, T))
    oracle = GradientOracle(model)
    iterates, evaluated = [], []
    for t in range(1, T + 1):
        ctx = StepContext(t=t, x=x, y=y, oracle=oracle, release=gw, run=run)
        params, state, _ = strategy.step(params, state, ctx)
        iterates.append(clone(params))
        evaluated.append(clone(strategy.evaluated(params, state)))
    return iterates, evaluated, strategy.finalize(params, state), state, gw


def _ema(iterates, beta: float):
    """Σ β^{t−s} θ_s / Σ β^{t−s}, computed directly in float64."""
    t = len(iterates)
    w = [beta ** (t - 1 - s) for s in range(t)]
    return {k: sum(wi * it[k].double() for wi, it in zip(w, iterates, strict=True)) / sum(w) for k in iterates[0]}


def _mean(iterates):
    return {k: sum(it[k].double() for it in iterates) / len(iterates) for k in iterates[0]}


def _close(a, b) -> None:
    for k in b:
        torch.testing.assert_close(a[k].double(), b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("final_step", [False, True])
def test_ema_is_the_hand_computed_ema_of_the_iterates(final_step: bool) -> None:
    beta = 0.8
    avg = make_strategy("dpgd", lr=LR, average="ema", ema_decay=beta, final_step=final_step)
    iterates, evaluated, final, state, gw = _iterates(avg)
    for t in range(1, T + 1):  # every evaluation during training scores the EMA so far
        _close(evaluated[t - 1], _ema(iterates[:t], beta))
    plain = make_strategy("dpgd", lr=LR, final_step=final_step)
    ref_iterates, ref_eval, ref_final, ref_state, ref_gw = _iterates(plain)
    for a, b in zip(iterates, ref_iterates, strict=True):  # the iterates are DP-GD's, unchanged
        for k in a:
            assert torch.equal(a[k], b[k])
    assert gw.ledger.to_dict() == ref_gw.ledger.to_dict() and gw.ledger.matches(avg.planned_event(NU, 1.0, T))
    # The free step's iterate θ_{T+1} = θ_T − η·m_T (the plain run's final parameters) is averaged too.
    _close(final, _ema(iterates + ([ref_final] if final_step else []), beta))
    assert not torch.equal(final["weight"], ref_final["weight"])


def test_swa_averages_the_iterates_from_its_start() -> None:
    s = make_strategy("dpgd", lr=LR, average="swa", swa_start=0.5, final_step=False)
    iterates, evaluated, final, _, _ = _iterates(s)
    first = swa_first_step(0.5, T)
    assert first == 4  # ⌊0.5·7⌋ + 1
    for t in range(1, first):  # before SWA starts, the evaluated parameters are the iterate
        _close(evaluated[t - 1], {k: v.double() for k, v in iterates[t - 1].items()})
    for t in range(first, T + 1):
        _close(evaluated[t - 1], _mean(iterates[first - 1 : t]))
    _close(final, _mean(iterates[first - 1 :]))


def test_default_decay_is_horizon_aware_and_public() -> None:
    run = run_plan(NU, 1.0, 60.0, 100)
    assert default_ema_decay(run) == pytest.approx(0.9)  # window T/10 = 10 steps
    assert default_ema_decay(run_plan(NU, 1.0, 60.0, 5)) == 0.0  # T ≤ 10: the last iterate
    cfg = make_strategy("dpgd", average="ema").config()
    assert cfg.pop("strategy") == "dpgd" and cfg["ema_decay"] is None
    assert make_strategy("dpgd", **cfg) == make_strategy("dpgd", average="ema")  # the config round-trips


@pytest.mark.parametrize("average", ["ema", "swa"])
def test_train_spends_exactly_the_plan_and_returns_the_average(average: str) -> None:
    model, x, y = _problem()
    kw = {"steps": T, "full_batch": True, "noise_multiplier": NU, "seed": 2, "device": "cpu", "lr": LR}
    kw |= {"eval_data": (x, y), "eval_every": 2, "accountant": "gdp"}
    plain = dptune.train(_problem()[0], (x, y), "dpgd", **kw)
    avg = dptune.train(model, (x, y), "dpgd", average=average, ema_decay=0.7, **kw)
    assert avg.ledger.to_dict() == plain.ledger.to_dict() and avg.ledger.matches(avg.plan.event())
    assert avg.epsilon(1e-5) == plain.epsilon(1e-5)
    assert [r["lr"] for r in avg.history] == [r["lr"] for r in plain.history]
    # The same run driven by hand (same noise stream, full batch): every evaluation of ``train``
    # scored the running average, and the run returns the final average.
    _, evaluated, final, _, _ = _iterates(
        make_strategy("dpgd", lr=LR, average=average, ema_decay=0.7), seed=stream_seed(2, "noise")
    )
    oracle = GradientOracle(model)
    during = [e for e in avg.evals if not e.get("finalized")]
    assert [e["step"] for e in during] == [2, 4, 6, 7]
    for e in during:
        assert e["accuracy"] == evaluate(oracle, evaluated[e["step"] - 1], x, y, "accuracy")
    _close(avg.final_params, {k: v.double() for k, v in final.items()})
    (final_eval,) = [e for e in avg.evals if e.get("finalized")]
    assert final_eval["accuracy"] == evaluate(oracle, avg.final_params, x, y, "accuracy")
    assert not torch.equal(avg.final_params["weight"], plain.final_params["weight"])


def test_train_many_and_the_tuners_checkpoints_score_the_average() -> None:
    from dptune.vectorized import train_many

    model, x, y = _problem()
    kw = {"steps": T, "full_batch": True, "noise_multiplier": NU, "device": "cpu", "eval_data": (x, y)}
    cfg = {"lr": LR, "average": "ema", "ema_decay": 0.6}
    (many,) = train_many(lambda s: _problem()[0], (x, y), "dpgd", [cfg], [9], fallback="error", eval_every=1, **kw)
    one = dptune.train(_problem()[0], (x, y), "dpgd", seed=9, eval_every=1, **cfg, **kw)
    assert [e["accuracy"] for e in many.evals] == pytest.approx([e["accuracy"] for e in one.evals])
    _close(many.final_params, {k: v.double() for k, v in one.final_params.items()})
    # The tuner's scores (a RunLoop's score callback at its EvalSchedule) see what the strategy
    # evaluates: the running EMA.
    seen, iterates = {}, []
    task = OwnTask.resolve((x, y), None, "cpu", None, None)
    model, oracle = task.prepare(_problem()[0])
    strategy = make_strategy("dpgd", **cfg)
    plan = dptune.plan_run(strategy, x.shape[0], full_batch=True, steps=T, noise_multiplier=NU)

    def score(params):
        seen[len(loop.history) + 1] = clone(params)
        return 0.0

    loop = RunLoop(
        model, strategy, plan, seed=9, device=task.device, secure_mode=False, run_id="", metric="score", higher=True,
        schedule=EvalSchedule((3, 5)), score=score, on_step=lambda t, row: iterates.append(clone(loop.params)),
    )  # fmt: skip
    loop.drive(task, oracle, None)
    assert set(seen) == {3, 5} and len(iterates) == T
    for t in (3, 5):
        _close(seen[t], _ema(iterates[:t], 0.6))
