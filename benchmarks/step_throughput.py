"""Step throughput and peak memory of every strategy against the non-private step.

    python benchmarks/step_throughput.py --quick            # a couple of minutes on 2 cores
    python benchmarks/step_throughput.py                     # all models, 7 rounds
    python benchmarks/step_throughput.py --memory            # + peak RSS per config (subprocesses)

For each model (batch 512), one process times, round-robin: the plain PyTorch
non-private step (forward, backward, SGD update: the reference), dptune's ``nodp``
strategy, and one ``Strategy.step`` of every DP strategy (per-sample norms, weighted
sums, the real ``NoisyRelease`` with its ledger and Gaussian noise, the update) with the
ghost/book-keeping path and with the vmap path, and Opacus (hooks; ghost clipping) when
installed. It prints samples/s and the ratio to the non-private step (medians over the
rounds), and OSO / DP-SGD.

Peak memory (``--memory``): each configuration runs in a fresh subprocess; the peak
resident set (``ru_maxrss``) is reported in total and above an "idle" child that built the
model and batch but ran no step (the PyTorch runtime itself is ~0.3 GB). On CUDA the
script reports ``torch.cuda.max_memory_allocated`` instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MODEL_NAMES,
    batch_for,
    build_model,
    check_device,
    count_params,
    device_sync,
    interleaved_medians,
    machine,
    strategy_step,
    table,
)

STRATEGY_HP: dict[str, dict[str, Any]] = {
    "dpsgd": {"lr": 0.05, "clip": 1.0},
    "oso": {"lr": 0.05, "initial_clip": 0.5},
    "quantile": {"lr": 0.05, "initial_clip": 0.5},
    "adamwosm": {"clip": 1.0},
    "dpadam": {"lr": 1e-3, "clip": 1.0},
}
NOISE_MULTIPLIER = 1.0
N_TRAIN = 60_000


class PerSampleMSE(nn.Module):
    """MSE averaged over each example's elements; ``reduction='none'`` gives the [B] vector (Opacus)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "mean"

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per = (out - y).pow(2).flatten(1).mean(1)
        return per if self.reduction == "none" else per.mean()


def criterion(loss: str) -> nn.Module:
    return nn.CrossEntropyLoss() if loss == "cross_entropy" else PerSampleMSE()


