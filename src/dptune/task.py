"""A run's task: its data on the device, with the metric and loss they imply. ``OwnTask``: whatever
``train`` and ``make_private`` take (docs/your_data.md); ``resolve_task``: tensors ``train_many`` stacks."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dptune import inputs, metrics, own
from dptune.devices import resolve_device
from dptune.errors import OWNER, ConfigError
from dptune.gradients.oracle import GradientOracle
from dptune.metrics import Metric
from dptune.tree import Tensors


@dataclass(frozen=True)
class TaskTensors:
    """Training/evaluation tensors on the device, with the metric and loss they imply."""

    device: torch.device
    x: torch.Tensor
    y: torch.Tensor
    ex: torch.Tensor | None
    ey: torch.Tensor | None
    metric: Metric
    loss: str


def resolve_task(
    data: Any, eval_data: Any, device: str | torch.device | None, metric: str | Metric | None, loss: str | None
) -> TaskTensors:
    """Move the data to the device; a float target shaped like the input means reconstruction (MSE)."""
    dev = resolve_device(device)  # a named device must exist: never a silent run on the CPU
    x, y = _as_tensors(data, dev)
    recon = isinstance(x, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype and x.dtype.is_floating_point
    m = metrics.resolve(metric, "mse" if recon else "accuracy")
    loss = loss or ("mse" if recon else "cross_entropy")
    check_labels(y, loss, int(y.shape[0]))
    ex, ey = _as_tensors(eval_data, dev) if eval_data is not None else (None, None)
    return TaskTensors(dev, x, y, ex, ey, m, loss)


def check_labels(y: torch.Tensor, loss: Any, n: int, what: str = "data") -> None:
    """Before any training: ``n`` > 0 examples and, for the cross-entropy loss, class labels ``y``
    that are integers 0..C-1 (else torch fails mid-run: "Target -1 is out of bounds", a dtype
    error). A map-style dataset's ``y`` is its empty batch: its dtype is checked."""
    if n == 0:
        raise ConfigError(f"{what} has no examples. Fix: check your loader (did a filter drop every row?).")
    if loss != "cross_entropy":
        return
    # Float targets of several dims may be class probabilities, and -100 is cross_entropy's ignore_index.
    if y.ndim == 1 and (y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool):
        whole = y.dtype.is_floating_point and bool((y == y.round()).all())
        fix = "y.long() (whole numbers stored as floats)" if whole else "loss='mse' for regression targets"
        raise ConfigError(
            f"{what}: class labels must be integers 0..C-1 for the cross-entropy loss, got dtype {y.dtype}. Fix: {fix}."
        )
    bad = y[(y < 0) & (y != -100)] if y.numel() and not y.dtype.is_floating_point else y[:0]
    if bad.numel():
        raise ConfigError(
            f"{what}: class labels must be integers 0..C-1, got {int(bad.min())}{OWNER}. "
            "Fix: map them to 0..C-1 (e.g. y - y.min(): labels -1..1 become 0..2)."
        )


