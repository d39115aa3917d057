"""95 % confidence intervals (Student's t) for the benchmark records: the package's own
(``vllm_powersave/intervals.py``), so that a record and the compare report use one table."""

from __future__ import annotations

from vllm_powersave.intervals import T975, mean_ci95, t975

__all__ = ["T975", "mean_ci95", "t975"]
