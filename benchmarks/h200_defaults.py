"""Stock vLLM against ``--plugin powersave`` with its defaults, one server at a time, read-only.

Arms, segments, measurements, the time plan and the commands of an H200 run and of the CPU smoke test:
``docs/benchmarks.md``. Never changes a GPU setting: refuses to start unless ``POWERSAVE_FORCE_DRY_RUN=1``.
Writes under ``--out``: ``defaults-<tag>.json`` (rewritten after every window; ``h200_defaults_record.py``
reads it) and ``servers-<tag>.tar.gz`` (server logs, step traces, request-energy lines, advise output).
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
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_powersave.serving import api_servers_in_log

from .lib import load
from .lib.device import T0, make_model, require_dry_run, write_json_atomic
from .lib.device import log as _log
from .lib.serve import SERVER_ENV, metrics_text, start_server, stop, wait_healthy

log = functools.partial(_log, tag="defaults")

# --- names the plugin side provides (kept here so that a rename is one edit) ------------------------
#: Front-end starvation counters (docs/metrics.md): GPU energy and time with the engine idle while an
#: API server had requests in flight, and the busy time they are a share of (per engine).
STARVATION_METRICS = (
    "powersave_idle_while_busy_energy_joules_total",
    "powersave_idle_while_busy_seconds_total",
    "powersave_frontend_busy_seconds_total",
)
#: The same three as the raw file's figures, and as the harness result keys advise's --result reads.
STARVATION_FIGURES = ("idle_while_busy_j", "idle_while_busy_s", "frontend_busy_s")
ADVISE_RESULT_KEYS = ("gpu_idle_while_busy_energy_j", "gpu_idle_while_busy_s", "frontend_busy_s")
#: Energy of non-idle time charged to no request (docs/request-energy.md); snapshot field alongside.
REQUEST_TAIL_METRIC = "powersave_request_tail_energy_joules_total"
REQUEST_TAIL_SNAPSHOT = "request_energy_j_tail"
#: The plugin's warning about a starved GPU in the server log (vllm_powersave/starvation.py, StarvationWatch.check).
STARVATION_WARNING = re.compile(r"powersave: engine \d+: GPU idle .*while requests were in flight|api-server-count", re.I)
#: Per-request energy lines and step traces the plugin writes into its stats_dir.
REQUEST_LINES = "requests-rank*.jsonl"
TRACE_LINES = "trace-rank*.jsonl"
#: ``vllm-powersave advise``, tried in turn until one exits 0 ({py}: this Python; {url}: the server;
#: {metrics}: the /metrics scrape after the window; {report}: the starvation window's harness result
#: with its starvation counter deltas; {n}: API servers). --result wins over --metrics' totals since start.
ADVISE_CMDS = (
    "{py} -m vllm_powersave.cli advise --result {report} --metrics {metrics} --api-servers {n}",
    "{py} -m vllm_powersave.cli advise --result {report} --api-servers {n}",
    "{py} -m vllm_powersave.cli advise --metrics {url} --api-servers {n}",
)
#: The servers tarball stays below this; step traces are dropped (largest first, noted) beyond it.
TAR_MAX_BYTES = 16 * 1024 * 1024
#: No FlashInfer in the bundle (the bundle's vLLM needs this), offline; start_server turns NVLink multicast off.
#: Options recorded as given in the raw file's ``method``, in this order.
METHOD_OPTIONS = ("sat_concurrency", "window_s", "idle_s", "settle_s", "gap_s", "input_len", "output_len", "segments", "segments_last")
#: --defaults-observe items: the plugin settings they turn on.
OBSERVE = {"trace": "trace_steps", "reqenergy": "per_request_energy"}
#: Arms of --order; segments of --segments / --segments-last.
ARMS = ("stock", "defaults", "fix", "ablation")
SEGMENTS = ("idle", "sweep", "reqenergy", "bursts", "release", "starvation")
#: Bursts segment: the null request's prompt tokens, and the first burst's seed (one per burst).
NULL_PROMPT_TOKENS, BURST_SEED = 8, 1000
#: Bursts segment: a burst whose counter-difference truth is below this (J) is not judged (the
#: 10 Hz counter interpolation is good to a few J at idle edges; 4 x 1,900-token prefills on a 7B
#: model drew ~150 J on an H100, docs/results/h200-request-energy.md).
MIN_BURST_TRUTH_J = 10.0
#: Bursts segment: each span's cut starts this long before its request (deep idle on both spans),
#: and its end power is the counter's slope over this last stretch of the cut (s).
BURST_LEAD_S, END_POWER_S = 0.1, 0.4
#: Bursts segment: a pair whose cuts end more than this apart in power (W) ended in different
#: power states (one in the post-request clock hold, one past it) and is not judged by the cut.
END_POWER_MATCH_W = 10.0


# --- the plugin's figures: /metrics and stats_dir ----------------------------------------------------
def starvation_figures(d: dict[str, float]) -> dict:
    """The starvation counters among the /metrics deltas ``d``, and how they were read."""
    names = ", ".join(STARVATION_METRICS)
    if not (series := {k: v for k, v in d.items() if k.split("{")[0] in STARVATION_METRICS}):
        return {"series": {}, "how": f"none of {names} moved on /metrics"}
    j, s_, busy = (load.series_sum(d, n) for n in STARVATION_METRICS)
    out = {"series": series, "how": f"plugin counters {names} (delta over the window)", **dict(zip(STARVATION_FIGURES, (j, s_, busy)))}
    return {**out, "idle_while_busy_share_of_busy": (s_ / busy) if s_ is not None and busy else None}


@dataclass(frozen=True)
class SnapMark:
    """The plugin's first snapshot written after a moment (``wall``/``perf``: that moment on the
    wall clock and on perf_counter)."""

    wall: float
    perf: float
    snap: dict | None

    @property
    def perf_t(self) -> float:
        """The snapshot's own time ('t', wall clock) on perf_counter, where the sampler's counter lives."""
        return self.perf + ((self.snap or {}).get("t", self.wall) - self.wall)


def snap_between(m0: SnapMark, m1: SnapMark) -> dict | None:
    """The plugin's joules by phase from ``m0``'s snapshot to ``m1``'s; None without energy in both."""
    e0, e1 = snap_energy(m0.snap), snap_energy(m1.snap)
    return None if e0 is None or e1 is None else {k: e1[k] - e0.get(k, 0.0) for k in e1}


def busy_j(phases_j: dict[str, float]) -> float:
    """The plugin's non-idle joules among a span's phase joules."""
    return sum(v for p, v in phases_j.items() if p != "idle")


def null_work_j(runs: list[dict]) -> float | None:
    """The null request's own work: the median of the plugin's busy joules over the segment's null
    spans (the same 8-token request each time). One null's booking can hold a counter jump booked
    back onto its step (17.9 J against 2.4-5.1 J on the H100, docs/results/h200-request-energy.md)."""
    js = [busy_j(x["null"]["plugin_phases_j"]) for x in runs if (x.get("null") or {}).get("plugin_phases_j")]
    return statistics.median(js) if js else None


def bursts_line(runs: list[dict]) -> str:
    """The job's log line on a bursts segment: the judged ratios (``phase_over_truth``, what the
    record judges), and how many pairs were not judged."""
    judged = sorted(r["phase_over_truth"] for r in runs if r.get("phase_over_truth") is not None)
    inside = sum(abs(x - 1.0) <= 0.05 for x in judged)
    return (
        f"bursts: phase booking / truth {[round(x, 3) for x in judged]} ({inside} of {len(judged)} within 5 %), "
        f"{len(runs) - len(judged)} not judged"
    )


