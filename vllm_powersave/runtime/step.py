"""The step path: what the worker runs on vLLM's engine thread, every step (hot).

:class:`StepPath` classifies the step, has the regime filter and the clock controller decide its
clock (each through its own method), and appends one :class:`StepRecord` to the
:class:`StepHandoff`; the drain (``drain.py``, publisher thread) feeds the records to the energy
account, the trace and the simulator later, off the engine thread. :class:`StepTiming` (the
closed loop's step timer) and :class:`CudaPeak` are the other state both threads share. Measured on the H200 host, per-step work here costs 5-9x its hot-loop
figure (each step starts with cold caches after milliseconds of vLLM's own code), and a host-bound
small model pays it in throughput (``docs/results/hook-overhead.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import vllm_compat
from ..clocks import ClockController
from ..clocks.boost import BoostController
from ..clocks.regime import RegimeFilter
from ..device.step_timer import StepTimer

log = logging.getLogger("vllm.powersave")
_LOOKAHEAD_ATTR = vllm_compat.LOOKAHEAD_ATTR
#: Records the step hook lets pile up before it drains them itself (a stalled publisher thread).
MAX_PENDING_STEPS = 4096
#: Timed steps read per step start (normally one finishes per step), and at most this many waiting.
_READS_PER_STEP = 2
_MAX_UNREAD = 64


class StepRecord:
    """One engine step, from :meth:`StepPath.on_step_start` to the publisher's drain.

    ``info``: the ``StepInfo`` (``None`` until the drain classifies it; :data:`FAILED` or
    :data:`WARMUP` for steps the drain leaves out); ``so``: vLLM's ``SchedulerOutput`` (dropped
    once fed); ``sm_mhz``: the SM clock target decided for it; ``t_end``: its end (s, monotonic;
    ``None`` while it runs); ``rows``: its LM-head rows (set by the drain where read); ``mark``: its
    step timer's mark (device/step_timer.py; ``None``: untimed, or read and given back);
    ``gpu_ms``: its time as the timer read it (``None`` until read, on the engine thread).
    """

    __slots__ = ("t", "info", "so", "sm_mhz", "t_end", "rows", "mark", "gpu_ms")
    t: float
    info: Any
    so: Any
    sm_mhz: int | None
    t_end: float | None
    rows: int
    mark: Any
    gpu_ms: float | None

    def __init__(self, t: float, info: Any, so: Any, sm_mhz: int | None) -> None:
        self.t = t
        self.info = info
        self.so = so
        self.sm_mhz = sm_mhz
        self.t_end: float | None = None
        self.rows = 0
        self.mark: Any = None
        self.gpu_ms: float | None = None


#: Record markers (in ``StepRecord.info``) for steps the drain leaves out: a step that could not
#: be fed (its fault logged once), a kernel warm-up step of vLLM's.
FAILED = object()
WARMUP = object()


@dataclass(eq=False)
class StepHandoff:
    """What the engine thread hands the publisher thread.

    ``steps``: the step records, appended by :meth:`StepPath.on_step_start` and consumed oldest
    first by the drain (``drain.py``; ``None`` where nothing reads them); ``wake``: set by the step
    hook when requests finished, so that the publisher attributes them at once; ``last_step_s``:
    the newest busy step's start (s, monotonic), the publisher's idle verdict.
    """

    steps: deque[StepRecord] | None
    wake: threading.Event = field(default_factory=threading.Event)
    last_step_s: float = field(default_factory=lambda: time.monotonic())


class StepTiming:
    """The closed loop's step timing (device/step_timer.py), shared by both threads.

    ``active``: whether finished steps still feed the decode-clock tuner; ``timer``: the step timer
    (marked and read on the engine thread only; ``None``: engine-thread wall time, or the loop is
    off); ``source``: where step times come from; ``off_reason``: why the loop went off, for the
    snapshot's ``savings``. Either thread may turn it off (:meth:`turn_off`).
    """

    active: bool
    timer: StepTimer | None
    source: str
    off_reason: str | None

    def __init__(self, active: bool, timer: StepTimer | None, source: str, off_reason: str | None = None) -> None:
        self.active = active
        self.timer = timer
        self.source = source
        self.off_reason = off_reason

    def turn_off(self, reason: str) -> None:
        """Stop feeding the closed loop (its decode clock stays at the default) and stop timing
        steps for it; each thread drops its own queue of timed steps."""
        self.active = False
        self.timer = None
        self.off_reason = reason


class CudaPeak:
    """PyTorch's peak allocated CUDA memory of this worker (bytes): what LM-head chunking lowers
    for prompt-logprob batches. Reset once at the first served step (engine thread), read by the
    snapshot (publisher thread): a host-side allocator statistic, no device sync."""

    on_gpu: bool
    device_index: int
    reset_pending: bool
    scope: str

    def __init__(self, on_gpu: bool, device_index: int) -> None:
        self.on_gpu = on_gpu
        self.device_index = device_index
        self.reset_pending = on_gpu
        self.scope = "since worker start (includes vLLM's start-up profile run)"

    def reset(self) -> None:
        """vLLM's start-up profile run (a dummy batch of max_num_batched_tokens), V2's warm-up steps
        and CUDA-graph capture set a peak that serving rarely reaches again, so a peak read later
        would mostly report start-up. Reset once, at the first served step: the snapshot's peak is
        then serving's own. vLLM reads the peak only while it profiles memory at start-up."""
        self.reset_pending = False
        try:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device_index)
            self.scope = "since the first served step"
        except Exception as exc:
            log.debug("powersave: CUDA peak-memory statistics not reset: %s", exc)

    def allocated_bytes(self) -> int | None:
        """The peak since start or since :meth:`reset` (``None`` off a GPU or where unreadable)."""
        if not self.on_gpu:
            return None
        try:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device_index))
        except Exception:
            return None


