"""A small transformer text classifier trained with DP on Enron spam.

What it shows:
1. which layers get ghost norms and which fall back: a transformer written from ``nn.Linear``,
   ``nn.Embedding`` and ``nn.LayerNorm`` runs entirely on the ghost path; the same shape built
   from ``nn.TransformerEncoder`` does not (``nn.MultiheadAttention`` keeps its Q/K/V weights in
   one ``in_proj_weight`` used outside an ``nn.Linear``, which has no ghost rule), so the
   whole model falls back to vmap (per-sample gradients, slower, more memory);
2. the measured time of a private step relative to a non-private step (same model, batch, data).

Tokens: each message's lower-cased words hashed into a fixed vocabulary (no vocabulary is
learnt from the private messages: the preprocessing is data-independent, as in issue 10),
truncated/padded to ``--max-len`` tokens, 0 = padding.

    DPTUNE_DATA_DIR=/work/shared/data python examples/transformer_text.py
    DPTUNE_DATA_DIR=/work/shared/data python examples/transformer_text.py --tiny   # seconds, for the test

Outputs: the layer table is about the code only. Accuracies are on the test split (public, as
in dptune's loaders); the non-private run's is not private at all (ε = ∞). The timings are for
the data owner, not differentially private: a step's time grows with its realised Poisson batch
size, which dptune keeps in diagnostics/ for that reason. The training loss is never printed.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import dptune
import dptune.devices
from dptune.data.formats import read_enron_csv
from dptune.data.text import tokenize
from dptune.gradients import ghost

# -- data: hashed tokens ---------------------------------------------------------------------


def token_id(word: str, vocab: int) -> int:
    """A fixed id in 1..vocab-1 (0 is padding): a hash of the word alone, the same on every machine."""
    h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
    return 1 + h % (vocab - 1)


def encode(texts: list[str], vocab: int, max_len: int) -> torch.Tensor:
    out = torch.zeros(len(texts), max_len, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = [token_id(w, vocab) for w in tokenize(t)[:max_len]]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def load_enron(data_dir: str | os.PathLike[str], vocab: int, max_len: int, limit: int | None, seed: int):
    """(x_train, y_train, x_test, y_test): a seeded 80/20 split of Enron1 (spam = 1)."""
    _, texts, y = read_enron_csv(Path(data_dir) / "enron_spam" / "enron1.csv.gz", "enron_spam")
    perm = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    if limit is not None:
        perm = perm[:limit]
    x, labels = encode([texts[i] for i in perm], vocab, max_len), torch.as_tensor(y[perm], dtype=torch.long)
    k = int(0.8 * len(perm))
    return x[:k], labels[:k], x[k:], labels[k:]


# -- models ----------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention from four ``nn.Linear`` layers (each called once per forward:
    the ghost rule of a Linear over T tokens applies to each)."""

    dptune_rowwise = True  # each row from its own row: 'auto' may batch it (ghost path)

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        h = self.heads

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(B, T, h, d // h).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        att = att.masked_fill(pad[:, None, None, :], float("-inf")).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    dptune_rowwise = True  # each row from its own row: 'auto' may batch it (ghost path)

    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), pad)
        return x + self.ff2(torch.relu(self.ff1(self.ln2(x))))


