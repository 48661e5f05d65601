"""Tests of dptune.models: exact parameter counts, shapes, DP-compatibility."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dptune import models
from dptune.errors import ConfigError


def test_galli_cnn_param_count_and_shape() -> None:
    m = models.galli_cnn()
    assert models.count_params(m) == 551_322 == models.GALLI_CNN_PARAMS
    out = m(torch.rand(3, 1, 28, 28))
    assert out.shape == (3, 10)
    conv1 = m[0]
    assert isinstance(conv1, nn.Conv2d) and conv1.padding == (3, 3)
    assert not isinstance(m[-1], nn.ReLU)  # logits by default
    relu = models.galli_cnn(final_relu=True)
    assert isinstance(relu[-1], nn.ReLU) and models.count_params(relu) == 551_322
    with torch.no_grad():
        assert float(relu(torch.rand(2, 1, 28, 28)).min()) >= 0.0


def test_galli_autoencoder_param_count_and_range() -> None:
    m = models.galli_autoencoder()
    assert models.count_params(m) == 48_705 == models.GALLI_AUTOENCODER_PARAMS
    x = torch.rand(2, 1, 28, 28)
    with torch.no_grad():
        y = m(x)
    assert y.shape == x.shape
    assert float(y.min()) >= 0.0 and float(y.max()) <= 1.0
    assert m.encoder(x).shape == (2, 64, 20, 20)
    convs = [c for c in m.modules() if isinstance(c, nn.Conv2d | nn.ConvTranspose2d)]
    assert len(convs) == 8 and all(c.kernel_size == (3, 3) for c in convs)
    assert [c.out_channels for c in convs] == [8, 16, 32, 64, 32, 16, 8, 1]


def test_galli_bow_fc_param_count() -> None:
    m = models.galli_bow_fc(input_dim=750)
    assert models.count_params(m) == 113_156 == models.GALLI_BOW_FC_PARAMS
    assert models.count_params(models.galli_bow_fc()) == 113_156
    assert models.count_params(models.galli_bow_fc(input_dim=1250)) == 177_156
    assert m(torch.rand(5, 750)).shape == (5, 4)


def test_mohapatra_models() -> None:
    lr = models.logistic_regression(784, 10)
    assert models.count_params(lr) == 785 * 10
    assert lr(torch.rand(4, 1, 28, 28)).shape == (4, 10)  # flattens images
    tl = models.two_layer_nn(5512, classes=2)
    assert models.count_params(tl) == 5513 * 100 + 101 * 2
    assert tl(torch.rand(3, 5512)).shape == (3, 2)


def test_linear_probe_zero_init_no_bias() -> None:
    m = models.linear_probe(384, 4)
    assert models.count_params(m) == 384 * 4
    lin = m[-1]
    assert isinstance(lin, nn.Linear) and lin.bias is None
    assert torch.count_nonzero(lin.weight) == 0
    with torch.no_grad():
        assert torch.equal(m(torch.rand(2, 384)), torch.zeros(2, 4))
    with_bias = models.linear_probe(384, 4, zero_init=False, bias=True)
    assert models.count_params(with_bias) == 384 * 4 + 4
    assert torch.count_nonzero(with_bias[-1].weight) > 0


def test_mlp_and_registry() -> None:
    m = models.mlp()
    assert models.count_params(m) == 784 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert set(models.MODELS) == {
        "galli_cnn",
        "galli_autoencoder",
        "galli_bow_fc",
        "logistic_regression",
        "two_layer_nn",
        "linear_probe",
        "mlp",
        "hf_classifier",
    }
    assert models.count_params(models.build("galli_cnn")) == 551_322
    assert models.count_params(models.build("mlp", hidden=(32,), input_dim=64)) == 64 * 32 + 32 + 330
    with pytest.raises(ConfigError, match=r"unknown model 'resnet18'\. Fix: choose one of .*galli_cnn"):
        models.build("resnet18")
    with pytest.raises(ConfigError):
        models.build("mlp", width=3)
    with pytest.raises(ConfigError):
        models.logistic_regression(0, 2)


@pytest.mark.parametrize(
    ("name", "kwargs", "shape"),
    [
        ("galli_cnn", {}, (1, 28, 28)),
        ("galli_autoencoder", {}, (1, 28, 28)),
        ("galli_bow_fc", {}, (750,)),
        ("logistic_regression", {"input_dim": 105}, (105,)),
        ("two_layer_nn", {"input_dim": 105}, (105,)),
        ("linear_probe", {"input_dim": 384, "classes": 4}, (384,)),
        ("mlp", {}, (1, 28, 28)),
    ],
)
def test_no_batchnorm_and_per_sample_grads(name: str, kwargs: dict[str, object], shape: tuple[int, ...]) -> None:
    """Every model works with vmap(grad) per-example gradients (what DP-SGD needs)."""
    torch.manual_seed(0)
    m = models.build(name, **kwargs)
    assert not any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in m.modules())
    params = {k: v.detach() for k, v in m.named_parameters()}
    x = torch.rand(2, *shape)

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        out = functional_call(m, p, (xi.unsqueeze(0),))
        if name == "galli_autoencoder":
            return nn.functional.mse_loss(out, xi.unsqueeze(0))
        return nn.functional.cross_entropy(out, torch.zeros(1, dtype=torch.long))

    g = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for k, v in params.items():
        assert g[k].shape == (2, *v.shape)
    # the per-example gradient of example 0 equals an ordinary backward on it alone
    single = grad(loss)(params, x[0])
    for k in params:
        assert torch.allclose(g[k][0], single[k], atol=1e-5)


def test_kwargs_for_and_for_dataset() -> None:
    from types import SimpleNamespace as NS

    mnist = NS(name="mnist", input_shape=(1, 28, 28), num_classes=10, task="classification")
    assert models.kwargs_for("galli_cnn", mnist) == {}
    assert models.kwargs_for("two_layer_nn", mnist) == {"input_dim": 784, "classes": 10}
    assert models.count_params(models.for_dataset(mnist)) == 551_322
    flat = NS(name="mnist", input_shape=(784,), num_classes=10, task="classification")
    assert models.default_model_name(flat) == "mlp"
    ae = NS(name="fashion_mnist", input_shape=(1, 28, 28), num_classes=None, task="reconstruction")
    assert models.count_params(models.for_dataset(ae)) == 48_705
    news = NS(name="ag_news", input_shape=(750,), num_classes=4, task="classification")
    assert models.count_params(models.for_dataset(news)) == 113_156
    adult = NS(name="adult", input_shape=(105,), num_classes=2, task="classification")
    m = models.for_dataset(adult, hidden=10)
    assert models.count_params(m) == 106 * 10 + 11 * 2
    other = NS(name="x", input_shape=(1, 8, 8), num_classes=10, task="classification")
    assert models.default_model_name(other) == "mlp"
    assert models.for_dataset(other)(torch.rand(2, 1, 8, 8)).shape == (2, 10)
