"""A fake NVML (module-shaped) for clock and energy tests: records every setter call.

Also: per-call NVML error injection (:meth:`FakeNvml.inject`), an optional state file so that
several processes (a server, its watchdog, the next start, ``reset-clocks``) share one fake GPU,
and :class:`FakeZeusd`, an in-process zeusd (HTTP over a Unix socket) in front of a FakeNvml.
"""

from __future__ import annotations

import http.server
import json
import os
import socketserver
import threading
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace


class Clock:
    """A monotonic clock the test moves by hand: ``clock.t`` seconds (``clock()`` reads it)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_UNKNOWN = 999
    NVML_CLOCK_SM = 1

    def __init__(
        self, energy_mj: int = 1_000_000, no_permission: bool = False, mem_locks: bool = False, state_file: str | Path | None = None
    ) -> None:
        self.energy_mj = energy_mj
        self.no_permission = no_permission
        self.fail_energy = False
        self.fail_set: int | None = None
        self.calls: list[tuple] = []
        self.state_file = Path(state_file) if state_file else None
        self._locked: tuple[int, int] | None = None
        self._mem_locked: tuple[int, int] | None = None
        self.mem_locks = mem_locks  # False: memory locks NotSupported, as on the H200
        self.faults: dict[str, list] = {}
        self.power_mw = 250_000

    # -- state (optionally shared through a file) -------------------------------------------
    def _state(self) -> dict:
        if self.state_file is None:
            return {"locked": self._locked, "mem_locked": self._mem_locked}
        try:
            d = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            d = {}
        return {k: tuple(d[k]) if d.get(k) else None for k in ("locked", "mem_locked")}

    def _put(self, key: str, value) -> None:
        if self.state_file is None:
            setattr(self, "_" + key, value)
            return
        d = self._state()
        d[key] = value
        tmp = self.state_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d))
        tmp.replace(self.state_file)

    locked = property(lambda self: self._state()["locked"], lambda self, v: self._put("locked", v))
    mem_locked = property(lambda self: self._state()["mem_locked"], lambda self, v: self._put("mem_locked", v))

    # -- fault injection ---------------------------------------------------------------------
    def inject(self, fn: str, code: int, times: int | None = 1, after: bool = False) -> None:
        """Make ``fn`` raise NVML error ``code`` for its next ``times`` calls (``None``: always).

        ``after=True``: the call takes effect and *then* fails (the worst case for a setter).
        """
        self.faults[fn] = [code, times, after]

    def _fault(self, fn: str, when_after: bool) -> None:
        f = self.faults.get(fn)
        if not f or f[2] != when_after:
            return
        code, left, _ = f
        if left is None or left > 0:
            if left is not None:
                f[1] -= 1
            raise NVMLError(code)

    def _check(self) -> None:
        if self.no_permission:
            raise NVMLError(self.NVML_ERROR_NO_PERMISSION)
        if self.fail_set is not None:
            raise NVMLError(self.fail_set)

    # module-level functions of pynvml used outside a handle
    def nvmlInit(self):
        self.calls.append(("init",))

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return f"h:{uuid}"

    def nvmlDeviceGetPciInfo(self, h):
        class Pci:
            busId = b"00000000:41:00.0"

        return Pci()

    # setters
    def nvmlDeviceSetGpuLockedClocks(self, h, lo, hi):
        self.calls.append(("set", lo, hi))
        self._fault("nvmlDeviceSetGpuLockedClocks", False)
        self._check()
        self.locked = (lo, hi)
        self._fault("nvmlDeviceSetGpuLockedClocks", True)

    def nvmlDeviceResetGpuLockedClocks(self, h):
        self.calls.append(("reset",))
        self._fault("nvmlDeviceResetGpuLockedClocks", False)
        self._check()
        self.locked = None
        self._fault("nvmlDeviceResetGpuLockedClocks", True)

    def nvmlDeviceSetMemoryLockedClocks(self, h, lo, hi):
        self.calls.append(("set_mem", lo, hi))
        self._fault("nvmlDeviceSetMemoryLockedClocks", False)
        if not self.mem_locks:
            raise NVMLError(3)  # not supported, as on the H200
        self._check()
        self.mem_locked = (lo, hi)
        self._fault("nvmlDeviceSetMemoryLockedClocks", True)

    def nvmlDeviceResetMemoryLockedClocks(self, h):
        self.calls.append(("reset_mem",))
        self._fault("nvmlDeviceResetMemoryLockedClocks", False)
        if not self.mem_locks:
            raise NVMLError(3)
        self._check()
        self.mem_locked = None
        self._fault("nvmlDeviceResetMemoryLockedClocks", True)

    # getters
    def nvmlDeviceGetSupportedMemoryClocks(self, h):
        self._fault("nvmlDeviceGetSupportedMemoryClocks", False)
        return [3201, 2201]

    def nvmlDeviceGetSupportedGraphicsClocks(self, h, mem):
        self._fault("nvmlDeviceGetSupportedGraphicsClocks", False)
        return [1980, 1500, 1200, 990, 345]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if self.fail_energy:
            raise NVMLError(self.NVML_ERROR_UNKNOWN)
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, h):
        return self.power_mw

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=143771 << 20, used=self.memory_used_b, free=(143771 << 20) - self.memory_used_b)

    memory_used_b = 600 << 20

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


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _FakeZeusdHandler(http.server.BaseHTTPRequestHandler):
    """One request to a :class:`FakeZeusd` (``fake``: set on the subclass each FakeZeusd makes)."""

    protocol_version = "HTTP/1.1"
    fake: "FakeZeusd"

    def log_message(self, *args):  # quiet; client_address is '' on a Unix socket
        pass

    def _reply(self, status: int, body: object = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:  # an empty write after the headers can meet a client that already read them and closed (EPIPE)
            self.wfile.write(data)

    def _handle(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        params = dict(urllib.parse.parse_qsl(url.query))
        auth = self.headers.get("Authorization")
        self.fake.requests.append((method, url.path, params, auth))
        if method == "GET" and url.path == "/discover":
            return self._reply(200, self._discover())
        if self.fake.token is not None and auth != f"Bearer {self.fake.token}":
            return self._reply(401, {"error": "missing or invalid token"})
        if method == "GET" and url.path in ("/gpu/get_cumulative_energy", "/gpu/get_power"):
            return self._read(url.path, params)
        return self._control(method, url.path, params)

    def _discover(self) -> dict:
        fake = self.fake
        return {
            "gpus": [
                {"id": i, "name": "NVIDIA H200", "pci_address": a, "cumulative_energy_available": True} for i, a in enumerate(fake.pci)
            ],
            "cpus": [],
            "enabled_api_groups": ["gpu-control"] if fake.control_enabled else [],
            "auth_required": fake.token is not None,
        }

    def _read(self, path: str, params: dict) -> None:
        fake = self.fake
        if not fake.read_enabled:
            return self._reply(404)
        ids = [int(x) for x in params["gpu_ids"].split(",")] if "gpu_ids" in params else range(len(fake.gpus))
        if path == "/gpu/get_power":
            power_mw = {str(i): fake.gpus[i].nvmlDeviceGetPowerUsage(f"h{i}") for i in ids}
            return self._reply(200, {"timestamp_ms": int(time.time() * 1000), "power_mw": power_mw})
        return self._reply(200, {str(i): {"energy_mj": fake.gpus[i].nvmlDeviceGetTotalEnergyConsumption(f"h{i}")} for i in ids})

    def _control(self, method: str, path: str, params: dict) -> None:
        fns = {
            "/gpu/set_gpu_locked_clocks": "nvmlDeviceSetGpuLockedClocks",
            "/gpu/reset_gpu_locked_clocks": "nvmlDeviceResetGpuLockedClocks",
            "/gpu/set_mem_locked_clocks": "nvmlDeviceSetMemoryLockedClocks",
            "/gpu/reset_mem_locked_clocks": "nvmlDeviceResetMemoryLockedClocks",
        }
        if method != "POST" or path not in fns or not self.fake.control_enabled:
            return self._reply(404)
        errors = {}
        status = 200
        for gid in (int(x) for x in params["gpu_ids"].split(",")):
            nv = self.fake.gpus[gid]
            args = (int(params["min_clock_mhz"]), int(params["max_clock_mhz"])) if "min_clock_mhz" in params else ()
            try:
                getattr(nv, fns[path])(f"h{gid}", *args)
            except NVMLError as exc:
                code = {4: 403, 3: 400}.get(exc.value, 500)
                errors[str(gid)] = f"NVML error {exc.value}" + (" NotSupported" if exc.value == 3 else "")
                status = max(status, code)
        return self._reply(status, {"errors": errors} if errors else None)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


class FakeZeusd:
    """zeusd's GPU API (0.4+, ``docs/zeusd/api.md``) over a Unix socket, backed by FakeNvml GPUs.

    ``POST /gpu/{set,reset}_{gpu,mem}_locked_clocks?gpu_ids=..&block=..`` and ``GET /discover``.
    NVML errors map like zeusd's: NoPermission -> 403, NotSupported -> 400, others -> 500. With
    ``token`` set, requests without ``Authorization: Bearer <token>`` get 401;
    ``control_enabled=False`` answers 404 (gpu-control group disabled). ``requests`` records
    ``(method, path, params, authorization)``. The gpu-read group too: ``GET
    /gpu/get_cumulative_energy`` and ``/gpu/get_power`` (``read_enabled=False``: 404). With
    ``socket_path=None`` it listens on TCP at 127.0.0.1 (``url``), as ``zeusd serve --mode tcp``.
    """

    def __init__(
        self,
        socket_path: str | Path | None,
        gpus: list[FakeNvml] | None = None,
        token: str | None = None,
        control_enabled: bool = True,
        pci: list[str] | None = None,
        read_enabled: bool = True,
    ) -> None:
        self.socket_path = str(socket_path) if socket_path is not None else None
        self.read_enabled = read_enabled
        self.gpus = gpus if gpus is not None else [FakeNvml()]
        self.pci = pci or [f"0000:{0x41 + i:02x}:00.0" for i in range(len(self.gpus))]
        self.token = token
        self.control_enabled = control_enabled
        self.requests: list[tuple] = []
        handler = type("Handler", (_FakeZeusdHandler,), {"fake": self})
        if self.socket_path is None:
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            self._server.daemon_threads = True
            self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        else:
            self._server = _UnixHTTPServer(self.socket_path, handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> "FakeZeusd":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self.socket_path is not None:
            Path(self.socket_path).unlink(missing_ok=True)


class _FieldValue:
    """Shaped like nvidia-ml-py's ``c_nvmlFieldValue_t`` (only what the meter reads)."""

    def __init__(self, field_id: int, ret: int, value_mw: int) -> None:
        class _V:
            uiVal = value_mw

        self.fieldId, self.nvmlReturn, self.value = field_id, ret, _V()


