"""Update rules: what a strategy does with a released (noisy) gradient. They see released values only, never per-example
data (privacy by post-processing); ``defaults`` holds the linear-scaling learning rates."""

from dptune.updates.rules import (
    ADADP,
    AVERAGES,
    SGD,
    UPDATES,
    Adam,
    AdamWOSM,
    Average,
    Averaged,
    OSORate,
    UpdateRule,
    check_average,
    default_ema_decay,
    extrapolation_error,
    heavy_ball,
    swa_first_step,
)

# fmt: off
__all__ = [
    "ADADP", "AVERAGES", "SGD", "UPDATES", "Adam", "AdamWOSM", "Average", "Averaged", "OSORate", "UpdateRule",
    "check_average", "default_ema_decay", "extrapolation_error", "heavy_ball", "swa_first_step",
]
# fmt: on
