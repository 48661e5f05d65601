"""``dptune`` command line: a thin layer over the Python API.

Every user error is printed as one red line naming the fix (exit code 2); no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from dptune.errors import DPTuneError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Differentially private training and honest hyperparameter tuning.",
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


def _fail(msg: str) -> None:
    err_console.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(2)


def _guard(fn):
    """Turn dptune's own errors (and bad values) into one clear line."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (DPTuneError, ValueError, FileNotFoundError, KeyError) as e:
            _fail(str(e) if not isinstance(e, KeyError) else f"missing key {e}")

    return wrapper


def parse_hyperparameters(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs; values parsed as JSON when possible (numbers, true/false, null)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise DPTuneError(f"hyperparameter {pair!r} is not key=value (e.g. --hp lr=0.1).")
        k, v = pair.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


@app.command()
@_guard
def train(
    dataset: str = typer.Option("mnist5k", help="dataset name (dptune.data), e.g. mnist5k, digits, mnist"),
    model: str = typer.Option("auto", help="model name (dptune.models) or 'auto' for the dataset's default"),
    strategy: str = typer.Option("oso", help="nodp, dpsgd, quantile, oso, dpadam, adamwosm, adadp, dpgd"),
    epsilon: float | None = typer.Option(3.0, help="target ε of this run (ignored with --noise-multiplier)"),
    delta: float = typer.Option(1e-5, help="target δ"),
    noise_multiplier: float | None = typer.Option(None, help="use this ν instead of calibrating to ε"),
    epochs: float = typer.Option(5.0, help="epochs (T = epochs / q steps)"),
    batch_size: float = typer.Option(256, help="expected batch size L (Poisson rate q = L/n)"),
    full_batch: bool = typer.Option(False, help="full-batch training (q = 1)"),
    hp: list[str] = typer.Option([], "--hp", help="strategy hyperparameter key=value (repeatable), e.g. --hp lr=0.5"),
    accountant: str = typer.Option("rdp", help="rdp, pld or gdp (full batch only)"),
    eval_every: int = typer.Option(50, help="evaluate on the test split every N steps"),
    seed: int = typer.Option(0),
    data_dir: str | None = typer.Option(None, help="local dataset copies (else $DPTUNE_DATA_DIR / download cache)"),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda if available)"),
    out: Path = typer.Option(Path("dptune-train.json"), help="where to write the JSON result"),
    progress: bool = typer.Option(True, help="show a progress bar"),
) -> None:
    """Train one model with differential privacy and write a JSON result with its ledger."""
    import torch

    from dptune import data as dpdata
    from dptune import models
    from dptune.train import train as run_train

    ds = dpdata.load(dataset, data_dir=data_dir, seed=seed)
    torch.manual_seed(seed)
    net = models.for_dataset(ds) if model == "auto" else models.build(model, **models.kwargs_for(model, ds))
    hparams = parse_hyperparameters(hp)
    result = run_train(
        net, (ds.x_train, ds.y_train), strategy, epochs=epochs,
        expected_batch_size=None if full_batch else batch_size, full_batch=full_batch,
        noise_multiplier=noise_multiplier, target_epsilon=None if noise_multiplier else epsilon,
        delta=delta, accountant=accountant, eval_data=(ds.x_test, ds.y_test), eval_every=eval_every,
        seed=seed, device=device, progress=progress, **hparams,
    )
    summary = result.summary()
    out.write_text(json.dumps({**result.to_dict(), "dataset": dataset, "model": model}, default=str))
    t = Table(title=f"dptune train: {strategy} on {dataset}")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    rows = [
        ("steps T", summary["steps"]), ("sampling rate q", f"{summary['sampling_rate']:.4g}"),
        ("noise multiplier ν", f"{summary['noise_multiplier']:.4g}"),
        (f"best {result.metric}", f"{result.best_metric:.4f}" if result.best_metric is not None else "-"),
        ("best step", result.best_step), ("diverged", result.diverged),
        ("ε spent (RDP)", "∞" if not result.plan.strategy.private else f"{result.epsilon(delta):.4f}"),
        ("δ", delta), ("seconds", f"{summary['seconds']:.1f}"), ("result", str(out)),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)


@app.command()
@_guard
def account(
    noise_multiplier: float = typer.Option(..., help="per-step noise multiplier ν"),
    sampling_rate: float = typer.Option(..., help="Poisson sampling rate q = L/n (1 = full batch)"),
    steps: int = typer.Option(..., help="number of steps T"),
    delta: float = typer.Option(1e-5),
    runs: int = typer.Option(1, help="number of runs composed (per-grid accounting)"),
    accountant: str = typer.Option("all", help="rdp, pld, gdp or all"),
) -> None:
    """ε(δ) of T Poisson-sampled Gaussian steps (× runs)."""
    from dptune import accounting

    accounting.check_sampling_rate(sampling_rate)
    event = accounting.dpsgd_event(noise_multiplier, sampling_rate, steps, runs)
    names = ["rdp", "pld"] + (["gdp"] if sampling_rate >= 1 else []) if accountant == "all" else [accountant]
    t = Table(title=f"ν={noise_multiplier:g}, q={sampling_rate:g}, T={steps}, runs={runs}, δ={delta:g}")
    t.add_column("accountant")
    t.add_column("ε", justify="right")
    for name in names:
        t.add_row(name, f"{accounting.epsilon(event, delta, name):.4f}")
    console.print(t)


@app.command()
@_guard
def calibrate(
    epsilon: float = typer.Option(..., help="target total ε"),
    delta: float = typer.Option(1e-5),
    sampling_rate: float = typer.Option(..., help="q = L/n (1 = full batch)"),
    steps: int = typer.Option(..., help="steps per run"),
    runs: int = typer.Option(1, help="runs composed (e.g. grid size)"),
    accountant: str = typer.Option("rdp", help="rdp, pld or gdp"),
) -> None:
    """Smallest noise multiplier ν meeting (ε, δ): never overshoots the target."""
    from dptune import accounting

    nu = accounting.calibrate(epsilon, delta, sampling_rate, steps, runs, accountant)
    achieved = accounting.epsilon(accounting.dpsgd_event(nu, sampling_rate, steps, runs), delta, accountant)
    console.print(f"ν = [bold]{nu:.6g}[/]  (ε achieved {achieved:.6g} ≤ {epsilon:g} at δ = {delta:g}, {accountant})")


def main() -> None:  # pragma: no cover
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)

