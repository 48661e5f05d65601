"""A stock Hugging Face encoder fine-tuned privately vs non-privately (issue 24): step time and peak
memory, with Opacus in the same run.

    python benchmarks/hf_finetune.py                      # MiniLM full FT, batch 32, 128 tokens, CPU
    python benchmarks/hf_finetune.py --device cuda --rounds 5 --json runs/hf_finetune_gpu.json
    python benchmarks/hf_finetune.py --models tiny-bert minilm --batches 8 32 --tokens 64 \\
        --modes full last-layer --methods vmap auto --no-opacus --no-memory   # the first table

Models (tests/hf_models.py): a tiny random BERT (2 layers, d = 16) and MiniLM (all-MiniLM-L6-v2,
6 layers, d = 384, 22.7M parameters, pretrained from the ``text`` extra; where that package is
missing, e.g. on a GPU machine, the same architecture from its config with random weights, said in
the ``model`` column), each with mean pooling and a linear head, dict batches padded to ``--tokens``.
Per model, mode (``full`` fine-tuning, or ``last-layer``: the last encoder layer and the head) and
batch, interleaved in one process (``common.interleaved_medians``):

* ``non-private``: a torch AdamW step (one batched forward and backward);
* ``dptune <method>``: one ``dpadam`` step as ``dptune.train`` runs it (real gateway and ledger),
  ``grad_method`` 'auto' (the ghost path where its first probe passes) or 'vmap' (vmap refuses these
  models, so the oracle computes one example at a time), named by what runs;
* ``opacus <mode>``: Opacus's ``make_private`` (AdamW, C = 1, ν = 1) with ``grad_sample_mode``
  'hooks' and 'ghost'; where it fails, its error text is the row.

Time: one thread and the process's CPU clock on the CPU (a shared machine's wall time measures the
other jobs); wall clock with ``cuda.synchronize`` on a GPU. Ratio = non-private time / private time
(higher is better, 1 = free). Peak memory: what the step's own model copy, its optimizer or strategy
state and a steady-state step allocate above what was allocated before (after two steps: dptune's first
batch runs one example at a time for the isolation probe; CPU: peak resident memory of a fresh child
process per row during its third step, above its resident memory with the base model loaded; CUDA:
``max_memory_allocated`` during the third call above ``memory_allocated`` before the copy). ``--ops``: aten ops,
CUDA kernel launches and host syncs per step (``op_counts``, torch profiler). Prints a markdown table;
``--json PATH`` writes the rows and the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_device, device_sync, interleaved_medians, machine, strategy_step, table  # noqa: E402
from hf_models import PooledClassifier, freeze_trunk, minilm_classifier, tiny_classifier, token_batch  # noqa: E402

from dptune import inputs  # noqa: E402

N_TRAIN = 10_000
LR = 1e-4


def build(name: str, mode: str) -> tuple[PooledClassifier, str]:
    """The classifier and its label; MiniLM from its config (random weights) without the text extra."""
    if name == "tiny-bert":
        model, label = tiny_classifier("bert", dropout=0.0), name
    else:
        try:
            model, label = minilm_classifier(), "minilm"
        except ImportError:
            import transformers

            transformers.logging.set_verbosity_error()
            cfg = transformers.BertConfig(
                hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )  # fmt: skip
            torch.manual_seed(0)
            model, label = PooledClassifier(transformers.AutoModel.from_config(cfg), 384), "minilm (config)"
    if mode == "last-layer":
        freeze_trunk(model, 1)
    return model.train(), label  # as in fine-tuning (Opacus refuses eval mode); the tiny model has no dropout


def batch(model: PooledClassifier, B: int, T: int) -> tuple[dict, torch.Tensor]:
    vocab = model.encoder.config.vocab_size
    return token_batch(B, T, vocab=vocab, cls=101 % vocab, sep=102 % vocab, seed=B)


def torch_step(m: nn.Module, x: dict, y: torch.Tensor) -> Any:
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(**x), y).backward()
        opt.step()

    return step


def dptune_step(m: nn.Module, x: dict, y: torch.Tensor, method: str) -> Any:
    from dptune.strategies import make_strategy

    strat = make_strategy("dpadam", lr=LR, clip=1.0)
    step, oracle = strategy_step(m, x, y, "cross_entropy", strat, N_TRAIN, inputs.batch_len(x) / N_TRAIN, 1.0, method)
    step.path = "ghost" if oracle.method == "ghost" else "one at a time" if oracle.alone_reason else "vmap"  # type: ignore[attr-defined]
    return step


def opacus_step(m: nn.Module, x: dict, y: torch.Tensor, mode: str) -> Any:
    """Opacus 1.x ``make_private`` at C = 1, ν = 1 on this one batch; raises what Opacus raises."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
    loader = DataLoader(TensorDataset(y), batch_size=len(y))
    kw: dict[str, Any] = dict(
        module=m, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode=mode,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "ghost":
            gm, dpopt, crit, _ = PrivacyEngine().make_private(criterion=nn.CrossEntropyLoss(), **kw)
        else:
            (gm, dpopt, _), crit = PrivacyEngine().make_private(**kw), nn.CrossEntropyLoss()

    def step() -> None:
        dpopt.zero_grad(set_to_none=True)
        crit(gm(**x), y).backward()
        dpopt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
    step.path = mode  # type: ignore[attr-defined]
    return step


def make_step(kind: str, model: nn.Module, x: dict, y: torch.Tensor) -> Any:
    """``kind``: 'nodp', 'dptune:<method>' or 'opacus:<mode>'; the step works on its own copy of the model."""
    m = copy.deepcopy(model).to(y.device)
    if kind == "nodp":
        return torch_step(m, x, y)
    lib, how = kind.split(":")
    return dptune_step(m, x, y, how) if lib == "dptune" else opacus_step(m, x, y, how)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """VmHWM: this process's peak resident memory since its exec (ru_maxrss may be the parent's, kept over exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def peak_child(args: argparse.Namespace) -> None:
    """``--peak-child KIND``: a fresh process building one row's step; prints the peak of its third
    call (after two), in bytes above the resident memory with the base model loaded."""
    torch.set_num_threads(args.threads)
    model, _ = build(args.models[0], args.modes[0])
    x, y = batch(model, args.batches[0], args.tokens)
    try:  # the same kind of step on a tiny model first: lazy imports and one-time setup are not the step's memory
        small = tiny_classifier("bert", dropout=0.0)
        make_step(args.peak_child, small, *batch(small, 2, 8))()
    except Exception:  # noqa: BLE001, S110 - the real step below reports the error
        pass
    base = rss_bytes()
    try:
        step = make_step(args.peak_child, model, x, y)
        step()  # dptune's first calls compute the probe's batch one example at a time: not the steady state
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the resident memory now (Linux ≥ 4.0)
        step()
        print(json.dumps({"peak": peak_rss_bytes() - base}))
    except Exception as exc:  # noqa: BLE001 - reported as the row
        print(json.dumps({"error": error_text(exc)}))


def cpu_peak(kind: str, name: str, mode: str, B: int, args: argparse.Namespace) -> float | None:
    cmd = [sys.executable, __file__, "--peak-child", kind, "--models", name, "--modes", mode]
    cmd += ["--batches", str(B), "--tokens", str(args.tokens), "--threads", str(args.threads)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}  # big blocks mmapped, so freed ones leave the RSS
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env).stdout.strip().splitlines()
    res = json.loads(out[-1]) if out else {}
    return res.get("peak")


def cuda_peak(kind: str, model: nn.Module, x: dict, y: torch.Tensor) -> tuple[Any, float]:
    """The step (built here) and the peak allocation of a steady-state call, above what was allocated before the build."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    step = make_step(kind, model, x, y)
    step()  # dptune's first calls compute the probe's batch one example at a time: not the steady state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return step, torch.cuda.max_memory_allocated() - base


def op_counts(fn: Any, device: str, calls: int = 3) -> dict[str, float]:
    """Per call of ``fn``, from the torch profiler: aten ops (views and nested ops included), kernel
    launches (CUDA) and host syncs (CUDA: stream/device synchronisations; CPU: ``nonzero`` and
    ``item``'s ``_local_scalar_dense``, whose GPU versions sync; ``tolist``/``bool`` reads of a CPU
    tensor are not seen there: ``tests/gradients/test_host_reads.py`` counts those)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    device_sync(device)()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(calls):
            fn()
    ev = [(e.key, e.count / calls) for e in prof.key_averages()]
    syncs = (
        ("cudaStreamSynchronize", "cudaDeviceSynchronize") if cuda else ("aten::nonzero", "aten::_local_scalar_dense")
    )
    return {
        "aten ops": sum(c for k, c in ev if k.startswith("aten::")),
        **({"launches": sum(c for k, c in ev if k.startswith("cudaLaunchKernel"))} if cuda else {}),
        "syncs": sum(c for k, c in ev if k in syncs),
    }


def measure(name: str, mode: str, B: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    model, label = build(name, mode)
    x, y = batch(model, B, args.tokens)
    x, y = {k: v.to(args.device) for k, v in x.items()}, y.to(args.device)
    kinds = ["nodp", *(f"dptune:{m}" for m in args.methods), *(f"opacus:{m}" for m in args.opacus)]
    fns, peaks, rows = {}, {}, {}
    for kind in kinds:
        rows[kind] = {"model": label, "trainable": mode, "batch": B, "step": kind.replace(":", " ")}
        try:
            if args.memory and args.device.startswith("cuda"):
                fns[kind], peaks[kind] = cuda_peak(kind, model, x, y)
            else:
                fns[kind] = make_step(kind, model, x, y)
            rows[kind]["step"] = f"{kind.split(':')[0]} {getattr(fns[kind], 'path', '')}".strip()
        except Exception as exc:  # noqa: BLE001 - a library that cannot run the model: its error is the row
            rows[kind]["error"] = error_text(exc)
            print(kind, rows[kind]["error"], flush=True)
    if args.memory and not args.device.startswith("cuda"):
        peaks = {k: cpu_peak(k, name, mode, B, args) for k in fns}
    sync = device_sync(args.device)
    med = interleaved_medians(fns, rounds=args.rounds, warmup=1, clock=args.clock, sync=sync) if args.rounds else {}
    for kind, row in rows.items():
        if kind in med:
            row |= {"ms": 1e3 * med[kind], "time ratio": med["nodp"] / med[kind]}
        if args.ops and kind in fns:
            row |= op_counts(fns[kind], args.device)
        if peaks.get(kind) is not None and peaks.get("nodp"):
            row |= {"peak MiB": peaks[kind] / 2**20, "memory ratio": peaks[kind] / peaks["nodp"]}
        print(row, flush=True)
    return list(rows.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="0: peak memory only")
    ap.add_argument("--batches", type=int, nargs="+", default=[32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None, help="default: cpu on the CPU, wall on CUDA")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", default=["minilm"], choices=["tiny-bert", "minilm"])
    ap.add_argument("--modes", nargs="+", default=["full"], choices=["full", "last-layer"])
    ap.add_argument("--methods", nargs="+", default=["auto"], choices=["auto", "vmap", "ghost"])
    ap.add_argument("--opacus", nargs="*", default=["hooks", "ghost"], help="Opacus grad_sample_modes ('' for none)")
    ap.add_argument("--no-opacus", dest="opacus", action="store_const", const=[])
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    ap.add_argument("--ops", action="store_true", help="also aten ops, CUDA launches and host syncs per step")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_child:
        return peak_child(args)
    check_device(args.device)
    args.clock = args.clock or ("wall" if args.device.startswith("cuda") else "cpu")
    torch.set_num_threads(args.threads)
    rows = [r for n in args.models for mode in args.modes for B in args.batches for r in measure(n, mode, B, args)]
    where = (
        f"{machine(args.device)}, {args.tokens} tokens, {args.clock} clock, medians of {args.rounds} interleaved rounds"
    )
    print(f"\n{where}\n")
    cols = ["model", "trainable", "batch", "step", "ms", "time ratio", "aten ops", "launches", "syncs", "peak MiB"]
    cols += ["memory ratio", "error"]
    print(table(rows, [c for c in cols if any(c in r for r in rows)]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": where, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
