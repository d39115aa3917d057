#!/usr/bin/env python3
"""Stock vLLM against ``--plugin powersave`` with its defaults, one server at a time, read-only.

Runs ON the GPU machine after the bundle is up (``.gpu-bundle/README.md``), or on a CPU build
against a tiny model for a smoke test (no NVML there: energy, power and idle-share figures are
null and labelled ``unavailable``). One server per arm occurrence, in the order of ``--order``
(e.g. ``stock,defaults`` then, in a second call, ``defaults,stock``: ABBA over calls and GPUs;
``benchmarks/h200_defaults_record.py`` pairs adjacent stock/defaults servers of one GPU). Both arms
share the same model, serve flags and request schedules (same seeds), so a pair's windows see
identical arrivals and prompts.

Arms:

* ``stock``: vLLM alone: on the GPU machine a ``PYTHONPATH`` without the plugin's wheel
  (``--stock-site``, as every earlier device run); where the plugin is importable (``--stock-site
  ''``, the CPU smoke test) ``VLLM_PLUGINS=`` (empty: vLLM loads no general plugin);
* ``defaults``: ``--plugin powersave`` and no saving setting. Observation-only settings come
  through ``$POWERSAVE_CONFIG`` (``--defaults-observe``; default: ``stats_dir``, ``trace_steps``,
  ``per_request_energy``): they change no saving, and leave ``--additional-config`` empty, so the
  engine's compile cache key is the stock server's (one torch.compile per call, not one per arm);
* ``fix``: the defaults arm with the fix that ``vllm-powersave advise`` gave for the starvation
  window (``--api-server-count N`` found in its output; else ``--fix-args``), measured at the same
  load as the starvation window.

Per stock/defaults server: warm-up; ``--idle-s`` of idle with the engine loaded (after
``--settle-s``: the ``auto`` boost's side context is released 2 s after the last step); one
Poisson window per ``--rates`` (``sat`` = closed loop at ``--sat-concurrency``), ``--window-s`` of
request starts each, in-flight requests finish inside the window (the drain: ~256 steps, ~3-4 s on
the 7B). Finite rates also get a fixed ``span`` of at least ``--window-s`` from the first arrival
(at 0.2 req/s two requests may be done 5 s into a 10 s window: the harness window would leave the
idle tail out). Only where named in ``--segments`` (or ``--segments-last``: the last defaults
server only), defaults servers add ``reqenergy`` (``--reqe-n`` identical-length requests at
concurrency ``--reqe-conc``: the plugin's per-request lines against the NVML counter, and its
``request_energy_j_tail``) and ``starvation`` (closed loop at ``--starv-conc`` through one API
server; the plugin's ``powersave_idle_while_busy_*`` counters, its warning from the server log, and
``vllm-powersave advise --result ... --metrics ... --api-servers 1``).

Measurements: energy of a load window = the loadtests harness's NVML counter window (measured);
idle power, energy, SM clock and GPU utilisation from a 10 Hz sampler on the plugin's own
``NvmlEnergyMeter`` (interpolated counter) plus ``nvmlDeviceGetUtilizationRates`` (a read).
``gpu_idle_share`` of a window = share of those samples with utilisation 0 % (NVML: no kernel ran
during the driver's last sample period, 1/6 s to 1 s by product); ``gpu_low_power_share`` = share
with power below the server's idle power + ``LOW_POWER_MARGIN_W``, kept as a cross-check.

Default schedule: three servers per device call of <= 570 s (``--budget-s 550``). The plan is
printed at start (``--plan-only``: only that): start-up ~80 s with a warm torch.compile cache
(``--start-est-s``), ~120 s for the call's first (``--start-est-first-s``); per server after
start-up ~86 s (warm-up 4, settle + idle 18.5, rates 0.2, 1, 4 ~14 s each, sat ~16 s, stop 6):
``stock,defaults,defaults`` ~540 s. The defaults arm leaves ``--additional-config`` empty, so its
compile cache key is stock's. Before each segment the script checks that it and the server's stop
fit in what is left of ``--budget-s`` and skips it (noted in ``notes``) otherwise.

One GPU, three calls (6 servers S D D | S S D: pairs (S,D) (D,S) (S,D) across the two raw files,
``h200_defaults_record.py A.json B.json`` in that order), then the starvation fix::

    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.h200_defaults --gpu 0 --order stock,defaults,defaults --budget-s 550
    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.h200_defaults --gpu 0 --order stock,stock,defaults --budget-s 550
    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.h200_defaults --gpu 0 --order defaults,fix --segments starvation,reqenergy --budget-s 550
    python3 -m benchmarks.h200_defaults_record OUT_A/defaults-*.json OUT_B/defaults-*.json OUT_C/defaults-*.json \
        --trace-out docs/results/h200-closed-loop-decisions

(on the device after ``device.sh unpack`` and the wheel into /tmp/psite; PYTHONPATH=/tmp/site).
The defaults arm writes its step trace (``trace_steps``), with the closed-loop decode clock's
decision lines ``{"closed_loop": {...}}``, into the servers tarball (gzip, tarball <= 16 MB).

CPU smoke test: ``--model-dir /tmp/tiny --plugin-site '' --stock-site '' --energy none`` and tiny
windows (``--serve-args "--max-num-seqs 16 --gpu-memory-utilization 0.15 --enforce-eager"``).

Never changes a GPU setting: refuses to start unless ``POWERSAVE_FORCE_DRY_RUN=1``. Writes under
``--out`` (default ``$OUT``): ``defaults-<tag>.json`` (rewritten after every window) and
``servers-<tag>.tar.gz`` (server logs, step traces, request-energy lines, advise output; rebuilt
after every server), then prints a summary table.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from .lib.device import T0, make_model, require_dry_run, write_json_atomic
from .lib.device import log as _log
from .lib.serve import NO_MULTICAST, SUMMARY_KEYS, metrics_text, start_server, stop, wait_healthy

log = functools.partial(_log, tag="defaults")

# --- names the plugin side provides (kept here so that a rename is one edit) ------------------------
#: Front-end starvation counters (vllm_powersave/metrics.py, docs/metrics.md): GPU energy and time
#: with the engine idle while an API server had requests in flight, and the busy time they are a
#: share of (per engine).
STARVATION_METRICS = (
    "powersave_idle_while_busy_energy_joules_total",
    "powersave_idle_while_busy_seconds_total",
    "powersave_frontend_busy_seconds_total",
)
#: Energy of non-idle time charged to no request (docs/request-energy.md); snapshot field alongside.
REQUEST_TAIL_METRIC = "powersave_request_tail_energy_joules_total"
REQUEST_TAIL_SNAPSHOT = "request_energy_j_tail"
#: The plugin's warning about a starved GPU in the server log (vllm_powersave/starvation.py,
#: StarvationWatch.check: "powersave: engine N: GPU idle X % of busy time (... J over ... s) while
#: requests were in flight at the API server: ... try --api-server-count M (now N); ...").
STARVATION_WARNING = re.compile(r"powersave: engine \d+: GPU idle .*while requests were in flight|api-server-count", re.I)
#: Per-request energy lines and the per-rank snapshot the plugin writes into its stats_dir.
REQUEST_LINES = "requests-rank*.jsonl"
TRACE_LINES = "trace-rank*.jsonl"
SNAPSHOT = "rank0.json"
#: ``vllm-powersave advise`` (vllm_powersave/cli.py, advise.py), tried in turn until one exits 0
#: ({py}: this Python; {url}: the server; {metrics}: the /metrics scrape after the window;
#: {report}: the harness result of the starvation window, with the window's starvation counter
#: deltas; {n}: API servers of the run). --result wins over --metrics' totals since start.
ADVISE_CMDS = (
    "{py} -m vllm_powersave.cli advise --result {report} --metrics {metrics} --api-servers {n}",
    "{py} -m vllm_powersave.cli advise --result {report} --api-servers {n}",
    "{py} -m vllm_powersave.cli advise --metrics {url} --api-servers {n}",
)
#: The servers tarball stays below this; step traces are dropped (largest first, noted) beyond it.
TAR_MAX_BYTES = 16 * 1024 * 1024
LOW_POWER_MARGIN_W = 15.0
#: no FlashInfer in the bundle, offline, NVLink multicast off.
SERVER_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    **NO_MULTICAST,
}

#: The A/B runner's summary keys with the p90 before the p99 of TTFT and TPOT, then the energy note
#: and the steady-state figures.
SUMMARY_KEYS = (
    *(x for k in SUMMARY_KEYS for x in ((k.replace("p99", "p90"), k) if k in ("p99_ttft_ms", "p99_tpot_ms") else (k,))),
    "energy_note",
    "steady_state_duration_s",
    "steady_state_output_tokens_per_joule",
)


# --- GPU sampling (read-only) ------------------------------------------------------------------------
class Sampler(threading.Thread):
    """10 Hz: energy (J, the plugin's interpolated counter meter), power (W), SM clock, utilisation."""

    def __init__(self, gpu: int, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        from vllm_powersave.device import NvmlGpu
        from vllm_powersave.energy.meters import open_nvml_meter

        self.gpu = NvmlGpu.from_index(gpu)
        self.meter = open_nvml_meter(self.gpu, start_thread=True)
        self.period = period_s
        self.rows: list[tuple[float, float | None, float | None, int | None, int | None]] = []  # t, J, W, MHz, util %
        self.stop_ev = threading.Event()
        self.note = f"NVML {self.meter.method} ({type(self.meter).__name__}), 10 Hz; utilisation by nvmlDeviceGetUtilizationRates"

    def run(self) -> None:
        next_sync = 0.0
        while not self.stop_ev.is_set():
            t = time.perf_counter()
            if t >= next_sync and hasattr(self.meter, "sync_counter_phase"):
                try:
                    self.meter.sync_counter_phase()
                except Exception:
                    pass
                next_sync = t + 30.0
            try:
                util = self.gpu.utilization_gpu_pct()
            except Exception:
                util = None
            self.rows.append((time.perf_counter(), self.meter.energy_j(), self.meter.power_w(), self.meter.sm_clock_mhz(), util))
            time.sleep(self.period)

    def window(self, t0: float, t1: float, idle_w: float | None = None) -> dict:
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        if len(rows) < 2:
            return {"note": "fewer than 2 samples in the window"}
        ws = [r[2] for r in rows if r[2] is not None]
        clocks = sorted(r[3] for r in rows if r[3] is not None)
        utils = [r[4] for r in rows if r[4] is not None]
        e0, e1 = rows[0][1], rows[-1][1]
        out = {
            "seconds": rows[-1][0] - rows[0][0],
            "samples": len(rows),
            "energy_j": (e1 - e0) if e0 is not None and e1 is not None else None,
            "avg_power_w": sum(ws) / len(ws) if ws else None,
            "median_sm_clock_mhz": clocks[len(clocks) // 2] if clocks else None,
            "gpu_idle_share": sum(1 for u in utils if u == 0) / len(utils) if utils else None,
            "mean_util_pct": sum(utils) / len(utils) if utils else None,
        }
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

    def timeline(self, t0: float) -> list:
        return [(round(r[0] - t0, 2), None if r[2] is None else round(r[2], 1), r[3], r[4]) for r in self.rows[::5] if r[0] >= t0]


class NullSampler:
    def __init__(self, reason: str) -> None:
        self.note = f"unavailable: {reason}"
        self.stop_ev = threading.Event()

    def start(self) -> None:
        pass

    def window(self, t0: float, t1: float, idle_w: float | None = None) -> dict:
        return {"note": self.note, "energy_j": None, "avg_power_w": None, "gpu_idle_share": None}

    def energy_at(self, t: float) -> None:
        return None

    def timeline(self, t0: float) -> list:
        return []


# --- servers -----------------------------------------------------------------------------------------
def scrape(port: int) -> tuple[dict[str, float], str]:
    """``powersave_*`` series of /metrics as {name{labels}: value}, and the text of those lines."""
    text = metrics_text(port)
    if text.startswith("# scrape failed"):
        return {}, text.rstrip("\n")
    out, keep = {}, []
    for line in text.splitlines():
        if line.startswith("powersave_"):
            keep.append(line)
            key, _, val = line.rpartition(" ")
            try:
                out[key] = float(val)
            except ValueError:
                pass
    return out, "\n".join(keep)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: round(v - before.get(k, 0.0), 6)
        for k, v in after.items()
        if k.split("{")[0].endswith(("_total", "_joules", "_seconds")) and v != before.get(k)
    }


def series_sum(d: dict[str, float], name: str) -> float | None:
    vs = [v for k, v in d.items() if k.split("{")[0] == name]
    return sum(vs) if vs else None


def starvation_figures(d: dict[str, float]) -> dict:
    named = {k: v for k, v in d.items() if k.split("{")[0] in STARVATION_METRICS}
    if named:
        j, s_, busy = (series_sum(d, n) for n in STARVATION_METRICS)
        return {
            "series": named,
            "how": "plugin counters " + ", ".join(STARVATION_METRICS) + " (delta over the window)",
            "idle_while_busy_j": j,
            "idle_while_busy_s": s_,
            "frontend_busy_s": busy,
            "idle_while_busy_share_of_busy": (s_ / busy) if s_ is not None and busy else None,
        }
    return {"series": {}, "how": "none of " + ", ".join(STARVATION_METRICS) + " moved on /metrics"}


# --- load windows ------------------------------------------------------------------------------------
def n_prompts(rate: str | None, window_s: float, conc: int | None) -> int:
    """Prompts to generate for a window: enough for every arrival (Poisson: 3x the mean + 20) or, in
    a closed loop, for requests of >= 0.5 s each; generating 100k random prompts took 23 s on a
    2-core host, once per window."""
    if rate is None or rate == "sat":
        return int((conc or 64) * (2 * window_s + 2))
    return int(3 * float(rate) * window_s) + 20


def harness(ns: argparse.Namespace, port: int | list[int], label: str, **kw: Any) -> dict:
    from loadtests import BenchConfig, run

    ports = port if isinstance(port, list) else [port]
    cfg = dict(
        base_url=f"http://127.0.0.1:{ports[0]}",
        model="model",
        input_len=ns.input_len,
        output_len=ns.output_len,
        energy=ns.energy,
        gpus=[ns.gpu],
        label=label,
        progress=False,
        request_timeout_s=120.0,
        timeout_s=600.0,
    )
    cfg.update(kw)
    res = run(BenchConfig(**cfg))
    t0 = res.get("t0_perf_counter")
    return {"res": res, "t0": t0, "t1": (t0 + res["duration"]) if t0 is not None and res.get("duration") is not None else None}


def summary(res: dict) -> dict:
    out = {k: res.get(k) for k in SUMMARY_KEYS if k in res}
    out["energy_note"] = res.get("energy_note") or res.get("energy_scope")
    return out


def load_window(ns: argparse.Namespace, sampler: Any, port: int, label: str, rate: str, seed: int, idle_w: float | None) -> dict:
    if rate == "sat":
        kw = dict(request_rate=float("inf"), max_concurrency=ns.sat_concurrency)
    else:
        kw = dict(request_rate=float(rate), max_concurrency=None)
    h = harness(
        ns, port, f"{label}-r{rate}", num_prompts=n_prompts(rate, ns.window_s, ns.sat_concurrency), duration_s=ns.window_s, seed=seed, **kw
    )
    w = {"request_rate": rate, **summary(h["res"]), "t0": h["t0"], "t1": h["t1"]}
    w["sampler"] = sampler.window(h["t0"], h["t1"], idle_w) if h["t0"] is not None else {}
    if rate != "sat" and h["t0"] is not None and h["t1"] is not None:
        # Fixed span: the harness window ends at the last completion, which at 0.2 req/s can be 5 s
        # into a 10 s window and leaves out the idle time that a low rate is about. The span runs
        # at least --window-s from the first arrival (identical in both arms: same schedule).
        end = max(h["t1"], h["t0"] + ns.window_s)
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


# --- segments ----------------------------------------------------------------------------------------
def stats_lines(stats_dir: Path, pattern: str) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in stats_dir.glob(pattern)}


def new_lines(stats_dir: Path, pattern: str, offsets: dict[str, int]) -> list[dict]:
    out = []
    for f in sorted(stats_dir.glob(pattern)):
        with open(f, "rb") as fh:
            fh.seek(offsets.get(f.name, 0))
            for raw in fh.read().splitlines():
                try:
                    out.append(json.loads(raw))
                except ValueError:
                    pass
    return out


def read_snapshot(stats_dir: Path) -> dict | None:
    try:
        return json.loads((stats_dir / SNAPSHOT).read_text())
    except (OSError, ValueError):
        return None


def wait_snapshot_after(stats_dir: Path, wall_t: float, timeout_s: float = 5.0) -> dict | None:
    """The rank-0 snapshot written after wall time ``wall_t`` (its ``t``), or the latest one."""
    deadline = time.monotonic() + timeout_s
    snap = read_snapshot(stats_dir)
    while time.monotonic() < deadline and not (snap and snap.get("t", 0) > wall_t):
        time.sleep(0.05)
        snap = read_snapshot(stats_dir)
    return snap


def snap_energy(snap: dict | None) -> dict | None:
    if not snap or not isinstance(snap.get("energy_j"), dict):
        return None
    return {k: v for k, v in snap["energy_j"].items() if isinstance(v, (int, float))}


def request_energy_segment(ns: argparse.Namespace, sampler: Any, port: int, stats_dir: Path, label: str) -> dict:
    """``--reqe-n`` requests of identical length at a steady batch: the plugin's per-request figures
    (its lines in stats_dir) against the NVML counter over the same span (snapshot to snapshot)."""
    time.sleep(ns.settle_s)
    offs = stats_lines(stats_dir, REQUEST_LINES)
    m0, _ = scrape(port)
    wall0, perf0 = time.time(), time.perf_counter()
    snap0 = wait_snapshot_after(stats_dir, wall0)
    # Identical requests started together finish together: the batch then runs in waves that ramp
    # up and drain, and the first and last of each wave share steps with few others. Starting them
    # at a constant rate of about --reqe-conc per request lifetime staggers them once; the
    # concurrency cap then keeps the batch full, one request ending as the next starts.
    rate = math.inf if ns.reqe_rate == "inf" else ns.reqe_conc / ((ns.reqe_out * ns.reqe_tpot_ms + 50.0) / 1e3)
    if ns.reqe_rate not in ("inf", "auto"):
        rate = float(ns.reqe_rate)
    h = harness(
        ns,
        port,
        f"{label}-reqe",
        num_prompts=ns.reqe_n,
        max_concurrency=ns.reqe_conc,
        input_len=ns.reqe_in,
        output_len=ns.reqe_out,
        seed=7,
        request_rate=rate,
        arrival="constant",
    )
    time.sleep(ns.settle_s)  # every request's line written, the engine idle again
    wall1, perf1 = time.time(), time.perf_counter()
    snap1 = wait_snapshot_after(stats_dir, wall1)
    m1, _ = scrape(port)
    lines = new_lines(stats_dir, REQUEST_LINES, offs)
    seg: dict = {
        "n": ns.reqe_n,
        "concurrency": ns.reqe_conc,
        "input_len": ns.reqe_in,
        "output_len": ns.reqe_out,
        "request_rate": None if math.isinf(rate) else round(rate, 2),
        "arrivals": "all at once (waves)" if math.isinf(rate) else "constant rate, then one start per finish (staggered)",
        "prompts": "random tokens of equal length, distinct per request (no prefix-cache hits), ignore_eos",
        "harness": summary(h["res"]),
        "lines": lines,
        "snapshot_fields": sorted(snap1) if snap1 else None,
    }
    e0, e1 = snap_energy(snap0), snap_energy(snap1)
    if e0 is not None and e1 is not None:
        seg["plugin_energy_j_by_phase"] = {k: e1[k] - e0.get(k, 0.0) for k in e1}
        # The counter over the snapshots' own span: their 't' is wall time, mapped onto perf_counter.
        t_a = perf0 + (snap0.get("t", wall0) - wall0)
        t_b = perf1 + (snap1.get("t", wall1) - wall1)
        deadline = time.perf_counter() + 1.0  # the sampler's next row after the snapshot
        while getattr(sampler, "rows", None) and sampler.rows[-1][0] < t_b and time.perf_counter() < deadline:
            time.sleep(0.05)
        ca, cb = sampler.energy_at(t_a), sampler.energy_at(t_b)
        seg["counter_j"] = (cb - ca) if ca is not None and cb is not None else None
        seg["span_s"] = t_b - t_a
    else:
        seg["plugin_energy_j_by_phase"], seg["counter_j"] = None, None
        seg["note"] = "no plugin snapshot with energy_j in stats_dir"
    seg["counter_harness_window_j"] = h["res"].get("gpu_energy_j")
    # Non-idle energy charged to no request over the segment (after a batch's last step until idle
    # is detected): the snapshot's field and the /metrics counter, each as a delta.
    t0_, t1_ = (snap0 or {}).get(REQUEST_TAIL_SNAPSHOT), (snap1 or {}).get(REQUEST_TAIL_SNAPSHOT)
    seg["tail_j"] = (t1_ - t0_) if isinstance(t0_, (int, float)) and isinstance(t1_, (int, float)) else None
    a_, b_ = series_sum(m0, REQUEST_TAIL_METRIC), series_sum(m1, REQUEST_TAIL_METRIC)
    seg["tail_j_metrics"] = (b_ - a_) if a_ is not None and b_ is not None else None
    return seg


def run_advise(ns: argparse.Namespace, port: int, workdir: Path, label: str, report: dict, metrics_text: str) -> dict:
    metrics_f = workdir / f"metrics-{label}.txt"
    metrics_f.write_text(metrics_text)
    report_f = workdir / f"starv-report-{label}.json"
    report_f.write_text(json.dumps(report))
    env = {**os.environ}
    if ns.plugin_site:
        env["PYTHONPATH"] = f"{ns.plugin_site}:{ns.stock_site}"
    attempts = []
    for tmpl in [ns.advise_cmd] if ns.advise_cmd else ADVISE_CMDS:
        cmd = tmpl.format(py=sys.executable, url=f"http://127.0.0.1:{port}/metrics", metrics=metrics_f, report=report_f, n=1)
        try:
            r = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60, env=env)
            a = {"cmd": cmd, "rc": r.returncode, "stdout": r.stdout[-6000:], "stderr": r.stderr[-2000:]}
        except Exception as exc:
            a = {"cmd": cmd, "rc": None, "stdout": "", "stderr": f"{type(exc).__name__}: {exc}"}
        attempts.append(a)
        if a["rc"] == 0:
            break
    (workdir / f"advise-{label}.txt").write_text("\n\n".join(f"$ {a['cmd']}\nrc={a['rc']}\n{a['stdout']}\n{a['stderr']}" for a in attempts))
    ok = next((a for a in attempts if a["rc"] == 0), None)
    m = re.search(r"--api-server-count[ =](\d+)", ok["stdout"]) if ok else None
    return {
        "attempts": attempts,
        "ok": ok is not None,
        "output": ok["stdout"] if ok else None,
        "fix_args": f"--api-server-count {m.group(1)}" if m else None,
    }


