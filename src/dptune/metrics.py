"""Evaluation metrics: one ``Metric`` type, the built-ins (``ACCURACY``, ``MSE``), one resolver
(``resolve``) and one batched evaluation (``score_sums``, used by train, train_many and the tuner).
Torch is imported only when a score is computed, so a user's metric module loads without it."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dptune.errors import ConfigError
from dptune.factories import import_factory, is_factory_path

if TYPE_CHECKING:
    import torch

# Rows per evaluation forward pass (bounds memory). Read at call time: tests lower it to exercise
# the batching; the batch size does not change a metric's value beyond float rounding.
EVAL_BATCH = 4096


@dataclass(frozen=True)
class Metric:
    """An evaluation metric: ``fn(output [B, ...], target [B, ...]) -> per-example scores [B]``, averaged.

    For private selection ``sensitivity`` (trusted) bounds one example's move of the SUM of scores;
    scores are clamped to [0, sensitivity] so the bound holds for any output (docs/privacy.md)."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    higher_is_better: bool = True
    sensitivity: float | None = None
    name: str = "metric"

    def __post_init__(self) -> None:
        self._validate()
        if self.name in HIGHER_IS_BETTER:
            raise ConfigError(f"Metric name {self.name!r} is reserved for the built-in metric. Fix: rename it.")

    def _validate(self) -> None:
        if not callable(self.fn):
            raise ConfigError("Metric.fn must be callable(output, target) -> per-example scores [B].")
        if self.sensitivity is not None and not (
            isinstance(self.sensitivity, int | float) and math.isfinite(self.sensitivity) and self.sensitivity > 0
        ):
            raise ConfigError(f"Metric.sensitivity must be a finite number > 0, got {self.sensitivity!r}.")

    def require_sensitivity(self) -> float:
        """Private selection releases Σ scores + noise: the metric must state its sensitivity."""
        if self.sensitivity is None:
            raise ConfigError(
                f"metric {self.name!r} states no sensitivity, so it cannot be released privately. "
                "Fix: Metric(fn, sensitivity=s) with s bounding one example's score, or select in public mode."
            )
        return float(self.sensitivity)

    def with_sensitivity(self, sensitivity: float) -> Metric:
        """The same metric with another clip (the built-in MSE's is the study's ``mse_clip``)."""
        return dataclasses.replace(self, sensitivity=sensitivity)

    def scores(self, out: torch.Tensor, y: torch.Tensor, clip: bool = False) -> torch.Tensor:
        import torch

        s = self.fn(out, y)
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != (int(out.shape[0]),):
            got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ConfigError(
                f"metric {self.name!r} must return one score per example (shape "
                f"[{int(out.shape[0])}]), got {got}. Fix: do not reduce over the batch."
            )
        s = s.detach() if isinstance(self, _Builtin) else s.detach().double()  # a user's summed in float64
        if clip:
            c = self.require_sensitivity()
            worst = 0.0 if self.higher_is_better else c  # a non-finite score counts as the worst one
            # Before the clamp, which keeps NaN (one NaN would make the sum NaN); float64 for the sum (privacy.md 5).
            s = torch.nan_to_num(s.double(), nan=worst, posinf=worst, neginf=worst).clamp(0.0, c)
        return s


@dataclass(frozen=True)
class _Builtin(Metric):
    """A built-in metric: its own name; scores keep the output's dtype (the same runs bit for bit)."""

    def __post_init__(self) -> None:
        self._validate()


def _correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per example, the fraction of its predictions that are right, in [0, 1]: argmax over dim 1 (one logit: out > 0),
    one per label ([B, C, T] against [B, T]), label -100 (ignore_index) skipped (none left: 0); non-finite: 0."""
    import torch

    b = int(out.shape[0])
    pred, y = (out.argmax(1) if out.ndim > 1 and out.shape[1] > 1 else out > 0).reshape(b, -1), y.reshape(b, -1)
    if pred.shape != y.shape:  # broadcasting would compare an example's predictions with other examples' labels
        raise ConfigError(
            f"accuracy needs one prediction per label: outputs {tuple(out.shape)} make {pred.shape[1]} per example, "
            f"labels {tuple(y.shape)} {y.shape[1]}. Fix: classes on dim 1 ([B, C] or [B, C, T] against labels [B] "
            "or [B, T]; one logit: [B] or [B, 1]), or pass your own dptune.Metric."
        )
    labelled = y != -100
    right = (pred == y) & labelled & torch.isfinite(out.reshape(b, -1)).all(1, keepdim=True)
    return right.sum(1).double() / labelled.sum(1).clamp_min(1)


def _squared_error(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean squared error of each example (over its output dimensions)."""
    return ((out - y) ** 2).reshape(out.shape[0], -1).mean(1)


