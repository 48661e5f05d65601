"""``python -m dptune.presets [OUT_DIR]``: run the demo into OUT_DIR (default ``runs/demo``)."""

from __future__ import annotations

import sys

from dptune.presets import demo


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = args[0] if args else "runs/demo"
    demo(out)  # prints its run time, labelled: a side channel on the batch sizes (docs/privacy.md, item 7)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