def judge_bursts(runs: list[dict], idle_w: float | None) -> list[dict]:
    """Each ``{order, burst, null}`` run's :func:`burst_pair_figures` (figures computed before, as
    an older raw file holds, are not carried over), the null's work at the segment's median null
    booking (:func:`null_work_j`)."""
    work = null_work_j(runs)
    return [{"order": x.get("order"), **burst_pair_figures(x["burst"], x["null"], idle_w, work)} for x in runs]


def burst_pair_figures(burst: dict, null: dict, idle_w: float | None, null_work: float | None = None) -> dict:
    """A burst span against its null-request span (each ``{span_s, busy_s, counter_j,
    plugin_phases_j}``, and ``cut`` where recorded). The plugin's figure is the burst span's busy
    (non-idle) joules; the truth that judges it (``phase_over_truth``) is the cut's where both
    spans have one (:func:`cut_phase_truth`, the null's work at ``null_work``, else at this null's
    booking), else the whole spans' (:func:`spans_truth`; ``truth_method`` says which). A pair
    whose judging truth is under ``MIN_BURST_TRUTH_J`` or missing is not judged (``note``)."""
    out: dict[str, Any] = {"burst": burst, "null": null, "true_busy_j": None, "plugin_busy_j": None, "busy_over_truth": None}
    out["phase_over_truth"] = None
    if burst["plugin_phases_j"] is None or null["plugin_phases_j"] is None:
        return {**out, "note": "a span without counter or plugin energy"}
    busy = {k: busy_j(x["plugin_phases_j"]) for k, x in (("burst", burst), ("null", null))}
    out.update(plugin_phase_j=busy["burst"], null_plugin_busy_j=busy["null"], **spans_truth(burst, null, idle_w, busy))
    cut = cut_phase_truth(burst, null, busy["null"] if null_work is None else null_work)
    if cut is not None:
        out.update(truth_method="cut in the post-request hold", cut=cut, true_phase_j=cut.get("true_phase_j"))
        if cut.get("note"):
            return out
    elif out.get("true_phase_to_idle_j") is not None:
        out.update(truth_method="spans to deep idle", true_phase_j=out["true_phase_to_idle_j"])
    truth = out.get("true_phase_j")
    if truth is None:
        return {**out, "note": out.get("spans_note") or "a span without counter or plugin energy"}
    if truth < MIN_BURST_TRUTH_J:
        # Under a few joules the difference is the counter's and sampler's error, not a burst.
        return {**out, "note": f"burst's true energy {truth:.1f} J below {MIN_BURST_TRUTH_J:g} J: not judged"}
    return {**out, "phase_over_truth": busy["burst"] / truth}


def spans_truth(burst: dict, null: dict, idle_w: float | None, busy: dict[str, float]) -> dict:
    """The truth of spans run to deep idle: the counter's difference between them (their small
    length difference at ``idle_w``), so that the tail above deep idle that follows any request
    cancels, against the plugin's busy-joule difference (``busy_over_truth``); the phase truth adds
    the idle power the burst's longer busy time displaced (``true_phase_to_idle_j``); and each
    span's joules above deep idle that the plugin booked as idle. Empty without counter energy."""
    if burst["counter_j"] is None or null["counter_j"] is None or idle_w is None:
        return {}
    truth = burst["counter_j"] - null["counter_j"] - idle_w * (burst["span_s"] - null["span_s"])
    out: dict[str, Any] = {"true_busy_j": truth, "plugin_busy_j": busy["burst"] - busy["null"]}
    out["idle_above_deep_j"] = {k: x["counter_j"] - idle_w * x["span_s"] - busy[k] for k, x in (("burst", burst), ("null", null))}
    if truth < MIN_BURST_TRUTH_J:
        return {**out, "spans_note": f"burst's true energy {truth:.1f} J below {MIN_BURST_TRUTH_J:g} J: not judged"}
    out["busy_over_truth"] = out["plugin_busy_j"] / truth
    # Phase energy is what the GPU draws while the phase's work runs, baseline included; its rest
    # after the work is idle (docs/request-energy.md, short bursts). The difference above removes
    # the idle power the burst's longer busy time displaced from the end of its span (the spans
    # end at deep idle), and the null's own work (one 8-token step, ~1 J) is left out; the burst's
    # own booking is set against it, not less the null's, which holds whatever part of the null's
    # gap its ticks happened to book (docs/results/h200-request-energy.md).
    to_idle = truth + idle_w * ((burst["busy_s"] or 0.0) - (null["busy_s"] or 0.0))
    return {**out, "true_phase_to_idle_j": to_idle, "phase_over_truth_to_idle": busy["burst"] / to_idle}


def cut_phase_truth(burst: dict, null: dict, null_work_j: float) -> dict | None:
    """The burst's phase energy from each span's ``cut``: the counter from ``BURST_LEAD_S`` before its
    request to a fixed time after it, a point inside the GPU's post-request clock hold for both
    (~1.5-2.1 s at ~127 W on the H100, docs/results/h200-request-energy.md). Ending the spans at deep
    idle instead adds the hold's length, which varies by whole 0.5 s steps from request to request
    (+-27 J against a ~130 J burst), to the truth. With equal cuts the difference is the burst's work
    less the null's, less the hold power over the burst's extra busy time; those two are added back
    (the null's work at the plugin's booking of it, 2-5 J). None where a span has no cut; a note and
    no truth where the cuts end in different power states."""
    cb, cn = burst.get("cut"), null.get("cut")
    if not cb or not cn or None in (cb.get("counter_j"), cn.get("counter_j"), cb.get("end_power_w"), cn.get("end_power_w")):
        return None
    out = {"cut_s": cb.get("cut_s"), "end_power_w": [cb["end_power_w"], cn["end_power_w"]], "null_work_j": null_work_j}
    if abs(cb["end_power_w"] - cn["end_power_w"]) > END_POWER_MATCH_W:
        return {**out, "note": f"cuts end {cb['end_power_w']:.0f} W vs {cn['end_power_w']:.0f} W: different power states, not judged"}
    hold_w = (cb["end_power_w"] + cn["end_power_w"]) / 2.0
    extra_busy_s = (burst["busy_s"] or 0.0) - (null["busy_s"] or 0.0)
    return {**out, "hold_w": hold_w, "true_phase_j": cb["counter_j"] - cn["counter_j"] + hold_w * extra_busy_s + null_work_j}


def snap_energy(snap: dict | None) -> dict | None:
    if not snap or not isinstance(snap.get("energy_j"), dict):
        return None
    return {k: v for k, v in snap["energy_j"].items() if isinstance(v, (int, float))}


def batch_spread(lines: list[dict], keep: float = 0.6) -> list[int] | None:
    """p5 / p50 / p95 of the running requests per step over the middle ``keep`` of the steps' span."""
    steps = [x for x in lines if "t" in x and x.get("reqs")]
    if not steps:
        return None
    a, b = steps[0]["t"], steps[-1]["t"]
    mid = sorted(x["reqs"] for x in steps if a + (1 - keep) / 2 * (b - a) <= x["t"] <= b - (1 - keep) / 2 * (b - a))
    return [mid[int(q * (len(mid) - 1))] for q in (0.05, 0.5, 0.95)] if mid else None