# "loss" is a direction only (a report of a loss): no evaluation computes it.
HIGHER_IS_BETTER: dict[str, bool] = {"accuracy": True, "mse": False, "loss": False}
ACCURACY: Metric = _Builtin(_correct, higher_is_better=True, sensitivity=1.0, name="accuracy")
MSE: Metric = _Builtin(_squared_error, higher_is_better=False, name="mse")
BUILTINS: dict[str, Metric] = {m.name: m for m in (ACCURACY, MSE)}


def named(path: str, what: str = "selection.metric") -> Metric:
    """The ``dptune.Metric`` named ``"pkg.module:NAME"`` (e.g. a study's ``selection.metric``)."""
    obj = import_factory(path, what, require_callable=False)
    if not isinstance(obj, Metric):
        raise ConfigError(
            f"{what} {path!r} is a {type(obj).__name__}, not a dptune.Metric. Fix: define "
            "NAME = dptune.Metric(fn, higher_is_better=..., sensitivity=...) in that module."
        )
    return obj


def resolve(metric: Any, default: str | None = None, what: str = "metric") -> Metric:
    """``metric`` as a ``Metric`` (built-in name, ``"pkg.module:NAME"``, ``Metric`` or callable); None: ``default``."""
    metric = default if metric is None else metric
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, str):
        if metric in BUILTINS:
            return BUILTINS[metric]
        if is_factory_path(metric):
            return named(metric, what)
        raise ConfigError(
            f"unknown {what} {metric!r}. Fix: choose {' or '.join(BUILTINS)}, pass a dptune.Metric, "
            "or name your own as 'pkg.module:NAME'."
        )
    if callable(metric):
        return Metric(metric, name=getattr(metric, "__name__", "metric"))
    raise ConfigError(
        f"{what} must be {', '.join(repr(n) for n in BUILTINS)}, 'pkg.module:NAME', a dptune.Metric or a "
        f"callable, got {metric!r}. Fix: e.g. metric='accuracy' or metric=dptune.Metric(fn)."
    )


def better(a: float, b: float, higher: bool) -> bool:
    """Is score ``a`` strictly better than ``b`` (``higher``: the metric's direction)?"""
    return a > b if higher else a < b


def higher_is_better(metric: Any) -> bool:
    """The direction of a metric: a table name (``loss`` too), a ``"pkg.module:NAME"``, a ``Metric``, a callable."""
    if isinstance(metric, str) and metric in HIGHER_IS_BETTER:
        return HIGHER_IS_BETTER[metric]
    return resolve(metric).higher_is_better


def batches(x: Any, y: torch.Tensor, size: int | None = None) -> Iterator[tuple[Any, torch.Tensor]]:
    """(x, y) in consecutive batches of ``size`` rows (default ``EVAL_BATCH``); x may be a tuple/dict of tensors."""
    from dptune import inputs

    size = size or EVAL_BATCH
    for i in range(0, inputs.batch_len(x), size):
        yield inputs.rows(x, i, i + size), y[i : i + size]


def score_sums(
    forward: Callable[[Any], torch.Tensor],
    data: tuple[Any, torch.Tensor] | Iterable[tuple[Any, torch.Tensor]],
    metric: Metric,
    *,
    clip: bool = False,
    trials: int | None = None,
    model: torch.nn.Module | None = None,
) -> tuple[list[float], int]:
    """(Σ of ``metric``'s per-example scores, number of examples) over ``data`` (an ``(x, y)``
    tuple cut into ``EVAL_BATCH`` rows, or an iterable of batches); with ``trials=K``, one sum per
    parameter set of ``forward``'s [K, B, ...]. ``clip``: scores clamped for a private release, each from its row
    alone; ``model``: the module ``forward`` runs (default: ``forward`` itself), its Python state checked."""
    import torch

    if clip and trials is None and not isinstance(private := model or forward, torch.nn.Module):
        raise TypeError("score_sums(clip=True) needs the model that forward runs: model=...")

    parts = batches(*data) if isinstance(data, tuple) else data
    totals = [0.0] * (trials or 1)
    n = 0
    with torch.no_grad():
        for x, y in parts:
            b = int(y.shape[0])
            if b == 0:
                continue
            if trials is None:  # a private release (clip): each score from its example alone
                s = _isolated_scores(forward, x, y, metric, private) if clip else metric.scores(forward(x), y)
                totals[0] += float(s.sum())
            else:
                out = forward(x)
                # The K sets' rows as one batch of K·b examples (each set against the same targets).
                flat = out.reshape(trials * b, *out.shape[2:])
                yk = y.unsqueeze(0).expand(trials, *y.shape).reshape(trials * b, *y.shape[1:])
                per = metric.scores(flat, yk, clip=clip).reshape(trials, b).sum(1)
                totals = [t + v for t, v in zip(totals, per.tolist(), strict=True)]
            n += b
    return totals, n


