"""``python -m dptune.presets [OUT_DIR]``: run the demo into OUT_DIR (default ``runs/demo``), print its wall time."""

from __future__ import annotations

import sys
import time

from dptune.presets import demo


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = args[0] if args else "runs/demo"
    t0 = time.perf_counter()
    demo(out)
    print(f"demo wall time: {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