@dataclass(eq=False)
class StepPath:
    """The engine-thread component of :class:`~vllm_powersave.runtime.WorkerRuntime`: classifies
    each step, has the regime filter, the clock controller and the booster decide, and hands one
    :class:`StepRecord` per step to the publisher thread (:class:`StepHandoff`).

    ``drain``: the drain's ``drain_steps``, called here where ``drain_inline`` (the simulator
    prices each step at the clock it runs at) or the publisher thread stalled; ``decides``: whether
    a clock decision runs per step (presets, kernel groups, closed loop or booster);
    ``idle_stamp_gap_s``: a gap between two scheduler stamps this long means the engine idled.
    """

    clocks: ClockController
    regime: RegimeFilter
    boost: BoostController | None
    handoff: StepHandoff
    timing: StepTiming
    peak: CudaPeak
    drain: Callable[[], None]
    decides: bool
    per_request: bool
    lookahead: bool
    drain_inline: bool
    idle_stamp_gap_s: float
    per_step: bool = field(init=False)
    _serving: bool = field(default=False, init=False)  # set at the first step that is not vLLM's own warm-up
    _skip_step_end: bool = field(default=False, init=False)
    _last_stamp: float | None = field(default=None, init=False)
    _open_rec: StepRecord | None = field(default=None, init=False)  # the newest record, until on_step_end stamps its end
    _unread: deque[StepRecord] = field(default_factory=deque, init=False)  # timed steps not read yet, oldest first

    def __post_init__(self) -> None:
        self.per_step = self.decides or self.handoff.steps is not None

    def _first_served(self, scheduler_output: Any) -> bool:
        """Until the first served step: vLLM's own warm-up (V2 kernel warm-up, before the engine
        serves) goes through execute_model like a real step but is not served work (``False``:
        neither traced nor metered). At start-up it all comes before the first served step, so
        the check stops there (it costs ~2 us per step with cold caches)."""
        if vllm_compat.is_warmup_step(scheduler_output):
            self._skip_step_end = True
            return False
        self._serving = True
        if self.peak.reset_pending:
            self.peak.reset()
        return True

    def on_step_start(self, scheduler_output: Any) -> None:
        """Engine step hook (vLLM's engine thread, every step): the clock decision only.

        Classifies the step, decides the clock and appends one record; the energy account, the
        step trace and the prompt-logprob rows are computed from the records by the drain in a
        batch (publisher thread, every tick), where the same code runs warm. Every Python call
        here costs 2-5 us on the H200 host (h200_alternate --time-parts): the common step (decode
        only) is classified by one compat call and decided by one call each into the regime
        filter and the controller; other steps take step_info (ctx, a sum over the batch that only
        the trace and the simulator read, is added by the drain).
        """
        if not self._serving and not self._first_served(scheduler_output):
            return
        if not self.per_step:
            return  # nothing configured reads steps (no presets, meter, trace or booster)
        steps = self.handoff.steps
        if not self.decides:
            rec = StepRecord(time.monotonic(), None, scheduler_output, None)  # classified by the drain
        else:
            tokens = vllm_compat.decode_step_tokens(scheduler_output)
            if tokens >= 0:
                info = None
            elif vllm_compat.is_warmup_step(scheduler_output):
                # vLLM warms kernels up again on a worker already serving (0.32: elastic-EP scale-up).
                # That sequence opens with a prefill of new warm-up requests (never a decode-only
                # step), so it is caught here, and its decode steps by _first_served until it ends.
                self._serving = False
                self._skip_step_end = True
                return
            else:
                info = vllm_compat.step_info(scheduler_output, ctx=False)
            if info is not None and info.phase == "idle":
                rec = StepRecord(time.monotonic(), info, scheduler_output, None)
            else:
                self.handoff.last_step_s = t_step = time.monotonic()
                # The scheduler's stamp (same on every rank) drives the regime window and the dwell
                # (vllm_compat.step_lookahead, inlined: this runs every engine step).
                la = getattr(scheduler_output, _LOOKAHEAD_ATTR, None)
                if la is not None:
                    now = la[0]
                    waiting = la[2]
                    if waiting and not self.lookahead:
                        waiting = 0
                    # Engine-wide idle verdict from the scheduler's stamps (identical on every rank);
                    # the controller reconciles a rank whose own timer went idle meanwhile with it.
                    last = self._last_stamp
                    engine_idled = last is not None and now - last >= self.idle_stamp_gap_s
                    self._last_stamp = now
                else:
                    now, waiting, engine_idled = t_step, 0, None
                if info is None:
                    phase = self.regime.step("decode", tokens, now, waiting)
                else:
                    phase = self.regime.step(info.phase, info.num_tokens, now, waiting)
                clocks = self.clocks
                clocks.on_step(phase, now, t_step, engine_idled)
                if self.boost is not None:
                    self.boost.on_busy(t_step)
                rec = StepRecord(t_step, info, scheduler_output, clocks.current.sm_clock_mhz)
                timer = self.timing.timer
                if timer is not None:
                    try:
                        if self._unread:
                            self._read_step_times(timer)
                        rec.mark = timer.start()  # the closed loop's step time, on the GPU
                    except Exception as exc:
                        self._step_timer_failed(exc)
        if steps is None:
            return
        steps.append(rec)
        self._open_rec = rec
        if self.per_request and getattr(scheduler_output, "finished_req_ids", None):
            self.handoff.wake.set()  # the publisher attributes them now: the API server may hold their responses
        if self.drain_inline or len(steps) > MAX_PENDING_STEPS:
            self.drain()

    def on_step_end(self) -> None:
        if self._skip_step_end:
            self._skip_step_end = False
            return
        self.clocks.step_ended()
        rec = self._open_rec
        if rec is not None:
            self._open_rec = None
            if rec.t_end is None:
                if rec.mark is not None:
                    timer = self.timing.timer
                    if timer is not None:
                        try:
                            timer.stop(rec.mark)
                            self._unread.append(rec)
                        except Exception as exc:
                            self._step_timer_failed(exc)
                rec.t_end = time.monotonic()

    def _read_step_times(self, timer: Any) -> None:
        """Read the timed steps the GPU has finished, oldest first, into their records' ``gpu_ms``
        and give their events back. Here, on the engine thread, and nowhere else: a CUDA call from
        another thread while vLLM captures CUDA graphs on a serving worker (0.32's elastic-EP
        scale-up) would invalidate the capture, as NCCL's watchdog queries did (PyTorch's
        ``capture_error_mode`` docs). With async scheduling the newest step is still running, so
        the one before it is read: one query and one elapsed time per step."""
        unread = self._unread
        for _ in range(_READS_PER_STEP):
            rec = unread[0]
            ms = timer.elapsed_ms(rec.mark)
            if ms is None:
                break  # still running on the GPU
            unread.popleft()
            timer.release(rec.mark)
            rec.mark = None
            rec.gpu_ms = ms
            if not unread:
                return
        while len(unread) > _MAX_UNREAD:  # the GPU fell far behind: those steps go unmeasured
            unread.popleft().mark = None

    def _step_timer_failed(self, exc: Exception) -> None:
        """A step timer that faults on the step path turns the closed loop off (once); the step
        itself is still recorded, metered and traced."""
        self._unread.clear()
        self.timing.turn_off(f"step timer fault ({type(exc).__name__})")
        vllm_compat.fault_once("step_timer", exc, "timing a step on the GPU", "the decode clock stays at its default")
