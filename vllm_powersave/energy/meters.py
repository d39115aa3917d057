"""Energy meters: NVML's total-energy counter (measured) or the simulated GPU (simulated).

Both expose the same small interface, so the per-phase accounting and the metrics do not care which
one runs; ``source`` ("measured" / "simulated") travels with every figure.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Any

from ..sim.gpu import SimulatedGpu

log = logging.getLogger("vllm.powersave.energy")


class EnergyMeter(ABC):
    """Cumulative energy of one GPU since the meter was created."""

    source: str = "measured"
    gpu_id: str = "0"

    @abstractmethod
    def energy_j(self) -> float:
        """Joules since the meter started; never decreases."""

    @abstractmethod
    def power_w(self) -> float | None:
        """Instant power in W, or ``None`` where unavailable."""

    @abstractmethod
    def sm_clock_mhz(self) -> int | None:
        """Current SM clock in MHz, or ``None`` where unavailable."""

    def extra(self) -> dict[str, float | int | None]:
        """Read-only device state: temperature (°C), memory clock (MHz), clock-event reasons (bitmask)."""
        return {}

    def on_idle(self, seconds: float) -> None:  # noqa: B027 - optional hook
        """Told that the engine was idle for ``seconds``; only a simulated meter needs this."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class NvmlEnergyMeter(EnergyMeter):
    """Reads ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver load; updates every 100 ms).

    A counter that goes backwards (driver reload) is reported in ``resets`` and contributes no
    energy for that interval instead of a negative or absurd value. NVML faults are logged once and
    leave the last good value in place: metering must never take the server down.

    Args:
        nvml: the ``pynvml`` module, or a fake with the same functions (tests).
        handle: NVML device handle.
        gpu_id: label for metrics (UUID or index).
    """

    source = "measured"

    def __init__(self, nvml: Any, handle: Any, gpu_id: str = "0") -> None:
        self.nvml = nvml
        self.handle = handle
        self.gpu_id = gpu_id
        self._lock = threading.Lock()
        self._last_mj = int(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        self._total_mj = 0
        self.resets = 0
        self.faults = 0

    def energy_j(self) -> float:
        with self._lock:
            try:
                now = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
            except Exception as exc:
                self.faults += 1
                if self.faults == 1:
                    log.error("powersave: NVML energy read failed (%s); keeping the last value", exc)
                return self._total_mj / 1000.0
            if now < self._last_mj:
                self.resets += 1
                log.warning("powersave: NVML energy counter went backwards (%d -> %d mJ): reset; interval dropped", self._last_mj, now)
            else:
                self._total_mj += now - self._last_mj
            self._last_mj = now
            return self._total_mj / 1000.0

    def power_w(self) -> float | None:
        try:
            return self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
        except Exception:
            return None

    def sm_clock_mhz(self) -> int | None:
        try:
            return int(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
        except Exception:
            return None

    def extra(self) -> dict[str, float | int | None]:
        n, h, out = self.nvml, self.handle, {}
        for key, fn in (("temperature_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                        ("mem_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
                        # Named "throttle reasons" before NVML 12; same bitmask (0x4 = SW power cap).
                        ("clock_event_reasons", lambda: n.nvmlDeviceGetCurrentClocksEventReasons(h)
                         if hasattr(n, "nvmlDeviceGetCurrentClocksEventReasons") else n.nvmlDeviceGetCurrentClocksThrottleReasons(h))):
            try:
                out[key] = int(fn())
            except Exception:
                out[key] = None
        return out


class SimulatedEnergyMeter(EnergyMeter):
    """Energy of a :class:`SimulatedGpu`. Every figure is simulated."""

    source = "simulated"

    def __init__(self, gpu: SimulatedGpu, gpu_id: str = "sim0", shadow: SimulatedGpu | None = None) -> None:
        self.gpu = gpu
        self.gpu_id = gpu_id
        #: Optional twin at stock clocks fed the same steps and idle time: the counterfactual
        #: "these exact steps without the presets", free of run-to-run batching noise.
        self.shadow = shadow
        self._start = gpu.energy_j

    def energy_j(self) -> float:
        return self.gpu.energy_j - self._start

    def power_w(self) -> float | None:
        return self.gpu.last_power_w

    def on_idle(self, seconds: float) -> None:
        self.gpu.idle(seconds)
        if self.shadow is not None:
            self.shadow.idle(seconds)

    def sm_clock_mhz(self) -> int | None:
        return self.gpu.sm_clock_mhz


def nvml_handle_for_torch_device(nvml: Any, device_index: int) -> tuple[Any, str]:
    """NVML handle and UUID of torch's CUDA device ``device_index``.

    NVML enumerates all GPUs and ignores ``CUDA_VISIBLE_DEVICES``; torch's index is relative to it.
    Matching by UUID is the one mapping that is right under any visibility mask or MIG.
    """
    import torch

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    nvml_uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    return nvml.nvmlDeviceGetHandleByUUID(nvml_uuid), nvml_uuid
