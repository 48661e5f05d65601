"""Shared pieces of the presets: scales, log-spaced grids, the ``Preset``/``Part`` records. A preset
reproduces one paper experiment at a scale, in parts of one tuner study each (one dataset and model each)."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptune.errors import ConfigError

SCALES: tuple[str, ...] = ("smoke", "small", "paper")
# Scales only some presets have (``Preset.scales``): a slice of the paper scale that fits a GPU budget.
EXTRA_SCALES: dict[str, str] = {"gpu-slice": "one cell of the paper's grid at full size, ≈ 10 GPU minutes"}


def check_scale(scale: Any, scales: Sequence[str] = SCALES) -> str:
    """The scale name, or a ``ConfigError`` naming the choices (``scales``: those the preset has)."""
    key = scale.strip().lower() if isinstance(scale, str) else scale
    if key not in scales:
        extra = [f"{s}: {EXTRA_SCALES[s]}" for s in scales if s in EXTRA_SCALES]
        elsewhere = [s for s in EXTRA_SCALES if s not in scales]
        hint = f" ({key!r} exists only for other presets: see `dptune reproduce list`)" if key in elsewhere else ""
        raise ConfigError(
            f"unknown scale {scale!r}{hint}. Fix: choose one of {', '.join(scales)} "
            "(smoke: CI check in seconds; small: ≤ 60 min on a 2-core CPU; paper: the papers' settings"
            + "".join(f"; {e}" for e in extra)
            + ")."
        )
    return str(key)


def log_grid(lo_exp: float, hi_exp: float, k: int) -> list[float]:
    """k values 10^x, x uniform in [lo_exp, hi_exp] (Galli et al.), to 4 significant digits like the paper's
    tables: ``log_grid(-2.5, 1.5, 7)`` = [0.003162, 0.01468, 0.06813, 0.3162, 1.468, 6.813, 31.62]."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"grid size k must be an integer ≥ 1, got {k!r}. Fix: e.g. k = 7.")
    if k == 1:
        xs = [(lo_exp + hi_exp) / 2.0]
    else:
        xs = [lo_exp + (hi_exp - lo_exp) * i / (k - 1) for i in range(k)]
    return [float(round(v, 3 - math.floor(math.log10(v)))) if (v := 10.0**x) else 0.0 for x in xs]


@dataclass(frozen=True)
class Part:
    """One tuner study of a preset: ``name`` (its sub-directory), a title and the study dict."""

    name: str
    title: str
    study: Mapping[str, Any]
    notes: tuple[str, ...] = ()
    # The paper's published scores for this study's cells: (strategy name, ε) → (mean, std), in the
    # paper's unit (``paper_unit`` × ours: 100 for accuracy in %), and where they come from.
    paper_scores: Mapping[tuple[str, float], tuple[float, float]] = field(default_factory=dict)
    paper_source: str = ""
    paper_unit: float = 100.0

    def study_dict(self) -> dict[str, Any]:
        """A deep copy (callers may edit it freely)."""
        return copy.deepcopy(dict(self.study))


@dataclass(frozen=True)
class Preset:
    """A paper experiment: ``build(scale, options) -> [Part]``; ``extra(out_dir, scale, options, parts,
    console)`` writes what is not a study and returns rows to print (or None); ``options``: accepted keywords."""

    name: str
    paper: str
    summary: str
    build: Callable[[str, Mapping[str, Any]], list[Part]]
    options: Mapping[str, Any] = field(default_factory=dict)
    extra: Callable[..., Any] | None = None
    estimates: Mapping[str, str] = field(default_factory=dict)
    scales: tuple[str, ...] = SCALES

    def parts(self, scale: str, **options: Any) -> list[Part]:
        scale = check_scale(scale, self.scales)
        if unknown := sorted(set(options) - set(self.options)):
            allowed = ", ".join(self.options) or "(none)"
            raise ConfigError(f"preset {self.name!r} has no option {unknown[0]!r}. Fix: its options are: {allowed}.")
        return self.build(scale, {k: v for k, v in {**dict(self.options), **options}.items() if v is not None})


def study_dict(
    *,
    name: str,
    data: Mapping[str, Any],
    model: Mapping[str, Any],
    training: Mapping[str, Any],
    budget: Mapping[str, Any],
    selection: Mapping[str, Any],
    strategies: Sequence[Mapping[str, Any]],
    seeds: Sequence[int],
) -> dict[str, Any]:
    """A study in the ``study_from_dict`` form: a grid over each arm's space unless the arm names its method."""
    return {
        "study": {"name": name, "seed": 0, "seeds": [int(s) for s in seeds]},
        "data": dict(data),
        "model": dict(model),
        "training": dict(training),
        "budget": dict(budget),
        "selection": dict(selection),
        "strategies": [dict(s) for s in strategies],
        "method": {"name": "grid"},
    }


def check_int_option(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"option {name} must be an integer ≥ 1, got {value!r}. Fix: e.g. {name} = 7.")
    return value


def ensure_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"output path {str(p)!r} exists and is not a directory. Fix: pass a directory.")
    p.mkdir(parents=True, exist_ok=True)
    return p
