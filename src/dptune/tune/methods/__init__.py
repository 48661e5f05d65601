"""Tuning methods as plug-ins: one ``TuningMethod`` subclass per file, registered by name: grid,
random, online and oracle (``composition``), liu-talwar, repeat-and-select, linear-scaling. Their
runs and guarantees: the table in docs/tuning.md. Adding a method ("Adding a tuning method"):
subclass ``base.TuningMethod`` in a file of your own and ``register`` the class.
"""

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
