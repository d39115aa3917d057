"""Construction: a :class:`WorkerRuntime` assembled from the settings and vLLM's runner.

Picks the GPU's identity (NVML UUID, CUDA device or simulated), the energy meter, the clock
backend (NVML, zeusd, simulated or dry-run; ``$POWERSAVE_FORCE_DRY_RUN`` wins) and the booster,
then wires the three owned components: the step path (``step.py``, engine thread), the drain
(``drain.py``) and the publisher (``publisher.py``, background thread), which share only the
typed handoff records of ``step.py``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .. import envs, ray_relay, vllm_compat
from ..clocks import ClockController, DryRunClockBackend, NvmlClockBackend, SimulatedClockBackend
from ..clocks.backends import ClockBackend
from ..clocks.boost import BoostController, BoostHolder
from ..clocks.mode import ClockChoice, probe_and_select
from ..clocks.regime import RegimeFilter
from ..device import GpuError, NvmlGpu, init_nvml
from ..device.step_timer import WALL, CudaEventStepTimer, SimulatedStepTimer
from ..energy import PhaseEnergyAccount, SimulatedEnergyMeter, request_cost
from ..energy.meters import EnergyMeter, UnavailableEnergyMeter, open_nvml_meter
from ..envs import ENV_FORCE_DRY_RUN
from ..savings import start_line
from ..settings import PowersaveSettings
from ..sim.gpu import SPECS, ModelCost, SimulatedGpu
from ..starvation import FrontendBusyReader, StarvationWatch
from ..stats_contract import WorkerSnapshot, snapshot_name
from .drain import StepDrain
from .publisher import Publisher, WorkerIdentity, tenant_watch
from .step import CudaPeak, StepHandoff, StepPath, StepTiming

log = logging.getLogger("vllm.powersave")


def init_nvml_or_none() -> Any | None:
    """NVML's module, initialised; ``None`` (one warning) where it is unavailable."""
    try:
        return init_nvml()
    except GpuError as exc:
        log.warning("powersave: NVML unavailable (%s)", exc)
        return None


@dataclass(frozen=True)
class NvmlAccess:
    """How the builder reaches NVML (``device/nvml.py``): ``init`` (the module or ``None``),
    ``gpu_for_device(cuda_index, nvml)`` and ``open_meter(gpu, sample_period_s)``. The one seam
    for a stand-in GPU without NVML (``benchmarks/hook_overhead.py``'s stub meter)."""

    init: Callable[[], Any | None]
    gpu_for_device: Callable[[int, Any], Any]
    open_meter: Callable[[Any, float | None], EnergyMeter]


#: The real NVML (looked up at call time, so that a test's fake ``pynvml`` module is the one used).
NVML = NvmlAccess(
    init=lambda: init_nvml_or_none(),
    gpu_for_device=lambda index, nvml: NvmlGpu.for_torch_device(index, nvml),
    open_meter=lambda gpu, sample_period_s: open_nvml_meter(gpu, sample_period_s=sample_period_s),
)


class Metering(NamedTuple):
    """The energy side of a worker: its meter (``None``: off), the simulated GPU (priced per step
    where the meter or the clock backend is simulated), its stock-clock twin (the simulated
    saving's baseline) and the model's cost per step (for the simulator)."""

    meter: EnergyMeter | None
    sim: SimulatedGpu | None
    sim_stock: SimulatedGpu | None
    model_cost: ModelCost | None
    gpu: NvmlGpu | None = None  # the NVML device (process list for the closed loop), where NVML opened


def boost_for(on_gpu: bool, gpu_id: str, release_after_s: float) -> BoostController | None:
    """The side-context booster of this worker's GPU, addressed by UUID (``cuda_perf_boost: auto``)."""
    if not on_gpu:
        return None  # nothing to boost (the savings line and /metrics say "n/a: no GPU")
    if not gpu_id.startswith(("GPU-", "MIG-")):
        log.warning("powersave: cuda_perf_boost auto needs an NVIDIA GPU identified by UUID (have %r); the engine stays unboosted", gpu_id)
        return None
    return BoostController(BoostHolder(gpu_id), release_after_s)


