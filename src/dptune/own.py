"""Your own data, loss and code: map-style datasets read by index (``MapSource``: each example collated
alone, so no example changes another's row: docs/your_data.md, "The collate contract"), DataLoaders
(``from_dataloader``: Poisson sampling replaces their sampler), the per-example loss contract
(``user_loss``, ``check_loss``) and the user's data and model factories (``load_data``, ``build_model``)."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.func import functional_call
from torch.utils import _pytree

from dptune import inputs, metrics
from dptune.errors import OWNER, OWNER_ERROR, ConfigError
from dptune.factories import call_factory, import_factory
from dptune.gradients.persample import ScratchBuffers, check_model


# ----------------------------------------------------------------------------- data
def is_map_style(data: Any) -> bool:
    # A dict has __len__/__getitem__ but is indexed by keys, not positions; an IterableDataset's __getitem__ raises.
    plain = not isinstance(data, str | bytes | Mapping | torch.utils.data.IterableDataset)
    return hasattr(data, "__len__") and hasattr(data, "__getitem__") and plain


class MapSource:
    """Examples of a map-style dataset gathered by index into (x, y) batches (x may be a tuple/dict of tensors)."""

    def __init__(self, dataset: Any, device: torch.device, collate_fn: Callable[[list], Any] | None = None):
        from torch.utils.data import default_collate

        self.dataset, self.device = dataset, device
        self.collate = collate_fn or getattr(dataset, "collate_fn", None) or default_collate  # a study's too (review)
        self.n = len(dataset)
        if self.n < 1:
            raise ConfigError("the dataset is empty. Fix: pass at least one example.")
        first = dataset[0]
        if not isinstance(first, tuple | list) or len(first) != 2:
            raise ConfigError(
                f"each item of the dataset must be an (x, y) pair, got {type(first).__name__}. "
                "Fix: make __getitem__ return (input, target)."
            )
        x0, y0 = self.collate([first])
        if not isinstance(y0, torch.Tensor):
            raise ConfigError(
                f"the collated targets y must be a tensor, got {type(y0).__name__}. Fix: make "
                "__getitem__ return (input, target) with a tensor (or number) target."
            )
        x0 = inputs.check(x0, "the collated input x")
        # An empty Poisson batch (possible at small q) keeps the shapes and dtypes of a real one;
        # also how callers learn the input's shape without loading a batch.
        self.empty_batch = (inputs.to(inputs.rows(x0, 0, 0), device), y0[:0].to(device))

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate

        if idx.numel() == 0:
            return self.empty_batch
        items = self._read(idx.tolist())
        # A collate_fn never sees two examples, so none can change another's row; default_collate
        # only stacks, row by row (one call, as fast as ever). Only the stacking is guarded below:
        # an error of your collate_fn itself stays yours.
        start = None if self.collate is default_collate else _rng_states()  # replayed for the check below
        rows = None if start is None else [self.collate([item]) for item in items]
        try:
            if rows is None:
                x, y = default_collate(items)
            else:
                x, y = inputs.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        except RuntimeError:  # torch.stack / torch.cat: rows of different shapes
            raise ConfigError(
                "the examples have different shapes once collated one at a time (a collate_fn that pads "
                "to the batch's longest example?). dptune collates each example alone, so that no example "
                "changes another's input. Fix: pad (or truncate) to a fixed, public length, e.g. a "
                'tokenizer\'s padding="max_length", max_length=....'
            ) from None
        x = inputs.check(x)
        if inputs.batch_len(x) != len(items) or y.shape[:1] != (len(items),):
            raise ConfigError("collate_fn([item]) must give one row per example. Fix: return it stacked, [1, ...].")
        if rows and start and len(rows) > 1 and not _same_rows(_again(self.collate, items[0], start), rows[0]):
            raise ConfigError(  # a running standardiser moved every row with the others (14.6·C in review)
                "your collate_fn gave the first example of the batch another result when called again after the "
                "others: it keeps state from one example to the next. Fix: make it a function of its example alone."
            )
        return inputs.to(x, self.device), y.to(self.device)

    def _read(self, idx: list[int], copy: bool = False) -> list[Any]:
        """The examples ``idx``; read again, each copied as read, where two share a buffer: a ``__getitem__`` that
        reuses one output tensor gave every row the batch's last example (18.4·C in review)."""
        try:
            items = [_copied(self.dataset[i]) if copy else self.dataset[i] for i in idx]
        except IndexError as exc:
            raise ConfigError(f"reading an example failed ({exc!r}{OWNER_ERROR}) although len() is {self.n}. Fix: "
                              "make len() the number of examples __getitem__ can read.") from None  # fmt: skip
        at = [{a for v in _leaves(it) if (a := _address(v))} for it in items]  # one item may share within itself
        return items if copy or len(set().union(*at)) == sum(map(len, at)) else self._read(idx, copy=True)

    def chunks(self, size: int | None = None):
        size = size or metrics.EVAL_BATCH
        for i in range(0, self.n, size):
            yield self.batch(torch.arange(i, min(i + size, self.n)))


