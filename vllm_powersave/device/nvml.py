"""One NVIDIA GPU behind one typed class: :class:`NvmlGpu`. The only module that imports pynvml.

Every NVML call goes through :meth:`NvmlGpu._call`, which maps NVML errors to the typed exceptions
of :mod:`.errors`; units are in the method names (``_mj``, ``_j``, ``_w``, ``_mhz``, ``_c``).
A device is resolved once (:meth:`NvmlGpu.for_torch_device` by UUID, honouring
``CUDA_VISIBLE_DEVICES``) and the handle kept.

MIG: a MIG device's handle answers few NVML queries, and the ones that concern the chip (clocks,
temperature, power, energy) are the parent GPU's, which other MIG instances share. So
:meth:`NvmlGpu.parent` resolves the parent; read-only clock and temperature readings come from it;
energy and power of a MIG device raise :class:`~.errors.GpuMigError` (the caller decides whether a
whole-GPU figure is what it wants, via ``parent()``); clock setters refuse (never lock a shared
parent's clocks).
"""

from __future__ import annotations

import logging
from typing import Any

from .. import envs
from .errors import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_SUCCESS,
    GpuError,
    GpuMigError,
    GpuNotSupportedError,
    GpuUnavailableError,
    map_nvml_error,
)

log = logging.getLogger("vllm.powersave.device")

NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0
NVML_FI_DEV_POWER_INSTANT = 186

#: Bits of NVML's clocks-event-reasons mask (``nvmlClocksEventReason*`` in nvml.h; named
#: "throttle reasons" before NVML 12, same values), in bit order, as snake_case names.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def decode_clock_event_reasons(mask: int) -> list[str]:
    """Names of the bits set in an NVML clocks-event-reasons mask, in bit order.

    Bits this table does not know (a newer driver) appear as ``unknown_0x...``; ``0`` gives ``[]``.
    """
    mask = int(mask)
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENT_REASONS)
    bit = 1
    while rest >= bit:
        if rest & bit:
            names.append(f"unknown_{bit:#x}")
        bit <<= 1
    return names


def init_nvml(nvml: Any = None) -> Any:
    """The initialised NVML binding: ``pynvml`` (nvidia-ml-py), imported and ``nvmlInit``-ed here.

    ``nvml``: an already initialised binding or a fake with the same functions (tests); returned
    as it is. NVML counts its initialisations, so calling this again is harmless.

    Raises:
        GpuUnavailableError: pynvml is not installed or ``nvmlInit`` failed (no driver, ...).
    """
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError as exc:
        raise GpuUnavailableError(f"pynvml not installed (nvidia-ml-py): {exc}") from exc
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        err = map_nvml_error(exc, "nvmlInit")
        raise GpuUnavailableError(str(err), err.code) from exc
    return pynvml


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _module_call(nvml: Any, name: str, *args: Any) -> Any:
    fn = getattr(nvml, name, None)
    if fn is None:
        raise GpuNotSupportedError(f"{name}: not in this NVML binding", NVML_ERROR_FUNCTION_NOT_FOUND)
    try:
        return fn(*args)
    except Exception as exc:
        raise map_nvml_error(exc, name) from exc


def driver_version(nvml: Any = None) -> str:
    """The NVIDIA driver version. Raises a :class:`~.errors.GpuError`."""
    return _text(_module_call(init_nvml(nvml), "nvmlSystemGetDriverVersion"))


def device_count(nvml: Any = None) -> int:
    """GPUs NVML sees (all of them: NVML ignores ``CUDA_VISIBLE_DEVICES``)."""
    return int(_module_call(init_nvml(nvml), "nvmlDeviceGetCount"))


