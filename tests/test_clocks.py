import json
import logging
import os
import subprocess
import sys

import pytest
from fakes import Clock, FakeNvml

from vllm_powersave.clocks import ClockController, DryRunClockBackend, LeaseStore, NvmlClockBackend, SimulatedClockBackend
from vllm_powersave.device import NvmlGpu
from vllm_powersave.settings import load_settings
from vllm_powersave.sim.gpu import SimulatedGpu


def _settings(tmp_path, **clocks):
    base = {
        "backend": "nvml",
        "min_dwell_ms": 500,
        "lease_dir": str(tmp_path / "leases"),
        "presets": {"decode": {"sm_clock_mhz": 1210}, "idle": {"sm_clock_mhz": 345}},
    }
    base.update(clocks)
    return load_settings({"clocks": base}, env={}).clocks


def _ctl(tmp_path, nvml, clock, **kw):
    return ClockController(
        NvmlClockBackend(NvmlGpu(nvml, "h0")), _settings(tmp_path, **kw), gpu_id="GPU-test", asynchronous=False, clock=clock, watchdog=False
    )


def test_presets_snap_to_supported_clocks(tmp_path):
    ctl = _ctl(tmp_path, FakeNvml(), Clock(100.0))
    assert ctl.presets["decode"].sm_clock_mhz == 1200  # 1210 is not supported; highest below is 1200
    ctl.close()


def test_dwell_lowers_only_after_min_dwell_and_raises_at_once(tmp_path):
    nvml, clock = FakeNvml(), Clock(100.0)
    ctl = _ctl(tmp_path, nvml, clock)
    ctl.on_phase("decode")  # first decode step: wants lower, dwell starts
    assert nvml.calls == []
    clock.t += 0.3
    ctl.on_phase("decode")
    assert nvml.calls == []
    clock.t += 0.25  # 0.55 s of uninterrupted decode
    ctl.on_phase("decode")
    assert nvml.calls == [("set", 1200, 1200)]
    ctl.on_phase("decode")  # no-op: same target
    assert len(nvml.calls) == 1
    clock.t += 0.01
    ctl.on_phase("prefill")  # higher clock (driver default): immediately
    assert nvml.calls[-1] == ("reset",)
    clock.t += 0.1
    ctl.on_phase("decode")  # dwell restarts
    clock.t += 0.1
    ctl.on_phase("prefill")  # interrupts: still at default, nothing to do
    clock.t += 0.45
    ctl.on_phase("decode")  # only 0 s since this decode run began
    assert nvml.calls[-1] == ("reset",)
    assert [d.phase for d in ctl.decisions] == ["decode", "prefill"] and ctl.n_changes == 2
    ctl.close()


def test_restore_on_close_and_lease_lifecycle(tmp_path):
    nvml, clock = FakeNvml(), Clock(100.0)
    ctl = _ctl(tmp_path, nvml, clock, min_dwell_ms=0)
    ctl.on_phase("decode")
    lease = tmp_path / "leases" / "GPU-test.json"
    assert json.loads(lease.read_text())["pid"] == os.getpid()
    ctl.close()
    assert nvml.locked is None and nvml.calls[-1] == ("reset",)
    assert not lease.exists()
    ctl.close()  # idempotent
    assert nvml.calls.count(("reset",)) == 1


def test_permission_denied_falls_back_to_dry_run_with_one_warning(tmp_path, caplog):
    nvml, clock = FakeNvml(no_permission=True), Clock(100.0)
    ctl = _ctl(tmp_path, nvml, clock, min_dwell_ms=0)
    with caplog.at_level(logging.WARNING, logger="vllm.powersave.clocks"):
        ctl.on_phase("decode")
        ctl.on_phase("prefill")
        ctl.on_phase("decode")
    assert isinstance(ctl.backend, DryRunClockBackend)
    assert [r for r in caplog.records if "dry-run" in r.getMessage()].__len__() == 1
    assert list(ctl.backend.calls) == [("set", 1200, None), ("reset", None, None), ("set", 1200, None)]
    assert nvml.calls == [("set", 1200, 1200)]  # the only real attempt
    assert not (tmp_path / "leases" / "GPU-test.json").exists()
    ctl.close()


