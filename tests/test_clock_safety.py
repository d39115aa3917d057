"""Fault injection: every kill path and every NVML error at every call leaves the fake GPU unlocked.

Kill paths run a real child process that locks a fake GPU whose state lives in a file, so that
the child, the watchdog, the next start and ``reset-clocks`` all see one GPU.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from fakes import FakeNvml

from vllm_powersave.clocks import ClockController, LeaseStore, NvmlClockBackend
from vllm_powersave.clocks.backends import reset_from_lease
from vllm_powersave.clocks.watchdog import check_heartbeats, watch
from vllm_powersave.device import NvmlGpu
from vllm_powersave.settings import load_settings

TESTS = Path(__file__).parent
REPO = TESTS.parent

ERRORS = {"NotSupported": 3, "NoPermission": 4, "GpuIsLost": 15, "Unknown": 999}
CALLS = [
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetMemoryLockedClocks",
    "nvmlDeviceResetMemoryLockedClocks",
    "nvmlDeviceGetSupportedMemoryClocks",
    "nvmlDeviceGetSupportedGraphicsClocks",
]
SETTERS = [c for c in CALLS if "Set" in c or "Reset" in c]


def _settings(tmp_path, **kw):
    c = {
        "backend": "nvml",
        "min_dwell_ms": 0,
        "lease_dir": str(tmp_path / "leases"),
        "presets": {"decode": {"sm_clock_mhz": 1200, "mem_clock_mhz": 2201}, "idle": {"sm_clock_mhz": 345}},
    }
    c.update(kw)
    return load_settings({"clocks": c}, env={}).clocks


def _cases():
    for err in ERRORS:
        for call in CALLS:
            yield err, call, "once"
            yield err, call, "always"
    # A call that takes effect and then reports a fault. NoPermission and NotSupported are refusals
    # checked before NVML does anything, so only the other two can happen after the effect.
    for err in ("GpuIsLost", "Unknown"):
        for call in SETTERS:
            yield err, call, "after"


@pytest.mark.parametrize("err,call,mode", list(_cases()))
def test_nvml_error_at_every_call_leaves_gpu_unlocked(tmp_path, caplog, err, call, mode):
    nvml = FakeNvml(mem_locks=True)
    nvml.inject(call, ERRORS[err], times=None if mode == "always" else 1, after=mode == "after")
    with caplog.at_level(logging.WARNING, logger="vllm.powersave.clocks"):
        ctl = ClockController(
            NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path), gpu_id="GPU-f", asynchronous=False, watchdog=False
        )
        for phase in ["decode", "prefill", "decode", "idle", "prefill", "decode"]:
            ctl.on_phase(phase)  # never raises
        ctl.close()
    assert len([r for r in caplog.records if "falls back to dry-run" in r.getMessage()]) <= 1  # one warning at most
    leases = LeaseStore(tmp_path / "leases")
    if mode != "always":
        assert nvml.locked is None and nvml.mem_locked is None
        assert leases.all() == []
        return
    # Persistent fault: the GPU may stay locked only while a lease records it; recovery (watchdog,
    # next start, reset-clocks) succeeds once the fault clears.
    if nvml.locked is not None or nvml.mem_locked is not None:
        assert [lease["gpu"] for lease in leases.all()] == ["GPU-f"]
    nvml.faults.clear()
    for lease in leases.all():
        reset_from_lease(lease, nvml=nvml)
        leases.release(lease["gpu"])
    assert nvml.locked is None and nvml.mem_locked is None


def test_memory_clock_locked_where_supported_and_ignored_with_one_warning_where_not(tmp_path, caplog):
    nvml = FakeNvml(mem_locks=True)
    ctl = ClockController(
        NvmlClockBackend(NvmlGpu(nvml, "h0")),
        _settings(tmp_path, presets={"decode": {"sm_clock_mhz": 1210, "mem_clock_mhz": 2500}}),
        gpu_id="GPU-m",
        asynchronous=False,
        watchdog=False,
    )
    assert ctl.presets["decode"].mem_clock_mhz == 2201  # snapped to the supported list (3201, 2201)
    ctl.on_phase("decode")
    assert nvml.locked == (1200, 1200) and nvml.mem_locked == (2201, 2201)
    assert json.loads((tmp_path / "leases" / "GPU-m.json").read_text())["mem_locked"] is True
    ctl.close()
    assert nvml.locked is None and nvml.mem_locked is None

    h200 = FakeNvml(mem_locks=False)  # the H200: no memory locks
    with caplog.at_level(logging.WARNING, logger="vllm.powersave.clocks"):
        ctl = ClockController(
            NvmlClockBackend(NvmlGpu(h200, "h0")), _settings(tmp_path), gpu_id="GPU-h", asynchronous=False, watchdog=False
        )
        for phase in ["decode", "prefill", "decode"]:
            ctl.on_phase(phase)
    assert ctl.disabled_reason is None and h200.locked == (1200, 1200)
    assert [c for c in h200.calls if c[0] == "set_mem"] == [("set_mem", 2201, 2201)]  # tried once
    assert len([r for r in caplog.records if "memory-clock locks" in r.getMessage()]) == 1
    ctl.close()
    assert h200.locked is None


def test_out_of_range_presets_snap_to_the_supported_list(tmp_path):
    nvml = FakeNvml()
    s = _settings(tmp_path, presets={"decode": {"sm_clock_mhz": 4000}, "idle": {"sm_clock_mhz": 100}, "mixed": {"sm_clock_mhz": 1000}})
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), s, gpu_id="GPU-s", asynchronous=False, watchdog=False)
    assert {p: c.sm_clock_mhz for p, c in ctl.presets.items()} == {"decode": 1980, "idle": 345, "mixed": 990}
    ctl.close()


# -- kill paths ------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import faulthandler, os, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks if we hang
    # A shell without job control starts background jobs with SIGINT ignored, and the ignore is
    # inherited (a CI runner started with `&` is one): Python then installs no KeyboardInterrupt
    # handler. A server handles SIGINT itself (uvicorn does), so the child does too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path[:0] = [{tests!r}, {repo!r}]
    from fakes import FakeNvml
    from vllm_powersave.clocks import ClockController, NvmlClockBackend
    from vllm_powersave.device import NvmlGpu
    from vllm_powersave.settings import load_settings
    mode = sys.argv[1]
    nvml = FakeNvml(state_file={state!r})
    s = load_settings({{"clocks": {{"backend": "nvml", "min_dwell_ms": 0, "lease_dir": {leases!r}, "heartbeat_timeout_s": 1,
                        "presets": {{"decode": {{"sm_clock_mhz": 1200}}}}}}}}, env={{}}).clocks
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), s, gpu_id="GPU-k", asynchronous=True, watchdog=False)
    ctl.on_phase("decode")
    while nvml.locked is None:
        time.sleep(0.005)
    print("locked", flush=True)
    import select
    # Short waits: a signal delivered to another thread is only acted on when the main thread runs.
    while mode == "wait" or not select.select([sys.stdin], [], [], 0.05)[0]:
        time.sleep(0.05)
    if mode == "exit":
        sys.exit(0)
    raise RuntimeError("engine step failed")
""")


