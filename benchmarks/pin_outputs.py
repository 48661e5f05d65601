"""Pin what dptune prints and plans, to check a restructure changes none of it.

    python benchmarks/pin_outputs.py write /tmp/pins.json   # before
    python benchmarks/pin_outputs.py check /tmp/pins.json   # after: exit 1 on any difference

Pins 13 CLI commands (stdout + stderr + exit code, seeded, no progress bars, wall-clock times
masked), the JSON files they write, and calibrated ν of every strategy (float.hex, bit for bit).
Needs DPTUNE_DATA_DIR for the MNIST runs. Not a test: it takes about a minute.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = """
[study]
name = "pin"
seeds = [0]
[data]
name = "digits"
[model]
name = "mlp"
[training]
epochs = 2
expected_batch_size = 64
[budget]
epsilon = [2.0]
delta = 1e-5
[selection]
mode = "private"
noise_multiplier = 20.0
eval_every = 10
[method]
name = "grid"
[[strategies]]
name = "dpsgd"
space = { lr = [0.5, 2.0] }
[[strategies]]
name = "oso"
space = { initial_clip = [1.0] }
"""
TRAIN = ["train", "--dataset", "digits", "--epochs", "2", "--batch-size", "64", "--no-progress"]
COMMANDS: list[list[str]] = [
    ["--version"],
    ["account", "--noise-multiplier", "1.1", "--sampling-rate", "0.01", "--steps", "1000"],
    ["calibrate", "--epsilon", "3", "--sampling-rate", "0.01", "--steps", "1000", "--runs", "4"],
    ["calibrate", "--epsilon", "1", "--sampling-rate", "1", "--steps", "50"],
    [*TRAIN, "--strategy", "dpsgd", "--out", "t1.json"],
    [*TRAIN, "--strategy", "oso", "--out", "t2.json"],
    [*TRAIN, "--strategy", "quantile", "--hp", "lr=0.5", "--out", "t3.json"],
    [*TRAIN, "--strategy", "fixed+adam", "--epsilon", "1", "--out", "t4.json"],
    [*TRAIN, "--strategy", "dpgd", "--full-batch", "--out", "t5.json"],
    [*TRAIN, "--strategy", "nope", "--out", "t6.json"],
    ["tune", "study.toml", "--out", "st", "--no-progress"],
    ["status", "st"],
    ["audit", "--strategy", "dpsgd", "--canaries", "200"],
]
TIMES = re.compile(r"\d+(\.\d+)?\s?(s|ms|min)\b|\d+:\d\d(:\d\d)?")


def _mask(text: str, tmp: str) -> str:
    return TIMES.sub("<time>", text.replace(tmp, "<tmp>"))


def _nus() -> dict[str, str]:
    import dptune

    out = {}
    for name in ["dpsgd", "quantile", "oso", "dpadam", "adamwosm", "adadp", "dpgd", "fixed+momentum"]:
        for eps in [0.5, 3.0]:
            full = name == "dpgd"
            plan = dptune.plan_run(
                dptune.make_strategy(name),
                5000,
                expected_batch_size=None if full else 128,
                full_batch=full,
                epochs=3,
                target_epsilon=eps,
                delta=1e-5,
            )
            out[f"{name}@{eps}"] = float(plan.noise_multiplier).hex()
    return out


def pin() -> dict[str, object]:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb", "PYTHONHASHSEED": "0"}
    pins: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "study.toml").write_text(STUDY)
        for cmd in COMMANDS:
            p = subprocess.run([sys.executable, "-m", "dptune", *cmd], cwd=tmp, env=env, capture_output=True, text=True)
            pins[" ".join(cmd)] = {"rc": p.returncode, "stdout": _mask(p.stdout, tmp), "stderr": _mask(p.stderr, tmp)}
        for f in sorted(Path(tmp).glob("t*.json")) + sorted(Path(tmp, "st").glob("*.json")):
            pins[f"file:{f.name}"] = _mask(f.read_text(), tmp)
    pins["nu"] = _nus()
    return pins


def main() -> None:
    mode, path = sys.argv[1], Path(sys.argv[2])
    pins = pin()
    if mode == "write":
        path.write_text(json.dumps(pins, indent=1, ensure_ascii=False))
        return
    before = json.loads(path.read_text())
    diff = [k for k in before.keys() | pins.keys() if before.get(k) != pins.get(k)]
    for k in sorted(diff):
        print(f"DIFFERS: {k}\n--- before\n{before.get(k)}\n--- after\n{pins.get(k)}\n")
    print(f"{len(before) - len(diff)}/{len(before)} pins identical")
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
