#!/usr/bin/env python3
"""Turn a raw ``h200_energy_meter.py`` run into docs/results/h200-energy-meter.{json,md} (all measured).

Usage: python benchmarks/analyze_energy_meter.py RAW.json [--graph RAW_BG.json] [--runtime RAW_BGR.json] --out docs/results
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadtests.ab import ratio_ci  # noqa: E402


def keep_raw(dest: Path, raw: dict) -> None:
    """Copy a raw run into docs/results/raw once; an existing copy is the record and stays as is."""
    if not dest.exists():
        with gzip.open(dest, "wt") as f:
            json.dump(raw, f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--graph", help="raw of a later run with --parts bg (GPU-bound CUDA-graph step)")
    ap.add_argument("--runtime", help="raw of a run with --parts bgr,bg (the plugin's WorkerRuntime, after the gauge-period fix)")
    ns = ap.parse_args()
    def load(path: str) -> dict:
        return json.loads((gzip.open if path.endswith(".gz") else open)(path, "rt").read())

    raw = load(ns.raw)
    graph = load(ns.graph) if ns.graph else None
    rtm = load(ns.runtime) if ns.runtime else None
    out = Path(ns.out)
    by_w: dict[float, list[dict]] = defaultdict(list)
    for w in raw["a_windows"]:
        by_w[w["window_s"]].append(w)
    windows = sorted(by_w)

    def worst(ws: list[dict], k: str) -> float:
        return max((x[k] for x in ws), key=abs)

    doc = {
        "what": "NVML total-energy counter vs the integral of instant power; metering overhead; per-step attribution (measured, read-only)",
        "measured": True, "device": raw["device"], "driver": raw["driver"], "torch": raw["torch"], "date_utc": raw["date_utc"],
        "instant_power_source": raw.get("instant_power_source"),
        "window_s": windows,
        # Worst (largest |error|) over the repeats of each window length: the figure a user can rely on.
        "rel_err_counter_vs_instant": [worst(by_w[w], "rel_err_raw") for w in windows],
        "rel_err_interpolated_vs_instant": [worst(by_w[w], "rel_err_interpolated") for w in windows],
        "repeats": [len(by_w[w]) for w in windows],
        "counter_update_period_ms": st.median(x["counter_update_period_ms"] for x in raw["a_windows"]),
        "steady_load_power_w": st.median(x["avg_power_w"] for x in raw["a_windows"]),
        # The GPU-bound CUDA-graph step is the precise figure (host-bound loop: +-15 % noise).
        "meter_overhead_ratio": graph.get("meter_overhead_ratio_graph") if graph else raw.get("meter_overhead_ratio"),
        "meter_overhead_ratio_spread": graph.get("meter_overhead_ratio_graph_spread") if graph else raw.get("meter_overhead_ratio_spread"),
        "meter_overhead_method": "GPU-bound CUDA-graph step" if graph else "host-bound launch loop",
        "meter_overhead_graph_pairs": graph.get("b_graph_pairs") if graph else None,
        "graph_step_ms": graph.get("graph_step_ms") if graph else None,
        "graph_run_date_utc": graph.get("date_utc") if graph else None,
        "host_bound_loop_ratio": raw.get("meter_overhead_ratio"),
        "host_bound_loop_spread": raw.get("meter_overhead_ratio_spread"),
        "meter_overhead_pairs": raw.get("b_pairs"),
        "attribution": raw.get("c_attribution"),
        "windows_detail": raw["a_windows"],
        "notes": raw.get("notes", []),
    }
    if rtm:
        rp = rtm["b_runtime_pairs"]
        mean, lo, hi = ratio_ci([x["ratio"] for x in rp])
        doc.update({
            # The server's own metering path after the gauge-period fix: the headline figure.
            "meter_overhead_ratio": rtm["meter_overhead_ratio_runtime"],
            "meter_overhead_ratio_spread": rtm["meter_overhead_ratio_runtime_spread"],
            "meter_overhead_ratio_mean_ci95": [mean, lo, hi],
            "meter_overhead_method": "the plugin's WorkerRuntime (energy.meter off vs nvml) around a GPU-bound CUDA-graph step",
            "meter_overhead_runtime_pairs": rp,
            "runtime_step_ms": rtm["runtime_graph_step_ms"],
            "runtime_run_date_utc": rtm["date_utc"],
            "before_fix": {"meter_overhead_ratio_graph": doc["meter_overhead_ratio"], "spread": doc["meter_overhead_ratio_spread"],
                           "date_utc": doc["graph_run_date_utc"]},
            "bench_emulation_rerun": {"meter_overhead_ratio_graph": rtm.get("meter_overhead_ratio_graph"),
                                      "spread": rtm.get("meter_overhead_ratio_graph_spread"), "pairs": rtm.get("b_graph_pairs")},
        })
    (out / "raw").mkdir(parents=True, exist_ok=True)
    keep_raw(out / "raw" / "h200-energy-meter.json.gz", raw)
    if graph:
        keep_raw(out / "raw" / "h200-energy-meter-graph.json.gz", graph)
    if rtm:
        keep_raw(out / "raw" / "h200-energy-meter-runtime.json.gz", rtm)
    (out / "h200-energy-meter.json").write_text(json.dumps(doc, indent=1))
    c = doc["attribution"] or {}
    lines = [
        "# NVML energy on the H200: counter vs instant power, metering cost, per-step attribution (measured)", "",
        f"- Device: {doc['device']}, driver {doc['driver']}, torch {doc['torch']}. When: {doc['date_utc']} (UTC)" + (f"; metering overhead re-measured {doc['runtime_run_date_utc']} (UTC)" if doc.get("runtime_run_date_utc") else "") + ". Read-only: no GPU setting touched.",
        "- Script: `benchmarks/h200_energy_meter.py` (device; one call, GPU 1 of a 2-GPU machine while GPU 0 ran another benchmark), `benchmarks/analyze_energy_meter.py` (this report).",
        f"- Instant power: `{doc['instant_power_source']}` sampled together with the total-energy counter at ~190 Hz by a thread; the counter advanced every {doc['counter_update_period_ms']:.1f} ms (median).", "",
        f"## (a) Counter vs the integral of instant power, steady bf16 GEMM load (~{doc['steady_load_power_w']:.0f} W)", "",
        "Error = (counter energy − trapezoid integral of instant power) / integral; worst of the repeats. *Raw* = counter difference between the window's first and last sample; *interpolated* = counter at its last update plus instant power × time since (what `NvmlEnergyMeter` does).", "",
        "| window | repeats | raw counter error | interpolated error | all raw errors |", "|---|---|---|---|---|"]
    for w, e_raw, e_int, n in zip(windows, doc["rel_err_counter_vs_instant"], doc["rel_err_interpolated_vs_instant"], doc["repeats"]):
        allv = ", ".join(f"{100 * x['rel_err_raw']:+.2f} %" for x in by_w[w])
        lines.append(f"| {w:g} s | {n} | {100 * e_raw:+.2f} % | {100 * e_int:+.2f} % | {allv} |")
    ok = all(abs(e) <= 0.02 for w, e in zip(windows, doc["rel_err_counter_vs_instant"]) if w >= 10)
    lines += ["", f"Target (agreement within 2 % at ≥ 10 s): **{'met' if ok else 'not met'}**. Short windows: the raw counter can be off by one update (100 ms of energy: 2.3 % of a 5 s window once); the interpolated reading stays within 0.6 % at every length measured.", "",
              "## (b) Metering overhead on a GPU loop", "",
              "The plugin's metering as it runs in a server (a thread ticking `PhaseEnergyAccount` and reading the counter, power, SM clock and the extras every 0.25 s, plus `on_step`/`on_step_end` on every step), in alternating windows without / with it.", ""]
    rp = doc.get("meter_overhead_runtime_pairs")
    if rp:
        mean, lo, hi = doc["meter_overhead_ratio_mean_ci95"]
        ok = doc["meter_overhead_ratio"] >= 0.998
        lines += [f"**As the server runs it, after the fix** (run {doc['runtime_run_date_utc']}, GPU 1 of a 2-GPU machine while GPU 0 served a vLLM benchmark): "
                  "the plugin's own `WorkerRuntime` (step hook, background publisher with its 0.25 s counter tick, 2 s gauge period and "
                  "counter-phase sync, rank-file writes) around a GPU-bound CUDA-graph step "
                  f"({doc['runtime_step_ms']:.2f} ms), `energy.meter` \"off\" vs \"nvml\" (both arms run the same hook; only the meter differs), "
                  f"{len(rp)} pairs of 4 s windows, order alternating:", "",
                  "| pair | steps/s meter off | steps/s meter nvml | ratio |", "|---|---|---|---|"]
        lines += [f"| {p['pair']} | {p['steps_per_s_meter_off']:.2f} | {p['steps_per_s_meter_nvml']:.2f} | {p['ratio']:.5f} |" for p in rp]
        slo, shi = doc["meter_overhead_ratio_spread"]
        lines += ["", f"Median ratio **{doc['meter_overhead_ratio']:.4f}** (spread {slo:.4f}-{shi:.4f}; mean {mean:.4f}, 95 % t-interval "
                  f"{lo:.4f}-{hi:.4f}; {sum(p['ratio'] < 1 for p in rp)} of {len(rp)} pairs below 1). Target ≤ 0.2 % throughput: "
                  f"**{'met' if ok else 'not met'}** by the median; at 95 % confidence the cost is below {100 * (1 - lo):.2f} %. "
                  "Window-to-window noise on this shared host (±1-2 %) is larger than the effect.", ""]
        b = doc["bench_emulation_rerun"]
        if b.get("meter_overhead_ratio_graph") is not None:
            blo, bhi = b["spread"]
            lines += [f"Same run, the earlier emulation (the bench's own thread reading counter, power, SM clock and extras every 0.25 s, the "
                      f"pre-fix schedule): median {b['meter_overhead_ratio_graph']:.4f} (spread {blo:.4f}-{bhi:.4f}, {len(b['pairs'])} pairs). "
                      f"On the quieter single-GPU host of the first run below, that schedule cost {100 * (1 - doc['before_fix']['meter_overhead_ratio_graph']):.2f} % (9 of 10 pairs below 1); the server's path no longer reads the gauges every tick.", ""]
        lines += ["Before the fix (first run):", ""]
    gp = doc.get("meter_overhead_graph_pairs")
    if gp:
        lines += [f"**GPU-bound step** (one CUDA-graph replay of 4 x 32 layers of [64, 4096] x [4096, 4096] GEMMs and a sync, {doc['graph_step_ms']:.2f} ms per step; {len(gp)} pairs of 3 s windows, order alternating; run {doc['graph_run_date_utc']}, single-GPU machine):", "",
                  "| pair | steps/s without | steps/s with | ratio |", "|---|---|---|---|"]
        lines += [f"| {p['pair']} | {p['steps_per_s_without']:.2f} | {p['steps_per_s_with']:.2f} | {p['ratio']:.5f} |" for p in gp]
        lo, hi = doc["meter_overhead_ratio_spread"]
        r0 = doc["before_fix"]["meter_overhead_ratio_graph"] if rp else doc["meter_overhead_ratio"]
        lo, hi = doc["before_fix"]["spread"] if rp else doc["meter_overhead_ratio_spread"]
        lines += ["", f"Median ratio **{r0:.4f}** (spread {lo:.4f}-{hi:.4f}; {sum(p['ratio'] < 1 for p in gp)} of {len(gp)} pairs below 1): metering cost {100 * (1 - r0):.2f} % of throughput, **above the 0.2 % target**. The hot-path part is two deque appends per step (~1-2 µs, 0.1 % of this step); the rest is most likely the tick thread's six NVML reads every 0.25 s (24 per second; NVML reads take ~4 ms each on this host), which this run does not isolate. Fix made after this run: the power / clock / temperature / clock-event gauges are now re-read every `energy.gauge_period_s` (2 s) instead of every publish, and the counter every `energy.tick_s` (0.25 s): ~9 NVML reads per second instead of 24-40 in the server." + ("" if rp else " Not re-measured: the session's device time was spent."), ""]
    lines += ["Host-bound launch loop (24 small GEMMs per step, 3 s windows, shared host) for comparison:", "",
              "| pair | steps/s without | steps/s with | ratio |", "|---|---|---|---|"]
    for p in doc["meter_overhead_pairs"] or []:
        lines.append(f"| {p['pair']} | {p['steps_per_s_without']:.0f} | {p['steps_per_s_with']:.0f} | {p['ratio']:.4f} |")
    lo, hi = doc["host_bound_loop_spread"] or (None, None)
    lines += ["", f"Median {doc['host_bound_loop_ratio']:.3f} (spread {lo:.3f}-{hi:.3f}): a Python-driven loop on a host shared with another benchmark varies ±15 % between windows; it cannot resolve the effect.", "",
              "## (c) Per-step attribution on a real GPU loop", "",
              "6 cycles of 2 s of prefill-like steps (2048 x 4096 GEMMs), 2 s of decode-like steps (64-row GEMM chains) and 1 s idle, attributed by `PhaseEnergyAccount` (0.25 s ticks, time-share split of counter deltas), compared with each phase's power measured in a steady single-phase window x the phase's time:", "",
              "| phase | time s | attributed J | reference W | expected J | error |", "|---|---|---|---|---|---|"]
    for ph in ("prefill", "decode", "idle"):
        if ph in (c.get("expected_j_from_reference_power") or {}):
            lines.append(f"| {ph} | {c['time_s'][ph]:.2f} | {c['attributed_j'][ph]:.0f} | {c['reference_power_w'][ph]:.0f} | {c['expected_j_from_reference_power'][ph]:.0f} | {100 * c['rel_err_by_phase'][ph]:+.1f} % |")
    if c:
        lines += ["", f"Sum of attributed energy {c['attributed_total_j']:.1f} J = counter total {c['counter_total_j']:.1f} J (nothing dropped or double counted). Per phase, energy leaks across boundaries: GPU power lags the work by tens of ms (the decode-to-idle tail lands in idle: idle +22 %, decode −10 %), and a tick that spans a boundary is split by time share, not by each phase's own power. Whole-phase figures over seconds are right to ~1 % (prefill); short phases next to idle carry the lag.", ""]
    (out / "h200-energy-meter.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