def _child(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS), repo=str(REPO), state=str(tmp_path / "gpu.json"), leases=str(tmp_path / "leases")))
    proc = subprocess.Popen(
        [sys.executable, str(script), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
    return proc, FakeNvml(state_file=tmp_path / "gpu.json"), LeaseStore(tmp_path / "leases")


@pytest.mark.parametrize("mode,sig", [("exit", None), ("exception", None), ("wait", signal.SIGTERM), ("wait", signal.SIGINT)])
def test_exit_paths_reset_clocks_in_process(tmp_path, mode, sig):
    proc, gpu, leases = _child(tmp_path, mode)
    assert gpu.locked == (1200, 1200) and leases.held("GPU-k")
    if sig is not None:
        proc.send_signal(sig)
    else:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    try:
        _, err = proc.communicate(timeout=30)  # drains stderr: a full pipe must not stall the child
    except subprocess.TimeoutExpired:
        # Every thread's stack, to see where it is stuck (this is how the inherited SIG_IGN above was found).
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"child still running 30 s after {mode}/{sig}; its threads:\n{err[-6000:]}")
    assert gpu.locked is None, err
    assert leases.all() == []


def test_sigkill_lock_recovered_at_next_start(tmp_path):
    proc, gpu, leases = _child(tmp_path, "wait")
    proc.kill()
    proc.wait()
    assert gpu.locked == (1200, 1200) and [lease["pid"] for lease in leases.stale()] == [proc.pid]
    nxt = ClockController(NvmlClockBackend(NvmlGpu(gpu, "h0")), _settings(tmp_path), gpu_id="GPU-k", asynchronous=False, watchdog=False)
    assert gpu.locked is None and leases.all() == []
    nxt.close()


def test_sigkill_lock_recovered_by_reset_clocks_cli(tmp_path, monkeypatch, capsys):
    from vllm_powersave import cli

    proc, gpu, leases = _child(tmp_path, "wait")
    proc.kill()
    proc.wait()
    monkeypatch.setitem(sys.modules, "pynvml", gpu)  # reset_from_lease imports pynvml
    assert cli.main(["reset-clocks", "--lease-dir", str(tmp_path / "leases")]) == 0
    assert "reset clocks of GPU-k" in capsys.readouterr().out
    assert gpu.locked is None and leases.all() == []
    assert cli.main(["reset-clocks", "--lease-dir", str(tmp_path / "leases")]) == 0
    assert "no clock leases to reset" in capsys.readouterr().out


def test_sigkill_lock_reset_by_watchdog(tmp_path):
    proc, gpu, leases = _child(tmp_path, "wait")
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault("r", watch(proc.pid, leases, lambda lease: reset_from_lease(lease, nvml=gpu), poll_s=0.02))
    )
    t.start()
    proc.kill()
    proc.wait()
    t.join(timeout=10)
    assert out["r"] == ["GPU-k"] and gpu.locked is None and leases.all() == []


