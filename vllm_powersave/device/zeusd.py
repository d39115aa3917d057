"""Client of Zeus's privileged daemon ``zeusd`` (https://ml.energy/zeus), over its Unix socket or TCP.

zeusd (0.4+, ``docs/zeusd/api.md`` of ml-energy/zeus) runs as root and exposes NVML's setters
(API group ``gpu-control``) and readings (``gpu-read``) over HTTP, so that a server without
CAP_SYS_ADMIN can lock clocks and a harness on another host can read energy:

* ``POST /gpu/{set,reset}_{gpu,mem}_locked_clocks?gpu_ids=..&min_clock_mhz=..&max_clock_mhz=..&block=true``;
* ``GET /gpu/get_cumulative_energy?gpu_ids=..`` -> ``{"0": {"energy_mj": N}}``;
  ``GET /gpu/get_power`` -> ``{"timestamp_ms": T, "power_mw": {"0": P}}``;
* ``GET /discover`` -> GPUs with their PCI addresses, enabled API groups.

Status 200 is success. Refusals map to :class:`~.errors.GpuNoPermissionError` subclasses (socket
missing or refused, 401/403: token missing, without the scope, or NVML NoPermission; 404: API group
not enabled); every other failure is a :class:`ZeusdError` with ``status`` (400: bad input or an
NVML NotSupported, see :meth:`ZeusdError.not_supported`; 500: an NVML fault).

Why not Zeus's own ``zeus.utils.zeusd.ZeusdClient``: it needs httpx and the whole ``zeus`` package
(numpy, pandas, scikit-learn, amdsmi), runs discovery and authentication at construction (a
daemon that is down makes the constructor raise, while a clock lease must be undoable later from
its socket path alone), and raises one ``ZeusdError`` for every non-200 status, so "may not"
(dry-run fallback) and "failed" (stop clock control) could only be told apart by parsing its text.
The endpoints and parameters here are the same.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from typing import Any

from .errors import GpuError, GpuNoPermissionError


class ZeusdError(GpuError):
    """zeusd answered with an error (``status``: HTTP status; 0 when no reply came)."""

    def __init__(self, message: str, status: int = 0, body: str = "") -> None:
        super().__init__(message)
        self.status, self.body = status, body

    def not_supported(self) -> bool:
        """zeusd answers an NVML NotSupported with HTTP 400 (bad input or unsupported operation)."""
        return self.status == 400 or "NotSupported" in self.body


class ZeusdUnreachableError(ZeusdError, GpuNoPermissionError):
    """No daemon at the socket (missing, refused, no access to it)."""


class ZeusdRefusedError(ZeusdError, GpuNoPermissionError):
    """401/403: token missing or without the scope, or NVML NoPermission on the daemon's side."""