def resolve_nvml_device(nvml: Any, device_index: int, torch_uuid: str | None = None, visible: str | None = None) -> tuple[Any, str]:
    """NVML handle and UUID of the CUDA device ``device_index`` of this process.

    NVML enumerates all GPUs and ignores ``CUDA_VISIBLE_DEVICES``; CUDA's (and torch's) index is
    relative to it. Order of evidence:

    1. ``torch_uuid`` (``torch.cuda.get_device_properties(i).uuid``): exact under any mask and MIG;
    2. entry ``device_index`` of ``visible`` (``CUDA_VISIBLE_DEVICES``): a UUID (``GPU-...``,
       ``MIG-...``, or a unique prefix of one, as CUDA accepts) or an NVML index (valid with
       ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which NVML's order is);
    3. no mask: ``device_index`` itself as the NVML index.

    Raises:
        ValueError: the mask has no entry ``device_index``, or a UUID prefix matches no or several GPUs.
        GpuError: a failed NVML lookup (typed).
    """

    def by_uuid(uuid: str) -> tuple[Any, str]:
        try:
            return _module_call(nvml, "nvmlDeviceGetHandleByUUID", uuid), uuid
        except GpuError:
            # CUDA accepts unique UUID prefixes in CUDA_VISIBLE_DEVICES; NVML wants the full UUID.
            matches = []
            for i in range(int(_module_call(nvml, "nvmlDeviceGetCount"))):
                h = _module_call(nvml, "nvmlDeviceGetHandleByIndex", i)
                full = _text(_module_call(nvml, "nvmlDeviceGetUUID", h))
                if full.startswith(uuid):
                    matches.append((h, full))
            if len(matches) != 1:
                raise ValueError(f"CUDA_VISIBLE_DEVICES entry {uuid!r} matches {len(matches)} NVML devices") from None
            return matches[0]

    if torch_uuid:
        u = str(torch_uuid)
        return by_uuid(u if u.startswith(("GPU-", "MIG-")) else f"GPU-{u}")
    if visible is not None and visible.strip() != "":
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if device_index >= len(entries):
            raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} has no entry {device_index}")
        e = entries[device_index]
        if not e.lstrip("-").isdigit():
            return by_uuid(e)
        idx = int(e)
    else:
        idx = device_index
    h = _module_call(nvml, "nvmlDeviceGetHandleByIndex", idx)
    return h, _text(_module_call(nvml, "nvmlDeviceGetUUID", h))


