"""The energy counter checked against the integral of instant power, window by window.

``nvmlDeviceGetTotalEnergyConsumption`` is what every energy figure of the plugin comes from; a
counter that drifts (a driver bug, a board whose counter is mis-scaled) would go unnoticed. On the
H200 the counter and the trapezoid integral of ``NVML_FI_DEV_POWER_INSTANT`` agreed within 0.8 %
over 10-30 s windows (docs/results/h200-energy-meter.md (a)). So the meter, which reads instant
power with every counter read anyway (to extend the counter between its steps), also integrates
those readings: no NVML read is added. Each completed window of at least
:data:`CROSSCHECK_WINDOW_S` publishes ``counter J / power-integral J``
(``powersave_energy_crosscheck_ratio``), and a ratio off 1 by more than
:data:`CROSSCHECK_BOUND` in two windows in a row, on the same side, logs one warning, then at most
one per :data:`CROSSCHECK_WARN_EVERY_S`. Only the publisher's periodic reads feed it: reads that
requests' finishes trigger fall at step ends, where power dips, and biased the integral so that
the counter read 1.127 x it on an H100 (docs/results/h200-request-energy.md).

The bound: 5 %, six times the worst disagreement measured on the H200 (0.8 %), because the
power readings here are the periodic ticks' (every 0.25 s), not the 190 Hz of that
measurement, and instant power swings with each kernel under a batch (16 ms ticks read 0 to
1,270 W on the H200, docs/results/h200-request-energy.md). Over 30 s the sampling error of ~120
readings of such a swing is a few per cent at most; the window is 30 s so that a short burst's
lagging readings (tens of ms, docs/results/h200-energy-meter.md (c)) weigh little.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("vllm.powersave.energy")

#: Shortest window a ratio is published for (s).
CROSSCHECK_WINDOW_S = 30.0
#: |ratio - 1| beyond this warns.
CROSSCHECK_BOUND = 0.05
#: At most one warning per this many seconds (per GPU).
CROSSCHECK_WARN_EVERY_S = 3600.0
#: Fewer power readings than this in a window: too few to judge, no ratio.
CROSSCHECK_MIN_READINGS = 20


class EnergyCrossCheck:
    """Counter energy over the trapezoid integral of the power readings, per completed window.

    :meth:`add` takes each meter read: its time (s), the counter energy it returned (J) and the
    instant power read with it (W; ``None``: no reading, which restarts the window). ``ratio`` and
    ``window_s`` are the last completed window's (``None`` before the first)."""

    def __init__(
        self,
        gpu_id: str,
        window_s: float = CROSSCHECK_WINDOW_S,
        bound: float = CROSSCHECK_BOUND,
        warn_every_s: float = CROSSCHECK_WARN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.gpu_id, self.window_min_s, self.bound, self.warn_every_s = gpu_id, window_s, bound, warn_every_s
        self.clock, self.log = clock, logger
        self.ratio: float | None = None
        self.window_s: float | None = None
        self.windows = 0
        self.warnings = 0
        self._last_warn: float | None = None
        self._off_side = 0  # the last window: 0 within the bound, +1 above, -1 below
        self._start: tuple[float, float] | None = None  # (t, counter J) at the window's start
        self._last: tuple[float, float] | None = None  # (t, W) of the last reading
        self._integral_j = 0.0
        self._readings = 0

    def add(self, t: float, counter_j: float, power_w: float | None) -> None:
        if self._last is not None and t == self._last[0] and power_w is not None:
            return  # the same read handed on again (no newer one since): nothing to add
        broken = power_w is None or self._last is None or self._start is None or t < self._last[0]
        if broken or t - self._last[0] > self.window_min_s:  # type: ignore[index]
            # A fault, a clock going back or a gap longer than a window: the integral starts
            # again, and two windows off count as "in a row" only without such a break between.
            self._off_side = 0
            self._restart(t, counter_j, power_w)
            return
        t0, p0 = self._last
        self._integral_j += (p0 + power_w) / 2.0 * (t - t0)
        self._last = (t, power_w)
        self._readings += 1
        span = t - self._start[0]
        if span < self.window_min_s or self._readings < CROSSCHECK_MIN_READINGS:
            return  # a window with too few readings (a long tick period) grows until it has them
        if self._integral_j > 0:
            self._judge((counter_j - self._start[1]) / self._integral_j, span)
        self._restart(t, counter_j, power_w)

    def _restart(self, t: float, counter_j: float, power_w: float | None) -> None:
        self._start = (t, counter_j) if power_w is not None else None
        self._last = (t, power_w) if power_w is not None else None
        self._integral_j, self._readings = 0.0, 0

    def _judge(self, ratio: float, span_s: float) -> None:
        self.ratio, self.window_s = ratio, span_s
        self.windows += 1
        side = 0 if abs(ratio - 1.0) <= self.bound else (1 if ratio > 1.0 else -1)
        last_side, self._off_side = self._off_side, side
        # A counter that drifts stays off window after window; the sampling error of ~120 readings
        # of a swinging load does not (a few per cent either way, tests/test_energy_crosscheck.py).
        # So one window off warns nothing; two in a row on the same side do.
        if side == 0 or side != last_side:
            return
        now = self.clock()
        if self._last_warn is not None and now - self._last_warn < self.warn_every_s:
            return
        self._last_warn = now
        self.warnings += 1
        self.log.warning(
            "powersave: GPU %s: the NVML energy counter says %.3f x the integral of instant power over the last %.0f s "
            "(bound: within %.0f %%; they agreed within 0.8 %% on the H200, docs/results/h200-energy-meter.md): "
            "energy figures of this GPU may be off; powersave_energy_crosscheck_ratio tracks it",
            self.gpu_id,
            ratio,
            span_s,
            100 * self.bound,
        )
