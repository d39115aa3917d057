"""Construction: a :class:`WorkerRuntime` built from the settings and vLLM's runner.

Picks the GPU's identity (NVML UUID, CUDA device or simulated), the energy meter, the clock
backend (NVML, zeusd, simulated or dry-run; ``$POWERSAVE_FORCE_DRY_RUN`` wins), the booster and
the publisher's files; the step path (``step.py``) and the publisher (``publisher.py``) then run
on that state.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from .. import envs, ray_relay, vllm_compat
from ..clocks import ClockController, DryRunClockBackend, NvmlClockBackend, SimulatedClockBackend
from ..clocks.backends import ClockBackend
from ..clocks.boost import BoostController, BoostHolder
from ..clocks.mode import probe_and_select
from ..clocks.regime import RegimeFilter
from ..device import GpuError, NvmlGpu, init_nvml
from ..device.step_timer import WALL, CudaEventStepTimer, SimulatedStepTimer, StepTimer
from ..energy import PhaseEnergyAccount, SimulatedEnergyMeter, request_cost
from ..energy.meters import EnergyMeter, UnavailableEnergyMeter, open_nvml_meter
from ..envs import ENV_FORCE_DRY_RUN
from ..savings import savings_state, start_line
from ..settings import PowersaveSettings
from ..sim.gpu import SPECS, ModelCost, SimulatedGpu
from ..starvation import FrontendBusyReader, StarvationWatch
from ..stats_contract import TraceLine, snapshot_name, trace_name
from .publisher import Publisher
from .step import StepPath, StepRecord

log = logging.getLogger("vllm.powersave")


def _boost_for(on_gpu: bool, gpu_id: str, release_after_s: float) -> BoostController | None:
    """The side-context booster of this worker's GPU, addressed by UUID (``cuda_perf_boost: auto``)."""
    if not on_gpu:
        return None  # nothing to boost (the savings line and /metrics say "n/a: no GPU")
    if not gpu_id.startswith(("GPU-", "MIG-")):
        log.warning("powersave: cuda_perf_boost auto needs an NVIDIA GPU identified by UUID (have %r); the engine stays unboosted", gpu_id)
        return None
    return BoostController(BoostHolder(gpu_id), release_after_s)


def _init_nvml() -> Any | None:
    try:
        return init_nvml()
    except GpuError as exc:
        log.warning("powersave: NVML unavailable (%s)", exc)
        return None


