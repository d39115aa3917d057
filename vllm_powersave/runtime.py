"""Per-worker runtime: meter, phase accounting, clock controller, chunk policy and stats publishing.

One :class:`WorkerRuntime` per worker process (one GPU), created lazily on the first real engine
step, so that NVML is never touched by ``register()`` and CUDA is already set up by vLLM.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from . import ray_relay, vllm_compat
from .chunking.policy import ChunkPolicy, apply_chunked
from .clocks import ClockController, DryRunClockBackend, NvmlClockBackend, SimulatedClockBackend
from .clocks.backends import ClockBackend
from .energy import PhaseEnergyAccount, SimulatedEnergyMeter
from .energy.meters import EnergyMeter, UnavailableEnergyMeter, nvml_handle_for_torch_device, open_nvml_meter
from .clocks.boost import BoostController, BoostHolder
from . import envs
from .envs import ENV_FORCE_DRY_RUN
from .settings import PowersaveSettings, settings_from_env
from .sim.gpu import SPECS, ModelCost, SimulatedGpu

log = logging.getLogger("vllm.powersave")
_LOOKAHEAD_ATTR = vllm_compat.LOOKAHEAD_ATTR


_POLICY: ChunkPolicy | None = None
_RUNTIME: "WorkerRuntime | None" = None
_RT_LOCK = threading.Lock()


def chunk_policy() -> ChunkPolicy:
    global _POLICY
    if _POLICY is None:
        _POLICY = ChunkPolicy(settings_from_env().chunking)
    return _POLICY


def _head_fault(where: str, exc: Exception) -> None:
    """The LM-head hook fails open: its own fault is logged once per kind and the step goes on."""
    vllm_compat.fault_once(f"lm_head.{where}", exc, f"LM-head hook {where}", "this call runs the head unchunked")


def head_chunks(hidden_states: Any) -> int:
    """LM-head hook, asked first on every LM-head call: the chunk count for ``hidden_states``
    (``[rows, hidden]``) from the policy, keyed on the rows reaching the head, and recorded.

    Returns 0 where vLLM's own call applies unchanged (one chunk and no ``lm_head`` kernel-group
    clock preset: every step but those the table chunks), so that the subclass calls vLLM's head
    GEMM directly. Fails open: a fault of the plugin's own is logged once and gives 0.
    """
    try:
        policy = _POLICY if _POLICY is not None else chunk_policy()
        shape = hidden_states.shape
        rows = shape[0] if len(shape) >= 2 else 1
        rt = _RUNTIME
        if rows < policy.min_rows and (rt is None or not rt.head_groups):
            # policy.take(rows) == 1, inlined: on the H200 host each Python call here costs
            # microseconds (time_parts, h200-vllm.md), and this runs on every LM-head call.
            policy.plain += 1
            policy.rows_total += rows
            return 0
        n = policy.take(rows)
        if n <= 1 and (rt is None or not rt.clocks.groups or not rt.clocks.has_group("lm_head")):
            return 0
        return n
    except Exception as exc:
        _head_fault("policy", exc)
        return 0


def chunked_head(head: Any, hidden_states: Any, n: int | None = None) -> Any:
    """``head(hidden_states)`` over ``n`` row chunks (``None``: asks :func:`head_chunks`), inside
    the ``lm_head`` kernel-group clock preset where one passed the switch-latency gate.

    Fails open: a fault of the plugin's own (clock group) runs the head as vLLM would; the
    head's own errors (e.g. CUDA out of memory) propagate unchanged."""
    if n is None:
        n = head_chunks(hidden_states)
        if not n:
            return head(hidden_states)
    try:
        rt = _RUNTIME
        grouped = rt is not None and bool(rt.clocks.groups) and rt.clocks.has_group("lm_head")
    except Exception as exc:
        _head_fault("clock group", exc)
        grouped = False
    if not grouped:
        return apply_chunked(head, hidden_states, n)
    # A kernel-group preset for the LM head passed the switch-latency gate: switch when the GPU
    # (not the host, which runs ahead) reaches the LM head, and back when it leaves it.
    try:
        rt.clocks.on_group("lm_head", ready=_gpu_marker(hidden_states))
    except Exception as exc:
        _head_fault("clock group", exc)
    out = apply_chunked(head, hidden_states, n)
    try:
        rt.clocks.end_group(ready=_gpu_marker(hidden_states))
    except Exception as exc:
        _head_fault("clock group", exc)
    return out