def release_figures(
    lines: list[dict], rows: list, t1: float, idle_w: float | None, low_w: float | None, idle_mhz: int, energy_at
) -> list[dict]:
    """Per perf-boost release in a step trace's ``lines``: its delay after the last step, and how long
    after it the sampler ``rows`` (t, J, W, MHz, util) fell below ``low_w`` and to ``idle_mhz``, up
    to the next step (or ``t1``); the gap's energy above ``idle_w`` (``energy_at``: J at a time)."""
    ends, starts = sorted(x["t_end"] for x in lines if x.get("t_end")), sorted(x["t"] for x in lines if "t" in x)
    out = []
    # ms None: a boost lost without a release (helper death, shutdown), not the dwell's release.
    for b in [x["boost"] for x in lines if "boost" in x and not x["boost"]["held"] and x["boost"]["ms"] is not None]:
        t, last = b["t_s"], max((e for e in ends if e <= b["t_s"]), default=None)
        nxt = min((x for x in starts if x > t), default=t1)
        after = [r for r in rows if t <= r[0] <= nxt]
        fall_w = next((r[0] - t for r in after if low_w and r[2] is not None and r[2] < low_w), None)
        fall_mhz = next((r[0] - t for r in after if r[3] is not None and r[3] <= idle_mhz), None)
        j = load.diff(energy_at(last), energy_at(nxt)) if last else None
        delay, gap = (None, None) if last is None else (t - last, nxt - last)
        out.append(dict(release_after_last_step_s=delay, release_ms=b["ms"], power_fall_s=fall_w, clock_fall_s=fall_mhz, gap_s=gap))
        out[-1]["gap_excess_j"] = None if j is None or idle_w is None else j - idle_w * gap
    return out


