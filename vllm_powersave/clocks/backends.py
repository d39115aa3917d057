"""Clock backends: one small interface, three implementations (real NVML, dry-run, simulated).

The controller only ever talks to :class:`ClockBackend`; which backend runs is a setting. The NVML
backend is the only code in the project that calls an NVML setter.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..sim.gpu import SimulatedGpu

log = logging.getLogger("vllm.powersave.clocks")


class ClockError(RuntimeError):
    """A clock call failed for a reason other than permission (NVML fault, unsupported GPU)."""


class ClockPermissionError(ClockError):
    """The process may not change clocks (needs root or CAP_SYS_ADMIN)."""


@dataclass(frozen=True)
class ClockChange:
    """One applied (or, for dry-run, recorded) change. ``sm_clock_mhz=None`` means reset."""

    t_monotonic_s: float
    phase: str
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None


class ClockBackend(ABC):
    """Sets or resets the SM (and memory) clock of one GPU."""

    #: "real", "dry-run" or "simulated": shown in every metric and log line about clocks.
    kind: str = "real"

    @abstractmethod
    def supported_sm_clocks(self) -> tuple[int, ...]:
        """Supported SM clocks in MHz, ascending."""

    @abstractmethod
    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        """Lock the SM clock (MHz) and optionally the memory clock.

        Raises:
            ClockPermissionError: no privilege to change clocks.
            ClockError: any other failure.
        """

    @abstractmethod
    def reset(self) -> None:
        """Return to the driver's default clock management. Idempotent."""

    def snap(self, mhz: int) -> int:
        """The highest supported SM clock not above ``mhz`` (the lowest if none is)."""
        clocks = self.supported_sm_clocks()
        below = [c for c in clocks if c <= mhz]
        return below[-1] if below else clocks[0]


class DryRunClockBackend(ClockBackend):
    """Records what it would set; never calls a setter. The default, and forced on shared GPUs."""

    kind = "dry-run"

    def __init__(self, supported: tuple[int, ...] | None = None) -> None:
        self._supported = tuple(sorted(supported)) if supported else tuple(range(345, 1981, 15))
        self.calls: deque[tuple[str, int | None, int | None]] = deque(maxlen=4096)

    def supported_sm_clocks(self) -> tuple[int, ...]:
        return self._supported

    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        self.calls.append(("set", sm_clock_mhz, mem_clock_mhz))

    def reset(self) -> None:
        self.calls.append(("reset", None, None))


class SimulatedClockBackend(ClockBackend):
    """Drives a :class:`SimulatedGpu`; its effects on time and energy are simulated."""

    kind = "simulated"

    def __init__(self, gpu: SimulatedGpu) -> None:
        self.gpu = gpu

    def supported_sm_clocks(self) -> tuple[int, ...]:
        return self.gpu.spec.sm_clocks_mhz

    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        self.gpu.set_sm_clock(sm_clock_mhz)

    def reset(self) -> None:
        self.gpu.set_sm_clock(None)


class NvmlClockBackend(ClockBackend):
    """Locks SM clocks with ``nvmlDeviceSetGpuLockedClocks`` (min = max = target).

    ``nvml`` is the ``pynvml`` module (nvidia-ml-py) or a fake with the same functions (tests).
    """

    kind = "real"

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self._supported: tuple[int, ...] | None = None
        self.locked = False

    def _call(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.nvml, fn_name)
        try:
            return fn(self.handle, *args)
        except Exception as exc:  # pynvml raises NVMLError subclasses; map them to ours
            code = getattr(exc, "value", None)
            if code == getattr(self.nvml, "NVML_ERROR_NO_PERMISSION", 4):
                raise ClockPermissionError(f"{fn_name}: no permission (needs root or CAP_SYS_ADMIN)") from exc
            raise ClockError(f"{fn_name}: {exc}") from exc

    def supported_sm_clocks(self) -> tuple[int, ...]:
        if self._supported is None:
            mems = self._call("nvmlDeviceGetSupportedMemoryClocks")
            sm: set[int] = set()
            for m in mems:
                sm.update(int(c) for c in self._call("nvmlDeviceGetSupportedGraphicsClocks", m))
            self._supported = tuple(sorted(sm))
        return self._supported

    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        self._call("nvmlDeviceSetGpuLockedClocks", int(sm_clock_mhz), int(sm_clock_mhz))
        self.locked = True
        if mem_clock_mhz is not None:
            self._call("nvmlDeviceSetMemoryLockedClocks", int(mem_clock_mhz), int(mem_clock_mhz))

    def reset(self) -> None:
        self._call("nvmlDeviceResetGpuLockedClocks")
        try:
            self._call("nvmlDeviceResetMemoryLockedClocks")
        except ClockError:
            pass  # many GPUs (the H200 among them) do not support memory locks at all
        self.locked = False


def now() -> float:
    return time.monotonic()
