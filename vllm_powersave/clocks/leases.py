"""Clock leases and process liveness: who holds a GPU's clock lock, and whether they still live.

A lease file per GPU names the owner's PID and how to undo its lock; beside it, a heartbeat and a
revocation mark. The controller writes them (``clocks/controller.py``), the watchdog
(``clocks/watchdog.py``), the next start and ``vllm-powersave reset-clocks`` read them to reset the
GPUs of dead or silent owners (docs/design.md, clock path, hops 3 and 6). :func:`pid_alive` is also
what the stats readers use to tell a dead writer's files from a live one's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["LeaseStore", "pid_alive"]


class LeaseStore:
    """One JSON lease file per GPU (keyed by UUID) recording who holds a clock lock.

    Beside each lease: ``<gpu>.hb`` (its mtime is the owner's last heartbeat) and
    ``<gpu>.revoked`` (written by the watchdog when it reset the GPU of a live but silent owner;
    holds that owner's PID).
    """

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)

    def _path(self, gpu_id: str, suffix: str = ".json") -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in gpu_id)
        return self.dir / f"{safe}{suffix}"

    def acquire(self, gpu_id: str, sm_clock_mhz: int, info: dict[str, Any] | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self._path(gpu_id, f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**(info or {}), "gpu": gpu_id, "pid": os.getpid(), "sm_clock_mhz": sm_clock_mhz, "t": time.time()}))
        tmp.replace(self._path(gpu_id))
        self.beat(gpu_id)

    def release(self, gpu_id: str) -> None:
        for suffix in (".json", ".hb", ".revoked"):
            self._path(gpu_id, suffix).unlink(missing_ok=True)

    def held(self, gpu_id: str) -> bool:
        return self._path(gpu_id).exists()

    def beat(self, gpu_id: str) -> None:
        """Record a heartbeat (the file's mtime)."""
        p = self._path(gpu_id, ".hb")
        try:
            os.utime(p)
        except FileNotFoundError:
            p.touch()

    def heartbeat_age_s(self, gpu_id: str) -> float | None:
        """Seconds since the last heartbeat (wall clock), or ``None`` if none was ever written."""
        try:
            return max(0.0, time.time() - self._path(gpu_id, ".hb").stat().st_mtime)
        except OSError:
            return None

    def revoke(self, gpu_id: str, owner_pid: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._path(gpu_id, ".revoked").write_text(str(owner_pid))

    def revoked_for(self, gpu_id: str, pid: int) -> bool:
        try:
            return int(self._path(gpu_id, ".revoked").read_text().strip() or -1) == pid
        except (OSError, ValueError):
            return False

    def _load(self, p: Path) -> dict[str, Any]:
        try:
            lease = json.loads(p.read_text())
            if not isinstance(lease, dict):
                raise ValueError("not a mapping")
            lease["pid"] = int(lease.get("pid", -1))
            lease["gpu"] = str(lease.get("gpu") or p.stem)
        except (OSError, ValueError, TypeError, OverflowError, UnicodeDecodeError):
            # A corrupt lease cannot prove its owner alive: treat the GPU as possibly locked.
            lease = {"gpu": p.stem, "pid": -1, "corrupt": True}
        lease["path"] = str(p)
        return lease

    def all(self) -> list[dict[str, Any]]:
        if not self.dir.is_dir():
            return []
        return [self._load(p) for p in sorted(self.dir.glob("*.json"))]

    def stale(self) -> list[dict]:
        """Leases whose owning process no longer exists."""
        return [lease for lease in self.all() if not pid_alive(lease["pid"])]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0; a process we may not signal exists too)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return True
