"""The presets, one per paper experiment, and what can be done with them without training: list,
build (``preset_parts``, ``preset_study``) and plan (``plan_preset``)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from functools import partial
from typing import Any

from rich.markup import escape
from rich.table import Table

from dptune.errors import ConfigError
from dptune.presets import galli, mohapatra, panda, panda_finetune
from dptune.presets._common import SCALES, Part, Preset
from dptune.tune import plan_study, study_from_dict
from dptune.tune.data import study_data
from dptune.tune.spec import DataSpec
from dptune.tune.study import study_metric

_GALLI_EST = {
    "mnist": {
        "smoke": "≈ 10 s",
        "small": "≈ 30 min (51 runs × 71 steps × 256 examples of the Galli CNN; measured 32–38 s/run)",
        "paper": "GPU: 1,995 runs × 1,170 steps (k = 7); ≈ 2.9 h projected on one H100 (the gpu-slice's "
        "5.3 s of wall time per run at 8 workers)",
        "gpu-slice": "GPU: 5 min 42 s measured on one H100 with --executor process --workers 8 (65 runs × "
        "1,172 steps, full MNIST, k = 5, ε = 3; the GPU 98–99 % busy)",
    },
    "fmnist-ae": {
        "smoke": "≈ 10 s",
        "small": "≈ 35 min (51 runs × 59 steps × 128 examples of the autoencoder; 36–44 s/run)",
        "paper": "GPU: 1,995 runs × 1,170 steps (k = 7)",
    },
    "agnews": {
        "smoke": "≈ 5 s",
        "small": "≈ 10 min (297 runs × 119 steps × 512 examples, small FC net; 1.4–1.9 s/run)",
        "paper": "GPU (or a few CPU hours): 1,995 runs × 119 steps (k = 7)",
    },
}
_GALLI = [
    Preset(
        name=f"galli-{ds}",
        paper="Galli et al. 2024 (OSO-DPSGD)",
        summary=f"{title}: Online vs FixedThreshold vs FixedQuantile vs AdamWOSM vs NoDP, per-grid budgets",
        build=partial(galli.build, ds),
        options={"k": None, "steps": None, "limit": None},
        estimates=_GALLI_EST[ds],
        scales=(*SCALES, "gpu-slice") if ds == "mnist" else SCALES,
    )
    for ds, title in (("mnist", "MNIST"), ("fmnist-ae", "Fashion-MNIST autoencoder"), ("agnews", "AG News"))
]

_MOH_EST = {
    "mnist": {"smoke": "≈ 15 s", "small": "≈ 12 min (2 models × 180 runs × 600 steps)", "paper": "GPU"},
    "adult": {"smoke": "≈ 10 s", "small": "≈ 8 min (2 models × 180 runs × 600 steps)", "paper": "GPU"},
    "enron": {"smoke": "≈ 10 s", "small": "≈ 20 min (2 models × 180 runs × 300 steps, 5,512 inputs)", "paper": "GPU"},
}
_MOHAPATRA = [
    Preset(
        name=f"mohapatra-{ds}",
        paper="Mohapatra et al. 2022 (honest tuning, adaptive optimizers)",
        summary=f"{title}, LR and TLNN: DPSGD, DPMomentum, DPAdam, ADADP, DPAdamWOSM at σ ∈ {{2, 4, 8}}",
        build=partial(mohapatra.build, ds),
        extra=lambda out, scale, options, parts, console: mohapatra.report_sections(out, scale, parts),
        estimates=_MOH_EST[ds],
    )
    for ds, title in (("mnist", "MNIST"), ("adult", "Adult"), ("enron", "ENRON"))
]
_MOHAPATRA_LT = Preset(
    name="mohapatra-lt-vs-ma",
    paper="Mohapatra et al. 2022, appendix F",
    summary="cost of Liu–Talwar vs moments accountant by number of candidates (no training)",
    build=lambda scale, options: [],
    extra=lambda out, scale, options, parts, console: mohapatra.lt_vs_ma_extra(out, scale),
    estimates={"smoke": "≈ 2 s", "small": "≈ 2 s", "paper": "≈ 2 s (no training at any scale)"},
)

_PANDA = [
    Preset(
        name="panda-linear-scaling-mnist",
        paper="Panda et al. 2024 (linear scaling rule)",
        summary="MNIST CNN from scratch, full-batch DP-GD, linear scaling vs random search vs grid oracle",
        build=panda.build_mnist,
        options={"average": None},
        estimates={
            "smoke": "≈ 10 s",
            "small": "≈ 30 min (24 full-batch runs of 5–30 steps on 1,500 images; ≈ 3 s/step)",
            "paper": "GPU: full-batch DP-GD on 60,000 images",
        },
    ),
    Preset(
        name="panda-linear-scaling-text",
        paper="Panda et al. 2024 (linear scaling rule)",
        summary="MiniLM features + zero-init linear probe on AG News and Enron, full-batch DP-GD, linear scaling",
        build=panda.build_text,
        options={"average": None},
        estimates={
            "smoke": "≈ 40 s (MiniLM embeds 80 texts on a cold cache)",
            "small": "≈ 15 min (MiniLM embeds 6,000 texts ≈ 6 min; 576 probe runs ≈ 5 min)",
            "paper": "≈ 30–45 CPU minutes for the embeddings (cached afterwards), training minutes",
        },
    ),
    Preset(
        name="panda-finetune",
        paper="Panda et al. 2024 (linear scaling rule, Tables 6–8: fine-tuning)",
        summary="MiniLM fine-tuned (full, last-2, LoRA) on AG News and Enron, full-batch DP-GD, linear scaling vs "
        "random search vs grid oracle vs non-private",
        build=panda_finetune.build,
        extra=panda_finetune.modes_table,
        scales=(*SCALES, "gpu-slice"),
        estimates={
            "smoke": "≈ 40 s (Enron, 3 modes × 8 runs of 1–2 steps on 12 examples, 8 tokens)",
            "small": "≈ 15 min at 2 workers (AG News, LoRA: 38 runs × 4–10 full-batch steps of 480 examples, 16 "
            "tokens; 10 CPU ms per example-step, 4.7 ms to evaluate one)",
            "paper": "GPU: full data (6,080 / 4,137 examples), 128 tokens, 3 seeds, steps 10–100",
            "gpu-slice": "GPU: ≈ 10 min estimated on one H100 (Enron, n = 2,048, 64 tokens, 3 modes × 38 runs × "
            "4–16 steps: ≈ 2.3M example-steps, ≈ 10 PFLOP at ≈ 25 TFLOP/s)",
        },
    ),
]
PRESETS: dict[str, Preset] = {p.name: p for p in (*_GALLI, *_MOHAPATRA, _MOHAPATRA_LT, *_PANDA)}


def list_presets() -> list[dict[str, Any]]:
    """Name, paper, summary and per-scale time estimates of every preset."""
    return [
        {"name": p.name, "paper": p.paper, "summary": p.summary, "options": sorted(p.options)}
        | {"scales": list(p.scales), "estimates": dict(p.estimates)}
        for p in PRESETS.values()
    ]


def presets_table() -> Any:
    """``dptune reproduce list``: a ``rich`` table of the presets that fits 100 columns (long cells fold)."""
    # 4 borders + 3×2 padding + these caps = 100 columns.
    t = Table(
        title="dptune reproduce NAME --scale smoke|small|paper",
        title_justify="left",
        show_lines=True,
        caption="Settings, deviations from the papers and measured times: docs/reproduce.md.",
        caption_justify="left",
        header_style="bold",
    )
    t.add_column("preset", style="cyan", overflow="fold", max_width=26)
    t.add_column("paper, what it runs", overflow="fold", max_width=34)
    t.add_column("time per scale", overflow="fold", max_width=30)
    for p in list_presets():
        opts = f"\n[dim]options: {', '.join('--' + o for o in p['options'])}[/]" if p["options"] else ""
        est = "\n".join(f"[bold]{s}[/]: {escape(p['estimates'].get(s, '?'))}" for s in p["scales"])
        t.add_row(p["name"], escape(f"{p['paper']}: {p['summary']}") + opts, est)
    return t


def get_preset(name: Any) -> Preset:
    """The preset called ``name``, or a ``ConfigError`` listing the presets."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in PRESETS:
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown preset {name!r}.{hint} Fix: choose one of {', '.join(PRESETS)} "
            "(`dptune reproduce list` shows them)."
        )
    return PRESETS[key]