def worker_identity(runner: Any, settings: PowersaveSettings, nvml_access: NvmlAccess) -> tuple[WorkerIdentity, NvmlGpu | None, str | None]:
    """This worker's identity, its NVML GPU (``None``: not used or not found) and why NVML failed
    (``None``: it did not). A real GPU whose NVML is simply not used (meter off, dry-run clocks) is
    labelled as the CUDA device it is; ``simN`` where the figures are the simulated GPU's."""
    ident = vllm_compat.runner_identity(runner)
    rank = int(ident.get("global_rank", ident["rank"]))  # unique across data-parallel engines
    on_gpu = ident["device_type"] == "cuda"
    c = settings.clocks
    simulated = not on_gpu or settings.energy.meter == "simulated" or c.backend == "simulated"
    cuda_id = f"cuda{ident['device_index'] or 0}-rank{rank}"
    nvml, gpu, gpu_id, nvml_failed = None, None, f"sim{rank}" if simulated else cuda_id, None
    if (
        on_gpu
        and settings.energy.meter in ("auto", "nvml")
        or c.backend == "nvml"
        or on_gpu
        and c.backend == "auto"
        and c.mode not in ("off", "dry_run")
    ):
        nvml = nvml_access.init() if on_gpu else None
        if nvml is None and on_gpu:
            nvml_failed = "NVML unavailable"
        if nvml is not None:
            try:
                gpu = nvml_access.gpu_for_device(ident["device_index"] or 0, nvml)
                gpu_id = gpu.uuid
            except Exception as exc:
                log.warning("powersave: cannot map CUDA device to NVML (%s); energy figures of this GPU unavailable", exc)
                nvml, nvml_failed = None, f"cannot map CUDA device to NVML: {exc}"
    if nvml_failed is not None:
        gpu_id = cuda_id
    device_index = int(ident["device_index"] or 0)
    local_rank = int(ident.get("rank", 0) or 0)
    return WorkerIdentity(rank, local_rank, int(ident.get("dp_rank", 0)), device_index, on_gpu, gpu_id), gpu, nvml_failed


def open_metering(
    runner: Any, settings: PowersaveSettings, ident: WorkerIdentity, gpu: NvmlGpu | None, nvml_failed: str | None, nvml_access: NvmlAccess
) -> Metering:
    """The meter (``energy.meter``; ``auto``: NVML where a GPU has it, else simulated) and the
    simulated GPU behind a simulated meter or clock backend."""
    e = settings.energy
    meter_kind = e.meter
    if meter_kind == "auto":
        meter_kind = "nvml" if gpu is not None or nvml_failed is not None else "simulated"
    if meter_kind == "nvml" and gpu is None and nvml_failed is None:
        log.warning("powersave: energy.meter 'nvml' requested but no NVML device; using the simulated meter")
        meter_kind = "simulated"
    sim = sim_stock = model_cost = None
    if meter_kind == "simulated" or settings.clocks.backend == "simulated":
        sim = SimulatedGpu(SPECS[e.simulated_gpu])
        if e.simulated_model_shape:
            model_cost = ModelCost.for_shape(e.simulated_model_shape)
        else:
            cost = vllm_compat.runner_model_cost(runner)
            model_cost = ModelCost(cost["n_params"], cost["kv_bytes_per_token"], cost["weight_bytes"], cost["vocab_params"])
    meter: EnergyMeter | None = None
    if meter_kind == "nvml" and gpu is None:
        # A GPU whose NVML fails: its energy is unknown (never replaced by the simulated H200).
        meter = UnavailableEnergyMeter(ident.gpu_id, nvml_failed or "no NVML device")
    elif meter_kind == "nvml":
        meter = nvml_access.open_meter(gpu, e.sample_period_s)
    elif meter_kind == "simulated":
        assert sim is not None
        if settings.clocks.backend == "simulated" and settings.clocks.presets:
            sim_stock = SimulatedGpu(sim.spec)
        meter = SimulatedEnergyMeter(sim, ident.gpu_id, shadow=sim_stock)
    return Metering(meter, sim, sim_stock, model_cost, gpu)


def clock_controller(runner: Any, settings: PowersaveSettings, choice: ClockChoice, backend: ClockBackend, gpu_id: str) -> ClockController:
    """The clock controller for ``clocks.mode`` as chosen at start (``choice``, clocks/mode.py)."""
    clock_settings = settings.clocks
    if choice.controller == "off":
        clock_settings = clock_settings.model_copy(update={"presets": {}})
    elif choice.controller == "closed_loop" and not clock_settings.closed_loop.enabled:
        # clocks.mode (auto or closed_loop) chose the closed loop: the controller runs it.
        clock_settings = clock_settings.model_copy(update={"closed_loop": clock_settings.closed_loop.model_copy(update={"enabled": True})})
    return ClockController(
        backend,
        clock_settings,
        gpu_id=gpu_id,
        asynchronous=choice.backend in ("nvml", "zeusd"),
        host_ahead_steps=1 if vllm_compat.async_scheduling(runner) else 0,
    )


