"""Per-phase clock controller with hysteresis and look-ahead, applied off vLLM's critical path.

**How TP/PP ranks stay in agreement without talking.** Every rank runs its own controller for its
own GPU, and every input that decides a clock is identical on all ranks:

* the phase of each step, classified from the ``SchedulerOutput`` that the EngineCore broadcasts
  to every worker (same object, same order);
* the look-ahead facts (requests and prompt tokens waiting in the scheduler's queue) and the
  *scheduler's* timestamp, both attached to that ``SchedulerOutput`` in the EngineCore process by
  :func:`vllm_powersave.vllm_compat.install_scheduler_hooks` before the broadcast. The dwell and the
  regime window are measured on that shared timestamp (``now=`` of :meth:`ClockController.on_phase`),
  not on each rank's own clock, so a rank never lowers one step earlier than another;
* the settings (validated once in the API server and exported to every process).

:meth:`ClockController.decide` is therefore a pure function of the step sequence, and equal
sequences give equal decision streams (tested for TP=2). Two inputs are local and used only while
no step runs: idle detection (no step for ``energy.idle_after_s``) and the arrival ramp
(:meth:`ClockController.on_arrival`, only where the worker shares the EngineCore process, i.e.
single-GPU engines). Neither can put two ranks at different clocks during a collective; the next
step's decision is again identical on every rank.

**Async scheduling (the host runs one step ahead).** With ``async_scheduling`` vLLM schedules and
launches step N+1 while the GPU still executes step N, so the hook sees each step about one step
before the GPU runs it. Raising early is harmless (a prefill burst gets its clock up to one step
sooner; it costs at most one step of energy). Lowering early would slow the previous step, so with
``host_ahead_steps=1`` a lower clock additionally needs ``host_ahead_steps + 1`` consecutive steps
asking for it (on top of ``min_dwell_ms``): the step that is still running on the GPU is never one
that wanted the higher clock.

**Applying.** An NVML or zeusd call takes milliseconds, so :meth:`on_phase` only records the target;
a background thread applies the newest one (older targets are coalesced, no-ops skipped).

**Safety.** A lock is never left behind. Every lock writes a lease file naming the GPU, our PID and
how to undo it; :meth:`close` resets and removes it (also run by ``atexit``); a later start, or
``vllm-powersave reset-clocks``, resets GPUs whose lease belongs to a dead process; the watchdog
process (``clocks/watchdog.py``) resets when we die *or* stop heart-beating (:meth:`heartbeat`).
Any backend fault other than a permission error stops clock control for the rest of the run after
one reset attempt; the server keeps serving.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..settings import KERNEL_GROUPS, ClockPreset, ClockSettings
from .backends import ClockBackend, ClockChange, ClockError, ClockPermissionError, DryRunClockBackend, reset_from_lease
from .closed_loop import UNKNOWN, DecodeClockTuner
from .leases import LeaseStore

log = logging.getLogger("vllm.powersave.clocks")

#: A locked clock read back within this of the request counts as applied (MHz): one supported
#: step of the H200's SM clock table is ~15 MHz (docs/h200-facts.md).
_READBACK_TOL_MHZ = 20


class SwitchWatch:
    """The clock switch awaiting its read-back, and the switch latency learned from read-back
    (owned by :class:`ClockController`; docs/closed-loop.md, "Read-back")."""

    def __init__(self) -> None:
        # Request to the read-back that showed it (s), over recent switches that landed at the
        # first try (a resent one measures a loss, not a lag).
        self.times: deque[float] = deque(maxlen=32)
        self.t: float | None = None  # when the switch now awaiting its read-back was requested
        self.from_mhz: int | None = UNKNOWN  # the lock read back before it (UNKNOWN: none)
        # (switch time, read time): the lock before that switch was still read back then.
        self.seen_until: tuple[float, float] | None = None
        #: The learned switch latency (s; ``None``: fewer than 4 switches yet).
        self.estimate_s: float | None = None

    def learn(self, lag_s: float) -> float | None:
        """One switch's time from request to the read-back that showed it; returns the estimate:
        the 90th percentile (nearest rank) of the last 32, once 4 are in. A robust upper value: a
        read-back comes at a step's end, so each time is rounded up to it."""
        self.times.append(max(0.0, lag_s))
        if len(self.times) >= 4:
            ordered = sorted(self.times)
            self.estimate_s = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        return self.estimate_s


def _rank(p: ClockPreset) -> float:
    """Order presets by SM clock; the driver default (no lock) is the highest."""
    return float("inf") if p.sm_clock_mhz is None else float(p.sm_clock_mhz)


