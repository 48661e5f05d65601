"""One example with a non-finite gradient (a NaN feature, an overflow) must not poison the noisy
sum: it contributes 0 (a per-example rule, so the clipping bound and the sensitivity hold), the
others are summed as usual, on both per-sample paths and in the vectorised trials."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dptune.gradients.oracle import GradientOracle
from dptune.release.privatizers import clip_weights
from dptune.train import train


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(bad_value: float):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 6, generator=g)
    y = torch.randint(0, 3, (10,), generator=g)
    x_bad = x.clone()
    x_bad[4, 2] = bad_value
    return x, x_bad, y


@pytest.mark.parametrize("method", ["ghost", "vmap"])
@pytest.mark.parametrize("bad_value", [math.nan, math.inf])
@pytest.mark.parametrize("norms_first", [True, False])
def test_a_nonfinite_row_contributes_zero(method, bad_value, norms_first):
    model = _model()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    x, x_bad, y = _batch(bad_value)
    oracle = GradientOracle(model, "cross_entropy", method=method)
    clean = oracle(params, torch.cat([x[:4], x[5:]]), torch.cat([y[:4], y[5:]]))
    dirty = oracle(params, x_bad, y)
    w_clean = clip_weights(clean.norms, 0.5)
    if norms_first:  # what clipping strategies do: norms, then the weighted sum
        w = clip_weights(dirty.norms, 0.5)
        assert not bool(torch.isfinite(dirty.norms[4]))
        assert bool(torch.isfinite(torch.cat([dirty.norms[:4], dirty.norms[5:]])).all())
    else:  # a sum asked for before any norm (the row still has to go)
        w = torch.full((10,), 0.1)
        w_clean = torch.full((9,), 0.1)
    got = dirty.weighted_sum(w)
    want = clean.weighted_sum(w_clean)
    for k in want:
        assert bool(torch.isfinite(got[k]).all()), k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_the_naive_sum_would_be_poisoned():
    """The premise: without the rule, one NaN row makes the whole clipped sum NaN."""
    model = _model()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    _, x_bad, y = _batch(math.nan)
    grads = GradientOracle(model, "cross_entropy", method="vmap")(params, x_bad, y)
    w = clip_weights(grads.norms, 0.5)
    naive = {k: w @ g.reshape(10, -1) for k, g in grads.grads.items()}
    assert all(not bool(torch.isfinite(v).all()) for v in naive.values())


@pytest.mark.parametrize("strategy", ["dpsgd", "oso", "quantile", "adamwosm"])
def test_training_with_a_nan_example_stays_finite(strategy):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 6, generator=g)
    y = (x[:, 0] > 0).long()
    x[17, 3] = math.nan  # one corrupt record in the private data
    hp = {"count_noise_std": 1.0} if strategy == "quantile" else {}
    res = train(
        _model(), (x, y), strategy, steps=30, expected_batch_size=50, noise_multiplier=0.8, seed=0, device="cpu", **hp
    )
    assert not res.diverged
    assert all(bool(torch.isfinite(v).all()) for v in res.final_params.values())
    assert res.ledger.matches(res.plan.event())


def test_vectorised_trials_leave_the_row_out_too():
    from dptune.vectorized import train_many

    g = torch.Generator().manual_seed(3)
    x = torch.randn(120, 6, generator=g)
    y = (x[:, 1] > 0).long()
    x[5, 0] = math.inf
    res = train_many(
        lambda s: _model(),
        (x, y),
        "dpsgd",
        [{"lr": 0.5, "clip": 1.0}] * 2,
        seeds=[0, 1],
        noise_multiplier=1.0,
        steps=20,
        expected_batch_size=40,
        fallback="error",
    )
    for r in res:
        assert not r.diverged and all(bool(torch.isfinite(v).all()) for v in r.final_params.values())


def test_a_nan_row_in_the_first_batch_keeps_the_ghost_path():
    """The 'auto' self-check compares ghost and vmap on the first examples: NaN = NaN there."""
    import warnings

    model = _model()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    _, x_bad, y = _batch(math.nan)
    x_bad[0, 1] = math.nan  # inside the self-check's examples
    oracle = GradientOracle(model, "cross_entropy", method="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        oracle(params, x_bad, y)
    assert oracle.method == "ghost"
