"""Model constructors of the reproduced papers (no BatchNorm anywhere: DP-SGD needs per-example gradients, which batch
statistics would make undefined): galli_cnn, galli_autoencoder, galli_bow_fc (Galli et al. 2024, Tables 5–7),
logistic_regression and two_layer_nn (Mohapatra et al. 2022), linear_probe (Panda et al. 2024), mlp (benchmarks),
hf_classifier (``finetune``); their parameters and the choices the papers leave open: docs/data_and_models.md.
``kwargs_for(name, ds)`` fills ``input_dim`` / ``classes`` from a dataset; ``for_dataset(ds)`` builds a dataset's
default model; ``for_training`` what ``dptune train`` names, checked."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dptune import inputs
from dptune.errors import OWNER, OWNER_ERROR, ConfigError
from dptune.finetune import hf_classifier, token_options

GALLI_CNN_PARAMS = 551_322
GALLI_AUTOENCODER_PARAMS = 48_705
GALLI_BOW_FC_PARAMS = 113_156  # with input_dim=750


def count_params(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) scalar parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _positive(**values: int) -> None:
    for k, v in values.items():
        if int(v) < 1:
            raise ConfigError(f"{k}={v!r} must be a positive integer.")


def galli_cnn(final_relu: bool = False) -> nn.Sequential:
    """Galli et al. (2024) MNIST CNN, appendix Table 5: 551,322 parameters, input [B, 1, 28, 28].

    Table 5's ReLU after the last layer is off by default (``final_relu``): the outputs are logits for cross-entropy.
    The inferred padding: docs/data_and_models.md."""
    layers: list[nn.Module] = [
        nn.Conv2d(1, 16, kernel_size=8, stride=1, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=1),
        nn.Conv2d(16, 32, kernel_size=4, stride=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 23 * 23, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    ]
    if final_relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class GalliAutoencoder(nn.Module):
    """Galli et al. (2024) Fashion-MNIST convolutional autoencoder, Table 6: 48,705 params.

    Four 3×3 convolutions 1→8→16→32→64 and four transposed ones back, stride 1, padding 0 (inferred:
    docs/data_and_models.md), LeakyReLU between, a Sigmoid last (outputs in [0, 1] like the input). Train with MSE
    against the input."""

    def __init__(self) -> None:
        super().__init__()
        pairs = [(1, 8), (8, 16), (16, 32), (32, 64)]
        self.encoder = nn.Sequential(*[m for a, b in pairs for m in (nn.Conv2d(a, b, 3, stride=1), nn.LeakyReLU())])
        dec = [m for b, a in pairs[::-1] for m in (nn.ConvTranspose2d(a, b, 3, stride=1), nn.LeakyReLU())]
        self.decoder = nn.Sequential(*dec[:-1], nn.Sigmoid())

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.decoder(self.encoder(x))


def galli_autoencoder() -> GalliAutoencoder:
    """See :class:`GalliAutoencoder` (48,705 parameters)."""
    return GalliAutoencoder()


def galli_bow_fc(
    input_dim: int = 750, hidden: int = 128, classes: int = 4, final_activation: bool = False
) -> nn.Sequential:
    """Galli et al. (2024) AG News bag-of-words FC network, Table 7: input_dim→128→128→4, LeakyReLU.

    ``input_dim=750`` reproduces the published 113,156 parameters, the text's data has 1,250 (docs/data_and_models.md).
    Table 7's LeakyReLU after the output layer is off by default (logits)."""
    _positive(input_dim=input_dim, hidden=hidden, classes=classes)
    layers: list[nn.Module] = [
        nn.Flatten(),
        nn.Linear(input_dim, hidden),
        nn.LeakyReLU(),
        nn.Linear(hidden, hidden),
        nn.LeakyReLU(),
        nn.Linear(hidden, classes),
    ]
    if final_activation:
        layers.append(nn.LeakyReLU())
    return nn.Sequential(*layers)


def logistic_regression(input_dim: int, classes: int = 2) -> nn.Sequential:
    """Mohapatra et al. (2022) LR: one affine layer on flattened inputs (softmax in the loss)."""
    _positive(input_dim=input_dim, classes=classes)
    return nn.Sequential(nn.Flatten(), nn.Linear(input_dim, classes))


