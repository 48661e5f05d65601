"""Tuning methods as plug-ins, one ``TuningMethod`` subclass per file, registered by name (table and how to
add one: docs/tuning.md)."""

from __future__ import annotations

from dptune.tune.methods.base import TuningMethod
from dptune.tune.methods.composition import Grid, Online, Oracle, Random
from dptune.tune.methods.linear_scaling import LinearScaling
from dptune.tune.methods.liu_talwar import LiuTalwar
from dptune.tune.methods.registry import canonical_method, get_method, names, register, unregister
from dptune.tune.methods.repeat_and_select import RepeatAndSelect

__all__ = ["TuningMethod", "canonical_method", "get_method", "names", "register", "unregister"]

for _cls in (Grid, Random, Online, Oracle, LiuTalwar, RepeatAndSelect, LinearScaling):  # the order of names()
    register(_cls, builtin=True)
