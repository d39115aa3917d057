"""zeusd backend against an in-process fake zeusd (HTTP over a Unix socket, zeusd 0.4+ API)."""

import json
import logging
import os
import subprocess
import sys

import pytest
from fakes import FakeNvml, FakeZeusd

from vllm_powersave.clocks import ClockController, LeaseStore
from vllm_powersave.clocks.backends import ClockPermissionError, ZeusdClockBackend, reset_from_lease
from vllm_powersave.device import NvmlGpu
from vllm_powersave.settings import load_settings


def _settings(tmp_path, **kw):
    c = {
        "backend": "zeusd",
        "min_dwell_ms": 0,
        "lease_dir": str(tmp_path / "leases"),
        "presets": {"decode": {"sm_clock_mhz": 1200, "mem_clock_mhz": 2201}},
    }
    c.update(kw)
    return load_settings({"clocks": c}, env={}).clocks


def _ctl(tmp_path, backend, **kw):
    return ClockController(backend, _settings(tmp_path, **kw), gpu_id="GPU-z", asynchronous=False, watchdog=False)


def test_locks_and_resets_through_the_daemon(tmp_path):
    sock = str(tmp_path / "zeusd.sock")
    gpus = [FakeNvml(mem_locks=True), FakeNvml(mem_locks=True)]
    with FakeZeusd(sock, gpus) as daemon:
        ctl = _ctl(tmp_path, ZeusdClockBackend(sock, 1, supported=(345, 1200, 1980), supported_mem=(2201, 3201)))
        ctl.on_phase("decode")
        assert gpus[1].locked == (1200, 1200) and gpus[1].mem_locked == (2201, 2201) and gpus[0].locked is None
        lease = json.loads((tmp_path / "leases" / "GPU-z.json").read_text())
        assert lease["backend"] == "zeusd" and lease["socket"] == sock and lease["gpu_index"] == 1
        ctl.on_phase("prefill")
        assert gpus[1].locked is None and gpus[1].mem_locked is None
        ctl.on_phase("decode")
        ctl.close()
        assert gpus[1].locked is None and gpus[1].mem_locked is None
        assert LeaseStore(tmp_path / "leases").all() == []
        set_calls = [r for r in daemon.requests if r[1] == "/gpu/set_gpu_locked_clocks"]
        assert set_calls[0][:3] == (
            "POST",
            "/gpu/set_gpu_locked_clocks",
            {"gpu_ids": "1", "min_clock_mhz": "1200", "max_clock_mhz": "1200", "block": "true"},
        )


def test_token_is_sent_and_never_written_to_the_lease(tmp_path):
    sock = str(tmp_path / "zeusd.sock")
    gpu = FakeNvml()
    with FakeZeusd(sock, [gpu], token="s3cret") as daemon:
        ctl = _ctl(tmp_path, ZeusdClockBackend(sock, 0, token="s3cret"))
        ctl.on_phase("decode")
        assert gpu.locked == (1200, 1200)
        assert "s3cret" not in (tmp_path / "leases" / "GPU-z.json").read_text()
        assert {r[3] for r in daemon.requests} == {"Bearer s3cret"}
        ctl.close()
        assert gpu.locked is None


@pytest.mark.parametrize("case", ["no-token", "unreachable", "control-disabled", "nvml-no-permission"])
def test_refusal_falls_back_to_dry_run_with_one_warning(tmp_path, caplog, case):
    sock = str(tmp_path / "zeusd.sock")
    gpu = FakeNvml(no_permission=case == "nvml-no-permission")
    daemon = None
    if case != "unreachable":  # unreachable: no socket at all
        daemon = FakeZeusd(sock, [gpu], token="t" if case == "no-token" else None, control_enabled=case != "control-disabled")
        daemon.__enter__()
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.powersave.clocks"):
            ctl = _ctl(tmp_path, ZeusdClockBackend(sock, 0))
            for phase in ["decode", "prefill", "decode"]:
                ctl.on_phase(phase)  # never raises
            ctl.close()
        assert ctl.backend.kind == "dry-run"
        assert len([r for r in caplog.records if "falls back to dry-run" in r.getMessage()]) == 1
        assert gpu.locked is None and LeaseStore(tmp_path / "leases").all() == []
    finally:
        if daemon is not None:
            daemon.__exit__(None, None, None)