class WorkerRuntime(StepPath, Publisher):
    """Everything the plugin runs inside one worker process: built here, run by the step path
    (:class:`StepPath`, engine thread) and the publisher (:class:`Publisher`, background thread)."""

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
        nvml, gpu, gpu_id = None, None, f"sim{self.rank}" if simulated else f"cuda{ident['device_index'] or 0}-rank{self.rank}"
        nvml_failed = None
        if (
            on_gpu
            and settings.energy.meter in ("auto", "nvml")
            or settings.clocks.backend == "nvml"
            or on_gpu
            and settings.clocks.backend == "auto"
            and settings.clocks.mode not in ("off", "dry_run")
        ):
            nvml = _init_nvml() if on_gpu else None
            if nvml is None and on_gpu:
                nvml_failed = "NVML unavailable"
            if nvml is not None:
                try:
                    gpu = NvmlGpu.for_torch_device(ident["device_index"] or 0, nvml)
                    gpu_id = gpu.uuid
                except Exception as exc:
                    log.warning("powersave: cannot map CUDA device to NVML (%s); energy figures of this GPU unavailable", exc)
                    nvml, nvml_failed = None, f"cannot map CUDA device to NVML: {exc}"
        if nvml_failed is not None:
            gpu_id = f"cuda{ident['device_index'] or 0}-rank{self.rank}"
        self.gpu_id = gpu_id
        meter_kind = settings.energy.meter
        if meter_kind == "auto":
            meter_kind = "nvml" if gpu is not None or nvml_failed is not None else "simulated"
        if meter_kind == "nvml" and gpu is None and nvml_failed is None:
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
        if meter_kind == "nvml" and gpu is None:
            # A GPU whose NVML fails: its energy is unknown (never replaced by the simulated H200).
            self.meter = UnavailableEnergyMeter(gpu_id, nvml_failed or "no NVML device")
        elif meter_kind == "nvml":
            self.meter = open_nvml_meter(gpu, sample_period_s=settings.energy.sample_period_s)
        elif meter_kind == "simulated":
            assert self.sim is not None
            if settings.clocks.backend == "simulated" and settings.clocks.presets:
                self.sim_stock = SimulatedGpu(self.sim.spec)
            self.meter = SimulatedEnergyMeter(self.sim, gpu_id, shadow=self.sim_stock)
        else:
            self.meter = None
        # clocks.mode / backend auto: chosen from this process's permissions, nothing set (clocks/mode.py).
        self.clock_choice = probe_and_select(settings, on_gpu=gpu is not None)
        clock_settings = settings.clocks
        if self.clock_choice.controller == "off":
            clock_settings = clock_settings.model_copy(update={"presets": {}})
        elif self.clock_choice.controller == "closed_loop" and not clock_settings.closed_loop.enabled:
            # clocks.mode (auto or closed_loop) chose the closed loop: the controller runs it.
            clock_settings = clock_settings.model_copy(
                update={"closed_loop": clock_settings.closed_loop.model_copy(update={"enabled": True})}
            )
        self.clocks = ClockController(
            self._backend(settings, gpu),
            clock_settings,
            gpu_id=gpu_id,
            asynchronous=self.clock_choice.backend in ("nvml", "zeusd"),
            host_ahead_steps=1 if vllm_compat.async_scheduling(runner) else 0,
        )
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
            # Where NVML failed the UUID is unknown: its warning said so already; no second one
            # (/metrics shows perf boost as failed).
            self.boost = None if nvml_failed is not None else _boost_for(on_gpu, gpu_id, settings.boost_release_after_s)
        self._done_requests: deque[tuple[str, float | None]] = deque()
        # The energy ticks behind the per-request figures, for the step trace (bounded).
        self._ticks: deque = deque(maxlen=4096)
        trace_ticks = bool(settings.trace_steps and settings.stats_dir)
        # Front-end starvation: the API servers' busy intervals (starvation.py); first rank of each engine warns.
        self.frontend = FrontendBusyReader(settings.stats_dir) if settings.stats_dir else None
        e = settings.energy
        self.starvation = (
            StarvationWatch(e.starvation_warn_share, e.starvation_min_busy_s, e.starvation_warn_every_s, self.engine)
            if int(ident.get("rank", 0) or 0) == 0
            else None
        )
        self.account = (
            PhaseEnergyAccount(
                self.meter,
                settings.energy.idle_after_s,
                per_request=settings.per_request_energy,
                on_request_done=lambda rid, j: self._done_requests.append((rid, j)),
                on_tick=self._ticks.append if trace_ticks else None,
                window_s=settings.energy.window_s,
                feed=lambda: self.drain_steps(),
                busy=self.frontend.overlap if self.frontend is not None else None,
                gpu_runs_ahead=on_gpu and vllm_compat.async_scheduling(runner),
                cost=request_cost.for_worker(
                    settings.energy.simulated_model_shape, lambda: vllm_compat.runner_model_cost(runner), settings.energy.simulated_gpu
                )
                if settings.per_request_energy
                else None,
            )
            if self.meter
            else None
        )
        # Steady state = the running batch at the scheduler's limit (ML.ENERGY's window, account.py).
        self.steady_batch = settings.energy.steady_batch or vllm_compat.runner_max_num_seqs(runner)
        # Set by the step hook when requests finished: the publisher then ticks at once (at most every
        # flush_min_s) so that per-request energy reaches the API server within milliseconds.
        self._wake = threading.Event()
        self._flush_min_s = 0.01
        self.stats_path = Path(settings.stats_dir) / snapshot_name(self.rank) if settings.stats_dir else None
        self._stop = threading.Event()
        self._last_step_s = time.monotonic()
        c = settings.clocks
        self.regime = RegimeFilter(c.regime_window_s, c.compute_share_max, c.prefill_burst_tokens, c.memory_bound_max_tokens)
        # Completed trace records (TraceLine), written as JSON lines by the publisher.
        self._trace: deque[TraceLine] | None = deque() if settings.trace_steps and self.stats_path else None
        # Step records for the account, the trace and the simulator (on_step_start -> drain_steps).
        # The closed-loop decode clock learns from finished steps, fed by drain_steps off the step path.
        self._closed_loop = self.clocks.closed_loop is not None
        self._closed_loop_off_reason: str | None = None
        self._closed_loop_written = 0  # its decision records already in the trace
        # Where the closed loop's step times come from (device/step_timer.py); the timed steps the
        # engine thread has not read yet, and those the publisher holds until they are (both oldest
        # first: the loop learns in step order).
        self._step_timer: StepTimer | None = self._make_step_timer() if self._closed_loop else None
        self.step_time_source = self._step_timer.source if self._step_timer is not None else WALL
        self._timed_steps: deque[tuple[StepRecord, float, Any]] = deque()  # publisher thread's
        self._unread: deque[StepRecord] = deque()  # timed steps not read yet (engine thread's)
        self._steps: deque[StepRecord] | None = (
            deque() if (self.account is not None or self._trace is not None or self.sim is not None or self._closed_loop) else None
        )
        self._open_rec: StepRecord | None = None  # the newest step record, until on_step_end stamps its end
        self._drained_start: StepRecord | None = None  # the record whose start drain_steps fed last
        self._drain_lock = threading.Lock()
        # The simulator prices each step at the clock it runs at: drain at once.
        self._drain_inline = self.sim is not None
        self._per_request = self.account is not None and self.account.per_request
        self._lookahead = c.lookahead
        # The clock decision runs per step only where it can change something.
        self._decides = bool(self.clocks.presets or self.clocks.groups) or self._closed_loop or self.boost is not None
        self._per_step = self._decides or self._steps is not None
        #: Whether any phase has an lm_head kernel-group preset (the LM-head hook's fast path is off then).
        self.head_groups = any("lm_head" in g for g in self.clocks.groups.values())
        self._trace_path = self.stats_path.with_name(trace_name(self.rank)) if self.stats_path else None
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
            self.rank,
            gpu_id,
            (f"{self.meter.source} ({self.meter.method}{'' if self.meter.available else ', unavailable'})" if self.meter else "off"),
            self.clocks.backend.kind,
            " (simulated)" if self.clocks.backend.kind == "simulated" else "",
            [(r.min_rows, r.chunks) for r in settings.chunking.table] or "none",
        )
        # The API server announced the savings at start (savings.startup_line); what this worker
        # really got is in its snapshot, and a saving that fails here warns on its own.
        log.debug("%s (rank %d)", start_line(self.savings(), metering_only=settings.savings == "off"), self.rank)

    def savings(self) -> dict[str, dict[str, str]]:
        """Which savings are on, off or failed here, and why (savings.py)."""
        return savings_state(
            self.settings,
            self.clock_choice,
            self.boost.snapshot() if self.boost is not None else None,
            self._on_gpu,
            self.clocks.disabled_reason or (f"closed loop off: {self._closed_loop_off_reason}" if self._closed_loop_off_reason else None),
            self.clocks.backend.kind,
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

    def _backend(self, settings: PowersaveSettings, gpu: NvmlGpu | None) -> ClockBackend:
        kind = self.clock_choice.backend
        if envs.force_dry_run() and kind != "dry-run":
            log.warning("powersave: %s=1: clock backend %r forced to dry-run", ENV_FORCE_DRY_RUN, kind)
            kind = "dry-run"
        if kind == "nvml":
            if gpu is None:
                log.warning("powersave: clocks.backend 'nvml' but no NVML device; using dry-run")
                return DryRunClockBackend()
            return NvmlClockBackend(gpu)
        if kind == "zeusd":
            return self._zeusd_backend(settings, gpu)
        if kind == "simulated":
            assert self.sim is not None
            return SimulatedClockBackend(self.sim)
        supported = None
        if gpu is not None:
            try:
                supported = gpu.supported_sm_clocks_mhz()  # read-only query
            except Exception:
                supported = None
        elif self.sim is not None:
            supported = self.sim.spec.sm_clocks_mhz
        return DryRunClockBackend(supported)

    def _make_step_timer(self) -> StepTimer | None:
        """The closed loop's step timer: the simulated GPU's step time where the clock is the
        simulator's, CUDA events on a GPU, else ``None`` (engine-thread wall time: vLLM's CPU build
        runs a step synchronously). On a GPU whose events fail the loop is off, with one warning:
        the engine-thread time there is launch time under async scheduling, not the step's."""
        if self.clocks.backend.kind == "simulated" and self.sim is not None and self.model_cost is not None:
            return SimulatedStepTimer()
        if not self._on_gpu:
            return None
        try:
            return CudaEventStepTimer(self.device_index)
        except Exception as exc:
            self._closed_loop_off(f"no CUDA event timing ({exc})")
            log.warning("powersave: cannot time steps with CUDA events (%s); the closed-loop decode clock is off", exc)
            return None

    def _closed_loop_off(self, reason: str) -> None:
        """Stop feeding the closed loop (its decode clock stays at the default) and stop timing
        steps for it; the snapshot's ``savings`` then shows the clock saving as failed, with
        ``reason``. Either thread may call it: each side drops its own queue of timed steps."""
        self._closed_loop = False
        self._step_timer = None
        self._closed_loop_off_reason = reason

    def _zeusd_backend(self, settings: PowersaveSettings, gpu: NvmlGpu | None) -> ClockBackend:
        """Zeus's daemon for unprivileged servers; unreachable or unset -> dry-run, one warning."""
        from ..clocks.backends import ClockError, ZeusdClockBackend
        from ..envs import ENV_ZEUSD_SOCK

        sock = settings.clocks.zeusd_socket or envs.zeusd_socket()
        supported = mem = None
        if gpu is not None:
            try:  # read-only queries: no privilege needed
                supported, mem = gpu.supported_sm_clocks_mhz(), gpu.supported_mem_clocks_mhz()
            except Exception:
                supported = mem = None
        if not sock:
            log.warning("powersave: clocks.backend 'zeusd' but neither clocks.zeusd_socket nor $%s is set; using dry-run", ENV_ZEUSD_SOCK)
            return DryRunClockBackend(supported)
        token = envs.zeusd_token()
        index = settings.clocks.zeusd_gpu_index
        try:
            if index is None and gpu is not None:
                index = ZeusdClockBackend.index_for_pci(sock, gpu.pci_bus_id(), token)
        except ClockError as exc:
            log.warning("powersave: zeusd: %s; clock control falls back to dry-run", exc)
            return DryRunClockBackend(supported)
        except Exception as exc:
            log.warning("powersave: zeusd: cannot map this GPU to a zeusd index (%s); using the CUDA device index", exc)
        return ZeusdClockBackend(sock, int(index if index is not None else self.device_index), token, supported, mem)
