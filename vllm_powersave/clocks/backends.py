"""Clock backends: one small interface, four implementations (NVML, zeusd, dry-run, simulated).

The controller only ever talks to :class:`ClockBackend`; which backend runs is a setting. The NVML
backend drives :class:`~vllm_powersave.device.NvmlGpu` (the only code in the project that calls an
NVML setter); the zeusd backend asks Zeus's privileged daemon (https://ml.energy/zeus, ``zeusd``)
through :class:`~vllm_powersave.device.ZeusdClient` to call the same NVML setters for us. Both
translate the device layer's typed errors into the three below.

Errors: every backend raises :class:`ClockPermissionError` when clocks cannot be controlled at all
from this process (no privilege, GPU without locked clocks, daemon unreachable or refusing): the
controller then falls back to dry-run with one warning (so does a MIG device: its parent GPU is
shared, and its clocks are never locked from here). Any other failure is a
:class:`ClockError` (an NVML fault such as GpuIsLost or Unknown): the controller stops clock
control after one reset attempt and the server keeps serving.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any

from .. import envs
from ..device import GpuError, GpuNoPermissionError, GpuNotSupportedError, NvmlGpu, ZeusdClient, ZeusdError
from ..envs import ENV_ZEUSD_SOCK, ENV_ZEUSD_TOKEN  # noqa: F401 - re-exported; declared in envs.py
from ..sim.gpu import SimulatedGpu

log = logging.getLogger("vllm.powersave.clocks")


class ClockError(RuntimeError):
    """A clock call failed for a reason other than permission (NVML fault, daemon error)."""


class LeaseError(ClockError, ValueError):
    """A lease file names an unusable value (one line naming the field and value); nothing was reset."""


class ClockPermissionError(ClockError):
    """This process cannot change clocks (no root/CAP_SYS_ADMIN, daemon unreachable or refusing)."""


class ClockUnsupportedError(ClockPermissionError):
    """The GPU does not support locked clocks (NVML NotSupported): same fallback as no permission."""


@dataclass(frozen=True)
class ClockChange:
    """One applied (or, for dry-run, recorded) change. ``sm_clock_mhz=None`` means reset."""

    t_monotonic_s: float
    phase: str
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None


def _snap(clocks: tuple[int, ...], mhz: int) -> int:
    below = [c for c in clocks if c <= mhz]
    return below[-1] if below else clocks[0]


class ClockBackend(ABC):
    """Sets or resets the SM (and memory) clock of one GPU."""

    #: "real", "dry-run" or "simulated": shown in every metric and log line about clocks.
    kind: str = "real"

    @abstractmethod
    def supported_sm_clocks(self) -> tuple[int, ...]:
        """Supported SM clocks in MHz, ascending."""

    def supported_mem_clocks(self) -> tuple[int, ...]:
        """Supported memory clocks in MHz, ascending; ``()`` if unknown."""
        return ()

    @abstractmethod
    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        """Lock the SM clock (MHz) and optionally the memory clock (MHz).

        A GPU without memory locks (the H200) keeps its memory clock: one warning, no error.

        Raises:
            ClockPermissionError: clocks cannot be changed from this process.
            ClockError: any other failure.
        """

    @abstractmethod
    def reset(self) -> None:
        """Return to the driver's default clock management. Idempotent.

        Raises:
            ClockPermissionError, ClockError: the GPU may still be locked.
        """

    def read_sm_clock_mhz(self) -> int | None:
        """The SM clock the GPU runs now, read back (MHz), or ``None`` where it cannot be read.

        A read needs no privilege (``nvmlDeviceGetClockInfo``). The closed loop counts a step as
        run at a clock only once this read shows the clock (clocks/controller.py); a backend
        that cannot read never confirms a switch, so the loop turns off rather than trust it.
        """
        return None

    def snap(self, mhz: int) -> int:
        """The highest supported SM clock not above ``mhz`` (the lowest if none is)."""
        return _snap(self.supported_sm_clocks(), mhz)

    def snap_mem(self, mhz: int) -> int:
        """Like :meth:`snap` for the memory clock; unchanged if the list is unknown."""
        clocks = self.supported_mem_clocks()
        return _snap(clocks, mhz) if clocks else mhz

    def lease_info(self) -> dict[str, Any]:
        """What a lease must record so that another process can undo this backend's locks."""
        return {"backend": self.kind}

    def may_hold_lock(self) -> bool:
        """Whether a lock of ours may be in effect (a call that failed half-way counts)."""
        return False