class _Pool(nn.Module):
    """Token + position embeddings in, mean over the non-padding tokens out (per example)."""

    dptune_rowwise = True  # each row from its own row: 'auto' may batch it (ghost path)

    def embed(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
        pad = idx == 0
        pad = pad & ~pad.all(1, keepdim=True)  # an empty message attends to its padding
        return self.tok(idx) + self.pos(pos), pad

    def pool(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        keep = (~pad).unsqueeze(-1).to(x.dtype)
        return self.head(self.ln(x * keep).sum(1) / keep.sum(1))


class GhostTransformer(_Pool):
    """Pre-LN transformer encoder from Linear/Embedding/LayerNorm: every layer has a ghost rule."""

    def __init__(self, vocab: int, max_len: int, d: int, heads: int, layers: int, classes: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, 2 * d) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, pad = self.embed(idx)
        for b in self.blocks:
            x = b(x, pad)
        return self.pool(x, pad)


class TorchTransformer(_Pool):
    """The same shape from ``nn.TransformerEncoder`` (no dropout: per-sample gradients under vmap
    need no random masks)."""

    def __init__(self, vocab: int, max_len: int, d: int, heads: int, layers: int, classes: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, pad = self.embed(idx)
        return self.pool(self.encoder(x, src_key_padding_mask=pad), pad)


def layer_table(model: nn.Module) -> list[tuple[str, str, str]]:
    """(module, type, 'ghost rule' | 'no ghost rule') for every module with its own parameters."""
    rows, ruleless = [], []
    for name, mod in model.named_modules():
        if any(True for _ in mod.parameters(recurse=False)):
            if any(name.startswith(r + ".") for r in ruleless):  # e.g. MultiheadAttention's out_proj
                rule = "used by its parent's code (F.linear), not as a layer"
            elif ghost.base_type(mod) is not None:
                rule = "ghost rule"
            else:
                rule, _ = "no ghost rule", ruleless.append(name)
            rows.append((name, type(mod).__name__, rule))
    return rows


# -- training and timing ---------------------------------------------------------------------


def _run(model_cls, data, args, strategy: str, grad_method: str | None, **hp) -> tuple[float, float, object]:
    """(seconds per step, test accuracy) of one training run; the model is rebuilt from the same seed."""
    x, y, xt, yt = data
    torch.manual_seed(args.seed)
    model = model_cls(args.vocab, args.max_len, args.dim, args.heads, args.layers)
    kw = {} if strategy == "nodp" else {"noise_multiplier": args.noise_multiplier, "delta": args.delta}
    stamps: list[float] = []  # time after each step

    def on_step(t: int, row: dict) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    device = dptune.devices.resolve_device(args.device)
    res = dptune.train(
        model,
        (x, y),
        strategy,
        steps=args.steps,
        expected_batch_size=args.batch,
        eval_data=(xt, yt),
        eval_every=args.steps,
        seed=args.seed,
        device=device,
        grad_method=grad_method,
        on_step=on_step,
        **kw,
        **hp,
    )
    # steps 2..T-1: the first carries set-up, the last the test evaluation
    sec = (stamps[-2] - stamps[0]) / (len(stamps) - 2) if len(stamps) > 2 else float("nan")
    return sec, float(res.evals[-1][res.metric]), res


def core_times(data, args, reps: int) -> dict[str, float]:
    """Median seconds of the gradient part of one step on one batch of ``args.batch`` examples,
    the four variants interleaved ``reps`` times (so a machine whose load drifts slows all alike):
    non-private (one backward), and DP (per-sample norms + the clipped weighted sum)."""
    from dptune.gradients.oracle import GradientOracle

    device = dptune.devices.resolve_device(args.device)
    x, y = data[0][: int(args.batch)].to(device), data[1][: int(args.batch)].to(device)
    cases = {}
    for key, cls, method in (
        ("nodp", GhostTransformer, None),
        ("ghost", GhostTransformer, "ghost"),
        ("ghost_as_vmap", GhostTransformer, "vmap"),
        ("torch", TorchTransformer, "auto"),
    ):
        if key == "torch" and args.skip_torch:
            continue
        torch.manual_seed(args.seed)
        m = cls(args.vocab, args.max_len, args.dim, args.heads, args.layers).to(device)
        params = {k: v.detach() for k, v in m.named_parameters()}
        o = GradientOracle(m, method=method or "vmap")

        def dp(o=o, params=params):
            g = o(params, x, y)
            return g.weighted_sum(torch.clamp(args.clip / g.norms, max=1.0))

        cases[key] = (lambda o=o, params=params: o.loss_and_grad(params, x, y)) if method is None else dp
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(reps + 1):
        for k, f in cases.items():
            t0 = time.perf_counter()
            f()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:  # the first round warms up (and runs the auto probe)
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=os.environ.get("DPTUNE_DATA_DIR", "data"))
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=float, default=256)
    p.add_argument("--limit", type=int, default=None, help="use at most this many messages")
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--strategy", default="dpsgd", choices=["dpsgd", "dpadam"], help="dpsgd: with momentum 0.9")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-torch", action="store_true", help="skip the nn.TransformerEncoder (vmap) runs")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions of the step timing")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (seconds): for the test")
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.max_len, args.dim, args.heads, args.layers = 128, 12, 16, 2, 1
        args.steps, args.batch, args.limit, args.reps = 4, 16, args.limit or 120, 2

    data = load_enron(args.data_dir, args.vocab, args.max_len, args.limit, args.seed)
    out: dict = {"n_train": len(data[0]), "n_test": len(data[2])}
    print(f"Enron1: {out['n_train']} training / {out['n_test']} test messages, {args.max_len} hashed tokens each")
    models = {"ghost": GhostTransformer} | ({} if args.skip_torch else {"torch": TorchTransformer})
    for key, cls in models.items():
        m = cls(args.vocab, args.max_len, args.dim, args.heads, args.layers)
        reason = ghost.unsupported_reason(m)
        out[f"{key}_layers"] = layer_table(m)
        out[f"{key}_fallback"] = reason
        print(
            f"\n{cls.__name__} ({sum(p.numel() for p in m.parameters()):,} parameters): "
            + (
                "every layer has a ghost rule: ghost norms + book-keeping"
                if reason is None
                else f"falls back to vmap: {reason}"
            )
        )
        for name, typ, rule in out[f"{key}_layers"]:
            print(f"  {name:<36} {typ:<20} {rule}")

    print(
        f"\n{args.strategy}, ν = {args.noise_multiplier}, expected batch {args.batch:g}, {args.steps} steps "
        "(time per step, relative to non-private; test accuracy).\n"
        "Timings: not differentially private, for the data owner only (they grow with the batch sizes)."
    )
    hp_dp = {"lr": args.lr, "clip": args.clip} | ({"momentum": 0.9} if args.strategy == "dpsgd" else {})
    sec0, acc0, _ = _run(GhostTransformer, data, args, "nodp", None, lr=0.1, momentum=0.9)
    out["nodp"] = (sec0, acc0)
    print(f"  {'non-private SGD (momentum), ε = ∞':<42} {sec0 * 1e3:8.1f} ms   1.00x   acc {acc0:.3f}")
    runs = [("ghost", GhostTransformer, "ghost"), ("ghost_as_vmap", GhostTransformer, "vmap")]
    if not args.skip_torch:
        runs.append(("torch", TorchTransformer, "auto"))
    for key, cls, method in runs:
        sec, acc, res = _run(cls, data, args, args.strategy, method, **hp_dp)
        out[key] = (sec, acc)
        if key == "ghost":
            out["epsilon"] = res.epsilon(args.delta)
            out["accountant"] = res.plan.accountant
        label = f"DP, {cls.__name__}, grad_method={method}"
        print(f"  {label:<42} {sec * 1e3:8.1f} ms {sec / sec0:6.2f}x   acc {acc:.3f}")
    print(
        f"\nprivate runs: (ε = {out['epsilon']:.2f}, δ = {args.delta:g}) each "
        f"({out.get('accountant', 'rdp').upper()} accountant)"
    )
    core = out["core"] = core_times(data, args, args.reps)
    print(
        f"\nGradient part of one step, batch {int(args.batch)}, median of {args.reps} interleaved repetitions "
        "(steadier than whole runs on a busy machine):"
    )
    names = {
        "nodp": "non-private backward",
        "ghost": "DP, GhostTransformer, ghost",
        "ghost_as_vmap": "DP, GhostTransformer, vmap",
        "torch": "DP, TorchTransformer, vmap fallback",
    }
    for k, v in core.items():
        print(f"  {names[k]:<42} {v * 1e3:8.1f} ms {v / core['nodp']:6.2f}x")
    return out


if __name__ == "__main__":
    main()
