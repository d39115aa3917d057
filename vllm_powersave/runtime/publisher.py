"""The publisher: the background thread that ticks the energy account and writes the stats files
(``stats_contract.py``): the snapshot ``rank<N>.json``, the step trace and the request lines.

:class:`Publisher` runs on its own thread (``powersave-stats``); it has the drain (``drain.py``)
feed the step path's records first, so every file covers the steps up to the last one.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import envs, ray_relay, vllm_compat
from ..clocks import ClockController
from ..clocks.boost import BoostController
from ..clocks.mode import ClockChoice
from ..energy import PhaseEnergyAccount
from ..energy.meters import EnergyMeter
from ..savings import savings_state
from ..settings import PowersaveSettings
from ..starvation import FrontendBusyReader, StarvationWatch
from ..stats_contract import (
    RequestLine,
    WorkerSnapshot,
    boost_line,
    closed_loop_line,
    requests_name,
    snapshot_to_json,
    tick_line,
    trace_line,
    trace_name,
)
from .drain import StepDrain
from .step import CudaPeak, StepHandoff, StepTiming

log = logging.getLogger("vllm.powersave")
#: How long close() waits for the publisher thread's current round (s).
CLOSE_JOIN_S = 5.0
#: Requests finished: the publisher attributes and writes them at once, but at most this often (s).
FLUSH_MIN_S = 0.01
#: NVML's process list (another job on the GPU, for the closed loop) is read at most this often (s):
#: the closed loop leaves steps within ``_TENANT_SETTLE_S`` (0.5 s) of a change out of its tests.
TENANT_POLL_S = 0.5


@dataclass(frozen=True)
class WorkerIdentity:
    """Which worker this is: ``rank`` (unique across data-parallel engines), ``local_rank`` (its
    rank inside its engine), its data-parallel ``engine``, its CUDA ``device_index``, whether it
    runs on a GPU, and ``gpu_id`` (NVML UUID, or ``cudaN-rankM`` / ``simN`` where the figures are
    not NVML's)."""

    rank: int
    local_rank: int
    engine: int
    device_index: int
    on_gpu: bool
    gpu_id: str


@dataclass(eq=False)
class TenantWatch:
    """Other compute processes on this worker's GPU, from NVML's process list, for the closed
    loop (docs/closed-loop.md, "Another process on the GPU"): ``read()`` gives the count or
    ``None`` (unknown), called at most every ``every_s`` (the list is a driver query)."""

    read: Callable[[], int | None]
    every_s: float = TENANT_POLL_S
    _next_s: float = field(default=-math.inf, init=False)

    def poll(self, now_s: float) -> TenantCount | None:
        """The count read now, or ``None`` where the last read is under ``every_s`` old."""
        if now_s < self._next_s:
            return None
        self._next_s = now_s + self.every_s
        try:
            return TenantCount(self.read())
        except Exception as exc:  # the reader maps NVML errors itself; anything else: unknown
            log.debug("powersave: co-tenant count failed: %s", exc)
            return TenantCount(None)


@dataclass(frozen=True)
class TenantCount:
    """One read of :class:`TenantWatch`: other compute processes on the GPU (``None``: unknown)."""

    others: int | None


def tenant_watch(gpu: Any, own_pids: frozenset[int] | None = None, boost: Any = None) -> TenantWatch | None:
    """The watch over ``gpu`` (an :class:`~vllm_powersave.device.NvmlGpu`; ``None``: no watch),
    counting every process but this one, its parent (the engine that started this worker) and
    the perf-boost helper of ``boost`` (a :class:`~vllm_powersave.clocks.BoostController`), whose
    side CUDA context NVML lists on this GPU while it holds the boost, under load all the time:
    counted, it would read as a co-tenant and stop the closed loop's measurements."""
    if gpu is None:
        return None
    base = own_pids if own_pids is not None else frozenset({os.getpid(), os.getppid()})

    def read() -> int | None:
        helper_pid = getattr(getattr(boost, "holder", None), "pid", None)  # it restarts with a new PID
        return gpu.other_compute_processes(base | {helper_pid} if isinstance(helper_pid, int) else base)

    return TenantWatch(read)


@dataclass(eq=False)
class Publisher:
    """The publisher-thread component of :class:`~vllm_powersave.runtime.WorkerRuntime`.

    ``ticks``: the energy ticks behind the per-request figures, for the step trace (the account
    appends them); ``done_requests``: finished requests and their joules (the account appends
    them), written as request lines; ``relay``: under vLLM's Ray executor, the stats relay actor
    the files go through (``ray_relay.py``), else ``None`` and the files are written here.
    """

    settings: PowersaveSettings
    ident: WorkerIdentity
    meter: EnergyMeter | None
    account: PhaseEnergyAccount | None
    clocks: ClockController
    clock_choice: ClockChoice
    boost: BoostController | None
    drain: StepDrain
    handoff: StepHandoff
    timing: StepTiming
    peak: CudaPeak
    stats_path: Path | None
    relay: Any
    ticks: deque[Any]
    done_requests: deque[tuple[str, float | None]]
    frontend: FrontendBusyReader | None
    starvation: StarvationWatch | None
    tenants: TenantWatch | None = None
    trace_path: Path | None = field(init=False)
    _gauge_cache: dict[str, Any] | None = field(default=None, init=False)
    _gauge_t: float = field(default=0.0, init=False)
    _last_tick: float = field(default=0.0, init=False)
    _closed_loop_written: int = field(default=0, init=False)  # the closed loop's decision records already in the trace
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.trace_path = self.stats_path.with_name(trace_name(self.ident.rank)) if self.stats_path else None

    def savings(self) -> dict[str, dict[str, str]]:
        """Which savings are on, off or failed here, and why (savings.py)."""
        off = self.timing.off_reason
        return savings_state(
            self.settings,
            self.clock_choice,
            self.boost.snapshot() if self.boost is not None else None,
            self.ident.on_gpu,
            self.clocks.disabled_reason or (f"closed loop off: {off}" if off else None),
            self.clocks.backend.kind,
            vllm_compat.disabled_features(),
            vllm_compat.installed_features(),
            pacing_off=self.drain.pacing_off_reason(),
        )

    def starvation_snapshot(self) -> dict[str, Any]:
        """Idle-while-busy figures (starvation.py); absent where no API server's busy file is readable."""
        acc, fe = self.account, self.frontend
        if acc is None or fe is None or not fe.available or not acc.available:
            return {}
        return {
            "idle_while_busy_j": acc.idle_busy_j,
            "idle_while_busy_s": acc.idle_busy_s,
            "frontend_busy_s": acc.busy_s,
            "frontends": fe.frontends,
        }

    # -- snapshot --------------------------------------------------------------------------
    def energy_snapshot(self) -> WorkerSnapshot:
        """Energy fields of the snapshot; figures of an unavailable meter are left out, not frozen."""
        acc, m = self.account, self.meter
        if m is None or acc is None:
            return {"energy_available": False}
        out: WorkerSnapshot = {
            "energy_method": m.method,
            "energy_available": bool(acc.available and m.available),
            "energy_unavailable_reason": m.unavailable_reason,
            "counter_resets": m.counter_resets,
            "counter_wraps": m.counter_wraps,
            "counter_period_s": m.counter_period_s,
            "counter_phase_losses": m.phase_losses,
            "meter_faults": m.faults,
            **_crosscheck_fields(m),
            "steps": dict(acc.steps),
            "tokens": dict(acc.tokens),
            "requests_finished": acc.finished_requests,
        }
        if out["energy_available"]:
            out.update(
                {
                    "energy_j": dict(acc.energy_j),
                    "time_s": dict(acc.time_s),
                    "request_energy_j_finished": acc.finished_request_j,
                    "request_energy_j_in_flight": sum(list(acc.request_j.values())),
                    # no request's, and the open gap not yet settled (docs/request-energy.md)
                    "request_energy_j_tail": acc.tail_j,
                    "request_energy_j_pending": acc.pending_j,
                    "window": {"window_s": acc.window_s, **acc.window()},
                    "steady": {
                        "batch": self.drain.steady_batch,
                        "energy_j": acc.steady_j,
                        "seconds": acc.steady_s,
                        "tokens": dict(acc.steady_tokens),
                    },
                }
            )
        return out

    def _gauges(self) -> dict[str, Any]:
        """Power, SM clock and NVML extras, re-read at most every ``energy.gauge_period_s``."""
        now = time.monotonic()
        if self.meter is None:
            return {"power_w": None, "sm_clock_mhz": None}
        # The simulated meter's readings cost nothing: always current. NVML's cost milliseconds.
        if self._gauge_cache is None or self.meter.source == "simulated" or now - self._gauge_t >= self.settings.energy.gauge_period_s:
            self._gauge_cache = {"power_w": self.meter.power_w(), "sm_clock_mhz": self.meter.sm_clock_mhz(), **self.meter.extra()}
            self._gauge_t = now
        return self._gauge_cache

    def snapshot(self) -> WorkerSnapshot:
        self.drain.drain_steps()  # step and token counts up to the last step
        from . import chunk_policy  # the process's policy (the LM-head hook's)

        policy = chunk_policy()
        energy = self.energy_snapshot()
        ident, sim, sim_stock = self.ident, self.drain.sim, self.drain.sim_stock
        return {
            "pid": os.getpid(),
            "rank": ident.rank,
            "engine": ident.engine,
            "gpu": ident.gpu_id,
            "t": time.time(),
            "source": self.meter.source if self.meter else "none",
            "clock_backend": self.clocks.backend.kind,
            "energy_j": {},
            "time_s": {},
            "steps": {},
            "tokens": {},
            **energy,
            **self._gauges(),
            "cuda_peak_allocated_bytes": self.peak.allocated_bytes(),
            "cuda_peak_scope": self.peak.scope if ident.on_gpu else None,
            "target_sm_clock_mhz": self.clocks.target_sm_clock_mhz,
            "clock_changes": self.clocks.n_changes,
            "clock_disabled": self.clocks.disabled_reason,
            "lm_head_calls": {str(k): v for k, v in sorted(policy.calls.items())},
            "lm_head_rows": policy.rows_total,
            "sim_energy_j": sim.energy_j if sim is not None else None,
            "sim_stock_clocks_energy_j": sim_stock.energy_j if sim_stock is not None else None,
            "sim_busy_s": sim.busy_time_s if sim is not None else None,
            "sim_stock_clocks_busy_s": sim_stock.busy_time_s if sim_stock is not None else None,
            "cuda_perf_boost": "auto" if self.settings.cuda_perf_boost == "auto" else ("off" if envs.perf_boost_disabled() else "on"),
            "cuda_boost": self.boost.snapshot() if self.boost is not None else None,
            "transport": ray_relay.describe(self.relay),
            "clock_mode": self.clock_choice.controller,
            "closed_loop": (
                {
                    **self.clocks.closed_loop.snapshot(),
                    "unconfirmed_switches": self.clocks.n_unconfirmed,
                    "step_time_source": self.timing.source,
                    "active": self.timing.active,
                }
                if self.clocks.closed_loop is not None
                else None
            ),
            "savings": self.savings(),
            "decode_pacing": self.drain.pacing_snapshot(),
            **self.starvation_snapshot(),
            "ray_node_id": self.relay.node_id if self.relay is not None else None,
        }

    # -- files --------------------------------------------------------------------------------
    def flush_trace(self, final: bool = False) -> None:
        """Write the trace records of the steps drained so far (``final``: the running one too)."""
        trace = self.drain.trace
        if trace is None or self.trace_path is None:
            return
        self.drain.drain_steps(final)
        pop = trace.popleft
        done = [pop() for _ in range(len(trace))]
        lines = [trace_line(r) for r in done]
        tuner = self.clocks.closed_loop
        if tuner is not None:
            # The closed loop's decisions and the measurements behind them, beside the steps.
            new = min(tuner.n_records - self._closed_loop_written, len(tuner.records))
            self._closed_loop_written = tuner.n_records
            recs = list(tuner.records)[len(tuner.records) - new :] if new > 0 else []
            lines += [closed_loop_line(r, self.timing.source) for r in recs]
        if self.boost is not None:
            lines += [boost_line(x) for x in self.boost.drain_switches()]
        ticks = self.ticks
        if ticks:
            lines += [tick_line(ticks.popleft()) for _ in range(len(ticks))]
        if lines:
            self._write_lines(self.trace_path, lines)

    def _flush_requests(self) -> None:
        if not self.done_requests or self.stats_path is None:
            return
        src = self.meter.source if self.meter else "none"
        method = self.meter.method if self.meter else "none"
        lines = []
        while self.done_requests:
            rid, j = self.done_requests.popleft()
            lines.append(RequestLine(rid, j, src, method, self.ident.gpu_id, self.ident.rank).to_json())
            log.debug("powersave: request %s used %s J (%s)", rid, "unavailable" if j is None else f"{j:.3f}", src)
        self._write_lines(self.stats_path.with_name(requests_name(self.ident.rank)), lines)

    def _write_lines(self, path: Path, lines: list[str]) -> None:
        if self.relay is not None:
            self.relay.append(path.name, lines)
            return
        with open(path, "a") as f:
            f.writelines(lines)

    def publish(self) -> None:
        if self.stats_path is None:
            return
        self.flush_trace()
        self._flush_requests()
        text = snapshot_to_json(self.snapshot())
        if self.relay is not None:
            self.relay.snapshot(self.ident.rank, text)  # after the lines above: the relay keeps their order
            return
        tmp = self.stats_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(self.stats_path)  # atomic: the API server never reads half a file

    def poll_tenants(self, now_s: float) -> None:
        """Feed the closed loop how many other processes share the GPU (at most every
        ``TENANT_POLL_S``), on the monotonic clock of the step records."""
        if self.tenants is None:
            return
        read = self.tenants.poll(now_s)
        if read is not None:
            self.drain.observe_gpu_tenants(now_s, read.others)

    # -- thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Write the first snapshot (series exist from the first step on, not one period later),
        start the publisher thread, and close at interpreter exit."""
        try:
            self.publish()
        except OSError as exc:
            log.warning("powersave: cannot write stats to %s: %s", self.stats_path, exc)
        self._thread = threading.Thread(target=self._run, name="powersave-stats", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def stop_thread(self) -> None:
        """Stop the publisher thread and wait for it; the owner then drives :meth:`publish`,
        :meth:`flush_trace` and the account's ticks by hand (tests, benchmarks/hook_overhead.py)."""
        self._stop.set()
        self.handoff.wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def running(self) -> bool:
        """Whether the publisher thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        period = min(0.5, self.settings.energy.idle_after_s / 2)
        next_full = time.monotonic() + period
        last_flush = 0.0
        while not self._stop.is_set():
            woke = self.handoff.wake.wait(max(0.0, next_full - time.monotonic()))
            if self._stop.is_set():
                break
            try:
                now = time.monotonic()
                if now < next_full:
                    # Requests finished: attribute and write them now (the API server may be
                    # holding their responses), but no more often than every flush_min_s.
                    if woke and now - last_flush < FLUSH_MIN_S:
                        time.sleep(FLUSH_MIN_S - (now - last_flush))
                    self.handoff.wake.clear()
                    if self.account is not None:
                        self.account.tick()
                    self._flush_requests()
                    last_flush = time.monotonic()
                    continue
                self.handoff.wake.clear()
                next_full = now + period
                sync = getattr(self.meter, "sync_counter_phase", None)
                if sync is not None and now >= getattr(self.meter, "sync_due", float("inf")):
                    sync()  # learn when the NVML counter steps (<= 2.5 x 100 ms of 1 ms polls, every 30 s)
                if self.account is not None and now - self._last_tick >= self.settings.energy.tick_s:
                    self._last_tick = now
                    self.account.tick()
                    if (sample := getattr(self.meter, "crosscheck_sample", None)) is not None:
                        sample()  # periodic reads only: energy/meters.py says why
                if self.boost is not None:
                    self.boost.tick()
                self.poll_tenants(now)
                if self.starvation is not None and self.account is not None and self.frontend is not None and self.frontend.available:
                    self.starvation.check(self.account.idle_busy_s, self.account.busy_s, self.account.idle_busy_j, self.frontend.frontends)
                if time.monotonic() - self.handoff.last_step_s >= self.settings.energy.idle_after_s:
                    self.clocks.idle_begin()
                self.publish()
                last_flush = time.monotonic()
            except Exception as exc:
                log.debug("powersave: publish failed: %s", exc)

    def close(self) -> None:
        """Stop the publisher, restore clocks, write the final stats and trace. Idempotent (called
        by the server's shutdown and again at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.handoff.wake.set()
        self.clocks.close()
        if self.boost is not None:
            self.boost.close()
        # The publisher thread writes the same files: let it finish its round before the final one
        # (bounded: a stuck NVML read must not hold the shutdown).
        if self._thread is not None and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_JOIN_S)
        # Each final write on its own: one that fails must not cost the others.
        for what, fn in (
            ("final energy tick", self.account.tick if self.account is not None else None),
            ("final publish", self.publish),
            ("final trace flush", lambda: self.flush_trace(final=True)),
        ):
            if fn is None:
                continue
            try:
                fn()
            except Exception as exc:
                log.warning("powersave: %s failed (%s: %s); continuing the shutdown", what, type(exc).__name__, exc)
        if self.meter is not None:
            self.meter.close()


def _crosscheck_fields(m: Any) -> dict[str, float]:
    """The counter over the integral of instant power, last completed window (energy/crosscheck.py)."""
    cc = getattr(m, "crosscheck", None)
    if cc is None or cc.ratio is None:
        return {}
    return {"energy_crosscheck_ratio": cc.ratio, "energy_crosscheck_window_s": cc.window_s}
