"""Energy sources for the measured window.

Preference order:

1. The server's Prometheus counter ``powersave_gpu_energy_joules_total`` (published by
   the vllm-powersave plugin, labels ``gpu``, ``phase``, ``source``) at ``{base}/metrics``.
2. Local NVML total-energy counters (only meaningful when the server runs on this host).
3. None: energy fields are ``None`` and the report says "no energy source".
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

METRIC = "powersave_gpu_energy_joules"
_SAMPLE_NAMES = {METRIC, METRIC + "_total"}

LabelKey = tuple[tuple[str, str], ...]


def parse_energy_counters(text: str) -> dict[LabelKey, float] | None:
    """Extract ``powersave_gpu_energy_joules_total`` samples (joules) keyed by label set.

    ``prometheus_client`` strips ``_total`` from a counter's family name but not from an
    untyped family's, so both spellings are accepted; ``_created`` samples are skipped.
    Returns ``None`` when the metric is absent or the text does not parse.
    """
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[LabelKey, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name not in _SAMPLE_NAMES:
                continue
            for s in fam.samples:
                if s.name in _SAMPLE_NAMES:
                    found[tuple(sorted(s.labels.items()))] = float(s.value)
    except Exception:  # the parser raises bare ValueError/TypeError variants on bad input
        return None
    return found or None


@dataclass
class EnergyReading:
    """Energy over the measured window. ``energy_j`` is None when no source exists."""

    energy_j: float | None = None
    window_s: float = 0.0
    source: str | None = None  # "measured" | "simulated"
    provider: str | None = None  # "server-metrics" | "nvml"
    by_phase_j: dict[str, float] = field(default_factory=dict)
    by_gpu_j: dict[str, float] = field(default_factory=dict)
    note: str = ""


def diff_counters(before: dict[LabelKey, float], after: dict[LabelKey, float]) -> EnergyReading:
    """Sum counter deltas (J) over label sets, per phase and per GPU, and derive the source label.

    A label set missing before counts from 0 (a series appears on first use); a counter
    that went down was reset, so its post-reset value is the delta (Prometheus semantics).
    ``source`` is "measured" only if every series that advanced says ``measured``;
    a mix, ``simulated``, or a missing label yields "simulated" (never overclaim).
    """
    total = 0.0
    by_phase: dict[str, float] = {}
    by_gpu: dict[str, float] = {}
    sources: set[str] = set()
    all_sources: set[str] = set()
    for key, v_after in after.items():
        v_before = before.get(key, 0.0)
        delta = v_after - v_before if v_after >= v_before else v_after
        labels = dict(key)
        src = labels.get("source", "")
        all_sources.add(src)
        if delta > 0:
            sources.add(src)
        total += delta
        phase = labels.get("phase", "unknown")
        by_phase[phase] = by_phase.get(phase, 0.0) + delta
        gpu = labels.get("gpu", "all")
        by_gpu[gpu] = by_gpu.get(gpu, 0.0) + delta
    considered = sources or all_sources
    source = "measured" if considered == {"measured"} else "simulated"
    return EnergyReading(
        energy_j=total, source=source, provider="server-metrics", by_phase_j=by_phase, by_gpu_j=by_gpu
    )


class NvmlEnergy:
    """Local GPU energy via ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver load)."""

    def __init__(self, handles: list[Any], indices: list[int], nvml: Any) -> None:
        self._handles = handles
        self._indices = indices
        self._nvml = nvml

    @classmethod
    def open(cls, gpus: list[int] | None) -> tuple[NvmlEnergy | None, str]:
        """Return ``(reader, "")`` or ``(None, reason)`` when NVML or the counter is unavailable."""
        try:
            import pynvml  # nvidia-ml-py; optional at runtime
        except ImportError:
            return None, "pynvml not installed"
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            indices = list(range(count)) if gpus is None else list(gpus)
            if not indices:
                return None, "no GPUs visible to NVML"
            bad = [i for i in indices if i >= count]
            if bad:
                return None, f"GPU indices {bad} not present (NVML sees {count})"
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
            reader = cls(handles, indices, pynvml)
            reader.read_j()  # fails early on GPUs without the energy counter (pre-Volta)
            return reader, ""
        except Exception as e:  # NVMLError has many subclasses; any of them means "unavailable"
            return None, f"NVML unavailable: {e}"

    def read_j(self) -> float:
        """Sum of the selected GPUs' energy counters in joules."""
        return sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles) / 1000.0

    def per_gpu_j(self) -> dict[str, float]:
        """Per-GPU counter values in joules, keyed by index."""
        return {
            str(i): self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0
            for i, h in zip(self._indices, self._handles)
        }

    async def aligned_per_gpu_j(self, max_wait_s: float = 0.25, poll_s: float = 0.002) -> tuple[float, dict[str, float]]:
        """``(t, per-GPU joules)`` taken right when the first GPU's counter updates.

        The counter advances in ~100 ms steps, so a window read at arbitrary times is off by up to
        a step at each edge (±2 % on a 5 s window). Starting and ending the window on a counter
        update removes that quantisation; the window then grows by < 100 ms per edge (the energy
        of that time is real and stays in). Falls back to a plain read after ``max_wait_s``.
        """
        h0 = self._handles[0]
        first = self._nvml.nvmlDeviceGetTotalEnergyConsumption(h0)
        deadline = time.perf_counter() + max_wait_s
        while time.perf_counter() < deadline:
            if self._nvml.nvmlDeviceGetTotalEnergyConsumption(h0) != first:
                break
            await asyncio.sleep(poll_s)
        return time.perf_counter(), self.per_gpu_j()


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str | None:
    """``GET {base_url}/metrics`` text, or None on any error (metrics are optional)."""
    try:
        async with session.get(
            base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False
        ) as resp:
            if resp.status != 200:
                return None
            return await resp.text(errors="replace")
    except Exception:  # unreachable/timeout/bad encoding: fall through to the next source
        return None


