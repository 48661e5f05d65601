"""What ``dptune train`` trains: the data (a built-in dataset, or your ``pkg.module:loader``) and the
model (a built-in by name, ``auto``, or your ``pkg.module:factory``), loaded, built and checked to fit."""

from __future__ import annotations

import math
from typing import Any

import torch

from dptune import data as dpdata
from dptune import factories, models, own
from dptune.deliverable import factory_identity
from dptune.errors import ConfigError


def load_train_inputs(data: str | None, dataset: str, model: str, data_dir: str | None, seed: int) -> tuple[Any, ...]:
    """(train, test, the model built at ``seed``, how ``load_model`` rebuilds it) of ``dptune train``'s
    options; the user's code is imported first: a wrong path is one clear error before any data is read."""
    yours = factories.is_factory_path(model)
    if yours:
        factories.import_factory(model, "--model")
    if data is not None:
        factories.import_factory(data, "--data")
        if not yours:
            raise ConfigError("--data needs your own model too: --model pkg.module:factory.")
        train_part, test_part = own.load_data(data)
        dims = own.data_shape(train_part)
    else:
        ds = dpdata.load(dataset, data_dir=data_dir, seed=seed)
        train_part, test_part = (ds.x_train, ds.y_train), (ds.x_test, ds.y_test)
        dims = (math.prod(ds.input_shape), ds.num_classes)
    torch.manual_seed(seed)
    if yours:  # with the arguments the factory was given, for load_model
        net, ident = own.build_model(model, *dims), factory_identity(model, *dims)
    else:
        name = models.default_model_name(ds) if model == "auto" else model
        ident = {"name": name, "kwargs": models.kwargs_for(name, ds)}
        net = models.build(name, **ident["kwargs"])
    models.check_fits_data(net, train_part, model, data or dataset, data is None)
    return train_part, test_part, net, ident
