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

Per-request energy (opt-in, ``per_request=True``): each step's share of the interval energy is split
over the requests scheduled in it in proportion to their scheduled tokens in that step (prefill
chunks weigh by their prompt tokens, decodes by 1 + speculative tokens). A request's energy is the
sum over every step it took part in; idle energy belongs to no request. At any moment
``sum(requests, finished and in flight) + idle == total`` up to rounding. This is the token-share
rule; it does not model that a prefill token costs more or less than a decode token on a given GPU.

A meter that becomes unavailable (an NVML fault, see :mod:`.meters`) stops the attribution for good:
``available`` turns False, the cumulative figures freeze and must not be published as current, and
requests finishing afterwards are reported with ``None`` joules rather than a partial figure.

Tokens per joule over a sliding window (:meth:`window`): the account keeps one
``(t, joules, prefill tokens, decode tokens)`` sample per tick for ``window_s`` seconds; the window
is the oldest kept sample to now. Idle energy is in it: it is what the server spent.

Steady state (:meth:`on_step`'s ``steady``): the ML.ENERGY benchmark measures J/token in the window
that opens once ``max_num_seqs`` requests have their first token and closes when the batch starts
to drain (Chung et al., "The ML.ENERGY Benchmark", arXiv:2505.06371). Server-side this is "the
running batch is at its limit": the step hook flags steps with ``num_reqs >= max_num_seqs``, and
their time share of each tick's energy, their time and their tokens are summed in ``steady_*``.

Idle while busy (``busy``, optional): a function ``(t0, t1) -> seconds of [t0, t1] during which
the server had requests in flight`` (``starvation.FrontendBusyReader.overlap``). Every stretch
booked as idle is asked, and that part of the idle share of the tick's energy is also summed in
``idle_busy_j`` / ``idle_busy_s`` (a subset of idle, not a phase of its own: phases still sum to
the total); ``busy_s`` sums the busy time of every tick (the denominator of the share).
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
        feed: called at the start of each :meth:`tick`, before the lock, to deliver pending step
            events (the worker runtime batches the step hook's records, ``WorkerRuntime.drain_steps``).
    """

    def __init__(self, meter: EnergyMeter, idle_after_s: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 per_request: bool = False, on_request_done: Callable[[str, float | None], None] | None = None,
                 window_s: float = 60.0, feed: Callable[[], None] | None = None,
                 busy: Callable[[float, float], float] | None = None) -> None:
        self.meter = meter
        self.busy = busy
        self.idle_busy_j = 0.0
        self.idle_busy_s = 0.0
        self.busy_s = 0.0
        self.feed = feed
        self.idle_after_s = idle_after_s
        self.clock = clock
        self.energy_j: dict[str, float] = {p: 0.0 for p in PHASES}
        self.time_s: dict[str, float] = {p: 0.0 for p in PHASES}
        self.steps: dict[str, int] = {p: 0 for p in PHASES}
        self.tokens: dict[str, int] = {"prefill": 0, "decode": 0}
        # (t, phase, {req: tokens} | None, finished ids | None, steady) for a step start,
        # (t, None, None, None, False) for a step end; appended by the hot path only.
        self._events: deque[tuple[float, str | None, dict | None, object, bool]] = deque()
        self.steady_j = 0.0
        self.steady_s = 0.0
        self.steady_tokens: dict[str, int] = {"prefill": 0, "decode": 0}
        self.window_s = window_s
        self._window: deque[tuple[float, float, int, int]] = deque()
        self.available = True
        self._unknown: set[str] = set()  # requests in flight while the meter is unavailable
        self.per_request = per_request
        self.on_request_done = on_request_done
        self.request_j: dict[str, float] = {}  # in flight
        self.finished_request_j = 0.0
        self.finished_requests = 0
        self._req: dict | None = None
        self._steady = False
        self._phase = "idle"  # phase owning the time at _t
        self._end_t: float | None = None  # end of the last step, if it ended
        self._t = clock()
        e0 = meter.energy_j()
        self._e = e0 if e0 is not None else 0.0
        if e0 is None:
            self.available = False
        self._window.append((self._t, 0.0, 0, 0))
        self._lock = threading.Lock()  # serialises tick() callers, never taken by the hot path

    # -- hot path (no meter access, no lock) ---------------------------------------------------
    def on_step(self, phase: str, prefill_tokens: int = 0, decode_tokens: int = 0,
                req_tokens: dict[str, int] | None = None, finished: object = None, steady: bool = False,
                t: float | None = None) -> None:
        """A step of ``phase`` starts at ``t`` (the ``clock``'s seconds; now if ``None``).

        ``req_tokens``: scheduled tokens per request id (kept by reference, not copied);
        ``finished``: ids of requests that finished before this step (their energy is final);
        ``steady``: the running batch is at its limit (steady state, see the module docstring).
        Events must arrive in time order, and before the :meth:`tick` that passes their time
        (a later one is clamped to that tick's start).
        """
        if t is None:
            t = self.clock()
        if self.per_request:
            self._events.append((t, phase, req_tokens, finished, steady))
        else:
            self._events.append((t, phase, None, None, steady))
        self.steps[phase] += 1
        tokens = self.tokens
        tokens["prefill"] += prefill_tokens
        tokens["decode"] += decode_tokens
        if steady:
            tokens = self.steady_tokens
            tokens["prefill"] += prefill_tokens
            tokens["decode"] += decode_tokens

    def on_finished(self, finished: object, t: float | None = None) -> None:
        """Requests reported finished by a step that schedules no work (vLLM sends one as a batch
        drains), at ``t`` (now if ``None``)."""
        if self.per_request and finished:
            self._events.append((self.clock() if t is None else t, "", None, finished, False))

    def on_step_end(self, t: float | None = None) -> None:
        """The current step's host work ended at ``t`` (now if ``None``; its GPU work may still run)."""
        self._events.append((self.clock() if t is None else t, None, None, None, False))

    # -- background ----------------------------------------------------------------------------
    def tick(self) -> None:
        """Read the meter once and attribute the energy since the previous tick to phases."""
        if self.feed is not None:
            self.feed()
        with self._lock:
            t_now = self.clock()
            shares: dict[str, float] = {}

            segments: list[tuple[float, dict]] = []
            finished: list = []
            steady_s = [0.0]
            busy = self.busy
            idle_busy = [0.0]

            def own(phase: str, t0: float, t1: float, req: dict | None = None, steady: bool = False) -> None:
                if t1 > t0:
                    shares[phase] = shares.get(phase, 0.0) + (t1 - t0)
                    if busy is not None and phase == "idle":
                        idle_busy[0] += busy(t0, t1)
                    if req and phase != "idle":
                        segments.append((t1 - t0, req))
                    if steady and phase != "idle":
                        steady_s[0] += t1 - t0

            t, phase, end_t, req, steady = self._t, self._phase, self._end_t, self._req, self._steady
            events, idle_after_s = self._events, self.idle_after_s
            pop = events.popleft
            while events:
                te, ev, ev_req, ev_fin, ev_steady = pop()
                if te < t:  # noqa: PLR1730 - te = max(te, t) without the call
                    te = t
                if ev is None:
                    end_t = te
                    continue
                if ev == "":  # finished ids only: no new step
                    finished.extend(ev_fin)
                    continue
                if phase != "idle" and end_t is not None and te - end_t >= idle_after_s:
                    self._close(own, phase, t, te, end_t, req, steady)
                elif te > t:
                    # own(phase, t, te, req, steady), inlined: one step per event, every tick.
                    d = te - t
                    shares[phase] = shares.get(phase, 0.0) + d
                    if phase == "idle" and busy is not None:
                        idle_busy[0] += busy(t, te)
                    if phase != "idle":
                        if req:
                            segments.append((d, req))
                        if steady:
                            steady_s[0] += d
                t, phase, end_t, req, steady = te, ev, None, ev_req, ev_steady
                if ev_fin:
                    finished.extend(ev_fin)
            self._close(own, phase, t, t_now, end_t, req, steady)
            if shares.get("idle", 0.0) > 0:
                self.meter.on_idle(shares["idle"])  # a simulated meter adds idle power for it
            # Time after a long-finished step is idle from here on.
            if end_t is not None and t_now - end_t >= self.idle_after_s:
                phase, end_t, req, steady = "idle", None, None, False
            e_now = self.meter.energy_j() if self.available else None
            if e_now is None:
                # Meter unavailable (fault): nothing more is attributed; requests that finish from
                # now on get None, never a partial figure.
                self.available = False
                self._unknown.update(self.request_j)
                self.request_j.clear()
                for _, req_tok in segments:
                    self._unknown.update(req_tok)
                for rid in finished:
                    if rid in self._unknown:
                        self._unknown.discard(rid)
                        if self.on_request_done is not None:
                            self.on_request_done(rid, None)
                self._t, self._phase, self._end_t, self._req, self._steady = t_now, phase, end_t, req, steady
                return
            d_e = e_now - self._e
            total = sum(shares.values())
            if busy is not None:
                self.busy_s += busy(self._t, t_now)
                if total > 0 and idle_busy[0] > 0:
                    self.idle_busy_j += d_e * idle_busy[0] / total
                    self.idle_busy_s += idle_busy[0]
            if total > 0:
                for p, s in shares.items():
                    self.energy_j[p] += d_e * s / total
                    self.time_s[p] += s
                self.steady_j += d_e * steady_s[0] / total
                self.steady_s += steady_s[0]
            else:
                self.energy_j[phase] += d_e
            if total > 0 and segments:
                self._attribute_requests(d_e / total, segments)
            for rid in finished:
                j = self.request_j.pop(rid, None)
                if j is not None:
                    self.finished_request_j += j
                    self.finished_requests += 1
                    if self.on_request_done is not None:
                        self.on_request_done(rid, j)
            self._t, self._e, self._phase, self._end_t, self._req, self._steady = t_now, e_now, phase, end_t, req, steady
            self._window.append((t_now, self.total_j(), self.tokens["prefill"], self.tokens["decode"]))
            while len(self._window) > 2 and t_now - self._window[1][0] >= self.window_s:
                self._window.popleft()

    def _attribute_requests(self, j_per_s: float, segments: list[tuple[float, dict]]) -> None:
        acc = self.request_j
        for seconds, req in segments:
            n = sum(req.values())
            if n <= 0:
                continue
            k = j_per_s * seconds / n
            for rid, tok in req.items():
                acc[rid] = acc.get(rid, 0.0) + k * tok

    def _close(self, own: Callable[..., None], phase: str, t0: float, t1: float, end_t: float | None, req: dict | None,
               steady: bool = False) -> None:
        """Assign [t0, t1] to ``phase``, except a gap after the step's end longer than idle_after_s."""
        if phase != "idle" and end_t is not None and t1 - end_t >= self.idle_after_s:
            own(phase, t0, max(t0, end_t), req, steady)
            own("idle", max(t0, end_t), t1)
        else:
            own(phase, t0, t1, req, steady)

    @property
    def current_phase(self) -> str:
        return self._phase

    def total_j(self) -> float:
        return sum(self.energy_j.values())

    def window(self) -> dict[str, float]:
        """Energy (J), tokens and seconds over the sliding window (oldest kept tick to the last tick).

        ``seconds`` is 0 before the second tick. Figures are meaningless once ``available`` is False.
        """
        with self._lock:
            t0, e0, p0, d0 = self._window[0]
            t1, e1, p1, d1 = self._window[-1]
        return {"seconds": t1 - t0, "energy_j": e1 - e0, "prefill_tokens": p1 - p0, "decode_tokens": d1 - d0}