def _leaves(item: Any) -> list[Any]:  # an (x, y) pair of tensors without the pytree walk (a third of a batch's read)
    flat = isinstance(item, tuple) and not any(isinstance(v, tuple | list | dict) for v in item)
    return list(item) if flat else _pytree.tree_leaves(item)


def _address(v: Any) -> int | None:
    if isinstance(v, torch.Tensor):
        with contextlib.suppress(RuntimeError):  # a sparse tensor has no data pointer
            return v.data_ptr() or None
        return None
    return v.ctypes.data if isinstance(v, np.ndarray) and v.size else None


def _copied(item: Any) -> Any:
    return _pytree.tree_map(
        lambda v: v.clone() if torch.is_tensor(v) else np.copy(v) if isinstance(v, np.ndarray) else v, item
    )


def tensors_of(dataset: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x, y) of a ``TensorDataset`` of two tensors (the in-memory fast path), else None."""
    from torch.utils.data import TensorDataset

    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0], dataset.tensors[1]
    return None


def materialize(dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """All of a map-style dataset as an (x, y) tensor pair (studies hash and split examples)."""
    if (fast := tensors_of(dataset)) is not None:
        return fast
    src = MapSource(dataset, torch.device("cpu"))
    xs, ys = zip(*src.chunks(), strict=True)
    return inputs.cat(list(xs)), torch.cat(ys)


def from_dataloader(loader: Any) -> Any:
    """The dataset behind a ``DataLoader``, for ``dptune.train``: its sampler, shuffling and batch size
    are replaced by Poisson sampling at q = expected_batch_size / n (the accountant's assumption; a shuffled
    fixed-size batch is a weaker mechanism); a non-default ``collate_fn`` is kept, applied to each example."""
    from torch.utils.data import DataLoader, default_collate

    if not isinstance(loader, DataLoader):
        raise ConfigError(f"from_dataloader needs a torch DataLoader, got {type(loader).__name__}.")
    if not is_map_style(loader.dataset):
        raise ConfigError(
            "the DataLoader's dataset is iterable-style: Poisson sampling needs random access. "
            "Fix: use a map-style dataset (__len__ and __getitem__)."
        )
    collate = getattr(loader, "collate_fn", None)
    if collate is None or collate is default_collate or getattr(collate, "__name__", "") == "default_collate":
        return loader.dataset
    return CollatedDataset(loader.dataset, collate)


@dataclass(frozen=True)
class CollatedDataset:
    """A map-style dataset with its own ``collate_fn`` (kept from a DataLoader)."""

    dataset: Any
    collate_fn: Callable[[list], Any]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]


# ----------------------------------------------------------------------------- loss and metric
def _rng_states(state: tuple | None = None) -> tuple:
    """torch's (CPU), numpy's and random's global states; installs ``state`` if given."""
    now = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    if state is not None:
        torch.set_rng_state(state[0])
        np.random.set_state(state[1])
        random.setstate(state[2])
    return now