def test_nvml_fault_stops_control_resets_once_and_keeps_going(tmp_path):
    nvml, clock = FakeNvml(), Clock(100.0)
    ctl = _ctl(tmp_path, nvml, clock, min_dwell_ms=0)
    ctl.on_phase("decode")
    nvml.fail_set = 999
    ctl.on_phase("prefill")  # reset fails -> fault
    assert ctl.disabled_reason is not None
    n = len(nvml.calls)
    ctl.on_phase("decode")
    assert len(nvml.calls) == n  # never touched again
    ctl.close()


def test_stale_lease_of_dead_process_is_reset_at_start(tmp_path):
    leases = LeaseStore(tmp_path / "leases")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leases.acquire("GPU-test", 1200)
    p = tmp_path / "leases" / "GPU-test.json"
    p.write_text(json.dumps({"gpu": "GPU-test", "pid": int(dead.stdout), "sm_clock_mhz": 1200}))
    nvml = FakeNvml()
    nvml.locked = (1200, 1200)
    ctl = _ctl(tmp_path, nvml, Clock(100.0))
    # The lease does not say whether memory was locked too: both are reset (NotSupported is fine).
    assert nvml.calls == [("reset",), ("reset_mem",)] and nvml.locked is None
    assert not p.exists()
    ctl.close()


