"""``dptune.presets``: every experiment of the three papers in one command (``reproduce``), at the scales ``paper``
(``plan_preset`` plans it without training), ``small`` and ``smoke``. Each preset is one or more tuner studies plus,
where the paper has them, theory tables and figures. Layout, settings, deviations and times: ``docs/reproduce.md``."""

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