def test_frozen_engine_reset_by_watchdog_heartbeat_and_stops_clock_control(tmp_path):
    """A live but frozen process (SIGSTOP) stops heart-beating: the watchdog resets its GPU."""
    proc, gpu, leases = _child(tmp_path, "wait")
    stop = threading.Event()
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "r", watch(proc.pid, leases, lambda lease: reset_from_lease(lease, nvml=gpu), poll_s=0.05, stop=stop, heartbeat_timeout_s=1.0)
        )
    )
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t.start()
        deadline = time.monotonic() + 20
        while gpu.locked is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gpu.locked is None  # reset while the owner still exists
        assert leases.revoked_for("GPU-k", proc.pid)
    finally:
        stop.set()
        t.join(timeout=10)
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=30)
    assert out["r"] == ["GPU-k"] and gpu.locked is None and leases.all() == []


def test_hung_step_withholds_heartbeat_and_revocation_stops_control(tmp_path):
    nvml = FakeNvml()
    ctl = ClockController(
        NvmlClockBackend(NvmlGpu(nvml, "h0")),
        _settings(tmp_path, heartbeat_timeout_s=5),
        gpu_id="GPU-hb",
        asynchronous=False,
        watchdog=False,
    )
    leases = LeaseStore(tmp_path / "leases")
    assert ctl.heartbeat() is False  # nothing locked: nothing to guard
    ctl.on_phase("decode")
    assert ctl.heartbeat() is True
    ctl.step_begun(now=time.monotonic() - 6)  # a step running for 6 s > 5 s: hung
    assert ctl.heartbeat() is False
    ctl.step_ended()
    assert ctl.heartbeat() is True
    # The watchdog sees an old heartbeat (aged by hand), revokes and resets once.
    hb = tmp_path / "leases" / "GPU-hb.hb"
    os.utime(hb, (time.time() - 10, time.time() - 10))
    resets, revoked = [], set()
    assert check_heartbeats(
        os.getpid(), leases, lambda lease: (resets.append(lease["gpu"]), reset_from_lease(lease, nvml=nvml)), 5.0, revoked
    ) == ["GPU-hb"]
    assert check_heartbeats(os.getpid(), leases, resets.append, 5.0, revoked) == []  # once only
    assert nvml.locked is None and leases.revoked_for("GPU-hb", os.getpid())
    # The owner wakes up: it stops touching clocks instead of locking again.
    assert ctl.heartbeat() is False and ctl.disabled_reason is not None and "heartbeats" in ctl.disabled_reason
    n = len(nvml.calls)
    ctl.on_phase("prefill")
    ctl.on_phase("decode")
    assert len(nvml.calls) == n and nvml.locked is None and leases.all() == []
    ctl.close()


def test_permission_error_after_an_earlier_lock_resets_it(tmp_path, caplog):
    """A token that expires (or a daemon that goes away) mid-run: the earlier lock is undone."""
    nvml = FakeNvml()
    ctl = ClockController(NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path), gpu_id="GPU-p", asynchronous=False, watchdog=False)
    ctl.on_phase("decode")
    assert nvml.locked == (1200, 1200)
    nvml.inject("nvmlDeviceSetGpuLockedClocks", 4, times=None)
    with caplog.at_level(logging.WARNING, logger="vllm.powersave.clocks"):
        ctl.on_phase("idle")  # refused: fall back to dry-run, and undo the 1200 MHz lock
        ctl.on_phase("prefill")
        ctl.on_phase("idle")
    assert nvml.locked is None and LeaseStore(tmp_path / "leases").all() == []
    assert len([r for r in caplog.records if "falls back to dry-run" in r.getMessage()]) == 1
    ctl.close()