class NvmlGpu:
    """One GPU (or MIG device) seen through NVML; every method raises only :class:`~.errors.GpuError`.

    Build one with :meth:`for_torch_device`, :meth:`for_cuda_device`, :meth:`from_uuid` or
    :meth:`from_index`; the constructor takes a handle already resolved.

    Args:
        nvml: the initialised ``pynvml`` module, or a fake with the same functions (tests).
        handle: the NVML device handle.
        uuid: the device's UUID (``GPU-...`` or ``MIG-...``): its label in metrics and leases.
    """

    def __init__(self, nvml: Any, handle: Any, uuid: str = "0", *, is_mig: bool | None = None) -> None:
        self.nvml = nvml
        self.handle = handle
        self.uuid = uuid
        self._mig: bool | None = is_mig  # None: asked of NVML on first use
        self._parent: NvmlGpu | None = None
        self._supported_mem: tuple[int, ...] | None = None
        self._supported_sm: tuple[int, ...] | None = None
        self._instant_ok = True
        self._procs_failed = False  # the process list failed once (logged)

    def __repr__(self) -> str:
        return f"NvmlGpu({self.uuid!r})"

    # -- resolution ----------------------------------------------------------------------------
    @classmethod
    def from_uuid(cls, uuid: str, nvml: Any = None) -> NvmlGpu:
        """The GPU (or MIG device) with this UUID. Raises :class:`~.errors.GpuError`."""
        n = init_nvml(nvml)
        return cls(n, _module_call(n, "nvmlDeviceGetHandleByUUID", str(uuid)), str(uuid))

    @classmethod
    def from_index(cls, index: int, nvml: Any = None) -> NvmlGpu:
        """NVML's device ``index`` (NVML order, not CUDA's). Raises :class:`~.errors.GpuError`."""
        n = init_nvml(nvml)
        h = _module_call(n, "nvmlDeviceGetHandleByIndex", int(index))
        try:
            uuid = _text(_module_call(n, "nvmlDeviceGetUUID", h))
        except GpuNotSupportedError:
            uuid = str(index)
        return cls(n, h, uuid)

    @classmethod
    def for_cuda_device(cls, device_index: int, torch_uuid: str | None = None, visible: str | None = None, nvml: Any = None) -> NvmlGpu:
        """CUDA device ``device_index`` of this process (see :func:`resolve_nvml_device`)."""
        n = init_nvml(nvml)
        handle, uuid = resolve_nvml_device(n, device_index, torch_uuid, visible)
        return cls(n, handle, uuid)

    @classmethod
    def for_torch_device(cls, device_index: int, nvml: Any = None) -> NvmlGpu:
        """torch's CUDA device ``device_index``: by torch's UUID, else by ``$CUDA_VISIBLE_DEVICES``."""
        uuid = None
        try:
            import torch

            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        except Exception as exc:  # older torch without .uuid, or no CUDA here: the mask decides
            log.debug("powersave: torch device UUID unavailable (%s)", exc)
        return cls.for_cuda_device(device_index, uuid, envs.cuda_visible_devices(), nvml)

    # -- calls -----------------------------------------------------------------------------------
    def _call(self, name: str, *args: Any, handle: Any = None) -> Any:
        """``nvml.<name>(handle, *args)`` with NVML errors mapped to :class:`~.errors.GpuError`."""
        fn = getattr(self.nvml, name, None)
        if fn is None:
            raise GpuNotSupportedError(f"{name}: not in this NVML binding", NVML_ERROR_FUNCTION_NOT_FOUND)
        try:
            return fn(self.handle if handle is None else handle, *args)
        except Exception as exc:
            raise map_nvml_error(exc, name) from exc

    def _const(self, name: str, default: int) -> int:
        return int(getattr(self.nvml, name, default))

    def _chip(self) -> Any:
        """Handle for chip-wide readings: the parent's on a MIG device."""
        return self.parent().handle if self.is_mig() else self.handle

    def _refuse_on_mig(self, what: str) -> None:
        if self.is_mig():
            raise GpuMigError(
                f"{what}: {self.uuid} is a MIG device; its parent GPU {self.parent().uuid} is shared "
                "with other MIG instances, so its clocks are never changed from here"
            )

    # -- identity --------------------------------------------------------------------------------
    def name(self) -> str:
        return _text(self._call("nvmlDeviceGetName"))

    def pci_bus_id(self) -> str:
        """PCI bus id (``00000000:41:00.0``) of the GPU (the parent's on a MIG device)."""
        return _text(self._call("nvmlDeviceGetPciInfo", handle=self._chip()).busId)

    def is_mig(self) -> bool:
        """Whether this is a MIG device (decided once: by its UUID or by NVML)."""
        if self._mig is None:
            mig = self.uuid.startswith("MIG-")
            if not mig and hasattr(self.nvml, "nvmlDeviceIsMigDeviceHandle"):
                try:
                    mig = bool(self._call("nvmlDeviceIsMigDeviceHandle"))
                except GpuError:  # drivers before MIG (pre-R450) or GPUs without it: not MIG
                    mig = False
            self._mig = mig
        return self._mig

    def parent(self) -> NvmlGpu:
        """The physical GPU: itself, or a MIG device's parent (resolved once)."""
        if not self.is_mig():
            return self
        if self._parent is None:
            h = self._call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
            self._parent = NvmlGpu(self.nvml, h, _text(self._call("nvmlDeviceGetUUID", handle=h)), is_mig=False)
        return self._parent

    # -- energy and power --------------------------------------------------------------------------
    def total_energy_mj(self) -> int:
        """NVML's total-energy counter (mJ since the driver loaded; Volta and newer)."""
        if self.is_mig():
            raise GpuMigError(
                f"energy: {self.uuid} is a MIG device; NVML counts energy for the whole GPU "
                f"{self.parent().uuid} only (use parent() for the whole GPU)"
            )
        return int(self._call("nvmlDeviceGetTotalEnergyConsumption"))

    def total_energy_j(self) -> float:
        return self.total_energy_mj() / 1000.0

    def instant_power_w(self) -> float:
        """``NVML_FI_DEV_POWER_INSTANT`` (W). :class:`~.errors.GpuNotSupportedError` where the driver lacks it."""
        self._refuse_power_on_mig()
        fid = self._const("NVML_FI_DEV_POWER_INSTANT", NVML_FI_DEV_POWER_INSTANT)
        v = self._call("nvmlDeviceGetFieldValues", [fid])[0]
        ret = int(v.nvmlReturn)
        if ret != NVML_SUCCESS:
            raise _field_error(ret, fid)
        return float(v.value.uiVal) / 1000.0

    def average_power_w(self) -> float:
        """``nvmlDeviceGetPowerUsage`` (W): a 1 s average on Ampere and newer (NVML docs)."""
        self._refuse_power_on_mig()
        return float(self._call("nvmlDeviceGetPowerUsage")) / 1000.0

    def power_w(self) -> float:
        """Instant power where the driver has it (as Zeus reads it), else the 1 s average, W.

        A missing instant field is remembered; other failures of the field fall back to the average
        for this reading. Raises the average's error where neither answers.
        """
        if self._instant_ok:
            try:
                return self.instant_power_w()
            except GpuMigError:
                raise
            except GpuNotSupportedError:
                self._instant_ok = False
            except GpuError as exc:
                log.debug("powersave: instant power of %s failed (%s); reading the average", self.uuid, exc)
        return self.average_power_w()

    def _refuse_power_on_mig(self) -> None:
        if self.is_mig():
            raise GpuMigError(
                f"power: {self.uuid} is a MIG device; NVML reports power for the whole GPU "
                f"{self.parent().uuid} only (use parent() for the whole GPU)"
            )

    def power_limit_w(self) -> float:
        """The enforced power limit, W (the parent's on a MIG device)."""
        return float(self._call("nvmlDeviceGetEnforcedPowerLimit", handle=self._chip())) / 1000.0

    # -- clocks and state (read-only) ----------------------------------------------------------------
    def sm_clock_mhz(self) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", self._const("NVML_CLOCK_SM", NVML_CLOCK_SM), handle=self._chip()))

    def memory_used_bytes(self) -> int:
        """Device memory in use by every process on this GPU (``nvmlDeviceGetMemoryInfo``; on a MIG
        device, that instance's)."""
        return int(self._call("nvmlDeviceGetMemoryInfo").used)

    def utilization_gpu_pct(self) -> int:
        """Share of the last sample period in which a kernel ran (NVML's coarse GPU utilisation, %)."""
        return int(self._call("nvmlDeviceGetUtilizationRates", handle=self._chip()).gpu)

    def mem_clock_mhz(self) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", self._const("NVML_CLOCK_MEM", NVML_CLOCK_MEM), handle=self._chip()))

    def temperature_c(self) -> int:
        return int(self._call("nvmlDeviceGetTemperature", self._const("NVML_TEMPERATURE_GPU", NVML_TEMPERATURE_GPU), handle=self._chip()))

    def other_compute_processes(self, own_pids: frozenset[int]) -> int | None:
        """How many compute processes other than ``own_pids`` hold a context on this GPU
        (``nvmlDeviceGetComputeRunningProcesses``; visible without privilege, NVML API reference,
        "Device Queries"), or ``None`` where NVML cannot say: the call missing from the binding or
        the driver, any NVML error, or none of ``own_pids`` in the list (a PID namespace, as in a
        container, where NVML lists host pids: every process would look like another's). Never
        raises; the first failure is logged at debug."""
        try:
            procs = self._call("nvmlDeviceGetComputeRunningProcesses")
            pids = {int(p.pid) for p in procs}
        except Exception as exc:
            if not self._procs_failed:
                self._procs_failed = True
                log.debug("powersave: NVML process list unavailable on %s (%s): co-tenants unknown", self.uuid, exc)
            return None
        if not pids & own_pids:
            return None
        return len(pids - own_pids)

    def clock_event_reasons_mask(self) -> int:
        """NVML's clocks-event-reasons bitmask (see :data:`CLOCK_EVENT_REASONS`)."""
        if hasattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons"):
            return int(self._call("nvmlDeviceGetCurrentClocksEventReasons", handle=self._chip()))
        return int(self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle=self._chip()))  # before NVML 12

    def clock_event_reasons(self) -> list[str]:
        """Why the clocks are below their maximum now, by name (e.g. ``["sw_power_cap"]``)."""
        return decode_clock_event_reasons(self.clock_event_reasons_mask())

    def supported_mem_clocks_mhz(self) -> tuple[int, ...]:
        """Supported memory clocks, MHz, ascending (read once)."""
        if self._supported_mem is None:
            self._supported_mem = tuple(sorted(int(m) for m in self._call("nvmlDeviceGetSupportedMemoryClocks", handle=self._chip())))
        return self._supported_mem

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks over all memory clocks, MHz, ascending (read once)."""
        if self._supported_sm is None:
            sm: set[int] = set()
            for m in self.supported_mem_clocks_mhz():
                sm.update(int(c) for c in self._call("nvmlDeviceGetSupportedGraphicsClocks", m, handle=self._chip()))
            self._supported_sm = tuple(sorted(sm))
        return self._supported_sm

    # -- clock setters (root or CAP_SYS_ADMIN; refused on MIG) -----------------------------------------
    def lock_sm_clocks_mhz(self, lo_mhz: int, hi_mhz: int) -> None:
        """``nvmlDeviceSetGpuLockedClocks``. :class:`~.errors.GpuMigError` on a MIG device."""
        self._refuse_on_mig("lock SM clocks")
        self._call("nvmlDeviceSetGpuLockedClocks", int(lo_mhz), int(hi_mhz))

    def reset_sm_clocks(self) -> None:
        """``nvmlDeviceResetGpuLockedClocks``. :class:`~.errors.GpuMigError` on a MIG device."""
        self._refuse_on_mig("reset SM clocks")
        self._call("nvmlDeviceResetGpuLockedClocks")

    def lock_mem_clocks_mhz(self, lo_mhz: int, hi_mhz: int) -> None:
        """``nvmlDeviceSetMemoryLockedClocks`` (NotSupported on the H200)."""
        self._refuse_on_mig("lock memory clocks")
        self._call("nvmlDeviceSetMemoryLockedClocks", int(lo_mhz), int(hi_mhz))

    def reset_mem_clocks(self) -> None:
        self._refuse_on_mig("reset memory clocks")
        self._call("nvmlDeviceResetMemoryLockedClocks")


def _field_error(ret: int, fid: int) -> GpuError:
    class _Ret(Exception):
        value = ret

    return map_nvml_error(_Ret(f"field value {fid} returned NVML error {ret}"), "nvmlDeviceGetFieldValues")
