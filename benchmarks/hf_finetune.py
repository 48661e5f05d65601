"""A stock Hugging Face encoder fine-tuned privately vs non-privately (issue 24): step time on the CPU.

    python benchmarks/hf_finetune.py [--rounds 3] [--batches 8 32] [--tokens 64] [--threads 1] [--clock cpu]

Models (tests/hf_models.py): a tiny random BERT (2 layers, d = 16) and the pretrained MiniLM
(all-MiniLM-L6-v2, 6 layers, d = 384, 22.7M parameters; needs the ``text`` extra), each with mean
pooling and a linear head, dict batches padded to ``--tokens``. Per model and batch, interleaved in
one process (``common.interleaved_medians``): a non-private AdamW step (one batched forward and
backward), and one ``dpadam`` step as ``dptune.train`` runs it (real gateway and ledger), full
fine-tuning and with only the last encoder layer and the head trainable (frozen trunk), with
``grad_method`` 'vmap' and 'auto', each named by what runs: vmap refuses these models, so the
oracle computes one example at a time; 'auto' takes the ghost path where its first probe passes. One thread and the process's CPU clock by default: on a shared machine wall times with
two threads measure the other jobs (``common.interleaved_medians``). Prints a markdown table of medians and ratios non-private / private.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import interleaved_medians, machine, table  # noqa: E402
from hf_models import freeze_trunk, minilm_classifier, tiny_classifier, token_batch  # noqa: E402

from dptune import inputs  # noqa: E402

N_TRAIN = 10_000


def torch_step(model: nn.Module, x: dict, y: torch.Tensor):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(**x), y).backward()
        opt.step()

    return step


def dptune_step(model: nn.Module, x: dict, y: torch.Tensor, method: str) -> tuple[Any, str]:
    from dptune.gradients.oracle import GradientOracle
    from dptune.release.context import RunPlan, StepContext
    from dptune.release.ledger import Ledger
    from dptune.release.mechanisms import NoiseSource, NoisyRelease
    from dptune.strategies import make_strategy

    m = copy.deepcopy(model)
    strat = make_strategy("dpadam", lr=1e-4, clip=1.0)
    oracle = GradientOracle(m, "cross_entropy", method=method)
    params = {k: p.detach().clone() for k, p in m.named_parameters() if p.requires_grad}
    q = inputs.batch_len(x) / N_TRAIN
    run = RunPlan(strat, N_TRAIN, q, 10_000, 1.0)
    state = {"params": params, "state": strat.init(params, run), "t": 0}
    gateway = NoisyRelease(Ledger(), q, NoiseSource(0, torch.device("cpu")))

    def step() -> None:
        state["t"] += 1
        ctx = StepContext(t=state["t"], x=x, y=y, oracle=oracle, release=gateway, run=run)
        state["params"], state["state"], _ = strat.step(state["params"], state["state"], ctx)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step()
    return step, "ghost" if oracle.method == "ghost" else "one at a time" if oracle.alone_reason else "vmap"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="cpu: this process's CPU seconds")
    ap.add_argument("--models", nargs="+", default=["tiny-bert", "minilm"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        full = tiny_classifier("bert", dropout=0.0) if name == "tiny-bert" else minilm_classifier()
        vocab = full.encoder.config.vocab_size
        frozen = copy.deepcopy(full)
        freeze_trunk(frozen, 1)
        for B in args.batches:
            x, y = token_batch(B, args.tokens, vocab=vocab, cls=101 % vocab, sep=102 % vocab, seed=B)
            for mode, model in (("full", full), ("last layer", frozen)):
                fns, paths = {"nodp": torch_step(model, x, y)}, {}
                for method in ("vmap", "auto"):
                    fns[method], paths[method] = dptune_step(model, x, y, method)
                med = interleaved_medians(fns, rounds=args.rounds, warmup=1, clock=args.clock)
                for method in ("vmap", "auto"):
                    rows.append(
                        {
                            "model": name,
                            "trainable": mode,
                            "batch": B,
                            "grad_method": f"{method} ({paths[method]})",
                            "non-private ms": 1e3 * med["nodp"],
                            "dpadam ms": 1e3 * med[method],
                            "ratio": med["nodp"] / med[method],
                        }
                    )
                    print(rows[-1], flush=True)
    print(f"\n{machine()}, {args.tokens} tokens, {args.clock} clock, medians of {args.rounds} interleaved rounds\n")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