def group_gate(settings: ClockSettings) -> tuple[dict[str, dict[str, ClockPreset]], list[str]]:
    """Kernel-group presets that pass the switch-latency gate, and one line per ignored group.

    A group preset is used only if its measured contiguous duration is at least
    ``group_min_switch_multiple * switch_latency_ms``: a clock takes ``switch_latency_ms`` to take
    effect, so for shorter groups most of the requested clock would land on the neighbouring
    kernels (seed 000 tuned kernel clocks offline and never paid this cost).
    """
    min_ms = settings.group_min_switch_multiple * settings.switch_latency_ms
    active: dict[str, dict[str, ClockPreset]] = {}
    ignored = []
    for phase, preset in settings.presets.items():
        for group, gp in preset.groups.items():
            where = f"clocks.presets.{phase}.groups.{group}"
            if gp.duration_ms is None:
                ignored.append(f"{where}: ignored, no measured duration_ms (needs >= {min_ms:g} ms)")
            elif gp.duration_ms < min_ms:
                ignored.append(
                    f"{where}: ignored, measured {gp.duration_ms:g} ms < {settings.group_min_switch_multiple:g} x "
                    f"switch latency {settings.switch_latency_ms:g} ms"
                )
            else:
                active.setdefault(phase, {})[group] = ClockPreset(sm_clock_mhz=gp.sm_clock_mhz, mem_clock_mhz=gp.mem_clock_mhz)
    return active, ignored


def _sigterm_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _exit_on_sigterm() -> None:
    """Make SIGTERM run ``atexit`` (and so :meth:`ClockController.close`) where nobody handles it.

    Python's default SIGTERM action ends the process without ``atexit``; vLLM's processes install
    their own handler (raising ``SystemExit``), which is left alone. Main thread only.
    """
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _sigterm_exit)
    except (ValueError, OSError):
        pass


