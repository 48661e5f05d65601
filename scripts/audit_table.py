#!/usr/bin/env python
"""Regenerate the audit table of docs/reliability.md: each strategy and each mutant, audited.

    python scripts/audit_table.py                         # every row (≈ 5 min on 2 cores)
    python scripts/audit_table.py --strategy oso --method two-world --eps 4   # one row, printed
    python scripts/audit_table.py --write docs/reliability.md                 # rewrite the table
    python scripts/audit_table.py --threat-model black-box --method one-run --eps 2 \
        --write docs/reliability.md --marker audit-table-black-box           # the black-box table

A row = one strategy, one audit method, one claimed ε: the lower bound for the real code and
for every applicable mutant of ``tests/mutants`` (deliberately broken variants, which live
only in the test tree; this script imports them from there). ✓ marks a mutant that the audit
flags (lower bound above the claimed ε); the real code must NOT be flagged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the mutants live in the test tree only

from mutants import APPLICABLE, MUTANTS  # noqa: E402

from dptune.audit import AUDITABLE, run_audit  # noqa: E402

MUTANT_ORDER = ["noise×0.25", "no clipping", "q-query noise removed", "split accounted at ν_g"]
DEFAULT_ROWS = [("one-run", 2.0), ("one-run", 4.0), ("two-world", 4.0)]


def audit_row(strategy: str, method: str, eps: float, seed: int, canaries: int | None,
              threat_model: str = "white-box") -> dict:
    t0 = time.perf_counter()
    kw = dict(method=method, seed=seed, canaries=canaries, threat_model=threat_model)
    real = run_audit(strategy, eps, **kw)
    row = {"strategy": strategy, "method": method if threat_model == "white-box" else f"{method}, {threat_model}",
           "eps": eps, "real": real.lower_bound,
           "real_flagged": real.flagged, "ledger_epsilon": real.details["ledger_epsilon"],
           "noise_multiplier": real.details["noise_multiplier"], "mutants": {}}
    for name in APPLICABLE[strategy]:
        with MUTANTS[name]():
            r = run_audit(strategy, eps, **kw)
        row["mutants"][name] = r.lower_bound
    row["seconds"] = time.perf_counter() - t0
    row["command"] = (f"python scripts/audit_table.py --strategy {strategy} --method {method} --eps {eps:g}"
                      + (f" --seed {seed}" if seed else "") + (f" --canaries {canaries}" if canaries else "")
                      + (f" --threat-model {threat_model}" if threat_model != "white-box" else ""))
    return row


def markdown(rows: list[dict]) -> str:
    head = ("| strategy | method | claimed ε | audited lower bound (real code) | "
            + " | ".join(MUTANT_ORDER) + " | seconds | command |")
    sep = "|" + "---|" * (6 + len(MUTANT_ORDER))
    lines = [head, sep]
    for r in rows:
        cells = []
        for name in MUTANT_ORDER:
            if name in r["mutants"]:
                v = r["mutants"][name]
                cells.append(f"{v:.2f} {'✓' if v > r['eps'] else '✗'}")
            else:
                cells.append("n/a")
        real = f"{r['real']:.2f}" + (" ✗ FLAGGED" if r["real_flagged"] else "")
        lines.append(f"| {r['strategy']} | {r['method']} | {r['eps']:g} | {real} | " + " | ".join(cells)
                     + f" | {r['seconds']:.0f} | `{r['command']}` |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", action="append", choices=AUDITABLE, help="repeatable; default: all")
    ap.add_argument("--method", choices=["one-run", "two-world"], help="with --eps: one row type")
    ap.add_argument("--eps", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--canaries", type=int, default=None, help="m (one run) or trials per world (two worlds)")
    ap.add_argument("--threat-model", choices=["white-box", "black-box"], default="white-box")
    ap.add_argument("--marker", default="audit-table", help="which marked table of --write to replace")
    ap.add_argument("--write", type=Path, help="rewrite the table between the markers of this file")
    ap.add_argument("--json", type=Path, help="also save the rows as JSON")
    args = ap.parse_args()
    strategies = args.strategy or list(AUDITABLE)
    kinds = [(args.method, args.eps)] if args.method and args.eps else DEFAULT_ROWS
    rows = []
    for method, eps in kinds:
        for s in strategies:
            row = audit_row(s, method, eps, args.seed, args.canaries, args.threat_model)
            rows.append(row)
            print(f"{s:9s} {method:9s} ε={eps:g}: real {row['real']:.2f}; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["mutants"].items()) + f"  ({row['seconds']:.0f} s)",
                  flush=True)
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write:
        begin, end = f"<!-- {args.marker}:begin -->", f"<!-- {args.marker}:end -->"
        text = args.write.read_text()
        if begin not in text or end not in text:
            raise SystemExit(f"{args.write}: markers {begin} / {end} not found")
        pre, rest = text.split(begin, 1)
        _, post = rest.split(end, 1)
        args.write.write_text(f"{pre}{begin}\n{table}\n{end}{post}")


if __name__ == "__main__":
    main()
