"""Issue 24 acceptance on a GPU: the pretrained MiniLM fine-tuned on Enron1 (dptune's tokens, 64), test accuracy.
DP runs: dptune.train defaults (dpadam, fine-tuning lr, C = 1, L = default_batch_size(n) = 256, 5 epochs, δ = 1e-5)."""

import json
import os
import time
import warnings

import torch
import transformers

import dptune
from dptune.finetune import hf_classifier

warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()
d = torch.load("runs/enron_minilm.pt")
DEV = os.environ.get("DEV", "cuda")
N = int(os.environ.get("N", "0")) or None


def dev(x):
    return {k: v[:N].long().to(DEV) for k, v in x.items()}


xtr, ytr, xte, yte = dev(d["x_train"]), d["y_train"][:N].to(DEV), dev(d["x_test"]), d["y_test"][:N].to(DEV)


def encoder():
    enc = transformers.BertModel(transformers.BertConfig(**d["cfg"]), add_pooling_layer=False)
    missing, unexpected = enc.load_state_dict(d["sd"], strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return enc


def acc(m):
    m.eval()
    with torch.no_grad():
        return float(
            (
                torch.cat([m(**{k: v[i : i + 256] for k, v in xte.items()}).argmax(1) for i in range(0, len(yte), 256)])
                == yte
            )
            .float()
            .mean()
        )


out, rows = os.environ.get("OUT", "/tmp"), []


def dp(name, mode, eps, head_only=False, **kw):
    t = time.time()
    m = hf_classifier(encoder(), 2, mode=mode, **kw)
    if head_only:
        for n, p in m.named_parameters():
            p.requires_grad_(n.startswith("head"))
    r = dptune.train(
        m.to(DEV),
        (xtr, ytr),
        "dpadam",
        epochs=float(os.environ.get("EPOCHS", "5")),
        target_epsilon=eps,
        delta=1e-5,
        device=DEV,
        seed=0,
    )
    row = {
        "run": name,
        "eps": eps,
        "test_acc": acc(r.model),
        "eps_spent": r.epsilon(1e-5),
        "wall_s": round(time.time() - t, 1),
        "trainable": sum(p.numel() for p in m.parameters() if p.requires_grad),
    }
    print(json.dumps(row), flush=True)
    rows.append(row)


def nonprivate(epochs=1, lr=5e-4, bs=64):
    t = time.time()
    m = hf_classifier(encoder(), 2, mode="full").to(DEV)
    m.train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(epochs):
        perm = torch.randperm(len(ytr), generator=g).to(DEV)
        for i in range(0, len(ytr), bs):
            idx = perm[i : i + bs]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(**{k: v[idx] for k, v in xtr.items()}), ytr[idx]).backward()
            opt.step()
    row = {
        "run": f"non-private full (AdamW {lr}, {epochs} epoch, batch {bs})",
        "eps": None,
        "test_acc": acc(m),
        "wall_s": round(time.time() - t, 1),
    }
    print(json.dumps(row), flush=True)
    rows.append(row)


print("majority", float((yte == yte.mode().values).float().mean()), flush=True)
nonprivate()
dp("dpadam full (defaults)", "full", 8.0)
dp("dpadam lora (defaults)", "lora", 8.0)
dp("dpadam last-2 (defaults)", "last-k", 8.0, k=2)
dp("dpadam head only (linear probe, mean-pooled MiniLM)", "full", 8.0, head_only=True)
dp("dpadam full (defaults)", "full", 1.0)
dp("dpadam full (defaults)", "full", 3.0)
with open(f"{out}/enron_gpu.json", "w") as f:
    json.dump(rows, f, indent=1)
