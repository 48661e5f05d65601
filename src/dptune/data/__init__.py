"""Datasets used by the papers dptune reproduces, with verified files and documented preprocessing.

>>> from dptune import data
>>> ds = data.load("mnist")                  # $DPTUNE_DATA_DIR/mnist/... or download + cache
>>> ds.x_train.shape, ds.y_train.dtype
(torch.Size([60000, 1, 28, 28]), torch.int64)

See ``docs/data_and_models.md`` for sources, checksums, preprocessing and caveats.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from dptune.data.dataset import Dataset, Task
from dptune.data.files import cache_root, data_root
from dptune.data.loaders import LOADERS, Context
from dptune.data.registry import DATASETS, DatasetSpec, FileSpec
from dptune.errors import ConfigError

__all__ = [
    "DATASETS",
    "Dataset",
    "DatasetSpec",
    "FileSpec",
    "Task",
    "available",
    "cache_root",
    "data_root",
    "load",
    "options",
]


def available() -> list[str]:
    """Names accepted by :func:`load`, sorted."""
    return sorted(LOADERS)


def options(name: str) -> dict[str, Any]:
    """The dataset-specific keyword options of ``load(name, ...)`` and their defaults."""
    loader = _loader(name)
    params = inspect.signature(loader).parameters
    out = {k: p.default for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return {"verify": True, **out}


def _loader(name: str) -> Any:
    try:
        return LOADERS[name]
    except KeyError:
        raise ConfigError(
            f"unknown dataset {name!r}. Fix: choose one of the available datasets: {', '.join(available())} "
            "(for Galli's autoencoder task: load('fashion_mnist', task='reconstruction')), or pass your own "
            "data (docs/your_data.md)."
        ) from None


def load(
    name: str,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    **opts: Any,
) -> Dataset:
    """Load dataset ``name`` as float32 features and int64 labels.

    Files are read from ``data_dir`` (else ``$DPTUNE_DATA_DIR``) in the layout of the
    shared data folder (``<data_dir>/<name>/...``), else from the cache (``cache_dir``,
    else ``$DPTUNE_CACHE``, else ``~/.cache/dptune``), else downloaded there from the
    canonical URLs. Every file's SHA-256 is verified (``verify=False`` skips it).
    ``seed`` fixes every random split and subset. Dataset-specific options: see
    :func:`options` and ``docs/data_and_models.md``.

    Raises ``dptune.errors.DataError`` for missing, unreachable or corrupted files and
    ``dptune.errors.ConfigError`` for bad options.
    """
    loader = _loader(name)
    verify = bool(opts.pop("verify", True))
    accepted = options(name)
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise ConfigError(
            f"load({name!r}) got unknown option(s) {unknown}; accepted: "
            + ", ".join(f"{k}={v!r}" for k, v in accepted.items())
        )
    ctx = Context(data_dir=data_dir, cache_dir=cache_dir, seed=int(seed), verify=verify)
    return loader(ctx, **opts)