class EnergyMeter:
    """Brackets the measured window: call :meth:`start` before load and :meth:`stop` after."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, gpus: list[int] | None, timeout_s: float = 5.0, mode: str = "auto"):
        self._mode = mode
        self._session = session
        self._base_url = base_url
        self._gpus = gpus
        self._timeout_s = timeout_s
        self._before: dict[LabelKey, float] | None = None
        self._nvml: NvmlEnergy | None = None
        self._nvml_before: dict[str, float] | None = None
        self._t0 = 0.0
        self._note = ""

    async def start(self) -> None:
        """Take the "before" reading, choosing the first available source."""
        self._t0 = time.perf_counter()
        if self._mode == "none":
            self._note = "no energy source (disabled by energy='none')"
            return
        reason = "not tried"
        if self._mode in ("auto", "server"):
            text = await scrape_metrics(self._session, self._base_url, self._timeout_s)
            counters = parse_energy_counters(text) if text is not None else None
            self._t0 = time.perf_counter()
            if counters is None and text is not None and "powersave_info" in text:
                counters = {}  # plugin active, no step booked yet: every counter is still 0
            if counters is not None:
                self._before = counters
                return
            if self._mode == "server":
                self._note = f"no energy source (server has no {METRIC}_total)"
                return
        self._nvml, reason = NvmlEnergy.open(self._gpus)
        if self._nvml is not None:
            self._t0, self._nvml_before = await self._nvml.aligned_per_gpu_j()
        else:
            self._note = f"no energy source (server has no {METRIC}_total; {reason})"

    async def stop(self) -> EnergyReading:
        """Take the "after" reading and return the window's energy (J) and duration (s)."""
        if self._before is not None:
            text = await scrape_metrics(self._session, self._base_url, self._timeout_s)
            window = time.perf_counter() - self._t0
            after = parse_energy_counters(text) if text is not None else None
            if after is None:
                return EnergyReading(window_s=window, note="no energy source (final /metrics scrape failed)")
            r = diff_counters(self._before, after)
            r.window_s = window
            return r
        if self._nvml is not None and self._nvml_before is not None:
            try:
                t1, after_gpu = await self._nvml.aligned_per_gpu_j()
            except Exception as e:  # driver hiccup: report no energy instead of crashing the run
                return EnergyReading(window_s=time.perf_counter() - self._t0, note=f"no energy source (NVML read failed: {e})")
            window = t1 - self._t0
            by_gpu = {k: after_gpu[k] - self._nvml_before.get(k, 0.0) for k in after_gpu}
            return EnergyReading(
                energy_j=sum(by_gpu.values()),
                window_s=window,
                source="measured",
                provider="nvml",
                by_gpu_j=by_gpu,
                note="local NVML counters (server assumed to run on this host)",
            )
        return EnergyReading(window_s=time.perf_counter() - self._t0, note=self._note or "no energy source")