def preset_parts(name: str, scale: str, **options: Any) -> list[Part]:
    """The parts (one tuner study each, as ``study_from_dict`` dicts) of a preset at a scale. Mohapatra presets read
    the dataset's size (their budgets depend on q = L/n): the data must be available (``DPTUNE_DATA_DIR``)."""
    return get_preset(name).parts(scale, **options)


def preset_studies(name: str, scale: str, **options: Any) -> dict[str, Any]:
    """``{part name: dptune.tune.Study}`` of a preset (empty for theory-only presets)."""
    return {p.name: study_from_dict(p.study_dict()) for p in preset_parts(name, scale, **options)}


def preset_study(name: str, scale: str, part: str | None = None, **options: Any) -> Any:
    """The ``dptune.tune.Study`` of a one-part preset, or of part ``part`` of a larger one."""
    studies = preset_studies(name, scale, **options)
    if not studies:
        raise ConfigError(
            f"preset {name!r} trains nothing (it computes theory tables and figures). "
            f"Fix: run it with reproduce({name!r}, scale, out_dir)."
        )
    if part is None:
        if len(studies) == 1:
            return next(iter(studies.values()))
        raise ConfigError(f"preset {name!r} has several studies: {', '.join(studies)}. Fix: pass part=<one of them>.")
    if part not in studies:
        raise ConfigError(f"preset {name!r} has no part {part!r}. Fix: choose one of {', '.join(studies)}.")
    return studies[part]


def _sizes(data: Mapping[str, Any], seed: int, selection: Any) -> tuple[int, int, str]:
    """(n_train, n_val, task) of a data section without computing text embeddings: the loader's
    splits do not depend on the representation, so MiniLM and token sections are sized with 'counts'
    (not with a holdout: it is assigned by a hash of each example's features)."""
    opts = dict(data.get("options", {}))
    if opts.get("representation") in ("minilm", "tokens") and selection.split != "holdout":
        opts["representation"] = "counts"
        opts.pop("max_tokens", None)
    d = study_data(DataSpec(name=data["name"], options=opts), selection, seed)
    return d.n_train, d.n_val, d.task


def plan_preset(name: str, scale: str, **options: Any) -> dict[str, Any]:
    """``{part name: StudyPlan}``: every run's ν, steps and planned event, without training (paper scale too)."""
    plans = {}
    for p in preset_parts(name, scale, **options):
        st = study_from_dict(p.study_dict())
        n_tr, n_val, task = _sizes(p.study["data"], st.seed, st.selection)
        plans[p.name] = plan_study(st, n_tr, n_val, study_metric(st, task))
    return plans
