"""The drain: feeds the step path's records to the energy account, the step trace, the simulator
and the closed-loop decode clock, off the engine thread.

:class:`StepDrain` consumes the :class:`~vllm_powersave.runtime.step.StepHandoff`'s records
oldest first, on the publisher thread every tick (and inline where a simulator prices each step at
its clock, ``StepPath.drain_inline``), under a lock the step hook never takes. The step trace's
records (``TraceLine``) it appends are written by the publisher (``publisher.py``).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .. import vllm_compat
from ..clocks import ClockController
from ..device.step_timer import WALL, SimulatedStepTimer
from ..energy import PhaseEnergyAccount
from ..pacing import PaceFigures
from ..sim.gpu import ModelCost, SimulatedGpu
from ..stats_contract import TraceLine
from .step import FAILED, WARMUP, StepHandoff, StepRecord, StepTiming

_PACING_ATTR = vllm_compat.PACING_ATTR


@dataclass(eq=False)
class StepDrain:
    """Turns step records into the account's steps, trace records and simulated work.

    ``trace``: the step trace's records, for the publisher to write (``None``: no trace);
    ``plp_rows``: the prompt-logprob rows still to come per request (``vllm_compat``);
    ``sim_stock``: the simulated GPU at stock clocks, priced beside ``sim`` (the saving's baseline);
    ``steady_batch``: the running batch counted as steady state (ML.ENERGY's window, account.py);
    ``memory_bound_max_tokens``: the regime bound the closed loop's samples are tagged with.
    """

    handoff: StepHandoff
    timing: StepTiming
    clocks: ClockController
    account: PhaseEnergyAccount | None
    trace: deque[TraceLine] | None
    plp_rows: vllm_compat.PromptLogprobRows
    sim: SimulatedGpu | None
    sim_stock: SimulatedGpu | None
    model_cost: ModelCost | None
    steady_batch: int | None
    per_request: bool
    memory_bound_max_tokens: int
    # A decode pacer's hold is idle GPU time the simulated GPU must price (it prices steps, not
    # the host's gaps); a hold past idle_after_s is priced as idle by the account already.
    hold_cap_s: float = 0.25
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _drained_start: StepRecord | None = field(default=None, init=False)  # the record whose start was fed last
    # Finished steps held for the closed loop until the engine thread has read their GPU time (oldest first).
    _timed_steps: deque[tuple[StepRecord, float, Any]] = field(default_factory=deque, init=False)
    # The decode pacer's figures as last stamped on a step (vllm_compat.PACING_ATTR), if one runs.
    _pacing: PaceFigures | None = field(default=None, init=False)

    def pacing_snapshot(self) -> dict[str, float | int] | None:
        """The engine's decode pacing figures as the last drained step carried them (``None``: no
        pacer, or no step yet); the off reason goes to the savings state instead."""
        p = self._pacing
        if p is None:
            return None
        return {
            "tpot_target_ms": p.tpot_target_ms,
            "held_steps": p.held_steps,
            "held_s": p.held_s,
            "woken_early": p.woken_early,
            "paused": int(p.paused),
            "closed_loop_pauses": p.closed_loop_pauses,
            "pauses_withdrawn": p.pauses_withdrawn,
            "closed_loop_checks": p.closed_loop_checks,
            "checking": int(p.checking),
        }

    def _price_hold(self, sim: SimulatedGpu, seconds: float) -> None:
        """The simulated GPU (and its stock-clock twin) idle for a pacing hold before this step."""
        sim.idle(seconds)
        if self.sim_stock is not None:
            self.sim_stock.idle(seconds)

    def pacing_off_reason(self) -> str | None:
        """Why the engine's pacer turned itself off, as the last drained step said (else ``None``)."""
        return self._pacing.off_reason if self._pacing is not None else None

    def observe_gpu_tenants(self, now_s: float, others: int | None) -> None:
        """How many other compute processes share the GPU (``TenantWatch``), to the closed loop
        under the drain's lock, so that it is fed from one thread at a time, before the steps
        still held here (those ended before ``now_s``: docs/closed-loop.md, "Another process on
        the GPU"). A fault leaves the count unknown, never stops serving."""
        if not self.timing.active:
            return
        with self._lock:
            try:
                self.clocks.observe_gpu_tenants(now_s, others)
            except Exception as exc:
                vllm_compat.fault_once("gpu_tenants", exc, "feeding the co-tenant count", "the closed loop runs without it")

    def drain_steps(self, final: bool = False) -> None:
        """Feed the step records appended by :meth:`StepPath.on_step_start` to the energy account, the
        step trace and the simulator, oldest first (any thread; serialised by a lock the step hook
        never takes). A step still running keeps its record until its end is known, unless
        ``final``. Idempotent: each record is consumed once."""
        steps = self.handoff.steps
        if not steps:
            return
        with self._lock:
            acc, trace, plp, sim = self.account, self.trace, self.plp_rows, self.sim
            closed_loop = self.timing.active
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
                # An empty step (nothing scheduled) reports finished requests only; its end is
                # no work's end, and would keep a batch that vLLM has not reported drained from
                # ever reaching idle_after_s while vLLM runs empty steps (docs/request-energy.md).
                if acc is not None and t_end is not None and getattr(info, "phase", None) != "idle":
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
            if self.timing.source == WALL:
                self._observe_closed_loop(t_end, (t_end - rec.t) * 1e3, info)
            return
        if not self.clocks.closed_loop_active:
            # Nothing more to learn for. After a backend fault the loop is off for good and the timer
            # stops; at close, the last steps are simply not fed (clocks close before the final drain).
            self._timed_steps.clear()
            if self.clocks.disabled_reason is not None:
                self.timing.turn_off(f"clock control off ({self.clocks.disabled_reason})")
            return
        wait = self._timed_steps
        wait.append((rec, t_end, info))
        while wait:
            head, t_end, info = wait[0]
            if head.gpu_ms is None:
                if head.mark is not None and self.timing.timer is not None:
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
        (``StepTiming.source``), decode batch and regime. A fault turns the loop off, once."""
        if not self.timing.active:
            return
        try:
            self.clocks.observe_decode_step(
                t_end,
                info.decode_reqs,
                step_ms,
                memory_bound=info.decode_reqs > 0 and info.num_tokens <= self.memory_bound_max_tokens,
                ctx_tokens=info.decode_ctx_tokens,
                tokens=info.num_tokens,
                span_s=span_s,
            )
        except Exception as exc:
            self.timing.turn_off(f"fault ({type(exc).__name__})")
            try:  # the loop's last clock must not stay applied once nothing tracks it
                self.clocks.stop_closed_loop(t_end, f"fault ({type(exc).__name__})")
            except Exception:
                pass
            vllm_compat.fault_once("closed_loop", exc, "feeding the closed-loop decode clock", "the decode clock goes back to its default")

    def _step_fed(self, rec: StepRecord, acc: PhaseEnergyAccount | None, plp: Any, sim: SimulatedGpu | None, want_rows: bool) -> None:
        """One record's start: prompt-logprob rows, the account's step, the simulator's work."""
        so = rec.so
        rec.so = None  # the SchedulerOutput is not kept past this point
        pacing = getattr(so, _PACING_ATTR, None)
        if pacing is not None:
            held_s = pacing.held_s - (self._pacing.held_s if self._pacing is not None else 0.0)
            self._pacing = pacing
            if held_s > 0 and sim is not None:
                self._price_hold(sim, min(held_s, self.hold_cap_s))
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
            ctx = vllm_compat.step_request_context(so) if self.per_request and acc.cost is not None else None
            acc.on_step(info.phase, info.prefill_tokens, info.decode_tokens, req, fin, steady, t=t, req_ctx=ctx)
        if sim is not None and self.model_cost is not None:
            work = self.model_cost.step_work(info.num_tokens, rows, info.decode_ctx_tokens, self.model_cost.vocab_params)
            res = sim.run(work)
            timer = self.timing.timer
            if rec.mark is not None and isinstance(timer, SimulatedStepTimer):
                timer.set_ms(rec.mark, res.time_s * 1e3)
            if self.sim_stock is not None:
                self.sim_stock.run(work)
