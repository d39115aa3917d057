"""The device layer: every NVML and zeusd call of the package goes through here.

* :class:`NvmlGpu` (``nvml.py``): one GPU or MIG device behind one typed class, resolved by UUID
  once, units in method names; the only module that imports ``pynvml`` (nvidia-ml-py).
* :mod:`.errors`: NVML return codes and zeusd refusals mapped once to typed exceptions, all
  subclasses of :class:`GpuError`.
* :class:`ZeusdClient` (``zeusd.py``): Zeus's privileged daemon, for clock locks without
  CAP_SYS_ADMIN and for energy reads from another host.

Modelled on Zeus (``zeus/device/gpu/nvidia.py``: one class per GPU, one exception map), without
depending on the ``zeus`` package: its ``NVIDIAGPU`` opens devices by NVML index only (no UUID or
``CUDA_VISIBLE_DEVICES`` UUID mapping), refuses MIG devices outright, and binds ``pynvml`` at
import (no fake NVML can be handed in, which the clock-safety tests need); its zeusd client is
discussed in ``zeusd.py``; and the package pulls numpy, pandas, scikit-learn and amdsmi into
every vLLM server. This layer has no dependency beyond nvidia-ml-py (imported lazily).
"""

from .errors import (
    NVML_ERROR_CLASSES,
    GpuError,
    GpuInvalidArgumentError,
    GpuLostError,
    GpuMigError,
    GpuNoPermissionError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuUnavailableError,
    GpuUnknownError,
    map_nvml_error,
    nvml_error_code,
)
from .nvml import (
    CLOCK_EVENT_REASONS,
    NvmlGpu,
    decode_clock_event_reasons,
    device_count,
    driver_version,
    init_nvml,
    resolve_nvml_device,
)
from .zeusd import ZeusdApiDisabledError, ZeusdClient, ZeusdError, ZeusdRefusedError, ZeusdUnreachableError

__all__ = [
    "CLOCK_EVENT_REASONS",
    "NVML_ERROR_CLASSES",
    "GpuError",
    "GpuInvalidArgumentError",
    "GpuLostError",
    "GpuMigError",
    "GpuNoPermissionError",
    "GpuNotFoundError",
    "GpuNotSupportedError",
    "GpuUnavailableError",
    "GpuUnknownError",
    "NvmlGpu",
    "ZeusdApiDisabledError",
    "ZeusdClient",
    "ZeusdError",
    "ZeusdRefusedError",
    "ZeusdUnreachableError",
    "decode_clock_event_reasons",
    "device_count",
    "driver_version",
    "init_nvml",
    "map_nvml_error",
    "nvml_error_code",
    "resolve_nvml_device",
]
