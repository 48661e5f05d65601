"""Per-sample gradients (vmap(grad) in ``dptune.gradients.oracle``) against a naive per-example loop."""

from __future__ import annotations

import pytest
import torch
from conftest import ConvAutoencoder, SmallCNN, mlp, params_of
from torch import nn

from dptune.errors import ConfigError
from dptune.gradients.oracle import GradientOracle, MaterializedGrads, per_example_loss


def naive_per_sample(model: nn.Module, loss: str, x: torch.Tensor, y: torch.Tensor):
    """One ordinary backward pass per example: the reference."""
    fn = per_example_loss(loss)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    grads = {k: [] for k in names}
    losses = []
    for i in range(x.shape[0]):
        model.zero_grad()
        out = model(x[i : i + 1]).squeeze(0)
        li = fn(out, y[i])
        li.backward()
        losses.append(li.detach())
        for k, p in model.named_parameters():
            if p.requires_grad:
                grads[k].append(p.grad.detach().clone())
    return {k: torch.stack(v) for k, v in grads.items()}, torch.stack(losses)


CASES = {
    "cnn": (
        lambda: SmallCNN(side=12),
        lambda g: (torch.randn(9, 1, 12, 12, generator=g), torch.randint(0, 10, (9,), generator=g)),
        "cross_entropy",
    ),
    "mlp": (
        lambda: mlp(20, 16, 5),
        lambda g: (torch.randn(9, 20, generator=g), torch.randint(0, 5, (9,), generator=g)),
        "cross_entropy",
    ),
    "conv_autoencoder": (ConvAutoencoder, lambda g: (torch.rand(9, 1, 8, 8, generator=g),) * 2, "mse"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_sample_gradients_equal_naive_loop(case: str) -> None:
    make_model, make_data, loss = CASES[case]
    torch.manual_seed(3)
    model = make_model()
    x, y = make_data(torch.Generator().manual_seed(4))
    ref_grads, ref_losses = naive_per_sample(model, loss, x, y)
    got = GradientOracle(model, loss)(params_of(model), x, y)
    assert set(got.grads) == set(ref_grads)
    for k in ref_grads:
        torch.testing.assert_close(got.grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=f"{case}: {k}")
    torch.testing.assert_close(got.losses, ref_losses, rtol=1e-5, atol=1e-7)
    # The norms and weighted sums the strategies read are the obvious functions of them.
    # Norms are upper bounds (issue 10, item 1): ≥ the float64 norm, ≤ it·(1 + 1e-4) (the
    # worst-case float32 rounding slack, 6.1e-5, see grads.upper_norms).
    flat = torch.cat([g.reshape(x.shape[0], -1) for g in ref_grads.values()], 1).double()
    exact = flat.norm(dim=1)
    assert bool((got.norms.double() >= exact).all()) and bool((got.norms.double() <= exact * (1 + 1e-4) + 1e-7).all())
    w = torch.linspace(-1, 2, x.shape[0])
    ws = got.weighted_sum(w)
    for k in ref_grads:
        torch.testing.assert_close(ws[k], torch.einsum("b,b...->...", w, ref_grads[k]), rtol=1e-5, atol=1e-6)


def test_chunked_oracle_matches_unchunked() -> None:
    torch.manual_seed(0)
    model = SmallCNN(side=12)
    x, y = torch.randn(7, 1, 12, 12), torch.randint(0, 10, (7,))
    a = GradientOracle(model)(params_of(model), x, y)
    b = GradientOracle(model, chunk_size=3)(params_of(model), x, y)
    for k in a.grads:
        torch.testing.assert_close(a.grads[k], b.grads[k], rtol=1e-5, atol=1e-7)


def test_gradients_at_other_parameters() -> None:
    """The oracle differentiates at the parameters it is given, not at the model's own."""
    torch.manual_seed(1)
    model = mlp(20, 8, 3)
    x, y = torch.randn(4, 20), torch.randint(0, 3, (4,))
    other = {k: v + 0.1 for k, v in params_of(model).items()}
    got = GradientOracle(model)(other, x, y)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(other[k])
    ref, _ = naive_per_sample(model, "cross_entropy", x, y)
    for k in ref:
        torch.testing.assert_close(got.grads[k], ref[k], rtol=1e-5, atol=1e-7)


def test_empty_batch_gives_zero_sums() -> None:
    model = mlp(20, 8, 3)
    g = GradientOracle(model)(params_of(model), torch.zeros(0, 20), torch.zeros(0, dtype=torch.long))
    assert isinstance(g, MaterializedGrads) and g.norms.shape == (0,)
    for k, v in g.weighted_sum(torch.zeros(0)).items():
        assert v.shape == dict(model.named_parameters())[k].shape and not v.any()


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(8), nn.SyncBatchNorm(8)])
def test_batchnorm_is_rejected_with_the_fix_named(norm: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(4, 8), norm, nn.Linear(8, 2))
    with pytest.raises(ConfigError, match="GroupNorm"):
        GradientOracle(model)


def test_groupnorm_is_accepted() -> None:
    GradientOracle(nn.Sequential(nn.Linear(4, 8), nn.GroupNorm(2, 8), nn.Linear(8, 2)))


@pytest.mark.parametrize(("name", "loss"), [("galli_cnn", "cross_entropy"), ("galli_autoencoder", "mse")])
def test_per_sample_gradients_of_the_paper_models(name: str, loss: str) -> None:
    """The same check on dptune.models' Galli CNN (MNIST) and conv autoencoder (Fashion-MNIST)."""
    models = pytest.importorskip("dptune.models")
    torch.manual_seed(5)
    model = models.build(name)
    g = torch.Generator().manual_seed(6)
    x = torch.rand(4, 1, 28, 28, generator=g)
    y = x if loss == "mse" else torch.randint(0, 10, (4,), generator=g)
    ref_grads, ref_losses = naive_per_sample(model, loss, x, y)
    got = GradientOracle(model, loss)(params_of(model), x, y)
    for k in ref_grads:
        torch.testing.assert_close(got.grads[k], ref_grads[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    torch.testing.assert_close(got.losses, ref_losses, rtol=1e-5, atol=1e-7)
