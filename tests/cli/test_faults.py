"""Faults and bad input: fuzzed study configs and CLI arguments give clear errors, never tracebacks;
a study survives SIGKILL at random points (the reduced version of ``scripts/kill_test.py``).

Study-level divergence (a diverged run is marked diverged and its spend stays in the ledger) is
tested in test_tune_study.py; corrupted/truncated dataset files in test_data.py.
"""

from __future__ import annotations

import copy
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tune_helpers import tiny_study_toml

from dptune.errors import ConfigError

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
# Every command is fuzzed with the kinds of input issue 13 found mishandled: wrong file types,
# paths, devices, booleans, huge numbers, damaged study stores and unreachable Ray clusters.
# A value drawn from a "bad" list must be refused (exit code 2), and a refusal leaves no new
# directory behind. Commands that train or run a study always get at least one bad value, so
# (refused before any work) no example trains for long; a fault found late shows up as a slow
# example or a left-over directory.
HUGE = ["1e12", "1e308", "-0", "1e-320", "1000000000000"]
BAD_NUMBERS = ["-0", "0", "-1", "nan", "inf", "-inf", "1e400", "abc", "", "1,5"]  # bad for any positive quantity
numbers = st.one_of(
    st.sampled_from(BAD_NUMBERS + HUGE + ["0.5", "1e-5", "2", "3.0"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**4), 10**4).map(str),
    st.text(max_size=6),
)

FUZZ_STUDY = tiny_study_toml("fz", steps=2)
FUZZ_ARM = "dpsgd@eps=2"
# A 1×1 PNG: an image where a study file is expected.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010800000000"
    "3a7e9b550000000a49444154789c6360000000020001e221bc330000000049454e44ae426082"
)
# Study directories, made in each example's folder when an argument names them.
STORES = ("S-ok", "S-truncated", "S-garbage", "S-empty", "S-unplanned", "S-nodb")
BAD_STORES = [s for s in STORES if s != "S-ok"] + ["adir", "afile.txt", "garbage.bin", "missing", "afile.txt/x", ".."]


def _bad_devices() -> list[str]:
    import torch

    bad = ["tpu", "", "cuda:99", "CPU:1", "cuda:-1", "gpu"]
    if not torch.cuda.is_available():  # this machine's torch has no CUDA: 'cuda' must be refused
        bad.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_available():
        bad.append("mps")
    return bad


# Study-file injections: (TOML text to replace, replacement); each makes the study invalid.
CONFIG_FAULTS = [
    ("[training]\n", '[training]\ndevice = "{device}"\n'),
    ("[training]\n", '[training]\nfull_batch = "maybe"\n'),
    ("[training]\n", '[training]\nfull_batch = "yes"\n'),
    ("[training]\n", "[training]\nfull_batch = 2\n"),
    ("flatten = true", 'flatten = "maybe"'),
    ("flatten = true", "flatten = 2"),
    ("steps = 2", "steps = 1000000000000"),
    ("steps = 2", "steps = 1e308"),
    ("steps = 2", "steps = -0.0"),
    ("steps = 2", "steps = 1e-320"),
    ("expected_batch_size = 64", "expected_batch_size = 1e12"),
    ("expected_batch_size = 64", "expected_batch_size = 1e-320"),
    ("expected_batch_size = 64", "expected_batch_size = -0.0"),
    ("epsilon = 2.0", "epsilon = -0.0"),
    ("epsilon = 2.0", 'epsilon = "three"'),
    ("epsilon = 2.0", "epsilon = nan"),
    ("epsilon = 2.0", "epsilonn = 2.0"),
    ("delta = 1e-5", "delta = 1e308"),
    ("delta = 1e-5", "delta = -0.0"),
    ('name = "fz"', 'name = "a/.."'),
    ('name = "fz"', 'name = ".."'),
    ('accountant = "rdp"', 'accountant = "rpd"'),
]
RAY_FAULTS = [
    ["--executor", "ray", "--address", "127.0.0.1:1"],  # nothing listens on port 1
    ["--executor", "ray", "--address", "ray://127.0.0.1:1"],
    ["--executor", "ray", "--address", ""],
    ["--executor", "ray", "--address", "127.0.0.1:port"],
    ["--executor", "local", "--address", "127.0.0.1:1"],  # an address only Ray uses
    ["--executor", "bogus"],
    ["--workers", "0"],
    ["--workers", "-1"],
]


