"""``panda-finetune``: Panda et al.'s linear scaling rule fine-tuning all-MiniLM-L6-v2 (``hf_classifier``) on
AG News and Enron1 token ids, one part per (dataset, mode: full, last 2 blocks, LoRA): panda-linear-scaling-text's
arms plus a non-private fine-tune (the ceiling, diagnostics only). Settings, sizing, results: docs/reproduce.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dptune.outputs import up
from dptune.presets._common import Part
from dptune.presets.panda import DELTA, SMALL_N_SWEEPS, TEXT_DATASETS, panda_study, rule_notes, sweeps_text
from dptune.report.html import Section, Table
from dptune.tune.results import private_rows, study_table

MODES: dict[str, tuple[dict[str, Any], str]] = {
    "full": ({"mode": "full"}, "full fine-tuning (embedding tables frozen)"),
    "last-k": ({"mode": "last-k", "k": 2}, "last 2 blocks + head"),
    "lora": ({"mode": "lora", "lora_rank": 8, "lora_alpha": 16}, "LoRA r = 8 on query/value + head"),
}
# Sizing (docs/reproduce.md, "panda-finetune"): CPU seconds per example and full-batch step of one
# torch thread at 16 tokens, measured: full 50 ms, last-2 19 ms, LoRA 10 ms, evaluation 4.7 ms (at 32
# tokens 58 / 25 / 20 / 9.2). ``limit`` examples are pooled and split (1 − test_fraction)/test_fraction.
_PAPER: dict[str, Any] = {
    # limit None: AG News: the 7,600-row test split → 6,080 / 1,520; Enron1: 4,137 / 1,035
    **{"limit": None, "test_fraction": 0.2, "tokens": 128, "lr": (0.01, 1.0), "steps": (10, 100)},
    **{"grid_lr": [0.01, 0.03, 0.1, 0.3, 1.0], "grid_steps": [25, 50, 100], "epsilons": [1.0, 3.0, 8.0]},
    **{"seeds": [0, 1, 2], "sweeps": [0.1, 0.2], "datasets": tuple(TEXT_DATASETS), "modes": tuple(MODES)},
}
FINETUNE: dict[str, dict[str, Any]] = {
    "paper": _PAPER,
    # Enron at n = 2,048, 64 tokens: ≈ 2.3M example-steps, ≈ 10 PFLOP (docs/reproduce.md)
    "gpu-slice": {
        **_PAPER,
        **{"limit": 2560, "tokens": 64, "steps": (4, 16), "grid_lr": [0.1, 1.0], "grid_steps": [8, 16]},
        **{"seeds": [0], "sweeps": SMALL_N_SWEEPS, "datasets": ("enron",)},
    },
    # AG News with LoRA only, 480 training and 240 test examples, 16 tokens, T ∈ [4, 10] (momentum 0.9 needs
    # ≈ 10 steps to move the head): ≈ 22 CPU min of planned work (test_panda_finetune.py), ≈ 12 min at 2
    # workers. n = 40 over both datasets and modes did not test the claim (docs/reproduce.md).
    "small": {
        **_PAPER,
        **{"limit": 720, "test_fraction": 1 / 3, "tokens": 16, "lr": (0.03, 1.0), "steps": (4, 10)},
        **{"grid_lr": [0.1, 1.0], "grid_steps": [5, 10], "seeds": [0], "sweeps": SMALL_N_SWEEPS},
        **{"datasets": ("agnews",), "modes": ("lora",)},
    },
    "smoke": {
        **_PAPER,
        **{"limit": 24, "test_fraction": 0.5, "tokens": 8, "lr": (0.05, 0.5), "steps": (1, 2)},
        **{"grid_lr": [0.1, 0.3], "grid_steps": [2], "epsilons": [1.0], "seeds": [0], "runs_per_sweep": 1},
        **{"datasets": ("enron",), "modes": ("last-k", "lora")},  # full mode: 5× LoRA's CPU time; tested elsewhere
    },
}


SMALL_N = (
    "Small scale (CPU): AG News with LoRA only, n = 480. Each sweep has 3 runs at ν ≈ 14–97, so its best r is "
    "one noisy draw, and the line through two sweeps' best r can extrapolate r* far beyond both, where "
    "momentum-0.9 DP-GD diverges (measured: docs/reproduce.md, 'panda-finetune')."
)


def build(scale: str, options: Mapping[str, Any]) -> list[Part]:
    """One part per (dataset, mode): the panda-linear-scaling-text arms + a non-private fine-tune."""
    s = FINETUNE[scale]
    fixed = {"clip": 1.0, "momentum": 0.9, "zero_init": False}  # pretrained weights: no zero init
    nodp = {"name": "nodp", "label": "non-private", "space": {"lr": list(s["grid_lr"])}, "fixed": {"momentum": 0.9}}
    parts = []
    for key in s["datasets"]:
        dataset, title = TEXT_DATASETS[key]
        for mode in s["modes"]:
            model_opts, what = MODES[mode]
            tokens = {"representation": "tokens", "max_tokens": s["tokens"], "test_fraction": s["test_fraction"]}
            data: dict[str, Any] = {"name": dataset, "options": tokens}
            model = {"name": "hf_classifier", "options": {"encoder": "minilm", **model_opts}}
            study = panda_study(f"panda-finetune-{key}-{mode}-{scale}", data, model, s, fixed)
            study["strategies"].append(dict(nodp))
            notes = (
                f"all-MiniLM-L6-v2 fine-tuned, {what}; token ids padded/truncated to {s['tokens']} (a public "
                f"length); full-batch DP-GD (momentum 0.9, C = 1, head from seed 0, no zero init); sweeps at "
                f"{sweeps_text(s['sweeps'])}, targets ε ∈ {s['epsilons']}, δ = {DELTA:g}.",
                rule_notes(scale, s, probe=False)[0],
                *((SMALL_N,) if scale == "small" else ()),
                "non-private: the same fine-tune without clipping or noise on the grid oracle's learning rates "
                "at T_max (the ceiling; not differentially private, diagnostics only).",
            )
            parts.append(Part(f"{key}-{mode}", f"{title}, MiniLM fine-tuned: {what}", study, notes))
    return parts


def modes_table(out_dir: Path, scale: str, options: Mapping[str, Any], parts: list[Part], console: Any) -> list[Any]:
    """The preset page's comparison across parts (full vs last-k vs LoRA per dataset): each private
    arm's selected score per ε, as in each part's results (released: the selected runs' scores)."""
    cols: dict[tuple[str, float], None] = {}
    body: dict[str, dict[tuple[str, float], str]] = {}
    for p in parts:
        for r in private_rows(study_table(Path(out_dir) / p.name)):
            cols[(r["strategy"], float(r["epsilon"]))] = None
            v = r["value_mean"]
            body.setdefault(p.name, {})[(r["strategy"], float(r["epsilon"]))] = "—" if v is None else f"{v:.4g}"
    if not body:
        return []
    order = sorted(cols, key=lambda c: c[1] if math.isfinite(c[1]) else math.inf)  # stable: arms in plan order
    rows = [[name, *(cells.get(c, "—") for c in order)] for name, cells in body.items()]
    caption = (
        "The selected configuration's test score of each private arm (mean over seeds), per part and ε; the "
        "frozen-feature linear probe on the same data is panda-linear-scaling-text (docs/reproduce.md)."
    )
    table = Table(["part", *(f"{a} @ ε = {up(e, 4)}" for a, e in order)], rows, caption=caption)
    return [Section("Full fine-tuning vs last-k vs LoRA", tables=[table])]