def _gpu_marker(t: Any) -> Any:
    """``Event.synchronize`` of a CUDA event recorded now on ``t``'s stream (``None`` off CUDA)."""
    if getattr(getattr(t, "device", None), "type", None) != "cuda":
        return None
    import torch

    ev = torch.cuda.Event()
    ev.record()
    return ev.synchronize


def clock_phase(info: Any, memory_bound_max_tokens: int) -> str:
    """The phase whose clock preset a step gets on its own.

    A step's FLOPs per weight byte equal its token count, so a step of at most
    ``memory_bound_max_tokens`` tokens is memory-bound whatever vLLM calls it: small mixed steps
    get the decode clock, and decode batches above it (e.g. 256 requests, or speculative tokens)
    are compute-bound and get the mixed (compute) clock. 0 disables both.
    """
    if memory_bound_max_tokens and info.phase in ("mixed", "decode"):
        if info.num_tokens <= memory_bound_max_tokens:
            return "decode"
        if info.phase == "decode":
            return "mixed"
    return info.phase


class RegimeFilter:
    """Time-weighted share of compute-bound steps; decides the clock phase under continuous batching.

    Deterministic given the step sequence and the step times, which every TP rank shares up to
    host jitter (ranks start each step within microseconds of each other).
    """

    def __init__(self, window_s: float, share_max: float, burst_tokens: int, memory_bound_max_tokens: int) -> None:
        self.window_s, self.share_max, self.burst_tokens = window_s, share_max, burst_tokens
        self.mb_tokens = memory_bound_max_tokens
        self.share = 1.0  # start compute-bound: never lower before the regime is known
        self._t: float | None = None

    def phase(self, info: Any, now: float, waiting_tokens: int = 0) -> str:
        """The clock phase of this step. ``now``: the scheduler's timestamp (s) where vLLM's
        scheduler was hooked (identical on all ranks); ``waiting_tokens``: prompt tokens waiting in
        the scheduler's queue (look-ahead: at least ``burst_tokens`` of them raise the clock before
        the burst's first step)."""
        # clock_phase(info, self.mb_tokens), inlined: this runs every engine step.
        phase = own = info.phase
        if self.mb_tokens and (phase == "decode" or phase == "mixed"):
            if info.num_tokens <= self.mb_tokens:
                own = "decode"
            elif phase == "decode":
                own = "mixed"
        x = 0.0 if own == "decode" else 1.0
        t = self._t
        if t is None:
            self.share = x
        else:
            dt = now - t
            a = math.exp(-(dt if dt > 0.0 else 0.0) / self.window_s)  # noqa: FURB136 - max(0.0, dt) without the call
            self.share = a * self.share + (1 - a) * x
        self._t = now
        if waiting_tokens >= self.burst_tokens or phase == "prefill" and info.num_tokens >= self.burst_tokens:
            return "prefill"
        return "decode" if self.share < self.share_max else own


#: A step record (on_step_start -> drain_steps): [start s, StepInfo | None (classified by the
#: drain), SchedulerOutput (dropped once fed), target SM clock MHz, end s, LM-head rows].
_R_T, _R_INFO, _R_SO, _R_SM, _R_END, _R_ROWS = range(6)
#: Records the step hook lets pile up before it drains them itself (a stalled publisher thread).
_MAX_PENDING_STEPS = 4096
#: How long close() waits for the publisher thread's current round (s).
_CLOSE_JOIN_S = 5.0
#: Record markers (in the StepInfo slot) for steps the drain leaves out: a step that could not be
#: fed (its fault logged once), a kernel warm-up step of vLLM's.
_FAILED = object()
_WARMUP = object()

_TRACE_KEYS = ("t", "phase", "prefill", "decode", "rows", "ctx", "reqs", "sm_target", "t_end")
_TRACE_TYPES = (float, str, int, int, int, int, int)
_TRACE_PHASES = frozenset(("prefill", "decode", "mixed", "idle"))
_INF = float("inf")


