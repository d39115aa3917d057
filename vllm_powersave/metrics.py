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
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

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
    pacing = s.get("decode_pacing")
    if pacing is not None and (not isinstance(pacing, dict) or not all(_num_ok(v) for v in pacing.values())):
        return f"'decode_pacing' = {_short(pacing)}"
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
    from .clocks.leases import pid_alive

    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except OSError:
        return True
    pid = snap.get("pid") if isinstance(snap, dict) else None
    return age > stale_after_s and isinstance(pid, int) and not isinstance(pid, bool) and not pid_alive(pid)


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


class FamilySpec(NamedTuple):
    """One ``powersave_*`` family: its Prometheus name (counters are exposed with ``_total``), type,
    help text, unit (as docs/metrics.md states it; not passed to prometheus_client, which would
    append it to the name) and label names."""

    name: str
    type: str  # "counter" or "gauge"
    help: str
    unit: str
    labels: tuple[str, ...]

    def build(self) -> CounterMetricFamily | GaugeMetricFamily:
        cls = CounterMetricFamily if self.type == "counter" else GaugeMetricFamily
        return cls(self.name, self.help, labels=list(self.labels))


_C, _G = "counter", "gauge"
#: Every family the collector exports, in the order of the exposition; docs/metrics.md describes
#: each (tests/test_docs.py checks its type, labels and unit against this table).
FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("powersave_gpu_energy_joules", _C, "GPU energy by engine phase (J)", "J", ("gpu", "phase", "source", "method")),
    FamilySpec(
        "powersave_engine_energy_joules", _C, "Energy of all GPUs of the engine (every TP/PP rank) by phase (J)", "J", ("phase", "source")
    ),
    FamilySpec("powersave_steps", _C, "Engine steps by phase", "steps", ("gpu", "phase")),
    FamilySpec("powersave_tokens", _C, "Tokens processed by kind (prefill, decode)", "tokens", ("gpu", "kind")),
    FamilySpec("powersave_gpu_power_watts", _G, "GPU power (W)", "W", ("gpu", "source")),
    FamilySpec("powersave_sm_clock_mhz", _G, "SM clock (MHz)", "MHz", ("gpu", "source")),
    FamilySpec("powersave_gpu_temperature_celsius", _G, "GPU temperature (°C, measured)", "°C", ("gpu",)),
    FamilySpec("powersave_mem_clock_mhz", _G, "Memory clock (MHz, measured)", "MHz", ("gpu",)),
    FamilySpec(
        "powersave_clock_event_reasons",
        _G,
        "NVML clock-event (throttle) reasons bitmask (0x4 SW power cap, "
        "0x20 SW thermal); label reasons: its bits by name, e.g. sw_power_cap,hw_slowdown",
        "bitmask",
        ("gpu", "reasons"),
    ),
    FamilySpec("powersave_clock_target_mhz", _G, "SM clock the controller wants (MHz; 0 = driver default)", "MHz", ("gpu", "backend")),
    FamilySpec("powersave_clock_changes", _C, "Clock changes decided", "count", ("gpu", "backend")),
    FamilySpec("powersave_lm_head_calls", _C, "LM-head calls by chunk count", "calls", ("gpu", "chunks")),
    FamilySpec(
        "powersave_request_energy_joules",
        _C,
        "Energy attributed to finished requests (J; each step split by request cost, docs/request-energy.md)",
        "J",
        ("gpu", "source"),
    ),
    FamilySpec("powersave_requests_finished", _C, "Requests whose energy was attributed", "requests", ("gpu",)),
    FamilySpec(
        "powersave_request_tail_energy_joules",
        _C,
        "Energy of non-idle time charged to no request: after a batch's last step until idle is detected (J)",
        "J",
        ("gpu", "source"),
    ),
    FamilySpec("powersave_energy_simulated", _G, "1 if this GPU's energy figures are simulated, 0 if measured", "1/0", ("gpu",)),
    FamilySpec("powersave_info", _G, "vllm-powersave is active", "1", ("version", "source", "clock_backend", "cuda_perf_boost")),
    FamilySpec(
        "powersave_energy_available",
        _G,
        "1 if this GPU's energy figures are current, 0 if its meter failed (figures left out)",
        "1/0",
        ("gpu", "method"),
    ),
    FamilySpec(
        "powersave_energy_counter_resets",
        _C,
        "NVML energy counter went backwards or jumped implausibly (bridged with instant power)",
        "count",
        ("gpu",),
    ),
    FamilySpec("powersave_energy_counter_wraps", _C, "NVML energy counter wrapped (delta kept)", "count", ("gpu",)),
    FamilySpec("powersave_meter_faults", _C, "Failed NVML reads of the meter (the first one is logged)", "count", ("gpu",)),
    FamilySpec(
        "powersave_energy_crosscheck_ratio",
        _G,
        "NVML energy counter over the integral of instant power, last completed window of >= 30 s (1 = agree)",
        "ratio",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_tokens_per_joule",
        _G,
        "Engine tokens per joule (all GPUs): sliding window, steady state, whole run",
        "tokens/J",
        ("window", "kind", "source"),
    ),
    FamilySpec(
        "powersave_window_energy_joules", _G, "Engine energy over the sliding tokens-per-joule window (J)", "J", ("window", "source")
    ),
    FamilySpec("powersave_steady_energy_joules", _C, "Energy of steps at the batch limit (steady state, J)", "J", ("gpu", "source")),
    FamilySpec("powersave_steady_seconds", _C, "Time of steps at the batch limit (s)", "s", ("gpu",)),
    FamilySpec("powersave_steady_tokens", _C, "Tokens of steps at the batch limit", "tokens", ("gpu", "kind")),
    FamilySpec("powersave_cuda_boost_held", _G, "cuda_perf_boost auto: 1 while the side CUDA context boosts this GPU", "1/0", ("gpu",)),
    FamilySpec("powersave_cuda_boost_switches", _C, "cuda_perf_boost auto: side-context holds and releases", "count", ("gpu",)),
    FamilySpec("powersave_gpu_info", _G, "Which data-parallel engine and worker rank each GPU belongs to", "1", ("gpu", "engine", "rank")),
    # Front-end starvation (starvation.py) and which savings run (savings.py).
    FamilySpec(
        "powersave_idle_while_busy_energy_joules",
        _C,
        "GPU energy while the engine was idle but the API server had requests in flight (front-end starvation, J)",
        "J",
        ("gpu", "engine", "source"),
    ),
    FamilySpec(
        "powersave_idle_while_busy_seconds",
        _C,
        "Time the engine was idle while the API server had requests in flight (s)",
        "s",
        ("gpu", "engine"),
    ),
    FamilySpec(
        "powersave_frontend_busy_seconds",
        _C,
        "Time the API server(s) had requests in flight, as seen by this GPU's worker (s)",
        "s",
        ("gpu", "engine"),
    ),
    FamilySpec(
        "powersave_saving_state",
        _G,
        "1 per saving with its state (auto/on/off/dry-run/failed/n/a) and basis (measured/predicted)",
        "1",
        ("gpu", "saving", "state", "basis"),
    ),
    # The closed-loop decode clock (clocks/closed_loop.py, docs/closed-loop.md).
    FamilySpec(
        "powersave_closed_loop_sm_clock_mhz",
        _G,
        "Closed-loop decode clock per batch bucket: the SM clock it "
        "asks for (MHz; 0 = driver default); state baseline/probe/ref/hold; decisions only in dry-run",
        "MHz",
        ("gpu", "bucket", "state", "backend"),
    ),
    FamilySpec(
        "powersave_closed_loop_baseline_step_ms",
        _G,
        "Closed-loop decode clock: step time measured at the default clock per batch bucket (ms, at the bucket's mean context); "
        "timing: cuda_events (on the GPU), simulated, or engine_wall (CPU build)",
        "ms",
        ("gpu", "bucket", "timing"),
    ),
    FamilySpec("powersave_closed_loop_probes", _C, "Closed-loop decode clock: candidate clocks probed", "count", ("gpu",)),
    FamilySpec(
        "powersave_closed_loop_backoffs",
        _C,
        "Closed-loop decode clock: back-offs after a measured violation of the target",
        "count",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_closed_loop_decisions",
        _C,
        "Closed-loop decode clock: decision records (each in the step trace with its measurement)",
        "count",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_closed_loop_read_back_sm_clock_mhz",
        _G,
        "Closed-loop decode clock: the SM clock last read back from the GPU (MHz; NVML, or the simulated GPU's)",
        "MHz",
        ("gpu", "backend"),
    ),
    # Decode pacing (pacing/pacer.py, docs/decode-pacing.md).
    FamilySpec(
        "powersave_decode_pacing_held_seconds", _C, "Decode pacing: time the engine loop was held before a decode step", "s", ("gpu",)
    ),
    FamilySpec("powersave_decode_pacing_held_steps", _C, "Decode pacing: decode steps held to the TPOT target", "count", ("gpu",)),
    FamilySpec(
        "powersave_decode_pacing_woken_early",
        _C,
        "Decode pacing: holds cut short by an arriving request",
        "count",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_decode_pacing_paused",
        _G,
        "Decode pacing: 1 while paused because arrivals follow finished requests (closed-loop clients)",
        "1/0",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_decode_pacing_checking",
        _G,
        "Decode pacing: 1 while a scheduled check lifts pacing to see whether arrivals speed up",
        "1/0",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_decode_pacing_closed_loop_pauses",
        _C,
        "Decode pacing: pauses for closed-loop clients",
        "count",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_decode_pacing_pauses_withdrawn",
        _C,
        "Decode pacing: pauses withdrawn because arrivals did not speed up while paused (open-loop traffic)",
        "count",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_decode_pacing_closed_loop_checks",
        _C,
        "Decode pacing: scheduled checks (pacing lifted for a few seconds to see whether arrivals speed up)",
        "count",
        ("gpu",),
    ),
    FamilySpec(
        "powersave_closed_loop_unconfirmed_switches",
        _C,
        "Closed-loop decode clock: clock switches not read back within switch_confirm_ms (each re-sent, or the loop turned off)",
        "count",
        ("gpu",),
    ),
)


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
        sc = _Scrape()
        # A rank whose snapshot is unusable has unknown energy: no engine sums over the others.
        all_available = bool(snaps) and not bad
        _add_bad(sc, bad)
        for s in snaps:
            all_available = _add_rank(sc, s) and all_available
        if all_available:  # engine-level figures only when every GPU's energy is known
            _add_engine(sc)
        boost = ",".join(sorted(sc.boost_modes)) or "pending"
        sc.add("info", [self.version, ",".join(sorted(sc.sources)) or "pending", ",".join(sorted(sc.backends)) or "pending", boost], 1.0)
        return list(sc.families.values())