def starv_window(ns: argparse.Namespace, sampler: Any, port: int, label: str, after_s: float = 0.0) -> tuple[dict, dict]:
    """The closed loop at ``--starv-conc`` (starvation segment and fix arm): harness output and
    the window's figures, read ``after_s`` after its end."""
    h = harness(
        ns,
        port,
        f"{label}-starv",
        num_prompts=n_prompts(None, ns.starv_window_s, ns.starv_conc),
        max_concurrency=ns.starv_conc,
        duration_s=ns.starv_window_s,
        seed=11,
    )
    time.sleep(after_s)
    sampled = sampler.window(h["t0"], h["t1"]) if h["t0"] is not None else {}
    return h, {"concurrency": ns.starv_conc, **summary(h["res"]), "t0": h["t0"], "t1": h["t1"], "sampler": sampled}


def starvation_segment(ns: argparse.Namespace, sampler: Any, port: int, logp: Path, workdir: Path, label: str) -> dict:
    time.sleep(ns.settle_s)
    log_off = logp.stat().st_size
    before, _ = scrape(port)
    h, w = starv_window(ns, sampler, port, label, after_s=1.0)  # 1 s: the engine's last publish after the window
    after, _ = scrape(port)
    text = metrics_text(port)
    d = delta(before, after)
    fig = starvation_figures(d)
    report = {k: v for k, v in h["res"].items() if not isinstance(v, list)}
    # The window's own starvation figures where the harness did not read them (advise's --result keys).
    for key, fk in (
        ("gpu_idle_while_busy_energy_j", "idle_while_busy_j"),
        ("gpu_idle_while_busy_s", "idle_while_busy_s"),
        ("frontend_busy_s", "frontend_busy_s"),
    ):
        if report.get(key) is None and fig.get(fk) is not None:
            report[key] = fig[fk]
    report.setdefault("max_concurrency", ns.starv_conc)
    adv = run_advise(ns, port, workdir, label, report, text)
    with open(logp, "rb") as f:  # after advise: the plugin warns from its publisher, seconds late at most
        f.seek(log_off)
        tail = f.read().decode(errors="replace").splitlines()
    warnings = [ln[-400:] for ln in tail if STARVATION_WARNING.search(ln) and ("WARN" in ln or "warn" in ln.lower())]
    return {
        "window": w,
        "metrics_delta": d,
        "starvation": fig,
        "idle_while_busy_j": fig.get("idle_while_busy_j"),
        "idle_while_busy_s": fig.get("idle_while_busy_s"),
        "frontend_busy_s": fig.get("frontend_busy_s"),
        "harness_idle_while_busy_j": h["res"].get("gpu_idle_while_busy_energy_j"),
        "warnings": warnings[:10],
        "advise": adv,
    }


