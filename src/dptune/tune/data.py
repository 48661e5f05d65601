"""Materialise a study's data and model, identically in the coordinator and in every worker.

The coordinator only needs sizes (to plan q and T); a worker needs the tensors. Both
call ``study_data``, which is a pure function of the ``DataSpec`` and the study seed
(the holdout split is seeded), cached per process so a pool worker loads it once.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from dptune.errors import ConfigError
from dptune.sampling import stream_seed
from dptune.tune.spec import DataSpec, ModelSpec, SelectionSpec


@dataclass(frozen=True)
class StudyData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor  # the selection split (test split, or a holdout carved from train)
    y_val: torch.Tensor
    x_test: torch.Tensor | None  # reported separately when the selection split is a holdout
    y_test: torch.Tensor | None
    task: str  # classification | reconstruction
    num_classes: int | None
    input_shape: tuple[int, ...]

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def n_val(self) -> int:
        return int(self.x_val.shape[0])


_CACHE: dict[str, StudyData] = {}


def _key(spec: DataSpec, selection: SelectionSpec, study_seed: int) -> str:
    return json.dumps([spec.describe(), selection.split, selection.holdout_fraction, study_seed],
                      sort_keys=True, default=str)


def study_data(spec: DataSpec, selection: SelectionSpec, study_seed: int) -> StudyData:
    key = _key(spec, selection, study_seed)
    if key in _CACHE:
        return _CACHE[key]
    if spec.tensors is not None:
        x_tr, y_tr, x_te, y_te = spec.tensors
        recon = x_tr.shape == y_tr.shape and x_tr.dtype.is_floating_point and y_tr.dtype.is_floating_point
        task = "reconstruction" if recon else "classification"
        num_classes = None if recon else int(torch.max(torch.cat([y_tr.reshape(-1), y_te.reshape(-1)])).item()) + 1
        input_shape = tuple(x_tr.shape[1:])
    else:
        from dptune import data as _data

        ds = _data.load(spec.name, seed=study_seed, **dict(spec.options))
        x_tr, y_tr, x_te, y_te = ds.x_train, ds.y_train, ds.x_test, ds.y_test
        task, num_classes, input_shape = ds.task, ds.num_classes, tuple(ds.input_shape)
    if selection.split == "holdout":
        n = int(x_tr.shape[0])
        m = int(round(selection.holdout_fraction * n))
        if m < 1 or m >= n:
            raise ConfigError(
                f"selection.holdout_fraction = {selection.holdout_fraction} leaves {n - m} training and {m} "
                f"holdout examples out of {n}. Fix: pick a fraction that keeps both non-empty."
            )
        g = torch.Generator().manual_seed(stream_seed(study_seed, "holdout"))
        perm = torch.randperm(n, generator=g)
        val_idx, tr_idx = perm[:m].sort().values, perm[m:].sort().values
        same = x_tr is y_tr
        out = StudyData(x_tr[tr_idx], (x_tr[tr_idx] if same else y_tr[tr_idx]), x_tr[val_idx],
                        (x_tr[val_idx] if same else y_tr[val_idx]), x_te, y_te, task, num_classes, input_shape)
    else:
        out = StudyData(x_tr, y_tr, x_te, y_te, None, None, task, num_classes, input_shape)
    if out.n_val == 0:
        raise ConfigError("the selection split is empty. Fix: use selection.split = 'holdout' or a dataset with a test split.")
    _CACHE[key] = out
    return out


def build_model(spec: ModelSpec, data: StudyData, seed: int) -> torch.nn.Module:
    """``torch.manual_seed(seed)`` then build: the initial weights are a function of the seed."""
    opts: dict[str, Any] = dict(spec.options)
    if spec.builder is not None:
        ctor = spec.builder
    else:
        from dptune.models import MODELS

        ctor = MODELS[spec.name]
        params = inspect.signature(ctor).parameters
        if "input_dim" in params and "input_dim" not in opts:
            opts["input_dim"] = math.prod(data.input_shape)
        if "classes" in params and "classes" not in opts and data.num_classes is not None:
            opts["classes"] = data.num_classes
    torch.manual_seed(int(seed))
    try:
        return ctor(**opts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model: building {spec.describe()} failed ({exc}). Fix model.options.") from exc
