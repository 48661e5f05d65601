"""panda-finetune (issue 24, item 5): Panda's linear scaling rule on a fine-tuned MiniLM. Its smoke
scale runs end to end (ledger == plan for every arm) in tests/outputs/test_presets.py with the other
presets; here: its parts, its arms (those of panda-linear-scaling-text), and its sizing.

Reference values: the measured CPU cost per example and full-batch step at 16 tokens, one torch
thread, `hf_classifier` as the preset builds it (docs/reproduce.md, "panda-finetune"): full 50 ms,
last-2 19 ms, LoRA 10 ms; evaluation 4.7 ms per example.
"""

from __future__ import annotations

import math

from dptune.presets import plan_preset, preset_parts
from dptune.tune.theory import panda_total_epsilon

SECONDS_PER_EXAMPLE_STEP = {"full": 0.050, "last-k": 0.019, "lora": 0.010}
EVAL_SECONDS_PER_EXAMPLE = 0.0047


def test_small_parts_carry_the_text_presets_arms():
    parts = preset_parts("panda-finetune", "small")
    assert [p.name for p in parts] == ["agnews-lora"]  # the paper scale: both datasets × three modes
    (probe, _) = preset_parts("panda-linear-scaling-text", "small")
    for p in parts:
        st = p.study
        assert st["data"]["options"] == {
            "representation": "tokens",
            "max_tokens": 16,
            "test_fraction": 1 / 3,
            "limit": 720,
        }
        assert st["model"] == {"name": "hf_classifier", "options": {"encoder": "minilm", **_mode(p.name)}}
        assert st["training"] == {"steps": 10, "full_batch": True}
        assert st["selection"] == probe.study["selection"] and st["budget"]["epsilon"] == [1.0, 3.0, 8.0]
        labels = [a.get("label") for a in st["strategies"]]
        assert labels == ["linear-scaling", "random-search", "grid-oracle", "non-private"]
        for mine, theirs in zip(st["strategies"][:3], probe.study["strategies"], strict=True):
            assert mine["method"] == theirs["method"] and mine["name"] == theirs["name"] == "dpgd"
            # pretrained weights: no zero init (the probe's Table 1 choice), same clip and momentum
            assert mine["fixed"] == {**theirs["fixed"], "zero_init": False}


def _mode(part: str) -> dict:
    mode = part.split("-", 1)[1]
    return {"full": {"mode": "full"}, "last-k": {"mode": "last-k", "k": 2}}.get(
        mode, {"mode": "lora", "lora_rank": 8, "lora_alpha": 16}
    )


def test_small_scale_fits_twenty_minutes_at_two_workers(data_env):
    """Σ over every planned run of steps × n × the mode's measured cost, plus each run's evaluation of
    the test split, stays under 35 CPU minutes: the small scale's 20 minutes at 2 workers, less ≈ 5 CPU
    minutes for loading MiniLM once per run (38 runs) and the report."""
    seconds = 0.0
    for part, plan in plan_preset("panda-finetune", "small").items():
        assert (plan.n_train, plan.n_val) == (480, 240)
        cost = SECONDS_PER_EXAMPLE_STEP[part.split("-", 1)[1]]
        for r in plan.runs.values():
            assert r.sampling_rate == 1.0  # full batch (Algorithm 1)
            seconds += r.steps * plan.n_train * cost + plan.n_val * EVAL_SECONDS_PER_EXAMPLE
    assert 15 * 60 < seconds < 35 * 60, seconds / 60


def test_each_arm_spends_its_target_and_the_rule_keeps_pandas_split(data_env):
    for plan in plan_preset("panda-finetune", "small").values():
        for arm in plan.arms:
            if not math.isfinite(arm.epsilon):
                assert arm.label == "non-private"
                continue
            assert arm.guarantee["epsilon"] <= arm.epsilon * (1 + 1e-9) or arm.method == "oracle"
            if arm.method == "linear-scaling":
                assert len(arm.runs) == 3 + 3 + 1
                e = arm.epsilon
                eps_f = arm.extra["final_epsilon"]["0"]
                total = panda_total_epsilon([(3, 0.1 * e), (3, 0.2 * e), (1, eps_f)], 1e-5)
                assert abs(total - e) <= 1e-4 * e


def test_gpu_slice_is_enron_at_two_thousand_examples(data_env):
    plans = plan_preset("panda-finetune", "gpu-slice")
    assert list(plans) == ["enron-full", "enron-last-k", "enron-lora"]
    work = sum(r.steps * p.n_train for p in plans.values() for r in p.runs.values())
    assert {p.n_train for p in plans.values()} == {2048} and 2e6 < work < 3e6  # ≈ 10 PFLOP at 64 tokens