# --- plan and budget -------------------------------------------------------------------------------
def drain_s(ns: argparse.Namespace, sat: bool = True) -> float:
    """A request started at a window's end finishes in about this: output_len decode steps of
    --tpot-est-ms at saturation, half that at the Poisson rates (small batches), + 0.5 s."""
    return ns.output_len * ns.tpot_est_ms / 1000.0 * (1.0 if sat else 0.5) + 0.5


def seg_costs(ns: argparse.Namespace) -> dict[str, float]:
    """Estimated wall time of each segment (s), for the plan and the budget checks. ``rate``: one
    Poisson window (gap + window + drain + harness start), ``sat``: the closed-loop window."""
    return {
        "warm": 4.0,
        "idle": ns.settle_s + ns.idle_s + 0.5,
        "rate": ns.gap_s + ns.window_s + drain_s(ns, sat=False) + 0.5,
        "sat": ns.gap_s + ns.window_s + drain_s(ns) + 0.5,
        "reqenergy": 2 * ns.settle_s + -(-ns.reqe_n // ns.reqe_conc) * (ns.reqe_out * ns.tpot_est_ms / 1000.0 + 0.3) + 3.0,
        "starvation": ns.settle_s + ns.starv_window_s + drain_s(ns) + 2.0 + 10.0,  # + advise (up to 3 CLI runs)
        "fix": ns.settle_s + ns.starv_window_s + drain_s(ns) + 2.0,
        "stop": ns.stop_est_s,
    }


def server_segments(ns: argparse.Namespace, order: list[str], pos: int) -> list[str]:
    """Segments of server ``pos``: --segments (reqenergy/starvation on defaults servers only), plus
    --segments-last on the last defaults server of the order."""
    arm = order[pos]
    if arm == "fix":
        return ["fix"]
    segs = [x for x in ns.segments.split(",") if x]
    last_defaults = max((i for i, a in enumerate(order) if a == "defaults"), default=None)
    if arm == "defaults" and pos == last_defaults:
        segs += [x for x in ns.segments_last.split(",") if x and x not in segs]
    if arm == "stock":
        segs = [x for x in segs if x in ("idle", "sweep")]
    return segs


def plan(ns: argparse.Namespace, order: list[str]) -> list[dict]:
    """Per server: estimated start-up and segment times (s)."""
    c, rates = seg_costs(ns), [x for x in ns.rates.split(",") if x]
    out = []
    for pos, arm in enumerate(order):
        segs = server_segments(ns, order, pos)
        parts = {"start": ns.start_est_first_s if pos == 0 else ns.start_est_s, "warm": c["warm"]}
        for x in segs:
            parts[x] = sum(c["sat" if r_ == "sat" else "rate"] for r_ in rates) if x == "sweep" else c[x]
        parts["stop"] = c["stop"]
        out.append(
            {
                "pos": pos,
                "arm": arm,
                "segments": segs,
                "est_s": {k: round(v, 1) for k, v in parts.items()},
                "total_s": round(sum(parts.values()), 1),
            }
        )
    return out


def left_s() -> float:
    return NS_BUDGET[0] - (time.monotonic() - T0)


#: --budget-s, set by main (module-level so that every check reads the same figure).
NS_BUDGET = [math.inf]


# --- one server --------------------------------------------------------------------------------------
def observe_settings(ns: argparse.Namespace, stats_dir: Path) -> dict:
    if ns.defaults_observe == "none":
        return {}
    s: dict = {"stats_dir": str(stats_dir)}
    for item in ns.defaults_observe.split(","):
        if item == "trace":
            s["trace_steps"] = True
        elif item == "reqenergy":
            s["per_request_energy"] = True
    return s


def run_server(
    ns: argparse.Namespace,
    model: Path,
    arm: str,
    pos: int,
    port: int,
    sampler: Any,
    workdir: Path,
    result: dict,
    save: Any,
    segs: list[str],
) -> dict:
    label = f"{arm}{pos}"
    srv: dict = {"pos": pos, "arm": arm, "gpu": ns.gpu, "label": label, "windows": [], "notes": []}
    result["servers"].append(srv)
    stats_dir = Path(ns.stats_root) / f"{ns.tag}-{label}"
    shutil.rmtree(stats_dir, ignore_errors=True)
    env = {"CUDA_VISIBLE_DEVICES": str(ns.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"} if ns.set_visible else {}
    extra: list[str] = []
    if arm == "stock":
        pythonpath = ns.stock_site or None
        if pythonpath is None:  # the plugin is importable here (CPU smoke test): vLLM loads no general plugin
            env["VLLM_PLUGINS"] = ""
    else:
        settings = observe_settings(ns, stats_dir)
        if settings:
            stats_dir.mkdir(parents=True, exist_ok=True)
            cfg_f = workdir / f"powersave-{label}.json"
            cfg_f.write_text(json.dumps({"powersave": settings}))
            env["POWERSAVE_CONFIG"] = str(cfg_f)
        srv["observe_settings"] = settings
        pythonpath = f"{ns.plugin_site}:{ns.stock_site}" if ns.plugin_site else None
        extra = ["--plugin", "powersave"]
        if arm == "fix":
            fix = result.get("advised_fix") or ns.fix_args
            srv["fix_args"] = fix
            srv["fix_source"] = "vllm-powersave advise" if result.get("advised_fix") else "--fix-args (no advice parsed)"
            extra += shlex.split(fix)
    srv["serve_extra"] = extra
    t_start, t_start_perf = time.monotonic(), time.perf_counter()
    serve_args = shlex.split(ns.serve_args)
    p = start_server(label, model, port, extra, pythonpath, workdir, env_extra=env, serve_args=serve_args, max_model_len=ns.max_model_len)
    logp = workdir / f"server-{label}.log"
    srv["log"] = logp.name
    try:
        wait_healthy({label: (p, port)}, ns.start_timeout_s, logs={label: logp})
        srv["startup_s"] = round(time.monotonic() - t_start, 1)
        log(f"[{label}] healthy after {srv['startup_s']} s")
        harness(ns, port, f"{label}-warm", num_prompts=ns.warm_n, max_concurrency=ns.warm_n, output_len=16, energy="none")
        harness(ns, port, f"{label}-warm1", num_prompts=4, max_concurrency=1, output_len=16, energy="none")
        srv["metrics_info"] = [ln for ln in scrape(port)[1].splitlines() if ln.startswith("powersave_info")]
        cost, stop_s = seg_costs(ns), ns.stop_est_s
        srv["segments"] = segs

        def fits(seg: str, what: str) -> bool:
            if left_s() >= cost[seg] + stop_s:
                return True
            srv["notes"].append(f"budget: {what} not run ({left_s():.0f} s left, needs ~{cost[seg] + stop_s:.0f} s with the stop)")
            log(f"[{label}] {srv['notes'][-1]}")
            return False

        if arm == "fix":
            time.sleep(ns.settle_s)
            h, srv["fix_window"] = starv_window(ns, sampler, port, label)
            log(
                f"[{label}] c={ns.starv_conc}: {h['res'].get('output_throughput') or 0:.0f} tok/s, "
                f"{h['res'].get('output_tokens_per_joule')} tok/J"
            )
            save()
            return srv
        idle_w = None
        if "idle" in segs and fits("idle", "idle window"):
            time.sleep(ns.settle_s)
            t0 = time.perf_counter()
            time.sleep(ns.idle_s)
            srv["idle"] = sampler.window(t0, time.perf_counter())
            srv["idle"]["metrics_boost"] = [ln for ln in scrape(port)[1].splitlines() if "boost" in ln]
            idle_w = srv["idle"].get("avg_power_w")
            log(f"[{label}] idle {srv['idle'].get('avg_power_w')} W, SM {srv['idle'].get('median_sm_clock_mhz')} MHz")
            save()
        if "sweep" in segs:
            for k, rate in enumerate(ns.rates.split(",")):
                if not fits("sat" if rate == "sat" else "rate", f"rate {rate} and later"):
                    break
                time.sleep(ns.gap_s)
                w = load_window(ns, sampler, port, label, rate, seed=100 + k, idle_w=idle_w)
                srv["windows"].append(w)
                log(
                    f"[{label}] rate {rate}: {w.get('output_throughput') or 0:.0f} tok/s, {w.get('output_tokens_per_joule')} tok/J, "
                    f"idle share {w['sampler'].get('gpu_idle_share')} (span {(w.get('span') or {}).get('gpu_idle_share')}), TTFT p50 {w.get('median_ttft_ms')}, TPOT p99 {w.get('p99_tpot_ms')}"
                )
                save()
        if arm == "defaults" and "reqenergy" in segs and fits("reqenergy", "request-energy segment"):
            srv["reqenergy"] = request_energy_segment(ns, sampler, port, stats_dir, label)
            n = len(srv["reqenergy"]["lines"])
            log(
                f"[{label}] request energy: {n} lines, counter {srv['reqenergy'].get('counter_j')} J, "
                f"plugin {srv['reqenergy'].get('plugin_energy_j_by_phase')}"
            )
            save()
        if arm == "defaults" and "starvation" in segs and fits("starvation", "starvation segment"):
            srv["starvation"] = starvation_segment(ns, sampler, port, logp, workdir, label)
            st = srv["starvation"]
            if st["advise"]["fix_args"]:
                result["advised_fix"] = st["advise"]["fix_args"]
            log(
                f"[{label}] starvation c={ns.starv_conc}: {st['window'].get('output_throughput') or 0:.0f} tok/s, "
                f"idle-while-busy {st['idle_while_busy_j']} J ({st['starvation']['how']}), {len(st['warnings'])} warning line(s), "
                f"advise ok={st['advise']['ok']} fix={st['advise']['fix_args']}"
            )
            save()
    except Exception as exc:
        srv["notes"].append(f"error: {type(exc).__name__}: {exc}")
        log(f"[{label}] error:", exc)
    finally:
        stop(p)
        srv["snapshot"] = read_snapshot(stats_dir)
        for f in sorted(stats_dir.glob(TRACE_LINES)) + sorted(stats_dir.glob(REQUEST_LINES)):
            with open(f, "rb") as src, gzip.open(workdir / f"{label}-{f.name}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        srv["timeline"] = sampler.timeline(t_start_perf)
        save()
        time.sleep(3.0)  # the GPU drops the context before the next server
    return srv


# --- main --------------------------------------------------------------------------------------------
def pack(workdir: Path, tar_path: Path, result: dict | None = None) -> None:
    """Server logs, step traces (``<label>-trace-rank<N>.jsonl.gz``, closed-loop decision lines
    included), request-energy lines and advise output; step traces dropped, largest first, where
    the tarball would pass TAR_MAX_BYTES (noted in the result)."""
    files = sorted(workdir.iterdir())
    size = sum(f.stat().st_size for f in files)
    dropped = []
    for f in sorted((f for f in files if "-trace-rank" in f.name), key=lambda f: -f.stat().st_size):
        if size <= TAR_MAX_BYTES * 0.95:
            break
        size -= f.stat().st_size
        dropped.append(f.name)
    tmp = tar_path.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as t:
        for f in files:
            if f.name not in dropped:
                t.add(f, arcname=f.name)
    tmp.replace(tar_path)
    if result is not None:
        result["tarball"] = {"bytes": tar_path.stat().st_size, "traces_dropped": dropped}


def print_summary(result: dict) -> None:
    print("\n== summary (" + result["device"].get("name", "?") + "; energy " + result["method"]["energy"] + ")")
    print(f"{'server':<12}{'start s':>8}{'idle W':>8}  rate: out tok/s | tok/J | GPU idle share | TTFT p50 ms | TPOT p99 ms")
    for s in result["servers"]:
        idle = (s.get("idle") or {}).get("avg_power_w")
        cells = [
            f"{w['request_rate']}: {w.get('output_throughput') or 0:.0f} | {w.get('output_tokens_per_joule')} | "
            f"{(w.get('sampler') or {}).get('gpu_idle_share')} | {w.get('median_ttft_ms') and round(w['median_ttft_ms'], 1)} | "
            f"{w.get('p99_tpot_ms') and round(w['p99_tpot_ms'], 2)}"
            for w in s["windows"]
        ]
        print(f"{s['label']:<12}{s.get('startup_s', '-')!s:>8}{idle if idle is None else round(idle, 1)!s:>8}  " + " ; ".join(cells))
        if s.get("starvation"):
            st = s["starvation"]
            print(
                f"{'':<12}starvation c={st['window']['concurrency']}: {st['window'].get('output_throughput') or 0:.0f} tok/s, "
                f"{st['window'].get('output_tokens_per_joule')} tok/J, idle-while-busy {st['idle_while_busy_j']} J, "
                f"warnings {len(st['warnings'])}, advise {'ok' if st['advise']['ok'] else 'failed'} -> {st['advise']['fix_args']}"
            )
        if s.get("fix_window"):
            fw = s["fix_window"]
            print(f"{'':<12}fix {s['fix_args']}: {fw.get('output_throughput') or 0:.0f} tok/s, {fw.get('output_tokens_per_joule')} tok/J")
        if s.get("reqenergy"):
            js = sorted(x["energy_j"] for x in s["reqenergy"]["lines"] if isinstance(x.get("energy_j"), (int, float)))
            if js:
                med = js[len(js) // 2]
                print(
                    f"{'':<12}request energy: {len(js)} lines, median {med:.3f} J, max/median {js[-1] / med if med else None}, "
                    f"sum {sum(js):.1f} J, counter {s['reqenergy'].get('counter_j')}"
                )
        for n in s["notes"]:
            print(f"{'':<12}note: {n}")


def main(argv: list[str] | None = None) -> int:
    require_dry_run()  # first: nothing may touch a GPU before this
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", default="stock,defaults", help="arms in server order: stock, defaults, fix")
    ap.add_argument("--gpu", type=int, default=0, help="NVML / CUDA index (PCI bus order)")
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--model-dir", default=None, help="use this model directory instead of building one from --shape")
    ap.add_argument("--rates", default="0.2,1,4,sat", help="Poisson request rates (req/s); 'sat' = closed loop at --sat-concurrency")
    ap.add_argument("--sat-concurrency", type=int, default=64)
    ap.add_argument("--window-s", type=float, default=10.0, help="request starts per rate window (s)")
    ap.add_argument("--idle-s", type=float, default=15.0, help="idle window per server (s)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="quiet time before idle/segment windows (auto boost: 2 s dwell)")
    ap.add_argument("--gap-s", type=float, default=1.0, help="quiet time before each rate window")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument(
        "--segments",
        default="idle,sweep",
        help="per stock/defaults server: idle, sweep; defaults only, run only where named: reqenergy, starvation "
        "(--segments-last applies to the last defaults server only)",
    )
    ap.add_argument("--segments-last", default="", help="extra segments of the last defaults server of --order only, e.g. reqenergy")
    ap.add_argument("--reqe-n", type=int, default=480)
    ap.add_argument("--reqe-rate", default="auto", help="start rate (req/s): auto = --reqe-conc per request lifetime, inf = all at once")
    ap.add_argument("--reqe-tpot-ms", type=float, default=5.5, help="decode step for --reqe-rate auto (7B, H200: h200-step-timer.md)")
    ap.add_argument("--reqe-conc", type=int, default=48)
    ap.add_argument("--reqe-in", type=int, default=128)
    ap.add_argument("--reqe-out", type=int, default=96)
    ap.add_argument("--starv-conc", type=int, default=64)
    ap.add_argument("--starv-window-s", type=float, default=15.0)
    ap.add_argument("--fix-args", default="--api-server-count 4", help="fix arm's serve flags when advise names none")
    ap.add_argument("--advise-cmd", default=None, help="one advise command template ({py} {url} {metrics} {report})")
    ap.add_argument(
        "--defaults-observe",
        default="trace,reqenergy",
        help="observation-only settings of the defaults arm via $POWERSAVE_CONFIG: trace, reqenergy, or none",
    )
    ap.add_argument("--warm-n", type=int, default=32)
    ap.add_argument("--serve-args", default="--max-num-seqs 256 --gpu-memory-utilization 0.85", help="vllm serve flags of every server")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--energy", default="nvml", help="loadtests energy source (nvml; none on a CPU smoke test)")
    ap.add_argument("--budget-s", type=float, default=550.0, help="start nothing that cannot end by this (s since start)")
    ap.add_argument("--start-est-s", type=float, default=80.0, help="a server's start-up, warm compile cache, for the plan (s)")
    ap.add_argument("--start-est-first-s", type=float, default=120.0, help="the first server's start-up (cold cache), for the plan (s)")
    ap.add_argument("--tpot-est-ms", type=float, default=15.0, help="decode step at saturation, for the drain estimate (ms)")
    ap.add_argument("--stop-est-s", type=float, default=6.0, help="a server's stop + GPU release, for the plan (s)")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--set-visible", action=argparse.BooleanOptionalAction, default=True, help="give servers CUDA_VISIBLE_DEVICES=--gpu")
    ap.add_argument("--shapes-dir", default=".gpu-bundle/shapes")
    ap.add_argument("--tok-dir", default="/tmp/model_cfg")
    ap.add_argument("--plugin-site", default="/tmp/psite", help="'' = inherit PYTHONPATH (CPU smoke test)")
    ap.add_argument("--stock-site", default="/tmp/site", help="'' = inherit PYTHONPATH (CPU smoke test)")
    ap.add_argument("--stats-root", default="/tmp/powersave-defaults")
    ap.add_argument("--port", type=int, default=None, help="default 8100 + 50 * gpu")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--plan-only", action="store_true", help="print the time plan and exit (starts nothing)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ns = ap.parse_args(argv)
    for k, v in SERVER_ENV.items():  # the bundle's vLLM needs the first; the rest keep it offline and NVLS off
        os.environ.setdefault(k, v)
    ns.tag = ns.tag or f"gpu{ns.gpu}-{time.strftime('%m%d%H%M%S', time.gmtime())}"
    if ns.plugin_site:
        sys.path[:0] = [ns.plugin_site]
    order = [a.strip() for a in ns.order.split(",") if a.strip()]
    bad = [a for a in order if a not in ("stock", "defaults", "fix")]
    if bad:
        print(f"error: --order: unknown arm {bad[0]!r} (stock, defaults, fix)", file=sys.stderr)
        return 2
    NS_BUDGET[0] = ns.budget_s
    bad_seg = [x for x in (ns.segments + "," + ns.segments_last).split(",") if x and x not in ("idle", "sweep", "reqenergy", "starvation")]
    if bad_seg:
        print(f"error: --segments: unknown segment {bad_seg[0]!r} (idle, sweep, reqenergy, starvation)", file=sys.stderr)
        return 2
    pl = plan(ns, order)
    total = sum(x["total_s"] for x in pl)
    for x in pl:
        log(f"plan: server {x['pos']} {x['arm']}: ~{x['total_s']:.0f} s (" + ", ".join(f"{k} {v:g}" for k, v in x["est_s"].items()) + ")")
    log(
        f"plan: ~{total:.0f} s for {len(pl)} server(s) against --budget-s {ns.budget_s:g}"
        + ("" if total <= ns.budget_s else "; OVER: segments that cannot finish are skipped (noted)")
    )
    if ns.plan_only:
        return 0
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path("/tmp") / f"defaults-work-{ns.tag}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    raw_f, tar_f = out / f"defaults-{ns.tag}.json", out / f"servers-{ns.tag}.tar.gz"
    model = Path(ns.model_dir) if ns.model_dir else make_model(ns.shape, Path(ns.shapes_dir), Path(ns.tok_dir))
    import vllm

    from .lib.energy import device_facts  # after --plugin-site is on sys.path: it imports the plugin

    try:
        sampler: Any = Sampler(ns.gpu)
    except Exception as exc:  # no NVML (CPU smoke test): energy and idle share are null, labelled
        sampler = NullSampler(f"no NVML sampler ({type(exc).__name__}: {exc})")
        log(sampler.note)
    sampler.start()
    result: dict = {
        "what": "stock vLLM vs --plugin powersave defaults, one server at a time; read-only (POWERSAVE_FORCE_DRY_RUN=1)",
        "measured": not isinstance(sampler, NullSampler),
        "tag": ns.tag,
        "gpu": ns.gpu,
        "device": {k: v for k, v in device_facts(ns.gpu).items() if k != "uuid"},
        "vllm_version": vllm.__version__,
        "model": str(model),
        "shape": None if ns.model_dir else ns.shape,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": {
            "order": order,
            "rates": ns.rates.split(","),
            "sat_concurrency": ns.sat_concurrency,
            "window_s": ns.window_s,
            "idle_s": ns.idle_s,
            "settle_s": ns.settle_s,
            "gap_s": ns.gap_s,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "segments": ns.segments,
            "segments_last": ns.segments_last,
            "drain_s_est": round(drain_s(ns), 2),
            "low_rate_span": "finite rates: energy, idle share and tok/J also over a fixed span of >= window_s from the "
            "first arrival (idle tail included; 'span'), from the 10 Hz sampler",
            "serve_args": ns.serve_args,
            "defaults_observe": ns.defaults_observe,
            "stock": "PYTHONPATH without the plugin (--stock-site), else VLLM_PLUGINS= (empty)",
            "defaults": "--plugin powersave; observation settings only via $POWERSAVE_CONFIG",
            "energy": f"loadtests energy={ns.energy} per load window (counter); sampler: " + sampler.note,
            "gpu_idle_share": "share of 10 Hz samples with NVML utilisation 0 % inside the load window",
            "clocks": "never changed (POWERSAVE_FORCE_DRY_RUN=1)",
            "reqenergy": {"n": ns.reqe_n, "concurrency": ns.reqe_conc, "input_len": ns.reqe_in, "output_len": ns.reqe_out},
            "starvation": {
                "concurrency": ns.starv_conc,
                "window_s": ns.starv_window_s,
                "fix_args_default": ns.fix_args,
                "metrics": STARVATION_METRICS,
            },
        },
        "plan": pl,
        "budget_s": ns.budget_s,
        "servers": [],
        "notes": [],
    }

    save = functools.partial(write_json_atomic, raw_f, result)
    save()
    port = ns.port or 8100 + 50 * ns.gpu
    c = seg_costs(ns)
    for pos, arm in enumerate(order):
        segs = server_segments(ns, order, pos)
        # At least start-up, warm-up, its first segment (idle, or one rate) and the stop must fit.
        first = "fix" if arm == "fix" else ("idle" if "idle" in segs else "rate" if "sweep" in segs else segs[0] if segs else None)
        first = "sat" if first == "rate" and ns.rates.split(",")[0] == "sat" else first
        need = result["plan"][pos]["est_s"]["start"] + c["warm"] + (c[first] if first else 0.0) + c["stop"]
        if left_s() < need:
            result["notes"].append(f"budget: server {pos} ({arm}) not started ({left_s():.0f} s left, needs ~{need:.0f} s)")
            log(result["notes"][-1])
            break
        run_server(ns, model, arm, pos, port + pos, sampler, workdir, result, save, segs)
        pack(workdir, tar_f, result)
    sampler.stop_ev.set()
    result["elapsed_s"] = round(time.monotonic() - T0, 1)
    pack(workdir, tar_f, result)
    save()
    log(f"saved {raw_f} ({raw_f.stat().st_size} bytes), {tar_f} ({tar_f.stat().st_size} bytes)")
    print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
