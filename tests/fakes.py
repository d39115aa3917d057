"""A fake NVML (module-shaped) for clock and energy tests: records every setter call."""

from __future__ import annotations


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_UNKNOWN = 999
    NVML_CLOCK_SM = 1

    def __init__(self, energy_mj: int = 1_000_000, no_permission: bool = False) -> None:
        self.energy_mj = energy_mj
        self.no_permission = no_permission
        self.fail_energy = False
        self.fail_set: int | None = None
        self.calls: list[tuple] = []
        self.locked: tuple[int, int] | None = None
        self.power_mw = 250_000

    def _check(self) -> None:
        if self.no_permission:
            raise NVMLError(self.NVML_ERROR_NO_PERMISSION)
        if self.fail_set is not None:
            raise NVMLError(self.fail_set)

    # setters
    def nvmlDeviceSetGpuLockedClocks(self, h, lo, hi):
        self.calls.append(("set", lo, hi))
        self._check()
        self.locked = (lo, hi)

    def nvmlDeviceResetGpuLockedClocks(self, h):
        self.calls.append(("reset",))
        self._check()
        self.locked = None

    def nvmlDeviceSetMemoryLockedClocks(self, h, lo, hi):
        self.calls.append(("set_mem", lo, hi))
        raise NVMLError(3)  # not supported, as on the H200

    def nvmlDeviceResetMemoryLockedClocks(self, h):
        raise NVMLError(3)

    # getters
    def nvmlDeviceGetSupportedMemoryClocks(self, h):
        return [3201, 2201]

    def nvmlDeviceGetSupportedGraphicsClocks(self, h, mem):
        return [1980, 1500, 1200, 990, 345]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if self.fail_energy:
            raise NVMLError(self.NVML_ERROR_UNKNOWN)
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, h):
        return self.power_mw

    def nvmlDeviceGetClockInfo(self, h, kind):
        if kind == 2:  # NVML_CLOCK_MEM
            return 3201
        return self.locked[0] if self.locked else 1980

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_MEM = 2

    def nvmlDeviceGetTemperature(self, h, kind):
        return 47

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4  # SW power cap
