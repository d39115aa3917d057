"""Attribution of a meter's energy to engine phases (prefill, decode, mixed, idle).

The step hook runs on vLLM's critical path, and one NVML query costs from tens of microseconds to
milliseconds (measured on the H200 test machine: two queries per step made vLLM 3-4x slower at
small batches). So the hook only timestamps steps; a background ``tick()`` (every ~0.1-0.25 s)
reads the meter once and splits the energy of the interval since the previous tick over phases.

Method (per tick interval ``[t_prev, t_now]``): each step owns the time from its start to the next
step's start, except that a gap longer than ``idle_after_s`` after a step's end is idle; intervals
with no step at all are idle. The interval's energy is split in proportion to these times. Phase
totals therefore always sum to the meter's total; idle energy is kept as its own phase, never
dropped or subtracted. Resolution is the tick period, which is finer than NVML's 100 ms counter
update anyway, so the split is meaningful over many ticks, not for a single step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from ..settings import PHASES
from .meters import EnergyMeter


class PhaseEnergyAccount:
    """Cumulative joules, steps, seconds and tokens per phase for one GPU.

    Args:
        meter: the GPU's meter (read only from :meth:`tick`).
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
        # (t, phase) for a step start, (t, None) for a step end; appended by the hot path only.
        self._events: deque[tuple[float, str | None]] = deque()
        self._phase = "idle"  # phase owning the time at _t
        self._end_t: float | None = None  # end of the last step, if it ended
        self._t = clock()
        self._e = meter.energy_j()
        self._lock = threading.Lock()  # serialises tick() callers, never taken by the hot path

    # -- hot path (no meter access, no lock) ---------------------------------------------------
    def on_step(self, phase: str, prefill_tokens: int = 0, decode_tokens: int = 0) -> None:
        """A step of ``phase`` starts now."""
        self._events.append((self.clock(), phase))
        self.steps[phase] += 1
        self.tokens["prefill"] += prefill_tokens
        self.tokens["decode"] += decode_tokens

    def on_step_end(self) -> None:
        """The current step's host work ended now (its GPU work may still run)."""
        self._events.append((self.clock(), None))

    # -- background ----------------------------------------------------------------------------
    def tick(self) -> None:
        """Read the meter once and attribute the energy since the previous tick to phases."""
        with self._lock:
            t_now = self.clock()
            shares: dict[str, float] = {}

            def own(phase: str, t0: float, t1: float) -> None:
                if t1 > t0:
                    shares[phase] = shares.get(phase, 0.0) + (t1 - t0)

            t, phase, end_t = self._t, self._phase, self._end_t
            while self._events:
                te, ev = self._events.popleft()
                te = max(te, t)
                if ev is None:
                    end_t = te
                    continue
                self._close(own, phase, t, te, end_t)
                t, phase, end_t = te, ev, None
            self._close(own, phase, t, t_now, end_t)
            if shares.get("idle", 0.0) > 0:
                self.meter.on_idle(shares["idle"])  # a simulated meter adds idle power for it
            # Time after a long-finished step is idle from here on.
            if end_t is not None and t_now - end_t >= self.idle_after_s:
                phase, end_t = "idle", None
            e_now = self.meter.energy_j()
            d_e = e_now - self._e
            total = sum(shares.values())
            if total > 0:
                for p, s in shares.items():
                    self.energy_j[p] += d_e * s / total
                    self.time_s[p] += s
            else:
                self.energy_j[phase] += d_e
            self._t, self._e, self._phase, self._end_t = t_now, e_now, phase, end_t

    def _close(self, own: Callable[[str, float, float], None], phase: str, t0: float, t1: float, end_t: float | None) -> None:
        """Assign [t0, t1] to ``phase``, except a gap after the step's end longer than idle_after_s."""
        if phase != "idle" and end_t is not None and t1 - end_t >= self.idle_after_s:
            own(phase, t0, max(t0, end_t))
            own("idle", max(t0, end_t), t1)
        else:
            own(phase, t0, t1)

    @property
    def current_phase(self) -> str:
        return self._phase

    def total_j(self) -> float:
        return sum(self.energy_j.values())