def torch_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str):
    """The reference: one ordinary non-private SGD step."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    crit = criterion(loss)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        crit(m(x), y).backward()
        opt.step()

    return step


def dptune_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str, strategy: str, method: str):
    """One ``strategy.step`` exactly as ``dptune.train`` runs it (real gateway and ledger)."""
    from dptune.strategies import make_strategy

    strat = make_strategy(strategy, **STRATEGY_HP.get(strategy, {}))
    nu = NOISE_MULTIPLIER if strat.private else float("inf")
    return strategy_step(copy.deepcopy(model), x, y, loss, strat, N_TRAIN, x.shape[0] / N_TRAIN, nu, method)


def opacus_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str, ghost: bool):
    """Opacus 1.x DP-SGD step: per-sample hooks, or fast gradient (ghost) clipping."""
    import opacus
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

    m = copy.deepcopy(model)
    crit = criterion(loss)
    B = x.shape[0]
    if ghost:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0, use_ghost_clipping=True)
        opt = DPOptimizerFastGradientClipping(
            torch.optim.SGD(gsm.parameters(), lr=0.05),
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=1.0,
            expected_batch_size=B,
        )
        dploss = DPLossFastGradientClipping(gsm, opt, crit, "mean")

        def step() -> None:
            opt.zero_grad()
            dploss(gsm(x), y).backward()
            opt.step()
    else:
        gsm = opacus.GradSampleModule(m)
        opt = DPOptimizer(
            torch.optim.SGD(gsm.parameters(), lr=0.05),
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=1.0,
            expected_batch_size=B,
        )

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            crit(gsm(x), y).backward()
            opt.step()

    step()
    return step


def configs(name: str, strategies: list[str], methods: list[str], with_opacus: bool) -> list[str]:
    out = ["torch", "nodp"]
    out += [f"{s}/{m}" for m in methods for s in strategies]
    if with_opacus:
        out += ["opacus_hooks", "opacus_ghost"]
    return out


def make_step(cfg: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str):
    if cfg == "torch":
        return torch_step(model, x, y, loss)
    if cfg == "nodp":
        return dptune_step(model, x, y, loss, "nodp", "auto")[0]
    if cfg.startswith("opacus_"):
        return opacus_step(model, x, y, loss, ghost=cfg == "opacus_ghost")
    strategy, method = cfg.split("/")
    step, oracle = dptune_step(model, x, y, loss, strategy, method)
    if method != "vmap" and oracle.method != method:
        print(f"  note: {cfg} fell back to {oracle.method}: {oracle.fallback_reason}")
    return step


def have_opacus() -> bool:
    try:
        import opacus  # noqa: F401

        return True
    except ImportError:
        return False


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with_opacus = not args.no_opacus and have_opacus()
    if not args.no_opacus and not with_opacus:
        print("opacus is not installed: skipping the Opacus comparison (pip install opacus)")
    for name in args.models:
        model = build_model(name).to(args.device)
        x, y, loss = batch_for(name, args.batch)
        x, y = x.to(args.device), y.to(args.device)
        cfgs = configs(name, args.strategies, args.methods, with_opacus)
        fns = {}
        for cfg in cfgs:
            try:
                fns[cfg] = make_step(cfg, model, x, y, loss)
            except Exception as exc:  # an Opacus version without a layer, say: report, go on
                print(f"  {name}: {cfg} unavailable ({type(exc).__name__}: {exc})")
        med = interleaved_medians(
            fns,
            rounds=args.rounds,
            warmup=1,
            min_seconds=args.min_seconds,
            clock=args.clock,
            sync=device_sync(args.device),
        )
        base = med["torch"]
        print(
            f"\n{name} ({count_params(model):,} params), batch {args.batch}: median {args.clock} s/step, {args.rounds} rounds"
        )
        for cfg, t in med.items():
            row = {
                "model": name,
                "config": cfg,
                "ms/step": 1e3 * t,
                "samples/s": args.batch / t,
                "vs non-private": base / t,
            }
            rows.append(row)
            print(f"  {cfg:24s} {1e3 * t:10.1f} ms  {args.batch / t:10.0f} samples/s  {base / t:6.3f}x non-private")
        for m in args.methods:
            if f"oso/{m}" in med and f"dpsgd/{m}" in med:
                print(f"  OSO / DP-SGD step time ({m}): {med[f'oso/{m}'] / med[f'dpsgd/{m}']:.3f}")
    return rows


def child_memory(name: str, cfg: str, batch: int, steps: int) -> dict[str, float]:
    """Run in a fresh process: peak RSS (MiB) after ``steps`` steps of ``cfg`` (0 = idle).

    The peak is VmHWM of /proc/self/status (per address space, reset by exec); ru_maxrss
    would not do: Linux carries it over from the forking parent across execve.
    """
    model = build_model(name)
    x, y, loss = batch_for(name, batch)
    if cfg != "idle":
        step = make_step(cfg, model, x, y, loss)
        for _ in range(steps):
            step()
    out = {"maxrss_mib": peak_rss_mib()}
    if torch.cuda.is_available():
        out["cuda_max_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def peak_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # not Linux: ru_maxrss (KiB on Linux, bytes on macOS)

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with_opacus = not args.no_opacus and have_opacus()
    for name in args.models:
        cfgs = ["idle", *configs(name, args.strategies, args.methods, with_opacus)]
        res = {}
        for cfg in cfgs:
            cmd = [sys.executable, __file__, "--_child", name, cfg, "--batch", str(args.batch)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"  {name}: {cfg} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            res[cfg] = json.loads(out.stdout.strip().splitlines()[-1])
        idle = res["idle"]["maxrss_mib"]
        base = res["torch"]["maxrss_mib"]
        print(
            f"\n{name}: peak RSS (MiB) per config; 'above idle' subtracts the {idle:.0f} MiB of a child that ran no step"
        )
        for cfg, r in res.items():
            if cfg == "idle":
                continue
            row = {
                "model": name,
                "config": cfg,
                "peak MiB": r["maxrss_mib"],
                "vs non-private": r["maxrss_mib"] / base,
                "above idle MiB": r["maxrss_mib"] - idle,
                "above idle vs non-private": (r["maxrss_mib"] - idle) / max(base - idle, 1e-9),
            }
            rows.append(row)
            print(
                f"  {cfg:24s} {r['maxrss_mib']:8.0f} MiB  {row['vs non-private']:5.2f}x   above idle: "
                f"{row['above idle MiB']:7.0f} MiB  {row['above idle vs non-private']:5.2f}x"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    ap.add_argument("--strategies", nargs="+", default=["dpsgd", "oso", "quantile", "adamwosm", "dpadam"])
    ap.add_argument("--methods", nargs="+", default=["ghost", "vmap"], choices=["ghost", "vmap", "auto"])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--device", default="cpu", help="torch device of the models and batches, e.g. cuda")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-seconds", type=float, default=0.05, help="repeat short steps within a slot")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: PyTorch's default)")
    ap.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (use on a busy machine)"
    )
    ap.add_argument("--memory", action="store_true", help="also measure peak RSS in subprocesses")
    ap.add_argument("--no-opacus", action="store_true")
    ap.add_argument("--quick", action="store_true", help="3 rounds, DP-SGD and OSO on the ghost path only")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory and torch.device(args.device).type != "cpu":
        raise SystemExit("--memory measures peak RSS of CPU runs. Fix: drop --memory with --device cuda.")
    if args._child:
        print(json.dumps(child_memory(args._child[0], args._child[1], args.batch, steps=3)))
        return
    if args.quick:
        args.rounds = min(args.rounds, 3)
        args.strategies = [s for s in args.strategies if s in ("dpsgd", "oso")]
        args.methods = ["ghost"]
    print(f"# step throughput: {machine(args.device)}")
    rows = throughput(args)
    cols = ["model", "config", "ms/step", "samples/s", "vs non-private"]
    print("\n" + table(rows, cols))
    if args.memory:
        mrows = memory(args)
        print(
            "\n"
            + table(
                mrows, ["model", "config", "peak MiB", "vs non-private", "above idle MiB", "above idle vs non-private"]
            )
        )
        rows += mrows
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
