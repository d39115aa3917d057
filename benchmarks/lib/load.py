"""Load windows against one vLLM server (loadtests), the GPU's facts and a 10 Hz sampler through the
plugin's device layer (read-only; without NVML no samples and null figures), and what the plugin
publishes: its ``powersave_*`` series on /metrics and its ``stats_dir`` files (JSON lines, snapshot).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from .serve import metrics_text

#: The loadtests result keys a record keeps per load window.
SUMMARY_KEYS = tuple(
    "completed failed duration total_input_tokens total_output_tokens request_throughput output_throughput total_token_throughput "
    "mean_ttft_ms median_ttft_ms p90_ttft_ms p99_ttft_ms mean_tpot_ms median_tpot_ms p90_tpot_ms p99_tpot_ms median_itl_ms p99_itl_ms "
    "median_e2el_ms gpu_energy_j gpu_avg_power_w gpu_energy_per_output_token_j output_tokens_per_joule total_tokens_per_joule "
    "energy_source energy_window_s energy_window_edge_s energy_note steady_state_duration_s steady_state_output_tokens_per_joule "
    # the plugin's starvation counter (idle while requests wait), read at the window's edges
    "gpu_idle_while_busy_energy_j "
    # the harness's own client check, kept so that its threshold can be judged against GPU runs
    "client_loop_lag_p99_ms client_bottleneck_threshold_ms client_bottleneck client_cpu_contended".split()
)
#: A sample counts as low power below the server's idle power plus this (a cross-check of the idle share).
LOW_POWER_MARGIN_W = 15.0
#: The plugin's rank-0 snapshot in its stats_dir.
SNAPSHOT = "rank0.json"


def diff(a: Any, b: Any) -> float | None:
    """``b - a`` where both are numbers, else None."""
    return b - a if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None


# --- load windows ------------------------------------------------------------------------------------
def n_prompts(rate: str | None, window_s: float, conc: int | None) -> int:
    """Prompts for a window: enough for every arrival (Poisson: 3x the mean + 20; closed loop: requests
    of >= 0.5 s each), and no more: 100k random prompts took 23 s to generate on a 2-core host."""
    if rate is None or rate == "sat":
        return int((conc or 64) * (2 * window_s + 2))
    return int(3 * float(rate) * window_s) + 20


def run_window(port: int, label: str, **kw: Any) -> dict:
    """One loadtests run (``kw``: BenchConfig fields over these defaults): ``{"res": its result, "t0",
    "t1": its window in perf_counter s, None if unknown}``."""
    from loadtests import BenchConfig, run

    cfg = dict(base_url=f"http://127.0.0.1:{port}", model="model", label=label, progress=False, request_timeout_s=120.0, timeout_s=600.0)
    res = run(BenchConfig(**{**cfg, **kw}))
    t0 = res.get("t0_perf_counter")
    return {"res": res, "t0": t0, "t1": (t0 + res["duration"]) if t0 is not None and res.get("duration") is not None else None}


def summary(res: dict) -> dict:
    """A loadtests result's :data:`SUMMARY_KEYS` and its energy note."""
    return {**{k: res.get(k) for k in SUMMARY_KEYS if k in res}, "energy_note": res.get("energy_note") or res.get("energy_scope")}


def rate_window(
    port: int, label: str, sampler: Sampler, rate: str, window_s: float, sat_concurrency: int, idle_w: float | None, **kw: Any
) -> dict:
    """``window_s`` of request starts, Poisson at ``rate`` req/s or (``sat``) a closed loop at ``sat_concurrency``,
    in-flight requests finishing inside the window: its :func:`summary` and sampler figures (``idle_w``: the
    server's idle power), at a finite rate also those of a fixed ``span``. ``kw``: BenchConfig fields."""
    sat, n = rate == "sat", n_prompts(rate, window_s, sat_concurrency)
    arrivals = dict(request_rate=math.inf if sat else float(rate), max_concurrency=sat_concurrency if sat else None)
    h = run_window(port, label, num_prompts=n, duration_s=window_s, **arrivals, **kw)
    w = {"request_rate": rate, **summary(h["res"]), "t0": h["t0"], "t1": h["t1"]}
    w["sampler"] = sampler.window(h["t0"], h["t1"], idle_w) if h["t0"] is not None else {}
    if rate != "sat" and h["t0"] is not None and h["t1"] is not None:
        # Fixed span: the harness window ends at the last completion, which at 0.2 req/s can be 5 s
        # into a 10 s window and leaves out the idle time that a low rate is about. The span runs
        # at least window_s from the first arrival (identical in both arms: same schedule).
        end = max(h["t1"], h["t0"] + window_s)
        time.sleep(max(0.0, end - time.perf_counter()) + 0.15)  # + one sampler period past the end
        sp = sampler.window(h["t0"], end, idle_w)
        toks = h["res"].get("total_output_tokens")
        sp["out_tok_per_j"] = toks / sp["energy_j"] if toks and sp.get("energy_j") else None
        sp["end_s"] = end - h["t0"]
        w["span"] = sp
    if not h["res"].get("completed"):
        errs = [e for e in h["res"].get("errors") or [] if e]
        w["error"] = f"0 requests completed; first error: {errs[0] if errs else None}"
    return w


