"""The device layer (vllm_powersave.device): typed NVML errors, one resolution per device, MIG,
clock-event reason names, the zeusd client's error typing, and that nothing else imports pynvml."""

import ast
import logging
from pathlib import Path

import pytest
from fakes import FakeNvml, FakeNvmlDevices, FakeZeusd, NVMLError
from test_energy_runtime import make_runtime, run_steps, scrape, warnings_seen  # noqa: F401 - fixture

from vllm_powersave.clocks import ClockController, LeaseStore, NvmlClockBackend
from vllm_powersave.device import (
    CLOCK_EVENT_REASONS,
    GpuError,
    GpuInvalidArgumentError,
    GpuLostError,
    GpuMigError,
    GpuNoPermissionError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuUnavailableError,
    GpuUnknownError,
    NvmlGpu,
    ZeusdApiDisabledError,
    ZeusdClient,
    ZeusdError,
    ZeusdRefusedError,
    ZeusdUnreachableError,
    decode_clock_event_reasons,
    map_nvml_error,
)
from vllm_powersave.energy.meters import open_nvml_meter
from vllm_powersave.settings import load_settings

REPO = Path(__file__).resolve().parent.parent

# nvml.h return code -> the exception a caller catches
CODE_CLASSES = {
    1: GpuUnavailableError,  # uninitialized
    2: GpuInvalidArgumentError,
    3: GpuNotSupportedError,
    4: GpuNoPermissionError,
    6: GpuNotFoundError,
    9: GpuUnavailableError,  # driver not loaded
    12: GpuUnavailableError,  # library not found
    13: GpuNotSupportedError,  # function not found in this driver
    15: GpuLostError,
    16: GpuLostError,  # reset required
    18: GpuUnavailableError,  # library / kernel module version mismatch
    24: GpuInvalidArgumentError,  # frequency not supported
    28: GpuNotFoundError,
    999: GpuUnknownError,
    10: GpuUnknownError,  # timeout: no class of its own
}


@pytest.mark.parametrize("code", CODE_CLASSES)
def test_each_nvml_error_code_raises_its_typed_exception(code):
    exc = map_nvml_error(NVMLError(code), "nvmlDeviceGetPowerUsage")
    assert type(exc) is CODE_CLASSES[code] and isinstance(exc, GpuError)
    assert exc.code == code and "nvmlDeviceGetPowerUsage" in str(exc)
    # the same through a device call: the NVML error never leaks
    nvml = FakeNvmlDevices()
    nvml.faults["nvmlDeviceGetPowerUsage"] = code
    with pytest.raises(CODE_CLASSES[code]) as info:
        NvmlGpu(nvml, 0, "GPU-aaaa-0000").average_power_w()
    assert info.value.code == code and isinstance(info.value.__cause__, NVMLError)


def test_missing_nvml_function_or_foreign_exception_is_typed():
    with pytest.raises(GpuNotSupportedError, match="nvmlDeviceGetEnforcedPowerLimit"):
        NvmlGpu(FakeNvml(), "h0").power_limit_w()  # an older binding without the function
    assert type(map_nvml_error(ValueError("ctypes trouble"))) is GpuUnknownError


def test_device_is_resolved_by_uuid_once_for_a_whole_run(monkeypatch, tmp_path, warnings_seen):  # noqa: F811
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))
    runtime = make_runtime(monkeypatch, tmp_path, nvml)  # CUDA_VISIBLE_DEVICES=GPU-bbbb-1111
    try:
        run_steps(runtime, nvml, 6)
        runtime.publish()
    finally:
        runtime.close()
    assert runtime.gpu_id == "GPU-bbbb-1111"
    assert nvml.calls_by_name["nvmlDeviceGetHandleByUUID"] == 1
    assert "nvmlDeviceGetHandleByIndex" not in nvml.calls_by_name
    assert nvml.calls_by_name["nvmlDeviceGetTotalEnergyConsumption"] > 6  # the one handle served every read
    assert warnings_seen == []


