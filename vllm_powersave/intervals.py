"""95 % confidence intervals (Student's t): one table for the compare report and the benchmark records.

Savings are measured side by side, in A/B pairs (ABBA order); a pair's ratio B/A cancels what
drifts between pairs (temperature, other tenants). The interval of the mean ratio over pairs is
what a report shows; "contains 1" means no effect is shown.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

#: Two-sided 95 % quantiles of Student's t for 1-30 degrees of freedom (standard tables); beyond
#: 30 the normal 1.960, within 2 % of t's.
# fmt: off
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# fmt: on


def t975(df: int) -> float:
    """Two-sided 95 % quantile of Student's t with ``df`` degrees of freedom (the normal 1.960 beyond 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return T975[df - 1] if df <= len(T975) else 1.960


def mean_ci95(values: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, lo, hi)``: the mean and its t-based 95 % interval; ValueError below 2 values (no spread)."""
    xs = [float(v) for v in values]
    if len(xs) < 2:
        raise ValueError(f"a confidence interval needs at least 2 values, got {len(xs)}")
    m = statistics.fmean(xs)
    half = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half