def _trace_line(r: Any) -> str:
    """``json.dumps(dict(zip(_TRACE_KEYS, r))) + "\\n"`` for one trace record, formatted directly
    where the fields have the types the step hook stores (finite floats, ints, a known phase),
    for which json.dumps writes float repr, int repr and null; anything else goes through
    json.dumps. One line per engine step, on the publisher thread (which holds the GIL)."""
    t, phase, pre, dec, rows, ctx, reqs, sm, t_end = r
    if ((type(t), type(phase), type(pre), type(dec), type(rows), type(ctx), type(reqs)) == _TRACE_TYPES
            and -_INF < t < _INF and phase in _TRACE_PHASES and (sm is None or type(sm) is int)
            and (t_end is None or type(t_end) is float and -_INF < t_end < _INF)):
        return (f'{{"t": {t!r}, "phase": "{phase}", "prefill": {pre!r}, "decode": {dec!r}, "rows": {rows!r}, '
                f'"ctx": {ctx!r}, "reqs": {reqs!r}, "sm_target": {"null" if sm is None else repr(sm)}, '
                f'"t_end": {"null" if t_end is None else repr(t_end)}}}\n')
    return json.dumps(dict(zip(_TRACE_KEYS, r))) + "\n"


def _boost_for(on_gpu: bool, gpu_id: str, release_after_s: float) -> BoostController | None:
    """The side-context booster of this worker's GPU, addressed by UUID (``cuda_perf_boost: auto``)."""
    if not on_gpu or not gpu_id.startswith(("GPU-", "MIG-")):
        log.warning("powersave: cuda_perf_boost auto needs an NVIDIA GPU identified by UUID (have %r); the engine stays unboosted", gpu_id)
        return None
    return BoostController(BoostHolder(gpu_id), release_after_s)


def _init_nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as exc:
        log.warning("powersave: NVML unavailable (%s)", exc)
        return None