class ZeusdApiDisabledError(ZeusdError, GpuNoPermissionError):
    """404: the API group (``gpu-control`` or ``gpu-read``) is not enabled on the daemon."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix domain socket (zeusd's default transport)."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class ZeusdClient:
    """Blocking zeusd client: one HTTP request per call, no connection kept (safe from any thread).

    Args:
        target: the daemon's Unix socket path, or ``http://host:port`` (``zeusd serve --mode tcp``).
        token: JWT (``$ZEUSD_TOKEN``) or ``None``; sent as ``Authorization: Bearer``, never logged.
        timeout_s: per-request timeout, s.
    """

    def __init__(self, target: str, token: str | None = None, timeout_s: float = 5.0) -> None:
        self.target = target
        self.token = token
        self.timeout_s = timeout_s
        self._prefix = ""
        if target.startswith(("http://", "https://")):
            u = urllib.parse.urlsplit(target)
            self._prefix = u.path.rstrip("/")  # a daemon behind a reverse proxy's path
            https = u.scheme == "https"
            self._tcp: tuple[str, int, bool] | None = (u.hostname or "localhost", u.port or (443 if https else 80), https)
        else:
            self._tcp = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._tcp is None:
            return _UnixHTTPConnection(self.target, self.timeout_s)
        host, port, https = self._tcp
        if https:  # zeusd itself speaks plain HTTP; a TLS proxy may front it
            return http.client.HTTPSConnection(host, port, timeout=self.timeout_s)
        return http.client.HTTPConnection(host, port, timeout=self.timeout_s)

    def request(self, method: str, path: str, params: dict[str, Any] | None = None, group: str = "gpu-control") -> Any:
        """One request; returns the decoded JSON body (``None`` for an empty one).

        ``group``: the API group the path belongs to, named in refusal messages.

        Raises:
            ZeusdUnreachableError, ZeusdRefusedError, ZeusdApiDisabledError: "may not".
            ZeusdError: timeout, any other status, a reply that is not JSON.
        """
        query = "?" + urllib.parse.urlencode(params) if params else ""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        conn = self._connection()
        try:
            conn.request(method, self._prefix + path + query, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
            raise ZeusdUnreachableError(f"zeusd unreachable at {self.target} ({type(exc).__name__})") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise ZeusdError(f"zeusd {path}: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()
        text = body.decode("utf-8", "replace").strip()
        if resp.status == 401:
            raise ZeusdRefusedError(f"zeusd {path}: HTTP 401 (token missing): {text[:120]}", 401, text)
        if resp.status == 403:
            raise ZeusdRefusedError(f"zeusd {path}: HTTP 403 (token without {group} scope, or NVML NoPermission): {text[:120]}", 403, text)
        if resp.status == 404:
            raise ZeusdApiDisabledError(f"zeusd {path}: HTTP 404 ({group} API group not enabled on the daemon)", 404, text)
        if resp.status != 200:
            raise ZeusdError(f"zeusd {path}: HTTP {resp.status}: {text[:200]}", resp.status, text)
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ZeusdError(f"zeusd {path}: reply is not JSON: {text[:80]!r}", resp.status, text) from exc

    # -- discovery -------------------------------------------------------------------------------
    def discover(self) -> dict[str, Any]:
        """``GET /discover``: GPUs (``id``, ``pci_address``), enabled API groups, auth."""
        return self.request("GET", "/discover") or {}

    def index_for_pci(self, pci_bus_id: str) -> int | None:
        """zeusd's index of the GPU at ``pci_bus_id`` (from :meth:`discover`), or ``None`` if not listed."""
        want = pci_bus_id.lower().lstrip("0")
        for g in self.discover().get("gpus", []):
            if str(g.get("pci_address", "")).lower().lstrip("0") == want:
                return int(g["id"])
        return None

    # -- gpu-control -----------------------------------------------------------------------------
    def _post(self, path: str, gpu_index: int, **params: Any) -> None:
        self.request("POST", path, {"gpu_ids": str(int(gpu_index)), **params, "block": "true"})

    def lock_sm_clocks_mhz(self, gpu_index: int, lo_mhz: int, hi_mhz: int) -> None:
        self._post("/gpu/set_gpu_locked_clocks", gpu_index, min_clock_mhz=int(lo_mhz), max_clock_mhz=int(hi_mhz))

    def reset_sm_clocks(self, gpu_index: int) -> None:
        self._post("/gpu/reset_gpu_locked_clocks", gpu_index)

    def lock_mem_clocks_mhz(self, gpu_index: int, lo_mhz: int, hi_mhz: int) -> None:
        self._post("/gpu/set_mem_locked_clocks", gpu_index, min_clock_mhz=int(lo_mhz), max_clock_mhz=int(hi_mhz))

    def reset_mem_clocks(self, gpu_index: int) -> None:
        self._post("/gpu/reset_mem_locked_clocks", gpu_index)

    # -- gpu-read --------------------------------------------------------------------------------
    @staticmethod
    def _ids(gpu_ids: list[int] | None) -> dict[str, str]:
        return {"gpu_ids": ",".join(str(int(g)) for g in gpu_ids)} if gpu_ids else {}

    def total_energy_mj(self, gpu_ids: list[int] | None = None) -> dict[int, int]:
        """NVML's total-energy counter per GPU (mJ), keyed by zeusd's index; ``None``: all GPUs."""
        body = self.request("GET", "/gpu/get_cumulative_energy", self._ids(gpu_ids), group="gpu-read") or {}
        try:
            return {int(k): int(v["energy_mj"]) for k, v in body.items()}
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ZeusdError(f"zeusd /gpu/get_cumulative_energy: unexpected reply ({type(exc).__name__})", 200) from exc

    def power_mw(self, gpu_ids: list[int] | None = None) -> dict[int, int]:
        """Power per GPU (mW), keyed by zeusd's index; ``None``: all GPUs."""
        body = self.request("GET", "/gpu/get_power", self._ids(gpu_ids), group="gpu-read") or {}
        try:
            return {int(k): int(v) for k, v in body["power_mw"].items()}
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ZeusdError(f"zeusd /gpu/get_power: unexpected reply ({type(exc).__name__})", 200) from exc
