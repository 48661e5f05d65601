"""Per-sample norms and one weighted sum of a convolutional model (the private part of a DP step),
by the two ways dptune can compute kept convolution gradients, side by side in one process.

    python benchmarks/conv_per_sample.py --device cuda              # ~10 s on an H100 or H200
    python benchmarks/conv_per_sample.py --device cpu --batch 64    # the CPU default, for reference

Variants (all in exact float32, as every private computation runs; ``grads.ieee_matmul``):

* ``grouped, deterministic``: the native convolution backward with the batch folded into B channel
  groups, cuDNN restricted to deterministic kernels (what dptune did on CUDA until issue 15's
  slice: ``ieee_matmul`` forced determinism).
* ``grouped``: the same kernel, cuDNN free to choose (the CPU default).
* ``patches + bmm``: strided views of the input copied once into GEMM layout, then one batched
  GEMM per chunk (``ghost.use_unfold_products``; the CUDA default now).
* ``torch step``: forward + backward + SGD update of the plain non-private model, for scale.

Each variant is checked against the first before timing (norms to 1e-4 relative), so a faster
path that computes something else cannot win. Measured (docs/performance.md): H200, 7.96 ms
grouped against 4.97 ms patches + bmm; CPU (2 cores, batch 64) 33 against 60 ms.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import batch_for, build_model, check_device, device_sync, interleaved_medians, machine, table  # noqa: E402

from dptune.gradients import ghost  # noqa: E402
from dptune.gradients.oracle import GradientOracle  # noqa: E402


def _private_part(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str) -> Callable[[], torch.Tensor]:
    params = {k: p.detach() for k, p in model.named_parameters()}
    oracle = GradientOracle(model, loss, method="ghost")
    w = torch.linspace(0.5, 1.5, x.shape[0], device=x.device)

    def run() -> torch.Tensor:
        got = oracle(params, x, y)
        norms = got.norms
        got.weighted_sum(w)
        return norms

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="galli_cnn", choices=["galli_cnn", "galli_autoencoder"])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    device = check_device(a.device)
    model = build_model(a.model).to(device)
    x, y, loss = batch_for(a.model, a.batch)
    x, y = x.to(device), y.to(device)
    cudnn = torch.backends.cudnn
    user_det = cudnn.deterministic

    def variant(unfold: bool, deterministic: bool) -> Callable[[], torch.Tensor]:
        run = _private_part(model, x, y, loss)

        def call() -> torch.Tensor:
            saved = ghost.use_unfold_products
            ghost.use_unfold_products = lambda dev, transposed, size: unfold and not transposed  # type: ignore[assignment]
            cudnn.deterministic = deterministic
            try:
                return run()
            finally:
                ghost.use_unfold_products = saved  # type: ignore[assignment]
                cudnn.deterministic = user_det

        return call

    fns = {
        "grouped, deterministic": variant(False, True),
        "grouped": variant(False, False),
        "patches + bmm": variant(True, False),
    }
    ref = fns["grouped, deterministic"]()
    for name, f in fns.items():
        torch.testing.assert_close(f(), ref, rtol=1e-4, atol=1e-7, msg=name)

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    lossf = torch.nn.functional.cross_entropy if loss == "cross_entropy" else torch.nn.functional.mse_loss

    def torch_step() -> None:
        opt.zero_grad()
        lossf(model(x), y).backward()
        opt.step()

    times = interleaved_medians({**fns, "torch step": torch_step}, rounds=a.rounds, sync=device_sync(device))
    base = times["grouped, deterministic"]
    rows = [
        {"variant": k, "ms": round(1e3 * t, 3), "speed-up vs grouped, deterministic": round(base / t, 2)}
        for k, t in times.items()
    ]
    print(f"{a.model}, batch {a.batch}, {machine(device)}")
    print(table(rows, ["variant", "ms", "speed-up vs grouped, deterministic"]))
    if a.json:
        a.json.write_text(json.dumps({"machine": machine(device), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
