"""``powersave_*`` series on vLLM's own ``/metrics`` (API-server process).

Workers publish a small JSON snapshot per rank into the run's stats directory (atomic rename);
this collector reads them at scrape time. No metric is named ``vllm:*`` because vLLM's Prometheus
logger unregisters those at start-up. Each energy, power and clock series carries ``source``
(``measured`` or ``simulated``); per-GPU energy also ``method`` (``energy-counter``,
``power-sampling``, ``model``: see ``energy/meters.py``).

Unavailable meters (NVML faults): ``powersave_energy_available{gpu}`` is 0 and that GPU's energy,
power, window and request series are left out, never frozen at their last value; engine-level
sums and tokens-per-joule gauges are left out while any GPU is unavailable (no partial sums).

Several API servers (``--api-server-count N``): vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` and
``/metrics`` is answered from a fresh registry holding only prometheus_client's
``MultiProcessCollector`` (built per request by prometheus-fastapi-instrumentator's handler), so a
collector in the global registry would not be served at all. ``register_collector`` has this
collector added to every such registry (``vllm_compat.install_metrics_registry_hook``). Every
API-server process reads the same worker files at scrape time and exports each series once, so a
scrape answered by any of them gives the same, un-summed values. Nothing of ours goes through the
multiprocess files (which would sum counters over the N processes: double counting).

Tokens per joule (``powersave_tokens_per_joule``): engine-level gauges, energy summed over the
engine's GPUs, tokens counted once (every TP/PP rank sees the same steps); ``window``: the sliding
window (``energy.window_s``, computed in the workers, idle energy included), ``steady`` (steps at
the batch limit, ML.ENERGY's steady state), ``run`` (since start). ``kind``: ``decode`` (one per
decoding request per step, plus speculative tokens: close to output tokens, without the first
token of each request, which its prefill step makes) or ``total`` (prompt + decode tokens).

Front-end starvation (``starvation.py``): ``powersave_idle_while_busy_energy_joules`` and
``_seconds`` (per GPU, with its ``engine``) count the idle energy and time while the API server had
requests in flight; ``powersave_frontend_busy_seconds`` the busy time they are a share of. Absent,
not zero, where a worker cannot read the API servers' busy files. ``powersave_saving_state``: which
savings run and why they may not (``savings.py``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .device import decode_clock_event_reasons
from .stats_contract import COUNTER_DICT_KEYS, NONNEG_KEYS, SNAPSHOT_GLOB, WorkerSnapshot, snapshot_from_json

log = logging.getLogger("vllm.powersave")


#: A rank snapshot not rewritten for this long whose writer PID is gone is a leftover (a reused
#: ``stats_dir`` of an earlier server, a crashed worker) and is ignored. Live workers rewrite theirs
#: at least every 0.5 s; snapshots a Ray relay writes for workers on other nodes carry PIDs of those
#: nodes but stay fresh, so they are kept.
STALE_AFTER_S = 10.0
#: The numeric fields of a snapshot's window and steady-state dicts (stats_contract.Window, .Steady;
#: steady's tokens are checked on their own).
_WINDOW_NUMBERS = ("window_s", "seconds", "energy_j", "prefill_tokens", "decode_tokens")
_STEADY_NUMBERS = ("seconds", "energy_j")
_warned: set[tuple[str, str]] = set()


def _num_ok(v: Any, nonneg: bool = True) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v >= 0 or not nonneg)


def snapshot_problem(s: Any) -> str | None:
    """Why a rank snapshot cannot be exported (``None``: it can). Workers never write such files;
    a hand-edited, corrupted or foreign file must not take ``/metrics`` down or export NaN or
    negative counters."""
    if not isinstance(s, dict):
        return f"not a JSON object ({type(s).__name__})"
    if not isinstance(s.get("gpu", s.get("rank", "?")), (str, int)):
        return f"'gpu' = {s.get('gpu')!r}"
    for key in NONNEG_KEYS:
        if s.get(key) is not None and not _num_ok(s[key]):
            return f"'{key}' = {s[key]!r}"
    if s.get("temperature_c") is not None and not _num_ok(s["temperature_c"], nonneg=False):
        return f"'temperature_c' = {s['temperature_c']!r}"
    for key in COUNTER_DICT_KEYS:
        d = s.get(key)
        if d is None:
            continue
        if not isinstance(d, dict) or not all(_num_ok(v) for v in d.values()):
            return f"'{key}' = {_short(d)}"
    for key, fields in (("window", _WINDOW_NUMBERS), ("steady", _STEADY_NUMBERS)):
        d = s.get(key)
        if d is None:
            continue
        if not isinstance(d, dict) or not all(_num_ok(d[f]) for f in fields if d.get(f) is not None):
            return f"'{key}' = {_short(d)}"
    tok = (s.get("steady") or {}).get("tokens")
    if tok is not None and (not isinstance(tok, dict) or not all(_num_ok(v) for v in tok.values())):
        return f"'steady.tokens' = {_short(tok)}"
    cb = s.get("cuda_boost")
    if cb is not None and (not isinstance(cb, dict) or (cb.get("switches") is not None and not _num_ok(cb["switches"]))):
        return f"'cuda_boost' = {_short(cb)}"
    return None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:75] + "...'"


def _warn_once(path: Path, why: str) -> None:
    if (str(path), why) not in _warned:
        _warned.add((str(path), why))
        log.warning("powersave: ignoring metrics snapshot %s: %s", path, why)


def snapshot_is_stale(path: Path, snap: Any, now: float | None = None, stale_after_s: float = STALE_AFTER_S) -> bool:
    """A snapshot not rewritten for ``stale_after_s`` whose ``pid`` no longer exists (see ``STALE_AFTER_S``)."""
    from .clocks.controller import _pid_alive

    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except OSError:
        return True
    pid = snap.get("pid") if isinstance(snap, dict) else None
    return age > stale_after_s and isinstance(pid, int) and not isinstance(pid, bool) and not _pid_alive(pid)


def load_snapshots(stats_dir: str | Path) -> tuple[list[WorkerSnapshot], list[tuple[Path, Any, str]]]:
    """``(good, bad)``: the live rank snapshots in ``stats_dir`` that can be exported, and the
    unusable ones as ``(path, parsed or None, why)``. Leftovers of dead writers are in neither."""
    good: list[WorkerSnapshot] = []
    bad: list[tuple[Path, Any, str]] = []
    d = Path(stats_dir)
    if not d.is_dir():
        return good, bad
    now = time.time()
    for p in sorted(d.glob(SNAPSHOT_GLOB)):
        try:
            s = snapshot_from_json(p.read_text())
        except OSError:
            continue  # removed between glob and read
        except ValueError as exc:  # truncated or corrupted (workers replace it atomically)
            if not snapshot_is_stale(p, None, now):
                bad.append((p, None, f"not JSON ({str(exc)[:60]})"))
            continue
        if snapshot_is_stale(p, s, now):
            continue
        why = snapshot_problem(s)
        if why is None:
            good.append(s)
        else:
            bad.append((p, s, why))
    return good, bad


def read_snapshots(stats_dir: str | Path) -> list[WorkerSnapshot]:
    """The live, exportable rank snapshots in ``stats_dir`` (see :func:`load_snapshots`)."""
    return load_snapshots(stats_dir)[0]


class PowersaveCollector(Collector):
    """Prometheus collector over the worker snapshots of one server."""

    def __init__(self, stats_dir: str | Path, version: str = "") -> None:
        self.stats_dir = Path(stats_dir)
        self.version = version

    def collect(self) -> Iterator[Any]:
        try:
            families = self._collect()
        except Exception as exc:  # never take vLLM's own /metrics down with ours
            _warn_once(self.stats_dir, f"collector failed: {type(exc).__name__}: {exc}")
            families = []
        yield from families

    def _collect(self) -> list[Any]:
        snaps, bad = load_snapshots(self.stats_dir)
        energy = CounterMetricFamily(
            "powersave_gpu_energy_joules", "GPU energy by engine phase (J)", labels=["gpu", "phase", "source", "method"]
        )
        engine = CounterMetricFamily(
            "powersave_engine_energy_joules", "Energy of all GPUs of the engine (every TP/PP rank) by phase (J)", labels=["phase", "source"]
        )
        engine_sum: dict[tuple[str, str], float] = {}
        steps = CounterMetricFamily("powersave_steps", "Engine steps by phase", labels=["gpu", "phase"])
        tokens = CounterMetricFamily("powersave_tokens", "Tokens processed by kind (prefill, decode)", labels=["gpu", "kind"])
        power = GaugeMetricFamily("powersave_gpu_power_watts", "GPU power (W)", labels=["gpu", "source"])
        clock = GaugeMetricFamily("powersave_sm_clock_mhz", "SM clock (MHz)", labels=["gpu", "source"])
        target = GaugeMetricFamily(
            "powersave_clock_target_mhz", "SM clock the controller wants (MHz; 0 = driver default)", labels=["gpu", "backend"]
        )
        temp = GaugeMetricFamily("powersave_gpu_temperature_celsius", "GPU temperature (°C, measured)", labels=["gpu"])
        mem_clock = GaugeMetricFamily("powersave_mem_clock_mhz", "Memory clock (MHz, measured)", labels=["gpu"])
        reasons = GaugeMetricFamily(
            "powersave_clock_event_reasons",
            "NVML clock-event (throttle) reasons bitmask (0x4 SW power cap, "
            "0x20 SW thermal); label reasons: its bits by name, e.g. sw_power_cap,hw_slowdown",
            labels=["gpu", "reasons"],
        )
        changes = CounterMetricFamily("powersave_clock_changes", "Clock changes decided", labels=["gpu", "backend"])
        chunks = CounterMetricFamily("powersave_lm_head_calls", "LM-head calls by chunk count", labels=["gpu", "chunks"])
        req_e = CounterMetricFamily(
            "powersave_request_energy_joules",
            "Energy attributed to finished requests (J; each step split by request cost, docs/request-energy.md)",
            labels=["gpu", "source"],
        )
        req_tail = CounterMetricFamily(
            "powersave_request_tail_energy_joules",
            "Energy of non-idle time charged to no request: after a batch's last step until idle is detected (J)",
            labels=["gpu", "source"],
        )
        req_n = CounterMetricFamily("powersave_requests_finished", "Requests whose energy was attributed", labels=["gpu"])
        simulated = GaugeMetricFamily(
            "powersave_energy_simulated", "1 if this GPU's energy figures are simulated, 0 if measured", labels=["gpu"]
        )
        info = GaugeMetricFamily(
            "powersave_info", "vllm-powersave is active", labels=["version", "source", "clock_backend", "cuda_perf_boost"]
        )
        available = GaugeMetricFamily(
            "powersave_energy_available",
            "1 if this GPU's energy figures are current, 0 if its meter failed (figures left out)",
            labels=["gpu", "method"],
        )
        resets = CounterMetricFamily(
            "powersave_energy_counter_resets",
            "NVML energy counter went backwards or jumped implausibly (bridged with instant power)",
            labels=["gpu"],
        )
        wraps = CounterMetricFamily("powersave_energy_counter_wraps", "NVML energy counter wrapped (delta kept)", labels=["gpu"])
        faults = CounterMetricFamily("powersave_meter_faults", "Failed NVML reads of the meter (the first one is logged)", labels=["gpu"])
        tpj = GaugeMetricFamily(
            "powersave_tokens_per_joule",
            "Engine tokens per joule (all GPUs): sliding window, steady state, whole run",
            labels=["window", "kind", "source"],
        )
        tpj_energy = GaugeMetricFamily(
            "powersave_window_energy_joules", "Engine energy over the sliding tokens-per-joule window (J)", labels=["window", "source"]
        )
        steady_e = CounterMetricFamily(
            "powersave_steady_energy_joules", "Energy of steps at the batch limit (steady state, J)", labels=["gpu", "source"]
        )
        steady_s = CounterMetricFamily("powersave_steady_seconds", "Time of steps at the batch limit (s)", labels=["gpu"])
        steady_t = CounterMetricFamily("powersave_steady_tokens", "Tokens of steps at the batch limit", labels=["gpu", "kind"])
        boost_held = GaugeMetricFamily(
            "powersave_cuda_boost_held", "cuda_perf_boost auto: 1 while the side CUDA context boosts this GPU", labels=["gpu"]
        )
        boost_sw = CounterMetricFamily(
            "powersave_cuda_boost_switches", "cuda_perf_boost auto: side-context holds and releases", labels=["gpu"]
        )
        # Front-end starvation (starvation.py) and which savings run (savings.py).
        iwb_j = CounterMetricFamily(
            "powersave_idle_while_busy_energy_joules",
            "GPU energy while the engine was idle but the API server had requests in flight (front-end starvation, J)",
            labels=["gpu", "engine", "source"],
        )
        iwb_s = CounterMetricFamily(
            "powersave_idle_while_busy_seconds",
            "Time the engine was idle while the API server had requests in flight (s)",
            labels=["gpu", "engine"],
        )
        fe_busy = CounterMetricFamily(
            "powersave_frontend_busy_seconds",
            "Time the API server(s) had requests in flight, as seen by this GPU's worker (s)",
            labels=["gpu", "engine"],
        )
        cl_clock = GaugeMetricFamily(
            "powersave_closed_loop_sm_clock_mhz",
            "Closed-loop decode clock per batch bucket: the SM clock it "
            "asks for (MHz; 0 = driver default); state baseline/probe/ref/hold; decisions only in dry-run",
            labels=["gpu", "bucket", "state", "backend"],
        )
        cl_base = GaugeMetricFamily(
            "powersave_closed_loop_baseline_step_ms",
            "Closed-loop decode clock: step time measured at the default clock per batch bucket (ms, at the bucket's mean context); "
            "timing: cuda_events (on the GPU), simulated, or engine_wall (CPU build)",
            labels=["gpu", "bucket", "timing"],
        )
        cl_probes = CounterMetricFamily("powersave_closed_loop_probes", "Closed-loop decode clock: candidate clocks probed", labels=["gpu"])
        cl_backoffs = CounterMetricFamily(
            "powersave_closed_loop_backoffs", "Closed-loop decode clock: back-offs after a measured violation of the target", labels=["gpu"]
        )
        cl_decisions = CounterMetricFamily(
            "powersave_closed_loop_decisions",
            "Closed-loop decode clock: decision records (each in the step trace with its measurement)",
            labels=["gpu"],
        )
        saving_state = GaugeMetricFamily(
            "powersave_saving_state",
            "1 per saving with its state (auto/on/off/dry-run/failed/n/a) and basis (measured/predicted)",
            labels=["gpu", "saving", "state", "basis"],
        )
        sources, backends, boost = set(), set(), set()
        # A rank whose snapshot is unusable has unknown energy: no engine sums over the others.
        all_available = bool(snaps) and not bad
        for path, s, why in bad:
            _warn_once(path, why)
            gpu = s.get("gpu") if isinstance(s, dict) else None
            method = s.get("energy_method") if isinstance(s, dict) else None
            available.add_metric([gpu if isinstance(gpu, str) else path.stem, method if isinstance(method, str) else "unknown"], 0.0)
        # Per data-parallel engine: tokens are the same steps on every rank of one engine (max),
        # different steps on different engines (sum).
        eng: dict[str, dict[int, dict[str, float]]] = {"window": {}, "steady": {}, "run": {}}
        gpu_info = GaugeMetricFamily(
            "powersave_gpu_info", "Which data-parallel engine and worker rank each GPU belongs to", labels=["gpu", "engine", "rank"]
        )
        window_label = ""
        for s in snaps:
            gpu, src, be = str(s.get("gpu", s.get("rank", "?"))), str(s.get("source", "none")), str(s.get("clock_backend", "?"))
            e_id = s.get("engine", 0) if isinstance(s.get("engine", 0), int) else 0
            gpu_info.add_metric([gpu, str(e_id), str(s.get("rank", "?"))], 1.0)
            method = str(s.get("energy_method", "energy-counter" if src == "measured" else "model"))
            sources.add(src)
            backends.add(be)
            boost.add(str(s.get("cuda_perf_boost", "on")))
            ok = bool(s.get("energy_available", bool(s.get("energy_j"))))
            all_available = all_available and ok
            available.add_metric([gpu, method], 1.0 if ok else 0.0)
            resets.add_metric([gpu], float(s.get("counter_resets", 0)))
            wraps.add_metric([gpu], float(s.get("counter_wraps", 0)))
            faults.add_metric([gpu], float(s.get("meter_faults", 0)))
            if ok:  # else no stale figures: energy, window and request series of this GPU are left out
                for phase, j in (s.get("energy_j") or {}).items():
                    energy.add_metric([gpu, phase, src, method], float(j))
                    engine_sum[(phase, src)] = engine_sum.get((phase, src), 0.0) + float(j)
                tok = s.get("tokens") or {}
                _engine_add(
                    eng["run"].setdefault(e_id, {}), sum((s.get("energy_j") or {}).values()), tok.get("prefill", 0), tok.get("decode", 0)
                )
                w = s.get("window") or {}
                if w.get("seconds"):
                    window_label = f"{float(w.get('window_s', 0)):g}s"
                    _engine_add(
                        eng["window"].setdefault(e_id, {}), w.get("energy_j", 0.0), w.get("prefill_tokens", 0), w.get("decode_tokens", 0)
                    )
                st = s.get("steady") or {}
                if st.get("seconds"):
                    st_tok = st.get("tokens") or {}
                    steady_e.add_metric([gpu, src], float(st.get("energy_j", 0.0)))
                    steady_s.add_metric([gpu], float(st["seconds"]))
                    for kind, n in st_tok.items():
                        steady_t.add_metric([gpu, kind], float(n))
                    _engine_add(
                        eng["steady"].setdefault(e_id, {}), st.get("energy_j", 0.0), st_tok.get("prefill", 0), st_tok.get("decode", 0)
                    )
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
            for fam, key in ((temp, "temperature_c"), (mem_clock, "mem_clock_mhz")):
                if s.get(key) is not None:
                    fam.add_metric([gpu], float(s[key]))
            if s.get("clock_event_reasons") is not None:
                mask = int(s["clock_event_reasons"])
                reasons.add_metric([gpu, ",".join(decode_clock_event_reasons(mask)) or "none"], float(mask))
            changes.add_metric([gpu, be], float(s.get("clock_changes", 0)))
            cb = s.get("cuda_boost")
            if cb:
                boost_held.add_metric([gpu], 1.0 if cb.get("held") else 0.0)
                boost_sw.add_metric([gpu], float(cb.get("switches", 0)))
            if ok and s.get("idle_while_busy_j") is not None:
                iwb_j.add_metric([gpu, str(e_id), src], float(s["idle_while_busy_j"]))
                iwb_s.add_metric([gpu, str(e_id)], float(s.get("idle_while_busy_s") or 0.0))
                fe_busy.add_metric([gpu, str(e_id)], float(s.get("frontend_busy_s") or 0.0))
            cl = s.get("closed_loop")
            if isinstance(cl, dict):
                for edge, b in (cl.get("buckets") or {}).items():
                    if isinstance(b, dict):
                        cl_clock.add_metric([gpu, str(edge), str(b.get("state", "?")), be], float(b.get("sm_clock_mhz") or 0))
                        if b.get("baseline_ms") is not None:
                            cl_base.add_metric([gpu, str(edge), str(cl.get("step_time_source") or "engine_wall")], float(b["baseline_ms"]))
                cl_probes.add_metric([gpu], float(cl.get("probes_total") or 0))
                cl_backoffs.add_metric([gpu], float(cl.get("backoffs_total") or 0))
                cl_decisions.add_metric([gpu], float(cl.get("decisions_total") or 0))
            sv = s.get("savings")
            for name, st in sv.items() if isinstance(sv, dict) else ():
                if isinstance(st, dict):
                    saving_state.add_metric([gpu, str(name), str(st.get("state", "?")), str(st.get("basis", ""))], 1.0)
            for c, n in (s.get("lm_head_calls") or {}).items():
                chunks.add_metric([gpu, str(c)], float(n))
            simulated.add_metric([gpu], 1.0 if src == "simulated" else 0.0)
            if ok and s.get("requests_finished") and s.get("request_energy_j_finished") is not None:
                req_e.add_metric([gpu, src], float(s.get("request_energy_j_finished", 0.0)))
                req_n.add_metric([gpu], float(s["requests_finished"]))
            if ok and s.get("request_energy_j_tail") is not None:
                req_tail.add_metric([gpu, src], float(s["request_energy_j_tail"]))
        engine_src = "measured" if sources == {"measured"} else "simulated"
        if all_available:  # engine-level figures only when every GPU's energy is known
            for (phase, src), j in sorted(engine_sum.items()):
                engine.add_metric([phase, src], j)
            for name, per_engine in eng.items():
                e = {k: sum(x.get(k, 0.0) for x in per_engine.values()) for k in ("energy_j", "prefill", "decode")}
                if name == "window" and not window_label:
                    continue
                if e.get("energy_j", 0.0) > 0:
                    label = window_label if name == "window" else name
                    tpj.add_metric([label, "decode", engine_src], e["decode"] / e["energy_j"])
                    tpj.add_metric([label, "total", engine_src], (e["prefill"] + e["decode"]) / e["energy_j"])
                    if name == "window":
                        tpj_energy.add_metric([label, engine_src], e["energy_j"])
        info.add_metric(
            [
                self.version,
                ",".join(sorted(sources)) or "pending",
                ",".join(sorted(backends)) or "pending",
                ",".join(sorted(boost)) or "pending",
            ],
            1.0,
        )
        return [
            energy,
            engine,
            steps,
            tokens,
            power,
            clock,
            temp,
            mem_clock,
            reasons,
            target,
            changes,
            chunks,
            req_e,
            req_n,
            req_tail,
            simulated,
            info,
            available,
            resets,
            wraps,
            faults,
            tpj,
            tpj_energy,
            steady_e,
            steady_s,
            steady_t,
            boost_held,
            boost_sw,
            gpu_info,
            iwb_j,
            iwb_s,
            fe_busy,
            saving_state,
            cl_clock,
            cl_base,
            cl_probes,
            cl_backoffs,
            cl_decisions,
        ]


def _engine_add(acc: dict[str, float], energy_j: float, prefill: float, decode: float) -> None:
    """Engine sums: energy adds over GPUs; tokens are the same steps on every rank, so the max."""
    acc["energy_j"] = acc.get("energy_j", 0.0) + float(energy_j)
    acc["prefill"] = max(acc.get("prefill", 0.0), float(prefill))
    acc["decode"] = max(acc.get("decode", 0.0), float(decode))


_REGISTERED: dict[str, PowersaveCollector] = {}


def register_collector(stats_dir: str | Path, version: str = "") -> PowersaveCollector:
    """Register the collector in prometheus_client's global registry (which vLLM's /metrics serves)."""
    from prometheus_client import REGISTRY

    key = str(stats_dir)
    if key not in _REGISTERED:
        col = PowersaveCollector(stats_dir, version)
        REGISTRY.register(col)
        _REGISTERED[key] = col
        from . import vllm_compat

        vllm_compat.install_metrics_registry_hook(add_to_registry)
    return _REGISTERED[key]


def add_to_registry(registry: Any) -> None:
    """Register every collector of this process on ``registry`` once (the multiprocess registries
    ``/metrics`` is answered from with ``--api-server-count > 1``)."""
    mine = getattr(registry, "_powersave_collectors", None)
    if mine is None:
        mine = set()
        registry._powersave_collectors = mine
    for key, col in _REGISTERED.items():
        if key not in mine:
            registry.register(col)
            mine.add(key)