def _cli_args(draw: st.DrawFn) -> tuple[list[str], bool, tuple[str, str] | None]:
    """(argv, whether a bad value was drawn, the study-file injection if any)."""
    bad = False

    def pick(good: list[Any], faults: list[Any]) -> Any:
        nonlocal bad
        value, is_bad = draw(st.sampled_from([(g, False) for g in good] + [(f, True) for f in faults]))
        bad |= is_bad
        return value

    def faults(pool: dict[str, list[list[str]]]) -> dict[str, list[str]]:
        """1–3 bad options of a command, each a drawn argv fragment."""
        nonlocal bad
        bad = True
        names = draw(st.lists(st.sampled_from(sorted(pool)), min_size=1, max_size=3, unique=True))
        return {n: draw(st.sampled_from(pool[n])) for n in names}

    devices = _bad_devices()
    cmd = draw(
        st.sampled_from(
            ["account", "calibrate", "train", "tune", "status", "resume", "report", "export"]
            + ["reproduce", "demo", "audit", "bogus", "--help-me"]
        )
    )
    if cmd in ("bogus", "--help-me"):
        return [cmd], True, None
    args = [cmd]
    injection = None
    if cmd in ("account", "calibrate"):
        first = "--noise-multiplier" if cmd == "account" else "--epsilon"
        opts = [first, "--sampling-rate", "--steps", "--delta", "--runs", "--accountant", "--bad"]
        for opt in draw(st.lists(st.sampled_from(opts), max_size=6, unique=True)):  # click keeps the last one
            if opt == "--accountant":
                val = pick(["rdp", "pld", "all" if cmd == "account" else "auto"], ["rpd", ""])
            elif opt == "--bad":
                val, bad = "1", True
            else:
                val = draw(
                    st.one_of(st.integers(-5, 200).map(str), numbers) if opt in ("--steps", "--runs") else numbers
                )
                bad |= val in BAD_NUMBERS
            args += [opt, val]
        return args, bad, None
    if cmd == "train":
        got = faults(
            {
                "device": [["--device", d] for d in devices],
                "out": [["--out", "adir"], ["--out", "afile.txt/r.json"]],
                "diagnostics": [["--diagnostics-out", "adir"], ["--diagnostics-out", "afile.txt/d.json"]],
                # a file; below a file; a folder that is not empty (no --overwrite); a folder no file can be made in
                "save": [["--save", "afile.txt"], ["--save", "afile.txt/model"], ["--save", "S-ok"]]
                + ([["--save", "/proc/x"]] if Path("/proc/self").exists() else []),
                "hp": [
                    ["--strategy", "oso", "--hp", "adapt_lr=maybe"],
                    ["--strategy", "oso", "--hp", "adapt_lr=2"],
                    ["--hp", "lr=yes"],
                    ["--hp", "nope=3"],
                    ["--hp", "lr"],
                ],
                "epochs": [["--epochs", v] for v in ("-0", "0", "nan", "inf", "1e308")],
                "batch": [["--batch-size", v] for v in ("1e12", "-0", "1e-320", "nan")],
                "epsilon": [["--epsilon", v] for v in ("-0", "nan", "inf", "1e308")],
                "delta": [["--delta", v] for v in ("-0", "1", "1e308", "nan")],
                "noise": [["--noise-multiplier", v] for v in ("1e-320", "1e308", "-0", "nan", "inf")],
                "seed": [["--seed", "-1"], ["--seed", "1000000000000000000000000"]],
                "eval": [["--eval-every", "0"], ["--eval-every", "-1"]],
                "data_dir": [["--data-dir", v] for v in ("afile.txt", "missing-dir", "garbage.bin")],
                "dataset": [["--dataset", v] for v in ("no-such-dataset", "", "../etc/passwd", "adir", "garbage.bin")],
                "model": [["--model", v] for v in ("galli_cnn", "image.png", "no_such_model", "a:b")],
                "accountant": [["--accountant", "rpd"], ["--accountant", ""]],
                "flag": [["--full-batch", "maybe"], ["--secure", "2"], ["--progress", "yes"]],
            }
        )
        if "noise" in got:  # --epsilon is ignored with --noise-multiplier
            got.pop("epsilon", None)
        args += [x for frag in got.values() for x in frag]
        if "dataset" not in got:
            args += ["--dataset", "digits"]
        if "epochs" not in got:
            args += ["--epochs", "0.05"]  # 1 step, should a fault slip through
        if "out" not in got:
            args += ["--out", "r.json"]
        return args + ["--no-progress"], True, None
    if cmd == "tune":
        got = faults(
            {
                "file": [[f] for f in ("adir", "garbage.bin", "garbage.toml", "yaml.toml", "image.png")]
                + [[f] for f in ("image.toml", "missing.toml", "afile.txt", "afile.txt/s.toml", "")],
                "config": [[str(i)] for i in range(len(CONFIG_FAULTS))],
                "out": [["-o", v] for v in ("afile.txt", "afile.txt/sub", "S-truncated", "S-garbage")],
                "executor": RAY_FAULTS
                + [["--gpus-per-run", v] for v in ("nan", "-0", "1e308", "0.5")]
                + [["--progress", "maybe"]],
            }
        )
        if "config" in got:
            old, new = CONFIG_FAULTS[int(got["config"][0])]
            injection = (old, new.replace("{device}", draw(st.sampled_from(devices))))
            args.append("bad.toml")
        elif "file" in got:
            args += got["file"]
        else:
            args.append("study.toml")
        args += got.get("out", ["-o", draw(st.sampled_from(["new/study", "adir", "S-ok"]))])
        args += got.get("executor", [])
        return args + ["--no-progress"], True, injection
    if cmd in ("status", "resume", "report", "export"):
        target = pick(["S-ok"], BAD_STORES)
        args.append(target)
        if cmd == "resume":
            args += pick([[], ["--executor", "local"], ["--executor", "process"]], RAY_FAULTS)
            args.append("--no-progress")
        elif cmd == "report":
            # the intact study only with a bad --out: a good report draws figures (seconds)
            good_out = [] if target == "S-ok" else [[], ["--out", "rep"]]
            args += pick(good_out, [["--out", "afile.txt"], ["--out", "afile.txt/sub"]])
            args += draw(st.sampled_from([[], ["--include-diagnostics"]]))
        elif cmd == "export":
            args += pick([[], ["--arm", FUZZ_ARM]], [["--arm", "bogus"], ["--arm", ""]])
            args += pick([[], ["--out", "exp"]], [["--out", "afile.txt"], ["--out", "afile.txt/x"]])
        return args, bad, None
    if cmd == "reproduce":
        got = faults(
            {
                "name": [[v] for v in ("no-such-preset", "../etc", "", "galli")],
                "scale": [["--scale", v] for v in ("huge", "", "paperr", "tiny")],
                "k": [["--k", v] for v in ("0", "-0", "1000000000000", "1e12")] + [["--scale", "paper", "--k", "4"]],
                "device": [["--device", d] for d in devices],
                "workers": [["--workers", "0"], ["--workers", "-1"], ["--executor", "bogus"]],
                "out": [["--out", "afile.txt"], ["--out", "afile.txt/x"]],
                "data_dir": [["--data-dir", v] for v in ("afile.txt", "missing-dir")],
                "steps": [["--steps", v] for v in ("0", "-1", "1000000000000")] + [["--limit", "0"], ["--limit", "-0"]],
                "flag": [["--progress", "maybe"]],
            }
        )
        args += got.pop("name", ["galli-mnist"])
        args += [x for frag in got.values() for x in frag]
        if "scale" not in got and "k" not in got:
            args += ["--scale", "smoke"]
        if "steps" not in got:
            args += ["--steps", "1", "--limit", "64"]  # a short run, should a fault slip through
        if "out" not in got:
            args += ["--out", "rep"]
        return args + ["--no-progress"], True, None
    if cmd == "demo":
        got = faults(
            {
                "out": [["--out", v] for v in ("afile.txt", "afile.txt/x", "S-truncated", "S-garbage", "S-ok")],
                "flag": [["--progress", "maybe"]],
            }
        )
        return args + [x for frag in got.values() for x in frag] + ["--no-progress"], True, None
    # audit
    got = faults(
        {
            "strategy": [["--strategy", v] for v in ("nonsense", "", "nodp", "dp sgd")],
            "eps": [["--eps", v] for v in ("-0", "0", "nan", "inf", "1e308")],
            "delta": [["--delta", v] for v in ("-0", "1", "1e308")],
            "method": [["--method", "bogus"], ["--method", "two-world", "--threat-model", "black-box"]],
            "confidence": [["--confidence", v] for v in ("1e-320", "2", "nan")],
            "canaries": [["--canaries", v] for v in ("5", "-0", "1000000000000")],
            "threat": [["--threat-model", ""]],
            "out": [["--out", "adir"], ["--out", "afile.txt/a.json"]],
        }
    )
    args += got.pop("strategy", ["--strategy", draw(st.sampled_from(["dpsgd", "oso"]))])
    args += [x for frag in got.values() for x in frag]
    if "canaries" not in got:
        args += ["--canaries", "20"]  # a short audit, should a fault slip through
    return args, True, None


