"""Materialise a study's data and model, identically in the coordinator and every worker; ``study_data``
is a pure function of the ``DataSpec`` and seed, cached per process."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dptune import data as datasets
from dptune.errors import ConfigError
from dptune.factories import call_factory, import_factory
from dptune.inputs import Inputs, leaves, rows, take
from dptune.models import MODELS
from dptune.own import as_pair, factory_kwargs, load_data
from dptune.release.sampling import stream_seed
from dptune.task import check_labels
from dptune.tune.spec import DataSpec, ModelSpec, SelectionSpec


@dataclass(frozen=True)
class StudyData:
    x_train: Inputs  # a tensor, or a dict/tuple of tensors (e.g. tokens: dptune.inputs)
    y_train: torch.Tensor
    x_val: Inputs  # the selection split (test split, or a holdout carved from train)
    y_val: torch.Tensor
    x_test: Inputs | None  # reported separately when the selection split is a holdout
    y_test: torch.Tensor | None
    task: str  # classification | reconstruction
    num_classes: int | None
    input_shape: tuple[int, ...]

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def n_val(self) -> int:
        return int(self.y_val.shape[0])

    def digest(self) -> dict[str, str]:
        """Per split, the SHA-256 of its rows as a multiset (their order is free), with names, shapes and dtypes. The
        test split too, where separate: a resume mixing two test sets printed a mean of both (found in review)."""
        out = {}
        splits: list[tuple[str, Any, torch.Tensor]] = [
            ("training", self.x_train, self.y_train),
            ("validation", self.x_val, self.y_val),
        ]
        for split, x, y in splits + (
            [("test", self.x_test, self.y_test)] if self.y_test is not None and len(self.y_test) else []
        ):
            rows, head = [hashlib.sha256() for _ in range(int(y.shape[0]))], hashlib.sha256()
            for name, t in [("y", y), *(x.items() if isinstance(x, dict) else enumerate(leaves(x)))]:
                head.update(repr((name, tuple(t.shape), str(t.dtype))).encode())
                flat = t.detach().cpu().contiguous().view(torch.uint8).reshape(len(rows), -1).numpy()
                for h, row in zip(rows, flat, strict=True):
                    h.update(row)  # type: ignore[arg-type]
            head.update(b"".join(sorted(h.digest() for h in rows)))
            out[split] = head.hexdigest()
        return out


_CACHE: dict[str, StudyData] = {}


def forget_cached(y_train: torch.Tensor) -> None:
    """Drop the cached study data with training labels ``y_train`` (the audit's single-use datasets)."""
    for key in [k for k, v in _CACHE.items() if v.y_train is y_train]:
        _CACHE.pop(key, None)


def _rows(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    a = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()  # numpy has no bfloat16
    return a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(-1, 1)


def holdout_mask(x: Inputs, y: torch.Tensor | None, fraction: float, study_seed: int) -> torch.Tensor:
    """Bool [n]: example i is in the holdout iff BLAKE2b(key, bytes of x_i and y_i) / 2⁶⁴ < fraction: a
    function of the example alone, so neighbouring datasets give neighbouring training sets OR holdouts."""
    key = stream_seed(study_seed, "holdout").to_bytes(8, "little")
    xs = _rows(x) if isinstance(x, torch.Tensor) else np.concatenate([_rows(t).view(np.uint8) for t in leaves(x)], 1)
    ys = None if y is None else _rows(y)
    limit = int(fraction * 2.0**64)
    out = np.empty(xs.shape[0], dtype=bool)
    for i in range(xs.shape[0]):
        h = hashlib.blake2b(xs[i].tobytes(), digest_size=8, key=key)
        if ys is not None:
            h.update(ys[i].tobytes())
        out[i] = int.from_bytes(h.digest(), "little") < limit
    return torch.from_numpy(out)


def study_data(spec: DataSpec, selection: SelectionSpec, study_seed: int) -> StudyData:
    key = json.dumps(
        [spec.describe(), selection.split, selection.holdout_fraction, study_seed], sort_keys=True, default=str
    )
    if key in _CACHE:
        return _CACHE[key]
    x_tr: Inputs
    x_te: Inputs
    declared = None  # a Dataset's class count (a CSV's declared labels), else read from the labels
    if spec.factory is not None:
        # The user's loader, read into memory: the holdout split hashes each example.
        train, test, declared = load_data(spec.factory, dict(spec.options))
        (x_tr, y_tr) = as_pair(train)
        x_te, y_te = as_pair(test) if test is not None else (rows(x_tr, 0, 0), y_tr[:0])
    if spec.tensors is not None:
        x_tr, y_tr, x_te, y_te = spec.tensors
    if spec.tensors is not None or spec.factory is not None:
        recon = isinstance(x_tr, torch.Tensor) and x_tr.shape == y_tr.shape and x_tr.dtype.is_floating_point
        recon = recon and y_tr.dtype.is_floating_point
        task = "reconstruction" if recon else "classification"
        check_labels(y_tr, "mse" if recon else "cross_entropy", int(y_tr.shape[0]), "data (training split)")
        labels = torch.cat([y_tr.reshape(-1), y_te.reshape(-1)])
        num_classes = None if recon else declared or int(torch.max(labels).item()) + 1
        input_shape = tuple(leaves(x_tr)[0].shape[1:])
    else:
        ds = datasets.load(spec.name, seed=study_seed, **dict(spec.options))
        x_tr, y_tr, x_te, y_te = ds.x_train, ds.y_train, ds.x_test, ds.y_test
        task, num_classes, input_shape = ds.task, ds.num_classes, tuple(ds.input_shape)
    if selection.split == "holdout":
        n = int(y_tr.shape[0])
        same = x_tr is y_tr
        mask = holdout_mask(x_tr, None if same else y_tr, selection.holdout_fraction, study_seed)
        m = int(mask.sum())
        if m < 1 or m >= n:
            raise ConfigError(
                f"selection.holdout_fraction = {selection.holdout_fraction} leaves {n - m} training and {m} "
                f"holdout examples out of {n}. Fix: pick a fraction that keeps both non-empty."
            )
        val_idx, tr_idx = torch.nonzero(mask).reshape(-1), torch.nonzero(~mask).reshape(-1)
        x_val, y_val = take(x_tr, val_idx), y_tr[val_idx]  # y is x when same
        x_tr, y_tr = take(x_tr, tr_idx), y_tr[tr_idx]
        out = StudyData(x_tr, y_tr, x_val, y_val, x_te, y_te, task, num_classes, input_shape)
    else:
        out = StudyData(x_tr, y_tr, x_te, y_te, None, None, task, num_classes, input_shape)
    if out.n_val == 0:
        raise ConfigError(
            "the selection split is empty. Fix: use selection.split = 'holdout' or a dataset with a test split."
        )
    _CACHE[key] = out
    return out


def build_model(spec: ModelSpec, data: StudyData, seed: int) -> torch.nn.Module:
    """``torch.manual_seed(seed)`` then build: the initial weights are a function of the seed."""
    opts: dict[str, Any] = dict(spec.options)
    if spec.builder is not None:
        ctor = spec.builder
    else:
        # A factory is imported in this process (every executor's worker): its module must be on the path.
        ctor = import_factory(spec.factory, "model.factory") if spec.factory is not None else MODELS[spec.name]
        opts = factory_kwargs(ctor, math.prod(data.input_shape), data.num_classes, opts)
    torch.manual_seed(int(seed))
    if spec.factory is not None:
        return call_factory(ctor, spec.factory, "model factory", **opts)
    try:
        return ctor(**opts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model: building {spec.describe()} failed ({exc}). Fix model.options.") from exc