def two_layer_nn(input_dim: int, hidden: int = 100, classes: int = 2) -> nn.Sequential:
    """Mohapatra et al. (2022) TLNN: Linear(d→hidden) + ReLU → Linear(hidden→classes); hidden 100 is ours."""
    _positive(input_dim=input_dim, hidden=hidden, classes=classes)
    return nn.Sequential(nn.Flatten(), nn.Linear(input_dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def linear_probe(input_dim: int, classes: int, zero_init: bool = True, bias: bool = False) -> nn.Sequential:
    """Panda et al. (2024) linear classifier on fixed features: no bias, zero-initialised."""
    _positive(input_dim=input_dim, classes=classes)
    lin = nn.Linear(input_dim, classes, bias=bias)
    if zero_init:
        nn.init.zeros_(lin.weight)
        if lin.bias is not None:
            nn.init.zeros_(lin.bias)
    return nn.Sequential(nn.Flatten(), lin)


def mlp(input_dim: int = 784, hidden: Sequence[int] = (128, 128), classes: int = 10) -> nn.Sequential:
    """Flatten → [Linear + ReLU] per hidden width → Linear(→classes). For benchmarks."""
    _positive(input_dim=input_dim, classes=classes)
    for h in hidden:
        _positive(hidden=h)
    dims = [input_dim, *hidden]
    layers = [m for d, h in zip(dims, dims[1:], strict=False) for m in (nn.Linear(d, h), nn.ReLU())]
    return nn.Sequential(nn.Flatten(), *layers, nn.Linear(dims[-1], classes))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "galli_cnn": galli_cnn,
    "galli_autoencoder": galli_autoencoder,
    "galli_bow_fc": galli_bow_fc,
    "logistic_regression": logistic_regression,
    "two_layer_nn": two_layer_nn,
    "linear_probe": linear_probe,
    "mlp": mlp,
    "hf_classifier": hf_classifier,
}


def _registered(name: str) -> Callable[..., nn.Module]:
    if name not in MODELS:
        raise ConfigError(
            f"unknown model {name!r}. Fix: choose one of {', '.join(sorted(MODELS))}, or your own pkg.module:factory."
        )
    return MODELS[name]


def build(name: str, **kwargs: object) -> nn.Module:
    """Build a registered model by name, e.g. ``build('two_layer_nn', input_dim=784, classes=10)``."""
    ctor = _registered(name)
    try:
        return ctor(**kwargs)
    except TypeError as exc:
        takes = ", ".join(inspect.signature(ctor).parameters)
        raise ConfigError(f"build({name!r}, ...): {exc}. Fix: {name} takes {takes}.") from exc


# Default model per dataset (the paper's where there is one). Anything else falls back on
# the task: reconstruction of 1x28x28 images -> galli_autoencoder, classification -> mlp.
DEFAULT_MODELS: dict[str, str] = {
    "mnist": "galli_cnn",  # Galli et al.
    "fashion_mnist": "galli_cnn",  # the autoencoder when task='reconstruction'
    "ag_news": "galli_bow_fc",  # Galli et al.; input_dim from the representation
    "adult": "two_layer_nn",  # Mohapatra et al. (TLNN; LR is 'logistic_regression')
    "enron_spam": "two_layer_nn",
    "gisette": "two_layer_nn",
    "digits": "mlp",
    "mnist5k": "mlp",  # a quick stand-in for MNIST on CPU
}


def kwargs_for(name: str, ds: Any) -> dict[str, Any]:
    """``input_dim = prod(ds.input_shape)`` and ``classes = ds.num_classes`` where model ``name`` takes them."""
    from dptune.own import factory_kwargs

    return factory_kwargs(_registered(name), math.prod(tuple(ds.input_shape)), getattr(ds, "num_classes", None))


def default_model_name(ds: Any) -> str:
    """The name ``for_dataset`` would build for ``ds`` (see ``DEFAULT_MODELS``)."""
    shape = tuple(ds.input_shape)
    if getattr(ds, "task", "classification") == "reconstruction":
        if shape == (1, 28, 28):
            return "galli_autoencoder"
        raise ConfigError(
            f"no default model for reconstruction of inputs {shape}; build one yourself "
            "(galli_autoencoder expects [N, 1, 28, 28])."
        )
    name = DEFAULT_MODELS.get(getattr(ds, "name", ""), "mlp")
    if name == "galli_cnn" and shape != (1, 28, 28):  # e.g. flatten=True
        name = "mlp"
    return name


def for_dataset(ds: Any, **overrides: Any) -> nn.Module:
    """Build the default model of a ``dptune.data.Dataset`` with matching input/output sizes."""
    name = default_model_name(ds)
    return build(name, **{**kwargs_for(name, ds), **overrides})


def for_training(
    data: str | None, dataset: str, model: str, data_dir: str | None, seed: int, csv: Any = None, options: Any = None
) -> tuple[Any, Any, nn.Module, dict[str, Any]]:
    """(train, test, model, identity) of ``dptune train``'s options: the data (a built-in ``dataset``, your ``data``
    loader ``pkg.module:fn`` or your ``FILE.csv``: ``load_csv(data, **csv)``) and the model (a built-in, ``auto`` for
    the dataset's default, or your ``pkg.module:factory``), built at ``seed`` and checked to fit; the identity
    (``{"name" or "factory": ..., "kwargs": ...}``) is how ``load_model`` rebuilds it. Your code is imported first:
    a wrong path is one clear error before any data is read."""
    from dptune import data as dpdata
    from dptune import factories, own
    from dptune.data import tabular

    yours, options = factories.is_factory_path(model), dict(options or {})  # options: built-in models' only
    if yours:
        factories.import_factory(model, "--model")
    if data is not None and not data.lower().endswith(".csv"):
        factories.import_factory(data, "--data")
        if not yours:
            raise ConfigError("--data needs your own model too: --model pkg.module:factory.")
        train_part, test_part, _ = own.load_data(data)
        dims = own.data_shape(train_part)
    else:
        opts = {} if data else token_options(model, dataset)
        if "max_tokens" in options and "representation" in opts:  # hf_classifier: the tokens' public length
            opts["max_tokens"] = options.pop("max_tokens")
        ds = (
            tabular.load_csv(data, **(csv or {}))
            if data
            else dpdata.load(dataset, data_dir=data_dir, seed=seed, **opts)
        )
        train_part, test_part = (ds.x_train, ds.y_train), (ds.x_test, ds.y_test) if ds.n_test else None
        dims = (math.prod(ds.input_shape), ds.num_classes)
    torch.manual_seed(seed)
    if yours:  # with the arguments the factory was given, for load_model
        kwargs = own.factory_kwargs(factories.import_factory(model, "model factory"), *dims)
        net, ident = own.build_model(model, *dims), {"factory": model}
    else:
        name = default_model_name(ds) if model == "auto" else model
        kwargs, ident = {**kwargs_for(name, ds), **options}, {"name": name}
        net = build(name, **kwargs)
    # A model that cannot take the data's inputs: one clear line, not a shape error in the first step.
    pair = train_part if isinstance(train_part, tuple | list) and len(train_part) == 2 else own.tensors_of(train_part)
    if pair is not None:  # else a map-style dataset read by index: its loader decides the shape
        fix = (
            f"choose a model for the inputs of {dataset!r}, e.g. --model auto (the dataset's default); "
            f"built-in models: {', '.join(sorted(MODELS))}."
            if data is None
            else "make your model factory build a model for these inputs (or pick the data it was written for)."
        )
        check_fits(net, pair[0], pair[1], f"--model {model}", fix)
    return train_part, test_part, net, {**ident, "kwargs": kwargs}


def check_fits(model: nn.Module, x: Any, y: Any, what: str, fix: str) -> None:
    """One forward pass on one training example (``x``: a tensor or a tuple/dict of tensors), nothing
    released: a model that cannot take the inputs, or gives too few logits, is one ConfigError naming
    ``fix``, not a shape error mid-run. The global RNG and the train/eval mode are left as they were."""
    x1 = inputs.rows(x, 0, 1)
    shape = tuple(x1.shape[1:]) if isinstance(x1, torch.Tensor) else "several inputs"
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()  # dropout draws nothing
            out = inputs.call(model, x1)
    except Exception as exc:  # any layer's complaint: the model and the data do not fit
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ConfigError(
            f"{what} does not take these inputs (one example: shape {shape}): {first}{OWNER_ERROR}. Fix: {fix}"
        ) from None
    finally:
        model.train(was_training)
    y = torch.as_tensor(y)
    if not isinstance(out, torch.Tensor):
        return  # a structured output: the loss decides
    recon = isinstance(x1, torch.Tensor) and x1.shape[1:] == y.shape[1:] and y.dtype.is_floating_point
    if recon and tuple(out.shape) != tuple(x1.shape):
        raise ConfigError(
            f"{what} outputs shape {tuple(out.shape[1:])} for inputs of shape {shape} "
            f"(a reconstruction task needs the input's shape). Fix: {fix}"
        )
    if not recon and not y.dtype.is_floating_point and y.numel():
        classes = int(y.max()) + 1
        if out.ndim != 2 or out.shape[1] < classes:
            raise ConfigError(
                f"{what} outputs shape {tuple(out.shape[1:])} per example, but the labels need "
                f"{classes} logits (classes 0..{classes - 1}{OWNER}). Fix: {fix}"
            )