class DryRunClockBackend(ClockBackend):
    """Records what it would set; never calls a setter. The default, and forced on shared GPUs."""

    kind = "dry-run"

    def __init__(self, supported: tuple[int, ...] | None = None) -> None:
        self._supported = tuple(sorted(supported)) if supported else tuple(range(345, 1981, 15))
        self.calls: deque[tuple[str, int | None, int | None]] = deque(maxlen=4096)
        self.recorded_mhz: int | None = None  # the clock last recorded (``None``: default)

    def supported_sm_clocks(self) -> tuple[int, ...]:
        return self._supported

    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        self.calls.append(("set", sm_clock_mhz, mem_clock_mhz))
        self.recorded_mhz = int(sm_clock_mhz)

    def reset(self) -> None:
        self.calls.append(("reset", None, None))
        self.recorded_mhz = None

    def read_sm_clock_mhz(self) -> int | None:
        """The clock last *recorded* (a prediction: nothing was applied; ``kind`` says dry-run),
        the supported maximum after a reset."""
        return self.recorded_mhz if self.recorded_mhz is not None else self._supported[-1]


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

    def read_sm_clock_mhz(self) -> int | None:
        """The simulated GPU's actual SM clock (simulated)."""
        return int(self.gpu.sm_clock_mhz)


def _clock_error(what: str, exc: GpuError) -> ClockError:
    """The device layer's typed error as this module's: refusals -> permission, capability -> unsupported."""
    if isinstance(exc, GpuNoPermissionError):
        return ClockPermissionError(f"{what}: no permission (needs root or CAP_SYS_ADMIN): {exc}")
    if isinstance(exc, GpuNotSupportedError):
        return ClockUnsupportedError(f"{what}: not supported: {exc}")
    return ClockError(f"{what}: {exc}")


class NvmlClockBackend(ClockBackend):
    """Locks clocks with ``nvmlDeviceSetGpuLockedClocks`` / ``SetMemoryLockedClocks`` (min = max).

    ``gpu``: the device (:class:`~vllm_powersave.device.NvmlGpu`); a MIG device refuses every setter
    (``GpuMigError``, a NotSupported: dry-run fallback). ``mem_may_be_locked``: a recovering process
    does not know whether the crashed one locked the memory clock, so it resets that too
    (NotSupported is ignored).
    """

    kind = "real"

    def __init__(self, gpu: NvmlGpu, mem_may_be_locked: bool = False) -> None:
        self.gpu = gpu
        self.locked = False
        self.mem_lock_supported: bool | None = None  # None: not tried yet
        self.mem_may_be_locked = mem_may_be_locked

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except GpuError as exc:
            raise _clock_error(what, exc) from exc

    def supported_mem_clocks(self) -> tuple[int, ...]:
        return self._call("supported memory clocks", self.gpu.supported_mem_clocks_mhz)

    def supported_sm_clocks(self) -> tuple[int, ...]:
        return self._call("supported SM clocks", self.gpu.supported_sm_clocks_mhz)

    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        self._call("nvmlDeviceSetGpuLockedClocks", self.gpu.lock_sm_clocks_mhz, int(sm_clock_mhz), int(sm_clock_mhz))
        self.locked = True
        if mem_clock_mhz is None or self.mem_lock_supported is False:
            return
        self.mem_may_be_locked = True  # pessimistic: a failing call may still have taken effect
        try:
            self._call("nvmlDeviceSetMemoryLockedClocks", self.gpu.lock_mem_clocks_mhz, int(mem_clock_mhz), int(mem_clock_mhz))
            self.mem_lock_supported = True
        except ClockUnsupportedError:
            self.mem_lock_supported = False
            self.mem_may_be_locked = False
            log.warning("powersave: this GPU does not support memory-clock locks; memory clock presets are ignored (SM clocks only)")

    def read_sm_clock_mhz(self) -> int | None:
        """``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``; ``None`` where the read fails."""
        try:
            return self.gpu.sm_clock_mhz()
        except GpuError:
            return None

    def reset(self) -> None:
        self._call("nvmlDeviceResetGpuLockedClocks", self.gpu.reset_sm_clocks)
        self.locked = False
        if not self.mem_may_be_locked:
            return
        try:
            self._call("nvmlDeviceResetMemoryLockedClocks", self.gpu.reset_mem_clocks)
        except ClockUnsupportedError:
            if self.mem_lock_supported:
                raise  # we did lock the memory clock: "not supported" now cannot mean "not locked"
            # Many GPUs (the H200 among them) have no memory locks at all.
        self.mem_may_be_locked = False

    def lease_info(self) -> dict[str, Any]:
        return {"backend": "nvml", "mem_locked": bool(self.mem_may_be_locked)}

    def may_hold_lock(self) -> bool:
        return self.locked or self.mem_may_be_locked


