"""Bad input to `dptune account` (issue 13): one clear line, never a traceback or a huge allocation."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dptune.cli import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--noise-multiplier", "nan"], "noise_multiplier must be > 0"),
        (["--noise-multiplier", "0"], "noise_multiplier must be > 0"),
        (["--noise-multiplier", "1", "--steps", "0"], "--steps and --runs must be ≥ 1"),
    ],
)
def test_account_refuses_bad_input_with_one_clear_line(args: list[str], message: str) -> None:
    base = {"--noise-multiplier": "1", "--sampling-rate": "0.1", "--steps": "10"}
    argv = dict(base, **dict(zip(args[::2], args[1::2], strict=True)))
    res = CliRunner().invoke(app, ["account", *[x for kv in argv.items() for x in kv]])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    (line,) = res.output.strip().splitlines()  # one line naming the fix
    assert line.startswith("error:") and message in line and "Fix:" in line, line
    assert "count" not in line and "cannot convert" not in line  # the old messages


def test_account_with_a_tiny_noise_multiplier_does_not_build_a_huge_pld_grid() -> None:
    """ν = 1e-6 once asked numpy for 35 PiB (PLD's grid grows with ε): RDP's ε is printed and
    PLD says why it is skipped."""
    res = CliRunner().invoke(app, ["account", "--noise-multiplier", "1e-6", "--sampling-rate", "0.1",
                                   "--steps", "10"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "not computed" in res.output and "rdp" in res.output
