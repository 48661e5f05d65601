"""Batch sweep on one GPU: dptune's DP step against the plain step and Opacus, before and after.

    python benchmarks/gpu_batch_sweep.py --device cuda --json sweep.json
    python benchmarks/gpu_batch_sweep.py --device cuda --baseline-src /tmp/base/src --json sweep.json
    python benchmarks/gpu_batch_sweep.py --device cpu --batches 64 128 --models mlp --rounds 1   # smoke

For each model (Galli CNN, MLP) and batch (256 … 4096) one process times, round-robin: the plain
PyTorch step (forward, backward, SGD: the reference), one ``Strategy.step`` of dptune's DP-SGD and
OSO on the ghost path (real gateway, ledger and noise; ``step_throughput.dptune_step``) and Opacus's
hooks and ghost clipping when installed. Each cell is the step's throughput as a ratio to the plain
step of the same process, so the ratios of two processes on the same GPU compare.

``--baseline-src DIR`` also runs DP-SGD and OSO with the dptune found in DIR (DIR first on
``sys.path`` of a second subprocess; e.g. ``git archive <rev> src | tar -x -C /tmp/base``): before
and after in one GPU session. The batch is exactly B here (a Poisson batch varies around it;
``dptune.train`` also samples). Each subprocess has ``--child-seconds``; the cells it finished are
kept when it runs out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
DP = ["dpsgd/ghost", "oso/ghost"]


def child(args: argparse.Namespace) -> None:
    """Time every (model, batch) cell of this side; one JSON line per cell, as it finishes."""
    sys.path.insert(0, str(HERE))
    from common import batch_for, build_model, device_sync, interleaved_medians  # puts this tree's src first
    from step_throughput import have_opacus, make_step

    src = Path(args.src).resolve()
    sys.path.insert(0, str(src))  # after common's insert: this side's dptune is the one imported
    import dptune

    if not Path(dptune.__file__).resolve().is_relative_to(src):
        raise SystemExit(f"{args.side}: imported {dptune.__file__}, not the dptune under {src}")

    cfgs = ["torch", *DP]
    if args.side == "new" and not args.no_opacus and have_opacus():
        cfgs += ["opacus_hooks", "opacus_ghost"]
    for name in args.models:
        model = build_model(name).to(args.device)
        for B in args.batches:
            x, y, loss = batch_for(name, B)
            x, y = x.to(args.device), y.to(args.device)
            fns, failed = {}, {}
            for cfg in cfgs:
                try:
                    fns[cfg] = make_step(cfg, model, x, y, loss)
                except Exception as exc:  # Opacus out of memory at a large batch, say: report, go on
                    failed[cfg] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
            med = interleaved_medians(
                fns, rounds=args.rounds, warmup=1, min_seconds=0.05, sync=device_sync(args.device)
            )
            cell = {"model": name, "batch": B, "side": args.side, "dptune": dptune.__file__, "seconds": med}
            print(json.dumps({**cell, "failed": failed}), flush=True)
            del fns
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


def run_side(args: argparse.Namespace, side: str, src: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--_child", side, src, "--device", args.device, "--rounds", str(args.rounds)]
    cmd += ["--models", *args.models, "--batches", *map(str, args.batches)] + (
        ["--no-opacus"] if args.no_opacus else []
    )
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_seconds).stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(f"  {side}: stopped after {args.child_seconds} s; the cells it finished are kept")
    cells = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for c in cells:
        for cfg, why in c["failed"].items():
            print(f"  {side} {c['model']} batch {c['batch']}: {cfg} unavailable ({why})")
    return cells


def rows_of(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for c in cells:
        base = c["seconds"]["torch"]
        for cfg, t in c["seconds"].items():
            label = cfg if c["side"] == "new" else f"{cfg} (baseline)"
            rows.append(
                {"model": c["model"], "batch": c["batch"], "config": label, "side": c["side"], "ms/step": 1e3 * t}
                | {"samples/s": c["batch"] / t, "vs plain": base / t}
            )
    return rows


def markdown(rows: list[dict[str, Any]], batches: list[int]) -> str:
    """One line per (model, config): its ratio to the plain step at each batch."""
    lines = ["| model | config | " + " | ".join(map(str, batches)) + " |", "|---|---|" + "---|" * len(batches)]
    for model, cfg in dict.fromkeys((r["model"], r["config"]) for r in rows if r["config"] != "torch (baseline)"):
        got = {r["batch"]: r for r in rows if (r["model"], r["config"]) == (model, cfg)}
        if cfg == "torch":
            cells = [f"{got[b]['samples/s']:,.0f}/s" if b in got else "–" for b in batches]
            lines.append(f"| {model} | plain (samples/s) | " + " | ".join(cells) + " |")
        else:
            lines.append(
                f"| {model} | {cfg} | "
                + " | ".join(f"{got[b]['vs plain']:.2f}" if b in got else "–" for b in batches)
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="+", default=["galli_cnn", "mlp"])
    ap.add_argument("--batches", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-src", help="a folder holding another dptune package (its src/): timed too")
    ap.add_argument("--child-seconds", type=float, default=70.0, help="time limit of each side's subprocess")
    ap.add_argument("--no-opacus", action="store_true")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        args.side, args.src = args._child
        child(args)
        return
    sys.path.insert(0, str(HERE))
    from common import check_device, machine

    check_device(args.device)
    print(f"# GPU batch sweep: {machine(args.device)}; ratio to the plain step (higher is better)")
    cells = run_side(args, "new", str(HERE.parent / "src"))
    if args.baseline_src:
        cells += run_side(args, "baseline", str(Path(args.baseline_src).resolve()))
    rows = rows_of(cells)
    print(markdown(rows, args.batches))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(args.device), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