@pytest.fixture(scope="module")
def cli_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with one small real study (one 2-step run on digits), built once: each fuzzed
    command line gets its own sub-folder with copies (damaged ones too) and junk files."""
    from dptune.tune import run_study

    root = tmp_path_factory.mktemp("cli-fuzz")
    (root / "template").mkdir()
    cfg = root / "template" / "study.toml"
    cfg.write_text(FUZZ_STUDY)
    assert run_study(cfg, root / "template" / "S-ok", progress=False).complete
    return root


JUNK = random.Random(0).randbytes(2048)
# The files an argument may name (only those named are made: most examples need one or two).
FILES: dict[str, bytes | None] = {
    "adir": None,  # a directory
    "afile.txt": b"keep\n",
    "garbage.bin": JUNK,
    "garbage.toml": JUNK,
    "yaml.toml": b"study:\n  name: fz\nbudget:\n  epsilon: 2.0\n",  # YAML in a .toml
    "image.png": PNG,
    "image.toml": PNG,
    "study.toml": FUZZ_STUDY.encode(),
}


def _make_example_folder(root: Path, argv: list[str], injection: tuple[str, str] | None) -> Path:
    import shutil

    from dptune.tune.store import Store

    work = Path(tempfile.mkdtemp(dir=root, prefix="ex-"))
    names = {a.split("/")[0] for a in argv}
    for name, content in FILES.items():
        if name in names and content is None:
            (work / name).mkdir()
        elif name in names:
            (work / name).write_bytes(content)
    if injection is not None:
        assert injection[0] in FUZZ_STUDY
        (work / "bad.toml").write_text(FUZZ_STUDY.replace(*injection, 1))
    for name in STORES:
        if name not in names:
            continue
        d = work / name
        if name == "S-unplanned":  # what an interrupted plan leaves: the store's tables, no plan
            Store(d, create=True).close()
            continue
        shutil.copytree(root / "template" / "S-ok", d)
        db = d / "study.sqlite"
        if name == "S-truncated":
            with open(db, "r+b") as f:
                f.truncate(100)
        elif name == "S-garbage":
            db.write_bytes(JUNK)
        elif name == "S-empty":
            db.write_bytes(b"")
        elif name == "S-nodb":
            db.unlink()
    return work


def _dirs(root: Path) -> set[Path]:
    """Every directory under ``root`` but the template study (never touched: commands get copies)."""
    tops = [p for p in root.iterdir() if p.is_dir() and p.name != "template"]
    return {*tops, *(p for top in tops for p in top.rglob("*") if p.is_dir())}


@settings(
    max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(drawn=st.composite(lambda draw: _cli_args(draw))())
def test_fuzzed_cli_arguments_never_raise_tracebacks(cli_world: Path, drawn: tuple[list[str], bool, Any]) -> None:
    import os
    import shutil

    from typer.testing import CliRunner

    from dptune.cli import app

    args, bad, injection = drawn
    work = _make_example_folder(cli_world, args, injection)
    before = _dirs(cli_world)
    cwd = os.getcwd()
    os.chdir(work)  # default outputs (studies/, runs/, dptune-demo) and relative paths land here
    try:
        result = CliRunner().invoke(app, args, catch_exceptions=True)
    finally:
        os.chdir(cwd)
    try:
        # an uncaught exception would have been a traceback for the user
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            f"dptune {' '.join(args)!s} raised {type(result.exception).__name__}: {result.exception}"
        )
        assert "Traceback" not in result.output
        assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output[-500:])
        if bad:  # a bad value is refused (exit code 2), not accepted, ignored, or found after the work
            assert result.exit_code == 2, (args, injection, result.output[-800:])
        for line in result.output.splitlines():  # dptune's own refusals: one line that names the fix
            assert not line.startswith("error:") or "Fix" in line, (args, injection, line)
        if result.exit_code != 0:
            left = sorted(str(p.relative_to(cli_world)) for p in _dirs(cli_world) - before)
            assert not left, (args, injection, left, result.output[-500:])
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
