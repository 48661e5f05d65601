"""Default learning rates by Panda et al.'s linear scaling rule (public: from the plan only)."""

from __future__ import annotations

import math
import sys
from typing import Any

from dptune.release.context import RunPlan

# Default learning rates by Panda et al.'s linear scaling rule: what matters is r = η·T, step size times steps
# (docs/strategies.md, "Defaults", with the measurements). SGD on clipped means: η is the effective step lr·C/(1 − μ)
# (one update of a fully clipped batch); Adam: lr itself (Adam normalises the gradient's scale).
SGD_STEP_BUDGET = 200.0  # r = lr·C/(1 − μ)·T
ADAM_STEP_BUDGET = 0.8  # r = lr·T
# Fine-tuning (``run.pretrained``): lr at most this, as r/T moves pretrained weights too far in a
# short run (docs/strategies.md, "Defaults for fine-tuning", measured with MiniLM on AG News).
PRETRAINED_ADAM_LR = 3e-3


# The best r grows as the noise shrinks (Panda et al.: r grows with ε). The noise that matters is
# that of the mean gradient per unit of C, s = ν/L; below S_REF the budget grows as (S_REF/s)^1.5,
# at most ×3 (measured: best r ≈ 150–250 at ε = 1, ≈ 500–600 at ε = 8).
S_REF = 0.005
MAX_BUDGET_GROWTH = 3.0


def noise_scaled_budget(budget: float, run: RunPlan) -> float:
    """r for this run's noise level s = ν/L (public: the plan's ν and L)."""
    s = run.noise_multiplier / run.expected_batch_size
    if not math.isfinite(s) or s <= 0:
        return budget
    return budget * min(MAX_BUDGET_GROWTH, max(1.0, (S_REF / s) ** 1.5))


def scaled_lr(budget: float, run: RunPlan, clip: float = 1.0, momentum: float = 0.0) -> float:
    """The linear-scaling default: lr = r·(1 − μ)/(C·T) (public: T, C and μ are planned)."""
    return budget * (1.0 - momentum) / (clip * max(run.steps, 1))


def default_adam_lr(run: RunPlan) -> float:
    """Adam-type default (lr, or AdamWOSM's α): r/T, r = ADAM_STEP_BUDGET; at most PRETRAINED_ADAM_LR
    when the run fine-tunes pretrained weights (``run.pretrained``)."""
    lr = scaled_lr(ADAM_STEP_BUDGET, run)
    return min(lr, PRETRAINED_ADAM_LR) if run.pretrained else lr


def starts_pretrained(model: Any) -> bool:
    """Whether ``model`` holds a Hugging Face ``PreTrainedModel`` loaded from a checkpoint (its
    ``config.name_or_path``, which ``from_pretrained`` sets and ``from_config`` leaves empty): the
    fine-tuning defaults' test (public: the model, not the data). transformers is not imported here:
    such a module exists only once ``transformers.modeling_utils`` is loaded."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if base is None or not callable(getattr(model, "modules", None)):  # not a torch module: refused later
        return False
    return any(isinstance(m, base) and bool(getattr(m.config, "name_or_path", "")) for m in model.modules())


def default_sgd_lr(run: RunPlan, clip: float | None, momentum: float) -> float:
    """SGD-type default: lr = r·(1 − μ)/(C·T), r = SGD_STEP_BUDGET grown at low noise; C = 1
    for an unclipped (non-private) release."""
    return scaled_lr(noise_scaled_budget(SGD_STEP_BUDGET, run), run, 1.0 if clip is None else clip, momentum)