def clock_backend(
    settings: PowersaveSettings, choice: ClockChoice, gpu: NvmlGpu | None, sim: SimulatedGpu | None, device_index: int
) -> ClockBackend:
    """The backend ``choice`` names; ``$POWERSAVE_FORCE_DRY_RUN=1`` turns it into dry-run."""
    kind = choice.backend
    if envs.force_dry_run() and kind != "dry-run":
        log.warning("powersave: %s=1: clock backend %r forced to dry-run", ENV_FORCE_DRY_RUN, kind)
        kind = "dry-run"
    if kind == "nvml":
        if gpu is None:
            log.warning("powersave: clocks.backend 'nvml' but no NVML device; using dry-run")
            return DryRunClockBackend()
        return NvmlClockBackend(gpu)
    if kind == "zeusd":
        return zeusd_backend(settings, gpu, device_index)
    if kind == "simulated":
        assert sim is not None
        return SimulatedClockBackend(sim)
    supported = None
    if gpu is not None:
        try:
            supported = gpu.supported_sm_clocks_mhz()  # read-only query
        except Exception:
            supported = None
    elif sim is not None:
        supported = sim.spec.sm_clocks_mhz
    return DryRunClockBackend(supported)


def zeusd_backend(settings: PowersaveSettings, gpu: NvmlGpu | None, device_index: int) -> ClockBackend:
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
    return ZeusdClockBackend(sock, int(index if index is not None else device_index), token, supported, mem, reader=gpu)


def step_timing(clocks: ClockController, metering: Metering, ident: WorkerIdentity) -> StepTiming:
    """The closed loop's step timer: the simulated GPU's step time where the clock is the
    simulator's, CUDA events on a GPU, else none (engine-thread wall time: vLLM's CPU build runs a
    step synchronously). On a GPU whose events fail the loop is off, with one warning: the
    engine-thread time there is launch time under async scheduling, not the step's."""
    if clocks.closed_loop is None:
        return StepTiming(False, None, WALL)
    if clocks.backend.kind == "simulated" and metering.sim is not None and metering.model_cost is not None:
        timer = SimulatedStepTimer()
        return StepTiming(True, timer, timer.source)
    if not ident.on_gpu:
        return StepTiming(True, None, WALL)
    try:
        timer = CudaEventStepTimer(ident.device_index)
    except Exception as exc:
        log.warning("powersave: cannot time steps with CUDA events (%s); the closed-loop decode clock is off", exc)
        return StepTiming(False, None, WALL, f"no CUDA event timing ({exc})")
    return StepTiming(True, timer, timer.source)


def energy_account(
    runner: Any,
    settings: PowersaveSettings,
    meter: EnergyMeter | None,
    on_gpu: bool,
    publisher_queues: tuple[deque[tuple[str, float | None]], deque[Any]],
    feed: Callable[[], None],
    frontend: FrontendBusyReader | None,
) -> PhaseEnergyAccount | None:
    """The phase energy account on ``meter`` (``None`` without one). ``feed``: the drain, run
    before each tick; ``publisher_queues``: the publisher's finished requests and energy ticks,
    which the account appends to (the ticks only where a step trace is written)."""
    if not meter:
        return None
    done_requests, ticks = publisher_queues
    e = settings.energy
    cost = None
    if settings.per_request_energy:
        cost = request_cost.for_worker(e.simulated_model_shape, lambda: vllm_compat.runner_model_cost(runner), e.simulated_gpu)
    return PhaseEnergyAccount(
        meter,
        e.idle_after_s,
        per_request=settings.per_request_energy,
        on_request_done=lambda rid, j: done_requests.append((rid, j)),
        on_tick=ticks.append if settings.trace_steps and settings.stats_dir else None,
        window_s=e.window_s,
        feed=feed,
        busy=frontend.overlap if frontend is not None else None,
        gpu_runs_ahead=on_gpu and vllm_compat.async_scheduling(runner),
        cost=cost,
    )


