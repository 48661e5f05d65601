"""Issue 24, item 2: the ghost path on stock Hugging Face transformers (tiny ``from_config`` models,
dict inputs ``{input_ids, attention_mask}``, a mean-pool + linear head).

Per family (BERT, RoBERTa, DistilBERT, GPT-2, Llama with rotary embeddings) and per new rule
(Embedding on HF's shared [1, T] position ids, LayerNorm, RMSNorm and Linear over tokens, GPT-2's
``Conv1D``):

* the ghost norms are ≥ the exact norm of each example's gradient, computed alone (a single-example
  backward pass, float64), and within a tight factor of it; in float64 they are ≥ it outright;
* what ``weighted_sum`` releases equals Σ w_i g_i of the one-at-a-time reference, one example's
  release alone (weight 1, others 0) is ≤ its norm, and clipped at C < ‖g_i‖ it is ≤ C(1 + 1e-6);
* the oracle's isolation probe passes on these models (first call, forced ghost) and still refuses
  a head that mixes the examples of a batch;
* an input without the batch as its first dimension falls back (no silent mis-attribution).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from dptune.errors import ConfigError
from dptune.gradients import ghost, norm_bounds
from dptune.gradients.oracle import GradientOracle

transformers = pytest.importorskip("transformers")
B, T, D, VOCAB = 5, 16, 32, 97


DECODERS = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3", "phi": "Phi",
            "gpt_neox": "GPTNeoX", "stablelm": "StableLm", "olmo": "Olmo"}  # fmt: skip
# Phi-2, Pythia (parallel residual), StableLM, OLMo: LayerNorm and partial rotary; StableLM 2 12B's LayerNorm per
# head on q and k, OLMo 7B's q/k/v clipped in place
OPTIONS = {"stablelm": dict(qk_layernorm=True, use_qkv_bias=True), "olmo": dict(clip_qkv=0.5)}


def _config(family: str):  # noqa: ANN202 - a transformers config
    small = dict(vocab_size=VOCAB, max_position_embeddings=T + 4)
    if family == "bert":
        return transformers.BertConfig(
            hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, **small
        )
    if family in ("roberta", "xlm_roberta"):  # position ids from the input ids ([B, T]), padding_idx 1
        return getattr(transformers, ("XLM" if family == "xlm_roberta" else "") + "RobertaConfig")(
            hidden_size=D, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, pad_token_id=1, **small
        )
    if family == "electra":  # embeddings narrower than the layers, projected (ELECTRA-small's)
        return transformers.ElectraConfig(
            embedding_size=16, hidden_size=D, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, **small
        )
    if family == "modernbert":  # a global layer, then a local one (window ±12: each padded row still sees a token)
        return transformers.ModernBertConfig(
            hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, global_attn_every_n_layers=2,
            local_attention=24, pad_token_id=1, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0, **small,
        )  # fmt: skip
    if family == "distilbert":
        return transformers.DistilBertConfig(dim=D, n_layers=1, n_heads=2, hidden_dim=48, **small)
    if family in DECODERS:  # a decoder with rotary position embeddings (no parameters) and RMSNorm or LayerNorm
        return getattr(transformers, DECODERS[family] + "Config")(
            hidden_size=D, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            bos_token_id=0, eos_token_id=0, pad_token_id=1, **small, **OPTIONS.get(family, {}),
        )  # fmt: skip
    return transformers.GPT2Config(  # Conv1D everywhere, position ids [1, T]
        vocab_size=VOCAB, n_embd=D, n_layer=1, n_head=2, n_positions=T, bos_token_id=0, eos_token_id=0
    )


class Pooled(nn.Module):
    """A text classifier as users write one: encoder, masked mean of the last hidden states, a Linear."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self, family: str, mix: bool = False):
        super().__init__()
        cfg = _config(family)
        cfg._attn_implementation = "eager"  # the same maths on every machine (sdpa: kernel choice)
        self.enc = transformers.AutoModel.from_config(cfg)
        self.head = nn.Linear(D, 3)
        self.mix = mix

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)
        if self.mix:  # a batch statistic: each example's output depends on the others
            pooled = pooled - pooled.mean(0, keepdim=True)
        return self.head(pooled)