# --- one server's segments ---------------------------------------------------------------------------
@dataclass
class Server:
    """A running server and what its segments need: the run's options, the sampler, its port and files."""

    ns: argparse.Namespace
    sampler: load.Sampler
    port: int
    label: str
    workdir: Path
    stats_dir: Path

    @property
    def log_path(self) -> Path:
        return self.workdir / f"server-{self.label}.log"

    @property
    def base(self) -> dict:
        """The loadtests settings of every window: the run's lengths and energy source, on its GPU."""
        return dict(input_len=self.ns.input_len, output_len=self.ns.output_len, energy=self.ns.energy, gpus=[self.ns.gpu])

    def harness(self, name: str, **kw: Any) -> dict:
        """One loadtests run against this server (``kw`` over :attr:`base`)."""
        return load.run_window(self.port, f"{self.label}-{name}", **{**self.base, **kw})

    def mark(self) -> SnapMark:
        """Now, and the plugin's first snapshot after it."""
        wall, perf = time.time(), time.perf_counter()
        return SnapMark(wall, perf, load.wait_snapshot_after(self.stats_dir, wall))

    def idle(self) -> dict:
        time.sleep(self.ns.settle_s)
        t0 = time.perf_counter()
        time.sleep(self.ns.idle_s)
        w = self.sampler.window(t0, time.perf_counter())
        w["metrics_boost"] = [ln for ln in load.scrape(self.port)[1].splitlines() if "boost" in ln]
        log(f"[{self.label}] idle {w.get('avg_power_w')} W, SM {w.get('median_sm_clock_mhz')} MHz")
        return w

    def load_window(self, rate: str, seed: int, idle_w: float | None) -> dict:
        ns = self.ns
        b0 = self.boost_series()
        w = load.rate_window(
            self.port, f"{self.label}-r{rate}", self.sampler, rate, ns.window_s, ns.sat_concurrency, idle_w, seed=seed, **self.base
        )
        # Perf boost auto's side context over the window: how often it switched and whether it
        # held at the end (h200-under-load.md asks whether it let go under load). Stock: none.
        b1 = self.boost_series()
        if b1:
            w["boost"] = {"switches": load.delta(b0, b1), "at_end": {k: v for k, v in b1.items() if "_held" in k}}
        log(
            f"[{self.label}] rate {rate}: {w.get('output_throughput') or 0:.0f} tok/s, {w.get('output_tokens_per_joule')} tok/J, "
            f"idle share {w['sampler'].get('gpu_idle_share')} (span {(w.get('span') or {}).get('gpu_idle_share')}), "
            f"TTFT p50 {w.get('median_ttft_ms')}, TPOT p99 {w.get('p99_tpot_ms')}"
        )
        return w

    def boost_series(self) -> dict[str, float]:
        """The plugin's ``powersave_cuda_boost_*`` series now ({} for stock, or a failed scrape)."""
        return {k: v for k, v in load.scrape(self.port)[0].items() if k.startswith("powersave_cuda_boost")}

    def request_energy(self, shape: "ReqeShape") -> dict:
        """``shape.n`` requests of identical length at a steady batch: the plugin's per-request figures
        (its lines in stats_dir) against the NVML counter over the same span (snapshot to snapshot)."""
        ns, stats_dir = self.ns, self.stats_dir
        time.sleep(ns.settle_s)
        offs = {f.name: f.stat().st_size for f in stats_dir.glob(REQUEST_LINES)}
        m0, _ = load.scrape(self.port)
        mark0 = self.mark()
        # Identical requests started together finish together: the batch then runs in waves that ramp
        # up and drain, and the first and last of each wave share steps with few others. A cap on
        # concurrency keeps that: a start per finish re-synchronises starts with finishes, and the
        # waves came back within 2 s on the H200 (h200-request-energy.md, run I). Open-loop starts at
        # a constant rate have no such feedback: the batch settles at rate x lifetime (Little's law).
        rate = shape.start_rate(ns.reqe_conc, ns.reqe_tpot_ms)
        waves = math.isinf(rate)
        cap = ns.reqe_conc if waves or ns.reqe_cap else None
        reqe = dict(num_prompts=shape.n, max_concurrency=cap, input_len=shape.input_len, output_len=shape.output_len)
        t_offs = {f.name: f.stat().st_size for f in stats_dir.glob(TRACE_LINES)}
        # Not streamed by default: at ~80 req/s x 96 tokens one client process lags behind its own
        # schedule (loadtests' loop-lag check), and its bunched starts unsteady the batch (run J).
        h = self.harness("reqe", **reqe, seed=7, request_rate=rate, arrival="constant", stream=ns.reqe_stream)
        time.sleep(ns.settle_s)  # every request's line written, the engine idle again
        mark1 = self.mark()
        m1, _ = load.scrape(self.port)
        seg: dict = dict(n=shape.n, concurrency=ns.reqe_conc, cap=cap, stream=ns.reqe_stream, input_len=shape.input_len)
        seg.update(output_len=shape.output_len, request_rate=None if waves else round(rate, 2))
        closed = "then one start per finish" if cap else "open loop (no cap)"
        seg["arrivals"] = "all at once (waves)" if waves else f"constant rate, {closed}"
        seg["batch_p5_p50_p95"] = batch_spread(load.new_lines(stats_dir, TRACE_LINES, t_offs))
        seg["prompts"] = "random tokens of equal length, distinct per request (no prefix-cache hits), ignore_eos"
        seg.update(harness=load.summary(h["res"]), lines=load.new_lines(stats_dir, REQUEST_LINES, offs))
        seg["snapshot_fields"] = sorted(mark1.snap) if mark1.snap else None
        if (phases := snap_between(mark0, mark1)) is not None:
            seg["plugin_energy_j_by_phase"] = phases
            # The counter over the snapshots' own span: their 't' is wall time, mapped onto perf_counter.
            t_a, t_b = mark0.perf_t, mark1.perf_t
            seg.update(counter_j=self.sampler.energy_between(t_a, t_b), span_s=t_b - t_a)
        else:
            seg.update(plugin_energy_j_by_phase=None, counter_j=None, note="no plugin snapshot with energy_j in stats_dir")
        seg["counter_harness_window_j"] = h["res"].get("gpu_energy_j")
        # Non-idle energy charged to no request over the segment (after a batch's last step until idle
        # is detected): the snapshot's field and the /metrics counter, each as a delta.
        seg["tail_j"] = load.diff((mark0.snap or {}).get(REQUEST_TAIL_SNAPSHOT), (mark1.snap or {}).get(REQUEST_TAIL_SNAPSHOT))
        seg["counter_phase_losses"] = load.diff(
            (mark0.snap or {}).get("counter_phase_losses"), (mark1.snap or {}).get("counter_phase_losses")
        )
        seg["tail_j_metrics"] = load.diff(load.series_sum(m0, REQUEST_TAIL_METRIC), load.series_sum(m1, REQUEST_TAIL_METRIC))
        phases = seg["plugin_energy_j_by_phase"]
        log(
            f"[{self.label}] request energy: {len(seg['lines'])} lines, counter {seg['counter_j']} J, plugin {phases}, "
            f"counter phase losses {seg['counter_phase_losses']}"
        )
        return seg

    def bursts(self, idle_w: float | None) -> dict:
        """``--burst-n`` pairs of spans, each a short prefill burst (``--burst-conc`` distinct prompts
        of ``--burst-in`` tokens, one output token each) and a null request (``NULL_PROMPT_TOKENS``
        tokens, one output), in alternating order, each span ``--burst-span-s`` long from one idle
        spell into the next. After any request the GPU draws above its deep-idle power for a while
        (clocks fall back, perf boost releases), which the plugin books as idle; the null span holds
        that tail too, so the burst's own energy is the counter's difference between the two spans,
        set against the plugin's busy-joule difference (:func:`burst_pair_figures`). Each burst
        has its own seed: the same prompt twice would hit the prefix cache."""
        ns, runs = self.ns, []
        for i in range(ns.burst_n):
            order = ("null", "burst") if i % 2 == 0 else ("burst", "null")
            spans = {kind: self._burst_span(kind, BURST_SEED + i) for kind in order}
            runs.append({"order": list(order), **spans})
        runs = judge_bursts(runs, idle_w)
        m, _ = load.scrape(self.port)
        cross = {k: v for k, v in m.items() if k.startswith("powersave_energy_crosscheck")}
        log(f"[{self.label}] {bursts_line(runs)}, cross-check {cross}")
        out = {"n": ns.burst_n, "conc": ns.burst_conc, "input_len": ns.burst_in, "idle_w": idle_w, "span_s": ns.burst_span_s}
        out["cut_s"] = BURST_LEAD_S + ns.burst_cut_s
        return {**out, "method": "null-request control", "runs": runs, "crosscheck": cross}

    def _burst_span(self, kind: str, seed: int) -> dict:
        """One span of ``--burst-span-s`` from the moment before its request: the counter's joules,
        the plugin's by phase between its snapshots, and the request's harness duration."""
        ns = self.ns
        time.sleep(ns.burst_gap_s)
        mark0 = self.mark()
        shape = dict(num_prompts=ns.burst_conc, max_concurrency=ns.burst_conc, input_len=ns.burst_in)
        if kind == "null":
            shape = dict(num_prompts=1, max_concurrency=1, input_len=NULL_PROMPT_TOKENS)
        h = self.harness(f"{kind}{seed}", output_len=1, seed=seed, **shape)
        time.sleep(max(0.0, mark0.perf + ns.burst_span_s - time.perf_counter()))
        mark1 = self.mark()
        return {
            "span_s": mark1.perf - mark0.perf,
            "busy_s": h["res"].get("duration"),
            "counter_j": self.sampler.energy_between(mark0.perf, mark1.perf),
            "plugin_phases_j": snap_between(mark0, mark1),
            "cut": self._burst_cut(h["t0"]),
        }

    def _burst_cut(self, t_req: float | None) -> dict | None:
        """The counter from ``BURST_LEAD_S`` before the request at ``t_req`` to ``--burst-cut-s`` after
        it, and the power over the cut's last ``END_POWER_S`` (:func:`cut_phase_truth`)."""
        if t_req is None:
            return None
        a, b = t_req - BURST_LEAD_S, t_req + self.ns.burst_cut_s
        end_j = self.sampler.energy_between(b - END_POWER_S, b)
        return {
            "cut_s": BURST_LEAD_S + self.ns.burst_cut_s,
            "counter_j": self.sampler.energy_between(a, b),
            "end_power_w": None if end_j is None else end_j / END_POWER_S,
        }

    def release(self, idle_w: float | None) -> dict:
        """Short requests ``--release-gap-s`` apart: each perf-boost release in the trace, and how long the GPU
        then took to fall below idle_w + LOW_POWER_MARGIN_W and to the idle SM clock (10 Hz samples)."""
        ns = self.ns
        time.sleep(ns.settle_s)
        offs = {f.name: f.stat().st_size for f in self.stats_dir.glob(TRACE_LINES)}
        kw = dict(num_prompts=ns.release_n, request_rate=1.0 / ns.release_gap_s, arrival="constant", input_len=128, output_len=32)
        h = self.harness("release", **kw, seed=13)
        time.sleep(ns.release_gap_s)  # the last release, and the fall after it
        t0, t1, lines = h["t0"] or 0.0, time.perf_counter(), load.new_lines(self.stats_dir, TRACE_LINES, offs)
        rows = [r for r in self.sampler.rows if t0 <= r[0] <= t1]
        low_w = idle_w + load.LOW_POWER_MARGIN_W if idle_w else None
        out = release_figures(lines, rows, t1, idle_w, low_w, ns.release_idle_mhz, self.sampler.energy_at)
        log(f"[{self.label}] release: {len(out)} releases, power fell {[r['power_fall_s'] for r in out]} s after")
        seg = dict(n=ns.release_n, gap_s=ns.release_gap_s, input_len=128, output_len=32, idle_w=idle_w, low_power_w=low_w)
        seg.update(idle_sm_clock_mhz=ns.release_idle_mhz, harness=load.summary(h["res"]), releases=out)
        seg["boost_lines"] = [x["boost"] for x in lines if "boost" in x]
        seg["samples"] = [(round(r[0] - t0, 3), r[2], r[3], r[4]) for r in rows]  # s from the first request, W, MHz, util %
        return seg

    def starv_window(self, after_s: float = 0.0) -> tuple[dict, dict]:
        """The closed loop at ``--starv-conc`` (starvation, fix arm): harness output, window figures ``after_s`` later."""
        ns = self.ns
        n = load.n_prompts(None, ns.starv_window_s, ns.starv_conc)
        h = self.harness("starv", num_prompts=n, max_concurrency=ns.starv_conc, duration_s=ns.starv_window_s, seed=11)
        time.sleep(after_s)
        sampled = self.sampler.window(h["t0"], h["t1"]) if h["t0"] is not None else {}
        w = {"concurrency": ns.starv_conc, **load.summary(h["res"]), "t0": h["t0"], "t1": h["t1"], "sampler": sampled}
        log(f"[{self.label}] c={ns.starv_conc}: {w.get('output_throughput') or 0:.0f} tok/s, {w.get('output_tokens_per_joule')} tok/J")
        return h, w

    def starvation(self) -> dict:
        time.sleep(self.ns.settle_s)
        log_off = self.log_path.stat().st_size
        before, _ = load.scrape(self.port)
        h, w = self.starv_window(after_s=1.0)  # 1 s: the engine's last publish after the window
        after, _ = load.scrape(self.port)
        d = load.delta(before, after)
        fig = starvation_figures(d)
        report = {k: v for k, v in h["res"].items() if not isinstance(v, list)}
        for key, fk in zip(ADVISE_RESULT_KEYS, STARVATION_FIGURES):  # where the harness did not read them
            if report.get(key) is None and fig.get(fk) is not None:
                report[key] = fig[fk]
        report.setdefault("max_concurrency", self.ns.starv_conc)
        adv = self.advise(report, metrics_text(self.port))
        with open(self.log_path, "rb") as f:  # after advise: the plugin warns from its publisher, seconds late at most
            f.seek(log_off)
            tail = f.read().decode(errors="replace").splitlines()
        warnings = [ln[-400:] for ln in tail if STARVATION_WARNING.search(ln) and ("WARN" in ln or "warn" in ln.lower())]
        st = {"window": w, "metrics_delta": d, "starvation": fig, **{k: fig.get(k) for k in STARVATION_FIGURES}}
        st.update(harness_idle_while_busy_j=h["res"].get("gpu_idle_while_busy_energy_j"), warnings=warnings[:10], advise=adv)
        log(
            f"[{self.label}] starvation: idle-while-busy {st['idle_while_busy_j']} J ({fig['how']}), "
            f"{len(st['warnings'])} warning line(s), advise ok={adv['ok']} fix={adv['fix_args']}"
        )
        return st

    def advise(self, report: dict, metrics: str) -> dict:
        """``vllm-powersave advise`` on the starvation window (ADVISE_CMDS in turn, or --advise-cmd)."""
        ns, label = self.ns, self.label
        metrics_f, report_f = self.workdir / f"metrics-{label}.txt", self.workdir / f"starv-report-{label}.json"
        metrics_f.write_text(metrics)
        report_f.write_text(json.dumps(report))
        env = {**os.environ, **({"PYTHONPATH": f"{ns.plugin_site}:{ns.stock_site}"} if ns.plugin_site else {})}
        attempts = []
        for tmpl in [ns.advise_cmd] if ns.advise_cmd else ADVISE_CMDS:
            cmd = tmpl.format(py=sys.executable, url=f"http://127.0.0.1:{self.port}/metrics", metrics=metrics_f, report=report_f, n=1)
            try:
                r = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60, env=env)
                attempts.append({"cmd": cmd, "rc": r.returncode, "stdout": r.stdout[-6000:], "stderr": r.stderr[-2000:]})
            except Exception as exc:
                attempts.append({"cmd": cmd, "rc": None, "stdout": "", "stderr": f"{type(exc).__name__}: {exc}"})
            if attempts[-1]["rc"] == 0:
                break
        text = "\n\n".join(f"$ {a['cmd']}\nrc={a['rc']}\n{a['stdout']}\n{a['stderr']}" for a in attempts)
        (self.workdir / f"advise-{label}.txt").write_text(text)
        ok = next((a for a in attempts if a["rc"] == 0), None)
        m = re.search(r"--api-server-count[ =](\d+)", ok["stdout"]) if ok else None
        fix = f"--api-server-count {m.group(1)}" if m else None
        return {"attempts": attempts, "ok": ok is not None, "output": ok["stdout"] if ok else None, "fix_args": fix}


