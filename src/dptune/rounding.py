"""Printed privacy numbers never read smaller than they are: the one rounding-up rule (light: no accountant)."""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal


def round_up(x: float, digits: int = 6) -> float:
    """The smallest float ≥ ``x`` printed with ``digits`` significant digits (docs/accounting.md, "Printing ν")."""
    if not math.isfinite(x) or x <= 0 or (float(f"{x:.{digits}g}") == x and x >= 1e-300):  # as it is: 1e-05, 0.1
        return x
    d = Decimal(x)
    return float(d.quantize(Decimal(1).scaleb(d.adjusted() - digits + 1), rounding=ROUND_CEILING))