class FakeMigNvml(FakeNvmlDevices):
    """Device 0 is a GPU in MIG mode; device 1 one of its MIG instances (a handle NVML marks as MIG)."""

    def __init__(self) -> None:
        super().__init__(uuids=("GPU-aaaa-0000", "MIG-aaaa-0000-0001"))

    def nvmlDeviceIsMigDeviceHandle(self, h):
        self._hit("nvmlDeviceIsMigDeviceHandle")
        return int(h == 1)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h):
        self._hit("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        if h != 1:
            raise NVMLError(2)
        return 0

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if h == 1:
            raise NVMLError(3)  # a MIG handle has no energy counter of its own
        return super().nvmlDeviceGetTotalEnergyConsumption(h)


def test_mig_device_resolves_its_parent_gpu():
    nvml = FakeMigNvml()
    mig = NvmlGpu.for_cuda_device(0, visible="MIG-aaaa-0000-0001", nvml=nvml)
    assert mig.is_mig() and mig.parent().uuid == "GPU-aaaa-0000" and mig.parent().handle == 0
    assert mig.parent() is mig.parent()  # resolved once
    whole = NvmlGpu.from_index(0, nvml)
    assert not whole.is_mig() and whole.parent() is whole
    # chip-wide readings come from the parent; energy and power are refused (they are the whole GPU's)
    assert mig.sm_clock_mhz() == 1980 and mig.temperature_c() == 47
    with pytest.raises(GpuMigError, match="whole GPU GPU-aaaa-0000"):
        mig.total_energy_mj()
    with pytest.raises(GpuMigError):
        mig.power_w()
    assert mig.parent().total_energy_mj() == 1_000_000


def test_mig_energy_disabled_with_one_warning_naming_mig(caplog):
    nvml = FakeMigNvml()
    mig = NvmlGpu.for_cuda_device(0, visible="MIG-aaaa-0000-0001", nvml=nvml)
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        meter = open_nvml_meter(mig, start_thread=False)
        for _ in range(3):
            assert meter.energy_j() is None
            meter.power_w()
            meter.extra()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "MIG" in warnings[0] and "GPU-aaaa-0000" in warnings[0]
    assert not meter.available and "MIG" in meter.unavailable_reason
    assert meter.sm_clock_mhz() == 1980  # the gauges that are the chip's still show


def test_mig_energy_through_the_worker_is_marked_unavailable(monkeypatch, tmp_path, warnings_seen):  # noqa: F811
    nvml = FakeMigNvml()
    runtime = make_runtime(monkeypatch, tmp_path, nvml, visible="MIG-aaaa-0000-0001")
    try:
        run_steps(runtime, nvml, 3)
        m = scrape(tmp_path)
    finally:
        runtime.close()
    assert runtime.gpu_id == "MIG-aaaa-0000-0001"
    assert m['powersave_energy_available{gpu="MIG-aaaa-0000-0001",method="none"}'] == 0.0
    assert not any(k.startswith("powersave_gpu_energy_joules_total") for k in m)
    assert len(warnings_seen) == 1 and "MIG" in warnings_seen[0].getMessage()


def test_mig_parent_clocks_are_never_locked(tmp_path, caplog):
    nvml = FakeMigNvml()
    nvml.calls.clear()
    mig = NvmlGpu.from_uuid("MIG-aaaa-0000-0001", nvml)
    for call in (lambda: mig.lock_sm_clocks_mhz(1200, 1200), mig.reset_sm_clocks, lambda: mig.lock_mem_clocks_mhz(2201, 2201)):
        with pytest.raises(GpuMigError, match="shared"):
            call()
    settings = load_settings(
        {
            "clocks": {
                "backend": "nvml",
                "min_dwell_ms": 0,
                "lease_dir": str(tmp_path / "leases"),
                "presets": {"decode": {"sm_clock_mhz": 1200}},
            }
        },
        env={},
    ).clocks
    with caplog.at_level(logging.WARNING, logger="vllm.powersave.clocks"):
        ctl = ClockController(NvmlClockBackend(mig), settings, gpu_id=mig.uuid, asynchronous=False, watchdog=False)
        for phase in ("decode", "prefill", "decode"):
            ctl.on_phase(phase)
        ctl.close()
    assert ctl.backend.kind == "dry-run"
    falls = [r.getMessage() for r in caplog.records if "falls back to dry-run" in r.getMessage()]
    assert len(falls) == 1 and "MIG" in falls[0]
    assert nvml.calls == [] and nvml.locked is None  # no setter reached NVML, for the MIG or its parent
    assert LeaseStore(tmp_path / "leases").all() == []


def test_clock_event_reasons_decoded_into_names():
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(0x4) == ["sw_power_cap"]
    assert decode_clock_event_reasons(0x8 | 0x4 | 0x1) == ["gpu_idle", "sw_power_cap", "hw_slowdown"]
    assert decode_clock_event_reasons(0x20 | 0x40 | 0x80) == ["sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"]
    assert decode_clock_event_reasons(0x4 | 0x1000) == ["sw_power_cap", "unknown_0x1000"]
    gpu = NvmlGpu(FakeNvmlDevices(), 0, "GPU-aaaa-0000")
    assert gpu.clock_event_reasons_mask() == 0x4 and gpu.clock_event_reasons() == ["sw_power_cap"]

    class OldBinding:  # before NVML 12 the same mask was called "throttle reasons"
        def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
            return 0x8 | 0x20

    assert NvmlGpu(OldBinding(), 0).clock_event_reasons() == ["hw_slowdown", "sw_thermal_slowdown"]


def test_clock_event_reason_names_cover_every_bit_nvidia_ml_py_defines():
    pynvml = pytest.importorskip("pynvml")
    bits = {
        v
        for k, v in vars(pynvml).items()
        if k.startswith("nvmlClocksEventReason")
        and k not in ("nvmlClocksEventReasonAll", "nvmlClocksEventReasonNone")
        and isinstance(v, int)
    }
    assert bits and bits <= set(CLOCK_EVENT_REASONS)
    assert CLOCK_EVENT_REASONS[pynvml.nvmlClocksEventReasonSwPowerCap] == "sw_power_cap"
    assert CLOCK_EVENT_REASONS[pynvml.nvmlClocksEventReasonHwSlowdown] == "hw_slowdown"


def test_zeusd_refusals_are_typed_apart_from_faults(tmp_path):
    sock = str(tmp_path / "zeusd.sock")
    with pytest.raises(ZeusdUnreachableError) as info:
        ZeusdClient(sock).reset_sm_clocks(0)
    assert isinstance(info.value, GpuNoPermissionError)
    gpu = FakeNvml()
    with FakeZeusd(sock, [gpu], token="t") as daemon:
        with pytest.raises(ZeusdRefusedError, match="HTTP 401"):
            ZeusdClient(sock).lock_sm_clocks_mhz(0, 1200, 1200)
        client = ZeusdClient(sock, token="t")
        client.lock_sm_clocks_mhz(0, 1200, 1200)
        assert gpu.locked == (1200, 1200)
        assert client.total_energy_mj([0]) == {0: 1_000_000} and client.power_mw() == {0: 250_000}
        gpu.inject("nvmlDeviceResetGpuLockedClocks", 999)
        with pytest.raises(ZeusdError, match="HTTP 500") as info:
            client.reset_sm_clocks(0)
        assert not isinstance(info.value, GpuNoPermissionError) and info.value.status == 500
        with pytest.raises(ZeusdError) as info:
            client.lock_mem_clocks_mhz(0, 2201, 2201)  # memory locks NotSupported behind the daemon
        assert info.value.not_supported() and not isinstance(info.value, GpuNoPermissionError)
        assert daemon.requests[-1][3] == "Bearer t"
    with FakeZeusd(sock, [FakeNvml()], control_enabled=False, read_enabled=False):
        with pytest.raises(ZeusdApiDisabledError, match="gpu-control API group not enabled"):
            ZeusdClient(sock).lock_sm_clocks_mhz(0, 1200, 1200)
        with pytest.raises(ZeusdApiDisabledError, match="gpu-read API group not enabled"):
            ZeusdClient(sock).total_energy_mj()
    with FakeZeusd(None, [FakeNvml(), FakeNvml()]) as tcp:  # zeusd serve --mode tcp
        assert ZeusdClient(tcp.url).total_energy_mj() == {0: 1_000_000, 1: 1_000_000}


def _imports_pynvml(path: Path) -> list[int]:
    """Lines of ``path`` that import pynvml (import, from-import, __import__ or importlib)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pynvml" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pynvml":
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "pynvml" for a in node.args):
            lines.append(node.lineno)
    return lines


def test_no_module_outside_the_device_layer_imports_pynvml():
    device = REPO / "vllm_powersave" / "device"
    offenders = {}
    for pkg in ("vllm_powersave", "loadtests"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            if device in path.parents:
                continue
            if lines := _imports_pynvml(path):
                offenders[str(path.relative_to(REPO))] = lines
    assert offenders == {}
    # the check itself sees an import where there is one
    assert _imports_pynvml(device / "nvml.py")


def test_metrics_label_clock_event_reasons_by_name(monkeypatch, tmp_path, warnings_seen):  # noqa: F811
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"))  # reasons mask 0x4: SW power cap
    runtime = make_runtime(monkeypatch, tmp_path, nvml)
    try:
        run_steps(runtime, nvml, 2)
        m = scrape(tmp_path)
    finally:
        runtime.close()
    assert m['powersave_clock_event_reasons{gpu="GPU-bbbb-1111",reasons="sw_power_cap"}'] == 4.0
