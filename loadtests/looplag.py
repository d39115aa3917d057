"""The harness's own event-loop lag: how long a just-posted callback waits for the client's loop.

A streamed chunk is timestamped only when its task runs, so while the loop is busy with other
streams every TTFT and ITL grows by the wait. A probe thread posts a timestamped callback into the
loop every ``period_s`` (``call_soon_threadsafe``, which wakes an idle loop at once) and the
callback records how long it waited. A timer-overshoot probe (``asyncio.sleep`` and compare) was
not used: on an idle loop it reads 0.3 ms p50 / 4 ms p99 on a loaded 2-core host (epoll's timeout
is rounded up to whole ms, plus the timer wake), against 0.14 / 0.2 ms for the posted callback,
measured with both probes side by side (``loadtests/README.md``, "Client event-loop lag").
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

from .metrics import percentile

#: Flag the client when the p99 lag exceeds this share of the median ITL (the smallest latency reported) ...
BOTTLENECK_SHARE_OF_ITL = 0.10
#: ... but never below this floor (the probe's own idle noise, 0.2 ms p99 measured) ...
BOTTLENECK_FLOOR_MS = 0.5
#: ... and always above this, whatever the latencies.
BOTTLENECK_CAP_MS = 5.0
#: A loop thread that ran at least this share of the window is busy with its own work: its lag is
#: the client's, however long it also waited for a CPU.
CLIENT_BUSY_CORE_SHARE = 0.5
#: Where the schedstat file is (Linux): the calling thread's CPU time, and its time spent ready to
#: run but waiting for a CPU (ns; Documentation/scheduler/sched-stats.rst).
SCHEDSTAT = "/proc/thread-self/schedstat"


def runqueue_wait_s() -> float | None:
    """This thread's total time waiting on a run queue (s); None where the kernel does not say."""
    try:
        with open(SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class LoopLagProbe:
    """Measures the running loop's lag from a daemon thread; use in the loop's own thread."""

    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.lags_s: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, args=(loop,), name="loop-lag-probe", daemon=True)
        self._thread.start()

    def stop(self) -> list[float]:
        """Stop probing; returns the lags (s). Callbacks still queued are not waited for."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return list(self.lags_s)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.wait(self.period_s):
            try:
                loop.call_soon_threadsafe(self._record, time.perf_counter())
            except RuntimeError:  # loop closed
                return

    def _record(self, posted: float) -> None:
        if not self._stop.is_set():
            self.lags_s.append(time.perf_counter() - posted)


def bottleneck_threshold_ms(median_itl_ms: float | None, median_ttft_ms: float | None) -> float:
    """p99 lag (ms) above which the client is the bottleneck: 10 % of the median ITL (median TTFT
    when there is no ITL, e.g. non-streamed), at least 0.5 ms, at most 5 ms."""
    ref = median_itl_ms if median_itl_ms else median_ttft_ms
    share = BOTTLENECK_SHARE_OF_ITL * ref if ref else BOTTLENECK_CAP_MS
    return min(BOTTLENECK_CAP_MS, max(BOTTLENECK_FLOOR_MS, share))


def loop_lag_metrics(
    lags_s: Sequence[float],
    period_s: float,
    median_itl_ms: float | None,
    median_ttft_ms: float | None,
    client_cpu_share: float | None = None,
    client_wait_share: float | None = None,
) -> dict[str, Any]:
    """``client_loop_lag_*`` fields and the bottleneck verdict (``client_bottleneck``, with a note).

    ``client_cpu_share`` / ``client_wait_share``: the loop thread's CPU time, and its time ready to
    run but waiting for a CPU (:func:`runqueue_wait_s`), each over the window's wall time. A lag over
    the threshold while the loop waited for a CPU longer than it ran (and ran under
    :data:`CLIENT_BUSY_CORE_SHARE`) is contention from other
    processes on the host (on a small machine, the server itself), not the client's own load: more
    harness processes would not help, so it is noted but not called a client bottleneck."""
    ms = [x * 1000.0 for x in lags_s]
    threshold = bottleneck_threshold_ms(median_itl_ms, median_ttft_ms)
    p99 = percentile(ms, 99) if ms else None
    ref = "median ITL" if median_itl_ms else "median TTFT"
    over = p99 is not None and p99 > threshold
    contended = (
        over
        and None not in (client_cpu_share, client_wait_share)
        and client_cpu_share < CLIENT_BUSY_CORE_SHARE
        and client_wait_share > client_cpu_share
    )
    flagged = over and not contended
    note = None
    if contended:
        note = (
            f"client event-loop lag p99 {p99:.2f} ms exceeds {threshold:.2f} ms, but the client's loop waited for a CPU "
            f"{100 * client_wait_share:.0f} % of the window and ran {100 * client_cpu_share:.0f} %: other processes on this host "
            "(a server on the same machine) took the CPU, not the client's load; latency figures include that delay"
        )
    elif flagged:
        note = (
            f"client event-loop lag p99 {p99:.2f} ms exceeds {threshold:.2f} ms (10 % of the {ref}, within "
            f"{BOTTLENECK_FLOOR_MS:g}-{BOTTLENECK_CAP_MS:g} ms): the client is the bottleneck, and the latency "
            "figures include client delay; use fewer streams per harness process or a bigger client machine"
        )
    elif not ms:
        note = "no event-loop lag samples (run shorter than one probe period)"
    return {
        "client_loop_lag_period_ms": period_s * 1000.0,
        "client_loop_lag_samples": len(ms),
        "client_loop_lag_p50_ms": percentile(ms, 50) if ms else None,
        "client_loop_lag_p99_ms": p99,
        "client_loop_lag_max_ms": max(ms) if ms else None,
        "client_bottleneck": flagged,
        "client_cpu_contended": contended,
        "client_bottleneck_threshold_ms": threshold,
        "client_bottleneck_note": note,
        "client_cpu_share": client_cpu_share,
        "client_cpu_wait_share": client_wait_share,
    }
