"""Out-of-process watchdog: resets a GPU's clocks when the process that locked them dies.

``atexit`` and vLLM's own signal handling cover normal exits, SIGTERM and SIGINT; a SIGKILL or an
OOM kill runs no Python at all. So the first real clock lock of a worker starts this watchdog in
its own session (a ``kill`` of the server's process group does not reach it). It polls the owner's
PID and, once the owner is gone, resets every GPU still leased to it and removes the leases; then it
exits. A normal exit releases the leases first, leaving the watchdog nothing to do.

Usage: ``python -m vllm_powersave.clocks.watchdog --pid PID [--lease-dir DIR] [--poll-s 1.0]``
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable

from .controller import LeaseStore, _pid_alive


def watch(owner_pid: int, leases: LeaseStore, reset: Callable[[str], None], poll_s: float = 1.0,
          stop: threading.Event | None = None) -> list[str]:
    """Block until ``owner_pid`` dies, then ``reset(gpu_uuid)`` each GPU it still leases.

    Returns the GPU ids reset. Errors of one reset do not stop the others.
    """
    while _pid_alive(owner_pid):
        if stop is not None and stop.wait(poll_s):
            return []
        if stop is None:
            time.sleep(poll_s)
    done = []
    for lease in leases.stale():
        if int(lease.get("pid", -1)) != owner_pid:
            continue
        gpu = str(lease["gpu"])
        try:
            reset(gpu)
            done.append(gpu)
        except Exception as exc:
            print(f"powersave watchdog: reset of {gpu} failed: {exc}", file=sys.stderr)
            continue
        leases.release(gpu)
    return done


def _nvml_reset(gpu_uuid: str) -> None:
    import pynvml

    from .backends import NvmlClockBackend

    pynvml.nvmlInit()
    NvmlClockBackend(pynvml, pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)).reset()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_powersave.clocks.watchdog")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--lease-dir", default="/tmp/vllm-powersave/leases")
    ap.add_argument("--poll-s", type=float, default=1.0)
    ns = ap.parse_args(argv)
    reset = watch(ns.pid, LeaseStore(ns.lease_dir), _nvml_reset, ns.poll_s)
    if reset:
        print(f"powersave watchdog: owner {ns.pid} died; reset clocks of {', '.join(reset)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
