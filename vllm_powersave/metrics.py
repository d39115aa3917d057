"""``powersave_*`` series on vLLM's own ``/metrics`` (API-server process).

Workers publish a small JSON snapshot per rank into the run's stats directory (atomic rename);
this collector reads them at scrape time. No metric is named ``vllm:*`` because vLLM's Prometheus
logger unregisters those at start-up. Each energy, power and clock series carries ``source``
(``measured`` or ``simulated``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("vllm.powersave")


def read_snapshots(stats_dir: str | Path) -> list[dict[str, Any]]:
    """All rank snapshots in ``stats_dir`` (unreadable files are skipped)."""
    out = []
    d = Path(stats_dir)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("rank*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


class PowersaveCollector(Collector):
    """Prometheus collector over the worker snapshots of one server."""

    def __init__(self, stats_dir: str | Path, version: str = "") -> None:
        self.stats_dir = Path(stats_dir)
        self.version = version

    def collect(self) -> Iterator[Any]:
        snaps = read_snapshots(self.stats_dir)
        energy = CounterMetricFamily("powersave_gpu_energy_joules", "GPU energy by engine phase (J)", labels=["gpu", "phase", "source"])
        engine = CounterMetricFamily("powersave_engine_energy_joules", "Energy of all GPUs of the engine (every TP/PP rank) by phase (J)", labels=["phase", "source"])
        engine_sum: dict[tuple[str, str], float] = {}
        steps = CounterMetricFamily("powersave_steps", "Engine steps by phase", labels=["gpu", "phase"])
        tokens = CounterMetricFamily("powersave_tokens", "Tokens processed by kind (prefill, decode)", labels=["gpu", "kind"])
        power = GaugeMetricFamily("powersave_gpu_power_watts", "GPU power (W)", labels=["gpu", "source"])
        clock = GaugeMetricFamily("powersave_sm_clock_mhz", "SM clock (MHz)", labels=["gpu", "source"])
        target = GaugeMetricFamily("powersave_clock_target_mhz", "SM clock the controller wants (MHz; 0 = driver default)", labels=["gpu", "backend"])
        temp = GaugeMetricFamily("powersave_gpu_temperature_celsius", "GPU temperature (°C, measured)", labels=["gpu"])
        mem_clock = GaugeMetricFamily("powersave_mem_clock_mhz", "Memory clock (MHz, measured)", labels=["gpu"])
        reasons = GaugeMetricFamily("powersave_clock_event_reasons", "NVML clock-event (throttle) reasons bitmask (0x4 SW power cap, 0x20 SW thermal)", labels=["gpu"])
        changes = CounterMetricFamily("powersave_clock_changes", "Clock changes decided", labels=["gpu", "backend"])
        chunks = CounterMetricFamily("powersave_lm_head_calls", "LM-head calls by chunk count", labels=["gpu", "chunks"])
        req_e = CounterMetricFamily("powersave_request_energy_joules", "Energy attributed to finished requests (J; token share per step)", labels=["gpu", "source"])
        req_n = CounterMetricFamily("powersave_requests_finished", "Requests whose energy was attributed", labels=["gpu"])
        simulated = GaugeMetricFamily("powersave_energy_simulated", "1 if this GPU's energy figures are simulated, 0 if measured", labels=["gpu"])
        info = GaugeMetricFamily("powersave_info", "vllm-powersave is active", labels=["version", "source", "clock_backend", "cuda_perf_boost"])
        sources, backends, boost = set(), set(), set()
        for s in snaps:
            gpu, src, be = str(s.get("gpu", s.get("rank", "?"))), str(s.get("source", "none")), str(s.get("clock_backend", "?"))
            sources.add(src)
            backends.add(be)
            boost.add(str(s.get("cuda_perf_boost", "on")))
            for phase, j in (s.get("energy_j") or {}).items():
                energy.add_metric([gpu, phase, src], float(j))
                engine_sum[(phase, src)] = engine_sum.get((phase, src), 0.0) + float(j)
            for phase, n in (s.get("steps") or {}).items():
                if phase != "idle":  # idle is time without steps, not a kind of step
                    steps.add_metric([gpu, phase], float(n))
            for kind, n in (s.get("tokens") or {}).items():
                tokens.add_metric([gpu, kind], float(n))
            if s.get("power_w") is not None:
                power.add_metric([gpu, src], float(s["power_w"]))
            if s.get("sm_clock_mhz") is not None:
                clock.add_metric([gpu, src], float(s["sm_clock_mhz"]))
            target.add_metric([gpu, be], float(s.get("target_sm_clock_mhz") or 0))
            for fam, key in ((temp, "temperature_c"), (mem_clock, "mem_clock_mhz"), (reasons, "clock_event_reasons")):
                if s.get(key) is not None:
                    fam.add_metric([gpu], float(s[key]))
            changes.add_metric([gpu, be], float(s.get("clock_changes", 0)))
            for c, n in (s.get("lm_head_calls") or {}).items():
                chunks.add_metric([gpu, str(c)], float(n))
            simulated.add_metric([gpu], 1.0 if src == "simulated" else 0.0)
            if s.get("requests_finished"):
                req_e.add_metric([gpu, src], float(s.get("request_energy_j_finished", 0.0)))
                req_n.add_metric([gpu], float(s["requests_finished"]))
        for (phase, src), j in sorted(engine_sum.items()):
            engine.add_metric([phase, src], j)
        info.add_metric([self.version, ",".join(sorted(sources)) or "pending", ",".join(sorted(backends)) or "pending",
                         ",".join(sorted(boost)) or "pending"], 1.0)
        yield from (energy, engine, steps, tokens, power, clock, temp, mem_clock, reasons, target, changes, chunks, req_e, req_n, simulated, info)


_REGISTERED: dict[str, PowersaveCollector] = {}


def register_collector(stats_dir: str | Path, version: str = "") -> PowersaveCollector:
    """Register the collector in prometheus_client's global registry (which vLLM's /metrics serves)."""
    from prometheus_client import REGISTRY

    key = str(stats_dir)
    if key not in _REGISTERED:
        col = PowersaveCollector(stats_dir, version)
        REGISTRY.register(col)
        _REGISTERED[key] = col
    return _REGISTERED[key]
