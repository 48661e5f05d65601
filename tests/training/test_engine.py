"""The training engine end to end: input validation, divergence, Poisson sampling,
reproducibility, and the MNIST sanity runs."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import load_mnist, pooled_mnist_mlp, zero_grad_problem
from scipy import stats
from torch import nn

from dptune import plan_run, train
from dptune.errors import ConfigError
from dptune.release.sampling import PoissonSampler, steps_for_epochs
from dptune.strategies import make_strategy


def toy(n: int = 60, d: int = 5, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


def model_for(d: int = 5, k: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(d, k)


# ----------------------------------------------------------------------------- bad input
BASE = dict(steps=3, expected_batch_size=10, device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(target_epsilon=0.0, delta=1e-5), "epsilon"),
        (dict(target_epsilon=-2.0, delta=1e-5), "epsilon"),
        (dict(target_epsilon=math.nan, delta=1e-5), "epsilon"),
        (dict(target_epsilon=1.0, delta=0.0), "delta"),
        (dict(target_epsilon=1.0, delta=1.0), "delta"),
        (dict(target_epsilon=1.0, delta=-1e-5), "delta"),
        (dict(target_epsilon=1.0), "delta"),
        (dict(noise_multiplier=1.0, expected_batch_size=0), "expected batch size"),
        (dict(noise_multiplier=1.0, expected_batch_size=61), "expected batch size"),
        (dict(noise_multiplier=1.0, clip=0.0), "clip"),
        (dict(noise_multiplier=1.0, clip=-1.0), "clip"),
        (dict(noise_multiplier=1.0, lr=0.0), "lr"),
        (dict(noise_multiplier=1.0, lr=-0.1), "lr"),
        (dict(noise_multiplier=0.0), "noise_multiplier"),
        (dict(noise_multiplier=1.0, learning_rate=0.1), "no hyperparameter"),
        ({}, "noise_multiplier or target_epsilon"),
    ],
)
def test_bad_input_is_one_clear_config_error(kwargs: dict, match: str) -> None:
    x, y = toy()
    with pytest.raises(ConfigError, match=match):
        train(model_for(), (x, y), "dpsgd", **{**BASE, **kwargs})


def test_sampling_rate_outside_unit_interval() -> None:
    with pytest.raises(ConfigError, match="sampling rate"):
        PoissonSampler(10, 1.5, 0)
    with pytest.raises(ConfigError, match="sampling rate"):
        PoissonSampler(10, 0.0, 0)


def test_unknown_strategy_names_the_choices() -> None:
    x, y = toy()
    with pytest.raises(ConfigError, match="choose one of: .*dpsgd"):
        train(model_for(), (x, y), "dp-sgd-turbo", noise_multiplier=1.0, **BASE)


def test_batchnorm_model_is_rejected_before_any_release() -> None:
    x, y = toy()
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(ConfigError, match="BatchNorm1d"):
        train(model, (x, y), "dpsgd", noise_multiplier=1.0, **BASE)


def test_hyperparameters_with_a_strategy_object_are_refused() -> None:
    x, y = toy()
    with pytest.raises(ConfigError, match="hyperparameters go into the strategy"):
        train(model_for(), (x, y), make_strategy("dpsgd"), noise_multiplier=1.0, lr=0.1, **BASE)


def test_config_errors_are_value_errors_with_one_message() -> None:
    try:
        make_strategy("dpsgd", clip=0.0)
    except ConfigError as e:
        assert isinstance(e, ValueError) and "clip (C)" in str(e) and "> 0" in str(e)
    else:  # pragma: no cover
        pytest.fail("no ConfigError")


# ----------------------------------------------------------------------------- divergence
def test_non_finite_parameters_stop_the_run_and_keep_its_spend(tmp_path) -> None:
    """Divergence is judged on the parameters (post-processing of the noisy releases, so the
    stop leaks nothing; a stop on the private batch loss would). lr = 1e39 overflows float32 at
    the first step: the parameters, and with them every later loss, are non-finite."""
    x, y = toy(200)
    res = train(
        model_for(), (x, y), "dpsgd", steps=50, expected_batch_size=20, noise_multiplier=1.0, device="cpu", lr=1e39
    )
    assert res.diverged
    done = len(res.history)
    assert 1 <= done < 50
    assert not all(bool(torch.isfinite(v).all()) for v in res.final_params.values())
    assert res.ledger.releases == done  # every step taken was spent and stays recorded
    assert res.epsilon(1e-5) > 0
    assert res.summary()["diverged"] is True
    # Found in review: its model card said all 50 steps were taken, and a model of NaNs was saved.
    assert res.steps_taken == done
    import dptune
    from dptune.errors import ConfigError

    with pytest.raises(ConfigError, match="diverged.*Fix: a smaller learning rate"):
        dptune.save_model(res, tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_non_finite_entry_in_any_tensor_is_seen(bad: float) -> None:
    """``finite_flag`` reduces every tensor to one flag (one host read on a GPU): a single bad
    entry anywhere, in any tensor and dtype, makes it False; an empty dict is finite."""
    from dptune.tree import finite_flag, is_finite

    base = {
        "a": torch.zeros(3),
        "b": torch.ones(2, 2),
        "c": torch.zeros((), dtype=torch.float64),
        "d": torch.zeros(2, dtype=torch.float16),
        "e": torch.zeros(2, dtype=torch.bfloat16),
    }
    flag = finite_flag(base)
    assert flag.dtype == torch.bool and flag.dim() == 0 and bool(flag) and is_finite({})
    for k, v in base.items():
        for i in range(v.numel()):
            a = {kk: vv.clone() for kk, vv in base.items()}
            a[k].view(-1)[i] = bad
            assert not is_finite(a), (k, i)


def test_step_rows_carry_the_batch_loss_as_a_float() -> None:
    """The step row's training loss (for the data owner only) is read in the same host read as
    the divergence flag: a Python float, the mean of the batch's per-example losses. With zero
    weights every logit is 0, so the first batch's mean cross-entropy is exactly log 3."""
    x, y = toy(200)
    model = model_for()
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    seen: list[float] = []
    res = train(
        model,
        (x, y),
        "dpsgd",
        steps=3,
        expected_batch_size=20,
        noise_multiplier=1.0,
        device="cpu",
        lr=0.1,
        on_step=lambda t, row: seen.append(row["train_loss"]),
    )
    assert len(seen) == 3 and all(type(v) is float and math.isfinite(v) and v > 0 for v in seen)
    assert seen[0] == pytest.approx(math.log(3), rel=1e-6)
    assert [r["train_loss"] for r in res.history] == seen and not res.diverged


