"""The contract every registered strategy keeps (issue 14): one battery, run over ``STRATEGIES``,
so a strategy added later is checked without anyone naming it here.

For each strategy, with its default hyperparameters:

* the executed ledger equals the plan (every release was planned, nothing more);
* empty Poisson batches work (the step and its noise still happen) — full-batch strategies excepted;
* the same seed gives the same run, bit for bit;
* every released value is the exact sum plus N(0, (ν·sensitivity)²) noise: the standardised
  residuals pass a KS test for normality and a variance test that accepts σ and rejects 0.9σ and 1.1σ;
* ghost norms and vmap give the same run (to float tolerance);
* vectorised trials (``train_many``) equal sequential runs, or the strategy refuses to be stacked
  with a clear error (then the tuner trains it run by run).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import zero_grad_problem
from scipy import stats
from torch import nn

import dptune
from dptune.errors import ConfigError
from dptune.release.mechanisms import NoisyRelease
from dptune.strategies import STRATEGIES

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(n: int = 60, d: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def _model(seed: int = 0, d: int = 5) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, 2))


def _private(name: str) -> bool:
    return STRATEGIES[name]().private


def _kw(name: str, steps: int = 6, batch: float = 20.0) -> dict:
    kw: dict = {"steps": steps, "seed": 3}
    kw.update({"full_batch": True} if name == "dpgd" else {"expected_batch_size": batch})
    if _private(name):
        kw["noise_multiplier"] = 1.1
    return kw


class StrategyContract:
    """The battery; ``TestEveryRegisteredStrategy`` runs it for every name in ``STRATEGIES``."""

    def test_the_ledger_equals_the_plan(self, name: str) -> None:
        x, y = _problem()
        res = dptune.train(_model(), (x, y), name, **_kw(name))
        assert res.ledger.matches(res.plan.event())
        assert all(torch.isfinite(p).all() for p in res.final_params.values())

    def test_empty_batches_work(self, name: str) -> None:
        """A Poisson batch can be empty: the step still releases (noise only) and keeps params finite."""
        from conftest import run_plan

        from dptune.gradients.oracle import GradientOracle
        from dptune.release.context import StepContext
        from dptune.release.ledger import Ledger
        from dptune.release.mechanisms import NoiseSource
        from dptune.strategies import make_strategy

        strat = make_strategy(name)
        model = _model()
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
        q = 1.0 if name == "dpgd" else 0.25
        run = run_plan(1.1 if strat.private else float("inf"), q, 16.0 * q / 0.25, 5, strat)
        state = strat.init(params, run)
        ledger = Ledger()
        gateway = NoisyRelease(ledger, q, NoiseSource(0))
        oracle = GradientOracle(model, "cross_entropy")
        x, y = _problem()
        for t, rows in enumerate([slice(0, 0), slice(0, 16), slice(0, 0)], start=1):
            ctx = StepContext(t=t, x=x[rows], y=y[rows], oracle=oracle, release=gateway, run=run)
            params, state, _ = strat.step(params, state, ctx)
            assert all(torch.isfinite(p).all() for p in params.values()), (name, t)
        assert ledger.releases >= 3  # one entry per step, a NonPrivateDpEvent for a non-private strategy

    def test_the_same_seed_gives_the_same_run(self, name: str) -> None:
        x, y = _problem()
        a = dptune.train(_model(), (x, y), name, **_kw(name))
        b = dptune.train(_model(), (x, y), name, **_kw(name))
        for k in a.final_params:
            assert torch.equal(a.final_params[k], b.final_params[k]), k

    def test_released_noise_has_std_nu_times_sensitivity(self, name: str, monkeypatch) -> None:
        if not _private(name):
            pytest.skip("non-private: releases nothing")
        residuals: list[np.ndarray] = []
        real = NoisyRelease._noisy_outputs

        def spy(self, queries):
            outs = real(self, queries)
            for q, out in zip(queries, outs, strict=True):
                if q.deferred:  # drawn later, by the gateway; its std is the same ν·sensitivity
                    continue
                vals = q.value if isinstance(q.value, dict) else {"": q.value}
                got = out if isinstance(out, dict) else {"": out}
                for k in vals:
                    residuals.append(((got[k] - vals[k]).double() / q.std).flatten().numpy())
            return outs

        monkeypatch.setattr(NoisyRelease, "_noisy_outputs", spy)
        model, x, y = zero_grad_problem(inputs=200, classes=50, n=48)
        dptune.train(model, (x, y), name, **_kw(name, steps=1, batch=16.0))
        per_step = max(1, sum(r.size for r in residuals))
        residuals.clear()  # enough steps for ~4,000 residuals (a scalar release needs many steps)
        steps = min(5_000, max(3, -(-4_000 // per_step)))
        model, x, y = zero_grad_problem(inputs=200, classes=50, n=48)
        dptune.train(model, (x, y), name, **_kw(name, steps=steps, batch=16.0))
        z = np.concatenate(residuals)
        n = z.size
        assert n >= 4_000, n
        assert stats.kstest(z, "norm").pvalue > 1e-3  # the law: Gaussian
        se = (2.0 / n) ** 0.5  # sd of the sample variance of n standard normals
        assert abs(float(np.mean(z**2)) - 1.0) < 4 * se  # the scale: σ = ν·sensitivity
        for wrong in (0.9, 1.1):  # the test can fail: σ off by 10% is rejected (≥ 8 se away)
            assert abs(float(np.mean((z / wrong) ** 2)) - 1.0) > 5 * se

    def test_ghost_and_vmap_give_the_same_run(self, name: str) -> None:
        x, y = _problem()
        a = dptune.train(_model(), (x, y), name, grad_method="ghost", **_kw(name))
        b = dptune.train(_model(), (x, y), name, grad_method="vmap", **_kw(name))
        for k in a.final_params:
            torch.testing.assert_close(a.final_params[k], b.final_params[k], rtol=1e-4, atol=1e-5)

    def test_vectorised_trials_equal_sequential_runs(self, name: str) -> None:
        from dptune.vectorized import train_many

        x, y = _problem()
        # 20 steps: the horizon-aware default rates of a 6-step run are large enough (OSO: ρ ≈ 6.7)
        # to amplify the summation-order rounding of the stacked sums to 1e-4.
        kw = _kw(name, steps=20)
        kw.pop("seed")
        try:
            many = train_many(_model, (x, y), name, [{}, {}], [0, 1], fallback="error", **kw)
        except ConfigError as exc:  # refusing to stack is allowed; silently stacking wrongly is not
            assert "Fix" in str(exc) or "fallback" in str(exc), exc
            pytest.skip(f"{name} is trained run by run: {exc}")
        for seed, res in zip([0, 1], many, strict=True):
            one = dptune.train(_model(seed), (x, y), name, seed=seed, **kw)
            for k in one.final_params:
                torch.testing.assert_close(res.final_params[k], one.final_params[k], rtol=1e-4, atol=1e-5)


@pytest.fixture(params=sorted(STRATEGIES))
def name(request) -> str:
    return request.param


class TestEveryRegisteredStrategy(StrategyContract):
    pass
