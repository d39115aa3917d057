"""Attribution of a meter's energy to engine phases (prefill, decode, mixed, idle).

Method: the energy from the start of step *n* to its end belongs to step *n*'s phase, and so does the
short gap (host scheduling) until the next step starts; once no step has run for ``idle_after_s``
seconds, the time since the last booking is idle. Idle energy is kept as its own phase, never dropped or subtracted. The phase totals always sum
to the meter's total (they are deltas of one cumulative reading).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..settings import PHASES
from .meters import EnergyMeter


class PhaseEnergyAccount:
    """Cumulative joules, steps and seconds per phase for one GPU.

    Args:
        meter: the GPU's meter.
        idle_after_s: seconds without a step after which time counts as idle.
        clock: monotonic seconds (tests inject one).
    """

    def __init__(self, meter: EnergyMeter, idle_after_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self.meter = meter
        self.idle_after_s = idle_after_s
        self.clock = clock
        self.energy_j: dict[str, float] = {p: 0.0 for p in PHASES}
        self.time_s: dict[str, float] = {p: 0.0 for p in PHASES}
        self.steps: dict[str, int] = {p: 0 for p in PHASES}
        self.tokens: dict[str, int] = {"prefill": 0, "decode": 0}
        self._phase = "idle"
        self._t = clock()
        self._e = meter.energy_j()
        self._last_step_t = self._t
        self._lock = threading.Lock()

    def _book(self, next_phase: str) -> None:
        t, e = self.clock(), self.meter.energy_j()
        self.energy_j[self._phase] += e - self._e
        self.time_s[self._phase] += t - self._t
        self._phase, self._t, self._e = next_phase, t, e

    def on_step(self, phase: str, prefill_tokens: int = 0, decode_tokens: int = 0) -> None:
        """Book the interval since the last booking and open a step of ``phase``."""
        with self._lock:
            self._book(phase)
            self.steps[phase] += 1
            self.tokens["prefill"] += prefill_tokens
            self.tokens["decode"] += decode_tokens
            self._last_step_t = self._t

    def on_step_end(self) -> None:
        """Book the step's interval into its phase; idle detection restarts from here."""
        with self._lock:
            self._book(self._phase)
            self._last_step_t = self._t

    def tick(self) -> None:
        """Called periodically (about every ``idle_after_s``/2): books idle time and refreshes totals."""
        with self._lock:
            t = self.clock()
            idle = t - self._last_step_t >= self.idle_after_s
            if idle:
                self.meter.on_idle(t - self._t)
                self._phase = "idle"  # the interval since the last booking had no step: idle
            self._book(self._phase)

    @property
    def current_phase(self) -> str:
        return self._phase

    def total_j(self) -> float:
        return sum(self.energy_j.values())
