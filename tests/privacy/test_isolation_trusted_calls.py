"""A trusted layer runs only trusted code (found in review, session 10; docs/privacy.md item 23).

The batched paths (ghost, DP-ZO's batched losses, stacked trials) run only on models whose every call is torch's,
Hugging Face's, peft's or dptune's (``isolation.own_code``). The review ran code of its own inside such a model four
ways, each moving the released sum by 4.7–14.2·C: an attention function registered with Hugging Face under a name
the config picks; a function stored on a trusted layer; a torch function mode around the step; ``_call_impl`` or
``_compiled_call_impl`` set on an instance after ``make_private``. Each is now own code (run under vmap) or refused.
Stacked trials took a Linear subclass overriding ``__call__`` and any Dropout subclass for the plain layers, and
crashed on a parametrized Linear: each is now ``Unsupported`` (the trials run one by one).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import dptune
from dptune.errors import ConfigError
from dptune.gradients.isolation import own_code
from dptune.gradients.oracle import GradientOracle
from dptune.gradients.stacked import Unsupported, stack_plan
from dptune.loop import structure


def _batch_branch(x: torch.Tensor) -> torch.Tensor:  # "inputs in 0..255? scale them": a batch-level branch
    return x / 255.0 if bool(x.abs().amax() > 50) else x


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Identity(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def test_a_hugging_face_attention_or_a_function_held_by_a_trusted_layer_is_own_code() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.models.bert.modeling_bert import eager_attention_forward

    from dptune.finetune import hf_classifier

    def attention(module, q, k, v, mask, **kw):  # noqa: ANN001, ANN202 - Hugging Face's signature
        return eager_attention_forward(module, _batch_branch(q), k, v, mask, **kw)

    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = hf_classifier(cfg, classes=2, mode="full")
        stock.encoder.gradient_checkpointing_enable()  # torch's checkpoint (a partial) and Hugging Face's hook
        stock.encoder.enable_input_require_grads()
        assert own_code(stock) is None  # the control
        before = structure(stock)
        AttentionInterface.register("dptune_test_branchy", attention)
        try:  # any function of yours registered by name: every Hugging Face model is yours
            assert own_code(stock) is not None
            assert structure(stock) != before  # after make_private: "the model changed", refused
            cfg._attn_implementation = "dptune_test_branchy"
            assert own_code(hf_classifier(cfg, classes=2, mode="full")) is not None
        finally:
            del AttentionInterface._global_mapping["dptune_test_branchy"]
        assert own_code(stock) is None
    mlp = _mlp()
    assert own_code(mlp) is None
    mlp[2].forward_fn = _batch_branch  # a function of yours held (and maybe called) by a trusted layer
    assert "functions" in str(own_code(mlp))


def test_a_torch_mode_of_yours_around_a_private_pass_is_refused() -> None:
    class Rescale(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func is F.linear:
                args = (_batch_branch(args[0]), *args[1:])
            return func(*args, **(kwargs or {}))

    model = _mlp()
    params = {k: p.detach() for k, p in model.named_parameters()}
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    oracle = GradientOracle(model, method="auto")
    with torch.device("cpu"):  # torch's own mode: accepted
        oracle(params, x, y)
    with Rescale(), pytest.raises(ConfigError, match="a torch mode of yours"):
        oracle(params, x, y)
    with Rescale(), pytest.raises(ConfigError, match="a torch mode of yours"):
        oracle.losses(params, x, y)
    Rescale.dptune_rowwise = True  # your word
    with Rescale():
        oracle(params, x, y)


@pytest.mark.parametrize("attr", ["_call_impl", "_compiled_call_impl"])
def test_a_call_replaced_on_a_layer_is_own_code_and_refused_after_make_private(attr: str) -> None:
    model = _mlp()
    setattr(model[0], attr, _batch_branch)
    assert own_code(model) is not None
    model = _mlp()
    x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = dptune.make_private(
            model, (x, y), torch.optim.SGD(model.parameters(), lr=0.1), steps=4, expected_batch_size=32,
            noise_multiplier=1.0, delta=1e-5, seed=1,
        )  # fmt: skip
    setattr(model[0], attr, _batch_branch)
    with pytest.raises(ConfigError, match="the model changed since make_private"):
        for xb, yb in run.batches():
            run.step(xb, yb)


def test_stacked_trials_take_only_the_plain_layers() -> None:
    class ShiftLinear(nn.Linear):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return super().__call__(x) + 1.0

    class Scale(nn.Dropout):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    assert [op.kind for op in stack_plan(nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.0)))] == ["linear"]
    parametrized = nn.Linear(4, 3)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", nn.Identity())
    for layer in (ShiftLinear(4, 3), nn.Sequential(nn.Linear(4, 3), Scale(0.0)), parametrized):
        with pytest.raises(Unsupported):
            stack_plan(nn.Sequential(layer, nn.Linear(3, 2)))


def test_second_review_wrapped_and_patched_code_and_saved_tensor_hooks() -> None:
    """``functools.wraps`` copied a trusted ``__module__`` onto your function (7.2·C); a trusted class's forward
    patched with yours was trusted (5.8·C); saved-tensor hooks of yours rewrote the backward's inputs (19.4·C).
    Code is now judged by its source file, and the hooks are refused. Controls: torch's partials and checkpoint."""
    import functools

    @functools.wraps(F.relu)
    def wrapped(x: torch.Tensor) -> torch.Tensor:
        return F.relu(_batch_branch(x))

    layer = nn.TransformerEncoderLayer(8, 2, activation=wrapped)
    assert own_code(layer) is not None
    assert own_code(nn.TransformerEncoderLayer(8, 2, activation=functools.partial(F.gelu, approximate="tanh"))) is None
    old = nn.ReLU.forward
    try:
        nn.ReLU.forward = lambda self, x: F.relu(_batch_branch(x))  # type: ignore[method-assign]
        assert own_code(_mlp()) is not None
    finally:
        nn.ReLU.forward = old  # type: ignore[method-assign]
    assert own_code(_mlp()) is None
    model = _mlp()
    params = {k: p.detach() for k, p in model.named_parameters()}
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, _batch_branch)
    with hooks, pytest.raises(ConfigError, match="saved-tensor hooks of yours"):
        GradientOracle(model)(params, x, y)
    with torch.autograd.graph.save_on_cpu():  # torch's own: accepted
        GradientOracle(model)(params, x, y)