class _Scrape:
    """One scrape's families (by name without the ``powersave_`` prefix) and the engine-level sums
    gathered over the rank snapshots."""

    def __init__(self) -> None:
        self.families: dict[str, Any] = {spec.name.removeprefix("powersave_"): spec.build() for spec in FAMILIES}
        self.engine_energy_j: dict[tuple[str, str], float] = {}  # (phase, source) -> J
        # Per data-parallel engine: tokens are the same steps on every rank of one engine (max),
        # different steps on different engines (sum).
        self.engine_totals: dict[str, dict[int, dict[str, float]]] = {"window": {}, "steady": {}, "run": {}}
        self.window_label = ""
        self.sources: set[str] = set()
        self.backends: set[str] = set()
        self.boost_modes: set[str] = set()

    def add(self, family: str, labels: list[str], value: float) -> None:
        self.families[family].add_metric(labels, value)


class _Rank(NamedTuple):
    """The labels of one rank snapshot's series."""

    gpu: str
    source: str
    backend: str
    method: str
    engine: int
    ok: bool  # its energy figures are current (else they are left out, never frozen)


def _rank_of(s: WorkerSnapshot) -> _Rank:
    src = str(s.get("source", "none"))
    e_id = s.get("engine", 0) if isinstance(s.get("engine", 0), int) else 0
    return _Rank(
        gpu=str(s.get("gpu", s.get("rank", "?"))),
        source=src,
        backend=str(s.get("clock_backend", "?")),
        method=str(s.get("energy_method", "energy-counter" if src == "measured" else "model")),
        engine=e_id,
        ok=bool(s.get("energy_available", bool(s.get("energy_j")))),
    )


