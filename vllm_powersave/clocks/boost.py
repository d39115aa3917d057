"""Unprivileged run-time switch of the CUDA performance boost, through a side CUDA context.

Why this works (and what it rests on): since driver 580.105.08 every CUDA session asks the driver
to boost the GPU to a higher power state unless the process sets ``CUDA_DISABLE_PERF_BOOST=1``
when it creates its context (driver release notes). The request belongs to the session (a
per-context ``NV2080_CTRL_PERF_BOOST`` control call, per public analyses of the driver's ioctls),
so it lasts as long as the context and is not a device setting: no privilege is needed and
nothing outlives the process. An engine started with the variable set runs unboosted; a tiny
helper process that holds a *default* context brings the boost back, and dropping that context
takes it away again. Whether the driver really combines sessions this way is a measured claim:
``docs/results/h200-perf-boost.md`` records idle power and SM clock with and without the holder.

The helper is a separate process (not a second context in the engine) because CUDA reads the
variable once per process. It is a child with a pipe on stdin: when the parent dies, the pipe
closes, the child exits and its context is gone, so a boost can never outlive the server. The pipe
alone is not enough: a process the engine forks (without exec) inherits its write end and keeps it
open after the engine is gone, so the helper also exits as soon as its parent PID changes.
A helper that dies while holding (OOM killer, a stray ``kill``) takes the boost with it; the
controller notices within one tick, says so once, and starts a new one (at most ``MAX_RESTARTS``
times, then the engine stays unboosted).

Protocol on the child's stdin/stdout, one line each: ``1`` -> hold a context (answers
``ok <ms>`` with the time taken, or ``err <reason>``), ``0`` -> release it (``ok <ms>``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from typing import NamedTuple

log = logging.getLogger("vllm_powersave")


class BoostUnavailable(RuntimeError):
    """No CUDA driver, or the helper could not create a context."""


class BoostHolder:
    """Holds or drops a default-boost CUDA context on one GPU from a helper process.

    Args:
        device: the GPU as CUDA_VISIBLE_DEVICES accepts it (UUID preferred, or an index).
        timeout_s: how long one hold/release may take before the helper is considered broken.

    Raises:
        BoostUnavailable: from :meth:`set` when the helper cannot start or create a context;
        the holder then stays off (callers keep serving, unboosted).
    """

    def __init__(self, device: str, timeout_s: float = 10.0) -> None:
        self.device = str(device)
        self.timeout_s = timeout_s
        self.held = False
        self.last_ms: float | None = None
        self.switches = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.broken: str | None = None

    def _start(self) -> subprocess.Popen:
        from ..settings import ENV_PERF_BOOST  # parent side only: the helper script stays stdlib-only

        env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.device)
        env.pop(ENV_PERF_BOOST, None)  # the whole point: this session asks for the boost
        # Run as a script in isolated mode: the helper needs the standard library only, so it
        # starts in tens of ms instead of importing the package (pydantic, settings) first.
        return subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), "--parent", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )

    @property
    def pid(self) -> int | None:
        """The helper process's PID, or None before it starts and after close (supervision, tests)."""
        p = self._proc
        return None if p is None else p.pid

    def alive(self) -> bool:
        """Whether a helper process is running (a held boost lasts exactly as long as it does)."""
        p = self._proc
        return p is not None and p.poll() is None

    def set(self, hold: bool) -> float:
        """Hold (``True``) or release (``False``) the boost context; returns the time taken in ms."""
        with self._lock:
            if self._closed:
                raise BoostUnavailable("closed")
            if self.broken:
                raise BoostUnavailable(self.broken)
            if self.held and not self.alive():
                self.held = False  # the helper died holding: its context, and the boost, went with it
            if hold == self.held:
                return 0.0
            try:
                proc = self._proc  # close() may clear the attribute from another thread meanwhile
                if proc is None or proc.poll() is not None:
                    proc = self._proc = self._start()
                    if self._closed:  # close() ran meanwhile (it does not wait for this lock)
                        self.close()
                        raise BoostUnavailable("closed")
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("1\n" if hold else "0\n")
                proc.stdin.flush()
                line = _readline(proc, self.timeout_s)
            except (OSError, ValueError, TimeoutError, AssertionError) as exc:  # ValueError: stdin closed by close()
                self._fail(f"boost helper: {type(exc).__name__}: {exc}")
                raise BoostUnavailable(self.broken) from exc
            parts = line.split()
            try:
                if parts[0] != "ok":
                    raise ValueError
                ms = float(parts[1])
            except (IndexError, ValueError):
                self._fail(f"boost helper: {line.strip()[:200] or 'exited'}")
                raise BoostUnavailable(self.broken) from None
            self.held = hold
            self.switches += 1
            self.last_ms = ms
            return ms

    def _fail(self, why: str) -> None:
        self.broken = why
        self.held = False
        self.close(final=False)

    def close(self, final: bool = True) -> None:
        """End the helper (EOF on its stdin, SIGKILL after 5 s); with ``final`` no new one starts.

        Safe to call from any thread while :meth:`set` waits for an answer: that call then fails.
        """
        if final:
            self._closed = True
        p, self._proc = self._proc, None
        self.held = False
        if p is None:
            return
        try:
            if p.stdin:
                p.stdin.close()  # the child exits on EOF, dropping its context
        except OSError:  # broken pipe: the child is gone already
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


