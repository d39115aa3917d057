#!/usr/bin/env python3
"""The plugin's own host time per engine step inside real vLLM (CPU build, measured).

Why: on the H200 the 0.5B model's decode step is host-bound (~2 ms), and the A/B there found the
plugin server's steady inter-token latency ~0.3 ms higher than stock's (``h200-vllm.md``). This
measures what the plugin's Python costs per step in the real engine loop (vLLM's offline ``LLM``,
uni-process, EngineCore in this process, tiny Qwen2 model), with the A/B's settings (step trace,
dry-run clock presets, an LM-head chunk table that never chunks; no meter, since a CPU has no
NVML; ``--meter off`` by default, the per-step path of a GPU server). Two figures per variant, each in a fresh process:

* wall ms per decode step, stock and plugin alternating (``--pairs``), no profiler;
* with ``cProfile`` on, the total own time (``tottime``) of functions in ``vllm_powersave``
  per step, and the top entries. cProfile inflates Python calls, so this is an upper bound.

Writes ``--out`` (JSON) and its Markdown twin. No GPU, no clocks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics as st
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
SETTINGS = {"powersave": {"stats_dir": "/tmp/powersave-step-cost", "trace_steps": True,
                          "chunking": {"table": [{"min_rows": 1_000_000, "chunks": 2}]},
                          "clocks": {"backend": "dry-run", "min_dwell_ms": 200,
                                     "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}}},
                          "energy": {"meter": "simulated"}}}

CHILD = r'''
import cProfile, json, os, pstats, sys, time
mode, profile, model, steps, batch, settings = sys.argv[1], sys.argv[2] == "1", sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6])
from vllm import LLM, SamplingParams
llm = LLM(model, max_model_len=512, enforce_eager=True, dtype="bfloat16", max_num_seqs=batch, gpu_memory_utilization=0.3,
          additional_config=settings if mode == "plugin" else {})
sp = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0)
prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(batch)]
llm.generate(prompts, sp, use_tqdm=False)  # warm-up
import gc
# Garbage-collector work during the timed steps: collections run inside whichever frame allocates,
# so a profiler charges them to vLLM even when the plugin's per-step objects triggered them.
gc_t, gc_s = [0.0], [0.0]
def _gc_cb(phase, info):
    if phase == "start":
        gc_s[0] = time.perf_counter()
    else:
        gc_t[0] += time.perf_counter() - gc_s[0]
gc.callbacks.append(_gc_cb)
before = [g["collections"] for g in gc.get_stats()]
pr = cProfile.Profile() if profile else None
t = time.perf_counter()
if pr: pr.enable()
for _ in range(3):
    llm.generate(prompts, sp, use_tqdm=False)
if pr: pr.disable()
wall = time.perf_counter() - t
gc.callbacks.remove(_gc_cb)
n = 3 * steps
colls = [g["collections"] - b for g, b in zip(gc.get_stats(), before)]
out = {"mode": mode, "profiled": profile, "steps": n, "wall_ms_per_step": 1000 * wall / n,
       "gc_collections_per_100_steps": [100 * c / n for c in colls], "gc_us_per_step": 1e6 * gc_t[0] / n,
       "gc_enabled": gc.isenabled(), "gc_frozen_objects": gc.get_freeze_count(), "gc_threshold": list(gc.get_threshold())}
if pr:
    rows, own = [], 0.0
    for (fn, line, name), (cc, nc, tt, ct, callers) in pstats.Stats(pr).stats.items():
        if "vllm_powersave" in fn:
            own += tt
            rows.append((tt, nc, fn.split("vllm_powersave/")[-1] + f":{line} {name}"))
    out["plugin_own_us_per_step"] = 1e6 * own / n
    out["top"] = [{"us_per_step": 1e6 * tt / n, "calls": nc, "where": w} for tt, nc, w in sorted(rows, reverse=True)[:10]]
print("RESULT " + json.dumps(out))
'''


def child(mode: str, profile: bool, model: Path, steps: int, batch: int) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("POWERSAVE_ENABLED", None)
    if mode == "plugin":
        env.update(POWERSAVE_ENABLED="1", POWERSAVE_FORCE_DRY_RUN="1")
    p = subprocess.run([PY, "-c", CHILD, mode, "1" if profile else "0", str(model), str(steps), str(batch), json.dumps(SETTINGS)],
                       capture_output=True, text=True, env=env, timeout=900)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"error: {mode} run failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-3:]}")
    return json.loads(line[7:])


def gc_lines(doc: dict) -> list[str]:
    """The garbage collector's work in the timed steps, per run (runs before this table existed have none)."""
    g = doc.get("gc")
    if not g or not g.get("stock"):
        return []
    first = g["stock"][0]
    lines = ["## Garbage collector during the timed steps (same runs)", "",
             f"Collections per 100 engine steps by generation (0 / 1 / 2) and time inside collections per step (`gc.callbacks`); "
             f"collector {'enabled' if first['gc_enabled'] else 'disabled'}, thresholds {first['gc_threshold']}, "
             f"{first['gc_frozen_objects']} objects frozen by vLLM (`gc.freeze`) in the stock run.", "",
             "| pair | stock collections / 100 steps | stock GC µs/step | plugin collections / 100 steps | plugin GC µs/step |", "|---|---|---|---|---|"]
    fmt = (lambda c: " / ".join(f"{x:.1f}" for x in c))
    for i, (a, b) in enumerate(zip(g["stock"], g["plugin"])):
        lines.append(f"| {i + 1} | {fmt(a['gc_collections_per_100_steps'])} | {a['gc_us_per_step']:.1f} | "
                     f"{fmt(b['gc_collections_per_100_steps'])} | {b['gc_us_per_step']:.1f} |")
    return [*lines, ""]


