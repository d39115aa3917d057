"""SM clock control: backends (real NVML, dry-run, simulated) and the per-phase controller."""

from .backends import (
    ClockBackend,
    ClockChange,
    ClockError,
    ClockPermissionError,
    DryRunClockBackend,
    NvmlClockBackend,
    SimulatedClockBackend,
)
from .controller import ClockController
from .leases import LeaseStore, pid_alive

__all__ = [
    "ClockBackend",
    "ClockChange",
    "ClockController",
    "ClockError",
    "ClockPermissionError",
    "DryRunClockBackend",
    "LeaseStore",
    "NvmlClockBackend",
    "SimulatedClockBackend",
    "pid_alive",
]
