"""Per-example gradient norms on transformers: the ghost path against vmap (issue 24, item 2).

Times ``GradientOracle(model, method=m)(params, x, y)``, its ``norms`` and the clipped sum
``weighted_sum(min(1, C/N))`` (the gradient part of a DP step) next to the non-private step's
``loss_and_grad`` (forward, backward), interleaved in one process:

* ``ghost``: the ghost / book-keeping path with float32 Gram forms (``norm_bounds.gram_parts``);
* ``ghost-f64``: the same with every Gram form in float64 (issue 10's rule, for comparison);
* ``vmap``: materialised per-sample gradients (an error is printed where vmap cannot run).

Models: a tiny stock HF BERT (``BertModel.from_config``, dict inputs, mean-pool + linear head) and
``examples/transformer_text.py``'s ``GhostTransformer`` at its default size.

    python benchmarks/ghost_transformers.py            # CPU, about a minute
    python benchmarks/ghost_transformers.py --minilm --tokens 128 --rounds 2
    python benchmarks/ghost_transformers.py --device cuda
    python benchmarks/ghost_transformers.py --device cuda --batch 256 --tokens 128 --example 256 4 --models example  # issue 24's shape
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
from common import check_device, device_sync, interleaved_medians, machine, table
from torch import nn

from dptune.gradients import norm_bounds
from dptune.gradients.oracle import GradientOracle

ROOT = Path(__file__).resolve().parent.parent


class Pooled(nn.Module):
    dptune_rowwise = True  # each row from its own row: 'auto' may batch it (ghost path)

    def __init__(self, enc: nn.Module, d: int):
        super().__init__()
        self.enc, self.head = enc, nn.Linear(d, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def tiny_bert(batch: int, T: int, d: int = 128, layers: int = 2) -> tuple[nn.Module, object, torch.Tensor, str]:
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=1000, hidden_size=d, num_hidden_layers=layers, num_attention_heads=d // 32, intermediate_size=4 * d
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Pooled(transformers.AutoModel.from_config(cfg), d).eval()
    ids = torch.randint(2, 1000, (batch, T))
    mask = torch.ones(batch, T, dtype=torch.long)
    mask[::2, T // 2 :] = 0
    return (
        model,
        {"input_ids": ids, "attention_mask": mask},
        torch.randint(0, 2, (batch,)),
        f"BERT d={d} L={layers} T={T}",
    )


def example_transformer(
    batch: int, T: int, d: int = 64, layers: int = 2
) -> tuple[nn.Module, object, torch.Tensor, str]:
    spec = importlib.util.spec_from_file_location("transformer_text", ROOT / "examples" / "transformer_text.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["transformer_text"] = mod
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.GhostTransformer(4096, T, d, 4, layers)
    x = torch.randint(1, 4096, (batch, T))
    x[::2, T // 2 :] = 0
    return model, x, torch.randint(0, 2, (batch,)), f"transformer_text d={d} L={layers} T={T}"


@contextmanager
def gram_in_float64():
    real = norm_bounds.gram_parts
    norm_bounds.gram_parts = lambda A, Bm, dt: real(A, Bm, torch.float64)
    try:
        yield
    finally:
        norm_bounds.gram_parts = real


def measure(build, args: argparse.Namespace, dev: str) -> dict[str, object]:  # noqa: ANN001 - a builder above
    model, x, y, name = build(args.batch, args.tokens)
    model = model.to(dev)
    x = {k: v.to(dev) for k, v in x.items()} if isinstance(x, dict) else x.to(dev)
    y = y.to(dev)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def norms(oracle: GradientOracle, f64: bool = False) -> object:
        with gram_in_float64() if f64 else nullcontext():
            g = oracle(params, x, y)
            return g.weighted_sum(torch.clamp(1.0 / g.norms, max=1.0))  # clipped at C = 1

    fns, errors = {}, {}
    for method in ("ghost", "vmap"):
        oracle = GradientOracle(model, method=method)
        try:
            norms(oracle)  # the first call (isolation probe), and a check that it runs
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            errors[method] = f"{type(exc).__name__}: {str(exc)[:90]}"
            continue
        fns[method] = partial(norms, oracle)
    if "ghost" in fns:
        fns["ghost-f64"] = partial(norms, GradientOracle(model, method="ghost"), True)
    fns["non-private"] = partial(GradientOracle(model, method="vmap").loss_and_grad, params, x, y)
    clock = "cpu" if dev == "cpu" and args.threads == 1 else "wall"
    t = interleaved_medians(fns, args.rounds, clock=clock, sync=device_sync(dev))
    row: dict[str, object] = {"model": name, "B": args.batch}
    for k in ("non-private", "ghost", "ghost-f64", "vmap"):
        row[k] = f"{1e3 * t[k]:.1f} ms" if k in t else errors.get(k, "-")
    if "ghost" in t and "vmap" in t:
        row["vmap/ghost"] = f"{t['vmap'] / t['ghost']:.2f}x"
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--minilm", action="store_true", help="also MiniLM-L6's shape (d = 384, 6 layers)")
    p.add_argument("--models", nargs="+", default=["bert", "example"], choices=["bert", "example"])
    p.add_argument(
        "--example", type=int, nargs=2, default=(64, 2), metavar=("D", "LAYERS"), help="transformer_text's size"
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: CPU time is wall time minus preemption)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev = check_device(args.device)
    print(machine(dev))
    builds = [tiny_bert] if "bert" in args.models else []
    if "example" in args.models:
        builds.append(partial(example_transformer, d=args.example[0], layers=args.example[1]))
    if args.minilm:  # MiniLM-L6's shape (d = 384, 6 layers, 1536 FFN), random weights
        builds.append(partial(tiny_bert, d=384, layers=6))
    rows = [measure(build, args, dev) for build in builds]
    print(table(rows, ["model", "B", "non-private", "ghost", "ghost-f64", "vmap", "vmap/ghost"]))


if __name__ == "__main__":
    main()
