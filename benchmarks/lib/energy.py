"""GPU energy, power and SM-clock windows, read through the plugin's own NVML meters.

The figures come from :class:`vllm_powersave.energy.meters.NvmlEnergyMeter` (the total-energy
counter with interpolated window edges, ``docs/results/h200-energy-meter.md``), the same reads the
plugin publishes on ``/metrics``; this module never calls NVML itself. Read-only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from vllm_powersave.device import GpuError, NvmlGpu, driver_version
from vllm_powersave.energy.meters import EnergyMeter, NvmlEnergyMeter


def nvml_meters(indices: Sequence[int], nvml: Any = None) -> list[EnergyMeter]:
    """One counter meter per NVML index (PCI bus order); RuntimeError where NVML is unavailable.

    ``nvml``: an NVML module to use instead of nvidia-ml-py (tests pass a fake)."""
    try:
        return [NvmlEnergyMeter(NvmlGpu.from_index(i, nvml)) for i in indices]
    except GpuError as exc:
        raise RuntimeError(f"NVML unavailable ({exc})") from exc


def device_facts(index: int = 0) -> dict[str, Any]:
    """Name, UUID, driver and power limit of GPU ``index``; ``{"name": "no NVML (...)"}`` without NVML."""
    try:
        gpu = NvmlGpu.from_index(index)
        return {"name": gpu.name(), "uuid": gpu.uuid, "driver": driver_version(gpu.nvml), "power_limit_w": gpu.power_limit_w()}
    except GpuError as exc:
        return {"name": f"no NVML ({exc})"}


class EnergySampler(threading.Thread):
    """Samples ``(t, W, SM MHz, J)`` from ``meters`` every ``period_s`` in a thread; power and energy
    summed over the meters (a TP group), SM clock of the first; per-meter power kept."""

    def __init__(self, meters: Sequence[EnergyMeter], period_s: float = 0.1) -> None:
        super().__init__(daemon=True, name="bench-energy-sampler")
        self.meters, self.period_s = list(meters), period_s
        self.rows: list[tuple[float, float, int | None, float]] = []
        self.per_gpu_w: list[tuple[float, ...]] = []
        self.stop_ev = threading.Event()

    def sample(self) -> None:
        ws = [m.power_w() for m in self.meters]
        js = [m.energy_j() for m in self.meters]
        if any(x is None for x in (*ws, *js)):
            return  # a meter fault: no row rather than a partial one (the meter logged it)
        self.rows.append((time.monotonic(), sum(ws), self.meters[0].sm_clock_mhz(), sum(js)))
        self.per_gpu_w.append(tuple(ws))

    def run(self) -> None:
        while not self.stop_ev.wait(self.period_s):
            self.sample()

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Mean power, median SM clock and counter energy between ``t0`` and ``t1`` (monotonic s);
        empty with fewer than 2 samples."""
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        if len(rows) < 2:
            return {}
        clocks = sorted(r[2] for r in rows if r[2] is not None)
        return {
            "avg_power_w": sum(r[1] for r in rows) / len(rows),
            "energy_j_counter": rows[-1][3] - rows[0][3],
            "median_sm_clock_mhz": clocks[len(clocks) // 2] if clocks else None,
            "seconds": rows[-1][0] - rows[0][0],
        }


class NullSampler(EnergySampler):
    """No GPU (a CPU dry run of a device script): no samples, empty windows."""

    def __init__(self) -> None:
        super().__init__([])

    def run(self) -> None:
        return
