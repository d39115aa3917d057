"""GPU facts for a device record, read through the plugin's device layer (never NVML directly). Read-only."""

from __future__ import annotations

from typing import Any

from vllm_powersave.device import GpuError, NvmlGpu, driver_version


def device_facts(index: int = 0) -> dict[str, Any]:
    """Name, UUID, driver and power limit of GPU ``index``; ``{"name": "no NVML (...)"}`` without NVML."""
    try:
        gpu = NvmlGpu.from_index(index)
        return {"name": gpu.name(), "uuid": gpu.uuid, "driver": driver_version(gpu.nvml), "power_limit_w": gpu.power_limit_w()}
    except GpuError as exc:
        return {"name": f"no NVML ({exc})"}