def _again(collate: Callable[[list], Any], item: Any, start: tuple) -> Any:
    """``collate([item])`` again from the random states it first ran from (an augmenting collate is no state)."""
    end = _rng_states(start)
    try:
        return collate([item])
    finally:
        _rng_states(end)


def _same_rows(a: Any, b: Any) -> bool:
    """Two collated (x, y) pairs hold equal tensors (NaN equal to NaN)."""
    ta, tb = [*inputs.leaves(a[0]), a[1]], [*inputs.leaves(b[0]), b[1]]
    same = [u.isnan().equal(v.isnan()) and u.nan_to_num().equal(v.nan_to_num()) for u, v in zip(ta, tb, strict=False)]
    return len(ta) == len(tb) and all(same)


def user_loss(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A batched user loss ``fn(out [B, ...], y [B, ...]) -> [B]`` as the per-example loss the oracles differentiate:
    always called on one example (a batch of one, vmapped), never on the batch, where a batch-level branch (a
    NaN guard on the whole batch, a threshold) let one example move the others' losses past any probe (9·C–59·C
    in review)."""

    def one(out: Any, y: torch.Tensor) -> torch.Tensor:  # ``out``: a tensor, or a structure of them (a ModelOutput)
        row: Any = inputs.tmap(lambda t: t.unsqueeze(0), out)
        return fn(row, y.unsqueeze(0)).reshape(())

    return one


def check_classes(model: torch.nn.Module, x: Any, y: torch.Tensor | None, loss: str = "cross_entropy") -> None:
    """A built-in loss gets a tensor, and cross-entropy labels are below the model's output count (one forward, scratch
    buffers; ``y``: every label, or None): one clear error, not a mid-run torch error."""
    check_model(model)  # on a public dummy (zeros): your forward may keep state from what it sees (found in review)
    args, kwargs = inputs.args_kwargs(inputs.dummy(x))
    try:
        with torch.no_grad(), ScratchBuffers(model)() as buffers:
            out = functional_call(model, buffers, args, kwargs)
    except Exception:  # noqa: BLE001 - a buffer write (refused where it trains), a dummy outside the domain: skipped
        return
    if not isinstance(out, torch.Tensor):  # a Hugging Face ModelOutput (found in review: a traceback on every path)
        raise ConfigError(
            f"the model returns a {type(out).__name__}, not a tensor: the built-in loss {loss!r} needs one. Fix: "
            "return the logits from forward (e.g. a module returning `model(**x).logits`, or "
            "dptune.finetune.hf_classifier), or pass loss=fn taking your model's output."
        )
    if loss != "cross_entropy" or y is None or not y.numel() or y.dtype.is_floating_point:
        return
    top = int(y.max())
    if isinstance(out, torch.Tensor) and out.ndim >= 2 and top >= out.shape[1]:
        raise ConfigError(
            f"data: class label {top}{OWNER} but the model has {out.shape[1]} outputs (classes 0..{out.shape[1] - 1}). "
            f"Fix: build the model with {top + 1} classes (or more), or map the labels to 0..{out.shape[1] - 1}."
        )


def check_loss(fn: Callable, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """``fn(model(x), y)`` has shape [B] on a tiny batch, run on scratch buffers (no statistics kept)."""
    check_model(model)
    b = min(2, int(y.shape[0]))
    args, kwargs = inputs.args_kwargs(inputs.dummy(x, b))  # public, as above
    try:
        with torch.no_grad(), ScratchBuffers(model)() as buffers:
            out = fn(inputs.tmap(lambda t: t, functional_call(model, buffers, args, kwargs)), inputs.dummy(y, b))
    except Exception:  # noqa: BLE001 - a dummy outside your forward's domain: the check is skipped
        return
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (b,):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"the loss must return one value per example (shape [{b}] for a batch of {b}), got {got}. Fix: use "
            "reduction='none' and average over the other dimensions, e.g. F.cross_entropy(out, y, reduction='none')."
        )


# ----------------------------------------------------------------------------- data factories
def load_data(path: str, options: dict[str, Any] | None = None) -> tuple[Any, Any, int | None]:
    """Call the data factory ``path`` and return ``(train, test, classes)``: the parts as given (contract:
    docs/your_data.md) and a ``dptune.data.Dataset``'s declared class count (else None: read from the labels)."""
    out = call_factory(import_factory(path, "data factory"), path, "data factory", **dict(options or {}))
    if hasattr(out, "x_train"):
        test = (out.x_test, out.y_test) if getattr(out, "x_test", None) is not None else None
        return (out.x_train, out.y_train), test, getattr(out, "num_classes", None)
    if isinstance(out, tuple | list) and len(out) == 4 and all(isinstance(t, torch.Tensor) for t in out):
        return (out[0], out[1]), (out[2], out[3]), None
    if isinstance(out, tuple | list) and len(out) == 2 and not isinstance(out[0], torch.Tensor):
        train, test = out
        for part, v in (("train", train), ("test", test)):
            if v is not None and not is_map_style(v):
                raise ConfigError(
                    f"data factory {path!r}: its {part} part is a {type(v).__name__}. Fix: return "
                    "map-style datasets or (x, y) tensor pairs."
                )
        return train, test, None
    raise ConfigError(
        f"data factory {path!r} returned a {type(out).__name__}. Fix: return (train, test) "
        "datasets, (x_train, y_train, x_test, y_test) tensors or a dptune.data.Dataset."
    )