def _add_bad(sc: _Scrape, bad: list[tuple[Path, Any, str]]) -> None:
    """An unusable snapshot: one warning, and its GPU shown as unavailable."""
    for path, s, why in bad:
        _warn_once(path, why)
        gpu = s.get("gpu") if isinstance(s, dict) else None
        method = s.get("energy_method") if isinstance(s, dict) else None
        sc.add("energy_available", [gpu if isinstance(gpu, str) else path.stem, method if isinstance(method, str) else "unknown"], 0.0)


def _add_rank(sc: _Scrape, s: WorkerSnapshot) -> bool:
    """Every series of one rank snapshot; whether its energy is available."""
    r = _rank_of(s)
    sc.add("gpu_info", [r.gpu, str(r.engine), str(s.get("rank", "?"))], 1.0)
    sc.sources.add(r.source)
    sc.backends.add(r.backend)
    sc.boost_modes.add(str(s.get("cuda_perf_boost", "on")))
    sc.add("energy_available", [r.gpu, r.method], 1.0 if r.ok else 0.0)
    sc.add("energy_counter_resets", [r.gpu], float(s.get("counter_resets", 0)))
    sc.add("energy_counter_wraps", [r.gpu], float(s.get("counter_wraps", 0)))
    sc.add("meter_faults", [r.gpu], float(s.get("meter_faults", 0)))
    if r.ok and s.get("energy_crosscheck_ratio") is not None:
        sc.add("energy_crosscheck_ratio", [r.gpu], float(s["energy_crosscheck_ratio"]))
    if r.ok:
        _add_rank_energy(sc, r, s)
    _add_rank_steps_and_clocks(sc, r, s)
    if r.ok and s.get("idle_while_busy_j") is not None:
        sc.add("idle_while_busy_energy_joules", [r.gpu, str(r.engine), r.source], float(s["idle_while_busy_j"]))
        sc.add("idle_while_busy_seconds", [r.gpu, str(r.engine)], float(s.get("idle_while_busy_s") or 0.0))
        sc.add("frontend_busy_seconds", [r.gpu, str(r.engine)], float(s.get("frontend_busy_s") or 0.0))
    cl = s.get("closed_loop")
    if isinstance(cl, dict):
        _add_closed_loop(sc, r, cl)
    pacing = s.get("decode_pacing")
    if isinstance(pacing, dict):
        sc.add("decode_pacing_held_seconds", [r.gpu], float(pacing.get("held_s") or 0.0))
        sc.add("decode_pacing_held_steps", [r.gpu], float(pacing.get("held_steps") or 0))
        sc.add("decode_pacing_woken_early", [r.gpu], float(pacing.get("woken_early") or 0))
        sc.add("decode_pacing_paused", [r.gpu], float(pacing.get("paused") or 0))
        sc.add("decode_pacing_checking", [r.gpu], float(pacing.get("checking") or 0))
        sc.add("decode_pacing_closed_loop_pauses", [r.gpu], float(pacing.get("closed_loop_pauses") or 0))
        sc.add("decode_pacing_pauses_withdrawn", [r.gpu], float(pacing.get("pauses_withdrawn") or 0))
        sc.add("decode_pacing_closed_loop_checks", [r.gpu], float(pacing.get("closed_loop_checks") or 0))
    sv = s.get("savings")
    for name, st in sv.items() if isinstance(sv, dict) else ():
        if isinstance(st, dict):
            sc.add("saving_state", [r.gpu, str(name), str(st.get("state", "?")), str(st.get("basis", ""))], 1.0)
    for c, n in (s.get("lm_head_calls") or {}).items():
        sc.add("lm_head_calls", [r.gpu, str(c)], float(n))
    sc.add("energy_simulated", [r.gpu], 1.0 if r.source == "simulated" else 0.0)
    if r.ok and s.get("requests_finished") and s.get("request_energy_j_finished") is not None:
        sc.add("request_energy_joules", [r.gpu, r.source], float(s.get("request_energy_j_finished", 0.0)))
        sc.add("requests_finished", [r.gpu], float(s["requests_finished"]))
    if r.ok and s.get("request_energy_j_tail") is not None:
        sc.add("request_tail_energy_joules", [r.gpu, r.source], float(s["request_energy_j_tail"]))
    return r.ok


