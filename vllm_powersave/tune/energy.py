"""Time and energy of a repeated GPU call: NVML counter windows (measured) or the H200 model (simulated).

NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ) advances only every
~100 ms on the H200 (``docs/h200-facts.md``). A window read at arbitrary instants is therefore off by
up to one update at each edge (±10 % on a 1 s window). :func:`busy_window` instead keeps the GPU
continuously busy and takes both window edges *at counter updates* seen while the queue is full, so
that the power between the two updates is the power of the call alone; energy per call is that
power times the call's duration from CUDA events. Seed 000 (Spaan et al., arXiv 2601.08539) used
5 s windows for the same reason; the edge alignment is what lets 1 s windows suffice here.

Only torch and (on a GPU) the device layer's :class:`~vllm_powersave.device.NvmlGpu` are used: this
module runs on a bare GPU machine.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..device import GpuError, NvmlGpu
from ..sim.gpu import H200, GpuSpec, StepWork, simulate_step

#: Per-kernel launch/tail cost charged by the simulated costing, in s (a CUDA kernel launch on
#: Hopper is a few µs; the engine-step overhead of the simulator, 150 µs, is per step, not per kernel).
SIM_KERNEL_OVERHEAD_S = 5e-6


@dataclass(frozen=True)
class Window:
    """One measurement window of a repeated call.

    ``ms_per_call`` (ms) and ``j_per_call`` (J) per call; ``window_s``: the energy window (s, between
    two counter updates); ``calls``: calls in the timed loop; ``power_w``: average power (W);
    ``sm_clock_mhz``: SM clock read at the end (MHz, None where unknown); ``source``: "measured" or
    "simulated".
    """

    ms_per_call: float
    j_per_call: float
    window_s: float
    calls: int
    power_w: float
    sm_clock_mhz: int | None
    source: str


def open_nvml(index: int = 0) -> NvmlGpu | None:
    """torch's CUDA device ``index`` through NVML, or None where NVML is unavailable. Read-only use."""
    try:
        return NvmlGpu.for_torch_device(index)
    except (GpuError, ValueError):
        return None


class _CounterPoller(threading.Thread):
    """Reads the energy counter in a background thread and records every change ``(time, mJ)``.

    NVML reads are slow on some machines (~4 ms each on the H200 test machine): polled from the
    launch loop they starve the GPU of work. ctypes releases the GIL during the call, so a thread
    keeps the launch loop free; an edge's time is taken right after the read that saw the change.
    """

    def __init__(self, read: Callable[[], int], poll_s: float) -> None:
        super().__init__(name="powersave-energy-poller", daemon=True)
        self.read, self.poll_s = read, poll_s
        self.changes: list[tuple[float, int]] = []
        self.stop_evt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            prev = self.read()
            while not self.stop_evt.is_set():
                cur = self.read()
                now = time.perf_counter()
                if cur != prev:
                    self.changes.append((now, int(cur)))
                    prev = cur
                self.stop_evt.wait(self.poll_s)
        except BaseException as exc:  # reported by the caller
            self.error = exc