class FakeNvmlDevices(FakeNvml):
    """A fake NVML with several devices (index -> UUID), instant power and per-call fault injection.

    ``faults[name] = code`` makes the NVML function ``name`` raise ``NVMLError(code)`` from then on.
    Energy and power are per device (``energy_mj[i]``, ``power_mw[i]``); handles are indices.
    """

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_FI_DEV_POWER_INSTANT = 186

    def __init__(self, uuids=("GPU-aaaa-0000",), energy_mj=1_000_000, power_w=250.0, instant=True) -> None:
        super().__init__(energy_mj=energy_mj)
        self.uuids = list(uuids)
        self.energy_mj = [int(energy_mj)] * len(self.uuids)
        self.power_mw = [int(power_w * 1000)] * len(self.uuids)
        self.instant = instant
        self.faults: dict[str, int] = {}
        self.calls_by_name: dict[str, int] = {}

    def _hit(self, name: str) -> None:
        self.calls_by_name[name] = self.calls_by_name.get(name, 0) + 1
        if name in self.faults:
            raise NVMLError(self.faults[name])

    def nvmlInit(self):
        self._hit("nvmlInit")

    def nvmlDeviceGetCount(self):
        self._hit("nvmlDeviceGetCount")
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._hit("nvmlDeviceGetHandleByIndex")
        if not 0 <= int(i) < len(self.uuids):
            raise NVMLError(2)  # invalid argument
        return int(i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self._hit("nvmlDeviceGetHandleByUUID")
        if uuid not in self.uuids:
            raise NVMLError(6)  # not found
        return self.uuids.index(uuid)

    def nvmlDeviceGetUUID(self, h):
        self._hit("nvmlDeviceGetUUID")
        return self.uuids[h]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self._hit("nvmlDeviceGetTotalEnergyConsumption")
        return self.energy_mj[h]

    def nvmlDeviceGetFieldValues(self, h, ids):
        self._hit("nvmlDeviceGetFieldValues")
        ret = self.NVML_SUCCESS if self.instant else self.NVML_ERROR_NOT_SUPPORTED
        return [_FieldValue(i, ret, self.power_mw[h]) for i in ids]

    def nvmlDeviceGetPowerUsage(self, h):
        self._hit("nvmlDeviceGetPowerUsage")
        return self.power_mw[h]

    def nvmlDeviceGetClockInfo(self, h, kind):
        self._hit("nvmlDeviceGetClockInfo")
        return super().nvmlDeviceGetClockInfo(h, kind)

    def nvmlDeviceGetTemperature(self, h, kind):
        self._hit("nvmlDeviceGetTemperature")
        return 47

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._hit("nvmlDeviceGetCurrentClocksEventReasons")
        return 0x4


def metrics_text(stats_dir, version: str = "t") -> str:
    """What /metrics would serve for ``stats_dir``: the plugin's collector alone, exposition text."""
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_powersave.metrics import PowersaveCollector

    reg = CollectorRegistry()
    reg.register(PowersaveCollector(stats_dir, version))
    return generate_latest(reg).decode()


def rank_decisions(stats_dir, ranks=(0, 1)) -> dict[int, list[tuple]]:
    """Per rank, each traced step's (phase, prefill tokens, decode tokens, SM clock target)."""
    import json

    out = {}
    for r in ranks:
        rows = [json.loads(x) for x in (stats_dir / f"trace-rank{r}.jsonl").read_text().splitlines()]
        # Step lines only: the trace also holds closed-loop decisions, boost switches and energy ticks.
        out[r] = [(x["phase"], x["prefill"], x["decode"], x["sm_target"]) for x in rows if "t" in x]
    return out


def energy_series(metrics_text: str) -> tuple[dict[str, float], dict[str, float]]:
    """``powersave_gpu_energy_joules_total`` and ``powersave_engine_energy_joules_total`` samples
    of a /metrics page, keyed by the series name with its labels."""
    per_gpu, engine = {}, {}
    for line in metrics_text.splitlines():
        if line.startswith("powersave_gpu_energy_joules_total{"):
            per_gpu[line.split(" ")[0]] = float(line.rsplit(" ", 1)[1])
        if line.startswith("powersave_engine_energy_joules_total{"):
            engine[line.split(" ")[0]] = float(line.rsplit(" ", 1)[1])
    return per_gpu, engine


class FakeCudaStepTimer:
    """Stands in for ``device.step_timer.CudaEventStepTimer`` where the test machine has no CUDA.

    A mark is ``[start_s, stop_s, done]``; by default every step is complete at once and its GPU time
    is its host time. ``gpu_ms``: report this GPU time instead (a step whose launch is not its run:
    async scheduling); ``hold()``: the GPU has not reached the marks stopped from now on, until
    ``finish()``; ``fail_on``: raise from that method (a CUDA fault).
    """

    source = "cuda_events"

    def __init__(self, device_index: int = 0, gpu_ms: float | None = None, fail_on: str | None = None) -> None:
        self.device_index = device_index
        self.gpu_ms = gpu_ms
        self.fail_on = fail_on
        self._holding = False
        self._held: list[list] = []
        self.started = self.released = 0

    def _maybe_fail(self, name: str) -> None:
        if self.fail_on == name:
            raise RuntimeError(f"CUDA error: fake fault in {name}")

    def start(self):
        self._maybe_fail("start")
        self.started += 1
        return [time.monotonic(), None, False]

    def stop(self, mark) -> None:
        self._maybe_fail("stop")
        mark[1] = time.monotonic()
        if self._holding:
            self._held.append(mark)
        else:
            mark[2] = True

    def hold(self) -> None:
        self._holding = True

    def finish(self) -> None:
        self._holding = False
        for m in self._held:
            m[2] = True
        self._held.clear()

    def elapsed_ms(self, mark):
        self._maybe_fail("elapsed_ms")
        if not mark[2]:
            return None
        return self.gpu_ms if self.gpu_ms is not None else (mark[1] - mark[0]) * 1e3

    def release(self, mark) -> None:
        self.released += 1