@dataclass(frozen=True)
class ReqeShape:
    """One request-energy run: ``n`` identical requests of ``input_len`` / ``output_len`` tokens,
    started at ``rate`` (req/s; ``auto``: the target batch over a request's lifetime; ``inf``: all at once)."""

    input_len: int
    output_len: int
    rate: str
    n: int

    def start_rate(self, target_batch: int, tpot_ms: float) -> float:
        if self.rate == "inf":
            return math.inf
        if self.rate == "auto":
            return target_batch / ((self.output_len * tpot_ms + 50.0) / 1e3)
        return float(self.rate)


def reqe_shapes(ns: argparse.Namespace) -> list[ReqeShape]:
    """``--reqe-shapes IN:OUT:RATE:N,...``, or the one shape of --reqe-in/--reqe-out/--reqe-rate/--reqe-n.
    Raises ValueError with one line naming the bad item."""
    if not ns.reqe_shapes:
        return [ReqeShape(ns.reqe_in, ns.reqe_out, ns.reqe_rate, ns.reqe_n)]
    out = []
    for item in ns.reqe_shapes.split(","):
        parts = item.split(":")
        try:
            shape = ReqeShape(int(parts[0]), int(parts[1]), parts[2], int(parts[3]))
            ok = len(parts) == 4 and min(shape.input_len, shape.output_len, shape.n) > 0
            ok = ok and (shape.rate in ("auto", "inf") or 0 < float(shape.rate) < math.inf)
        except (ValueError, IndexError):
            ok = False
        if not ok:
            raise ValueError(f"--reqe-shapes: {item!r} is not IN:OUT:RATE:N (positive integers; RATE req/s, auto or inf)")
        out.append(shape)
    return out


# --- plan and budget ---------------------------------------------------------------------------------
def drain_s(ns: argparse.Namespace, sat: bool = True) -> float:
    """A request started at a window's end finishes in about this: output_len decode steps of
    --tpot-est-ms at saturation, half that at the Poisson rates (small batches), + 0.5 s."""
    return ns.output_len * ns.tpot_est_ms / 1000.0 * (1.0 if sat else 0.5) + 0.5