class WorkerRuntime:
    """Everything the plugin runs inside one worker process."""

    def __init__(self, runner: Any, settings: PowersaveSettings) -> None:
        self.settings = settings
        ident = vllm_compat.runner_identity(runner)
        self.rank = int(ident.get("global_rank", ident["rank"]))  # unique across data-parallel engines
        self.engine = int(ident.get("dp_rank", 0))
        self.device_index = int(ident["device_index"] or 0)
        on_gpu = ident["device_type"] == "cuda"
        self._on_gpu = on_gpu
        self._peak_scope = "since worker start (includes vLLM's start-up profile run)"
        self._peak_reset_pending = on_gpu
        self._skip_step_end = False
        self._serving = False  # set at the first step that is not vLLM's own warm-up
        self.sim: SimulatedGpu | None = None
        self.sim_stock: SimulatedGpu | None = None
        self.model_cost: ModelCost | None = None
        # "simN" where the figures are the simulated GPU's (no CUDA device, or a simulated meter or
        # clock backend asked for); a real GPU whose NVML is simply not used (meter off, dry-run
        # clocks) is labelled as the CUDA device it is.
        simulated = not on_gpu or settings.energy.meter == "simulated" or settings.clocks.backend == "simulated"
        nvml, handle, gpu_id = None, None, f"sim{self.rank}" if simulated else f"cuda{ident['device_index'] or 0}-rank{self.rank}"
        nvml_failed = None
        if on_gpu and settings.energy.meter in ("auto", "nvml") or settings.clocks.backend == "nvml":
            nvml = _init_nvml() if on_gpu else None
            if nvml is None and on_gpu:
                nvml_failed = "NVML unavailable"
            if nvml is not None:
                try:
                    handle, gpu_id = nvml_handle_for_torch_device(nvml, ident["device_index"] or 0)
                except Exception as exc:
                    log.warning("powersave: cannot map CUDA device to NVML (%s); energy figures of this GPU unavailable", exc)
                    nvml, nvml_failed = None, f"cannot map CUDA device to NVML: {exc}"
        if nvml_failed is not None:
            gpu_id = f"cuda{ident['device_index'] or 0}-rank{self.rank}"
        self.gpu_id = gpu_id
        meter_kind = settings.energy.meter
        if meter_kind == "auto":
            meter_kind = "nvml" if handle is not None or nvml_failed is not None else "simulated"
        if meter_kind == "nvml" and handle is None and nvml_failed is None:
            log.warning("powersave: energy.meter 'nvml' requested but no NVML device; using the simulated meter")
            meter_kind = "simulated"
        needs_sim = meter_kind == "simulated" or settings.clocks.backend == "simulated"
        if needs_sim:
            self.sim = SimulatedGpu(SPECS[settings.energy.simulated_gpu])
            if settings.energy.simulated_model_shape:
                self.model_cost = ModelCost.for_shape(settings.energy.simulated_model_shape)
            else:
                cost = vllm_compat.runner_model_cost(runner)
                self.model_cost = ModelCost(cost["n_params"], cost["kv_bytes_per_token"], cost["weight_bytes"], cost["vocab_params"])
        self.meter: EnergyMeter | None
        if meter_kind == "nvml" and handle is None:
            # A GPU whose NVML fails: its energy is unknown (never replaced by the simulated H200).
            self.meter = UnavailableEnergyMeter(gpu_id, nvml_failed or "no NVML device")
        elif meter_kind == "nvml":
            self.meter = open_nvml_meter(nvml, handle, gpu_id, sample_period_s=settings.energy.sample_period_s)
        elif meter_kind == "simulated":
            assert self.sim is not None
            if settings.clocks.backend == "simulated" and settings.clocks.presets:
                self.sim_stock = SimulatedGpu(self.sim.spec)
            self.meter = SimulatedEnergyMeter(self.sim, gpu_id, shadow=self.sim_stock)
        else:
            self.meter = None
        self.clocks = ClockController(self._backend(settings, nvml, handle), settings.clocks, gpu_id=gpu_id,
                                      asynchronous=settings.clocks.backend in ("nvml", "zeusd"),
                                      host_ahead_steps=1 if vllm_compat.async_scheduling(runner) else 0)
        self._last_stamp: float | None = None
        self._plp_rows = vllm_compat.PromptLogprobRows(whole_batch=vllm_compat.runner_is_v2(runner))
        # A gap between two scheduler stamps this long means the engine idled (a step itself is
        # never this long in practice); between idle_after_s and this, ranks fall back to their
        # pre-idle state. Either way every rank ends in the same decision state.
        self._idle_stamp_gap_s = max(1.0, 4 * settings.energy.idle_after_s)
        self._gauge_cache: dict[str, Any] | None = None
        self._gauge_t = 0.0
        self._last_tick = 0.0
        self.boost: BoostController | None = None
        if settings.cuda_perf_boost == "auto":
            self.boost = _boost_for(on_gpu, gpu_id, settings.boost_release_after_s)
        self._done_requests: deque[tuple[str, float | None]] = deque()
        self.account = (PhaseEnergyAccount(self.meter, settings.energy.idle_after_s, per_request=settings.per_request_energy,
                                           on_request_done=lambda rid, j: self._done_requests.append((rid, j)),
                                           window_s=settings.energy.window_s, feed=lambda: self.drain_steps())
                        if self.meter else None)
        # Steady state = the running batch at the scheduler's limit (ML.ENERGY's window, account.py).
        self.steady_batch = settings.energy.steady_batch or vllm_compat.runner_max_num_seqs(runner)
        # Set by the step hook when requests finished: the publisher then ticks at once (at most every
        # flush_min_s) so that per-request energy reaches the API server within milliseconds.
        self._wake = threading.Event()
        self._flush_min_s = 0.01
        self.stats_path = Path(settings.stats_dir) / f"rank{self.rank}.json" if settings.stats_dir else None
        self._stop = threading.Event()
        self._last_step_s = time.monotonic()
        c = settings.clocks
        self.regime = RegimeFilter(c.regime_window_s, c.compute_share_max, c.prefill_burst_tokens, c.memory_bound_max_tokens)
        # Completed trace records (lists in _TRACE_KEYS order), written as JSON lines by the publisher.
        self._trace: deque[list] | None = deque() if settings.trace_steps and self.stats_path else None
        # Step records for the account, the trace and the simulator (on_step_start -> drain_steps).
        self._steps: deque[list] | None = deque() if (self.account is not None or self._trace is not None or self.sim is not None) else None
        self._open_rec: list | None = None  # the newest step record, until on_step_end stamps its end
        self._drained_start: list | None = None  # the record whose start drain_steps fed last
        self._drain_lock = threading.Lock()
        # The simulator prices each step at the clock it runs at: drain at once.
        self._drain_inline = self.sim is not None
        self._per_request = self.account is not None and self.account.per_request
        self._lookahead = c.lookahead
        # The clock decision runs per step only where it can change something.
        self._decides = bool(self.clocks.presets or self.clocks.groups) or self.boost is not None
        self._per_step = self._decides or self._steps is not None
        #: Whether any phase has an lm_head kernel-group preset (the LM-head hook's fast path is off then).
        self.head_groups = any("lm_head" in g for g in self.clocks.groups.values())
        self._trace_path = self.stats_path.with_name(f"trace-rank{self.rank}.jsonl") if self.stats_path else None
        # Under vLLM's Ray executor stats_dir may live on another node: send through the relay
        # actor the EngineCore started there (ray_relay.py); else write the files here.
        self._relay = ray_relay.connect(settings.stats_dir) if self.stats_path else None
        try:
            self.publish()  # series exist from the first step on, not one period later
        except OSError as exc:
            log.warning("powersave: cannot write stats to %s: %s", self.stats_path, exc)
        self._thread = threading.Thread(target=self._publisher, name="powersave-stats", daemon=True)
        self._thread.start()
        self._closed = False
        atexit.register(self.close)
        log.info(
            "powersave: active on rank %d (gpu %s): energy %s, clocks %s%s, chunk table %s",
            self.rank, gpu_id, (f"{self.meter.source} ({self.meter.method}{'' if self.meter.available else ', unavailable'})"
                                if self.meter else "off"), self.clocks.backend.kind,
            " (simulated)" if self.clocks.backend.kind == "simulated" else "",
            [(r.min_rows, r.chunks) for r in settings.chunking.table] or "none",
        )

    def _backend(self, settings: PowersaveSettings, nvml: Any, handle: Any) -> ClockBackend:
        kind = settings.clocks.backend
        if envs.force_dry_run() and kind != "dry-run":
            log.warning("powersave: %s=1: clock backend %r forced to dry-run", ENV_FORCE_DRY_RUN, kind)
            kind = "dry-run"
        if kind == "nvml":
            if handle is None:
                log.warning("powersave: clocks.backend 'nvml' but no NVML device; using dry-run")
                return DryRunClockBackend()
            return NvmlClockBackend(nvml, handle)
        if kind == "zeusd":
            return self._zeusd_backend(settings, nvml, handle)
        if kind == "simulated":
            assert self.sim is not None
            return SimulatedClockBackend(self.sim)
        supported = None
        if handle is not None:
            try:
                supported = NvmlClockBackend(nvml, handle).supported_sm_clocks()  # read-only query
            except Exception:
                supported = None
        elif self.sim is not None:
            supported = self.sim.spec.sm_clocks_mhz
        return DryRunClockBackend(supported)

    def _zeusd_backend(self, settings: PowersaveSettings, nvml: Any, handle: Any) -> ClockBackend:
        """Zeus's daemon for unprivileged servers; unreachable or unset -> dry-run, one warning."""
        from .clocks.backends import ClockError, ZeusdClockBackend
        from .envs import ENV_ZEUSD_SOCK

        sock = settings.clocks.zeusd_socket or envs.zeusd_socket()
        supported = mem = None
        if handle is not None:
            try:  # read-only queries: no privilege needed
                local = NvmlClockBackend(nvml, handle)
                supported, mem = local.supported_sm_clocks(), local.supported_mem_clocks()
            except Exception:
                supported = mem = None
        if not sock:
            log.warning("powersave: clocks.backend 'zeusd' but neither clocks.zeusd_socket nor $%s is set; using dry-run", ENV_ZEUSD_SOCK)
            return DryRunClockBackend(supported)
        token = envs.zeusd_token()
        index = settings.clocks.zeusd_gpu_index
        try:
            if index is None and handle is not None:
                bus = nvml.nvmlDeviceGetPciInfo(handle).busId
                index = ZeusdClockBackend.index_for_pci(sock, bus.decode() if isinstance(bus, bytes) else str(bus), token)
        except ClockError as exc:
            log.warning("powersave: zeusd: %s; clock control falls back to dry-run", exc)
            return DryRunClockBackend(supported)
        except Exception as exc:
            log.warning("powersave: zeusd: cannot map this GPU to a zeusd index (%s); using the CUDA device index", exc)
        return ZeusdClockBackend(sock, int(index if index is not None else self.device_index), token, supported, mem)

    # -- per step ----------------------------------------------------------------------------
    def _reset_cuda_peak(self) -> None:
        """vLLM's start-up profile run (a dummy batch of max_num_batched_tokens), V2's warm-up steps
        and CUDA-graph capture set a peak that serving rarely reaches again, so a peak read later
        would mostly report start-up. Reset once, at the first served step: the snapshot's peak is
        then serving's own. vLLM reads the peak only while it profiles memory at start-up."""
        self._peak_reset_pending = False
        try:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device_index)
            self._peak_scope = "since the first served step"
        except Exception as exc:
            log.debug("powersave: CUDA peak-memory statistics not reset: %s", exc)

    def on_step_start(self, scheduler_output: Any) -> None:
        """Engine step hook (vLLM's engine thread, every step): the clock decision only.

        Measured on the H200 host, per-step work here costs 5-9x its hot-loop figure (each step
        starts with cold caches after milliseconds of vLLM's own code), and a host-bound small model
        pays it in throughput. So this hook classifies the step, decides the clock and appends one
        record; the energy account, the step trace and the prompt-logprob rows are computed from
        the records by :meth:`drain_steps` in a batch (publisher thread, every tick), where the same
        code runs warm. The simulated GPU prices each step at the clock it ran at, so with a
        simulator the records are drained here at once.
        """
        # vLLM's own warm-up (V2 kernel warm-up, before the engine serves) goes through execute_model
        # like a real step: not served work, neither traced nor metered. At start-up it all comes
        # before the first served step, so the check stops there (it costs ~2 us per step with cold
        # caches); a warm-up on a serving worker is caught at its first step below, or by drain_steps.
        if not self._serving:
            if vllm_compat.is_warmup_step(scheduler_output):
                self._skip_step_end = True
                return
            self._serving = True
            if self._peak_reset_pending:
                self._reset_cuda_peak()
        if not self._per_step:
            return  # nothing configured reads steps (no presets, meter, trace or booster)
        steps = self._steps
        if not self._decides:
            rec = [time.monotonic(), None, scheduler_output, None, None, 0]  # classified by drain_steps
        else:
            # Measured on the H200 host (h200_alternate --time-parts), every Python call here costs
            # 2-5 us: the common step (decode only) is classified by one compat call and decided
            # below without calling the regime filter or the controller; drain_steps classifies it
            # fully later. Other steps take step_info (ctx, a sum over the batch that only the trace
            # and the simulator read, is added by drain_steps).
            tokens = vllm_compat.decode_step_tokens(scheduler_output)
            if tokens >= 0:
                info = None
            elif vllm_compat.is_warmup_step(scheduler_output):
                # vLLM warms kernels up again on a worker already serving (0.32: elastic-EP scale-up).
                # That sequence opens with a prefill of new warm-up requests (never a decode-only
                # step), so it is caught here, and its decode steps by the check above until it ends.
                self._serving = False
                self._skip_step_end = True
                return
            else:
                info = vllm_compat.step_info(scheduler_output, ctx=False)
            if info is not None and info.phase == "idle":
                rec = [time.monotonic(), info, scheduler_output, None, None, 0]
            else:
                self._last_step_s = t_step = time.monotonic()
                clocks = self.clocks
                # The scheduler's stamp (same on every rank) drives the regime window and the dwell
                # (vllm_compat.step_lookahead, inlined: this runs every engine step).
                la = getattr(scheduler_output, _LOOKAHEAD_ATTR, None)
                if la is not None:
                    now = la[0]
                    waiting = la[2]
                    if waiting and not self._lookahead:
                        waiting = 0
                    # Engine-wide idle verdict from the scheduler's stamps (identical on every rank); a
                    # rank whose own timer went idle meanwhile is reconciled with it before the step decides.
                    gap_idle = self._last_stamp is not None and now - self._last_stamp >= self._idle_stamp_gap_s
                    if gap_idle or clocks._pre_idle is not None:  # clocks.idling, without the property call
                        clocks.idle_end(gap_idle, now)
                    self._last_stamp = now
                else:
                    now, waiting = t_step, 0
                    if clocks._pre_idle is not None:
                        clocks.idle_end(True, now)
                clocks.step_since = t_step  # clocks.step_begun(t_step), in place: the watchdog's heartbeat
                reg = self.regime
                if info is None:
                    # RegimeFilter.phase for a decode-only step, inlined (same expressions, so the
                    # same share to the bit; tested): memory-bound up to mb_tokens, else compute-bound.
                    if not reg.mb_tokens or tokens <= reg.mb_tokens:
                        own, x = "decode", 0.0
                    else:
                        own, x = "mixed", 1.0
                    t = reg._t
                    if t is None:
                        reg.share = x
                    else:
                        dt = now - t
                        a = math.exp(-(dt if dt > 0.0 else 0.0) / reg.window_s)  # noqa: FURB136
                        reg.share = a * reg.share + (1 - a) * x
                    reg._t = now
                    if waiting >= reg.burst_tokens:
                        phase = "prefill"
                    else:
                        phase = "decode" if reg.share < reg.share_max else own
                else:
                    phase = reg.phase(info, now, waiting)
                # ClockController.on_phase's no-change return, inlined (the common case).
                if clocks._same.get(phase, False) and clocks._down_since is None and clocks.group is None:
                    clocks.phase = phase
                else:
                    clocks.on_phase(phase, now)
                if self.boost is not None:
                    self.boost.on_busy(t_step)
                rec = [t_step, info, scheduler_output, clocks.current.sm_clock_mhz, None, 0]
        if steps is None:
            return
        steps.append(rec)
        self._open_rec = rec
        if self._per_request and getattr(scheduler_output, "finished_req_ids", None):
            self._wake.set()  # the publisher attributes them now: the API server may hold their responses
        if self._drain_inline or len(steps) > _MAX_PENDING_STEPS:
            self.drain_steps()

    def on_step_end(self) -> None:
        if self._skip_step_end:
            self._skip_step_end = False
            return
        self.clocks.step_since = None  # clocks.step_ended(), in place
        rec = self._open_rec
        if rec is not None:
            self._open_rec = None
            if rec[_R_END] is None:
                rec[_R_END] = time.monotonic()

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
                        rec[_R_INFO] = _FAILED
                        vllm_compat.fault_once("drain_steps", exc, "feeding a step record", "that step is not metered or traced")
                if n == 1 and rec[_R_END] is None and not final:
                    break
                steps.popleft()
                info = rec[_R_INFO]
                if info is _WARMUP:
                    continue  # vLLM's kernel warm-up on a serving worker: no served work
                t_end = rec[_R_END]
                if acc is not None and t_end is not None:
                    acc.on_step_end(t_end)
                if info is _FAILED:
                    continue
                if trace is not None and info is not None and info.phase != "idle":
                    trace.append([rec[_R_T], info.phase, info.prefill_tokens, info.decode_tokens, rec[_R_ROWS],
                                  info.decode_ctx_tokens, info.num_reqs, rec[_R_SM], t_end])

    def _step_fed(self, rec: list, acc: PhaseEnergyAccount | None, plp: Any, sim: SimulatedGpu | None, want_rows: bool) -> None:
        """One record's start: prompt-logprob rows, the account's step, the simulator's work."""
        so = rec[_R_SO]
        rec[_R_SO] = None  # the SchedulerOutput is not kept past this point
        info = rec[_R_INFO]
        if info is None:
            if not self._decides and vllm_compat.is_warmup_step(so):
                # Records that no clock decision classified: a kernel warm-up vLLM runs on a worker
                # already serving (0.32's elastic-EP scale-up) is recognised here, off the step path.
                rec[_R_INFO] = _WARMUP
                return
            info = rec[_R_INFO] = vllm_compat.step_info(so)
        elif want_rows and info.phase != "idle":
            info = rec[_R_INFO] = info._replace(decode_ctx_tokens=vllm_compat.step_decode_ctx_tokens(so, info))
        if info.phase == "idle":
            if want_rows:
                plp.rows(so)  # forgets requests that finished (aborted) meanwhile
            if acc is not None:
                fin = vllm_compat.step_request_tokens(so)[1]
                acc.on_finished(fin, rec[_R_T])
            return
        t = rec[_R_T]
        if want_rows:
            # Prompt-logprob rows reach the LM head too: without them a long prompt with
            # prompt_logprobs would be priced (simulator) and traced as one row per request.
            # (rows() is 0 unless a request is pending or this step has new or context-phase requests.)
            rec[_R_ROWS] = rows = info.lm_head_rows + plp.rows(so) if plp.left or info.prefill_reqs else info.lm_head_rows
        if acc is not None:
            # References only (no copies); the account drops them unless per_request is on.
            req, fin = vllm_compat.step_request_tokens(so)
            steady = self.steady_batch is not None and info.num_reqs >= self.steady_batch
            acc.on_step(info.phase, info.prefill_tokens, info.decode_tokens, req, fin, steady, t=t)
        if sim is not None and self.model_cost is not None:
            work = self.model_cost.step_work(info.num_tokens, rows, info.decode_ctx_tokens, self.model_cost.vocab_params)
            sim.run(work)
            if self.sim_stock is not None:
                self.sim_stock.run(work)

    # -- publishing --------------------------------------------------------------------------
    def energy_snapshot(self) -> dict[str, Any]:
        """Energy fields of the snapshot; figures of an unavailable meter are left out, not frozen."""
        acc, m = self.account, self.meter
        if m is None or acc is None:
            return {"energy_available": False}
        out: dict[str, Any] = {
            "energy_method": m.method,
            "energy_available": bool(acc.available and m.available),
            "energy_unavailable_reason": m.unavailable_reason,
            "counter_resets": m.counter_resets,
            "counter_wraps": m.counter_wraps,
            "meter_faults": m.faults,
            "steps": dict(acc.steps),
            "tokens": dict(acc.tokens),
            "requests_finished": acc.finished_requests,
        }
        if out["energy_available"]:
            out.update({
                "energy_j": dict(acc.energy_j),
                "time_s": dict(acc.time_s),
                "request_energy_j_finished": acc.finished_request_j,
                "request_energy_j_in_flight": sum(list(acc.request_j.values())),
                "window": {"window_s": acc.window_s, **acc.window()},
                "steady": {"batch": self.steady_batch, "energy_j": acc.steady_j, "seconds": acc.steady_s, "tokens": dict(acc.steady_tokens)},
            })
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

    def snapshot(self) -> dict[str, Any]:
        self.drain_steps()  # step and token counts up to the last step
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
            "ray_node_id": self._relay.node_id if self._relay is not None else None,
        }

    def _flush_trace(self, final: bool = False) -> None:
        """Write the trace records of the steps drained so far (``final``: the running one too)."""
        if self._trace is None or self._trace_path is None:
            return
        self.drain_steps(final)
        pop = self._trace.popleft
        done = [pop() for _ in range(len(self._trace))]
        if done:
            self._write_lines(self._trace_path, [_trace_line(r) for r in done])

    def _flush_requests(self) -> None:
        if not self._done_requests or self.stats_path is None:
            return
        src = self.meter.source if self.meter else "none"
        method = self.meter.method if self.meter else "none"
        lines = []
        while self._done_requests:
            rid, j = self._done_requests.popleft()
            lines.append(json.dumps({"request_id": rid, "energy_j": None if j is None else round(j, 6), "source": src,
                                     "method": method, "gpu": self.gpu_id, "rank": self.rank}) + "\n")
            log.debug("powersave: request %s used %s J (%s)", rid, "unavailable" if j is None else f"{j:.3f}", src)
        self._write_lines(self.stats_path.with_name(f"requests-rank{self.rank}.jsonl"), lines)

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
        text = json.dumps(self.snapshot())
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
            self._thread.join(timeout=_CLOSE_JOIN_S)
        # Each final write on its own: one that fails must not cost the others.
        for what, fn in (("final energy tick", self.account.tick if self.account is not None else None),
                         ("final publish", self.publish), ("final trace flush", lambda: self._flush_trace(final=True))):
            if fn is None:
                continue
            try:
                fn()
            except Exception as exc:
                log.warning("powersave: %s failed (%s: %s); continuing the shutdown", what, type(exc).__name__, exc)
        if self.meter is not None:
            self.meter.close()