# --- the GPU (read-only) -----------------------------------------------------------------------------
def device_facts(index: int = 0) -> dict[str, Any]:
    """Name, driver and power limit of GPU ``index``; ``{"name": "no NVML (...)"}`` without NVML."""
    from vllm_powersave.device import GpuError, NvmlGpu, driver_version  # here: after --plugin-site is on sys.path

    try:
        gpu = NvmlGpu.from_index(index)
        return {"name": gpu.name(), "driver": driver_version(gpu.nvml), "power_limit_w": gpu.power_limit_w()}
    except GpuError as exc:
        return {"name": f"no NVML ({exc})"}


class Sampler(threading.Thread):
    """10 Hz: energy (J, the plugin's interpolated counter meter), power (W), SM clock, utilisation; ``note``
    says how, and without NVML (a CPU smoke test) is ``unavailable: ...``, with no samples and null figures."""

    def __init__(self, gpu: int, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period, self.stop_ev = period_s, threading.Event()
        self.rows: list[tuple[float, float | None, float | None, int | None, int | None]] = []  # t, J, W, MHz, util %
        try:
            from vllm_powersave.device import NvmlGpu
            from vllm_powersave.energy.meters import open_nvml_meter

            self.gpu = NvmlGpu.from_index(gpu)
            self.meter: Any = open_nvml_meter(self.gpu, start_thread=True)
        except Exception as exc:
            self.meter = None
            self.note = f"unavailable: no NVML sampler ({type(exc).__name__}: {exc})"
            return
        self.note = f"NVML {self.meter.method} ({type(self.meter).__name__}), 10 Hz; utilisation by nvmlDeviceGetUtilizationRates"

    @property
    def measured(self) -> bool:
        return self.meter is not None

    def run(self) -> None:
        next_sync = 0.0
        while self.measured and not self.stop_ev.is_set():
            if (t := time.perf_counter()) >= next_sync and hasattr(self.meter, "sync_counter_phase"):
                with contextlib.suppress(Exception):
                    self.meter.sync_counter_phase()
                next_sync = t + 30.0
            util = None
            with contextlib.suppress(Exception):
                util = self.gpu.utilization_gpu_pct()
            self.rows.append((time.perf_counter(), self.meter.energy_j(), self.meter.power_w(), self.meter.sm_clock_mhz(), util))
            time.sleep(self.period)

    def window(self, t0: float, t1: float, idle_w: float | None = None) -> dict:
        """Figures of the samples between ``t0`` and ``t1`` (perf_counter s); ``idle_w``: the server's idle power."""
        if not self.measured:
            return {"note": self.note, "energy_j": None, "avg_power_w": None, "gpu_idle_share": None}
        if len(rows := [r for r in self.rows if t0 <= r[0] <= t1]) < 2:
            return {"note": "fewer than 2 samples in the window"}
        ws, utils = [r[2] for r in rows if r[2] is not None], [r[4] for r in rows if r[4] is not None]
        clocks = sorted(r[3] for r in rows if r[3] is not None)
        out = {"seconds": rows[-1][0] - rows[0][0], "samples": len(rows), "energy_j": diff(rows[0][1], rows[-1][1])}
        out["avg_power_w"] = sum(ws) / len(ws) if ws else None
        out["median_sm_clock_mhz"] = clocks[len(clocks) // 2] if clocks else None
        out["gpu_idle_share"] = sum(1 for u in utils if u == 0) / len(utils) if utils else None
        out["mean_util_pct"] = sum(utils) / len(utils) if utils else None
        # Energy of the samples with utilisation 0 % (power x sample spacing): inside a window where
        # requests are running, a plugin-independent estimate of energy spent with the GPU waiting.
        idle_j = [(b[0] - a[0]) * a[2] for a, b in zip(rows, rows[1:]) if a[4] == 0 and a[2] is not None]
        out["util0_energy_j"] = sum(idle_j) if utils else None
        if idle_w is not None and ws:
            out["gpu_low_power_share"] = sum(1 for w in ws if w < idle_w + LOW_POWER_MARGIN_W) / len(ws)
        if out["energy_j"] is not None and out["seconds"] > 0:
            out["avg_power_from_energy_w"] = out["energy_j"] / out["seconds"]
        return out

    def energy_at(self, t: float) -> float | None:
        """Energy (J) interpolated between the two samples around ``t``."""
        rows = [r for r in self.rows if r[1] is not None]
        for a, b in zip(rows, rows[1:]):
            if a[0] <= t <= b[0]:
                return a[1] + (b[1] - a[1]) * (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else a[1]
        return None

    def energy_between(self, t_a: float, t_b: float, wait_s: float = 1.0) -> float | None:
        """Counter energy (J) from ``t_a`` to ``t_b`` (perf_counter s), after waiting up to ``wait_s`` for
        the first sample past ``t_b``; None where the samples do not cover both."""
        deadline = time.perf_counter() + wait_s
        while self.rows and self.rows[-1][0] < t_b and time.perf_counter() < deadline:
            time.sleep(0.05)
        return diff(self.energy_at(t_a), self.energy_at(t_b))

    def timeline(self, t0: float) -> list:
        """Every fifth sample from ``t0``: (s since t0, W, SM MHz, utilisation %)."""
        return [(round(r[0] - t0, 2), None if r[2] is None else round(r[2], 1), r[3], r[4]) for r in self.rows[::5] if r[0] >= t0]


# --- the plugin's own figures ------------------------------------------------------------------------
def scrape(port: int) -> tuple[dict[str, float], str]:
    """``powersave_*`` series of /metrics as {name{labels}: value}, and the text of those lines."""
    if (text := metrics_text(port)).startswith("# scrape failed"):
        return {}, text.rstrip("\n")
    keep, out = [ln for ln in text.splitlines() if ln.startswith("powersave_")], {}
    for key, _, val in (ln.rpartition(" ") for ln in keep):
        with contextlib.suppress(ValueError):
            out[key] = float(val)
    return out, "\n".join(keep)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters (``_total``, ``_joules``, ``_seconds``) that moved: ``after - before``."""
    counters = (k for k in after if k.split("{")[0].endswith(("_total", "_joules", "_seconds")))
    return {k: round(after[k] - before.get(k, 0.0), 6) for k in counters if after[k] != before.get(k)}


def series_sum(d: dict[str, float], name: str) -> float | None:
    """The sum of ``name`` over its label sets; None where it is absent."""
    vs = [v for k, v in d.items() if k.split("{")[0] == name]
    return sum(vs) if vs else None


def new_lines(stats_dir: Path, pattern: str, offsets: dict[str, int]) -> list[dict]:
    """JSON lines of the files matching ``pattern`` past ``offsets`` (bytes by file name, e.g. their sizes before)."""
    out = []
    for f in sorted(stats_dir.glob(pattern)):
        with open(f, "rb") as fh:
            fh.seek(offsets.get(f.name, 0))
            for raw in fh.read().splitlines():
                with contextlib.suppress(ValueError):
                    out.append(json.loads(raw))
    return out


def read_snapshot(stats_dir: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((stats_dir / SNAPSHOT).read_text())
    return None


def wait_snapshot_after(stats_dir: Path, wall_t: float, timeout_s: float = 5.0) -> dict | None:
    """The rank-0 snapshot written after wall time ``wall_t`` (its ``t``), or the latest one."""
    deadline, snap = time.monotonic() + timeout_s, read_snapshot(stats_dir)
    while time.monotonic() < deadline and not (snap and snap.get("t", 0) > wall_t):
        time.sleep(0.05)
        snap = read_snapshot(stats_dir)
    return snap
