"""``dpgd``: full-batch DP-GD with momentum (Panda et al. 2024, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dptune.errors import ConfigError
from dptune.privatizers import FixedClip
from dptune.steps import RunInfo
from dptune.strategies.base import Composed
from dptune.tree import Tensors
from dptune.updates import SGD


@dataclass(frozen=True)
class DPGD(Composed):
    """Panda et al. Algorithm 1, on the full batch (q = 1, so each step is a plain Gaussian):
      ∇_t = (Σ_{i∈D} clip_1(g_i) + N(0, ν²I)) / n        (unit clipping, C = 1)
      v_t = μ v_{t−1} + ∇_t;  w_t = w_{t−1} − η v_t          (μ = 0.9)
    = chain(FixedClip(C), SGD(η, μ, final_step)) at q = 1.
    Panda's ∇ is not divided by n; dptune divides by n so that η is comparable across
    strategies (η_dptune = n · η_Panda). Options: ``zero_init`` sets every parameter to 0
    before training (Panda Table 1; for linear probes — hidden layers need symmetry
    breaking); ``final_step`` takes one extra step w ← w − η v_T along the momentum buffer
    after training (§A.3, "a step for free": post-processing, no privacy cost).
    Default η: Panda's linear scaling, η = r·(1 − μ)/(C·T) with r = 200 (measured best r on
    mnist5k at full batch: 250–500; docs/strategies.md, "Defaults").
    """

    lr: float | None = None  # None: linear scaling, r = η·T (docs/strategies.md, "Defaults")
    clip: float = 1.0
    momentum: float = 0.9
    zero_init: bool = False
    final_step: bool = True
    name = "dpgd"
    hyperparameters = ("lr", "clip", "momentum", "zero_init", "final_step")

    def parts(self):
        return FixedClip(self.clip), SGD(self.lr, self.momentum, final_step=self.final_step)

    def validate_run(self, run: RunInfo) -> None:
        if run.sampling_rate < 1.0:
            raise ConfigError(
                f"dpgd is full-batch DP-GD: it needs q = 1, got q = {run.sampling_rate:.4g}. "
                "Set full_batch=True (or expected_batch_size = n), or use 'dpsgd' with momentum."
            )

    def init(self, params: Tensors, run: RunInfo):
        self.validate_run(run)
        return super().init(params, run)

    def prepare(self, params: Tensors) -> Tensors:
        return {k: torch.zeros_like(v) for k, v in params.items()} if self.zero_init else params