def write_md(doc: dict, path: Path) -> None:
    p, w = doc["profile"], doc["wall"]
    lines = ["# The plugin's host time per engine step in real vLLM (measured, CPU)", "",
             f"- When: {doc['date_utc']} (UTC). Machine: {doc['host']}. vLLM {doc['vllm_version']} (CPU build), offline `LLM`, "
             f"uni-process (EngineCore in the process), tiny Qwen2 model, batch {doc['batch']}, {doc['steps']} decode tokens per "
             "request, 3 generate calls per process after a warm-up. Script: `benchmarks/plugin_step_cost.py`.",
             "- Plugin settings as in the H200 A/B: step trace on, dry-run clock presets (decode 1200 MHz, idle 345 MHz, 200 ms dwell), "
             "an LM-head chunk table that never chunks (so vLLM's LogitsProcessor is replaced), energy meter "
             f"`{doc['settings']['powersave']['energy']['meter']}` (a CPU has no NVML; on a GPU the NVML meter is read by a background "
             "thread, never per step; `simulated` adds the simulated GPU's arithmetic to every step).", "",
             "## Wall time per step, no profiler (stock and plugin alternating, fresh process each)", "",
             "| pair | stock ms/step | plugin ms/step | plugin - stock (ms) |", "|---|---|---|---|"]
    for i, (a, b) in enumerate(zip(w["stock"], w["plugin"])):
        lines.append(f"| {i + 1} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    lines += ["", f"Median difference {doc['median_diff_ms']:+.3f} ms per step (pairs {', '.join(f'{x:+.3f}' for x in doc['diffs_ms'])}); "
              "on this shared 2-core machine a step varies by more than that from process to process.", "",
              *gc_lines(doc),
              "## The plugin's own Python time per step (cProfile, upper bound)", "",
              f"Total own time of `vllm_powersave` functions: **{p['plugin_own_us_per_step']:.1f} µs per step** "
              f"(wall {p['wall_ms_per_step']:.3f} ms per step under the profiler). Top entries:", "",
              "| µs / step | calls | where |", "|---|---|---|"]
    lines += [f"| {r['us_per_step']:.2f} | {r['calls']} | `{r['where']}` |" for r in p["top"]]
    lines += ["", "## Reading", ""] + [f"- {f}" for f in doc["findings"]]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / ".models" / "qwen2-tiny"))
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--meter", default="off", choices=["off", "simulated"],
                    help="off (default): the per-step path a GPU server runs, whose NVML meter is read off the step path; "
                         "simulated: adds the simulated GPU's per-step arithmetic (CPU servers only)")
    ap.add_argument("--finding", action="append", default=[])
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "plugin-step-cost.json"))
    ap.add_argument("--from-json", default=None, help="re-render a result file into --out with these --finding lines")
    ns = ap.parse_args()
    if ns.from_json:
        doc = json.loads(Path(ns.from_json).read_text())
        doc["findings"] = ns.finding
        Path(ns.out).write_text(json.dumps(doc, indent=1) + "\n")
        write_md(doc, Path(ns.out).with_suffix(".md"))
        return 0
    import vllm

    model = Path(ns.model)
    SETTINGS["powersave"]["energy"] = {"meter": ns.meter}
    wall: dict[str, list[float]] = {"stock": [], "plugin": []}
    gcs: dict[str, list[dict]] = {"stock": [], "plugin": []}
    for i in range(ns.pairs):
        for mode in (("stock", "plugin") if i % 2 == 0 else ("plugin", "stock")):
            r = child(mode, False, model, ns.steps, ns.batch)
            wall[mode].append(r["wall_ms_per_step"])
            gcs[mode].append({k: r.get(k) for k in ("gc_collections_per_100_steps", "gc_us_per_step", "gc_enabled", "gc_frozen_objects", "gc_threshold")})
            print(f"[step-cost] pair {i} {mode}: {r['wall_ms_per_step']:.3f} ms/step, GC {r['gc_collections_per_100_steps']} per 100 steps, {r['gc_us_per_step']:.1f} us/step", flush=True)
    prof = child("plugin", True, model, ns.steps, ns.batch)
    print(f"[step-cost] plugin own time under cProfile: {prof['plugin_own_us_per_step']:.1f} us/step", flush=True)
    diffs = [b - a for a, b in zip(wall["stock"], wall["plugin"])]
    doc = {"what": "plugin host time per engine step in real vLLM (CPU build)", "measured": True, "simulated_parts": "energy meter only",
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "vllm_version": vllm.__version__, "batch": ns.batch, "steps": ns.steps, "settings": SETTINGS,
           "wall": wall, "gc": gcs, "diffs_ms": diffs, "median_diff_ms": st.median(diffs), "profile": prof, "findings": ns.finding}
    out = Path(ns.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    write_md(doc, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
