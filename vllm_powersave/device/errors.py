"""Typed GPU errors: every NVML return code (and every zeusd refusal) mapped once, here.

Callers catch by meaning, never by number: :class:`GpuNotSupportedError` is a capability of the
device (remember it, no warning), :class:`GpuNoPermissionError` means "may not" (fall back to
dry-run), :class:`GpuLostError` and the rest are faults. The table follows Zeus's
``NVIDIAGPU._exception_map`` (``zeus/device/gpu/nvidia.py``), folded into fewer classes because
this package only ever branches on these few meanings.
"""

from __future__ import annotations

#: NVML return codes (``nvml.h``; nvidia-ml-py exposes the same values as ``NVML_ERROR_*``). Kept
#: here so that no module needs pynvml imported to name one.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_UNKNOWN = 999


class GpuError(RuntimeError):
    """A GPU call failed. ``code``: the NVML return code, where there was one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class GpuNotSupportedError(GpuError):
    """The device or driver lacks this call or reading (a capability, not a fault)."""


class GpuMigError(GpuNotSupportedError):
    """Refused on a MIG device: its parent GPU is shared with other MIG instances."""


class GpuNoPermissionError(GpuError):
    """This process may not do this (no root/CAP_SYS_ADMIN; a daemon refused or is unreachable)."""


class GpuLostError(GpuError):
    """The GPU fell off the bus or needs a reset before it answers again."""


class GpuUnavailableError(GpuError):
    """NVML cannot be used at all: not installed, no driver, library mismatch, not initialised."""


class GpuNotFoundError(GpuError):
    """No such device (UUID, index or PCI address)."""


class GpuInvalidArgumentError(GpuError):
    """NVML rejected an argument (e.g. a clock the GPU does not support)."""


class GpuUnknownError(GpuError):
    """Any other NVML failure (``NVML_ERROR_UNKNOWN`` and codes without a class of their own)."""


#: NVML return code -> exception class. Codes not listed map to :class:`GpuUnknownError`.
NVML_ERROR_CLASSES: dict[int, type[GpuError]] = {
    NVML_ERROR_NOT_SUPPORTED: GpuNotSupportedError,
    NVML_ERROR_FUNCTION_NOT_FOUND: GpuNotSupportedError,  # this driver's NVML lacks the function
    NVML_ERROR_NO_PERMISSION: GpuNoPermissionError,
    NVML_ERROR_GPU_IS_LOST: GpuLostError,
    NVML_ERROR_RESET_REQUIRED: GpuLostError,
    NVML_ERROR_UNINITIALIZED: GpuUnavailableError,
    NVML_ERROR_DRIVER_NOT_LOADED: GpuUnavailableError,
    NVML_ERROR_LIBRARY_NOT_FOUND: GpuUnavailableError,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: GpuUnavailableError,
    NVML_ERROR_NOT_FOUND: GpuNotFoundError,
    NVML_ERROR_GPU_NOT_FOUND: GpuNotFoundError,
    NVML_ERROR_INVALID_ARGUMENT: GpuInvalidArgumentError,
    NVML_ERROR_FREQ_NOT_SUPPORTED: GpuInvalidArgumentError,
    NVML_ERROR_UNKNOWN: GpuUnknownError,
}


def nvml_error_code(exc: BaseException) -> int | None:
    """NVML return code of an ``NVMLError`` (its ``value``), of a :class:`GpuError`, else ``None``."""
    if isinstance(exc, GpuError):
        return exc.code
    v = getattr(exc, "value", None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def map_nvml_error(exc: BaseException, what: str = "") -> GpuError:
    """The typed exception for ``exc`` (an ``NVMLError`` or anything a fake raises).

    A :class:`GpuError` is returned as it is; an exception without an NVML code (a fake, a ctypes
    failure) becomes :class:`GpuUnknownError`. ``what`` names the call in the message.
    """
    if isinstance(exc, GpuError):
        return exc
    code = nvml_error_code(exc)
    cls = NVML_ERROR_CLASSES.get(code, GpuUnknownError) if code is not None else GpuUnknownError
    return cls(f"{what}: {exc}" if what else str(exc), code)
