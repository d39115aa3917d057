"""Which clock control a server gets by default: ``clocks.mode`` and ``clocks.backend: auto``.

:func:`select_clock_mode` is a pure function of the settings and of facts probed without setting
anything (:func:`clock_permission` reads ``/proc/self/status``; :func:`zeusd_reachable` asks the
daemon's read-only ``GET /discover``). The worker runtime probes, calls it once, and builds the
backend it names; tests call it with the facts directly.

In ``auto`` the closed-loop decode clock controller (``clocks/closed_loop.py``) decides unless
per-phase presets are given; the backend is chosen by permission, and where the process may not set
clocks the decisions are computed and reported, never applied (predicted only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import envs


@dataclass(frozen=True)
class ClockChoice:
    """The outcome of :func:`select_clock_mode`.

    ``controller``: ``closed_loop``, ``presets`` or ``off`` (no decisions); ``backend``: ``nvml``,
    ``zeusd``, ``dry-run`` or ``simulated``; ``reason``: why, in a few words (start line, /metrics);
    ``predicted_only``: decisions are recorded but never applied, so any saving is a prediction.
    """

    controller: str
    backend: str
    reason: str

    @property
    def predicted_only(self) -> bool:
        return self.controller != "off" and self.backend in ("dry-run",)


def clock_permission(status_path: str = "/proc/self/status", euid: int | None = None) -> tuple[bool, str]:
    """Whether this process may lock GPU clocks (root or CAP_SYS_ADMIN), without touching a GPU."""
    euid = (os.geteuid() if hasattr(os, "geteuid") else -1) if euid is None else euid
    if euid == 0:
        return True, "running as root"
    try:
        for line in Path(status_path).read_text().splitlines():
            if line.startswith("CapEff:") and (int(line.split()[1], 16) >> 21) & 1:
                return True, "CAP_SYS_ADMIN"
    except (OSError, ValueError, IndexError):
        pass
    return False, "no clock permission (needs root or CAP_SYS_ADMIN)"


def zeusd_reachable(socket_path: str | None, token: str | None = None, timeout_s: float = 2.0) -> tuple[bool, str]:
    """Whether Zeus's daemon answers its read-only ``GET /discover`` at ``socket_path``.

    Reachable is not the same as allowed: a daemon without the gpu-control group refuses the
    first set (HTTP 403/404), and the controller then falls back to dry-run with one warning.
    """
    if not socket_path:
        return False, "no zeusd socket (clocks.zeusd_socket or $ZEUSD_SOCK_PATH)"
    from ..device import GpuError, ZeusdClient

    try:
        ZeusdClient(socket_path, token, timeout_s).discover()
    except GpuError as exc:
        return False, f"zeusd not usable: {exc}"
    return True, f"zeusd at {socket_path}"


def select_clock_mode(
    mode: str,
    backend: str,
    has_presets: bool,
    *,
    force_dry_run: bool,
    on_gpu: bool,
    nvml_permission: tuple[bool, str],
    zeusd: tuple[bool, str],
) -> ClockChoice:
    """What decides the clocks and which backend applies them (see ``ClockSettings``).

    Args:
        mode: ``clocks.mode``. backend: ``clocks.backend`` (``auto`` = by permission).
        has_presets: the settings name per-phase presets (they win over the closed loop in ``auto``).
        force_dry_run: ``POWERSAVE_FORCE_DRY_RUN`` is set (shared GPUs): never a real backend.
        on_gpu: a GPU that NVML can address is present.
        nvml_permission: ``(may_set, why)`` from :func:`clock_permission`.
        zeusd: ``(reachable, why)`` from :func:`zeusd_reachable`.
    """
    if mode == "off":
        return ClockChoice("off", "dry-run", "clocks.mode off")
    if mode == "presets" or has_presets:
        controller, why_c = "presets", ("clocks.mode presets" if mode == "presets" else "presets given")
    else:
        controller, why_c = "closed_loop", "closed loop"
    if force_dry_run:
        return ClockChoice(controller, "dry-run", f"{why_c}; POWERSAVE_FORCE_DRY_RUN=1: predicted only")
    if mode == "dry_run":
        return ClockChoice(controller, "dry-run", f"{why_c}; clocks.mode dry_run: predicted only")
    if backend != "auto":
        return ClockChoice(controller, backend, f"{why_c}; clocks.backend {backend}")
    may, why = nvml_permission
    if on_gpu and may:
        return ClockChoice(controller, "nvml", f"{why_c}; {why}")
    ok, zwhy = zeusd
    if on_gpu and ok:
        return ClockChoice(controller, "zeusd", f"{why_c}; {zwhy}")
    if not on_gpu:
        return ClockChoice(controller, "dry-run", f"{why_c}; no GPU: predicted only")
    return ClockChoice(controller, "dry-run", f"{why_c}; no clock permission: predicted only")


def probe_and_select(settings: Any, on_gpu: bool, env: dict[str, str] | None = None) -> ClockChoice:
    """Probe this process (no setter called) and :func:`select_clock_mode` for ``settings``."""
    c = settings.clocks
    force = envs.force_dry_run(env)
    needs_probe = c.mode in ("auto", "closed_loop") and c.backend == "auto" and on_gpu and not force
    perm = clock_permission() if needs_probe else (False, "not probed")
    z = (False, "not probed")
    if needs_probe and not perm[0]:
        z = zeusd_reachable(c.zeusd_socket or envs.zeusd_socket(env), envs.zeusd_token(env))
    return select_clock_mode(c.mode, c.backend, bool(c.presets), force_dry_run=force, on_gpu=on_gpu, nvml_permission=perm, zeusd=z)