def _as_tensors(data: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(data, Sequence) and len(data) == 2:
        x, y = data
    elif hasattr(data, "x_train"):
        x, y = data.x_train, data.y_train
    elif own.tensors_of(data) is not None:
        x, y = own.tensors_of(data)  # type: ignore[misc]
    else:
        # train_many stacks K trials on in-memory tensors; dptune.train reads any map-style dataset.
        raise ConfigError(
            "data must be a pair (x, y) of tensors, a TensorDataset or a dptune.data.Dataset here (a map-style "
            "dataset works with dptune.train; for train_many, read it into memory with dptune.own.materialize)."
        )
    # x: one tensor, or a tuple/dict of tensors for a model with several inputs (dptune.inputs).
    x = inputs.as_inputs(x)
    y = torch.as_tensor(y)
    if inputs.batch_len(x) != y.shape[0]:
        raise ConfigError(f"x and y have different lengths ({inputs.batch_len(x)} vs {y.shape[0]}).")
    return inputs.to(x, device), y.to(device)


@dataclass(eq=False)
class OwnTask:
    """The run's data and evaluation, whatever the user passed (docs/your_data.md): tensor pairs,
    ``Dataset``s and two-tensor ``TensorDataset``s by ``index_select``, any other map-style dataset
    by index (``own.MapSource``); the same rows for the same Poisson indices, so the same run."""

    device: torch.device
    train: Any
    evald: Any
    metric: Metric
    loss: str | Callable
    user_loss_fn: Callable | None

    @staticmethod
    def _source(data: Any, device: torch.device) -> Any:
        if isinstance(data, DataLoader):
            warnings.warn(
                "dptune uses the DataLoader's dataset only: its sampler, shuffle and batch_size are "
                "replaced by Poisson sampling at q = expected_batch_size / n, which the privacy "
                "accountant assumes (docs/your_data.md).",
                stacklevel=4,
            )
            data = own.from_dataloader(data)
        if (isinstance(data, Sequence) and len(data) == 2) or hasattr(data, "x_train"):
            return _as_tensors(data, device)
        if own.is_map_style(data):
            if (fast := own.tensors_of(data)) is not None:
                return _as_tensors(fast, device)
            return own.MapSource(data, device)
        raise ConfigError(
            "data must be a pair (x, y) of tensors, a map-style dataset (__len__ and __getitem__, "
            "e.g. a torch Dataset), a DataLoader or a dptune.data.Dataset."
        )

    @classmethod
    def resolve(cls, data: Any, eval_data: Any, device: str | torch.device | None, metric: Any, loss: Any) -> OwnTask:
        dev = resolve_device(device)  # a named device must exist: never a silent run on the CPU
        tr = cls._source(data, dev)
        ev = cls._source(eval_data, dev) if eval_data is not None else None
        x, y = tr if isinstance(tr, tuple) else tr.empty_batch
        recon = isinstance(x, torch.Tensor) and x.shape[1:] == y.shape[1:] and x.dtype == y.dtype
        recon = recon and y.dtype.is_floating_point
        m = metrics.resolve(metric, "mse" if recon else "accuracy")
        user_fn = None
        if callable(loss):
            user_fn, loss = loss, own.user_loss(loss)
        elif loss is None:
            loss = "mse" if recon else "cross_entropy"
        task = cls(dev, tr, ev, m, loss, user_fn)
        check_labels(y, loss, task.n)
        if isinstance(ev, tuple):
            check_labels(ev[1], loss, 1, "eval_data")  # an empty evaluation split scores NaN, as before
        return task

    @property
    def n(self) -> int:
        return int(self.train[1].shape[0]) if isinstance(self.train, tuple) else self.train.n

    def digest(self) -> str:
        """SHA-256 of every training row's bytes in order (a map-style dataset read once, by chunks, under a
        fixed torch seed: an augmentation is no difference), for ranks to compare: exact, no float64 copy.
        Every row: two rows swapped outside a sample of them clipped one example twice a step (found in review)."""
        h, n = hashlib.sha256(), self.n
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            chunks = [self.train] if isinstance(self.train, tuple) else (
                self.batch(torch.arange(i, min(i + 4096, n))) for i in range(0, n, 4096)
            )  # fmt: skip
            for x, y in chunks:
                for t in [*inputs.leaves(x), y]:
                    h.update(repr((tuple(t.shape), str(t.dtype))).encode())
                    h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
        return h.hexdigest()

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.train, tuple):
            x, y = self.train
            idx = inputs.indices_to(idx, self.device)
            return inputs.take(x, idx), y.index_select(0, idx)
        return self.train.batch(idx)

    def check_loss(self, model: nn.Module) -> None:
        if self.user_loss_fn is not None:
            own.check_loss(self.user_loss_fn, model, *self.batch(torch.arange(min(2, self.n))))
        else:  # every label in memory: their classes checked too
            x, y = self.train if isinstance(self.train, tuple) else (self.train.empty_batch[0], None)
            own.check_classes(model, x, y, str(self.loss))

    def prepare(
        self, model: nn.Module, chunk_size: int | None = None, method: str | None = None
    ) -> tuple[nn.Module, GradientOracle]:
        """The model on the task's device (its loss checked) and its gradient oracle."""
        model = model.to(self.device)
        self.check_loss(model)
        return model, GradientOracle(model, self.loss, chunk_size=chunk_size, method=method)

    def evaluate(self, oracle: GradientOracle, params: Tensors) -> float:
        # In-memory tensors are sliced, a map-style dataset is read chunk by chunk: the same batches.
        ev = self.evald
        with metrics.eval_mode(oracle.model):
            return metrics.mean_scores(
                partial(oracle.forward, params), ev if isinstance(ev, tuple) else ev.chunks(), self.metric
            )[0]