class ZeusdClockBackend(ClockBackend):
    """Locks clocks through Zeus's privileged daemon ``zeusd`` (:class:`~vllm_powersave.device.ZeusdClient`).

    For servers that run without root or CAP_SYS_ADMIN: an administrator runs ``zeusd serve``
    (``--enable gpu-control``); this process only needs write access to its socket. The client's
    refusals (socket missing, 401/403, 404: gpu-control group disabled) mean "may not" (dry-run
    fallback); 400/500 are faults. ``block=true`` makes the daemon report the NVML result; the call
    runs on the controller's background thread.

    Args:
        socket_path: the daemon's socket.
        gpu_index: zeusd's (NVML) index of the GPU.
        token: JWT (``$ZEUSD_TOKEN``) or ``None``.
        supported: supported SM clocks (MHz), read locally with NVML (no privilege needed).
        timeout_s: per-request timeout (s).
        reader: the same GPU through NVML, for reading the applied clock back (no privilege
            needed); ``None``: no read-back (the closed loop then turns off, one warning).
    """

    kind = "real"

    def __init__(
        self,
        socket_path: str,
        gpu_index: int,
        token: str | None = None,
        supported: tuple[int, ...] | None = None,
        supported_mem: tuple[int, ...] | None = None,
        timeout_s: float = 5.0,
        reader: NvmlGpu | None = None,
    ) -> None:
        self.reader = reader
        self.socket_path = socket_path
        self.gpu_index = int(gpu_index)
        self.client = ZeusdClient(socket_path, token, timeout_s)
        self._supported = tuple(sorted(supported)) if supported else tuple(range(345, 1981, 15))
        self._supported_mem = tuple(sorted(supported_mem)) if supported_mem else ()
        self.mem_lock_supported: bool | None = None
        self.mem_may_be_locked = False
        self.locked = False

    def _do(self, fn: Any, *args: Any) -> None:
        try:
            fn(self.gpu_index, *args)
        except GpuNoPermissionError as exc:
            raise ClockPermissionError(str(exc)) from exc
        except GpuError as exc:
            raise ClockError(str(exc)) from exc

    @classmethod
    def index_for_pci(cls, socket_path: str, pci_bus_id: str, token: str | None = None, timeout_s: float = 5.0) -> int | None:
        """zeusd's index of the GPU at ``pci_bus_id`` (``/discover``), or ``None`` if not listed.

        Raises:
            ClockPermissionError: the daemon is unreachable or refuses; ClockError: any other failure.
        """
        try:
            return ZeusdClient(socket_path, token, timeout_s).index_for_pci(pci_bus_id)
        except GpuNoPermissionError as exc:
            raise ClockPermissionError(str(exc)) from exc
        except GpuError as exc:
            raise ClockError(str(exc)) from exc

    def supported_sm_clocks(self) -> tuple[int, ...]:
        return self._supported

    def supported_mem_clocks(self) -> tuple[int, ...]:
        return self._supported_mem

    def read_sm_clock_mhz(self) -> int | None:
        if self.reader is None:
            return None
        try:
            return self.reader.sm_clock_mhz()
        except GpuError:
            return None

    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        self._do(self.client.lock_sm_clocks_mhz, int(sm_clock_mhz), int(sm_clock_mhz))
        self.locked = True
        if mem_clock_mhz is None or self.mem_lock_supported is False:
            return
        self.mem_may_be_locked = True
        try:
            self._do(self.client.lock_mem_clocks_mhz, int(mem_clock_mhz), int(mem_clock_mhz))
            self.mem_lock_supported = True
        except ClockError as exc:
            if not _zeusd_unsupported(exc):
                raise
            self.mem_lock_supported = False
            self.mem_may_be_locked = False
            log.warning("powersave: zeusd: memory-clock locks not supported on GPU %d; memory clock presets are ignored", self.gpu_index)

    def reset(self) -> None:
        self._do(self.client.reset_sm_clocks)
        self.locked = False
        if self.mem_may_be_locked:
            try:
                self._do(self.client.reset_mem_clocks)
            except ClockError as exc:
                if not _zeusd_unsupported(exc) or self.mem_lock_supported:
                    raise
            self.mem_may_be_locked = False

    def lease_info(self) -> dict[str, Any]:
        # Never the token: lease files live in a shared directory.
        return {"backend": "zeusd", "socket": self.socket_path, "gpu_index": self.gpu_index, "mem_locked": bool(self.mem_may_be_locked)}

    def may_hold_lock(self) -> bool:
        return self.locked or self.mem_may_be_locked