def frontend_watch(settings: PowersaveSettings, ident: WorkerIdentity) -> tuple[FrontendBusyReader | None, StarvationWatch | None]:
    """Front-end starvation: the API servers' busy intervals (starvation.py), read where a stats
    directory is shared with them; the first rank of each engine warns."""
    e = settings.energy
    frontend = FrontendBusyReader(settings.stats_dir) if settings.stats_dir else None
    if ident.local_rank != 0:
        return frontend, None
    return frontend, StarvationWatch(e.starvation_warn_share, e.starvation_min_busy_s, e.starvation_warn_every_s, ident.engine)


def step_path(
    settings: PowersaveSettings, clocks: ClockController, boost: BoostController | None, drain: StepDrain, peak: CudaPeak
) -> StepPath:
    """The engine thread's component, on the drain's handoff and step timing."""
    c = settings.clocks
    return StepPath(
        clocks,
        RegimeFilter(c.regime_window_s, c.compute_share_max, c.prefill_burst_tokens, c.memory_bound_max_tokens),
        boost,
        drain.handoff,
        drain.timing,
        peak,
        drain.drain_steps,
        # The clock decision runs per step only where it can change something.
        decides=bool(clocks.presets or clocks.groups) or drain.timing.active or boost is not None,
        per_request=drain.per_request,
        lookahead=c.lookahead,
        drain_inline=drain.sim is not None,  # the simulator prices each step at the clock it runs at
        # A gap between two scheduler stamps this long means the engine idled (a step itself is never
        # this long in practice); between idle_after_s and this, ranks fall back to their pre-idle
        # state. Either way every rank ends in the same decision state.
        idle_stamp_gap_s=max(1.0, 4 * settings.energy.idle_after_s),
    )


def assemble(
    runner: Any,
    settings: PowersaveSettings,
    ident: WorkerIdentity,
    metering: Metering,
    clocks: ClockController,
    clock_choice: ClockChoice,
    boost: BoostController | None,
) -> tuple[StepPath, StepDrain, Publisher]:
    """The step path, the drain and the publisher, wired over one :class:`StepHandoff`."""
    stats_path = Path(settings.stats_dir) / snapshot_name(ident.rank) if settings.stats_dir else None
    frontend, starvation = frontend_watch(settings, ident)
    done_requests: deque[tuple[str, float | None]] = deque()
    ticks: deque[Any] = deque(maxlen=4096)  # the energy ticks behind the per-request figures, for the trace (bounded)
    account = energy_account(runner, settings, metering.meter, ident.on_gpu, (done_requests, ticks), lambda: drain.drain_steps(), frontend)
    timing = step_timing(clocks, metering, ident)
    trace = deque() if settings.trace_steps and stats_path else None
    keeps_steps = account is not None or trace is not None or metering.sim is not None or timing.active
    drain = StepDrain(
        StepHandoff(deque() if keeps_steps else None),
        timing,
        clocks,
        account,
        trace,
        vllm_compat.PromptLogprobRows(whole_batch=vllm_compat.runner_is_v2(runner)),
        metering.sim,
        metering.sim_stock,
        metering.model_cost,
        # Steady state = the running batch at the scheduler's limit (ML.ENERGY's window, account.py).
        steady_batch=settings.energy.steady_batch or vllm_compat.runner_max_num_seqs(runner),
        per_request=account is not None and account.per_request,
        memory_bound_max_tokens=settings.clocks.memory_bound_max_tokens,
        hold_cap_s=settings.energy.idle_after_s,
    )
    peak = CudaPeak(ident.on_gpu, ident.device_index)
    step = step_path(settings, clocks, boost, drain, peak)
    # Under vLLM's Ray executor stats_dir may live on another node: send through the relay actor
    # the EngineCore started there (ray_relay.py); else write the files here.
    relay = ray_relay.connect(settings.stats_dir) if stats_path else None
    publisher = Publisher(
        settings,
        ident,
        metering.meter,
        account,
        clocks,
        clock_choice,
        boost,
        drain,
        drain.handoff,
        timing,
        peak,
        stats_path,
        relay,
        ticks=ticks,
        done_requests=done_requests,
        frontend=frontend,
        starvation=starvation,
        # Another process on the GPU, for the closed loop (docs/closed-loop.md, "Another process on the GPU").
        tenants=tenant_watch(metering.gpu, boost=boost) if timing.active else None,
    )
    return step, drain, publisher


