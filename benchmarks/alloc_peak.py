"""GPU memory measured without a GPU: the peak of live tensor bytes over a steady-state step, the quantity
``torch.cuda.max_memory_allocated`` reports, counted on the CPU by a dispatch mode that follows every
tensor storage from its allocation to its release; and which allocations are alive at that peak.

The steps are ``hf_finetune``'s (same model, batch, optimizer, ``dptune`` step), MiniLM's architecture
from its config as on the GPU. ``--gpu-path`` takes the float64 Gram path of A100/H100/H200/B200
(``norm_bounds.fast_fp64``), as those GPUs run it. On an H200 this estimator's rows were within 1-3 % of
``max_memory_allocated`` (non-private 967 vs 959 MiB; ``dpadam`` 1,725 vs 1,678 MiB, code of a70f06b).
Not counted: library workspaces (cuBLAS, cuDNN), the caching allocator's rounding, a CUDA graph's pool.

    python benchmarks/alloc_peak.py --gpu-path            # MiniLM full fine-tuning, batch 32, 128 tokens
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_finetune  # noqa: E402 - after the path


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made under the mode and still alive; ``peak`` their maximum, ``at_peak`` the
    ≥ 1 MiB ones alive then, by operation and call site."""

    dptune_rowwise = True  # it only measures: dptune's private passes accept it (``isolation.check_modes``)

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._where: dict[int, tuple[int, str]] = {}
        self.at_peak: dict[int, tuple[int, str]] = {}

    def _freed(self, key: int, n: int) -> None:
        self.live -= n
        self._where.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            if id(s) in self._where:  # a view of a counted storage (ids are dropped with the storage)
                continue
            n = s.nbytes()
            self.live += n
            self._where[id(s)] = (n, f"{func.__name__} {_site()}" if n >= 1 << 20 else "")
            weakref.finalize(s, self._freed, id(s), n)
        if self.live > self.peak:
            self.peak, self.at_peak = self.live, dict(self._where)
        return out


def _site() -> str:
    keep = ("/dptune/", "/transformers/", "hf_finetune")
    frames = [f for f in traceback.extract_stack() if any(k in f.filename for k in keep)]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-2:][::-1])


def measure(kind: str, args: argparse.Namespace) -> tuple[float, list[tuple[str, float]]]:
    model, _ = hf_finetune.build(args.model, "full")
    x, y = hf_finetune.batch(model, args.batch, args.tokens)
    mode = LiveBytes()
    with mode:  # from before the step is built, as the GPU benchmark's base
        step = hf_finetune.make_step(kind, model, x, y)
        step()  # the first step: the probe, lazy state
        gc.collect()
        mode.peak = mode.live
        step()
    by: collections.Counter[str] = collections.Counter()
    for n, where in mode.at_peak.values():
        if where:
            by[where] += n
    return mode.peak / 2**20, [(w, n / 2**20) for w, n in by.most_common(args.top)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minilm", choices=["minilm", "tiny-bert"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gpu-path", action="store_true", help="the float64 Gram forms of A100/H100/H200/B200")
    ap.add_argument("--graphs", action="store_true", help="the CUDA-graph path (captured state kept between steps)")
    ap.add_argument("--pretrained", action="store_true", help="MiniLM's own weights (the text extra), dropout 0.1")
    ap.add_argument("--top", type=int, default=12, help="allocations alive at the peak to list")
    args = ap.parse_args()
    if args.gpu_path:
        from dptune.gradients import norm_bounds

        norm_bounds.fast_fp64 = lambda device: True  # type: ignore[assignment]
    if args.graphs:  # tensors a graph keeps stay alive; a real pool also keeps the blocks freed during capture
        from dptune.gradients import graphed

        graphed.replayable = lambda device: True  # type: ignore[assignment]
    if not args.pretrained:  # as on the GPU machine: the architecture from its config
        hf_finetune.minilm_classifier = _config_only  # type: ignore[assignment]
    torch.set_num_threads(2)
    rows: dict[str, Any] = {}
    for kind in ("nodp", "dptune:auto"):
        rows[kind] = measure(kind, args)
    base = rows["nodp"][0]
    print(f"{args.model}, batch {args.batch}, {args.tokens} tokens, {'GPU' if args.gpu_path else 'CPU'} path")
    print("| step | peak MiB | vs non-private |\n|---|---|---|")
    for kind, (peak, _) in rows.items():
        print(f"| {kind} | {peak:,.0f} | {peak / base:.2f} |")
    for kind, (_, top) in rows.items():
        print(f"\nalive at the peak of {kind} (≥ 1 MiB, made during the step):")
        for where, mib in top:
            print(f"  {mib:8.1f} MiB  {where}")


def _config_only(**_: object) -> Any:
    raise ImportError  # hf_finetune.build then builds MiniLM's architecture from its config


if __name__ == "__main__":
    main()