class BoostSwitch(NamedTuple):
    """One finished hold or release: when it completed (s, monotonic: the step trace's clock), the
    state it left and how long the helper took (ms). The GPU's own fall to idle power follows the
    release by a lag of its own, which the step trace lets a reader line up with power samples.

    ``ms`` is ``None`` for a boost that ended without a release the helper answered: the helper
    died while holding (``t_s``: when the controller noticed, within one tick), a release failed
    (the holder then ends the helper) or :meth:`BoostController.close` ended it while held."""

    t_s: float
    held: bool
    ms: float | None


class BoostController:
    """``cuda_perf_boost: "auto"``: the engine runs unboosted; a side context boosts it while it works.

    Hysteresis like the clock presets': hold at once when a step (or an arriving request) shows
    work, release only after ``release_after_s`` without a step. Measured on the H200
    (``docs/results/h200-perf-boost.md``): unboosted idle 82 W vs 120 W boosted; the unboosted
    driver may lower the SM clock under load and costs TTFT/TPOT at low load, which holding the
    boost while serving avoids. Holding takes ~170 ms (a CUDA context) and releasing ~70 ms, so
    both run on this object's own thread: the step hook only stores a time stamp and, on the
    first busy step after a release, sets an event.

    Args:
        holder: the :class:`BoostHolder` of this worker's GPU (or a fake with ``set``/``close``).
        release_after_s: seconds without a step before the boost is released (s).
        clock: monotonic seconds (tests inject one).
    """

    #: Helpers that may die while holding before the controller gives up (OOM-killed each time).
    MAX_RESTARTS = 3

    def __init__(self, holder: "BoostHolder", release_after_s: float = 0.5, clock=time.monotonic) -> None:
        self.holder = holder
        self.release_after_s = release_after_s
        self.clock = clock
        self.want = False
        self.held = False
        self.last_busy = -float("inf")
        self.switches = 0
        self.restarts = 0
        self.last_switch_ms: float | None = None
        self.disabled_reason: str | None = None
        self._recent: deque[BoostSwitch] = deque(maxlen=256)  # finished switches not yet drained
        self._ev = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="powersave-boost", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        """A hold or release was asked for and the background loop has not taken it up yet."""
        return self._ev.is_set()

    # -- hot path ------------------------------------------------------------------------------
    def on_busy(self, now: float | None = None) -> None:
        """A step (or a request arrival) happened: keep or get the boost. No I/O, no blocking."""
        self.last_busy = self.clock() if now is None else now
        if not self.want and self.disabled_reason is None:
            self.want = True
            self._ev.set()

    # -- background ----------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Called periodically (the publisher thread): release after ``release_after_s`` idle."""
        now = self.clock() if now is None else now
        if self.want and now - self.last_busy >= self.release_after_s:
            self.want = False
            self._ev.set()
        elif self.held and not self._holder_alive():
            self._ev.set()  # the helper died holding: the loop notices and starts a new one

    def _holder_alive(self) -> bool:
        alive = getattr(self.holder, "alive", None)
        return True if alive is None else bool(alive())

    def _loop(self) -> None:
        while True:
            self._ev.wait()
            self._ev.clear()
            if self._stop:
                return
            if self.disabled_reason is not None:
                continue
            if self.held and not self._holder_alive():
                self.held = False
                self._recent.append(BoostSwitch(self.clock(), False, None))  # the boost went with the helper
                self.restarts += 1
                if self.restarts > self.MAX_RESTARTS:
                    self.disabled_reason = f"boost helper died {self.restarts} times while holding"
                    log.warning("powersave: cuda_perf_boost auto: %s; the engine stays unboosted", self.disabled_reason)
                    continue
                log.warning(
                    "powersave: cuda_perf_boost auto: the boost helper died while holding (the GPU is unboosted "
                    "meanwhile); starting a new one (%d/%d)",
                    self.restarts,
                    self.MAX_RESTARTS,
                )
            want = self.want
            if not want and self.clock() - self.last_busy < self.release_after_s:
                # A step landed between tick()'s test and its write of want: keep the boost.
                self.want = want = True
            if want == self.held:
                continue
            try:
                self.last_switch_ms = self.holder.set(want)
                self.held = want
                self._recent.append(BoostSwitch(self.clock(), want, self.last_switch_ms))
                self.switches += 1
            except Exception as exc:  # no driver, no memory for a context, helper died: stay unboosted
                if self.held:  # a failed release: the holder ended its helper, and the boost with it
                    self._recent.append(BoostSwitch(self.clock(), False, None))
                self.held = False
                if self._stop:
                    return  # close() ended the helper under a call in flight: not a failure
                self.disabled_reason = str(exc)
                log.warning("powersave: cuda_perf_boost auto: the side context failed (%s); the engine stays unboosted", exc)

    def drain_switches(self) -> list[BoostSwitch]:
        """The switches finished since the last call, oldest first (at most the latest 256). Safe
        from any thread: deque appends and pops are atomic."""
        out = []
        while True:
            try:
                out.append(self._recent.popleft())
            except IndexError:
                return out

    def close(self) -> None:
        """Release the boost and end the helper; prompt even while a hold is in flight (the helper
        is ended first, which makes that call fail instead of being waited for)."""
        self._stop = True
        self._ev.set()
        self.holder.close()
        self._thread.join(timeout=5)
        if self.held:  # ending the helper dropped the boost: the trace's last boost line says so
            self._recent.append(BoostSwitch(self.clock(), False, None))
        self.held = False

    def snapshot(self) -> dict:
        return {"held": self.held, "switches": self.switches, "last_switch_ms": self.last_switch_ms, "disabled": self.disabled_reason}


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        proc.kill()
        raise TimeoutError(f"no answer in {timeout_s:.0f} s")
    return box[0] if box else ""


