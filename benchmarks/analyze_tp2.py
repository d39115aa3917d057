#!/usr/bin/env python3
"""Turn a raw multi-GPU A/B run (``h200_ab.py --gpus 0,1 ... --tensor-parallel-size 2``) into
docs/results/h200x2-tp2.{json,md}: throughput and J/token ratios per load (pairs, 95 % interval),
the ranks' dry-run decision streams compared step by step, and energy per GPU.

All numbers are measured (NVML on the H200s, read-only), except the one field labelled simulated
(the simulated GPU's estimate for the dry-run decisions, carried over from ``analyze_h200.analyze``).

Usage: python benchmarks/analyze_tp2.py RAW.json[.gz] --out docs/results [--name h200x2-tp2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analyze_h200 import analyze, ratio_table  # noqa: E402


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def per_gpu_window_power(raw: dict) -> list[dict]:
    """Mean power of each GPU over every load window, from the 10 Hz sampler (PowerUsage, W)."""
    tl, per = raw.get("timeline", []), raw.get("timeline_per_gpu_w", [])
    out = []
    for w in raw["windows"]:
        rows = [p for (t, _, _), p in zip(tl, per) if w["t0"] <= t <= w["t1"]]
        if not rows:
            continue
        out.append({"server": w["server"], "load": w["load"], "pair": w["pair"],
                    "gpu_power_w": [round(st.mean(r[i] for r in rows), 1) for i in range(len(rows[0]))]})
    return out


def build(raw: dict, tag: str) -> dict:
    base = analyze(raw, tag)
    snaps = raw.get("plugin_snapshots_by_rank", {})
    per_gpu = {}
    for rank, s in sorted(snaps.items()):
        e = s.get("energy_j") or {}
        per_gpu[rank] = {"gpu_uuid": s.get("gpu"), "energy_j_by_phase": e, "energy_j_total": sum(e.values()),
                         "time_s_by_phase": s.get("time_s"), "steps_by_phase": s.get("steps"),
                         "dry_run_clock_changes": s.get("clock_changes"), "energy_method": s.get("energy_method"),
                         "counter_resets": s.get("counter_resets")}
    wp = per_gpu_window_power(raw)
    by_server_load: dict[tuple[str, int], list[list[float]]] = {}
    for x in wp:
        by_server_load.setdefault((x["server"], x["load"]), []).append(x["gpu_power_w"])
    gpu_power = [{"server": s, "load": ld, "mean_gpu_power_w": [round(st.mean(col), 1) for col in zip(*v)]}
                 for (s, ld), v in sorted(by_server_load.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    return {**base, "name": "h200x2-tp2", "measured": True, "gpus": raw.get("gpus"), "serve_args": raw.get("serve_args"),
            "decision_streams": raw.get("decision_streams"),
            "plugin_energy_per_gpu": per_gpu,
            "plugin_energy_sum_over_gpus_j": sum(g["energy_j_total"] for g in per_gpu.values()),
            "window_gpu_power_w": gpu_power}


def markdown(doc: dict) -> str:
    ds = doc.get("decision_streams") or {}
    lines = [f"# TP=2 on two H200s: stock vLLM vs vLLM + powersave ({doc['shape']}, measured)", "",
             f"- Device: 2 x {doc['device']['name']}, driver {doc['device']['driver']}, power limit {doc['device']['power_limit_w']} W each; "
             f"vLLM {doc['vllm_version']}; `vllm serve` args `{' '.join(doc.get('serve_args') or [])}` (`--load-format dummy`).",
             f"- When: {doc['date_utc']} (UTC). Scripts: `benchmarks/h200_ab.py --gpus 0,1` (device, job `tp2@0,1` of "
             "`benchmarks/device_run.sh`), `benchmarks/analyze_tp2.py` (this report). Raw: `raw/h200x2-tp2.json.gz`.",
             f"- Method: {doc['method']['order']}; closed-loop concurrency 8 / 64 / 256 through the OpenAI server and the load-test "
             f"harness, {doc['method']['input_len']} prompt / {doc['method']['output_len']} output tokens, windows of "
             f"{doc['method']['window_s']:.0f} s of request starts, {doc['method']['pairs']} A B pairs per load. "
             "Energy: both GPUs' NVML total-energy counters summed over each window (the resting other engine's draw is in A's and B's "
             "windows alike). Clocks never changed: `POWERSAVE_FORCE_DRY_RUN=1`, the controller ran dry-run with a decode preset of "
             "1200 MHz and an idle preset of 345 MHz, recording its decisions.",
             f"- Start-up of both TP=2 servers side by side: {doc['startup_s']:.0f} s. The KV cache is sized by "
             "`--kv-cache-memory-bytes` (8 GiB per rank) because two servers profiling memory at once on the same GPUs "
             "count each other's allocations (the first attempt failed with `No available memory for the cache blocks`).", "",
             "## Throughput and energy per token (plugin / stock, mean of pairs, 95 % t-interval; load = concurrency)", "",
             *ratio_table(doc["cases"])]
    lines += ["", "Per pair (throughput ratio / J-per-token ratio):", ""]
    for c in doc["cases"]:
        pp = ", ".join(f"{a:.3f} / {b:.3f}" for a, b in zip(c["throughput_ratio_per_pair"], c["j_per_token_ratio_per_pair"]))
        lines.append(f"- concurrency {c['load']}: {pp}")
    lines += ["", "## Both ranks' decision streams", "",
              f"- Ranks compared: {', '.join(ds.get('ranks', []))}; steps per rank: {ds.get('steps_per_rank')}; fields compared per step: "
              f"{', '.join(ds.get('fields', []))}.",
              f"- Identical: **{ds.get('identical')}** "
              + "; ".join(f"rank {r}: {v['differing_steps']} of {v['compared_steps']} steps differ" for r, v in (ds.get("by_rank") or {}).items()) + ".",
              "", "## Energy per GPU (plugin server, whole run, the plugin's per-rank NVML meter)", "",
              "| rank | GPU | prefill J | decode J | mixed J | idle J | total J | dry-run clock changes |", "|---|---|---|---|---|---|---|---|"]
    for r, g in doc["plugin_energy_per_gpu"].items():
        e = g["energy_j_by_phase"]
        lines.append(f"| {r} | `{g['gpu_uuid']}` | {e.get('prefill', 0):.0f} | {e.get('decode', 0):.0f} | {e.get('mixed', 0):.0f} | "
                     f"{e.get('idle', 0):.0f} | {g['energy_j_total']:.0f} | {g['dry_run_clock_changes']} |")
    lines += [f"| sum | | | | | | {doc['plugin_energy_sum_over_gpus_j']:.0f} | |", "",
              "Idle here is the plugin engine's time without a step of its own, which includes the windows in which the stock "
              "server ran (both engines are resident on both GPUs). `/metrics` on the API server sums the ranks and labels each GPU.",
              "", "Mean power per GPU during the windows (sampler, W):", "",
              "| concurrency | server | GPU 0 W | GPU 1 W |", "|---|---|---|---|"]
    for x in doc["window_gpu_power_w"]:
        w = x["mean_gpu_power_w"]
        lines.append(f"| {x['load']} | {'stock' if x['server'] == 'A' else 'plugin'} | {w[0]:.0f} | {w[1] if len(w) > 1 else float('nan'):.0f} |")
    idle = doc["idle"]
    lines += ["", f"Idle, both TP=2 engines loaded, no requests: {idle.get('avg_power_w', float('nan')):.0f} W for the two GPUs together "
              f"(median SM clock {idle.get('median_sm_clock_mhz')} MHz), measured.", ""]
    sims = [c["simulated_decision_energy"] for c in doc["cases"] if c["simulated_decision_energy"].get("energy_saving_pct_mean") is not None]
    if sims:
        lines += ["Simulated (not measured): the simulated H200's estimate of the energy the dry-run decisions would save, per load: "
                  + ", ".join(f"{c['load']}: {c['simulated_decision_energy']['energy_saving_pct_mean']:.1f} %" for c in doc["cases"]
                              if c["simulated_decision_energy"].get("energy_saving_pct_mean") is not None) + ".", ""]
    lines += ["## Findings", ""] + [f"- {f}" for f in doc.get("findings", [])]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--name", default="h200x2-tp2")
    ap.add_argument("--finding", action="append", default=[])
    ns = ap.parse_args()
    doc = build(load(Path(ns.raw)), ns.name)
    doc["findings"] = ns.finding
    out = Path(ns.out)
    (out / f"{ns.name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{ns.name}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
