"""panda-finetune's sizing: the cost of one full-batch DP-GD step per example, per fine-tuning mode, and
the projected time of a scale from its plan (issue 24, item 5; docs/reproduce.md, "panda-finetune").

    python benchmarks/panda_finetune_cost.py [--device cuda] [--tokens 64] [--batch 256] [--scale gpu-slice]
        [--rounds 3] [--clock wall|cpu] [--json out.json]

``hf_classifier`` (all-MiniLM-L6-v2, the ``text`` extra) as the preset builds it, random token batches,
the ``dpgd`` step as ``dptune.train`` runs it (real gateway and ledger), interleaved with an evaluation
forward (``common.interleaved_medians``). The projection: Σ over every planned run of the scale of
steps × n × the mode's cost per example-step + the test split's evaluation, without model loading.
Needs DPTUNE_DATA_DIR (the plan reads the dataset's size). Prints a markdown table. ≈ 60 s on one H100.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_device, device_sync, interleaved_medians, machine, strategy_step, table  # noqa: E402

MODES = {"full": {"mode": "full"}, "last-k": {"mode": "last-k", "k": 2}, "lora": {"mode": "lora"}}


def dpgd_step(model: torch.nn.Module, x: dict, y: torch.Tensor, device: str):
    """One full-batch DP-GD step (q = 1) as the preset's runs take it."""
    from dptune.strategies import make_strategy

    strat = make_strategy("dpgd", lr=0.1, clip=1.0)
    return strategy_step(model, x, y, "cross_entropy", strat, int(y.shape[0]), 1.0, 1.0, "auto")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--scale", default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = check_device(args.device)
    torch.set_num_threads(args.threads)
    from dptune.finetune import hf_classifier
    from dptune.presets import plan_preset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (args.batch, args.tokens), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    x = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    y = torch.randint(0, 2, (args.batch,), generator=g).to(device)
    models = {m: hf_classifier(**kw).to(device) for m, kw in MODES.items()}
    fns = {m: dpgd_step(model, x, y, device) for m, model in models.items()}

    def evaluate() -> None:
        with torch.no_grad():
            models["full"](**x)

    fns["eval"] = evaluate
    med = interleaved_medians(fns, rounds=args.rounds, warmup=1, clock=args.clock, sync=device_sync(device))
    per = {k: v / args.batch for k, v in med.items()}
    projected = {m: 0.0 for m in MODES}
    for part, plan in plan_preset("panda-finetune", args.scale).items():
        mode = part.split("-", 1)[1]
        for r in plan.runs.values():
            projected[mode] += r.steps * plan.n_train * per[mode] + plan.n_val * per["eval"]
    rows = [
        {
            "mode": m,
            "ms per example-step": round(1e3 * per[m], 3),
            f"{args.scale}: projected min": round(projected[m] / 60, 2),
        }
        for m in MODES
    ]
    rows.append({"mode": "eval (per example)", "ms per example-step": round(1e3 * per["eval"], 3)})
    rows[-1][f"{args.scale}: projected min"] = "in the rows above"
    total = sum(projected.values()) / 60
    print(f"\n{machine(device)}, batch {args.batch}, {args.tokens} tokens, {args.clock} clock\n")
    print(table(rows, list(rows[0])))
    print(f"\n{args.scale}: projected {total:.1f} min of steps and evaluation (one worker; model loading excluded)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "total_min": total}, indent=1))


if __name__ == "__main__":
    main()