def _add_rank_energy(sc: _Scrape, r: _Rank, s: WorkerSnapshot) -> None:
    """Phase energy, and the run, window and steady-state sums (only while the meter is available)."""
    for phase, j in (s.get("energy_j") or {}).items():
        sc.add("gpu_energy_joules", [r.gpu, phase, r.source, r.method], float(j))
        sc.engine_energy_j[(phase, r.source)] = sc.engine_energy_j.get((phase, r.source), 0.0) + float(j)
    tok = s.get("tokens") or {}
    totals = sc.engine_totals
    _engine_add(
        totals["run"].setdefault(r.engine, {}), sum((s.get("energy_j") or {}).values()), tok.get("prefill", 0), tok.get("decode", 0)
    )
    w = s.get("window") or {}
    if w.get("seconds"):
        sc.window_label = f"{float(w.get('window_s', 0)):g}s"
        _engine_add(
            totals["window"].setdefault(r.engine, {}), w.get("energy_j", 0.0), w.get("prefill_tokens", 0), w.get("decode_tokens", 0)
        )
    st = s.get("steady") or {}
    if st.get("seconds"):
        st_tok = st.get("tokens") or {}
        sc.add("steady_energy_joules", [r.gpu, r.source], float(st.get("energy_j", 0.0)))
        sc.add("steady_seconds", [r.gpu], float(st["seconds"]))
        for kind, n in st_tok.items():
            sc.add("steady_tokens", [r.gpu, kind], float(n))
        _engine_add(totals["steady"].setdefault(r.engine, {}), st.get("energy_j", 0.0), st_tok.get("prefill", 0), st_tok.get("decode", 0))