def test_an_overflowing_loss_with_finite_parameters_does_not_corrupt_the_update() -> None:
    """MSE with outputs ~1e36 overflows the loss to inf; per-sample norms are then inf and the
    clip weights C/‖g‖ = 0, so the clipped sum stays finite: only noise moves θ, and the run
    keeps its plan (no NaN leaks into the parameters)."""
    x, _ = toy(200)
    res = train(
        model_for(5, 5),
        (x, x),
        "dpsgd",
        steps=10,
        expected_batch_size=20,
        noise_multiplier=1.0,
        device="cpu",
        lr=1e30,
        clip=1e6,
    )
    assert any(not math.isfinite(h.get("train_loss", 0.0)) for h in res.history)
    assert all(bool(torch.isfinite(v).all()) for v in res.final_params.values())
    assert res.ledger.matches(res.plan.event())


# ----------------------------------------------------------------------------- Poisson sampling
def test_poisson_batch_sizes_are_binomial() -> None:
    n, q, draws = 1000, 0.05, 3000
    sampler = PoissonSampler(n, q, seed=7)
    sizes, hits = [], torch.zeros(n)
    for _ in range(draws):
        idx = sampler.sample()
        assert idx.unique().numel() == idx.numel()
        sizes.append(idx.numel())
        hits[idx] += 1
    s = np.array(sizes, dtype=float)
    mean, var = n * q, n * q * (1 - q)
    assert abs(s.mean() - mean) < 4 * math.sqrt(var / draws)
    # Sample variance: (draws−1)·s²/var ~ χ²(draws−1) under the binomial law.
    chi = (draws - 1) * s.var(ddof=1) / var
    assert stats.chi2.sf(chi, draws - 1) > 1e-4 and stats.chi2.cdf(chi, draws - 1) > 1e-4
    # ... and it rejects a fixed-size batcher's variance (0) and a doubled variance.
    assert stats.chi2.cdf((draws - 1) * s.var(ddof=1) / (2 * var), draws - 1) < 1e-4
    # Every example is included with probability q.
    assert abs(hits.mean().item() / draws - q) < 1e-3
    assert stats.chisquare(hits.numpy()).pvalue > 1e-4


def _subset_law_pvalue(draw, n: int, q: float, draws: int) -> float:
    """χ² p-value of the observed subsets of range(n) against the Poisson-sampling law q^|S|(1−q)^(n−|S|)."""
    counts = Counter(tuple(draw().tolist()) for _ in range(draws))
    subsets = [tuple(i for i in range(n) if mask >> i & 1) for mask in range(2**n)]
    assert set(counts) <= set(subsets), f"not a sorted subset of range({n}): {set(counts) - set(subsets)}"
    expected = np.array([draws * q ** len(S) * (1 - q) ** (n - len(S)) for S in subsets])
    return float(stats.chisquare([counts.get(S, 0) for S in subsets], expected).pvalue)