def _batch(n: int = B, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, T), generator=g)
    ids[:, 3] = ids[:, 7]  # a repeated token in every example
    mask = torch.ones(n, T, dtype=torch.long)
    for i in range(n):  # right padding, a public fixed length T
        mask[i, T - 3 * i :] = 0
    ids[mask == 0] = 1
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (n,), generator=g)


def _model(family: str, dtype: torch.dtype = torch.float32, mix: bool = False) -> nn.Module:
    torch.manual_seed(1)
    return Pooled(family, mix).to(dtype).eval()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}


def _alone(model: nn.Module, x: dict[str, torch.Tensor], y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each example's gradient from its own backward pass, float64, the example alone (batch of 1)."""
    m64 = copy.deepcopy(model).double()
    out = []
    for i in range(y.shape[0]):
        m64.zero_grad()
        loss = nn.functional.cross_entropy(m64(**{k: v[i : i + 1] for k, v in x.items()}), y[i : i + 1])
        loss.backward()
        out.append({k: torch.zeros_like(p) if p.grad is None else p.grad.clone() for k, p in m64.named_parameters()})
    return out


def _norms(grads: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.tensor(
        [math.sqrt(sum(float(t.square().sum()) for t in r.values())) for r in grads], dtype=torch.float64
    )


# qwen2: its own RMSNorm class
FAMILIES = ["bert", "roberta", "distilbert", "gpt2", "llama", "qwen2", "xlm_roberta", "electra", "modernbert"]


def test_every_reviewed_family_is_one_tested_here() -> None:
    from dptune.gradients.isolation import REVIEWED

    assert REVIEWED["transformers.models"] == {*FAMILIES, *DECODERS}  # a family trusted is a family tested


@pytest.mark.parametrize("family", [*FAMILIES, *(f for f in DECODERS if f not in FAMILIES)])
def test_ghost_norms_bound_each_example_alone(family: str) -> None:
    model = _model(family)
    x, y = _batch()
    oracle = GradientOracle(model, method="ghost")  # the first call runs the isolation probe
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        g = oracle(_params(model), x, y)
    assert isinstance(g, ghost.GhostGrads) and oracle.method == "ghost"
    ref = _alone(model, x, y)
    exact = _norms(ref).double()
    n = g.norms.double()
    # ≥ the example's own gradient (up to the float32 forward's rounding, ~1e-6) and tight
    assert bool((n >= exact * (1 - 1e-5)).all()), (n / exact - 1).min()
    assert bool((n <= exact * (1 + 1e-3)).all()), (n / exact - 1).max()  # the oracle's vmap comparison
    # the release equals the one-at-a-time reference, and one example's alone is ≤ its norm
    w = torch.linspace(0.2, 1.0, B)
    got = g.weighted_sum(w).wide
    for k in ref[0]:
        want = sum(float(w[i]) * ref[i][k] for i in range(B))
        assert torch.allclose(got[k].double(), want, rtol=1e-4, atol=1e-6 * (1 + float(want.abs().max()))), k
    for i in range(B):
        one = torch.zeros(B)
        one[i] = 1.0
        g.reset_reuse()
        out = g.weighted_sum(one).wide
        assert math.sqrt(sum(float(v.double().square().sum()) for v in out.values())) <= float(g.norms[i])
    # clipped at C below each example's norm: w·‖g_i‖ and the release alone ≤ C(1 + 1e-6)
    from test_edge_ghost_norms import clipping_violations

    assert clipping_violations(g) == []


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_float64_norms_are_upper_bounds_outright(family: str) -> None:
    model = _model(family, torch.float64)
    x, y = _batch()
    g = GradientOracle(model, method="ghost")(_params(model), x, y)
    exact = _norms(_alone(model, x, y))
    assert bool((g.norms >= exact).all()), (g.norms / exact - 1).min()
    assert bool((g.norms <= exact * (1 + 1e-9)).all())


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_probe_still_refuses_a_head_that_mixes_examples(family: str) -> None:
    model = _model(family, mix=True)
    x, y = _batch()
    with pytest.raises(ConfigError, match="depends on other examples"):
        GradientOracle(model, method="ghost")(_params(model), x, y)


class SharedPositions(nn.Module):
    """An Embedding called on ids [1, T] shared by the batch (HF's position ids), one on ids [T]."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self, batched: bool):
        super().__init__()
        self.tok, self.pos, self.fc = nn.Embedding(20, 6), nn.Embedding(T, 6), nn.Linear(6, 2)
        self.batched = batched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[1])
        h = self.tok(x) + self.pos(ids.unsqueeze(0) if self.batched else ids)
        return self.fc(torch.tanh(h).mean(1))


def test_shared_position_ids_give_each_example_its_own_gradient() -> None:
    torch.manual_seed(0)
    model = SharedPositions(batched=True)
    x, y = torch.randint(0, 20, (6, T)), torch.randint(0, 2, (6,))
    g = GradientOracle(model, method="ghost")(_params(model), x, y)
    v = GradientOracle(model, method="vmap")(_params(model), x, y)
    assert isinstance(g, ghost.GhostGrads)
    assert torch.allclose(g.norms, v.norms, rtol=1e-5)
    assert torch.allclose(g.grads["pos.weight"], v.grads["pos.weight"], atol=1e-6)


def test_an_input_without_the_batch_dimension_falls_back() -> None:
    torch.manual_seed(0)
    model = SharedPositions(batched=False)
    x, y = torch.randint(0, 20, (6, T)), torch.randint(0, 2, (6,))
    with pytest.warns(RuntimeWarning, match="first dimension is not the batch"):
        oracle = GradientOracle(model, method="auto")
        got = oracle(_params(model), x, y)
    assert oracle.method == "vmap"
    v = GradientOracle(model, method="vmap")(_params(model), x, y)
    assert torch.allclose(got.norms, v.norms)


def test_conv1d_is_a_transposed_linear() -> None:
    """GPT-2's Conv1D and an nn.Linear holding the transposed weight: the same norms, the sums transposed."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = nn.Sequential(Conv1D(5, 7), nn.Tanh(), nn.Flatten(), nn.Linear(5 * T, 2))
    lin = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Flatten(), nn.Linear(5 * T, 2))
    with torch.no_grad():
        lin[0].weight.copy_(conv[0].weight.t())
        lin[0].bias.copy_(conv[0].bias)
        lin[3].load_state_dict(conv[3].state_dict())
    x, y = torch.randn(6, T, 7), torch.randint(0, 2, (6,))
    gc = GradientOracle(conv, method="ghost")(_params(conv), x, y)
    gl = GradientOracle(lin, method="ghost")(_params(lin), x, y)
    assert torch.allclose(gc.norms, gl.norms, rtol=1e-6)  # x @ W and x @ Wᵀ round differently
    w = torch.rand(6)
    sc, sl = gc.weighted_sum(w), gl.weighted_sum(w)
    assert torch.allclose(sc["0.weight"], sl["0.weight"].t(), rtol=1e-5, atol=1e-7)
    assert torch.allclose(gc.grads["0.weight"], gl.grads["0.weight"].transpose(1, 2), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- float32 Gram forms
@pytest.mark.parametrize("c", [1 - 1e-4, 1 - 1e-6])
@pytest.mark.parametrize(("T", "p", "d"), [(4, 8, 16), (16, 40, 64)])
def test_float32_gram_bound_alone_holds_under_cancellation(
    T: int, p: int, d: int, c: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no example sent back to float64, the float32 Gram bound alone keeps every
    clipped release ≤ C(1 + 1e-6) under adversarial cancellation (test_edge_ghost_norms' models)."""
    from test_edge_ghost_norms import _linear_batch, clipping_violations

    seen = []
    real = norm_bounds.gram_parts
    monkeypatch.setattr(norm_bounds, "gram_parts", lambda A, Bm, dt: seen.append(dt) or real(A, Bm, torch.float32))
    g = _linear_batch(T, p, d, c, seed=1)
    assert clipping_violations(g) == []
    assert seen


def test_cancelling_examples_go_back_to_float64_and_ordinary_ones_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_edge_ghost_norms import _linear_batch

    seen: list[tuple[torch.dtype, int]] = []
    real = norm_bounds.gram_parts
    monkeypatch.setattr(norm_bounds, "gram_parts", lambda A, Bm, dt: seen.append((dt, A.shape[0])) or real(A, Bm, dt))
    assert _linear_batch(4, 8, 16, 1 - 1e-6, seed=0).norms.shape == (8,)
    assert (torch.float32, 8) in seen and (torch.float64, 8) in seen  # every example cancels
    seen.clear()
    model = _model("bert")
    x, y = _batch()
    g = GradientOracle(model, method="ghost")(_params(model), x, y)
    assert g.norms.shape == (B,)
    assert seen and {dt for dt, _ in seen} == {torch.float32}  # BERT's Linear layers over tokens


@pytest.mark.parametrize("c", [1 - 1e-4, 1 - 1e-6])
def test_direct_norms_too_big_to_keep_bound_the_release(c: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bu et al.'s choice: T = 16 > p·d/(p+d), so per-example products beat the Gram form; with no room
    to keep them their norms come chunk by chunk and the release forms them again: still ≤ C(1 + 1e-6)."""
    from test_edge_ghost_norms import _check_upper, _linear_batch, clipping_violations, exact_sq

    monkeypatch.setattr(ghost, "MATERIALIZE_LIMIT_BYTES", 3 * 4 * 8 * 4)  # three examples per chunk
    gram = []
    monkeypatch.setattr(norm_bounds, "gram_parts", lambda *a: gram.append(1))
    g = _linear_batch(16, 4, 8, c, seed=2)
    lin = g._layers[0]
    assert lin._direct and lin.G is None
    assert clipping_violations(g) == []
    assert not gram  # no Gram form
    ordinary = _linear_batch(16, 4, 8, 0.5, seed=3)
    _check_upper(ordinary, exact_sq(ordinary).sqrt(), 1e-4)


class ViewedPositions(nn.Module):
    """Position ids [1, T] whose embedding the model views as [T, d]: expanding them to the batch breaks
    the forward, which must then fall back to vmap rather than fail; and a Linear on a shared [1, d]
    float input is not expanded (it falls back: its output is shared by the batch)."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self, linear: bool):
        super().__init__()
        self.tok, self.pos, self.fc = nn.Embedding(20, 6), nn.Embedding(T, 6), nn.Linear(6, 2)
        self.q, self.proj, self.linear = nn.Parameter(torch.randn(1, 6), requires_grad=False), nn.Linear(6, 6), linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(x.shape[1]).unsqueeze(0))
        h = self.tok(x) + (pos * self.proj(self.q).unsqueeze(1) if self.linear else pos.view(x.shape[1], 6))
        return self.fc(torch.tanh(h).mean(1))


@pytest.mark.parametrize(("linear", "why"), [(False, "expanded to the batch"), (True, "not the batch")])
def test_shared_inputs_that_cannot_be_expanded_fall_back(linear: bool, why: str) -> None:
    torch.manual_seed(0)
    model = ViewedPositions(linear)
    x, y = torch.randint(0, 20, (6, T)), torch.randint(0, 2, (6,))
    with pytest.warns(RuntimeWarning, match=why):
        oracle = GradientOracle(model, method="auto")
        got = oracle(_params(model), x, y)
    assert oracle.method == "vmap"
    v = GradientOracle(model, method="vmap")(_params(model), x, y)
    assert torch.allclose(got.norms, v.norms)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_train_runs_on_the_ghost_path_with_dropout_and_dict_inputs(family: str) -> None:
    """``dptune.train`` (DP-Adam) in training mode (HF's dropout on: the probe replays the masks):
    no fallback, every planned release made."""
    import dptune

    torch.manual_seed(0)
    model = Pooled(family).train()
    x, y = _batch(40, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to vmap
        r = dptune.train(
            model, (x, y), "dpadam", steps=2, expected_batch_size=10, noise_multiplier=1.0, seed=0, device="cpu",
            grad_method="ghost",
        )  # fmt: skip
    assert r.ledger.releases == 2


@pytest.mark.parametrize("eps", [None, 1e-5])
def test_torch_rmsnorm_over_tokens_equals_vmap(eps: float | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 6), nn.RMSNorm(6, eps=eps), nn.Flatten(), nn.Linear(6 * T, 2))
    x, y = torch.randn(6, T, 7), torch.randint(0, 2, (6,))
    g = GradientOracle(model, method="ghost")(_params(model), x, y)
    v = GradientOracle(model, method="vmap")(_params(model), x, y)
    assert isinstance(g, ghost.GhostGrads)
    assert torch.allclose(g.norms, v.norms, rtol=1e-5)
    assert torch.allclose(g.grads["1.weight"], v.grads["1.weight"], rtol=1e-4, atol=1e-6)


def test_gram_forms_stacked_across_layers_equal_each_layer_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """BERT's feed-forward layers over tokens take the Gram rule; those of one shape share one stack
    (``norm_bounds.gram_stacks``: fewer products, one host read). Each layer's bound is the one it
    has alone, and with one example a stack."""
    model, (x, y) = _model("bert"), _batch()
    calls: list[int] = []  # rows of the float32 Gram forms (cancelling rows go on to float64)
    real = norm_bounds.gram_parts
    monkeypatch.setattr(
        norm_bounds,
        "gram_parts",
        lambda A, Bm, dt: (dt == torch.float32 and calls.append(A.shape[0])) or real(A, Bm, dt),
    )

    def gram_rules() -> list[ghost.LinearRule]:
        g = GradientOracle(model, method="ghost")(_params(model), x, y)
        assert g.norms.shape == (B,)
        return [r for r in g._layers if isinstance(r, ghost.LinearRule) and r._gram is not None]

    rules = gram_rules()
    assert len(rules) == 4 and set(calls) == {2 * B}  # two shapes, two layers each (the probe: twice)
    stacked = [r._gram[0][0] for r in rules]  # type: ignore[index]
    alone = [norm_bounds.gram_stacks([(r.a, r.b)], 2**30)[0][0][0] for r in rules]
    monkeypatch.setattr(ghost, "GRAM_STACK_BYTES", 1)
    calls.clear()
    one_row = [r._gram[0][0] for r in gram_rules()]  # type: ignore[index]
    assert set(calls) == {1}
    for s, t, u in zip(stacked, alone, one_row, strict=True):
        torch.testing.assert_close(s, t, rtol=1e-6, atol=0)
        torch.testing.assert_close(s, u, rtol=1e-6, atol=0)


def test_forced_ghost_refuses_a_weight_used_outside_its_layers_call() -> None:
    """Found in review: with method='ghost', a parameter used directly (``F.linear(h, self.out.weight)``, DeBERTa's
    ``rel_embeddings.weight``) had no ghost rule and got a zero gradient, silently; 'auto' fell back (its first
    call compares with vmap). Forced ghost now refuses it."""

    class Direct(nn.Module):
        dptune_rowwise = True  # declared: batched, so the ghost path itself runs

        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(torch.tanh(self.inp(x)), self.out.weight)  # self.out is never called

    torch.manual_seed(0)
    model, x, y = Direct(), torch.randn(8, 6), torch.randint(0, 3, (8,))
    with pytest.raises(ConfigError, match="used outside its layer's call"):
        GradientOracle(model, method="ghost")(_params(model), x, y)
    g = GradientOracle(model, method="auto")(_params(model), x, y)  # auto: vmap, every weight's gradient
    assert float(g.grads["out.weight"].abs().sum()) > 0
    Direct.dptune_rowwise = False  # your forward: the ghost path runs under vmap, and falls back to vmap here
    with pytest.warns(RuntimeWarning, match="used outside its layer's call"):
        g = GradientOracle(model, method="ghost")(_params(model), x, y)
    assert float(g.grads["out.weight"].abs().sum()) > 0