def _add_rank_steps_and_clocks(sc: _Scrape, r: _Rank, s: WorkerSnapshot) -> None:
    """Steps, tokens, the gauges, the clock target and changes, and the perf boost."""
    for phase, n in (s.get("steps") or {}).items():
        if phase != "idle":  # idle is time without steps, not a kind of step
            sc.add("steps", [r.gpu, phase], float(n))
    for kind, n in (s.get("tokens") or {}).items():
        sc.add("tokens", [r.gpu, kind], float(n))
    if s.get("power_w") is not None:
        sc.add("gpu_power_watts", [r.gpu, r.source], float(s["power_w"]))
    if s.get("sm_clock_mhz") is not None:
        sc.add("sm_clock_mhz", [r.gpu, r.source], float(s["sm_clock_mhz"]))
    sc.add("clock_target_mhz", [r.gpu, r.backend], float(s.get("target_sm_clock_mhz") or 0))
    for family, key in (("gpu_temperature_celsius", "temperature_c"), ("mem_clock_mhz", "mem_clock_mhz")):
        if s.get(key) is not None:
            sc.add(family, [r.gpu], float(s[key]))
    if s.get("clock_event_reasons") is not None:
        mask = int(s["clock_event_reasons"])
        sc.add("clock_event_reasons", [r.gpu, ",".join(decode_clock_event_reasons(mask)) or "none"], float(mask))
    sc.add("clock_changes", [r.gpu, r.backend], float(s.get("clock_changes", 0)))
    cb = s.get("cuda_boost")
    if cb:
        sc.add("cuda_boost_held", [r.gpu], 1.0 if cb.get("held") else 0.0)
        sc.add("cuda_boost_switches", [r.gpu], float(cb.get("switches", 0)))