@pytest.mark.parametrize("q", [0.05, 0.3, 0.9])
def test_poisson_sampler_has_the_exact_subset_law(q: float) -> None:
    """Every one of the 2^n index sets has probability q^|S|(1−q)^(n−|S|) (geometric skips are exact)."""
    n, draws = 5, 20_000
    sampler = PoissonSampler(n, q, seed=11)
    assert _subset_law_pvalue(sampler.sample, n, q, draws) > 1e-4
    # Power: the same test rejects a sampler at a 10% higher rate, and one whose gaps are off by one.
    wrong_rate = PoissonSampler(n, min(q * 1.1, 0.99), seed=11)
    assert _subset_law_pvalue(wrong_rate.sample, n, q, draws) < 1e-4
    gen = torch.Generator().manual_seed(5)

    def gaps_off_by_one() -> torch.Tensor:  # gaps ≥ 2: never two neighbours in one batch
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        idx = torch.cumsum(torch.floor(torch.log1p(-u) / math.log1p(-q)).long() + 2, 0) - 2
        return idx[idx < n]

    assert _subset_law_pvalue(gaps_off_by_one, n, q, draws) < 1e-4


def test_poisson_sampler_over_many_chunks(monkeypatch) -> None:
    """Batches that need several draws of skips keep the exact law (forced: 2 skips per draw)."""
    import dptune.release.sampling

    monkeypatch.setattr(dptune.release.sampling, "_chunk_size", lambda left: 2)
    assert _subset_law_pvalue(PoissonSampler(5, 0.6, seed=4).sample, 5, 0.6, 20_000) > 1e-4
    n, q = 200_000, 0.4
    idx = PoissonSampler(n, q, seed=2).sample()
    assert bool((idx[1:] > idx[:-1]).all()) and int(idx[0]) >= 0 and int(idx[-1]) < n
    assert abs(idx.numel() - n * q) < 5 * math.sqrt(n * q * (1 - q))


def test_empty_batches_are_handled_and_still_recorded() -> None:
    x, y = toy(100)
    res = train(
        model_for(), (x, y), "dpsgd", steps=30, expected_batch_size=0.1, noise_multiplier=1.0, device="cpu", seed=3
    )
    sizes = [h["batch_size"] for h in res.history]
    assert sizes.count(0) > 20  # q = 0.001 over 100 examples: most batches are empty
    assert len(sizes) == 30 and res.ledger.releases == 30
    assert not res.diverged
    assert all("train_loss" not in h for h in res.history if h["batch_size"] == 0)


@pytest.mark.parametrize("name", ["oso", "quantile", "adadp", "adamwosm"])
def test_empty_batches_in_adaptive_strategies(name: str) -> None:
    x, y = toy(100)
    hp = {"count_noise_std": 1.0} if name == "quantile" else {}
    # ν = 0.6: a value whose quantile/OSO split round-trips exactly (float rounding of the split
    # is tested separately in test_strategies.py::test_split_releases_are_exactly_the_planned_event)
    res = train(model_for(), (x, y), name, steps=6, expected_batch_size=0.1, noise_multiplier=0.6, device="cpu", **hp)
    assert res.ledger.releases == 6 and not res.diverged


def test_steps_for_epochs() -> None:
    assert steps_for_epochs(5, 250 / 5000) == 100
    assert steps_for_epochs(1, 0.3) == 4
    assert plan_run(make_strategy("dpsgd"), 5000, expected_batch_size=250, epochs=5, noise_multiplier=1.0).steps == 100


# ----------------------------------------------------------------------------- reproducibility
@pytest.mark.parametrize("name", ["dpsgd", "oso", "adadp"])
def test_same_seed_is_bit_identical_and_another_seed_differs(name: str) -> None:
    x, y = toy(80)

    def run(seed: int):
        return train(
            model_for(seed=0),
            (x, y),
            name,
            steps=8,
            expected_batch_size=16,
            noise_multiplier=1.0,
            device="cpu",
            seed=seed,
            eval_data=(x, y),
            eval_every=4,
        )

    a, b, c = run(11), run(11), run(12)
    for k in a.final_params:
        assert torch.equal(a.final_params[k], b.final_params[k])
    assert [h["batch_size"] for h in a.history] == [h["batch_size"] for h in b.history]
    assert a.history == b.history and a.evals == b.evals
    assert a.ledger.to_dict() == b.ledger.to_dict()
    assert [h["batch_size"] for h in a.history] != [h["batch_size"] for h in c.history]
    assert any(not torch.equal(a.final_params[k], c.final_params[k]) for k in a.final_params)