class ClockController:
    """Maps phases (and kernel groups) to clock presets with hysteresis and look-ahead.

    Args:
        backend: where clocks go (nvml, zeusd, dry-run or simulated).
        settings: presets per phase, dwell, switch latency, heartbeat timeout.
        gpu_id: GPU UUID (lease key).
        asynchronous: apply in a background thread (production) or inline (tests, simulation).
        clock: monotonic time source in seconds, used when a call passes no ``now``.
        watchdog: start the out-of-process watchdog before the first real lock.
        host_ahead_steps: 1 under vLLM's async scheduling (host one step ahead of the GPU), else 0.
    """

    #: Clock switches not read back within switch_confirm_ms (re-sent, or the loop turned off).
    n_unconfirmed: int = 0

    def __init__(
        self,
        backend: ClockBackend,
        settings: ClockSettings,
        gpu_id: str = "gpu0",
        asynchronous: bool = True,
        clock: Callable[[], float] = time.monotonic,
        watchdog: bool = True,
        host_ahead_steps: int = 0,
    ) -> None:
        self.watchdog = watchdog
        self.backend = backend
        self.settings = settings
        self.gpu_id = gpu_id
        self.clock = clock
        self.host_ahead_steps = max(0, int(host_ahead_steps))
        self.leases = LeaseStore(settings.lease_dir) if backend.kind == "real" else None
        self.disabled_reason: str | None = None
        groups, ignored = group_gate(settings)
        for line in ignored:
            log.info("powersave: %s", line)
        self.groups_ignored = ignored
        try:
            self._snap_all(settings, groups)
        except ClockPermissionError as exc:  # cannot even list clocks: nothing can be locked
            log.warning("powersave: %s; clock control falls back to dry-run for GPU %s", exc, gpu_id)
            self.backend = DryRunClockBackend()
            self.leases = None
            self._snap_all(settings, groups)
        except Exception as exc:
            self.disabled_reason = f"{type(exc).__name__}: {exc}"
            log.error("powersave: clock control disabled for GPU %s: cannot read supported clocks (%s); serving continues", gpu_id, exc)
            self.presets, self.groups = {}, {}
        self.min_dwell_s = settings.min_dwell_ms / 1000.0
        self.current: ClockPreset = ClockPreset()  # None/None: driver default
        self.phase: str | None = None
        self.group: str | None = None
        self._all_targets = {p: self.presets.get(p, ClockPreset()) for p in ("prefill", "decode", "mixed", "idle")}
        self._same = {p: t == self.current for p, t in self._all_targets.items()}
        self._same_for = self.current  # the preset object _same was computed against (presets are frozen)
        self.last_change_s = -1e18
        # What the GPU was confirmed to run, from when (s, same clock as on_phase's now): the SM
        # clock read back (None: the default), or UNKNOWN from a switch until its read-back.
        self._clock_log: deque[tuple[float, int | None]] = deque([(-float("inf"), None)], maxlen=64)
        self._confirmed = True  # the last switch was read back
        self._sent_s = -float("inf")  # when the current target was (re)sent
        self._attempts = 0  # re-sends of the current target
        self._last_lock_mhz: int | None = None  # the last SM clock locked (a reset must read above it)
        self._steps_since_read = 0
        #: Why the closed loop turned off after a switch never read back (one warning), else None.
        self.readback_off: str | None = None
        self.closed_loop: DecodeClockTuner | None = None
        self._init_closed_loop(settings)
        self._down_since: float | None = None
        self._down_steps = 0
        self._down_target: ClockPreset | None = None
        self._pre_idle: tuple | None = None  # decision state saved by idle_begin()
        self._arrival_raised = False
        # Bounded: a server runs for weeks; the count is kept separately.
        self.decisions: deque[ClockChange] = deque(maxlen=4096)
        self.n_changes = 0
        self._pending: tuple[str, ClockPreset, Callable[[], Any] | None] | None = None
        self._apply_lock = threading.Lock()
        self._maybe_locked = False  # what the GPU may have, as opposed to what we last wanted
        # A real backend whose lock could not be undone when we fell back to dry-run: close()
        # retries once; its lease stays for the watchdog, the next start or reset-clocks.
        self._leftover: ClockBackend | None = None
        # Heartbeat: start of the step in flight (monotonic s), None between steps. Public so that the
        # step hook can write it in place (a method call costs microseconds with cold caches, per step).
        self.step_since: float | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.leases is not None:
            self.recover_stale()
            _exit_on_sigterm()
        if asynchronous:
            self._thread = threading.Thread(target=self._loop, name="powersave-clocks", daemon=True)
            self._thread.start()
        atexit.register(self.close)

    def _init_closed_loop(self, settings: ClockSettings) -> None:
        self._sw = SwitchWatch()  # the switch awaiting its read-back, and the latency learned
        cl = settings.closed_loop
        if not cl.enabled or self.disabled_reason is not None:
            return
        static = self.presets.get("decode")
        if static is not None and static.sm_clock_mhz is not None:
            log.info(
                "powersave: clocks.presets.decode = %s MHz overrides clocks.closed_loop (static clock, nothing probed)", static.sm_clock_mhz
            )
            return
        try:
            self.closed_loop = DecodeClockTuner(cl, self.backend.supported_sm_clocks())
        except Exception as exc:  # a backend that cannot list clocks: the loop stays off, serving goes on
            log.error("powersave: closed-loop decode clock off for GPU %s: %s", self.gpu_id, exc)

    @property
    def closed_loop_active(self) -> bool:
        """Whether the closed loop still learns: it exists (not overridden by a static decode
        preset), and clock control is neither disabled after a fault nor closed."""
        return self.closed_loop is not None and self.disabled_reason is None and self.readback_off is None and not self._closed

    def ran_at(self, start_s: float, end_s: float) -> int | None:
        """The SM clock (MHz, ``None``: default) a step spanning ``[start_s, end_s]`` ran at
        throughout, or ``UNKNOWN``: a switch was requested before it and not yet read back, or
        anything changed inside it. Only read-back clocks count (:meth:`_read_back`), never what
        was asked for. Dry-run never changes the GPU: always the default."""
        if self.backend.kind == "dry-run":
            return None
        clock: int | None = UNKNOWN
        seen = self._sw.seen_until
        for t, f in tuple(self._clock_log):  # a copy: on_phase may append from the engine thread
            if seen is not None and t == seen[0] and f == UNKNOWN and end_s <= seen[1]:
                continue  # that switch had not landed by the step's end: the old lock still read back
            if t <= start_s:
                clock = f
            elif t < end_s:
                return UNKNOWN
        return clock

    def _landed(self, want: int | None, read: int | None) -> bool:
        """Whether the read-back clock shows the requested one: a lock within
        ``_READBACK_TOL_MHZ``; a reset above the clock last locked (the default is the driver's
        choice, but never the lock it replaced), or at the top supported clock (a lock within
        the tolerance of the top cannot be told from the reset, and costs nothing to miss)."""
        if read is None:
            return False
        if want is not None:
            return abs(read - want) <= _READBACK_TOL_MHZ
        last = self._last_lock_mhz
        top = self.closed_loop.default_mhz if self.closed_loop is not None else math.inf
        return last is None or read > last + _READBACK_TOL_MHZ or read >= top - _READBACK_TOL_MHZ

    def _resets_watched(self) -> bool:
        """Whether read-back still watches a reset after the closed loop turned off for a switch
        never read back: a lost reset would otherwise leave decode at the last lock (the idle
        preset's clock, say) until the next phase change. Locks are not watched then."""
        return (
            self.readback_off is not None
            and self.current.sm_clock_mhz is None
            and self.backend.kind != "dry-run"
            and self.disabled_reason is None
            and not self._closed
        )

    def _read_back(self, now_s: float) -> None:
        """Read the applied SM clock back after a switch (each step until it shows) and every
        ``readback_every_steps`` steps while holding; a switch not shown within
        ``switch_confirm_ms`` is re-sent, at most ``switch_retries`` times, then the closed loop
        turns off (:meth:`_readback_failed`)."""
        cl = self.settings.closed_loop
        if self._confirmed and self._steps_since_read + 1 < cl.readback_every_steps:
            self._steps_since_read += 1
            return
        self._steps_since_read = 0
        want = self.current.sm_clock_mhz
        read = self.backend.read_sm_clock_mhz()
        # Under a background apply thread the read happens now, possibly after the step's end.
        t = max(now_s, self.clock()) if self._thread is not None else now_s
        if self.closed_loop is not None:
            self.closed_loop.read_back_mhz = read
        if self._landed(want, read):
            if not self._confirmed:
                self._clock_log.append((t, want))
                if self._sw.t is not None and self._attempts == 0:
                    self._learn_latency(t - self._sw.t)
                self._confirmed, self._attempts, self._sw.t = True, 0, None
            return
        if self._confirmed:  # it was there and is not any more (a reset under us): re-send now
            self._clock_log.append((t, UNKNOWN))
            self._confirmed, self._sent_s, self._sw.t = False, -float("inf"), None
        elif self._sw.t is not None and self._sw.from_mhz not in (None, UNKNOWN) and read is not None:
            if abs(read - self._sw.from_mhz) <= _READBACK_TOL_MHZ:
                self._sw.seen_until = (self._sw.t, t)  # still the lock before: steps up to now ran at it
        if now_s - self._sent_s <= cl.switch_confirm_ms / 1000.0:
            return
        self._attempts += 1
        self.n_unconfirmed += 1
        if self._attempts > cl.switch_retries:
            if self.readback_off is None:
                self._readback_failed(now_s, want, read)
                return
            self._attempts = 0  # the loop is off already: a lost reset is sent again every so often
        self._resend(now_s)

    @property
    def switch_latency_s(self) -> float | None:
        """The switch latency learned from read-back (s; :class:`SwitchWatch`), ``None`` until 4
        switches were read back."""
        return self._sw.estimate_s

    def _learn_latency(self, lag_s: float) -> None:
        est = self._sw.learn(lag_s)
        if self.closed_loop is not None:
            self.closed_loop.switch_latency_s = est

    def _resend(self, now_s: float) -> None:
        """Send the current target again (a switch that did not show in the read-back)."""
        self._sent_s = now_s
        target = self.current
        if self._thread is None:
            self._apply("resend", target)
        else:
            with self._cv:
                self._pending = ("resend", target, None)
                self._cv.notify()

    def _readback_failed(self, now_s: float, want: int | None, read: int | None) -> None:
        """A switch never read back: the closed loop off for good (one warning), its held clocks
        forgotten (no saving is reported for a clock never confirmed), the default decode clock."""
        cl = self.settings.closed_loop
        self.readback_off = (
            f"SM clock {want or 'default'} MHz requested, {read if read is not None else 'nothing'} read back "
            f"after {cl.switch_retries + 1} tries of {cl.switch_confirm_ms:g} ms"
        )
        log.warning(
            "powersave: closed-loop decode clock off for GPU %s (%s backend): %s; decode runs at the default clock",
            self.gpu_id,
            self.backend.kind,
            self.readback_off,
        )
        if self.closed_loop is not None:
            self.closed_loop.turn_off(now_s, f"read-back: {self.readback_off}")
        self._retarget("decode", self.presets.get("decode") or ClockPreset())
        if want is None:
            self._resend(now_s)  # a reset that did not show: one more try; leases and close() stay in charge

    def stop_closed_loop(self, now_s: float, reason: str) -> None:
        """The closed loop off for good after a fault outside the controller (e.g. feeding it): its
        held clocks forgotten, and the decode target back to the static preset or the default, so
        no clock chosen by a loop that no longer tracks it stays applied."""
        if self.closed_loop is not None:
            self.closed_loop.turn_off(now_s, reason)
        self._retarget("decode", self.presets.get("decode") or ClockPreset())

    def observe_decode_step(
        self,
        now_s: float,
        batch: int,
        step_ms: float,
        memory_bound: bool = True,
        ctx_tokens: float = 0.0,
        tokens: int | None = None,
        span_s: tuple[float, float] | None = None,
    ) -> int | None:
        """Feed one finished step to the closed-loop decode clock; returns its SM clock (MHz) for
        the next decode steps (``None``: default), which the next :meth:`on_phase` applies through
        the usual dwell (lowering) or at once (raising), with every lease and reset guarantee.

        ``now_s``: the step's end on the same clock as ``on_phase``'s ``now``; ``batch``: decode
        requests in it; ``step_ms``: its time (on the GPU where timed there: device/step_timer.py);
        ``memory_bound``: the step's regime (False: not measured, default clock); ``ctx_tokens``:
        decode context (KV tokens); ``tokens``: tokens scheduled in the step (``None``: ``batch``; a
        mixed step is not measured); ``span_s``: the interval (same clock as ``now_s``) the step can
        have run in (``None``: the ``step_ms`` before ``now_s``); a clock switch landing anywhere in
        it makes the step no measurement.
        A no-op returning ``None`` when the loop is off, overridden by a static decode preset,
        disabled after a fault, or closed.

        Threads: call it from one thread, the engine thread or the thread that drains the step
        records (it costs tens of microseconds per step, too much for the step hook on a busy
        host); it only replaces the decode target, which ``on_phase`` reads (atomic under the GIL).
        """
        tuner = self.closed_loop
        if tuner is None or not self.closed_loop_active:
            if self._resets_watched():
                self._read_back(now_s)  # a reset lost after the loop turned off is still sent again
            return None
        tuner.dry_run = self.backend.kind == "dry-run"  # also after a permission fallback
        if not tuner.dry_run:
            self._read_back(now_s)
            if not self.closed_loop_active:
                return None
        ran = self.ran_at(*span_s) if span_s is not None else self.ran_at(now_s - step_ms / 1000.0, now_s)
        mhz = tuner.observe(now_s, batch, step_ms, ran, ctx_tokens, memory_bound, tokens)
        if memory_bound:
            target = self._all_targets["decode"]
            if target.sm_clock_mhz != mhz:
                self._retarget("decode", ClockPreset() if mhz is None else ClockPreset(sm_clock_mhz=mhz))
        return mhz

    def observe_gpu_tenants(self, now_s: float, others: int | None) -> None:
        """Tell the closed loop how many other compute processes share the GPU (``None``:
        unknown); see :meth:`DecodeClockTuner.observe_gpu_tenants`. ``now_s`` on the same clock
        as :meth:`observe_decode_step`'s. Call it from the thread that calls that method."""
        if self.closed_loop is not None:
            self.closed_loop.observe_gpu_tenants(now_s, others)

    def _retarget(self, phase: str, target: ClockPreset) -> None:
        """Replace one phase's target (the closed loop's decode clock); decide() applies it."""
        self._all_targets[phase] = target
        cur = self.current
        self._same = {p: t is cur or t == cur for p, t in self._all_targets.items()}
        self._same_for = cur

    def _snap_all(self, settings: ClockSettings, groups: dict[str, dict[str, ClockPreset]]) -> None:
        self.presets: dict[str, ClockPreset] = {phase: self._snapped(p, f"presets.{phase}") for phase, p in settings.presets.items()}
        self.groups: dict[str, dict[str, ClockPreset]] = {
            ph: {g: self._snapped(p, f"presets.{ph}.groups.{g}") for g, p in gs.items()} for ph, gs in groups.items()
        }

    def _snapped(self, p: ClockPreset, where: str) -> ClockPreset:
        """Out-of-range or unsupported clocks snapped to the GPU's supported list (one info line)."""
        sm = self.backend.snap(p.sm_clock_mhz) if p.sm_clock_mhz is not None else None
        mem = self.backend.snap_mem(p.mem_clock_mhz) if p.mem_clock_mhz is not None else None
        if (sm, mem) != (p.sm_clock_mhz, p.mem_clock_mhz):
            log.info(
                "powersave: clocks.%s snapped to supported clocks: SM %s -> %s MHz, memory %s -> %s MHz",
                where,
                p.sm_clock_mhz,
                sm,
                p.mem_clock_mhz,
                mem,
            )
        return ClockPreset(sm_clock_mhz=sm, mem_clock_mhz=mem)

    # -- decisions ---------------------------------------------------------------------------
    def decide(self, phase: str, now: float | None = None) -> ClockPreset | None:
        """The preset to switch to now for ``phase``, or ``None`` to stay.

        Asymmetric hysteresis: a higher clock (or the driver default) is applied at once, so a
        prefill burst after idle or decode is never slowed; a lower clock only once the phases
        asking for it have lasted ``min_dwell_ms`` (and ``host_ahead_steps + 1`` steps) without
        interruption, so short decode runs between prefills do not make the clock oscillate.
        ``now``: the scheduler's timestamp (s), identical on all ranks; default ``clock()``.
        """
        target = self._all_targets.get(phase) or ClockPreset()
        current = self.current
        # Presets are frozen models, so equality computed once (_same, against _same_for) holds for
        # as long as those objects are the ones compared; a model comparison costs microseconds.
        if target is current:
            same = True
        elif current is self._same_for and phase in self._same:
            same = self._same[phase]
        else:
            same = target == current
        if same:
            self._down_since = None
            return None
        if _rank(target) > _rank(current):
            self._down_since = None
            return target
        t = self.clock() if now is None else now
        if self._down_since is None or (self._down_target is not target and self._down_target != target):
            self._down_since, self._down_target, self._down_steps = t, target, 0
        self._down_steps += 1
        if t - self._down_since >= self.min_dwell_s and self._down_steps > self.host_ahead_steps:
            self._down_since = None
            return target
        return None

    def on_phase(self, phase: str, now: float | None = None) -> None:
        """Called once per engine step (hot path: no I/O here, and no work when nothing changes)."""
        self.phase = phase
        if self._same.get(phase, False) and self._down_since is None and self.group is None:
            return  # the common case: this phase's preset is already applied
        if self.disabled_reason is not None or self._closed:
            return
        self.group = None
        target = self.decide(phase, now)
        if target is not None:
            self._switch(phase, target, now)

    def on_step(self, phase: str, now: float, t_step: float, engine_idled: bool | None) -> None:
        """One engine step's clock decision, from the step hook (hot path: one call per step).

        ``now``: the scheduler's stamp (same on every rank; else the step's start); ``t_step``: the
        step's start on this host (the watchdog's heartbeat); ``engine_idled``: the engine-wide
        idle verdict from the scheduler's stamps, ``None`` without stamps (this rank's own timer
        is then the verdict). Same decisions as :meth:`idle_end` where needed, then
        :meth:`on_phase`; their no-change returns are inlined (the common step).
        """
        if engine_idled or self._pre_idle is not None:
            self.idle_end(True if engine_idled is None else engine_idled, now)
        self.step_since = t_step
        if self._same.get(phase, False) and self._down_since is None and self.group is None:
            self.phase = phase
        else:
            self.on_phase(phase, now)

    # -- idle, rank-consistently -----------------------------------------------------------------
    # Idle is seen by each rank's own timer (no step for idle_after_s), so two TP ranks can disagree
    # on whether a short gap was idle. The decision state therefore leaves idle only through
    # idle_end(), called by the next step with the engine-wide verdict (from the scheduler's
    # stamps, identical on all ranks): either every rank is put in the same post-idle state, or a
    # rank that idled on its own timer is put back where it was. Step decisions stay identical.
    def idle_begin(self, now: float | None = None) -> None:
        """No step for ``idle_after_s`` on this rank's timer: move towards the idle preset."""
        if self._pre_idle is None:
            self._pre_idle = (self.current, self._down_since, self._down_target, self._down_steps, self.phase)
        self.on_phase("idle", now)

    def idle_end(self, engine_idled: bool, now: float | None = None) -> None:
        """Before the first step after a gap: make the decision state rank-independent.

        ``engine_idled``: the engine-wide verdict (same on every rank). True: every rank continues
        from the idle preset reached (applied now where this rank had not reached it). False: a rank
        whose own timer started idling returns to its pre-idle state (and clock).
        """
        saved, self._pre_idle = self._pre_idle, None
        arrival, self._arrival_raised = self._arrival_raised, False
        if self.disabled_reason is not None or self._closed:
            return
        if arrival and not engine_idled:
            return  # raised on arrival: keep it; the step decides from here
        if engine_idled:
            idle = self._all_targets.get("idle") or ClockPreset()
            # A look-ahead raise on arrival stays (arrivals reach only single-process engines,
            # where there is no other rank to agree with).
            if self.current != idle and not self._arrival_raised:
                self._switch("idle", idle, now)
            self._down_since, self._down_target, self._down_steps, self.phase = None, None, 0, "idle"
        elif saved is not None:
            current, since, target, steps, phase = saved
            if self.current != current:
                self._switch(phase or "decode", current, now)
            self._down_since, self._down_target, self._down_steps, self.phase = since, target, steps, phase

    @property
    def idling(self) -> bool:
        """Whether idle_begin() ran since the last idle_end()."""
        return self._pre_idle is not None

    def on_arrival(self, now: float | None = None) -> None:
        """A request arrived (look-ahead): an idle-clocked GPU ramps up before the first step.

        Only from the idle phase (arrivals during serving join the running batch and are handled
        by the step's own decision); raises to the prefill preset at once if the current clock is
        lower, never lowers. Called from the scheduler's ``add_request`` where the worker shares
        the EngineCore process.
        """
        if self.phase != "idle" or not self.settings.lookahead or self.disabled_reason is not None or self._closed:
            return
        target = self._all_targets["prefill"]
        if _rank(target) > _rank(self.current):
            self._down_since = None
            self._arrival_raised = True
            self._switch("arrival", target, now)

    def has_group(self, group: str) -> bool:
        """Whether ``group`` has an active preset in the current phase (one dict lookup)."""
        return group in self.groups.get(self.phase or "", ())

    def on_group(self, group: str, now: float | None = None, ready: Callable[[], Any] | None = None) -> None:
        """Entering kernel group ``group`` of the current phase: its preset, if it passed the gate.

        ``ready``: blocks until the GPU reaches the group (e.g. ``torch.cuda.Event.synchronize`` of
        an event recorded at the boundary). The host runs ahead of the GPU, so the background
        thread waits on it before applying; the engine thread never waits.
        """
        preset = self.groups.get(self.phase or "", {}).get(group)
        if preset is None or self.disabled_reason is not None or self._closed:
            return
        self.group = group
        if preset != self.current:
            self._switch(f"{self.phase}/{group}", preset, now, ready)

    def end_group(self, now: float | None = None, ready: Callable[[], Any] | None = None) -> None:
        """Leaving the kernel group: back to the phase's clock (no dwell: the gate already paid it)."""
        if self.group is None:
            return
        self.group = None
        target = self._all_targets.get(self.phase or "", ClockPreset())
        if target != self.current and self.disabled_reason is None and not self._closed:
            self._switch(self.phase or "", target, now, ready)

    def _switch(self, phase: str, target: ClockPreset, now: float | None, ready: Callable[[], Any] | None = None) -> None:
        self.current = target
        self._same = {p: t is target or t == target for p, t in self._all_targets.items()}
        self._same_for = target
        self.last_change_s = self.clock() if now is None else now
        self._sw.from_mhz = self._clock_log[-1][1] if self._confirmed else UNKNOWN
        self._clock_log.append((self.last_change_s, UNKNOWN))  # until read back (observe_decode_step)
        self._confirmed, self._sent_s, self._attempts = False, self.last_change_s, 0
        self._sw.t = self.last_change_s
        if target.sm_clock_mhz is not None:
            self._last_lock_mhz = target.sm_clock_mhz
        self.decisions.append(ClockChange(self.last_change_s, phase, target.sm_clock_mhz, target.mem_clock_mhz))
        self.n_changes += 1
        if self._thread is None:
            if ready is not None:
                ready()
            self._apply(phase, target)
        else:
            with self._cv:
                self._pending = (phase, target, ready)  # coalesce: only the newest target matters
                self._cv.notify()

    # -- heartbeat ---------------------------------------------------------------------------
    def step_begun(self, now: float | None = None) -> None:
        """A step started (hot path: one attribute write)."""
        self.step_since = time.monotonic() if now is None else now

    def step_ended(self) -> None:
        self.step_since = None

    def heartbeat(self) -> bool:
        """Tell the watchdog we are alive, unless a step has hung for ``heartbeat_timeout_s``.

        Runs on the background thread every quarter timeout (call it yourself when
        ``asynchronous=False``). A frozen process, or one whose step never ends (a hung kernel or
        collective), stops beating and the watchdog resets its clocks. If the watchdog already did,
        clock control stops here (one reset attempt; the server keeps serving). Returns whether a
        beat was written.
        """
        if self.leases is None or not self._maybe_locked or self._closed:
            return False
        if self.leases.revoked_for(self.gpu_id, os.getpid()):
            with self._apply_lock:
                if self.disabled_reason is None:
                    self._fault(ClockError("the watchdog reset the clocks: this engine missed its heartbeats"))
            return False
        since = self.step_since
        if since is not None and time.monotonic() - since > self.settings.heartbeat_timeout_s:
            return False
        try:
            self.leases.beat(self.gpu_id)
        except OSError:
            return False
        return True

    # -- applying ----------------------------------------------------------------------------
    def _loop(self) -> None:
        period = self.settings.heartbeat_timeout_s / 4
        while True:
            with self._cv:
                if self._pending is None and not self._closed:
                    self._cv.wait(timeout=period)
                if self._closed:
                    return
                item, self._pending = self._pending, None
            if item is not None:
                phase, target, ready = item
                if ready is not None:
                    try:
                        ready()
                    except Exception:
                        pass  # a failed wait only misplaces the switch in time
                self._apply(phase, target)
            self.heartbeat()

    def _apply(self, phase: str, target: ClockPreset) -> None:
        with self._apply_lock:
            if self._closed and target.sm_clock_mhz is not None:
                return  # close() owns the final state: never lock after it started
            if self.disabled_reason is not None:
                return
            was_locked = self._maybe_locked
            try:
                if self.leases and self.leases.revoked_for(self.gpu_id, os.getpid()):
                    raise ClockError("the watchdog reset the clocks: this engine missed its heartbeats")
                if target.sm_clock_mhz is None:
                    self._reset_and_release()
                else:
                    if self.leases and self.backend.kind == "real":
                        info = self.backend.lease_info()
                        if target.mem_clock_mhz is not None:
                            info["mem_locked"] = True  # pessimistic, like _maybe_locked below
                        self.leases.acquire(self.gpu_id, target.sm_clock_mhz, info)
                        self._start_watchdog()
                    # Pessimistic: from here on the GPU may be locked, even if the call fails midway.
                    self._maybe_locked = True
                    self.backend.set_clocks(target.sm_clock_mhz, target.mem_clock_mhz)
            except ClockPermissionError as exc:
                self._to_dry_run(exc, target, was_locked)
            except Exception as exc:  # NVML faults and anything else: never take the engine down
                self._fault(exc)

    def _reset_and_release(self) -> None:
        """Reset the clocks; the lease is released only once the reset succeeded (raises otherwise)."""
        self.backend.reset()
        self._maybe_locked = False
        if self.leases and self._leftover is None:
            self.leases.release(self.gpu_id)

    def _to_dry_run(self, exc: Exception, target: ClockPreset, was_locked: bool) -> None:
        log.warning("powersave: %s; clock control falls back to dry-run for GPU %s", exc, self.gpu_id)
        if was_locked or target.sm_clock_mhz is None or self.backend.may_hold_lock():
            # An earlier lock may still hold (the daemon went away, a token expired), or the SM
            # lock took effect before the memory lock was refused: undo it once.
            try:
                self._reset_and_release()
            except Exception as exc2:
                self._leftover = self.backend
                log.error("powersave: reset failed for GPU %s (%s); lease kept for recovery", self.gpu_id, exc2)
        elif self.leases:
            self.leases.release(self.gpu_id)  # a refused lock never took effect
        self._maybe_locked = False
        try:
            supported: tuple[int, ...] | None = self.backend.supported_sm_clocks()
        except Exception:
            supported = None
        self.backend = DryRunClockBackend(supported)
        if self._leftover is None:
            self.leases = None
        if target.sm_clock_mhz is not None:
            self.backend.set_clocks(target.sm_clock_mhz, target.mem_clock_mhz)

    _watchdog_started = False

    def _start_watchdog(self) -> None:
        """Once per process, before the first real lock: survive a SIGKILL or a hang of this process."""
        if ClockController._watchdog_started or not self.watchdog:
            return
        ClockController._watchdog_started = True
        import subprocess
        import sys

        try:
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm_powersave.clocks.watchdog",
                    "--pid",
                    str(os.getpid()),
                    "--lease-dir",
                    str(self.settings.lease_dir),
                    "--heartbeat-timeout-s",
                    str(self.settings.heartbeat_timeout_s),
                ],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except OSError as exc:
            log.warning("powersave: clock watchdog not started (%s); stale locks are reset at the next start", exc)

    def _fault(self, exc: Exception) -> None:
        self.disabled_reason = f"{type(exc).__name__}: {exc}"
        log.error("powersave: clock control stopped for GPU %s after a fault (%s); serving continues", self.gpu_id, exc)
        try:
            self._reset_and_release()
        except Exception as exc2:
            # Keep the lease: the watchdog, the next start or `vllm-powersave reset-clocks` retries.
            log.error("powersave: reset after the fault failed for GPU %s (%s); lease kept for recovery", self.gpu_id, exc2)

    def recover_stale(self) -> list[str]:
        """Reset GPUs whose lease belongs to a dead process (a SIGKILLed server). Returns their ids."""
        recovered = []
        assert self.leases is not None
        for lease in self.leases.stale():
            if lease.get("gpu") != self.gpu_id:
                continue
            log.warning("powersave: resetting clocks of GPU %s left locked by dead PID %s", self.gpu_id, lease.get("pid"))
            try:
                if lease.get("backend", "nvml") == self.backend.lease_info().get("backend") or lease.get("corrupt"):
                    if hasattr(self.backend, "mem_may_be_locked"):
                        self.backend.mem_may_be_locked = bool(lease.get("mem_locked", True))  # type: ignore[attr-defined]
                    self.backend.reset()
                else:
                    reset_from_lease(lease)
            except Exception as exc:
                log.error("powersave: reset of stale lock failed (%s); lease kept", exc)
                continue
            self.leases.release(self.gpu_id)
            recovered.append(self.gpu_id)
        return recovered

    def close(self) -> None:
        """Stop the thread and restore the driver's default clocks. Idempotent.

        Waits for an in-flight NVML call (up to 30 s); the reset then runs whatever the controller
        last wanted, because what matters is what the GPU may have been given.
        """
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._pending = None
            self._cv.notify()
        got = self._apply_lock.acquire(timeout=30.0)
        try:
            if self._maybe_locked:
                try:
                    self._reset_and_release()
                except Exception as exc:
                    log.error("powersave: clock reset at exit failed for GPU %s (%s); lease kept for recovery", self.gpu_id, exc)
            elif self.leases and self._leftover is None:
                self.leases.release(self.gpu_id)
            if self._leftover is not None:
                try:
                    self._leftover.reset()
                    self._leftover = None
                    if self.leases:
                        self.leases.release(self.gpu_id)
                except Exception as exc:
                    log.error("powersave: clock reset at exit failed for GPU %s (%s); lease kept for recovery", self.gpu_id, exc)
            self.current = ClockPreset()
        finally:
            if got:
                self._apply_lock.release()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    @property
    def target_sm_clock_mhz(self) -> int | None:
        return self.current.sm_clock_mhz


__all__ = ["KERNEL_GROUPS", "ClockController", "LeaseStore", "group_gate"]
