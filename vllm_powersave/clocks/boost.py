"""Unprivileged run-time switch of the CUDA performance boost, through a side CUDA context.

Why this works (and what it rests on): since driver 580.105.08 every CUDA session asks the driver
to boost the GPU to a higher power state unless the process sets ``CUDA_DISABLE_PERF_BOOST=1``
when it creates its context (driver release notes). The request belongs to the session (a
per-context ``NV2080_CTRL_PERF_BOOST`` control call, per public analyses of the driver's ioctls),
so it lasts as long as the context and is not a device setting: no privilege is needed and
nothing outlives the process. An engine started with the variable set runs unboosted; a tiny
helper process that holds a *default* context brings the boost back, and dropping that context
takes it away again. Whether the driver really combines sessions this way is a measured claim:
``benchmarks/h200_perf_boost.py`` records idle power and SM clock with and without the holder.

The helper is a separate process (not a second context in the engine) because CUDA reads the
variable once per process. It is a child with a pipe on stdin: when the parent dies, the pipe
closes, the child exits and its context is gone, so a boost can never outlive the server.

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

log = logging.getLogger("vllm_powersave")

ENV_PERF_BOOST = "CUDA_DISABLE_PERF_BOOST"


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
        self.broken: str | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.device)
        env.pop(ENV_PERF_BOOST, None)  # the whole point: this session asks for the boost
        return subprocess.Popen([sys.executable, "-m", "vllm_powersave.clocks.boost"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)

    def set(self, hold: bool) -> float:
        """Hold (``True``) or release (``False``) the boost context; returns the time taken in ms."""
        with self._lock:
            if self.broken:
                raise BoostUnavailable(self.broken)
            if hold == self.held:
                return 0.0
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
                assert self._proc.stdin is not None and self._proc.stdout is not None
                self._proc.stdin.write("1\n" if hold else "0\n")
                self._proc.stdin.flush()
                line = _readline(self._proc, self.timeout_s)
            except (OSError, TimeoutError, AssertionError) as exc:
                self._fail(f"boost helper: {type(exc).__name__}: {exc}")
                raise BoostUnavailable(self.broken) from exc
            if not line.startswith("ok "):
                self._fail(f"boost helper: {line.strip() or 'exited'}")
                raise BoostUnavailable(self.broken)
            self.held = hold
            self.switches += 1
            self.last_ms = float(line.split()[1])
            return self.last_ms

    def _fail(self, why: str) -> None:
        self.broken = why
        self.held = False
        self.close()

    def close(self) -> None:
        p, self._proc = self._proc, None
        if p is None:
            return
        try:
            if p.stdin:
                p.stdin.close()  # the child exits on EOF, dropping its context
            p.wait(timeout=5)
        except Exception:
            p.kill()
        self.held = False


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

    def __init__(self, holder: "BoostHolder", release_after_s: float = 2.0, clock=time.monotonic) -> None:
        self.holder = holder
        self.release_after_s = release_after_s
        self.clock = clock
        self.want = False
        self.held = False
        self.last_busy = -float("inf")
        self.switches = 0
        self.last_switch_ms: float | None = None
        self.disabled_reason: str | None = None
        self._ev = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="powersave-boost", daemon=True)
        self._thread.start()

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

    def _loop(self) -> None:
        while True:
            self._ev.wait()
            self._ev.clear()
            if self._stop:
                return
            want = self.want
            if want == self.held or self.disabled_reason is not None:
                continue
            try:
                self.last_switch_ms = self.holder.set(want)
                self.held = want
                self.switches += 1
            except Exception as exc:  # no driver, no memory for a context, helper died: stay unboosted
                self.disabled_reason = str(exc)
                self.held = False
                log.warning("powersave: cuda_perf_boost auto: the side context failed (%s); the engine stays unboosted", exc)

    def close(self) -> None:
        self._stop = True
        self._ev.set()
        self._thread.join(timeout=5)
        self.holder.close()
        self.held = False

    def snapshot(self) -> dict:
        return {"held": self.held, "switches": self.switches, "last_switch_ms": self.last_switch_ms,
                "disabled": self.disabled_reason}


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
def _helper() -> int:
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
