"""Faults and bad input: fuzzed study configs and CLI arguments give clear errors, never tracebacks;
a study survives SIGKILL at random points (the reduced version of ``scripts/kill_test.py``).

Study-level divergence (a diverged run is marked diverged and its spend stays in the ledger) is
tested in test_tune_study.py; corrupted/truncated dataset files in test_data.py.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dptune.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- study configs
BASE: dict[str, Any] = {
    "study": {"name": "fuzz", "seeds": [0], "seed": 0},
    "data": {"name": "digits", "options": {"flatten": True}},
    "model": {"name": "logistic_regression"},
    "training": {"steps": 10, "expected_batch_size": 32},
    "budget": {"epsilon": 2.0, "delta": 1e-5, "accountant": "rdp"},
    "method": {"name": "grid"},
    "selection": {"mode": "public", "eval_every": 5},
    "strategies": [{"name": "dpsgd", "space": {"lr": [0.1, 1.0]}, "fixed": {"clip": 1.0}}],
}
KEYS = sorted(
    {k for sec in BASE.values() if isinstance(sec, dict) for k in sec}
    | {
        "epochs",
        "full_batch",
        "n",
        "gamma",
        "mode",
        "split",
        "label",
        "space",
        "fixed",
        "threads_per_run",
        "holdout_fraction",
        "checkpoint",
        "across_seeds",
        "noise_multiplier",
        "metric",
        "bogus",
    }
)
TOKENS = [
    "dpsgd",
    "oso",
    "grid",
    "random",
    "online",
    "liu-talwar",
    "public",
    "private",
    "holdout",
    "test",
    "rdp",
    "pld",
    "gdp",
    "auto",
    "digits",
    "mnist",
    "logistic_regression",
    "accuracy",
    "mse",
    "best",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(TOKENS),
    st.sampled_from([0, 1, -1, 1e-5, 0.5, 2.0, 1e300, -0.0]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), inner, max_size=3),
    ),
    max_leaves=6,
)


def _paths(d: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(cfg: dict, data: st.DataObject) -> dict:
    """Replace, delete or add 1–3 entries of a valid config, anywhere in the tree."""
    cfg = copy.deepcopy(cfg)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(cfg)
        path = data.draw(st.sampled_from(paths))
        parent: Any = cfg
        for p in path[:-1]:
            parent = parent[p]
        op = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if op == "replace" or not isinstance(parent, dict):
            parent[path[-1]] = data.draw(values)
        elif op == "delete":
            del parent[path[-1]]
        else:
            parent[data.draw(st.sampled_from(KEYS))] = data.draw(values)
        if not isinstance(cfg, dict):
            break
    return cfg


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_study_configs_give_config_errors_only(data: st.DataObject) -> None:
    from dptune.tune import study_from_dict

    cfg = _mutate(BASE, data)
    try:
        study_from_dict(cfg)
    except ConfigError as exc:
        msg = str(exc)
        assert msg and "Traceback" not in msg
        # the message names a place in the config or the fix
        assert any(w in msg for w in ("Fix", "fix", ":", "choose", "must")), msg


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.builds(
            lambda a, b: a + b,
            st.sampled_from(
                [
                    "[study]\nname = 'x'\n",
                    "[data]\nname = 'digits'\n",
                    "[[strategies]]\nname = 'dpsgd'\n",
                    "[budget]\nepsilon = ",
                ]
            ),
            st.text(max_size=60),
        ),
    ),
    suffix=st.sampled_from([".toml", ".yaml", ".json"]),
)
def test_fuzzed_study_files_give_config_errors_only(text: str, suffix: str) -> None:
    from dptune.tune import load_study_config

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / f"study{suffix}"
        try:
            p.write_text(text, encoding="utf-8")
        except UnicodeEncodeError:  # lone surrogates cannot be written to a file at all
            return
        with pytest.raises(ConfigError):
            load_study_config(p)


# ----------------------------------------------------------------------------- CLI
numbers = st.one_of(
    st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e400", "abc", "", "0.5", "1e-5", "2", "3.0", "1,5"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**4), 10**4).map(str),
    st.text(max_size=6),
)


def _cli_args(draw: st.DrawFn) -> list[str]:
    cmd = draw(
        st.sampled_from(
            [
                "account",
                "calibrate",
                "train",
                "bogus",
                "--help-me",
                "",
                "status",
                "resume",
                "report",
                "tune",
                "reproduce",
                "audit",
            ]
        )
    )
    args = [cmd] if cmd else []
    if cmd in ("status", "resume", "report", "tune"):
        # never a real study: missing paths, a file, an empty or a non-study folder
        args.append(draw(st.sampled_from(["/no/such/dir", "/etc/hostname", "/tmp", "", "x.toml", "/etc"])))
        if cmd in ("resume", "tune"):
            args += draw(st.sampled_from([[], ["--executor", "bogus"], ["--workers", "-1"], ["--executor", "local"]]))
        return args
    if cmd == "reproduce":
        args.append(draw(st.sampled_from(["no-such-preset", "galli", "", "galli-mnist"])))
        args += ["--scale", draw(st.sampled_from(["huge", "", "SMOKE", "tiny"]))]  # never a valid scale
        return args
    if cmd == "audit":
        args += ["--strategy", draw(st.sampled_from(["nonsense", "", "nodp", "dp sgd"]))]  # never auditable
        args += ["--eps", draw(numbers)]
        return args
    if cmd == "account":
        opts = ["--noise-multiplier", "--sampling-rate", "--steps", "--delta", "--runs", "--accountant", "--bad"]
    elif cmd == "calibrate":
        opts = ["--epsilon", "--delta", "--sampling-rate", "--steps", "--runs", "--accountant", "--bad"]
    else:
        opts = ["--epsilon", "--delta", "--strategy", "--accountant", "--batch-size", "--epochs", "--hp"]
    for opt in draw(st.lists(st.sampled_from(opts), max_size=6)):
        if opt == "--accountant":
            val = draw(st.sampled_from(["rdp", "pld", "gdp", "all", "rpd", ""]))
        elif opt == "--strategy":
            val = draw(st.sampled_from(["dpsgd", "oso", "nonsense", ""]))
        elif opt == "--hp":
            val = draw(st.sampled_from(["lr=0.1", "lr", "=", "clip=-1", "nope=3", "lr=nan"]))
        elif opt == "--steps" or opt == "--runs":
            val = draw(st.one_of(st.integers(-5, 200).map(str), numbers))
        else:
            val = draw(numbers)
        args += [opt, val]
    if cmd == "train":
        # never a complete valid training: the dataset does not exist (the run would be slow)
        args += ["--dataset", draw(st.sampled_from(["no-such-dataset", "", "../etc/passwd", "mnist?"]))]
    return args


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=st.composite(lambda draw: _cli_args(draw))())
def test_fuzzed_cli_arguments_never_raise_tracebacks(args: list[str]) -> None:
    from typer.testing import CliRunner

    from dptune.cli import app

    result = CliRunner().invoke(app, args, catch_exceptions=True)
    # an uncaught exception would have been a traceback for the user
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"dptune {' '.join(args)!s} raised {type(result.exception).__name__}: {result.exception}"
    )
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output[-500:])


# ----------------------------------------------------------------------------- SIGKILL
@pytest.mark.slow
def test_study_survives_sigkill_at_random_points() -> None:
    """Reduced CI version of scripts/kill_test.py (20 points there, 2 here)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "kill_test.py"), "--points", "2", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("identical to the reference") == 2