def test_daemon_side_nvml_fault_stops_control_after_one_reset(tmp_path):
    sock = str(tmp_path / "zeusd.sock")
    gpu = FakeNvml()
    with FakeZeusd(sock, [gpu]):
        ctl = _ctl(tmp_path, ZeusdClockBackend(sock, 0))
        ctl.on_phase("decode")
        gpu.inject("nvmlDeviceSetGpuLockedClocks", 999, times=None, after=True)  # Unknown -> HTTP 500
        ctl.on_phase("prefill")
        ctl.on_phase("decode")  # takes effect, then the daemon reports 500
        assert ctl.disabled_reason is not None and "HTTP 500" in ctl.disabled_reason
        assert gpu.locked is None and LeaseStore(tmp_path / "leases").all() == []
        n = len(gpu.calls)
        ctl.on_phase("prefill")
        assert len(gpu.calls) == n
        ctl.close()


def test_memory_locks_not_supported_by_the_gpu_behind_the_daemon(tmp_path, caplog):
    sock = str(tmp_path / "zeusd.sock")
    gpu = FakeNvml(mem_locks=False)
    with FakeZeusd(sock, [gpu]):
        with caplog.at_level(logging.WARNING, logger="vllm.powersave.clocks"):
            ctl = _ctl(tmp_path, ZeusdClockBackend(sock, 0))
            for phase in ["decode", "prefill", "decode"]:
                ctl.on_phase(phase)
        assert ctl.disabled_reason is None and gpu.locked == (1200, 1200)
        assert len([r for r in caplog.records if "memory-clock locks not supported" in r.getMessage()]) == 1
        ctl.close()
        assert gpu.locked is None


def test_crashed_servers_zeusd_lock_recovered_from_its_lease(tmp_path):
    sock = str(tmp_path / "zeusd.sock")
    gpu = FakeNvml()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    with FakeZeusd(sock, [gpu]):
        ZeusdClockBackend(sock, 0).set_clocks(1200)
        leases = LeaseStore(tmp_path / "leases")
        leases.acquire("GPU-z", 1200, {"backend": "zeusd", "socket": sock, "gpu_index": 0, "mem_locked": False})
        (tmp_path / "leases" / "GPU-z.json").write_text(
            json.dumps({**json.loads((tmp_path / "leases" / "GPU-z.json").read_text()), "pid": dead})
        )
        assert gpu.locked == (1200, 1200)
        # The next start, whatever backend it uses, undoes the lock the way the lease says.
        nxt = ClockController(ZeusdClockBackend(sock, 0), _settings(tmp_path), gpu_id="GPU-z", asynchronous=False, watchdog=False)
        assert gpu.locked is None and leases.all() == []
        nxt.close()
        ZeusdClockBackend(sock, 0).set_clocks(990)
        reset_from_lease({"gpu": "GPU-z", "backend": "zeusd", "socket": sock, "gpu_index": 0})  # watchdog / reset-clocks path
        assert gpu.locked is None


def test_gpu_index_matched_by_pci_address(tmp_path):
    sock = str(tmp_path / "zeusd.sock")
    with FakeZeusd(sock, [FakeNvml(), FakeNvml()], pci=["0000:01:00.0", "0000:41:00.0"]):
        assert ZeusdClockBackend.index_for_pci(sock, "00000000:41:00.0") == 1
        assert ZeusdClockBackend.index_for_pci(sock, "00000000:81:00.0") is None
    with pytest.raises(ClockPermissionError, match="unreachable"):
        ZeusdClockBackend.index_for_pci(sock, "00000000:41:00.0")
    assert not os.path.exists(sock)


def test_runtime_builds_the_zeusd_backend_or_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    from vllm_powersave.clocks import DryRunClockBackend
    from vllm_powersave.runtime.build import zeusd_backend
    from vllm_powersave.settings import load_settings as load

    monkeypatch.delenv("ZEUSD_SOCK_PATH", raising=False)
    nvml = FakeNvml()
    sock = str(tmp_path / "zeusd.sock")
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        b = zeusd_backend(load({"clocks": {"backend": "zeusd"}}, env={}), NvmlGpu(nvml, "h0"), 0)
    assert isinstance(b, DryRunClockBackend) and "ZEUSD_SOCK_PATH" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        b = zeusd_backend(load({"clocks": {"backend": "zeusd", "zeusd_socket": sock}}, env={}), NvmlGpu(nvml, "h0"), 0)
    assert isinstance(b, DryRunClockBackend) and len([r for r in caplog.records if "dry-run" in r.getMessage()]) == 1
    monkeypatch.setenv("ZEUSD_SOCK_PATH", sock)
    with FakeZeusd(sock, [FakeNvml(), FakeNvml()], pci=["0000:01:00.0", "0000:41:00.0"]):
        b = zeusd_backend(load({"clocks": {"backend": "zeusd"}}, env={}), NvmlGpu(nvml, "h0"), 0)
    assert isinstance(b, ZeusdClockBackend) and b.gpu_index == 1  # matched by PCI address, not by CUDA index
    assert b.supported_sm_clocks() == (345, 990, 1200, 1500, 1980)  # read locally with NVML
