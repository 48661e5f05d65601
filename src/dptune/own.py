"""Your own data, loss, metric and code: map-style datasets, DataLoaders and ``module:factory``.

* ``MapSource``: any map-style dataset (``__len__`` + ``__getitem__``, e.g. a torch
  ``Dataset``) read by index. A Poisson batch is the sorted indices of the sampler; it is
  gathered with ``ds[i]`` and collated (``torch.utils.data.default_collate``), so the data
  need not fit in memory. A ``TensorDataset`` of two tensors takes the in-memory fast path
  (``index_select``), and both give the same batches, hence the same run for a seed.
* ``from_dataloader``: the ``.dataset`` of a ``DataLoader``; its sampler and batch size are
  replaced by Poisson sampling (the accountant's assumption, docs/your_data.md).
* ``Metric`` and ``user_loss``: per-example contracts, checked early on a tiny batch.
* ``import_factory("pkg.module:fn")``: the user's model or data factory, imported with one
  clear error when the path is wrong.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dptune import inputs
from dptune.errors import ConfigError

# The direction of the built-in metrics (``dptune.train`` and the tuner read it from here).
HIGHER_IS_BETTER = {"accuracy": True, "mse": False, "loss": False}


# ----------------------------------------------------------------------------- factories
def import_factory(path: str, what: str = "factory", require_callable: bool = True) -> Any:
    """``"pkg.module:name"`` → the callable ``pkg.module.name`` (dots after ':' walk attributes)."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ConfigError(
            f"{what} {path!r} is not of the form 'pkg.module:function'. Fix: write e.g. "
            "'mypkg.models:build' (the module must be importable: on sys.path or PYTHONPATH)."
        )
    mod_name, attr = path.split(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(
            f"{what} {path!r}: cannot import module {mod_name!r} ({exc}). Fix: install the "
            "package or put its folder on PYTHONPATH (every worker needs it too)."
        ) from None
    except Exception as exc:  # the user's module raised while importing
        raise ConfigError(
            f"{what} {path!r}: importing {mod_name!r} failed ({type(exc).__name__}: {exc}). Fix the module."
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{what} {path!r}: module {mod_name!r} has no attribute {attr!r}. Fix: check the name after ':'."
            )
        obj = getattr(obj, part)
    if require_callable and not callable(obj):
        raise ConfigError(f"{what} {path!r} is not callable. Fix: point at a function or class.")
    return obj


def is_factory_path(s: Any) -> bool:
    return isinstance(s, str) and ":" in s


# ----------------------------------------------------------------------------- data
def is_map_style(data: Any) -> bool:
    # A dict has __len__/__getitem__ but is indexed by keys, not positions: not a dataset.
    return hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, str | bytes | Mapping)


class MapSource:
    """Examples of a map-style dataset, gathered by index into collated (x, y) batches.

    Each item must be an ``(x, y)`` pair; x is a tensor, or a tuple/dict of tensors for a model
    with several inputs (``dptune.inputs``: a tuple is passed positionally, a dict as keywords).
    """

    def __init__(self, dataset: Any, device: torch.device, collate_fn: Callable[[list], Any] | None = None):
        from torch.utils.data import default_collate

        self.dataset, self.device = dataset, device
        self.collate = collate_fn or default_collate
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
        # An empty Poisson batch (possible at small q) keeps the shapes and dtypes of a real one.
        self._empty = (inputs.to(inputs.rows(x0, 0, 0), device), y0[:0].to(device))

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if idx.numel() == 0:
            return self._empty
        x, y = self.collate([self.dataset[int(i)] for i in idx.tolist()])
        return inputs.to(inputs.check(x), self.device), y.to(self.device)

    def chunks(self, size: int = 4096):
        for i in range(0, self.n, size):
            yield self.batch(torch.arange(i, min(i + size, self.n)))


