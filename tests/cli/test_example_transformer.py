"""examples/transformer_text.py (issue 11, example d) runs on tiny sizes: which layers get ghost
norms and which fall back, and a DP-vs-non-private timing.

The messages are a tiny Enron-format file written here (CI has no datasets); with
``DPTUNE_DATA_DIR`` set, the real Enron1 file is used instead."""

from __future__ import annotations

import csv
import gzip
import math
import os
import random
from pathlib import Path

import pytest
import torch
from conftest import load_example

from dptune.gradients import ghost
from dptune.gradients.oracle import GradientOracle


def _example():
    return load_example("transformer_text.py")


def _fake_enron(root: Path, n: int = 120) -> Path:
    (root / "enron_spam").mkdir(parents=True)
    rng = random.Random(0)
    ham, spam = ["meeting", "gas", "schedule", "report", "vince"], ["free", "money", "click", "offer", "viagra"]
    with gzip.open(root / "enron_spam" / "enron1.csv.gz", "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label", "label_num", "text"])
        for i in range(n):
            s = i % 3 == 0
            words = [rng.choice(spam if s else ham) for _ in range(rng.randint(0, 15))]
            w.writerow(
                [f"{i:04d}.{'spam' if s else 'ham'}.txt", "spam" if s else "ham", int(s), "Subject: " + " ".join(words)]
            )
    return root


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    real = os.environ.get("DPTUNE_DATA_DIR")
    if real and (Path(real) / "enron_spam" / "enron1.csv.gz").is_file():
        data_dir = real
    else:
        data_dir = str(_fake_enron(tmp_path_factory.mktemp("data")))
    return _example().main(["--tiny", "--data-dir", data_dir, "--device", "cpu"])


def test_linear_attention_transformer_is_all_ghost(tiny_run):
    assert tiny_run["ghost_fallback"] is None
    layers = tiny_run["ghost_layers"]
    assert {t for _, t, _ in layers} == {"Embedding", "Linear", "LayerNorm"}
    assert all(rule == "ghost rule" for *_, rule in layers)


def test_torch_transformer_falls_back_on_multihead_attention(tiny_run):
    assert "MultiheadAttention" in tiny_run["torch_fallback"]
    rules = {name: rule for name, _, rule in tiny_run["torch_layers"]}
    assert rules["encoder.layers.0.self_attn"] == "no ghost rule"
    assert rules["encoder.layers.0.self_attn.out_proj"].startswith("used by its parent")
    assert rules["encoder.layers.0.linear1"] == "ghost rule"


def test_timings_and_guarantee_are_reported(tiny_run):
    for key in ("nodp", "ghost", "ghost_as_vmap", "torch"):
        sec, acc = tiny_run[key]
        assert sec > 0 and math.isfinite(sec) and 0.0 <= acc <= 1.0
    assert 0 < tiny_run["epsilon"] < math.inf
    core = tiny_run["core"]
    assert set(core) == {"nodp", "ghost", "ghost_as_vmap", "torch"}
    assert all(v > 0 and math.isfinite(v) for v in core.values())


def test_the_gradient_oracle_agrees_with_the_table():
    # What the table says is what training does: the ghost model's per-sample norms come from the
    # ghost engine and equal vmap's; the torch model's oracle falls back with the same reason.
    ex = _example()
    torch.manual_seed(0)
    m = ex.GhostTransformer(50, 8, 16, 2, 1)
    x = torch.randint(0, 50, (6, 8))
    x[0] = 0  # an empty message
    x[1, 4:] = 0
    y = torch.randint(0, 2, (6,))
    params = {k: p.detach() for k, p in m.named_parameters()}
    g, v = GradientOracle(m, method="ghost"), GradientOracle(m, method="vmap")
    assert g.method == "ghost"
    ng, nv = g(params, x, y).norms, v(params, x, y).norms
    assert torch.allclose(ng, nv, rtol=1e-4, atol=1e-6) and (ng >= nv * (1 - 1e-6)).all()
    t = ex.TorchTransformer(50, 8, 16, 2, 1)
    o = GradientOracle(t, method="auto")
    assert o.method == "vmap" and o.fallback_reason == ghost.unsupported_reason(t)
