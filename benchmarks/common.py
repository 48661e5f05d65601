"""Shared helpers of the benchmark scripts (not tests): models, synthetic batches, timing.

Every script prints *ratios measured side by side in one process*: the configurations
are interleaved round by round (so a burst of load from other processes hits all of
them alike) and each ratio is a ratio of medians over the rounds.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

MODEL_NAMES = ("galli_cnn", "galli_autoencoder", "galli_bow_fc", "mlp")


def build_model(name: str, seed: int = 0) -> nn.Module:
    """The Galli models and the MLP 784-128-128-10 from ``dptune.models`` (equivalents if absent)."""
    torch.manual_seed(seed)
    try:
        from dptune import models

        return models.build(name)
    except (ImportError, AttributeError):  # pragma: no cover - only before dptune.models existed
        return _fallback_model(name)


def _fallback_model(name: str) -> nn.Module:
    if name == "galli_cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 8, padding=3),
            nn.ReLU(),
            nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 23 * 23, 32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )
    if name == "galli_autoencoder":
        ch = (1, 8, 16, 32, 64)
        enc = [m for i in range(4) for m in (nn.Conv2d(ch[i], ch[i + 1], 3), nn.LeakyReLU())]
        dec = [m for i in range(4, 0, -1) for m in (nn.ConvTranspose2d(ch[i], ch[i - 1], 3), nn.LeakyReLU())]
        dec[-1] = nn.Sigmoid()
        return nn.Sequential(*enc, *dec)
    if name == "galli_bow_fc":
        return nn.Sequential(
            nn.Linear(750, 128), nn.LeakyReLU(), nn.Linear(128, 128), nn.LeakyReLU(), nn.Linear(128, 4)
        )
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )
    raise ValueError(name)


def batch_for(name: str, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A synthetic batch of the model's input shape, its targets and the loss name."""
    g = torch.Generator().manual_seed(seed)
    if name == "galli_autoencoder":
        x = torch.rand(batch, 1, 28, 28, generator=g)
        return x, x.clone(), "mse"
    if name == "galli_cnn":
        return torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g), "cross_entropy"
    if name == "galli_bow_fc":
        return torch.randn(batch, 750, generator=g), torch.randint(0, 4, (batch,), generator=g), "cross_entropy"
    if name == "mlp":
        return torch.rand(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g), "cross_entropy"
    raise ValueError(name)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    min_seconds: float = 0.0,
    clock: str = "wall",
    sync: Callable[[], object] = lambda: None,
) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin ``rounds`` times.

    A call shorter than ``min_seconds`` is repeated within its slot and averaged, so that
    sub-millisecond steps are not dominated by timer and scheduler noise. ``clock='cpu'``
    times this process's CPU seconds (all its threads): on a machine shared with other
    jobs it is much less noisy than wall time (use it with one thread, where CPU time is
    wall time minus preemption). ``sync`` waits for queued device work (``device_sync``): CUDA
    kernels run asynchronously, so a slot ends only when its kernels have finished.
    """
    now = CLOCKS[clock]
    for f in fns.values():
        for _ in range(warmup):
            f()
    sync()
    reps = {}
    for k, f in fns.items():
        t0 = now()
        f()
        sync()
        dt = now() - t0
        reps[k] = max(1, int(min_seconds / max(dt, 1e-6)))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = now()
            for _ in range(reps[k]):
                f()
            sync()
            times[k].append((now() - t0) / reps[k])
    return {k: statistics.median(v) for k, v in times.items()}


def device_sync(device: str) -> Callable[[], object]:
    """A function that waits for ``device``'s queued kernels (a no-op on the CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def check_device(device: str) -> str:
    """``device`` if torch can use it, else exit with one clear line (no traceback)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {device}: this PyTorch build sees no CUDA GPU. Fix: run on a GPU machine or drop --device."
        )
    return device


def machine(device: str = "cpu") -> str:
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    where = ""
    if torch.device(device).type == "cuda":
        where = f", GPU {torch.cuda.get_device_name(torch.device(device))}"
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load avg {load:.1f}{where}"
    )


def table(rows: list[dict[str, object]], cols: list[str]) -> str:
    """A markdown table (pasted as is into docs/performance.md)."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def strategy_step(
    model: nn.Module, x: object, y: torch.Tensor, loss: str, strategy: object, n: int, q: float, nu: float, method: str
) -> tuple[Callable[[], None], object]:
    """One ``strategy.step`` exactly as ``dptune.train`` runs it (real gateway, ledger and noise), on
    ``model``'s own parameters; the first call (the oracle's probe, lazy initialisation) runs here,
    outside any timing. Returns (step, oracle)."""
    import warnings

    from dptune.gradients.oracle import GradientOracle
    from dptune.release.context import RunPlan, StepContext
    from dptune.release.ledger import Ledger
    from dptune.release.mechanisms import NoiseSource, NoisyRelease

    oracle = GradientOracle(model, loss, method=method)
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}  # updates are out of place
    run = RunPlan(strategy, n, q, 10_000, nu)  # type: ignore[arg-type]
    state = {"params": params, "state": strategy.init(params, run), "t": 0}  # type: ignore[attr-defined]
    gateway = NoisyRelease(Ledger(), q, NoiseSource(0, y.device))

    def step() -> None:
        state["t"] += 1
        ctx = StepContext(t=state["t"], x=x, y=y, oracle=oracle, release=gateway, run=run)
        state["params"], state["state"], _ = strategy.step(state["params"], state["state"], ctx)  # type: ignore[attr-defined]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one-at-a-time notice of HF models
        step()
    return step, oracle
