"""``dpgd``: full-batch DP-GD with momentum (Panda et al. 2024, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dptune.errors import ConfigError
from dptune.release.context import RunPlan
from dptune.release.privatizers import FixedClip
from dptune.strategies.base import Composed
from dptune.tree import Tensors
from dptune.updates import SGD, Average, Averaged, check_average


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

    Iterate averaging (``average``; Panda §A.5, Fig. 11: EMA and SWA against none): the run's
    evaluated and final parameters are the average θ̄ of the iterates w_1..w_T (and of the free
    step's w_{T+1} when ``final_step``) instead of the last iterate; the iterates themselves
    follow Algorithm 1 unchanged. ``"ema"``: bias-corrected exponential moving average with decay
    ``ema_decay`` (None: β = 1 − 10/T, a window of the last tenth of the run); ``"swa"``: the
    uniform mean of the iterates from step ⌊swa_start·T⌋ + 1 on. It costs no privacy: every
    iterate is a function of the released noisy gradients alone, so any average of them is
    post-processing of the same T releases (same ledger, same ε; ``updates.Averaged``).
    """

    lr: float | None = None  # None: linear scaling, r = η·T (docs/strategies.md, "Defaults")
    clip: float = 1.0
    momentum: float = 0.9
    zero_init: bool = False
    final_step: bool = True
    average: Average = "none"  # "none" | "ema" | "swa"
    ema_decay: float | None = None  # β; None → 1 − 10/T
    swa_start: float = 0.5  # SWA averages the iterates after this fraction of T
    name = "dpgd"
    hyperparameters = ("lr", "clip", "momentum", "zero_init", "final_step", "average", "ema_decay", "swa_start")

    def __post_init__(self) -> None:
        check_average(self.average, self.ema_decay, self.swa_start)
        super().__post_init__()

    def parts(self):
        rule = SGD(self.lr, self.momentum, final_step=self.final_step)
        if self.average != "none":
            rule = Averaged(rule, self.average, self.ema_decay, self.swa_start)
        return FixedClip(self.clip), rule

    def validate_run(self, run: RunPlan) -> None:
        if run.sampling_rate < 1.0:
            raise ConfigError(
                f"dpgd is full-batch DP-GD: it needs q = 1, got q = {run.sampling_rate:.4g}. "
                "Set full_batch=True (or expected_batch_size = n), or use 'dpsgd' with momentum."
            )

    def init(self, params: Tensors, run: RunPlan):
        self.validate_run(run)
        return super().init(params, run)

    def prepare(self, params: Tensors) -> Tensors:
        return {k: torch.zeros_like(v) for k, v in params.items()} if self.zero_init else params