def seg_costs(ns: argparse.Namespace) -> dict[str, float]:
    """Estimated wall time of each segment (s), for the plan and the budget checks. ``rate``: one
    Poisson window (gap + window + drain + harness start), ``sat``: the closed-loop window."""
    fix = ns.settle_s + ns.starv_window_s + drain_s(ns) + 2.0
    reqe = 0.0
    for sh in reqe_shapes(ns):  # the starts at their rate (or in waves of the target batch), then each request's lifetime
        rate = sh.start_rate(ns.reqe_conc, ns.reqe_tpot_ms)
        starts_s = sh.n / rate if math.isfinite(rate) else -(-sh.n // ns.reqe_conc) * (sh.output_len * ns.tpot_est_ms / 1000.0 + 0.3)
        reqe += 2 * ns.settle_s + starts_s + sh.output_len * ns.tpot_est_ms / 1000.0 + 3.0
    c = dict(warm=4.0, idle=ns.settle_s + ns.idle_s + 0.5, rate=ns.gap_s + ns.window_s + drain_s(ns, sat=False) + 0.5)
    c.update(sat=ns.gap_s + ns.window_s + drain_s(ns) + 0.5, reqenergy=reqe)
    c["release"] = ns.settle_s + (ns.release_n + 1) * ns.release_gap_s + 2.0
    c["bursts"] = ns.burst_n * 2 * (ns.burst_gap_s + ns.burst_span_s + 0.5)  # per pair: two spans, each after a gap, a snapshot wait
    return c | dict(starvation=fix + 10.0, fix=fix, stop=ns.stop_est_s)  # starvation: + advise (up to 3 CLI runs)


def server_segments(ns: argparse.Namespace, order: list[str], pos: int) -> list[str]:
    """Segments of server ``pos``: --segments (reqenergy/starvation on defaults servers only), plus
    --segments-last on the last defaults server of the order."""
    arm = order[pos]
    if arm == "fix":
        return ["fix"]
    segs = [x for x in ns.segments.split(",") if x]
    if arm == "defaults" and pos == max(i for i, a in enumerate(order) if a == "defaults"):
        segs += [x for x in ns.segments_last.split(",") if x and x not in segs]
    return [x for x in segs if x in ("idle", "sweep")] if arm in ("stock", "ablation") else segs


def plan(ns: argparse.Namespace, order: list[str]) -> list[dict]:
    """Per server: estimated start-up and segment times (s)."""
    c, rates, out = seg_costs(ns), [x for x in ns.rates.split(",") if x], []
    for pos, arm in enumerate(order):
        segs = server_segments(ns, order, pos)
        parts = {"start": ns.start_est_first_s if pos == 0 else ns.start_est_s, "warm": c["warm"]}
        parts.update({x: sum(c["sat" if r == "sat" else "rate"] for r in rates) if x == "sweep" else c[x] for x in segs}, stop=c["stop"])
        est_s, total_s = {k: round(v, 1) for k, v in parts.items()}, round(sum(parts.values()), 1)
        out.append({"pos": pos, "arm": arm, "segments": segs, "est_s": est_s, "total_s": total_s})
    return out


def first_need_s(ns: argparse.Namespace, server: dict) -> float:
    """What a planned server needs to start at all: start-up, warm-up, its first segment and the stop."""
    c, segs = seg_costs(ns), server["segments"]  # a fix server's only segment is "fix"
    first = "idle" if "idle" in segs else "rate" if "sweep" in segs else segs[0] if segs else None
    first = "sat" if first == "rate" and ns.rates.split(",")[0] == "sat" else first
    return server["est_s"]["start"] + c["warm"] + (c[first] if first else 0.0) + c["stop"]


def defaults_settings(text: str) -> dict:
    """``--defaults-settings``: a JSON object of plugin settings, checked by the plugin's own model
    where it is importable (the run stops on a bad one before any server starts)."""
    try:
        obj = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    from vllm_powersave.settings import SettingsError, load_settings  # this checkout's model: the wheel under test is built from it

    try:
        load_settings(obj, env={})
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return obj


def ablation_arm(ns: argparse.Namespace) -> str:
    """The arm that runs with --defaults-settings: ``ablation`` where the order has one (the
    defaults arm then runs the product's defaults beside it, on the same machine), else ``defaults``."""
    return "ablation" if "ablation" in (a.strip() for a in ns.order.split(",")) else "defaults"


def check_args(ns: argparse.Namespace, order: list[str]) -> str | None:
    """One line naming the option and value that cannot run, or None."""
    if bad := [a for a in order if a not in ARMS]:
        return f"--order: unknown arm {bad[0]!r} ({', '.join(ARMS)})"
    if "ablation" in order and not ns.defaults_settings:
        return "--order: the ablation arm needs --defaults-settings (the settings it runs with)"
    segments = (ns.segments + "," + ns.segments_last).split(",")
    if bad := [x for x in segments if x and x not in SEGMENTS]:
        return f"--segments: unknown segment {bad[0]!r} ({', '.join(SEGMENTS)})"
    if "bursts" in segments and not END_POWER_S < ns.burst_cut_s < ns.burst_span_s - BURST_LEAD_S:
        # The cut needs its end-power stretch, and must end inside the span (whose counter rows it reads).
        return f"--burst-cut-s: {ns.burst_cut_s:g} must lie between {END_POWER_S:g} and --burst-span-s less {BURST_LEAD_S:g} s"
    try:
        reqe_shapes(ns)
    except ValueError as exc:
        return str(exc)
    return None


def left_s(ns: argparse.Namespace) -> float:
    """What is left of --budget-s (s since the script started)."""
    return ns.budget_s - (time.monotonic() - T0)


# --- one server --------------------------------------------------------------------------------------
def launch(ns: argparse.Namespace, s: Server, srv: dict, advised_fix: str | None) -> tuple[str | None, list[str], dict[str, str]]:
    """The arm's PYTHONPATH, extra serve flags and environment; its observation settings and fix go into ``srv``."""
    env = {"CUDA_VISIBLE_DEVICES": str(ns.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"} if ns.set_visible else {}
    if srv["arm"] == "stock":
        if not ns.stock_site:  # the plugin is importable here (CPU smoke test): vLLM loads no general plugin
            env["VLLM_PLUGINS"] = ""
        return ns.stock_site or None, [], env
    srv["observe_settings"] = settings = {}
    if ns.defaults_observe != "none":  # observation only: no saving setting, --additional-config stays empty
        settings.update(stats_dir=str(s.stats_dir), **{OBSERVE[x]: True for x in ns.defaults_observe.split(",") if x in OBSERVE})
        s.stats_dir.mkdir(parents=True, exist_ok=True)
    if ns.defaults_settings and srv["arm"] == ablation_arm(ns):  # fix keeps its flags alone
        srv["ablation_settings"] = dict(ns.defaults_settings)
        settings.update(ns.defaults_settings)
    if settings:
        (cfg_f := s.workdir / f"powersave-{s.label}.json").write_text(json.dumps({"powersave": settings}))
        env["POWERSAVE_CONFIG"] = str(cfg_f)
    extra = ["--plugin", "powersave"]
    if srv["arm"] == "fix":
        srv["fix_args"] = advised_fix or ns.fix_args
        srv["fix_source"] = "vllm-powersave advise" if advised_fix else "--fix-args (no advice parsed)"
        extra += shlex.split(srv["fix_args"])
    return (f"{ns.plugin_site}:{ns.stock_site}" if ns.plugin_site else None), extra, env


def run_segments(s: Server, srv: dict, segs: list[str], result: dict, save: Any) -> None:
    """The server's segments in a fixed order, each only where it and the server's stop fit the budget."""
    ns = s.ns
    if "fix" in segs:  # the fix arm's one window: the starvation segment's load
        time.sleep(ns.settle_s)
        srv["fix_window"] = s.starv_window()[1]
        save()

    def fits(seg: str, what: str) -> bool:
        need = seg_costs(ns)[seg] + ns.stop_est_s
        if left_s(ns) >= need:
            return True
        srv["notes"].append(f"budget: {what} not run ({left_s(ns):.0f} s left, needs ~{need:.0f} s with the stop)")
        log(f"[{s.label}] {srv['notes'][-1]}")
        return False

    idle_w = None
    if "idle" in segs and fits("idle", "idle window"):
        srv["idle"] = s.idle()
        idle_w = srv["idle"].get("avg_power_w")
        save()
    for k, rate in enumerate(ns.rates.split(",") if "sweep" in segs else []):
        if not fits("sat" if rate == "sat" else "rate", f"rate {rate} and later"):
            break
        time.sleep(ns.gap_s)
        srv["windows"].append(s.load_window(rate, seed=100 + k, idle_w=idle_w))
        save()
    if "reqenergy" in segs and fits("reqenergy", "request-energy segment"):
        srv["reqenergy_runs"] = []
        for shape in reqe_shapes(ns):
            srv["reqenergy_runs"].append(s.request_energy(shape))
            save()
    if "bursts" in segs and fits("bursts", "bursts segment"):
        srv["bursts"] = s.bursts(idle_w)
        save()
    if "release" in segs and fits("release", "release segment"):
        srv["release"] = s.release(idle_w)
        save()
    if "starvation" in segs and fits("starvation", "starvation segment"):
        srv["starvation"] = s.starvation()
        if srv["starvation"]["advise"]["fix_args"]:
            result["advised_fix"] = srv["starvation"]["advise"]["fix_args"]
        save()


def run_server(ns: argparse.Namespace, model: Path, server: dict, sampler: load.Sampler, workdir: Path, result: dict, save: Any) -> None:
    """Start the plan's ``server``, run its segments, stop it; its figures go into ``result["servers"]``."""
    arm, pos = server["arm"], server["pos"]
    label = f"{arm}{pos}"
    srv: dict = {"pos": pos, "arm": arm, "gpu": ns.gpu, "label": label, "windows": [], "notes": []}
    result["servers"].append(srv)
    s = Server(ns, sampler, (ns.port or 8100 + 50 * ns.gpu) + pos, label, workdir, Path(ns.stats_root) / f"{ns.tag}-{label}")
    shutil.rmtree(s.stats_dir, ignore_errors=True)
    pythonpath, extra, env = launch(ns, s, srv, result.get("advised_fix"))
    srv["serve_extra"], serve_args = extra, shlex.split(ns.serve_args)
    t_start, t_start_perf = time.monotonic(), time.perf_counter()
    p = start_server(label, model, s.port, extra, pythonpath, workdir, env_extra=env, serve_args=serve_args, max_model_len=ns.max_model_len)
    srv["log"] = s.log_path.name
    try:
        wait_healthy({label: (p, s.port)}, ns.start_timeout_s, logs={label: s.log_path})
        srv["startup_s"] = round(time.monotonic() - t_start, 1)
        srv["api_servers"] = api_servers_in_log(s.log_path)
        log(f"[{label}] healthy after {srv['startup_s']} s")
        s.harness("warm", num_prompts=ns.warm_n, max_concurrency=ns.warm_n, output_len=16, energy="none")
        s.harness("warm1", num_prompts=4, max_concurrency=1, output_len=16, energy="none")
        srv["metrics_info"] = [ln for ln in load.scrape(s.port)[1].splitlines() if ln.startswith("powersave_info")]
        srv["segments"] = list(server["segments"])
        run_segments(s, srv, srv["segments"], result, save)
    except Exception as exc:
        srv["notes"].append(f"error: {type(exc).__name__}: {exc}")
        log(f"[{label}] error:", exc)
    finally:
        stop(p)
        srv["snapshot"] = load.read_snapshot(s.stats_dir)
        for f in sorted(s.stats_dir.glob(TRACE_LINES)) + sorted(s.stats_dir.glob(REQUEST_LINES)):
            with open(f, "rb") as src, gzip.open(workdir / f"{label}-{f.name}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        srv["timeline"] = sampler.timeline(t_start_perf)
        save()
        time.sleep(3.0)  # the GPU drops the context before the next server


# --- main --------------------------------------------------------------------------------------------
def pack(workdir: Path, tar_path: Path, result: dict) -> None:
    """Server logs, step traces (``<label>-trace-rank<N>.jsonl.gz``, with the closed-loop decisions), request-energy
    lines, advise output; step traces dropped, largest first, where the tarball would pass TAR_MAX_BYTES (noted)."""
    files = sorted(workdir.iterdir())
    size, dropped = sum(f.stat().st_size for f in files), []
    for f in sorted((f for f in files if "-trace-rank" in f.name), key=lambda f: -f.stat().st_size):
        if size <= TAR_MAX_BYTES * 0.95:
            break
        size -= f.stat().st_size
        dropped.append(f.name)
    with tarfile.open(tmp := tar_path.with_suffix(".tmp"), "w:gz") as t:
        for f in (f for f in files if f.name not in dropped):
            t.add(f, arcname=f.name)
    tmp.replace(tar_path)
    result["tarball"] = {"bytes": tar_path.stat().st_size, "traces_dropped": dropped}


def print_summary(result: dict) -> None:
    """Per server: start-up, idle power and the rate windows, request energy, notes (segment figures are logged as they run)."""
    print("\n== summary (" + result["device"].get("name", "?") + "; energy " + result["method"]["energy"] + ")")
    print(f"{'server':<12}{'start s':>8}{'idle W':>8}  rate: out tok/s | tok/J | GPU idle share | TTFT p50 ms | TPOT p99 ms")
    for s in result["servers"]:
        idle, pad = (s.get("idle") or {}).get("avg_power_w"), " " * 12
        cells = [
            f"{w['request_rate']}: {w.get('output_throughput') or 0:.0f} | {w.get('output_tokens_per_joule')} | "
            f"{(w.get('sampler') or {}).get('gpu_idle_share')} | {w.get('median_ttft_ms') and round(w['median_ttft_ms'], 1)} | "
            f"{w.get('p99_tpot_ms') and round(w['p99_tpot_ms'], 2)}"
            for w in s["windows"]
        ]
        print(f"{s['label']:<12}{s.get('startup_s', '-')!s:>8}{idle if idle is None else round(idle, 1)!s:>8}  " + " ; ".join(cells))
        for run in s.get("reqenergy_runs") or []:
            if js := sorted(x["energy_j"] for x in run.get("lines", []) if isinstance(x.get("energy_j"), (int, float))):
                shape = f"{run['input_len']}/{run['output_len']}"
                print(
                    f"{pad}request energy {shape}: {len(js)} lines, median {js[len(js) // 2]:.3f} J, max {js[-1]:.3f} J, sum {sum(js):.1f} J"
                )
        for n in s["notes"]:
            print(f"{pad}note: {n}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Options without help text (docs/benchmarks.md), typed by their defaults.
    plain = dict(shape="qwen2.5-7b", sat_concurrency=64, input_len=512, output_len=256, reqe_n=480, reqe_in=128, reqe_out=96, starv_conc=64)
    plain.update(starv_window_s=15.0, warm_n=32, max_model_len=2048, start_timeout_s=300.0, shapes_dir=".gpu-bundle/shapes")
    plain.update(tok_dir="/tmp/model_cfg", stats_root="/tmp/powersave-defaults", out=os.environ.get("OUT", "/tmp/out"))
    for name, default in plain.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    ap.add_argument(
        "--order", default="stock,defaults", help="arms in server order: stock, defaults, fix, ablation (defaults + --defaults-settings)"
    )
    ap.add_argument("--gpu", type=int, default=0, help="NVML / CUDA index (PCI bus order)")
    ap.add_argument("--model-dir", default=None, help="use this model directory instead of building one from --shape")
    ap.add_argument("--rates", default="0.2,1,4,sat", help="Poisson request rates (req/s); 'sat' = closed loop at --sat-concurrency")
    ap.add_argument("--window-s", type=float, default=10.0, help="request starts per rate window (s)")
    ap.add_argument("--idle-s", type=float, default=15.0, help="idle window per server (s)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="quiet time before idle/segment windows (auto boost: 2 s dwell)")
    ap.add_argument("--gap-s", type=float, default=1.0, help="quiet time before each rate window")
    ap.add_argument("--segments", default="idle,sweep", help="idle, sweep (any server); reqenergy, release, starvation (defaults servers)")
    ap.add_argument("--segments-last", default="", help="extra segments of the last defaults server of --order only, e.g. reqenergy")
    ap.add_argument("--reqe-shapes", default="", help="request-energy runs IN:OUT:RATE:N,... (default: one of --reqe-in/out/rate/n)")
    ap.add_argument("--reqe-rate", default="auto", help="start rate (req/s): auto = --reqe-conc per request lifetime, inf = all at once")
    ap.add_argument("--reqe-tpot-ms", type=float, default=5.5, help="decode step for --reqe-rate auto (7B, H200: h200-step-timer.md)")
    ap.add_argument("--reqe-conc", type=int, default=48, help="target batch: sets the auto rate (and the cap with --reqe-cap)")
    ap.add_argument("--reqe-stream", action="store_true", help="stream the request-energy requests (default: one response each)")
    ap.add_argument("--reqe-cap", action="store_true", help="also cap concurrency at --reqe-conc (one start per finish)")
    ap.add_argument("--burst-n", type=int, default=6, help="bursts segment: pairs of a prefill burst and a null request")
    ap.add_argument("--burst-gap-s", type=float, default=2.0, help="bursts segment: idle before each burst (s)")
    ap.add_argument("--burst-conc", type=int, default=4, help="bursts segment: prompts per burst, started together")
    ap.add_argument("--burst-in", type=int, default=1900, help="bursts segment: prompt tokens (one output token each)")
    ap.add_argument(
        "--burst-span-s", type=float, default=3.0, help="bursts segment: each span, from before its request into the next idle spell (s)"
    )
    ap.add_argument(
        "--burst-cut-s",
        type=float,
        default=1.2,
        help="bursts segment: each span's truth cut ends this long after its request, inside the post-request clock hold (s)",
    )
    ap.add_argument("--release-n", type=int, default=8, help="release segment: requests, one at a time")
    ap.add_argument("--release-gap-s", type=float, default=4.0, help="release segment: seconds between request starts")
    ap.add_argument("--release-idle-mhz", type=int, default=400, help="release segment: SM clock counted as idle (H200: 345)")
    ap.add_argument("--fix-args", default="--api-server-count 4", help="fix arm's serve flags when advise names none")
    ap.add_argument("--advise-cmd", default=None, help="one advise command template ({py} {url} {metrics} {report})")
    ap.add_argument("--defaults-observe", default="trace,reqenergy", help="defaults arm's observation settings: trace, reqenergy, none")
    ap.add_argument(
        "--defaults-settings",
        type=defaults_settings,
        default={},
        help="plugin settings (a JSON object) the defaults arm runs with beside its observation settings, for ablations, "
        'e.g. \'{"cuda_perf_boost": "off"}\'',
    )
    ap.add_argument("--serve-args", default="--max-num-seqs 256 --gpu-memory-utilization 0.85", help="vllm serve flags of every server")
    ap.add_argument("--energy", default="nvml", help="loadtests energy source (nvml; none on a CPU smoke test)")
    ap.add_argument("--budget-s", type=float, default=550.0, help="start nothing that cannot end by this (s since start)")
    ap.add_argument("--start-est-s", type=float, default=80.0, help="a server's start-up, warm compile cache, for the plan (s)")
    ap.add_argument("--start-est-first-s", type=float, default=120.0, help="the first server's start-up (cold cache), for the plan (s)")
    ap.add_argument("--tpot-est-ms", type=float, default=15.0, help="decode step at saturation, for the drain estimate (ms)")
    ap.add_argument("--stop-est-s", type=float, default=6.0, help="a server's stop + GPU release, for the plan (s)")
    ap.add_argument("--set-visible", action=argparse.BooleanOptionalAction, default=True, help="give servers CUDA_VISIBLE_DEVICES=--gpu")
    ap.add_argument("--plugin-site", default="/tmp/psite", help="'' = inherit PYTHONPATH (CPU smoke test)")
    ap.add_argument("--stock-site", default="/tmp/site", help="'' = inherit PYTHONPATH (CPU smoke test)")
    ap.add_argument("--port", type=int, default=None, help="default 8100 + 50 * gpu")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--plan-only", action="store_true", help="print the time plan and exit (starts nothing)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    require_dry_run()  # first: nothing may touch a GPU before this
    ns = parse_args(argv)
    for k, v in SERVER_ENV.items():
        os.environ.setdefault(k, v)
    ns.tag = ns.tag or f"gpu{ns.gpu}-{time.strftime('%m%d%H%M%S', time.gmtime())}"
    if ns.plugin_site:
        sys.path[:0] = [ns.plugin_site]
    order = [a.strip() for a in ns.order.split(",") if a.strip()]
    if err := check_args(ns, order):
        print(f"error: {err}", file=sys.stderr)
        return 2
    pl = plan(ns, order)
    total = sum(x["total_s"] for x in pl)
    for x in pl:
        log(f"plan: server {x['pos']} {x['arm']}: ~{x['total_s']:.0f} s (" + ", ".join(f"{k} {v:g}" for k, v in x["est_s"].items()) + ")")
    over = "" if total <= ns.budget_s else "; OVER: segments that cannot finish are skipped (noted)"
    log(f"plan: ~{total:.0f} s for {len(pl)} server(s) against --budget-s {ns.budget_s:g}{over}")
    if ns.plan_only:
        return 0
    out, workdir = Path(ns.out), Path("/tmp") / f"defaults-work-{ns.tag}"
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    raw_f, tar_f = out / f"defaults-{ns.tag}.json", out / f"servers-{ns.tag}.tar.gz"
    model = Path(ns.model_dir) if ns.model_dir else make_model(ns.shape, Path(ns.shapes_dir), Path(ns.tok_dir))
    import vllm

    sampler = load.Sampler(ns.gpu)
    log(f"sampler: {sampler.note}")  # without NVML (CPU smoke test) energy and idle share are null, labelled
    sampler.start()
    method = {"order": order, "rates": ns.rates.split(","), **{k: getattr(ns, k) for k in METHOD_OPTIONS}}
    method["drain_s_est"] = round(drain_s(ns), 2)
    method["low_rate_span"] = (
        "finite rates: energy, idle share and tok/J also over a fixed span of >= window_s from the "
        "first arrival (idle tail included; 'span'), from the 10 Hz sampler"
    )
    method.update(serve_args=ns.serve_args, defaults_observe=ns.defaults_observe, defaults_settings=ns.defaults_settings)
    method["stock"] = "PYTHONPATH without the plugin (--stock-site), else VLLM_PLUGINS= (empty)"
    method["defaults"] = "--plugin powersave; observation settings via $POWERSAVE_CONFIG" + (
        f", and for this ablation {json.dumps(ns.defaults_settings)}"
        if ns.defaults_settings and ablation_arm(ns) == "defaults"
        else " only"
    )
    if ablation_arm(ns) == "ablation":
        method["ablation"] = f"the defaults arm's set-up plus {json.dumps(ns.defaults_settings)}; segments as stock's (idle, sweep)"
    method["energy"] = f"loadtests energy={ns.energy} per load window (counter); sampler: " + sampler.note
    method["gpu_idle_share"] = "share of 10 Hz samples with NVML utilisation 0 % inside the load window"
    method["clocks"] = "never changed (POWERSAVE_FORCE_DRY_RUN=1)"
    method["reqenergy"] = {"concurrency": ns.reqe_conc, "shapes": [vars(x) for x in reqe_shapes(ns)]}
    method["starvation"] = dict(
        concurrency=ns.starv_conc, window_s=ns.starv_window_s, fix_args_default=ns.fix_args, metrics=STARVATION_METRICS
    )
    result: dict = {"what": "stock vLLM vs --plugin powersave defaults, one server at a time; read-only (POWERSAVE_FORCE_DRY_RUN=1)"}
    result.update(measured=sampler.measured, tag=ns.tag, gpu=ns.gpu, device=load.device_facts(ns.gpu))
    result.update(vllm_version=vllm.__version__, model=str(model), shape=None if ns.model_dir else ns.shape)
    result.update(
        date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), method=method, plan=pl, budget_s=ns.budget_s, servers=[], notes=[]
    )
    save = functools.partial(write_json_atomic, raw_f, result)
    save()
    for x in pl:
        if left_s(ns) < (need := first_need_s(ns, x)):
            result["notes"].append(f"budget: server {x['pos']} ({x['arm']}) not started ({left_s(ns):.0f} s left, needs ~{need:.0f} s)")
            log(result["notes"][-1])
            break
        run_server(ns, model, x, sampler, workdir, result, save)
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