def test_noise_and_sampling_streams_are_independent_of_each_other() -> None:
    """Zero-gradient data: θ_T − θ_0 = −lr·Σ_t noise_t / L is pure noise. With the same seed but
    another expected batch size (so other Poisson samples), the noise stream must be the same:
    sampling draws from its own stream."""
    model, x, y = zero_grad_problem(6, 4, 50)
    theta0 = model.weight.detach().clone()
    moves = []
    for L in (10, 20):
        res = train(
            model, (x, y), "dpsgd", steps=4, expected_batch_size=L, noise_multiplier=1.0, device="cpu", seed=1, lr=0.5
        )
        assert res.ledger.releases == 4
        moves.append((res.final_params["weight"] - theta0) * L)
        with torch.no_grad():
            model.weight.copy_(theta0)  # train() loads the result into the model
    torch.testing.assert_close(moves[0], moves[1], rtol=1e-5, atol=1e-6)
    assert moves[0].abs().sum() > 0


# ----------------------------------------------------------------------------- MNIST sanity (slow)
def _mnist5k_at_epsilon_3(shared_data_dir, strategy: str, **hp):
    """``strategy`` on 5,000 MNIST training examples (10,000 test), ε = 3 (δ = 1e-5, RDP), 5 epochs,
    expected batch 500, pooled MLP, CPU, seed 0."""
    (x, y), (xt, yt) = load_mnist(shared_data_dir, n_test=10000)
    torch.manual_seed(0)
    return train(
        pooled_mnist_mlp(),
        (x, y),
        strategy,
        epochs=5,
        expected_batch_size=500,
        target_epsilon=3.0,
        delta=1e-5,
        eval_data=(xt, yt),
        eval_every=10**6,
        seed=0,
        device="cpu",
        accountant="rdp",
        **hp,
    )


@pytest.mark.slow
def test_dpsgd_reaches_80_percent_on_mnist5k_at_epsilon_3(shared_data_dir) -> None:
    """DP-SGD, 5,000 MNIST training examples, ε = 3 (δ = 1e-5), 5 epochs, expected batch 500,
    C = 1, lr = 4. Model: 2×2 average pooling + MLP 196-64-10 (the Galli CNN is too slow on CPU)."""
    res = _mnist5k_at_epsilon_3(shared_data_dir, "dpsgd", lr=4.0, clip=1.0, momentum=0.0)
    assert res.plan.steps == 50
    assert res.epsilon(accountant="rdp") <= 3.0
    assert res.evals[-1]["accuracy"] >= 0.80, res.evals


@pytest.mark.slow
def test_oso_from_small_clip_reaches_75_percent_on_mnist5k_at_epsilon_3(shared_data_dir) -> None:
    """OSO-DPSGD from C₀ = 0.1 (Galli's start), same setting; ρ₀ = 40 because with C₀ = 0.1 almost
    every example is clipped, so the effective step ρ·C₀ = 4 matches DP-SGD's lr·C."""
    res = _mnist5k_at_epsilon_3(shared_data_dir, "oso", lr=40.0, initial_clip=0.1)
    assert res.epsilon(accountant="rdp") <= 3.0
    assert res.evals[-1]["accuracy"] >= 0.75, res.evals


def test_sup_norm_is_finite_iff_every_entry_is() -> None:
    """The loop's divergence check: max |entry| (one pass) is NaN/inf exactly when an entry is, one buffer
    or several tensors, whatever the position of the bad entry."""
    import math

    from dptune.tree import Flat, sup_norm

    base = torch.randn(1000)
    assert sup_norm(Flat(base, (("a", torch.Size([600])), ("b", torch.Size([400]))))) == base.abs().max()
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 599, 999):
            x = base.clone()
            x[at] = bad
            flat = Flat(x, (("a", torch.Size([600])), ("b", torch.Size([400]))))
            assert not math.isfinite(float(sup_norm(flat)))
            assert not math.isfinite(float(sup_norm({"a": x[:600].clone(), "b": x[600:].clone(), "e": x[:0]})))
    assert math.isfinite(float(sup_norm({"a": torch.full((3,), 3e38), "b": torch.zeros(0)})))


def test_a_given_plan_still_refuses_a_delta_above_one_over_n() -> None:
    """``train(plan=...)`` with a δ ≥ 1/n is refused as ``plan_run`` refuses it (review: it was accepted)."""
    import dptune
    from dptune.errors import ConfigError

    x, y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    plan = dptune.plan_run(dptune.make_strategy("dpsgd"), 40, expected_batch_size=10, steps=3, noise_multiplier=1.0)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="1/n"):
        dptune.train(model, (x, y), "dpsgd", plan=plan, delta=0.1)
    assert dptune.train(model, (x, y), "dpsgd", plan=plan, delta=1e-3).ledger.releases == 3