class WorkerRuntime:
    """Everything the plugin runs inside one worker process: three owned components, the step path
    (:class:`StepPath`, engine thread), the drain (:class:`StepDrain`) and the publisher
    (:class:`Publisher`, background thread), assembled by :func:`assemble`.

    ``on_step_start`` / ``on_step_end`` are the step path's bound methods (no delegating frame on
    the engine thread: docs/results/hook-overhead.md); ``head_groups``: whether any phase has an
    ``lm_head`` kernel-group preset (the LM-head hook's fast path is off then).
    """

    settings: PowersaveSettings
    ident: WorkerIdentity
    metering: Metering
    clock_choice: ClockChoice
    clocks: ClockController
    boost: BoostController | None
    head_groups: bool
    step_path: StepPath
    drain: StepDrain
    publisher: Publisher
    on_step_start: Callable[[Any], None]
    on_step_end: Callable[[], None]

    def __init__(self, runner: Any, settings: PowersaveSettings, nvml: NvmlAccess = NVML) -> None:
        self.settings = settings
        self.ident, gpu, nvml_failed = worker_identity(runner, settings, nvml)
        self.metering = m = open_metering(runner, settings, self.ident, gpu, nvml_failed, nvml)
        # clocks.mode / backend auto: chosen from this process's permissions, nothing set (clocks/mode.py).
        self.clock_choice = probe_and_select(settings, on_gpu=gpu is not None)
        backend = clock_backend(settings, self.clock_choice, gpu, m.sim, self.ident.device_index)
        self.clocks = clock_controller(runner, settings, self.clock_choice, backend, self.ident.gpu_id)
        self.boost = None
        if settings.cuda_perf_boost == "auto" and nvml_failed is None:
            # Where NVML failed the UUID is unknown: its warning said so already (/metrics shows perf boost as failed).
            self.boost = boost_for(self.ident.on_gpu, self.ident.gpu_id, settings.boost_release_after_s)
        self.head_groups = any("lm_head" in g for g in self.clocks.groups.values())
        self.step_path, self.drain, self.publisher = assemble(runner, settings, self.ident, m, self.clocks, self.clock_choice, self.boost)
        self.on_step_start, self.on_step_end = self.step_path.on_step_start, self.step_path.on_step_end
        self.publisher.start()
        log.info(
            "powersave: active on rank %d (gpu %s): energy %s, clocks %s%s, chunk table %s",
            self.ident.rank,
            self.ident.gpu_id,
            (f"{m.meter.source} ({m.meter.method}{'' if m.meter.available else ', unavailable'})" if m.meter else "off"),
            self.clocks.backend.kind,
            " (simulated)" if self.clocks.backend.kind == "simulated" else "",
            [(r.min_rows, r.chunks) for r in settings.chunking.table] or "none",
        )
        # The API server announced the savings at start (savings.startup_line); what this worker
        # really got is in its snapshot, and a saving that fails here warns on its own.
        log.debug("%s (rank %d)", start_line(self.savings(), metering_only=settings.savings == "off"), self.ident.rank)

    # -- the worker's parts, by name (tests, benchmarks) ----------------------------------------
    @property
    def rank(self) -> int:
        return self.ident.rank

    @property
    def device_index(self) -> int:
        return self.ident.device_index

    @property
    def gpu_id(self) -> str:
        return self.ident.gpu_id

    @property
    def meter(self) -> EnergyMeter | None:
        return self.metering.meter

    @property
    def sim(self) -> SimulatedGpu | None:
        return self.metering.sim

    @property
    def account(self) -> PhaseEnergyAccount | None:
        return self.drain.account

    @property
    def regime(self) -> RegimeFilter:
        return self.step_path.regime

    @property
    def step_time_source(self) -> str:
        """Where the closed loop's step times come from (device/step_timer.py)."""
        return self.step_path.timing.source

    @property
    def closed_loop_active(self) -> bool:
        """Whether finished steps still feed the closed-loop decode clock."""
        return self.step_path.timing.active

    # -- the publisher's side ----------------------------------------------------------------------
    def drain_steps(self, final: bool = False) -> None:
        self.drain.drain_steps(final)

    def savings(self) -> dict[str, dict[str, str]]:
        return self.publisher.savings()

    def energy_snapshot(self) -> WorkerSnapshot:
        return self.publisher.energy_snapshot()

    def snapshot(self) -> WorkerSnapshot:
        return self.publisher.snapshot()

    def publish(self) -> None:
        self.publisher.publish()

    def stop_publisher_thread(self) -> None:
        """Stop the background thread; the caller then drives the publisher by hand."""
        self.publisher.stop_thread()

    def close(self) -> None:
        """Stop the publisher, restore clocks, write the final stats and trace (idempotent)."""
        self.publisher.close()