def _zeusd_unsupported(exc: ClockError) -> bool:
    """zeusd answers an NVML NotSupported with HTTP 400 (bad input or unsupported operation)."""
    cause = exc.__cause__
    return not isinstance(exc, ClockPermissionError) and isinstance(cause, ZeusdError) and cause.not_supported()


def reset_from_lease(lease: dict[str, Any], nvml: Any | None = None) -> None:
    """Undo the locks a lease records, from any process (watchdog, next start, ``reset-clocks``).

    ``lease``: as written by :class:`~vllm_powersave.clocks.leases.LeaseStore` (``gpu`` is the
    GPU UUID; ``backend`` ``nvml`` (default) or ``zeusd`` with ``socket`` and ``gpu_index``).
    ``nvml``: an NVML binding to use instead of ``pynvml`` (tests hand in a fake).

    Raises:
        ClockError: the reset failed (the caller keeps the lease); :class:`LeaseError` where the
            lease itself names an unusable socket or index.
    """
    if lease.get("backend") == "zeusd":
        sock, index = lease.get("socket"), lease.get("gpu_index")
        if not isinstance(sock, str) or not sock:
            raise LeaseError(f"lease field 'socket' = {sock!r}: a zeusd lease needs the daemon's socket path")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= 1024:
            raise LeaseError(f"lease field 'gpu_index' = {index!r}: must be zeusd's GPU index (0-1024)")
        b = ZeusdClockBackend(sock, index, token=envs.zeusd_token())
        b.mem_may_be_locked = bool(lease.get("mem_locked", False))
        b.reset()
        return
    try:
        gpu = NvmlGpu.from_uuid(str(lease["gpu"]), nvml)
    except GpuError as exc:
        raise ClockError(f"no NVML device {lease['gpu']!r}: {exc}") from exc
    # Unknown (corrupt) leases: reset the memory lock too, in case it was taken.
    NvmlClockBackend(gpu, mem_may_be_locked=bool(lease.get("mem_locked", True))).reset()


def now() -> float:
    return time.monotonic()
