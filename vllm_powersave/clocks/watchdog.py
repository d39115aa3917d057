"""Out-of-process watchdog: resets a GPU's clocks when the process that locked them dies or hangs.

``atexit`` and vLLM's own signal handling cover normal exits, SIGTERM and SIGINT; a SIGKILL or an
OOM kill runs no Python at all, and a hung engine (a kernel or collective that never returns, a
frozen process) runs none that matters. So the first real clock lock of a worker starts this
watchdog in its own session (a ``kill`` of the server's process group does not reach it). It
polls, every ``poll_s``:

* the owner's PID: once the owner is gone, it resets every GPU still leased to it, removes the
  leases and exits;
* the owner's heartbeats (``<gpu>.hb``, written by the controller's background thread while it
  holds a lock, and withheld while a step has run longer than ``heartbeat_timeout_s``): if one is
  older than ``heartbeat_timeout_s`` the watchdog writes ``<gpu>.revoked`` (so the controller, if
  it ever wakes up, stops touching clocks) and resets that GPU once. The lease stays until the
  owner releases it or dies, so a reset that failed is retried at death.

A normal exit releases the leases first, leaving the watchdog nothing to do.

Usage: ``python -m vllm_powersave.clocks.watchdog --pid PID [--lease-dir DIR] [--poll-s 1.0]
[--heartbeat-timeout-s 30]``
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .backends import reset_from_lease
from .leases import LeaseStore, pid_alive


def _say(msg: str) -> None:
    print(f"powersave watchdog: {msg}", file=sys.stderr, flush=True)


def check_heartbeats(
    owner_pid: int, leases: LeaseStore, reset: Callable[[dict[str, Any]], None], heartbeat_timeout_s: float, revoked: set[str]
) -> list[str]:
    """One pass: revoke and reset (once) each lease of ``owner_pid`` whose heartbeat is too old.

    ``revoked`` carries the GPUs already handled across passes. Returns the GPU ids reset.
    """
    done = []
    for lease in leases.all():
        gpu = str(lease["gpu"])
        if lease["pid"] != owner_pid or gpu in revoked:
            continue
        age = leases.heartbeat_age_s(gpu)
        if age is None or age <= heartbeat_timeout_s:
            continue
        leases.revoke(gpu, owner_pid)  # first, so a waking owner cannot lock again unnoticed
        revoked.add(gpu)
        try:
            reset(lease)
            done.append(gpu)
            _say(f"owner {owner_pid} silent for {age:.1f} s (> {heartbeat_timeout_s:g} s); reset clocks of {gpu}")
        except Exception as exc:
            _say(f"owner {owner_pid} silent; reset of {gpu} failed: {exc} (retried when it exits)")
    return done


def watch(
    owner_pid: int,
    leases: LeaseStore,
    reset: Callable[[dict[str, Any]], None],
    poll_s: float = 1.0,
    stop: threading.Event | None = None,
    heartbeat_timeout_s: float | None = None,
) -> list[str]:
    """Block until ``owner_pid`` dies, then ``reset(lease)`` for each GPU it still leases.

    While the owner lives, a lease whose heartbeat is older than ``heartbeat_timeout_s`` (``None``:
    heartbeats not checked) is revoked and reset once (:func:`check_heartbeats`). Returns the GPU
    ids reset (heartbeat resets first, then those at death). Errors of one reset do not stop the
    others.
    """
    done: list[str] = []
    revoked: set[str] = set()
    while pid_alive(owner_pid):
        if heartbeat_timeout_s is not None:
            done += check_heartbeats(owner_pid, leases, reset, heartbeat_timeout_s, revoked)
        if stop is not None:
            if stop.wait(poll_s):
                return done
        else:
            time.sleep(poll_s)
    for lease in leases.stale():
        if lease["pid"] != owner_pid:
            continue
        gpu = str(lease["gpu"])
        try:
            reset(lease)
            done.append(gpu)
        except Exception as exc:
            _say(f"reset of {gpu} failed: {exc}")
            continue
        leases.release(gpu)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_powersave.clocks.watchdog")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--lease-dir", default="/tmp/vllm-powersave/leases")
    ap.add_argument("--poll-s", type=float, default=1.0)
    ap.add_argument("--heartbeat-timeout-s", type=float, default=None)
    ns = ap.parse_args(argv)
    reset = watch(ns.pid, LeaseStore(ns.lease_dir), reset_from_lease, ns.poll_s, heartbeat_timeout_s=ns.heartbeat_timeout_s)
    if reset:
        _say(f"owner {ns.pid} gone; reset clocks of {', '.join(reset)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