def _runtime_for(runner: Any) -> WorkerRuntime:
    global _RUNTIME
    if _RUNTIME is None:
        with _RT_LOCK:
            if _RUNTIME is None:
                _RUNTIME = WorkerRuntime(runner, settings_from_env())
    return _RUNTIME


def on_step_start(runner: Any, scheduler_output: Any) -> None:
    rt = _RUNTIME
    (rt if rt is not None else _runtime_for(runner)).on_step_start(scheduler_output)


_ENGINE_RELAY = {"checked": False}


def _ensure_engine_relay() -> None:
    """EngineCore, first request: under vLLM's Ray executor (this process is the Ray driver) start
    the stats relay on this node, before the first step reaches any worker (ray_relay.py)."""
    _ENGINE_RELAY["checked"] = True
    stats_dir = settings_from_env().stats_dir
    if stats_dir:
        ray_relay.ensure_relay(stats_dir)


def on_arrival(prompt_tokens: int) -> None:
    """Scheduler ``add_request`` hook (EngineCore process). Only a worker living in the same
    process (single-GPU engines) reacts: an idle-clocked GPU ramps up before the first step."""
    if not _ENGINE_RELAY["checked"]:
        _ensure_engine_relay()
    if _RUNTIME is not None:
        _RUNTIME.clocks.on_arrival()
        if _RUNTIME.boost is not None:
            _RUNTIME.boost.on_busy()


def on_step_end(runner: Any) -> None:
    if _RUNTIME is not None:
        _RUNTIME.on_step_end()