def as_pair(part: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An (x, y) tensor pair from a pair or a map-style dataset (read fully into memory)."""
    if isinstance(part, tuple | list) and len(part) == 2 and all(isinstance(t, torch.Tensor) for t in part):
        return part[0], part[1]
    if isinstance(part, tuple | list) and len(part) == 2 and inputs.is_structured(part[0]):
        return part[0], torch.as_tensor(part[1])  # several inputs: the caller decides
    return materialize(part)


def factory_kwargs(
    fn: Callable[..., Any], input_dim: int | None, classes: int | None, options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``options`` plus ``input_dim``/``classes`` where ``fn`` takes them and they are known (build and reload)."""
    import inspect

    kwargs = dict(options or {})
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    known = {"input_dim": input_dim, "classes": classes}
    return kwargs | {k: int(v) for k, v in known.items() if k in params and k not in kwargs and v is not None}


def build_model(path: str, input_dim: int | None, classes: int | None, **options: Any) -> torch.nn.Module:
    """``factory(**options)``, given ``input_dim``/``classes`` when it takes them and they are known."""
    fn = import_factory(path, "model factory")
    net = call_factory(fn, path, "model factory", **factory_kwargs(fn, input_dim, classes, options))
    if not isinstance(net, torch.nn.Module):
        raise ConfigError(f"model factory {path!r} returned a {type(net).__name__}, not a torch nn.Module.")
    return net


def data_shape(train: Any) -> tuple[int | None, int | None]:
    """(input_dim, classes) of a training part: classes only for in-memory targets, input_dim None for tuple/dict x."""
    pair = isinstance(train, tuple | list) and len(train) == 2
    if pair and (isinstance(train[0], torch.Tensor) or inputs.is_structured(train[0])):
        x, y = train[0], torch.as_tensor(train[1])
    else:
        fast = tensors_of(train)
        if fast is None:
            x0, _ = MapSource(train, torch.device("cpu")).empty_batch
            return (None if not isinstance(x0, torch.Tensor) else math.prod(x0.shape[1:])), None
        x, y = fast
    classes = int(y.max()) + 1 if not y.dtype.is_floating_point and y.numel() else None
    return (math.prod(x.shape[1:]) if isinstance(x, torch.Tensor) else None), classes