def _add_closed_loop(sc: _Scrape, r: _Rank, cl: dict[str, Any]) -> None:
    """The closed-loop decode clock's buckets and counters (``DecodeClockTuner.snapshot()``)."""
    for edge, b in (cl.get("buckets") or {}).items():
        if isinstance(b, dict):
            sc.add("closed_loop_sm_clock_mhz", [r.gpu, str(edge), str(b.get("state", "?")), r.backend], float(b.get("sm_clock_mhz") or 0))
            if b.get("baseline_ms") is not None:
                timing = str(cl.get("step_time_source") or "engine_wall")
                sc.add("closed_loop_baseline_step_ms", [r.gpu, str(edge), timing], float(b["baseline_ms"]))
    sc.add("closed_loop_probes", [r.gpu], float(cl.get("probes_total") or 0))
    sc.add("closed_loop_backoffs", [r.gpu], float(cl.get("backoffs_total") or 0))
    sc.add("closed_loop_decisions", [r.gpu], float(cl.get("decisions_total") or 0))
    if isinstance(cl.get("read_back_mhz"), int | float):
        sc.add("closed_loop_read_back_sm_clock_mhz", [r.gpu, r.backend], float(cl["read_back_mhz"]))
    sc.add("closed_loop_unconfirmed_switches", [r.gpu], float(cl.get("unconfirmed_switches") or 0))


def _add_engine(sc: _Scrape) -> None:
    """Engine-level energy and tokens per joule (only when every GPU's energy is known)."""
    engine_src = "measured" if sc.sources == {"measured"} else "simulated"
    for (phase, src), j in sorted(sc.engine_energy_j.items()):
        sc.add("engine_energy_joules", [phase, src], j)
    for name, per_engine in sc.engine_totals.items():
        e = {k: sum(x.get(k, 0.0) for x in per_engine.values()) for k in ("energy_j", "prefill", "decode")}
        if name == "window" and not sc.window_label:
            continue
        if e.get("energy_j", 0.0) > 0:
            label = sc.window_label if name == "window" else name
            sc.add("tokens_per_joule", [label, "decode", engine_src], e["decode"] / e["energy_j"])
            sc.add("tokens_per_joule", [label, "total", engine_src], (e["prefill"] + e["decode"]) / e["energy_j"])
            if name == "window":
                sc.add("window_energy_joules", [label, engine_src], e["energy_j"])


def _engine_add(acc: dict[str, float], energy_j: float, prefill: float, decode: float) -> None:
    """Engine sums: energy adds over GPUs; tokens are the same steps on every rank, so the max."""
    acc["energy_j"] = acc.get("energy_j", 0.0) + float(energy_j)
    acc["prefill"] = max(acc.get("prefill", 0.0), float(prefill))
    acc["decode"] = max(acc.get("decode", 0.0), float(decode))


_REGISTERED: dict[str, PowersaveCollector] = {}
# Keys of _REGISTERED already on each registry, kept here rather than as an attribute of a
# prometheus_client object that is not ours.
_ADDED_TO: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


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
    mine = _ADDED_TO.setdefault(registry, set())
    for key, col in _REGISTERED.items():
        if key not in mine:
            registry.register(col)
            mine.add(key)
