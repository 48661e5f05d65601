"""Tuning methods as plug-ins: one ``TuningMethod`` subclass per file, registered by name.

=================== ====================================================== ===========================
method (file)       guarantee                                              accountant
=================== ====================================================== ===========================
grid, random,       composition of the runs (oracle: each run alone at ε,  auto
online, oracle      the search's cost not included)
(composition.py)
liu-talwar          Liu & Talwar Thm 3.4: (3ε₁ + 3√(2δ₁), √(2δ₁)T_max + δ₂) closed form (runs: RDP)
repeat-and-select   RepeatAndSelectDpEvent(run, mean, shape)               rdp
linear-scaling      composition of 2n sweep runs and the final run         gdp (q = 1), else auto
=================== ====================================================== ===========================

Adding a method (docs/tuning.md, "Adding a tuning method"): subclass ``base.TuningMethod`` in a
file of your own and ``register`` the class; study files then accept its name.
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
