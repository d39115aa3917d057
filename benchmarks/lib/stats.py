"""95 % confidence intervals (Student's t) for the benchmark records: the package's own
(``vllm_powersave/intervals.py``), so that a record and the compare report use one table."""

from __future__ import annotations

import math

from vllm_powersave.intervals import T975, mean_ci95, t975

__all__ = ["T975", "mean_ci", "mean_ci95", "rounded", "t975"]


def mean_ci(xs: list[float | None]) -> tuple[float | None, list[float] | None]:
    """Mean and t-based 95 % interval of the finite values; no interval below 2 (a record's field)."""
    v = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    if len(v) < 2:
        return (v[0] if v else None), None
    m, lo, hi = mean_ci95(v)
    return m, [lo, hi]


def rounded(x: object, nd: int = 4) -> object:
    """A float rounded to ``nd`` places for a record; anything else (None, an int) as it is."""
    return round(x, nd) if isinstance(x, float) else x