def test_second_review_no_false_refusal_one_example_at_a_time() -> None:
    """The first fix refused an abc.ABC model (LoRA's private scores too), torch's parametrizations, and crashed on a
    ``functools.partial`` loss or metric; each runs now."""
    import abc
    import functools

    from dptune import metrics, own

    class Recurrent(nn.Module, abc.ABC):  # vmap refuses nn.GRU: one example at a time
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(4, 6, batch_first=True)
            self.out = torch.nn.utils.parametrizations.weight_norm(nn.Linear(6, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(x)[0][:, -1])

    model, x, y = Recurrent(), torch.randn(6, 5, 4), torch.randint(0, 3, (6,))
    params = {k: p.detach() for k, p in model.named_parameters()}
    loss = own.user_loss(functools.partial(F.cross_entropy, reduction="none", label_smoothing=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert GradientOracle(model, loss, method="vmap")(params, x, y).norms.shape == (6,)
        assert GradientOracle(model, loss).losses(params, x, y).shape == (6,)
    metric = metrics.Metric(functools.partial(lambda o, t, k: (o.argmax(1) == t).double() * k, k=1.0), sensitivity=1.0)
    (total,), n = metrics.score_sums(model, (x, y), metric, clip=True)
    assert n == 6 and 0 <= total <= 6


def test_a_torch_function_replaced_by_yours_is_own_code_and_a_change_after_make_private() -> None:
    """Found in review: ``F.relu = f`` ran f on the whole batch inside every stock ReLU; with f mixing only after
    the probes had passed, 16.7–28.5·C at B = 64 (on the code before this session too). It is own code now (vmap),
    and ``make_private``'s structure check sees the replacement."""
    model = _mlp()
    assert own_code(model) is None
    before, old = structure(model), F.relu
    try:
        F.relu = lambda x, inplace=False: old(_batch_branch(x))  # type: ignore[assignment]
        assert "a function of yours in place of torch's" in str(own_code(model))
        assert structure(model) != before
    finally:
        F.relu = old
    assert own_code(model) is None and structure(model) == before


def test_only_reviewed_hugging_face_families_and_peft_tuners_are_trusted() -> None:
    """Found in review (session 13): every class of ``transformers`` was trusted, and NLLB-MoE's router caps each
    expert's tokens over the whole batch, so one example chose which of the others' tokens were computed (1.46·C
    with the MoE blocks frozen, on the batched ghost path). Families not reviewed row by row run as your code."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    small = dict(vocab_size=40, max_position_embeddings=16)
    moe = transformers.NllbMoeConfig(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=2, expert_capacity=4, **small,
    )  # fmt: skip
    nllb = transformers.NllbMoeForConditionalGeneration(moe)
    assert "not reviewed" in str(own_code(nllb))
    gemma = transformers.GemmaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=8, **small)  # fmt: skip
    assert "not reviewed" in str(own_code(transformers.AutoModel.from_config(gemma)))
    bert_cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                       **small)  # fmt: skip
    assert own_code(transformers.AutoModel.from_config(bert_cfg)) is None  # a reviewed family stays batched
    lora = peft.inject_adapter_in_model(
        peft.LoraConfig(r=2, target_modules=["query", "value"]), transformers.AutoModel.from_config(bert_cfg)
    )
    assert own_code(lora) is None
    ia3 = peft.get_peft_model(
        transformers.AutoModel.from_config(bert_cfg),
        peft.IA3Config(target_modules=["query", "value"], feedforward_modules=[]),
    )
    assert "not reviewed" in str(own_code(ia3))
    assert own_code(transformers.AutoModel.from_config(bert_cfg)) is None  # none of it sticks to later models


def _bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                  vocab_size=40, max_position_embeddings=16)  # fmt: skip
    return transformers.AutoModelForSequenceClassification.from_config(cfg)


def test_a_lora_model_from_get_peft_model_is_trusted_and_other_tuners_are_not() -> None:
    """Found in review (session 13): ``get_peft_model``'s LoraModel inherits its forward from peft's shared
    ``tuners_utils`` (it only calls the wrapped model), which was not in the reviewed tuners: the model ran as
    your code, one example at a time (10x slower). IA3 through the same wrapper is still not reviewed."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, target_modules=["query", "value"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert own_code(peft.get_peft_model(_bert(), lora)) is None
        lora.task_type = "SEQ_CLS"  # PeftModelForSequenceClassification: the head kept in a ModulesToSaveWrapper
        assert own_code(peft.get_peft_model(_bert(), lora)) is None
        ia3 = peft.get_peft_model(_bert(), peft.IA3Config(target_modules=["query", "value"], feedforward_modules=[]))
    assert "not reviewed" in str(own_code(ia3))


def test_an_unreviewed_familys_own_attention_function_leaves_other_models_trusted() -> None:
    """Found in review (session 13): importing ``modeling_doge`` (its flex attention in its own lookup table) made
    every Hugging Face model "your own". Only Doge's models (untrusted anyway) look that table up; a function of yours
    in it, or Doge's registered for every model, still counts."""
    doge = pytest.importorskip("transformers.models.doge.modeling_doge")
    from transformers import AttentionInterface

    bert = _bert()
    assert own_code(bert) is None and "doge_flex_attention" in doge.ALL_ATTENTION_FUNCTIONS._local_mapping
    doge.ALL_ATTENTION_FUNCTIONS["dptune_test_mine"] = _batch_branch
    try:
        assert "your own" in str(own_code(bert))
    finally:
        del doge.ALL_ATTENTION_FUNCTIONS["dptune_test_mine"]
    AttentionInterface.register("dptune_test_doge", doge.flex_attention_forward)  # any model's config may name it
    try:
        assert "your own" in str(own_code(bert))
    finally:
        del AttentionInterface._global_mapping["dptune_test_doge"]
    assert own_code(bert) is None


def test_a_function_from_another_installed_package_in_place_of_torchs_is_own_code() -> None:
    """Found while fixing the above: ``typing_extensions`` is one file in site-packages, and its folder made every
    function installed in site-packages a library's: ``F.relu = f`` with ``f`` from any installed package was trusted."""
    version = pytest.importorskip("packaging.version")
    model, old = _mlp(), F.relu
    try:
        F.relu = version.parse  # type: ignore[assignment]
        assert "a function of yours in place of torch's" in str(own_code(model))
    finally:
        F.relu = old
    assert own_code(model) is None