def test_sigkilled_owner_lease_recovered_by_cli(tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, %r)\n"
        "from vllm_powersave.clocks import LeaseStore\n"
        "LeaseStore(%r).acquire('GPU-x', 990); print('locked', flush=True); time.sleep(60)\n"
    ) % (os.getcwd(), str(tmp_path / "leases"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    proc.kill()
    proc.wait()
    stale = LeaseStore(tmp_path / "leases").stale()
    assert [s["gpu"] for s in stale] == ["GPU-x"] and stale[0]["pid"] == proc.pid


def test_async_apply_coalesces_to_latest_target(tmp_path):
    import time as _time

    class SlowNvml(FakeNvml):
        def nvmlDeviceSetGpuLockedClocks(self, h, lo, hi):
            _time.sleep(0.05)  # an NVML call takes milliseconds: decisions pile up meanwhile
            super().nvmlDeviceSetGpuLockedClocks(h, lo, hi)

        def nvmlDeviceResetGpuLockedClocks(self, h):
            _time.sleep(0.05)
            super().nvmlDeviceResetGpuLockedClocks(h)

    nvml, clock = SlowNvml(), Clock(100.0)
    ctl = ClockController(
        NvmlClockBackend(NvmlGpu(nvml, "h0")),
        _settings(tmp_path, min_dwell_ms=0),
        gpu_id="GPU-a",
        asynchronous=True,
        clock=clock,
        watchdog=False,
    )
    for phase in ["decode", "prefill"] * 7 + ["decode"]:
        ctl.on_phase(phase)
    assert len(ctl.decisions) == 15
    deadline = _time.monotonic() + 5
    while nvml.locked != (1200, 1200) and _time.monotonic() < deadline:
        _time.sleep(0.01)
    _time.sleep(0.1)
    applied = list(nvml.calls)
    assert applied[-1] == ("set", 1200, 1200)  # the newest target wins
    assert len(applied) < 15  # older targets were coalesced away
    ctl.close()
    assert nvml.locked is None  # restored at exit


def test_simulated_backend_drives_simulated_gpu(tmp_path):
    gpu = SimulatedGpu()
    s = load_settings(
        {
            "clocks": {"backend": "simulated", "min_dwell_ms": 0, "presets": {"decode": {"sm_clock_mhz": 1200}}},
            "energy": {"meter": "simulated"},
        },
        env={},
    ).clocks
    ctl = ClockController(SimulatedClockBackend(gpu), s, asynchronous=False)
    ctl.on_phase("decode")
    assert gpu.sm_clock_mhz <= 1200 and gpu.locked
    ctl.close()
    assert gpu.sm_clock_mhz == gpu.spec.f_max_mhz and not gpu.locked


def test_dry_run_never_calls_a_setter(tmp_path):
    backend = DryRunClockBackend()
    s = load_settings({"clocks": {"min_dwell_ms": 0, "presets": {"decode": {"sm_clock_mhz": 1200}}}}, env={}).clocks
    ctl = ClockController(backend, s, asynchronous=False)
    ctl.on_phase("decode")
    ctl.close()
    assert list(backend.calls)[0][0] == "set" and list(backend.calls)[-1][0] == "reset"


def test_watchdog_resets_clocks_of_a_sigkilled_owner(tmp_path):
    import threading

    from vllm_powersave.clocks.watchdog import watch

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    store = LeaseStore(tmp_path / "leases")
    (tmp_path / "leases").mkdir()
    (tmp_path / "leases" / "GPU-w.json").write_text(json.dumps({"gpu": "GPU-w", "pid": owner.pid, "sm_clock_mhz": 1200}))
    (tmp_path / "leases" / "GPU-other.json").write_text(json.dumps({"gpu": "GPU-other", "pid": os.getpid(), "sm_clock_mhz": 990}))
    resets, out = [], {}
    t = threading.Thread(
        target=lambda: out.setdefault("r", watch(owner.pid, store, lambda lease: resets.append(lease["gpu"]), poll_s=0.05))
    )
    t.start()
    assert resets == []
    owner.kill()
    owner.wait()
    t.join(timeout=10)
    assert out["r"] == ["GPU-w"] and resets == ["GPU-w"]
    assert not (tmp_path / "leases" / "GPU-w.json").exists()
    assert (tmp_path / "leases" / "GPU-other.json").exists()  # a live owner's lease is left alone


def test_failed_reset_keeps_lease_and_close_retries(tmp_path):
    nvml, clock = FakeNvml(), Clock(100.0)
    ctl = _ctl(tmp_path, nvml, clock, min_dwell_ms=0)
    ctl.on_phase("decode")
    nvml.fail_set = 999
    ctl.on_phase("prefill")  # reset fails: control stops, GPU may still be locked
    lease = tmp_path / "leases" / "GPU-test.json"
    assert lease.exists() and nvml.locked == (1200, 1200)
    nvml.fail_set = None
    ctl.close()  # retries the reset
    assert nvml.locked is None and not lease.exists()


def test_close_racing_a_pending_reset_leaves_no_lock(tmp_path):
    import time as _time

    for _ in range(20):
        nvml, clock = FakeNvml(), Clock(100.0)
        ctl = ClockController(
            NvmlClockBackend(NvmlGpu(nvml, "h0")),
            _settings(tmp_path, min_dwell_ms=0),
            gpu_id="GPU-r",
            asynchronous=True,
            clock=clock,
            watchdog=False,
        )
        ctl.on_phase("decode")
        _time.sleep(0.01)
        ctl.on_phase("prefill")
        ctl.close()
        assert nvml.locked is None
        assert not (tmp_path / "leases" / "GPU-r.json").exists()


def test_slow_set_finishing_after_close_started_is_undone(tmp_path):
    import time as _time

    class SlowSet(FakeNvml):
        def nvmlDeviceSetGpuLockedClocks(self, h, lo, hi):
            _time.sleep(0.3)
            super().nvmlDeviceSetGpuLockedClocks(h, lo, hi)

    nvml = SlowSet()
    ctl = ClockController(
        NvmlClockBackend(NvmlGpu(nvml, "h0")),
        _settings(tmp_path, min_dwell_ms=0),
        gpu_id="GPU-s",
        asynchronous=True,
        clock=Clock(100.0),
        watchdog=False,
    )
    ctl.on_phase("decode")
    _time.sleep(0.05)  # the set is in flight
    ctl.close()
    assert nvml.locked is None and nvml.calls[-1] == ("reset",)


@pytest.mark.parametrize("content", ["[1]", '"str"', '{"pid": "abc"}', "null", '{"pid": 1e300}', "\xff\xfe"])
def test_corrupt_lease_is_treated_as_stale_not_a_crash(tmp_path, content):
    d = tmp_path / "leases"
    d.mkdir()
    (d / "GPU-bad.json").write_text(content, errors="surrogateescape") if content != "\xff\xfe" else (d / "GPU-bad.json").write_bytes(
        b"\xff\xfe"
    )
    stale = LeaseStore(d).stale()
    assert [s["gpu"] for s in stale] == ["GPU-bad"]


def test_stale_lease_whose_reset_fails_is_kept(tmp_path):
    d = tmp_path / "leases"
    d.mkdir()
    (d / "GPU-test.json").write_text(json.dumps({"gpu": "GPU-test", "pid": -5}))
    nvml = FakeNvml()
    nvml.fail_set = 999
    ctl = _ctl(tmp_path, nvml, Clock(100.0))
    assert (d / "GPU-test.json").exists()
    nvml.fail_set = None
    ctl.close()
