"""Per-phase clock controller with hysteresis, applied off vLLM's critical path.

Decisions (:meth:`ClockController.decide`) are a pure function of the phase sequence and the time,
so every TP/PP rank, which sees the same scheduler output, takes the same decision. Applying a
decision can take milliseconds (an NVML call), so :meth:`ClockController.on_phase` only records the
target; a background thread applies the latest one (older targets are coalesced, no-ops skipped).

Safety: a lock is never left behind. Every applied lock writes a lease file naming the GPU and our
PID; :meth:`close` resets and removes it (also run by ``atexit``); a later start, or
``vllm-powersave reset-clocks``, resets GPUs whose lease belongs to a dead process. Any backend
fault other than a permission error stops clock control for the rest of the run after one reset
attempt; the server keeps serving.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ..settings import ClockPreset, ClockSettings
from .backends import ClockBackend, ClockChange, ClockPermissionError, DryRunClockBackend

log = logging.getLogger("vllm.powersave.clocks")


class LeaseStore:
    """One JSON lease file per GPU (keyed by UUID) recording who holds a clock lock."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)

    def _path(self, gpu_id: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in gpu_id)
        return self.dir / f"{safe}.json"

    def acquire(self, gpu_id: str, sm_clock_mhz: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self._path(gpu_id).with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpu": gpu_id, "pid": os.getpid(), "sm_clock_mhz": sm_clock_mhz, "t": time.time()}))
        tmp.replace(self._path(gpu_id))

    def release(self, gpu_id: str) -> None:
        self._path(gpu_id).unlink(missing_ok=True)

    def stale(self) -> list[dict]:
        """Leases whose owning process no longer exists."""
        out = []
        if not self.dir.is_dir():
            return out
        for p in sorted(self.dir.glob("*.json")):
            try:
                lease = json.loads(p.read_text())
                if not isinstance(lease, dict):
                    raise ValueError("not a mapping")
                lease["pid"] = int(lease.get("pid", -1))
                lease["gpu"] = str(lease.get("gpu") or p.stem)
            except (OSError, ValueError, TypeError, OverflowError, UnicodeDecodeError):
                # A corrupt lease cannot prove its owner alive: treat the GPU as possibly locked.
                lease = {"gpu": p.stem, "pid": -1, "corrupt": True}
            if not _pid_alive(lease["pid"]):
                lease["path"] = str(p)
                out.append(lease)
        return out


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _rank(p: ClockPreset) -> float:
    """Order presets by SM clock; the driver default (no lock) is the highest."""
    return float("inf") if p.sm_clock_mhz is None else float(p.sm_clock_mhz)


class ClockController:
    """Maps phases to clock presets with hysteresis (minimum dwell before lowering a clock).

    Args:
        backend: where clocks go (real, dry-run or simulated).
        settings: presets per phase and ``min_dwell_ms``.
        gpu_id: GPU UUID (lease key).
        asynchronous: apply in a background thread (production) or inline (tests, simulation).
        clock: monotonic time source in seconds (tests inject one).
        watchdog: start the out-of-process watchdog before the first real lock.
    """

    def __init__(
        self,
        backend: ClockBackend,
        settings: ClockSettings,
        gpu_id: str = "gpu0",
        asynchronous: bool = True,
        clock: Callable[[], float] = time.monotonic,
        watchdog: bool = True,
    ) -> None:
        self.watchdog = watchdog
        self.backend = backend
        self.settings = settings
        self.gpu_id = gpu_id
        self.clock = clock
        self.leases = LeaseStore(settings.lease_dir) if backend.kind == "real" else None
        self.presets: dict[str, ClockPreset] = {
            phase: ClockPreset(
                sm_clock_mhz=backend.snap(p.sm_clock_mhz) if p.sm_clock_mhz is not None else None,
                mem_clock_mhz=p.mem_clock_mhz,
            )
            for phase, p in settings.presets.items()
        }
        self.min_dwell_s = settings.min_dwell_ms / 1000.0
        self.current: ClockPreset = ClockPreset()  # None/None: driver default
        self._all_targets = {p: self.presets.get(p, ClockPreset()) for p in ("prefill", "decode", "mixed", "idle")}
        self._same = {p: t == self.current for p, t in self._all_targets.items()}
        self.last_change_s = -1e18
        self._down_since: float | None = None
        self._down_target: ClockPreset | None = None
        # Bounded: a server runs for weeks; the count is kept separately.
        self.decisions: deque[ClockChange] = deque(maxlen=4096)
        self.n_changes = 0
        self.disabled_reason: str | None = None
        self._pending: tuple[str, ClockPreset] | None = None
        self._apply_lock = threading.Lock()
        self._maybe_locked = False  # what the GPU may have, as opposed to what we last wanted
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.leases is not None:
            self.recover_stale()
        if asynchronous:
            self._thread = threading.Thread(target=self._loop, name="powersave-clocks", daemon=True)
            self._thread.start()
        atexit.register(self.close)

    # -- decisions ---------------------------------------------------------------------------
    def decide(self, phase: str) -> ClockPreset | None:
        """The preset to switch to now for ``phase``, or ``None`` to stay.

        Asymmetric hysteresis: a higher clock (or the driver default) is applied at once, so a
        prefill burst after idle or decode is never slowed; a lower clock only once the phases
        asking for it have lasted ``min_dwell_ms`` without interruption, so short decode runs
        between prefills do not make the clock oscillate.
        """
        target = self._all_targets.get(phase) or ClockPreset()
        if target == self.current:
            self._down_since = None
            return None
        if _rank(target) > _rank(self.current):
            self._down_since = None
            return target
        t = self.clock()
        if self._down_since is None or self._down_target != target:
            self._down_since, self._down_target = t, target
        if t - self._down_since >= self.min_dwell_s:
            self._down_since = None
            return target
        return None

    def on_phase(self, phase: str) -> None:
        """Called once per engine step (hot path: no NVML here, and no work when nothing changes)."""
        if self._same.get(phase, False) and self._down_since is None:
            return  # the common case: this phase's preset is already applied
        if self.disabled_reason is not None or self._closed:
            return
        target = self.decide(phase)
        if target is None:
            return
        self.current = target
        self._same = {p: t == target for p, t in self._all_targets.items()}
        self.last_change_s = self.clock()
        self.decisions.append(ClockChange(self.last_change_s, phase, target.sm_clock_mhz, target.mem_clock_mhz))
        self.n_changes += 1
        if self._thread is None:
            self._apply(phase, target)
        else:
            with self._cv:
                self._pending = (phase, target)  # coalesce: only the newest target matters
                self._cv.notify()

    # -- applying ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                phase, target = self._pending  # type: ignore[misc]
                self._pending = None
            self._apply(phase, target)

    def _apply(self, phase: str, target: ClockPreset) -> None:
        with self._apply_lock:
            if self._closed and target.sm_clock_mhz is not None:
                return  # close() owns the final state: never lock after it started
            try:
                if target.sm_clock_mhz is None:
                    self._reset_and_release()
                else:
                    if self.leases:
                        self.leases.acquire(self.gpu_id, target.sm_clock_mhz)
                        self._start_watchdog()
                    # Pessimistic: from here on the GPU may be locked, even if the call fails midway.
                    self._maybe_locked = True
                    self.backend.set_clocks(target.sm_clock_mhz, target.mem_clock_mhz)
            except ClockPermissionError as exc:
                self._to_dry_run(exc, target)
            except Exception as exc:  # NVML faults and anything else: never take the engine down
                self._fault(exc)

    def _reset_and_release(self) -> None:
        """Reset the clocks; the lease is released only once the reset succeeded (raises otherwise)."""
        self.backend.reset()
        self._maybe_locked = False
        if self.leases:
            self.leases.release(self.gpu_id)

    def _to_dry_run(self, exc: Exception, target: ClockPreset) -> None:
        log.warning("powersave: %s; clock control falls back to dry-run for GPU %s", exc, self.gpu_id)
        if self.leases:
            self.leases.release(self.gpu_id)  # a refused lock never took effect
        self._maybe_locked = False
        try:
            supported: tuple[int, ...] | None = self.backend.supported_sm_clocks()
        except Exception:
            supported = None
        self.backend = DryRunClockBackend(supported)
        self.leases = None
        if target.sm_clock_mhz is not None:
            self.backend.set_clocks(target.sm_clock_mhz, target.mem_clock_mhz)

    _watchdog_started = False

    def _start_watchdog(self) -> None:
        """Once per process, before the first real lock: survive a SIGKILL of this process."""
        if ClockController._watchdog_started or not self.watchdog:
            return
        ClockController._watchdog_started = True
        import subprocess
        import sys

        try:
            subprocess.Popen(
                [sys.executable, "-m", "vllm_powersave.clocks.watchdog", "--pid", str(os.getpid()), "--lease-dir", str(self.settings.lease_dir)],
                start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            )
        except OSError as exc:
            log.warning("powersave: clock watchdog not started (%s); stale locks are reset at the next start", exc)

    def _fault(self, exc: Exception) -> None:
        self.disabled_reason = f"{type(exc).__name__}: {exc}"
        log.error("powersave: clock control stopped for GPU %s after a fault (%s); serving continues", self.gpu_id, exc)
        try:
            self._reset_and_release()
        except Exception as exc2:
            # Keep the lease: the watchdog, the next start or `vllm-powersave reset-clocks` retries.
            log.error("powersave: reset after the fault failed for GPU %s (%s); lease kept for recovery", self.gpu_id, exc2)

    def recover_stale(self) -> list[str]:
        """Reset GPUs whose lease belongs to a dead process (a SIGKILLed server). Returns their ids."""
        recovered = []
        assert self.leases is not None
        for lease in self.leases.stale():
            if lease.get("gpu") == self.gpu_id:
                log.warning("powersave: resetting clocks of GPU %s left locked by dead PID %s", self.gpu_id, lease.get("pid"))
                try:
                    self.backend.reset()
                except Exception as exc:
                    log.error("powersave: reset of stale lock failed (%s); lease kept", exc)
                    continue
                self.leases.release(self.gpu_id)
                recovered.append(self.gpu_id)
        return recovered

    def close(self) -> None:
        """Stop the thread and restore the driver's default clocks. Idempotent.

        Waits for an in-flight NVML call (up to 30 s); the reset then runs whatever the controller
        last wanted, because what matters is what the GPU may have been given.
        """
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._pending = None
            self._cv.notify()
        got = self._apply_lock.acquire(timeout=30.0)
        try:
            if self._maybe_locked:
                try:
                    self._reset_and_release()
                except Exception as exc:
                    log.error("powersave: clock reset at exit failed for GPU %s (%s); lease kept for recovery", self.gpu_id, exc)
            elif self.leases:
                self.leases.release(self.gpu_id)
            self.current = ClockPreset()
        finally:
            if got:
                self._apply_lock.release()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    @property
    def target_sm_clock_mhz(self) -> int | None:
        return self.current.sm_clock_mhz
