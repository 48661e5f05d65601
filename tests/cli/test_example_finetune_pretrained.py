"""examples/finetune_pretrained.py (issue 24, item 6) on its tiny model: a Hugging Face encoder +
tokenizer brought by the user, texts padded to a fixed length, trained by ``dptune.train`` (last layer
and head) and by ``make_private`` in the user's loop (full fine-tuning); and the refusals that
docs/your_data.md promises for this path (padding to the longest text, unfreezing after make_private).

The mails are a tiny Enron-format file written here (CI has no datasets)."""

from __future__ import annotations

import csv
import gzip
import random

import pytest
import torch
from conftest import load_example

import dptune
from dptune.errors import ConfigError


@pytest.fixture(scope="module")
def ex():
    return load_example("finetune_pretrained.py")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("data")
    (root / "enron_spam").mkdir()
    rng = random.Random(0)
    with gzip.open(root / "enron_spam" / "enron1.csv.gz", "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label", "label_num", "text"])
        for i in range(100):
            s = i % 3 == 0
            words = rng.choices(["free", "money", "click"] if s else ["meeting", "gas", "report"], k=rng.randint(1, 12))
            w.writerow([f"{i:04d}.{'spam' if s else 'ham'}.txt", "spam" if s else "ham", int(s), " ".join(words)])
    return str(root)


def _fresh(ex):
    """The example's tiny classifier at its initial weights (seed 0, as ``main`` builds it)."""
    torch.manual_seed(0)
    enc, tok, _ = ex.pretrained_or_tiny(True)
    return ex.Classifier(enc), tok


ARGS = ["--tiny", "--n", "100", "--epochs", "2", "--batch", "16", "--max-len", "24"]


def test_last_layer_trains_only_itself_and_the_head(ex, data_dir) -> None:
    out = ex.main([*ARGS, "--data-dir", data_dir])
    assert out["ledger_matches_plan"] and out["ghost_reason"] is None
    assert 0 < out["epsilon"] <= 8.0
    assert set(out["final_params"]) == set(out["trainable"])
    assert all(k.startswith(("encoder.encoder.layer.1.", "head.")) for k in out["trainable"])
    before, _ = _fresh(ex)
    start = dict(before.named_parameters())
    for k, p in out["classifier"].named_parameters():
        assert torch.equal(p.detach(), start[k].detach()) == (k not in out["trainable"]), k  # frozen: bit for bit


def test_full_fine_tuning_in_your_own_loop(ex, data_dir) -> None:
    out = ex.main([*ARGS, "--data-dir", data_dir, "--full", "--own-loop"])
    assert out["ledger_matches_plan"] and 0 < out["epsilon"] <= 8.0
    assert set(out["trainable"]) == {k for k, _ in out["classifier"].named_parameters()}


def test_the_tokenizer_pads_to_the_fixed_length(ex) -> None:
    _, tok = _fresh(ex)
    x = ex.tokenize(tok, ["a", "a much longer text than the other one"], 12)
    assert x["input_ids"].shape == (2, 12) and x["attention_mask"].sum(1).tolist()[0] == 3  # [CLS] a [SEP]


class Texts(torch.utils.data.Dataset):
    """Unpadded token ids per text, and a collate_fn that pads to the longest (refused)."""

    def __init__(self, tok, texts: list[str]):
        self.items = [torch.tensor(tok(t)["input_ids"]) for t in texts]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i], torch.tensor(i % 2)

    @staticmethod
    def collate_fn(batch):
        ids = torch.nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True)
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}, torch.stack([b[1] for b in batch])


def test_padding_to_the_longest_text_is_refused(ex) -> None:
    model, tok = _fresh(ex)
    ds = Texts(tok, ["short", "a somewhat longer text", "mid text", "x"] * 8)
    with pytest.raises(ConfigError, match="fixed, public length"):
        dptune.train(model, ds, "dpadam", steps=2, expected_batch_size=16, noise_multiplier=1.0, device="cpu")


def test_unfreezing_after_make_private_is_refused(ex) -> None:
    model, tok = _fresh(ex)
    ex.freeze_all_but_last(model, 1)
    x = ex.tokenize(tok, ["free money", "gas meeting"] * 16, 16)
    y = torch.tensor([1, 0] * 16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    private = dptune.make_private(
        model, (x, y), opt, steps=2, expected_batch_size=8, noise_multiplier=1.0, device="cpu"
    )
    model.encoder.embeddings.requires_grad_(True)
    xb, yb = next(iter(private.batches()))
    with pytest.raises(ConfigError, match="trainable parameters changed"):
        private.step(xb, yb)
