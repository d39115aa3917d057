"""Front-end starvation: GPU energy and time spent idle while the server had requests in flight.

The engine can only step on requests that reached it. When the API server cannot keep up (one
process tokenizing, detokenizing and streaming for 64 clients), the engine empties and idles while
clients still wait: in the H200 run behind this module (qwen2.5-7b shape, concurrency 64, one API
server) the engine sat idle for 9 % of the run's energy, and four API servers gave +54 % throughput
and -8.6 % J/token. Nothing flagged it; this module counts it.

How, across processes (same host; the clocks are ``time.monotonic``, system-wide on Linux):

* **API server** (:class:`BusyTracker`, fed by :class:`FrontendBusyMiddleware`): counts generation
  requests in flight (``POST`` outside ``/powersave``) from receipt until the last byte of the
  response is sent, and writes its busy intervals to ``<stats_dir>/frontend-<pid>.json`` (the open
  one and the closed ones of the last ``KEEP_S`` seconds; at most every ``WRITE_EVERY_S`` seconds,
  from a thread, never from the event loop). Every API server of ``--api-server-count N`` writes its own.
* **Worker** (:class:`FrontendBusyReader`): the union of all API servers' busy intervals. The
  energy account (``energy/account.py``) asks it, for every stretch it books as idle, how much of
  it overlapped a busy interval: that share of the idle energy is *idle while busy*.
* **Warning** (:class:`StarvationWatch`): once the idle-while-busy share of busy time over at least
  ``energy.starvation_min_busy_s`` of busy time exceeds ``energy.starvation_warn_share``: one
  warning naming the cause and the fix, then at most every ``energy.starvation_warn_every_s``.

Resolution: the account books idle only after ``energy.idle_after_s`` without a step, so gaps
shorter than that are not counted (an undercount); the busy file lags by at most
``WRITE_EVERY_S``. Workers that cannot read the API server's files (another node, Ray relay)
publish no figure rather than zero.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.powersave")

FRONTEND_GLOB = "frontend-*.json"
#: Closed busy intervals kept in the file (s): several worker ticks, with room for a stalled one.
KEEP_S = 30.0
#: Longest the file lags the in-flight count (s).
WRITE_EVERY_S = 0.05
#: A frontend file not rewritten for this long whose writer is gone is ignored (s).
STALE_AFTER_S = 10.0


class BusyTracker:
    """In-flight generation requests of one API-server process and its busy intervals.

    ``enter``/``leave`` are called from the event loop and only update memory under a lock;
    :meth:`flush` writes the file (the writer thread calls it).
    """

    def __init__(
        self, stats_dir: str | Path | None, clock: Callable[[], float] = time.monotonic, keep_s: float = KEEP_S, name: str | None = None
    ) -> None:
        self.path = Path(stats_dir) / f"frontend-{name or os.getpid()}.json" if stats_dir else None
        self.clock = clock
        self.keep_s = keep_s
        self.in_flight = 0
        self.busy_since: float | None = None
        self.closed: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._thread: threading.Thread | None = None

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            if self.in_flight == 1:
                self.busy_since = self.clock()
                self._dirty.set()

    def leave(self) -> None:
        with self._lock:
            if self.in_flight <= 0:
                return
            self.in_flight -= 1
            if self.in_flight == 0 and self.busy_since is not None:
                now = self.clock()
                self.closed.append((self.busy_since, now))
                self.busy_since = None
                while self.closed and now - self.closed[0][1] > self.keep_s:
                    self.closed.popleft()
                self._dirty.set()

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "pid": os.getpid(),
                "t": self.clock(),
                "in_flight": self.in_flight,
                "busy_since": self.busy_since,
                "intervals": [list(iv) for iv in self.closed],
            }

    def flush(self) -> None:
        """Write the state atomically (the worker never reads half a file)."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.state()))
        tmp.replace(self.path)

    def start(self) -> None:
        """Write now and then on every change, at most every ``WRITE_EVERY_S`` (daemon thread)."""
        if self.path is None or self._thread is not None:
            return
        try:
            self.flush()
        except OSError as exc:
            log.warning("powersave: cannot write %s (%s); starvation figures unavailable", self.path, exc)
            return
        self._thread = threading.Thread(target=self._loop, name="powersave-frontend", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        failed = False
        while True:
            self._dirty.wait()
            self._dirty.clear()
            try:
                self.flush()
                failed = False
            except OSError as exc:
                if not failed:
                    log.warning("powersave: cannot write %s (%s); starvation figures stale", self.path, exc)
                failed = True
            time.sleep(WRITE_EVERY_S)


_TRACKER: dict[str, Any] = {}


def tracker() -> BusyTracker:
    """This process's tracker (created, and its writer started, when the app is built)."""
    t = _TRACKER.get("t")
    if t is None:
        t = _TRACKER["t"] = BusyTracker(_TRACKER.get("stats_dir"))
        t.start()
    return t


def configure(stats_dir: str | Path | None) -> str:
    """Name this API-server process's stats directory; returns the middleware's import path.
    Nothing starts until vLLM builds its app with the middleware (API-server processes only)."""
    _TRACKER["stats_dir"] = stats_dir
    return "vllm_powersave.starvation.FrontendBusyMiddleware"


class FrontendBusyMiddleware:
    """Pure ASGI middleware counting generation requests in flight (``POST`` outside ``/powersave``).

    A request counts from its receipt until the app returns, i.e. until the last byte of a
    streamed response is sent. Fails open: a fault of its own never touches the request.
    """

    def __init__(self, app: Any, busy: BusyTracker | None = None) -> None:
        self.app = app
        self.busy = busy if busy is not None else tracker()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or str(scope.get("path", "")).startswith("/powersave"):
            await self.app(scope, receive, send)
            return
        try:
            self.busy.enter()
        except Exception:
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            try:
                self.busy.leave()
            except Exception:
                pass


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class FrontendBusyReader:
    """Union of the busy intervals every API server of this ``stats_dir`` published (worker side).

    ``overlap(t0, t1)`` is called by the energy account under its tick; the files are re-read at
    most every ``refresh_s``. An open interval counts as busy up to ``t1``. ``available`` is False
    until some API server's file was read (then no figure is published, rather than zero).
    """

    def __init__(self, stats_dir: str | Path, clock: Callable[[], float] = time.monotonic, refresh_s: float = 0.05) -> None:
        self.dir = Path(stats_dir)
        self.clock = clock
        self.refresh_s = refresh_s
        self.available = False
        self.frontends = 0
        self.in_flight = 0
        self._intervals: list[tuple[float, float]] = []
        self._open: list[float] = []
        self._read_at = -float("inf")

    def refresh(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._read_at < self.refresh_s:
            return
        self._read_at = now
        from .clocks.leases import pid_alive

        closed: list[tuple[float, float]] = []
        opened: list[float] = []
        n = in_flight = 0
        for p in self.dir.glob(FRONTEND_GLOB):
            try:
                s = json.loads(p.read_text())
                pid = int(s.get("pid", -1))
                if not pid_alive(pid) and time.time() - p.stat().st_mtime > STALE_AFTER_S:
                    continue
                for a, b in s.get("intervals") or []:
                    closed.append((float(a), float(b)))
                if s.get("busy_since") is not None:
                    opened.append(float(s["busy_since"]))
                in_flight += int(s.get("in_flight", 0))
                n += 1
            except (OSError, ValueError, TypeError, AttributeError):
                continue  # removed meanwhile, or not ours: skip it
        self.frontends, self.in_flight = n, in_flight
        self.available = self.available or n > 0
        self._intervals, self._open = _merge(closed), opened

    def overlap(self, t0: float, t1: float) -> float:
        """Seconds of ``[t0, t1]`` during which some API server had a request in flight."""
        if t1 <= t0:
            return 0.0
        self.refresh()
        ivs = list(self._intervals) + [(o, t1) for o in self._open]
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in _merge(ivs))


def suggested_api_servers(current: int) -> int:
    """The API-server count to try next: 4 from one (the H200 run's fix), else twice as many."""
    return 4 if current <= 1 else 2 * current


class StarvationWatch:
    """Rate-limited warning when the GPU idles while the server has work (see module docstring)."""

    def __init__(
        self,
        share: float,
        min_busy_s: float,
        every_s: float,
        engine: int = 0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.share, self.min_busy_s, self.every_s, self.engine = share, min_busy_s, every_s, engine
        self.clock, self.log = clock, logger
        self._base = (0.0, 0.0, 0.0)  # idle-while-busy s, busy s, idle-while-busy J at the span's start
        self.last_warn: float | None = None
        self.warnings = 0

    def check(self, idle_busy_s: float, busy_s: float, idle_busy_j: float, frontends: int) -> str | None:
        """Judge the span since the last verdict; returns the warning logged, if any."""
        s0, b0, j0 = self._base
        d_busy = busy_s - b0
        if d_busy < self.min_busy_s or self.share >= 1.0:
            return None
        self._base = (idle_busy_s, busy_s, idle_busy_j)
        share = (idle_busy_s - s0) / d_busy
        now = self.clock()
        if share <= self.share or (self.last_warn is not None and now - self.last_warn < self.every_s):
            return None
        self.last_warn = now
        self.warnings += 1
        n = max(1, frontends)
        msg = (
            f"powersave: engine {self.engine}: GPU idle {100 * share:.0f} % of busy time ({idle_busy_j - j0:.0f} J over "
            f"{d_busy:.0f} s) while requests were in flight at the API server: the engine is waiting on the front end "
            f"(tokenizing, detokenizing, streaming); try --api-server-count {suggested_api_servers(n)} "
            f"(now {n}); `vllm-powersave advise` ranks this with the other fixes"
        )
        self.log.warning(msg)
        return msg