def _isolated_scores(
    forward: Callable[[Any], torch.Tensor], x: Any, y: torch.Tensor, metric: Metric, model: Any
) -> torch.Tensor:
    """The clamped scores of a batch, each from its row alone (a released score may depend on its
    example only: docs/privacy.md): vmap, or a loop over rows where vmap cannot run (``model``: what forward runs)."""
    import torch

    from dptune import inputs
    from dptune.gradients.isolation import KeptState

    def one(xi: Any, yi: torch.Tensor) -> torch.Tensor:
        out = forward(inputs.tmap(lambda t: t.unsqueeze(0), xi))
        return metric.scores(out, yi.unsqueeze(0), clip=True).reshape(())

    try:
        return torch.func.vmap(one)(x, y)
    except RuntimeError:
        kept, got = KeptState(model, others=(metric.fn,)), []  # the state before the batch

        def row(i: int) -> torch.Tensor:  # the output and the score
            out = forward(inputs.rows(x, i, i + 1))
            return torch.cat([out.flatten().double(), metric.scores(out, y[i : i + 1], clip=True).reshape(1)])

        for i in range(int(y.shape[0])):
            kept.mark(inputs.device_of(x))
            got.append(row(i))
        # The last row again as before the batch (same random streams): a model or metric keeping a value from one row
        # to the next (vmap refuses such Python state) would make a later score depend on the earlier rows.
        again = kept.again(lambda: row(i))
        if not torch.allclose(again, got[-1], rtol=0.0, atol=0.0, equal_nan=True):
            raise ConfigError(
                "scored one example at a time, an example's score depends on the examples scored before it (the last, "
                "scored again as before the batch, changed). Fix: keep no state from the input in the model or metric."
            ) from None
        return torch.stack([g[-1] for g in got])


def eval_mode(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """``model`` in eval mode for an evaluation (dropout off), each module's own mode restored afterwards."""
    from dptune.gradients.persample import eval_mode as model_eval_mode  # torch: loaded only when evaluating

    return model_eval_mode(model)


def mean_scores(
    forward: Callable[[Any], torch.Tensor],
    data: tuple[Any, torch.Tensor] | Iterable[tuple[Any, torch.Tensor]],
    metric: Metric,
    *,
    trials: int | None = None,
) -> list[float]:
    """The metric (mean score) of one parameter set, or of each of ``trials`` stacked ones; NaN without data."""
    sums, n = score_sums(forward, data, metric, trials=trials)
    return [s / n if n else math.nan for s in sums]


# The range of a metric's true value. A private selection score (exact + Gaussian noise) can fall outside it (an
# accuracy of 108%): displays clip it (post-processing); stored data (CSV, the study) keep the raw value.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "accuracy": (0.0, 1.0),
    "mse": (0.0, math.inf),
    "loss": (0.0, math.inf),
}


def clip_to_range(value: float | None, metric: str) -> float | None:
    """``value`` clipped to ``METRIC_RANGES[metric]`` for display (unknown metrics, None and NaN unchanged)."""
    lo_hi = METRIC_RANGES.get(metric)
    if value is None or lo_hi is None or math.isnan(value):
        return value
    return min(max(float(value), lo_hi[0]), lo_hi[1])


def finite_number(x: Any) -> bool:
    """Whether ``x`` is an int or float other than ±inf and NaN (None: a diverged run's score)."""
    return isinstance(x, int | float) and math.isfinite(x)


def mean_std(values: Iterable[Any]) -> tuple[float | None, float | None]:
    """Mean ± sample std of the finite numbers in ``values``: (None, None) with none, std None with one."""
    xs = [float(x) for x in values if finite_number(x)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)