def tensors_of(dataset: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x, y) of a ``TensorDataset`` of two tensors (the in-memory fast path), else None."""
    from torch.utils.data import TensorDataset

    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0], dataset.tensors[1]
    return None


def materialize(dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """All of a map-style dataset as an (x, y) tensor pair (studies hash and split examples)."""
    fast = tensors_of(dataset)
    if fast is not None:
        return fast
    src = MapSource(dataset, torch.device("cpu"))
    xs, ys = zip(*src.chunks(), strict=True)
    return inputs.cat(list(xs)), torch.cat(ys)


def from_dataloader(loader: Any) -> Any:
    """The dataset behind a ``torch.utils.data.DataLoader``, for ``dptune.train``.

    dptune replaces the loader's sampler, shuffling and ``batch_size`` by Poisson sampling at
    q = expected_batch_size / n: every example joins each batch independently with
    probability q, which is what the privacy accountant assumes (a shuffled fixed-size batch
    is a different mechanism, with a weaker guarantee than the one reported). The loader's
    ``collate_fn`` is kept (when it is not the default) to assemble each batch.
    """
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        raise ConfigError(f"from_dataloader needs a torch DataLoader, got {type(loader).__name__}.")
    if not is_map_style(loader.dataset):
        raise ConfigError(
            "the DataLoader's dataset is iterable-style: Poisson sampling needs random access. "
            "Fix: use a map-style dataset (__len__ and __getitem__)."
        )
    from torch.utils.data import default_collate

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
def user_loss(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A batched user loss ``fn(output [B, ...], target [B, ...]) -> [B]`` as the per-example
    (unbatched) loss the gradient oracles differentiate."""

    def one(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fn(out.unsqueeze(0), y.unsqueeze(0)).reshape(())

    one.batched = fn  # type: ignore[attr-defined]
    return one


def check_loss(fn: Callable, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """The per-example contract on a tiny batch: ``fn(model(x), y)`` has shape [B]."""
    b = min(2, int(y.shape[0]))
    with torch.no_grad():
        out = fn(inputs.call(model, inputs.rows(x, 0, b)), y[:b])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (b,):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"the loss must return one value per example (shape [{b}] for a batch of {b}), got "
            f"{got}. Fix: use reduction='none' and average over the other dimensions, e.g. "
            "F.cross_entropy(out, y, reduction='none')."
        )


@dataclass(frozen=True)
class Metric:
    """An evaluation metric: ``fn(output [B, ...], target [B, ...]) -> per-example scores [B]``.

    The metric of a parameter set is the mean score over the evaluation data. For private
    selection, ``sensitivity`` must bound how much one example's score can move the SUM of
    scores (e.g. 1 for a score in [0, 1]); it is trusted, and scores are clamped to
    [0, sensitivity] so that the bound holds for any output (docs/privacy.md).
    """

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    higher_is_better: bool = True
    sensitivity: float | None = None
    name: str = "metric"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError("Metric.fn must be callable(output, target) -> per-example scores [B].")
        if self.sensitivity is not None and not (
            isinstance(self.sensitivity, int | float) and math.isfinite(self.sensitivity) and self.sensitivity > 0
        ):
            raise ConfigError(f"Metric.sensitivity must be a finite number > 0, got {self.sensitivity!r}.")
        if self.name in ("accuracy", "mse", "loss"):
            raise ConfigError(f"Metric name {self.name!r} is reserved for the built-in metric. Fix: rename it.")

    def require_sensitivity(self) -> float:
        """Private selection releases Σ scores + noise: the metric must state its sensitivity."""
        if self.sensitivity is None:
            raise ConfigError(
                f"metric {self.name!r} states no sensitivity, so it cannot be released privately. "
                "Fix: Metric(fn, sensitivity=s) with s bounding one example's score, or select "
                "in public mode."
            )
        return float(self.sensitivity)

    def scores(self, out: torch.Tensor, y: torch.Tensor, clip: bool = False) -> torch.Tensor:
        s = self.fn(out, y)
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != (int(out.shape[0]),):
            got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ConfigError(
                f"metric {self.name!r} must return one score per example (shape "
                f"[{int(out.shape[0])}]), got {got}. Fix: do not reduce over the batch."
            )
        s = s.detach().double()
        if clip:
            c = self.require_sensitivity()
            worst = 0.0 if self.higher_is_better else c  # a non-finite score counts as the worst one
            s = torch.nan_to_num(s, nan=worst, posinf=worst, neginf=worst).clamp(0.0, c)
        return s


def as_metric(metric: Any) -> Metric | str | None:
    """None, a built-in name, a ``Metric``, or a bare callable (higher is better, no sensitivity)."""
    if metric is None or isinstance(metric, str | Metric):
        return metric
    if callable(metric):
        return Metric(metric, name=getattr(metric, "__name__", "metric"))
    raise ConfigError(f"metric must be 'accuracy', 'mse', a dptune.Metric or a callable, got {metric!r}.")


# ----------------------------------------------------------------------------- data factories
def load_data(path: str, options: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """Call the data factory ``path`` (``"pkg.module:loader"``) and return ``(train, test)``.

    The loader's contract (docs/your_data.md): ``loader(**options)`` returns a
    ``dptune.data.Dataset``, a 4-tuple ``(x_train, y_train, x_test, y_test)`` of tensors, or a
    pair ``(train, test)`` whose parts are map-style datasets or ``(x, y)`` tensor pairs
    (``test`` may be None). ``train``/``test`` come back as given (map-style or pairs).
    """
    fn = import_factory(path, "data factory")
    try:
        out = fn(**dict(options or {}))
    except TypeError as exc:
        raise ConfigError(f"data factory {path!r} failed ({exc}). Fix its options.") from None
    if hasattr(out, "x_train"):
        test = (out.x_test, out.y_test) if getattr(out, "x_test", None) is not None else None
        return (out.x_train, out.y_train), test
    if isinstance(out, tuple | list) and len(out) == 4 and all(isinstance(t, torch.Tensor) for t in out):
        return (out[0], out[1]), (out[2], out[3])
    if isinstance(out, tuple | list) and len(out) == 2 and not isinstance(out[0], torch.Tensor):
        train, test = out
        for part, v in (("train", train), ("test", test)):
            if v is not None and not is_map_style(v):
                raise ConfigError(
                    f"data factory {path!r}: its {part} part is a {type(v).__name__}. Fix: return "
                    "map-style datasets or (x, y) tensor pairs."
                )
        return train, test
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


def build_model(path: str, input_dim: int | None, classes: int | None, **options: Any) -> torch.nn.Module:
    """``factory(**options)``, given ``input_dim``/``classes`` when it takes them and they are known."""
    import inspect

    fn = import_factory(path, "model factory")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    for k, v in (("input_dim", input_dim), ("classes", classes)):
        if k in params and k not in options and v is not None:
            options[k] = v
    try:
        net = fn(**options)
    except TypeError as exc:
        raise ConfigError(f"model factory {path!r} failed ({exc}). Fix: give it defaults or options.") from None
    if not isinstance(net, torch.nn.Module):
        raise ConfigError(f"model factory {path!r} returned a {type(net).__name__}, not a torch nn.Module.")
    return net


def data_shape(train: Any) -> tuple[int | None, int | None]:
    """(input_dim, classes) of a training part: classes only when the targets are in memory;
    input_dim None for a model with several inputs (a tuple/dict x: no single width)."""
    if (
        isinstance(train, tuple | list)
        and len(train) == 2
        and (isinstance(train[0], torch.Tensor) or inputs.is_structured(train[0]))
    ):
        x, y = train[0], torch.as_tensor(train[1])
    else:
        fast = tensors_of(train)
        if fast is None:
            x0, _ = MapSource(train, torch.device("cpu"))._empty
            return (None if not isinstance(x0, torch.Tensor) else math.prod(x0.shape[1:])), None
        x, y = fast
    classes = int(y.max()) + 1 if not y.dtype.is_floating_point and y.numel() else None
    return (math.prod(x.shape[1:]) if isinstance(x, torch.Tensor) else None), classes


def named_metric(name: str | None) -> Metric | None:
    """The ``dptune.Metric`` named ``"pkg.module:NAME"`` (a study's ``selection.metric``), else None."""
    if not is_factory_path(name):
        return None
    obj = import_factory(name, "selection.metric", require_callable=False)  # type: ignore[arg-type]
    if not isinstance(obj, Metric):
        raise ConfigError(
            f"selection.metric {name!r} is a {type(obj).__name__}, not a dptune.Metric. Fix: define "
            "NAME = dptune.Metric(fn, higher_is_better=..., sensitivity=...) in that module."
        )
    return obj


def metric_higher(name: str) -> bool:
    """Direction of a built-in metric name or of a ``"pkg.module:NAME"`` Metric."""
    m = named_metric(name)
    if m is not None:
        return m.higher_is_better
    return HIGHER_IS_BETTER[name]
