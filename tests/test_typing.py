"""Type checking in CI: mypy on ``src/`` may not report any error that is not in the baseline.

The baseline (``mypy-baseline.txt``: one ``path: [code] message`` per line, line numbers left out
so that edits elsewhere in a file do not disturb it) lists the errors the code had when the checker
was introduced. A new error fails this test; a fixed one should be removed from the baseline
(``python tests/test_typing.py --update`` rewrites it from the current code), so that it shrinks.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections import Counter

import pytest
from conftest import ROOT

BASELINE = ROOT / "mypy-baseline.txt"
LINE = re.compile(r"^(?P<path>[^:]+):\d+:(?:\d+:)? error: (?P<msg>.*?)\s+\[(?P<code>[a-z0-9-]+)\]$")


def mypy_errors() -> Counter[str]:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "src/dptune", "--no-error-summary", "--no-pretty"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode not in (0, 1) or "error: " not in out.stdout and out.returncode == 1:
        raise RuntimeError(f"mypy did not run: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    errors: Counter[str] = Counter()
    for line in out.stdout.splitlines():
        m = LINE.match(line.strip())
        if m:
            errors[f"{m['path']}: [{m['code']}] {m['msg']}"] += 1
    return errors


def read_baseline() -> Counter[str]:
    lines = [ln for ln in BASELINE.read_text().splitlines() if ln and not ln.startswith("#")]
    return Counter(lines)


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is in the dev extra")
def test_mypy_reports_no_error_beyond_the_baseline() -> None:
    current, baseline = mypy_errors(), read_baseline()
    new = current - baseline
    assert not new, "new type errors (fix them; the baseline only shrinks):\n" + "\n".join(sorted(new))
    fixed = baseline - current
    if fixed:  # not a failure: a hint to shrink the baseline
        print(f"{sum(fixed.values())} baseline errors are fixed: run `python tests/test_typing.py --update`.")


def test_the_baseline_parser_reads_mypy_lines() -> None:
    m = LINE.match('src/dptune/cli.py:518: error: Argument "method" has incompatible type "str"  [arg-type]')
    assert m and (m["path"], m["code"]) == ("src/dptune/cli.py", "arg-type") and m["msg"].startswith("Argument")
    assert LINE.match("src/dptune/cli.py:518: note: See https://mypy.readthedocs.io") is None


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    errs = mypy_errors()
    head = ["# mypy errors accepted when the checker was introduced (tests/test_typing.py); only ever remove lines."]
    BASELINE.write_text("\n".join(head + sorted(errs.elements())) + "\n")
    print(f"{BASELINE}: {sum(errs.values())} errors")