# -- helper process ----------------------------------------------------------------------------
def _exit_when_orphaned(parent_pid: int, period_s: float = 0.2) -> None:
    """End this process (and with it its CUDA context) once ``parent_pid`` is no longer its parent.

    Stdin EOF is not enough: a child the engine forked without exec holds the pipe's write end.
    """
    if parent_pid <= 0:
        return
    if os.getppid() != parent_pid:
        os._exit(3)  # the parent died before we got here

    def watch() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _helper(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parent = int(argv[argv.index("--parent") + 1]) if "--parent" in argv else 0
    _exit_when_orphaned(parent)
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        print(f"err no CUDA driver ({exc})", flush=True)
        return 1

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned CUDA error {rc}")

    dev = ctypes.c_int(0)
    ctx = ctypes.c_void_p()
    buf = ctypes.c_uint64()
    release = getattr(cuda, "cuDevicePrimaryCtxRelease_v2", None) or cuda.cuDevicePrimaryCtxRelease
    held = False
    for line in sys.stdin:
        want = line.strip() == "1"
        t0 = time.perf_counter()
        try:
            if want and not held:
                check(cuda.cuInit(0), "cuInit")
                check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
                check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
                check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                # One small allocation and memset so that the session is fully set up, not lazily.
                check(cuda.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(1 << 20)), "cuMemAlloc")
                check(cuda.cuMemsetD8_v2(buf, ctypes.c_ubyte(0), ctypes.c_size_t(1 << 20)), "cuMemsetD8")
                check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
                held = True
            elif not want and held:
                cuda.cuMemFree_v2(buf)
                check(release(dev), "cuDevicePrimaryCtxRelease")
                held = False
        except Exception as exc:
            print(f"err {exc}", flush=True)
            return 1
        print(f"ok {1000 * (time.perf_counter() - t0):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_helper())
