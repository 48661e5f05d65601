"""Datasets used by the papers dptune reproduces, with verified files and documented preprocessing
(``data.load("mnist")``); sources, checksums and caveats: ``docs/data_and_models.md``."""

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
    params = inspect.signature(_loader(name)).parameters
    return {"verify": True, **{k: p.default for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}}


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

    Files come from ``data_dir`` (else ``$DPTUNE_DATA_DIR``), else the cache (``cache_dir``, ``$DPTUNE_CACHE``,
    ``~/.cache/dptune``), else are downloaded there; SHA-256 verified unless ``verify=False``. ``seed`` fixes
    every split and subset; options: :func:`options`. Raises ``DataError`` (files) or ``ConfigError``."""
    loader = _loader(name)
    verify = bool(opts.pop("verify", True))
    accepted = options(name)
    if unknown := sorted(set(opts) - set(accepted)):
        raise ConfigError(
            f"load({name!r}) got unknown option(s) {unknown}; accepted: "
            + ", ".join(f"{k}={v!r}" for k, v in accepted.items())
        )
    ctx = Context(data_dir=data_dir, cache_dir=cache_dir, seed=int(seed), verify=verify)
    return loader(ctx, **opts)
