"""``dptune.presets``: every experiment of the three papers in one command, at three scales.

>>> from dptune.presets import list_presets, reproduce, demo
>>> [p["name"] for p in list_presets()][:3]
['galli-mnist', 'galli-fmnist-ae', 'galli-agnews']
>>> reproduce("galli-agnews", "smoke", "runs/galli-agnews")      # doctest: +SKIP
>>> demo("runs/demo")                                             # doctest: +SKIP

Scales (``SCALES``): ``paper`` (the papers' settings; ``plan_preset`` plans it without
training), ``small`` (real data, reduced grids, ≤ 60 min on a 2-core CPU) and ``smoke`` (CI).
Each preset is one or more tuner studies (every run's privacy planned before training and
counted in the study ledger) plus, where the paper has them, theory tables and figures:
``reproduce`` writes each study's directory (``<part>/``, resumable, with its ``release/`` and
labelled ``diagnostics/``), one ``report.html`` and one ``results.csv`` for the preset. The
output layout, each preset's settings, deviations and time estimates: ``docs/reproduce.md``.
"""

from __future__ import annotations

from dptune.presets._catalog import (
    PRESETS,
    get_preset,
    list_presets,
    plan_preset,
    preset_parts,
    preset_studies,
    preset_study,
    presets_table,
)
from dptune.presets._common import SCALES, Part, Preset, log_grid
from dptune.presets._demo import demo_study
from dptune.presets._report import study_report
from dptune.presets._reproduce import demo, reproduce

__all__ = [
    "PRESETS",
    "SCALES",
    "Preset",
    "Part",
    "list_presets",
    "presets_table",
    "get_preset",
    "preset_parts",
    "preset_study",
    "preset_studies",
    "plan_preset",
    "reproduce",
    "demo",
    "demo_study",
    "log_grid",
    "study_report",
]
