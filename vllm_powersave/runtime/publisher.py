"""The publisher: drains the step records into the energy account, the trace and the simulator,
and writes the stats files (``stats_contract.py``) from a background thread.

The records come from the step path (``step.py``); :meth:`Publisher.drain_steps` runs on the
publisher thread every tick (and inline where a simulator prices each step at its clock), under a
lock the step hook never takes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from .. import envs, ray_relay, vllm_compat
from ..device.step_timer import WALL, SimulatedStepTimer
from ..energy import PhaseEnergyAccount
from ..sim.gpu import SimulatedGpu
from ..stats_contract import (
    RequestLine,
    TraceLine,
    WorkerSnapshot,
    boost_line,
    closed_loop_line,
    requests_name,
    snapshot_to_json,
    tick_line,
    trace_line,
)
from .step import FAILED, WARMUP, StepRecord

log = logging.getLogger("vllm.powersave")
#: How long close() waits for the publisher thread's current round (s).
CLOSE_JOIN_S = 5.0


class Publisher:
    """The background half of :class:`~vllm_powersave.runtime.WorkerRuntime` (a mixin: the state
    it reads is set up by the constructor in ``build.py``)."""

    def drain_steps(self, final: bool = False) -> None:
        """Feed the step records appended by :meth:`on_step_start` to the energy account, the
        step trace and the simulator, oldest first (any thread; serialised by a lock the step hook
        never takes). A step still running keeps its record until its end is known, unless
        ``final``. Idempotent: each record is consumed once."""
        steps = self._steps
        if not steps:
            return
        with self._drain_lock:
            acc, trace, plp, sim = self.account, self._trace, self._plp_rows, self.sim
            closed_loop = self._closed_loop
            want_rows = trace is not None or sim is not None
            while steps:
                # Read the length before the end stamp: a newer record is appended only after the
                # step thread stamped (or skipped) this one's end, so n > 1 means the end is final.
                n = len(steps)
                rec = steps[0]
                if rec is not self._drained_start:
                    self._drained_start = rec
                    try:
                        self._step_fed(rec, acc, plp, sim, want_rows)
                    except Exception as exc:
                        # One record that cannot be classified or fed loses that step only: it must
                        # not stop the records behind it, the tick, the publish or close().
                        rec.info = FAILED
                        vllm_compat.fault_once("drain_steps", exc, "feeding a step record", "that step is not metered or traced")
                if n == 1 and rec.t_end is None and not final:
                    break
                steps.popleft()
                info = rec.info
                t_end = rec.t_end
                if (
                    closed_loop
                    and t_end is not None
                    and info is not None
                    and info is not WARMUP
                    and info is not FAILED
                    and info.phase != "idle"
                ):
                    self._time_closed_loop_step(rec, t_end, info)
                if info is WARMUP:
                    continue  # vLLM's kernel warm-up on a serving worker: no served work
                if acc is not None and t_end is not None:
                    acc.on_step_end(t_end)
                if info is FAILED:
                    continue
                if trace is not None and info is not None and info.phase != "idle":
                    trace.append(
                        TraceLine(
                            rec.t,
                            info.phase,
                            info.prefill_tokens,
                            info.decode_tokens,
                            rec.rows,
                            info.decode_ctx_tokens,
                            info.num_reqs,
                            rec.sm_mhz,
                            t_end,
                        )
                    )

    def _time_closed_loop_step(self, rec: StepRecord, t_end: float, info: Any) -> None:
        """Queue a finished step for the closed loop, then feed it every queued step whose time is
        known, in step order. A timed step waits until the engine thread has read its GPU time
        (``StepPath._read_step_times``: no CUDA call is made on this thread); a step it will never
        read (the loop turned off, the GPU fell behind) is skipped. Without a timer (vLLM's CPU
        build) the engine-thread wall time is the step's time."""
        if rec.mark is None and rec.gpu_ms is None:
            if self.step_time_source == WALL:
                self._observe_closed_loop(t_end, (t_end - rec.t) * 1e3, info)
            return
        if not self.clocks.closed_loop_active:
            # Nothing more to learn for. After a backend fault the loop is off for good and the timer
            # stops; at close, the last steps are simply not fed (clocks close before the final drain).
            self._timed_steps.clear()
            if self.clocks.disabled_reason is not None:
                self._closed_loop_off(f"clock control off ({self.clocks.disabled_reason})")
            return
        wait = self._timed_steps
        wait.append((rec, t_end, info))
        while wait:
            head, t_end, info = wait[0]
            if head.gpu_ms is None:
                if head.mark is not None and self._step_timer is not None:
                    break  # not read yet: the GPU is still running it, or the engine has not stepped since
                wait.popleft()  # never to be read
                continue
            wait.popleft()
            # The GPU runs a step after its launch and, with async scheduling, up to about one
            # step after the engine thread moved on (two here, to err long): a clock switch
            # anywhere in that span makes the step no measurement.
            self._observe_closed_loop(t_end, head.gpu_ms, info, (head.t, t_end + 2e-3 * head.gpu_ms))

    def _observe_closed_loop(self, t_end: float, step_ms: float, info: Any, span_s: tuple[float, float] | None = None) -> None:
        """One finished step to the closed-loop decode clock (clocks/closed_loop.py): its time
        (``step_time_source``), decode batch and regime. A fault turns the loop off, once."""
        if not self._closed_loop:
            return
        try:
            self.clocks.observe_decode_step(
                t_end,
                info.decode_reqs,
                step_ms,
                memory_bound=info.decode_reqs > 0 and info.num_tokens <= self.settings.clocks.memory_bound_max_tokens,
                ctx_tokens=info.decode_ctx_tokens,
                tokens=info.num_tokens,
                span_s=span_s,
            )
        except Exception as exc:
            self._closed_loop_off(f"fault ({type(exc).__name__})")
            vllm_compat.fault_once("closed_loop", exc, "feeding the closed-loop decode clock", "the decode clock stays at its default")

    def _step_fed(self, rec: StepRecord, acc: PhaseEnergyAccount | None, plp: Any, sim: SimulatedGpu | None, want_rows: bool) -> None:
        """One record's start: prompt-logprob rows, the account's step, the simulator's work."""
        so = rec.so
        rec.so = None  # the SchedulerOutput is not kept past this point
        info = rec.info
        if info is None:
            if vllm_compat.is_warmup_step(so):
                # Records that no clock decision classified: a kernel warm-up vLLM runs on a worker
                # already serving (0.32's elastic-EP scale-up) is recognised here, off the step path.
                rec.info = WARMUP
                return
            info = rec.info = vllm_compat.step_info(so)
        elif want_rows and info.phase != "idle":
            info = rec.info = info._replace(decode_ctx_tokens=vllm_compat.step_decode_ctx_tokens(so, info))
        if info.phase == "idle":
            if want_rows:
                plp.rows(so)  # forgets requests that finished (aborted) meanwhile
            if acc is not None:
                fin = vllm_compat.step_request_tokens(so)[1]
                acc.on_finished(fin, rec.t)
            return
        t = rec.t
        if want_rows:
            # Prompt-logprob rows reach the LM head too: without them a long prompt with
            # prompt_logprobs would be priced (simulator) and traced as one row per request.
            # (rows() is 0 unless a request is pending or this step has new or context-phase requests.)
            rec.rows = rows = info.lm_head_rows + plp.rows(so) if plp.left or info.prefill_reqs else info.lm_head_rows
        if acc is not None:
            # References only (no copies); the account drops them unless per_request is on.
            req, fin = vllm_compat.step_request_tokens(so)
            steady = self.steady_batch is not None and info.num_reqs >= self.steady_batch
            ctx = vllm_compat.step_request_context(so) if self._per_request and acc.cost is not None else None
            acc.on_step(info.phase, info.prefill_tokens, info.decode_tokens, req, fin, steady, t=t, req_ctx=ctx)
        if sim is not None and self.model_cost is not None:
            work = self.model_cost.step_work(info.num_tokens, rows, info.decode_ctx_tokens, self.model_cost.vocab_params)
            res = sim.run(work)
            if rec.mark is not None and isinstance(self._step_timer, SimulatedStepTimer):
                self._step_timer.set_ms(rec.mark, res.time_s * 1e3)
            if self.sim_stock is not None:
                self.sim_stock.run(work)

    # -- publishing --------------------------------------------------------------------------
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
                        "batch": self.steady_batch,
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

    def _peak_allocated_bytes(self) -> int | None:
        """PyTorch's peak allocated CUDA memory of this worker since start (bytes): what LM-head
        chunking lowers for prompt-logprob batches. A host-side allocator statistic, no device sync."""
        if not self._on_gpu:
            return None
        try:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device_index))
        except Exception:
            return None

    def snapshot(self) -> WorkerSnapshot:
        self.drain_steps()  # step and token counts up to the last step
        from . import chunk_policy  # the process's policy (the LM-head hook's)

        policy = chunk_policy()
        energy = self.energy_snapshot()
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "engine": self.engine,
            "gpu": self.gpu_id,
            "t": time.time(),
            "source": self.meter.source if self.meter else "none",
            "clock_backend": self.clocks.backend.kind,
            "energy_j": {},
            "time_s": {},
            "steps": {},
            "tokens": {},
            **energy,
            **self._gauges(),
            "cuda_peak_allocated_bytes": self._peak_allocated_bytes(),
            "cuda_peak_scope": self._peak_scope if self._on_gpu else None,
            "target_sm_clock_mhz": self.clocks.target_sm_clock_mhz,
            "clock_changes": self.clocks.n_changes,
            "clock_disabled": self.clocks.disabled_reason,
            "lm_head_calls": {str(k): v for k, v in sorted(policy.calls.items())},
            "lm_head_rows": policy.rows_total,
            "sim_energy_j": self.sim.energy_j if self.sim is not None else None,
            "sim_stock_clocks_energy_j": self.sim_stock.energy_j if self.sim_stock is not None else None,
            "sim_busy_s": self.sim.busy_time_s if self.sim is not None else None,
            "sim_stock_clocks_busy_s": self.sim_stock.busy_time_s if self.sim_stock is not None else None,
            "cuda_perf_boost": "auto" if self.settings.cuda_perf_boost == "auto" else ("off" if envs.perf_boost_disabled() else "on"),
            "cuda_boost": self.boost.snapshot() if self.boost is not None else None,
            "transport": ray_relay.describe(self._relay),
            "clock_mode": self.clock_choice.controller,
            "closed_loop": (
                {**self.clocks.closed_loop.snapshot(), "step_time_source": self.step_time_source, "active": self._closed_loop}
                if self.clocks.closed_loop is not None
                else None
            ),
            "savings": self.savings(),
            **self.starvation_snapshot(),
            "ray_node_id": self._relay.node_id if self._relay is not None else None,
        }

    def _flush_trace(self, final: bool = False) -> None:
        """Write the trace records of the steps drained so far (``final``: the running one too)."""
        if self._trace is None or self._trace_path is None:
            return
        self.drain_steps(final)
        pop = self._trace.popleft
        done = [pop() for _ in range(len(self._trace))]
        lines = [trace_line(r) for r in done]
        tuner = self.clocks.closed_loop
        if tuner is not None:
            # The closed loop's decisions and the measurements behind them, beside the steps.
            new = min(tuner.n_records - self._closed_loop_written, len(tuner.records))
            self._closed_loop_written = tuner.n_records
            recs = list(tuner.records)[len(tuner.records) - new :] if new > 0 else []
            lines += [closed_loop_line(r, self.step_time_source) for r in recs]
        if self.boost is not None:
            lines += [boost_line(x) for x in self.boost.drain_switches()]
        ticks = self._ticks
        if ticks:
            lines += [tick_line(ticks.popleft()) for _ in range(len(ticks))]
        if lines:
            self._write_lines(self._trace_path, lines)

    def _flush_requests(self) -> None:
        if not self._done_requests or self.stats_path is None:
            return
        src = self.meter.source if self.meter else "none"
        method = self.meter.method if self.meter else "none"
        lines = []
        while self._done_requests:
            rid, j = self._done_requests.popleft()
            lines.append(RequestLine(rid, j, src, method, self.gpu_id, self.rank).to_json())
            log.debug("powersave: request %s used %s J (%s)", rid, "unavailable" if j is None else f"{j:.3f}", src)
        self._write_lines(self.stats_path.with_name(requests_name(self.rank)), lines)

    def _write_lines(self, path: Path, lines: list[str]) -> None:
        if self._relay is not None:
            self._relay.append(path.name, lines)
            return
        with open(path, "a") as f:
            f.writelines(lines)

    def publish(self) -> None:
        if self.stats_path is None:
            return
        self._flush_trace()
        self._flush_requests()
        text = snapshot_to_json(self.snapshot())
        if self._relay is not None:
            self._relay.snapshot(self.rank, text)  # after the lines above: the relay keeps their order
            return
        tmp = self.stats_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(self.stats_path)  # atomic: the API server never reads half a file

    def _publisher(self) -> None:
        period = min(0.5, self.settings.energy.idle_after_s / 2)
        next_full = time.monotonic() + period
        last_flush = 0.0
        while not self._stop.is_set():
            woke = self._wake.wait(max(0.0, next_full - time.monotonic()))
            if self._stop.is_set():
                break
            try:
                now = time.monotonic()
                if now < next_full:
                    # Requests finished: attribute and write them now (the API server may be
                    # holding their responses), but no more often than every flush_min_s.
                    if woke and now - last_flush < self._flush_min_s:
                        time.sleep(self._flush_min_s - (now - last_flush))
                    self._wake.clear()
                    if self.account is not None:
                        self.account.tick()
                    self._flush_requests()
                    last_flush = time.monotonic()
                    continue
                self._wake.clear()
                next_full = now + period
                sync = getattr(self.meter, "sync_counter_phase", None)
                if sync is not None and now >= getattr(self.meter, "sync_due", float("inf")):
                    sync()  # learn when the NVML counter steps (<= 2.5 x 100 ms of 1 ms polls, every 30 s)
                if self.account is not None and now - self._last_tick >= self.settings.energy.tick_s:
                    self._last_tick = now
                    self.account.tick()
                if self.boost is not None:
                    self.boost.tick()
                if self.starvation is not None and self.account is not None and self.frontend is not None and self.frontend.available:
                    self.starvation.check(self.account.idle_busy_s, self.account.busy_s, self.account.idle_busy_j, self.frontend.frontends)
                if time.monotonic() - self._last_step_s >= self.settings.energy.idle_after_s:
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
        self._wake.set()
        self.clocks.close()
        if self.boost is not None:
            self.boost.close()
        # The publisher thread writes the same files: let it finish its round before the final one
        # (bounded: a stuck NVML read must not hold the shutdown).
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_JOIN_S)
        # Each final write on its own: one that fails must not cost the others.
        for what, fn in (
            ("final energy tick", self.account.tick if self.account is not None else None),
            ("final publish", self.publish),
            ("final trace flush", lambda: self._flush_trace(final=True)),
        ):
            if fn is None:
                continue
            try:
                fn()
            except Exception as exc:
                log.warning("powersave: %s failed (%s: %s); continuing the shutdown", what, type(exc).__name__, exc)
        if self.meter is not None:
            self.meter.close()
