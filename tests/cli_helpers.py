"""CLI calls shared by the tests: a small `dptune train` run, and a call that must be refused with one line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from typer.testing import CliRunner, Result

from dptune.cli import app

# `dptune train` on the user's own data and model (tests/own_factories.py) instead of --dataset
OWN_FACTORIES = ("--data", "own_factories:load_data", "--model", "own_factories:make_model")


def invoke_train(
    out: Path,
    *extra: str,
    data: Sequence[str] = ("--dataset", "digits"),
    epochs: str = "0.2",
    batch_size: str = "64",
    eval_every: str | None = "2",
    hps: Sequence[str] = ("lr=0.5", "clip=1.0"),
) -> Result:
    """`dptune train` of DP-SGD (by default on digits, lr 0.5, clip 1), release JSON to ``out``,
    ``extra`` options appended; the caller checks the exit code."""
    args = ["train", *data, "--strategy", "dpsgd", "--epochs", epochs, "--batch-size", batch_size]
    for hp in hps:
        args += ["--hp", hp]
    if eval_every is not None:
        args += ["--eval-every", eval_every]
    from dptune import cli

    width = cli.console.width  # wide enough for the table's rows whatever the length of tmp_path (xdist's is longer)
    cli.console.width = 160
    try:
        return CliRunner().invoke(app, [*args, "--no-progress", "--out", str(out), *extra])
    finally:
        cli.console.width = width


def one_error_line(args: list[str]) -> str:
    """The output of a CLI call that must fail with exactly one clear line naming the fix (exit code 2)."""
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Fix:" in lines[0], res.output
    return lines[0]