def _time_per_call_s(torch: Any, call: Callable[[], Any]) -> float:
    """Seconds per call from CUDA events over three calls after a warm-up call."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    call()
    torch.cuda.synchronize()
    s.record()
    for _ in range(3):
        call()
    e.record()
    torch.cuda.synchronize()
    return max(s.elapsed_time(e) / 3 / 1000, 1e-6)


def _launch_until_two_edges(
    torch: Any, call: Callable[[], Any], poller: _CounterPoller, *, stride: int, depth: int, window_s: float, lead_in_s: float, max_s: float
) -> tuple[tuple[float, int] | None, tuple[float, int] | None, int]:
    """Enqueue ``call`` back to back while ``poller`` watches the counter, until two counter updates
    at least ``window_s`` apart (the first after ``lead_in_s``), ``max_s`` or a read error.

    Returns the two edges ``(time, mJ)`` (``None`` where not seen) and the number of calls enqueued.
    """
    ring: deque[Any] = deque()
    t_begin = time.perf_counter()
    poller.start()
    edge0: tuple[float, int] | None = None
    edge1: tuple[float, int] | None = None
    n = 0
    try:
        while True:
            call()
            n += 1
            if n % stride:
                continue
            ev = torch.cuda.Event()
            ev.record()
            ring.append(ev)
            while len(ring) > depth:
                if ring[0].query():
                    ring.popleft()
            ch = poller.changes
            if edge0 is None:
                edge0 = next((c for c in ch if c[0] - t_begin >= lead_in_s), None)
            if edge0 is not None:
                edge1 = next((c for c in ch if c[0] - edge0[0] >= window_s), None)
                if edge1 is not None:
                    break
            if time.perf_counter() - t_begin > max_s or poller.error is not None:
                break
    finally:
        poller.stop_evt.set()
        poller.join()
    return edge0, edge1, n


def busy_window(
    call: Callable[[], Any],
    window_s: float,
    gpu: NvmlGpu,
    *,
    poll_s: float = 0.001,
    lead_in_s: float = 0.05,
    queue_s: float = 0.005,
    max_s: float | None = None,
) -> Window:
    """Run ``call`` back to back on the current CUDA device and measure time and energy per call.

    Args:
        call: enqueues one call (asynchronous CUDA work; its result is discarded).
        window_s: minimum energy window in s, between two counter updates (>= 1 s recommended).
        gpu: the device (read-only calls only).
        poll_s: pause between counter reads in the poller thread (s).
        lead_in_s: busy time before the first edge may be taken (power ramp), s.
        queue_s: GPU work kept queued ahead of the host (s), so that host time tracks GPU time.
        max_s: give up waiting for counter updates after this long (default ``window_s + 1``).

    Returns:
        A measured :class:`Window`: ``j_per_call`` = average power between the two counter updates
        x time per call (CUDA events over the whole loop).

    Raises:
        RuntimeError: the counter did not advance twice within ``max_s`` (no energy reading).
    """
    import torch

    per_call_s = _time_per_call_s(torch, call)
    # An event every ~0.5 ms of work (not every call: recording costs host time on tiny calls), and
    # enough of them in flight that the GPU never waits for the host.
    stride = max(1, int(0.0005 / per_call_s))
    depth = max(2, int(queue_s / (stride * per_call_s)) + 1)
    max_s = window_s + 1.0 if max_s is None else max_s

    poller = _CounterPoller(gpu.total_energy_mj, poll_s)
    start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_evt.record()
    edge0, edge1, n = _launch_until_two_edges(
        torch, call, poller, stride=stride, depth=depth, window_s=window_s, lead_in_s=lead_in_s, max_s=max_s
    )
    end_evt.record()
    torch.cuda.synchronize()
    if poller.error is not None:
        raise RuntimeError(f"NVML energy read failed: {poller.error}")
    if edge0 is None or edge1 is None:
        raise RuntimeError(f"NVML energy counter did not advance twice within {max_s:.1f} s")
    ms = start_evt.elapsed_time(end_evt) / n
    dt = edge1[0] - edge0[0]
    power = (edge1[1] - edge0[1]) / 1000.0 / dt
    try:
        clock = gpu.sm_clock_mhz()
    except GpuError:
        clock = None
    return Window(
        ms_per_call=ms, j_per_call=power * ms / 1000.0, window_s=dt, calls=n, power_w=power, sm_clock_mhz=clock, source="measured"
    )


def timed_window(call: Callable[[], Any], window_s: float, sync: Callable[[], None] | None = None) -> tuple[float, int]:
    """``(ms per call, calls)`` of ``call`` repeated for at least ``window_s`` s (wall clock; CPU or GPU)."""
    sync = sync or (lambda: None)
    t0 = time.perf_counter()
    call()
    sync()
    first = time.perf_counter() - t0
    if first >= window_s:  # one call already fills the window (large shapes on a CPU): use it
        return first * 1000.0, 1
    n = 0
    t0 = time.perf_counter()
    while True:
        call()
        n += 1
        if n % 4 == 0 or n < 4:
            sync()
            el = time.perf_counter() - t0
            if el >= window_s:
                return el * 1000.0 / n, n


def simulated_kernels(kernels: list[tuple[float, float]], sm_clock_mhz: float | None = None, spec: GpuSpec = H200) -> tuple[float, float]:
    """``(seconds, joules)`` a simulated GPU spends on a sequence of kernels. Simulated.

    Args:
        kernels: ``(FLOPs, bytes moved to/from HBM)`` per kernel launch.
        sm_clock_mhz: requested SM clock (MHz); default: the boost clock (driver default).
        spec: the simulated GPU (default: the H200 model of ``vllm_powersave.sim.gpu``).
    """
    kspec = dataclasses.replace(spec, t_fixed_s=SIM_KERNEL_OVERHEAD_S)
    f = spec.f_max_mhz if sm_clock_mhz is None else sm_clock_mhz
    t = j = 0.0
    for flops, nbytes in kernels:
        r = simulate_step(kspec, StepWork(flops=flops, bytes=nbytes), f)
        t += r.time_s
        j += r.energy_j
    return t, j
