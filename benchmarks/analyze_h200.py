#!/usr/bin/env python3
"""Turn the raw H200 A/B runs (benchmarks/h200_ab.py) into docs/results/h200-vllm.{json,md} + plots.

Measured numbers come from the runs; the only simulated numbers (labelled so) are the energy the
simulated GPU predicts for the controller's dry-run decisions over the traced steps.

Usage: python benchmarks/analyze_h200.py RAW.json [RAW.json ...] --out docs/results
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics as st
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark modules (h200_alternate)

from loadtests.ab import ratio_ci  # noqa: E402
from vllm_powersave.sim.gpu import H200, ModelCost, simulate_step  # noqa: E402

def ci95(xs: list[float]) -> tuple[float, float]:
    _, lo, hi = ratio_ci(xs)
    return lo, hi


def sim_decisions(trace: list[dict], shape: str, t0: float, t1: float) -> dict:
    """Simulated energy of the traced steps at stock clocks vs at the dry-run decisions."""
    cost = ModelCost.for_shape(shape)
    vocab = cost.vocab_params
    e_stock = e_dec = t_stock = t_dec = 0.0
    e_alt = 0.0
    n = 0
    for s in trace:
        if not (t0 <= s["t"] <= t1):
            continue
        w = cost.step_work(s["prefill"] + s["decode"], s["rows"], s["ctx"], vocab)
        a = simulate_step(H200, w, H200.f_max_mhz)
        b = simulate_step(H200, w, s["sm_target"] or H200.f_max_mhz)
        # Alternative policy, for comparison: every step with few prefill tokens at 1200 MHz.
        c = simulate_step(H200, w, 1200 if s["prefill"] <= 512 else H200.f_max_mhz)
        e_stock += a.energy_j
        e_dec += b.energy_j
        e_alt += c.energy_j
        t_stock += a.time_s
        t_dec += b.time_s
        n += 1
    if n == 0:
        return {}
    return {"steps": n, "stock_j": e_stock, "decisions_j": e_dec, "energy_saving_pct": 100 * (1 - e_dec / e_stock),
            "time_change_pct": 100 * (t_dec / t_stock - 1),
            "alt_policy_low_prefill_steps_1200mhz_saving_pct": 100 * (1 - e_alt / e_stock), "source": "simulated"}


def verdict(lo: float, hi: float, jlo: float, jhi: float) -> str:
    """Whether the 95 % intervals of the throughput and J/token ratios both contain 1 (a NaN
    interval, from one pair or no energy figures, decides nothing)."""
    if math.isnan(lo) or math.isnan(jlo):
        return "one pair or no energy figures: no interval"
    return "no difference beyond noise" if (lo <= 1 <= hi and jlo <= 1 <= jhi) else "difference beyond noise"


def paired(ws: list[dict]) -> tuple[dict, dict, list]:
    """One load's windows as (A by pair, B by pair, the pairs that have both, in order)."""
    a = {w["pair"]: w for w in ws if w["server"] == "A"}
    b = {w["pair"]: w for w in ws if w["server"] == "B"}
    return a, b, sorted(p for p in a if p in b)


def ratio_fields(a: dict, b: dict, full: list) -> dict:
    """B / A per pair for throughput and J per output token, with their means and 95 % intervals."""
    thr = [b[p]["output_throughput"] / a[p]["output_throughput"] for p in full]
    jpt = [b[p]["gpu_energy_per_output_token_j"] / a[p]["gpu_energy_per_output_token_j"] for p in full]
    return {"throughput_ratio": st.mean(thr), "throughput_ratio_ci95": list(ci95(thr)), "throughput_ratio_per_pair": thr,
            "j_per_token_ratio": st.mean(jpt), "j_per_token_ratio_ci95": list(ci95(jpt)), "j_per_token_ratio_per_pair": jpt}


def analyze(raw: dict, tag: str) -> dict:
    shape = raw["shape"]
    trace = raw.get("trace", [])
    cases = []
    by_load: dict[int, list[dict]] = {}
    for w in raw["windows"]:
        by_load.setdefault(w["load"], []).append(w)
    for load, ws in sorted(by_load.items()):
        a, b, full = paired(ws)
        if not full:
            continue
        rat = ratio_fields(a, b, full)
        (lo, hi), (jlo, jhi) = rat["throughput_ratio_ci95"], rat["j_per_token_ratio_ci95"]
        trace_steps = [s for p in full for s in trace if b[p]["t0"] <= s["t"] <= b[p]["t1"]]
        phases = Counter(s["phase"] for s in trace_steps)
        host_ms = [1000 * (s["t_end"] - s["t"]) for s in trace_steps if s.get("t_end") and s["t_end"] - s["t"] < 1.0]
        intervals = [1000 * (y["t"] - x["t"]) for x, y in zip(trace_steps, trace_steps[1:]) if 0 < y["t"] - x["t"] < 1.0]
        targets = Counter(str(s["sm_target"] or "default") for s in trace_steps)
        sims = [sim_decisions(trace, shape, b[p]["t0"], b[p]["t1"]) for p in full]
        sims = [x for x in sims if x]
        case = {
            "shape": shape, "load": load, "load_kind": "closed-loop concurrency (OpenAI server, load-test harness)",
            "pairs": len(full), **rat,
            "verdict": verdict(lo, hi, jlo, jhi),
            "stock_out_tok_per_s": st.mean(a[p]["output_throughput"] for p in full),
            "plugin_out_tok_per_s": st.mean(b[p]["output_throughput"] for p in full),
            "stock_out_tok_per_j": st.mean(a[p]["output_tokens_per_joule"] for p in full),
            "plugin_out_tok_per_j": st.mean(b[p]["output_tokens_per_joule"] for p in full),
            "stock_avg_power_w": st.mean(a[p]["gpu_avg_power_w"] for p in full),
            "plugin_avg_power_w": st.mean(b[p]["gpu_avg_power_w"] for p in full),
            "stock_median_sm_clock_mhz": st.median(a[p]["sampler"].get("median_sm_clock_mhz", math.nan) for p in full),
            "plugin_median_sm_clock_mhz": st.median(b[p]["sampler"].get("median_sm_clock_mhz", math.nan) for p in full),
            "stock_p99_tpot_ms": st.mean(a[p]["p99_tpot_ms"] for p in full),
            "plugin_p99_tpot_ms": st.mean(b[p]["p99_tpot_ms"] for p in full),
            "stock_median_ttft_ms": st.mean(a[p]["median_ttft_ms"] for p in full),
            "plugin_median_ttft_ms": st.mean(b[p]["median_ttft_ms"] for p in full),
            "energy_source": "measured",
            "phase_mix": {"steps_by_phase": dict(phases),
                          "host_step_ms_median": st.median(host_ms) if host_ms else None,
                          "step_interval_ms_median": st.median(intervals) if intervals else None,
                          "dry_run_sm_target_share": {k: v / max(1, sum(targets.values())) for k, v in targets.items()}},
            "simulated_decision_energy": {
                "source": "simulated",
                "energy_saving_pct_mean": st.mean(x["energy_saving_pct"] for x in sims) if sims else None,
                "time_change_pct_mean": st.mean(x["time_change_pct"] for x in sims) if sims else None,
                "alt_policy_saving_pct_mean": st.mean(x["alt_policy_low_prefill_steps_1200mhz_saving_pct"] for x in sims) if sims else None,
            },
        }
        cases.append(case)
    snap = raw.get("plugin_snapshot", {})
    return {"run": tag, "shape": shape, "vllm_version": raw["vllm_version"], "device": raw["device"], "date_utc": raw["date_utc"],
            "method": raw["method"], "startup_s": raw.get("startup_s"), "notes": raw.get("notes", []),
            "idle": {**raw.get("idle", {}), "what": "both engines (stock and plugin) loaded, no requests, measured",
                     "idle_preset_prediction_w": H200.p_busy_static_w * 0.6 + 0.06 * H200.p_sm_max_w * (345 / 1980) * (0.7 ** 2),
                     "idle_preset_prediction_source": "simulated (idle preset 345 MHz lock; cf. measured 77-82 W with no CUDA context)",
                     "dry_run_clock_changes_total": snap.get("clock_changes")},
            "plugin_energy_by_phase_j": snap.get("energy_j"), "plugin_time_by_phase_s": snap.get("time_s"),
            "cases": cases}


def plots(runs: list[dict], raws: dict[str, dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, r in zip(axes[0], runs):
        loads = [c["load"] for c in r["cases"]]
        for key, label, m in (("stock", "stock vLLM", "o"), ("plugin", "vLLM + powersave", "s")):
            ys = [c[f"{key}_out_tok_per_j"] for c in r["cases"]]
            ax.plot(loads, ys, marker=m, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens / J (measured)")
        ax.set_title(f"{r['shape']} — {r['run']}")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("H200, vLLM 0.25.0, clocks untouched (dry-run): tokens per joule vs load")
    fig.tight_layout()
    p = out / "h200-vllm-tokens-per-joule.png"
    fig.savefig(p, dpi=110)
    files.append(p.name)
    plt.close(fig)

    # Timeline with phase shading, for the largest run.
    tag, raw = max(raws.items(), key=lambda kv: float(kv[1].get("method", {}).get("timeline_priority", 0)) or len(kv[1]["windows"]))
    tl = raw["timeline"]
    if tl:
        t0 = tl[0][0]
        fig, ax = plt.subplots(figsize=(12, 4))
        ax.plot([t - t0 for t, _, _ in tl], [w for _, w, _ in tl], lw=0.8, color="k", label="power (W)")
        ax2 = ax.twinx()
        ax2.plot([t - t0 for t, _, _ in tl], [c for _, _, c in tl], lw=0.8, color="tab:blue", label="SM clock (MHz)")
        colors = {"prefill": "tab:red", "mixed": "tab:orange", "decode": "tab:green"}
        bins: dict[int, Counter] = {}
        for s in raw["trace"]:
            bins.setdefault(int((s["t"] - t0) * 2), Counter())[s["phase"]] += 1
        for b, cnt in bins.items():
            ph = cnt.most_common(1)[0][0]
            ax.axvspan(b / 2, b / 2 + 0.5, color=colors.get(ph, "grey"), alpha=0.15, lw=0)
        top = max(w for _, w, _ in tl)
        for w in raw["windows"]:
            ax.annotate(f"{w['server']}{w['load']}", (w["t0"] - t0, top * 1.02), fontsize=7)
        ax.set_ylim(0, top * 1.08)
        ax.set_xlabel("s (A = stock window, no trace; B = plugin window, shaded by dominant step phase: red prefill, orange mixed, green decode)")
        ax.set_ylabel("GPU power (W, measured)")
        ax2.set_ylabel("SM clock (MHz, measured, read-only)")
        ax.set_title(f"{raw['shape']}: power and SM clock timeline ({tag})")
        fig.tight_layout()
        p = out / "h200-vllm-timeline.png"
        fig.savefig(p, dpi=110)
        files.append(p.name)
        plt.close(fig)
    return files


def analyze_plp(raw: dict, tag: str) -> dict:
    """A prompt-logprob run of ``h200_ab.py`` whose two arms are both vLLM + powersave: A with an
    empty chunk table (no chunking), B with the table under test. Ratios are B / A per pair.

    Besides time and energy it states whether the policy ever chose more than one chunk (the LM-head
    calls by chunk count of each arm): a table whose smallest rule is never reached measures the
    hook, not chunking.
    """
    by_load: dict[int, list[dict]] = {}
    for w in raw["windows"]:
        by_load.setdefault(w["load"], []).append(w)
    snap_b = raw.get("plugin_snapshot", {})
    snap_a = next(iter((raw.get("plugin_a_snapshots_by_rank") or {}).values()), {})
    calls_b = {int(k): v for k, v in (snap_b.get("lm_head_calls") or {}).items()}
    cases = []
    for load, ws in sorted(by_load.items()):
        a, b, full = paired(ws)
        if not full:
            continue
        cases.append({
            "load": load, "pairs": len(full), **ratio_fields(a, b, full),
            "unchunked_req_per_s": st.mean(a[p]["request_throughput"] for p in full),
            "chunked_req_per_s": st.mean(b[p]["request_throughput"] for p in full),
            "unchunked_median_e2e_ms": st.mean(a[p]["median_e2el_ms"] for p in full),
            "chunked_median_e2e_ms": st.mean(b[p]["median_e2el_ms"] for p in full),
            "unchunked_avg_power_w": st.mean(a[p]["gpu_avg_power_w"] for p in full),
            "chunked_avg_power_w": st.mean(b[p]["gpu_avg_power_w"] for p in full),
            "unchunked_total_tok_per_j": st.mean(a[p]["total_tokens_per_joule"] for p in full),
            "chunked_total_tok_per_j": st.mean(b[p]["total_tokens_per_joule"] for p in full),
        })
    rows_b, n_b = snap_b.get("lm_head_rows"), sum(calls_b.values())
    return {"run": tag, "shape": raw["shape"], "date_utc": raw["date_utc"], "method": raw["method"],
            "serve_args": raw.get("serve_args"), "notes": raw.get("notes", []), "cases": cases,
            "lm_head_calls_by_chunks": {"A": snap_a.get("lm_head_calls"), "B": snap_b.get("lm_head_calls")},
            "lm_head_rows_per_call_mean_b": rows_b / n_b if rows_b and n_b else None,
            "policy_engaged": any(k > 1 for k in calls_b),
            # torch's peak since the worker started: vLLM's start-up profile run is in it unless the
            # plugin reset it at its first step (builds after session 5 do).
            "cuda_peak_allocated_bytes": {"A": snap_a.get("cuda_peak_allocated_bytes"), "B": snap_b.get("cuda_peak_allocated_bytes")},
            "cuda_peak_scope": snap_b.get("cuda_peak_scope", "since worker start (includes vLLM's start-up profile run)")}


def analyze_cross(raw: dict, tag: str) -> dict:
    """A cross-GPU A/B (``h200_ab_cross.py``): per arm and load, the per-pair ratios (each the
    geometric mean over the two placements, so a GPU's own speed and power cancel), their median,
    mean and 95 % interval, and both arms' mean figures over their windows."""
    # The first cross run (session 6) had one arm, called "plugin" in its windows and unnamed in its pairs.
    raw = {**raw, "pairs": [{"arm": "full", **p} for p in raw["pairs"]],
           "windows": [{**w, "arm": "full" if w["arm"] == "plugin" else w["arm"]} for w in raw["windows"]]}
    cases = []
    for key in sorted({(p["arm"], p["load"]) for p in raw["pairs"]}, key=lambda k: (k[1], k[0])):
        arm, load = key
        ps = [p for p in raw["pairs"] if (p.get("arm", "full"), p["load"]) == key and p["throughput_ratio"] is not None]
        if not ps:
            continue
        pairs = {p["pair"] for p in ps}
        # A round's two windows are stored one after the other, stock first: that is what ties a
        # stock window to the arm it ran against.
        rounds = [(s_, a_) for s_, a_ in zip(raw["windows"][::2], raw["windows"][1::2])
                  if a_["arm"] == arm and a_["load"] == load and a_["pair"] in pairs]
        stock, plug = [s_ for s_, _ in rounds], [a_ for _, a_ in rounds]
        thr = [p["throughput_ratio"] for p in ps]
        jpt = [p["j_per_token_ratio"] for p in ps if p["j_per_token_ratio"] is not None]
        (lo, hi) = ci95(thr) if len(thr) > 1 else (math.nan, math.nan)
        (jlo, jhi) = ci95(jpt) if len(jpt) > 1 else (math.nan, math.nan)
        cases.append({
            "shape": raw["shape"], "load": load, "arm": arm, "pairs": len(ps),
            "load_kind": "closed-loop concurrency (OpenAI server, load-test harness)",
            "design": "cross-GPU: stock and plugin at the same moment, one per GPU, placements swapped per pair",
            "throughput_ratio": st.median(thr), "throughput_ratio_mean": st.mean(thr), "throughput_ratio_ci95": [lo, hi],
            "throughput_ratio_per_pair": thr,
            "j_per_token_ratio": st.median(jpt) if jpt else None, "j_per_token_ratio_mean": st.mean(jpt) if jpt else None,
            "j_per_token_ratio_ci95": [jlo, jhi], "j_per_token_ratio_per_pair": jpt,
            "itl_p50_ratio": st.median(itl) if (itl := [p["itl_p50_ratio"] for p in ps if p.get("itl_p50_ratio") is not None]) else None,
            "verdict": verdict(lo, hi, jlo, jhi),
            "stock_out_tok_per_s": st.mean(w["output_throughput"] for w in stock),
            "plugin_out_tok_per_s": st.mean(w["output_throughput"] for w in plug),
            "stock_out_tok_per_j": st.mean(w["output_tokens_per_joule"] for w in stock) if all(w.get("output_tokens_per_joule") for w in stock) else None,
            "plugin_out_tok_per_j": st.mean(w["output_tokens_per_joule"] for w in plug) if all(w.get("output_tokens_per_joule") for w in plug) else None,
            "stock_avg_power_w": st.mean(w["gpu_avg_power_w"] for w in stock) if all(w.get("gpu_avg_power_w") for w in stock) else None,
            "plugin_avg_power_w": st.mean(w["gpu_avg_power_w"] for w in plug) if all(w.get("gpu_avg_power_w") for w in plug) else None,
            "stock_median_itl_ms": st.median(w["median_itl_ms"] for w in stock),
            "plugin_median_itl_ms": st.median(w["median_itl_ms"] for w in plug),
            "energy_source": "measured",
        })
    return {"run": tag, "shape": raw["shape"], "date_utc": raw["date_utc"], "method": raw["method"],
            "startup_s": raw.get("startup_s"), "notes": raw.get("notes", []), "cases": cases,
            "profiles": raw.get("profiles", []),
            "first_send_spread_s": max((abs(a["first_send_s"] - b["first_send_s"]) for a, b in zip(raw["windows"][::2], raw["windows"][1::2])
                                        if a.get("first_send_s") is not None and b.get("first_send_s") is not None), default=None)}


def cross_lines(r: dict) -> list[str]:
    m = r["method"]
    servers = m.get("servers", {})
    cpus = ", ".join(f"{n} CPUs {v['cpus'][0]}-{v['cpus'][-1]}" if isinstance(v.get("cpus"), list) else f"{n} not pinned"
                     for n, v in servers.items())
    lines = [f"## Cross-GPU A/B: {r['shape']} — {r['run']} (measured)", "",
             f"Two GPUs of one host; each holds a stock server and one server per plugin arm ({', '.join(m.get('arms', ['full']))}; "
             "`full` = the A/B's settings above, `bare` = every option off: meter off, no trace, no presets, empty chunk table). "
             "A round drives one server per GPU at the same moment, stock on one GPU and the arm on the other, each alone on its GPU "
             "(one forked client each, started behind a barrier; "
             + (f"first requests at most {1000 * (r['first_send_spread_s'] or 0):.0f} ms apart); " if "first_send_s" in m
                else "this run recorded only the barrier's release, not the first requests' times); ")
             + 
             "the next round swaps the GPUs. Per pair the ratio is the geometric mean of the two rounds' arm/stock ratios, so a GPU's own "
             f"speed and power cancel, and host drift cancels within each round. {m.get('window_s'):.0f} s windows, {m.get('input_len')} prompt / "
             f"{m.get('output_len')} output tokens, energy from each GPU's NVML counter over its own window. Placement: {cpus} "
             f"(start-up {r.get('startup_s') or 0:.0f} s; {r['date_utc']}; `benchmarks/h200_ab_cross.py`).", "",
             "| arm | load | pairs | throughput ratio median (mean, 95% CI) | J/token ratio median (mean, 95% CI) | ITL p50 ratio | stock tok/s | plugin tok/s | stock tok/J | plugin tok/J | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = (lambda x, d=2: f"{x:.{d}f}" if x is not None else "n/a")
    for c in r["cases"]:
        lo, hi = c["throughput_ratio_ci95"]
        jlo, jhi = c["j_per_token_ratio_ci95"]
        lines.append(f"| {c['arm']} | {c['load']} | {c['pairs']} | {c['throughput_ratio']:.3f} ({c['throughput_ratio_mean']:.3f}, {lo:.3f}–{hi:.3f}) | "
                     f"{f(c['j_per_token_ratio'], 3)} ({f(c['j_per_token_ratio_mean'], 3)}, {jlo:.3f}–{jhi:.3f}) | {f(c['itl_p50_ratio'], 3)} | "
                     f"{c['stock_out_tok_per_s']:.0f} | {c['plugin_out_tok_per_s']:.0f} | {f(c['stock_out_tok_per_j'])} | {f(c['plugin_out_tok_per_j'])} | {c['verdict']} |")
    if r.get("profiles"):
        lines += ["", "GIL profiles in one extra round per arm (`py-spy record --gil` on both processes of both servers, same moment): "
                      "share of the time a thread of the process held the GIL, and the share of those samples in the plugin's own frames "
                      "(its wrappers' calls into vLLM excluded):", "",
                  "| arm | process | GIL held | plugin's own share | top plugin frames |", "|---|---|---|---|---|"]
        for pr in r["profiles"]:
            for k, v in pr["profiles"].items():
                top = "; ".join(f"{fr.split(' (')[0]} ({n})" for fr, n in (v.get("top") or [])[:4]) or "-"
                lines.append(f"| {pr['arm']} | {k} | {100 * (v.get('gil_busy_share') or 0):.1f} % | {100 * (v.get('share') or 0):.1f} % | {top} |")
    if r.get("notes"):
        lines += ["", f"Run notes: {'; '.join(r['notes'])}."]
    return [*lines, ""]


def analyze_alt(raw: dict, tag: str) -> dict:
    """A fast-alternation run (``h200_alternate.py``): per load and arm the per-cycle ratios to
    stock (``twin`` = a second stock process, the A/A control), the arms' median tokens/s, and,
    for ``--time-hooks`` runs, the plugin's time per engine step by hook."""
    import h200_alternate as alt

    summary = alt.summarize(raw["calls"], raw["arms"], raw["loads"])
    med = {}
    for load in raw["loads"]:
        for arm in raw["arms"]:
            xs = [c["tokens"] / c["s"] for c in raw["calls"] if c["load"] == load and c["arm"] == arm and c.get("tokens")]
            med[f"{load}:{arm}"] = st.median(xs) if xs else None
    # Against both stock processes of the cycle (geometric mean of stock and twin): one noisy
    # reference call less per ratio than arm / stock.
    vs_controls = {}
    if "twin" in raw["arms"]:
        by = {(c["load"], c["cycle"], c["arm"]): c["tokens"] / c["s"] for c in raw["calls"] if c.get("tokens")}
        for load in raw["loads"]:
            for arm in raw["arms"]:
                if arm in ("stock", "twin"):
                    continue
                xs = [v / math.sqrt(by[(ld, cyc, "stock")] * by[(ld, cyc, "twin")]) for (ld, cyc, a), v in by.items()
                      if ld == load and a == arm and (ld, cyc, "stock") in by and (ld, cyc, "twin") in by]
                if xs:
                    vs_controls[f"{load}:{arm}"] = {"cycles": len(xs), "median": st.median(xs), "mean": st.mean(xs)}
    return {"run": tag, "mode": raw["mode"], "shape": raw["shape"], "date_utc": raw["date_utc"], "method": raw["method"],
            "arms": raw["arms"], "loads": raw["loads"], "startup_s": raw.get("startup_s"), "notes": raw.get("notes", []),
            "summary": summary, "median_tok_per_s": med, "throughput_vs_both_controls": vs_controls,
            "hooks": alt.hook_summary(raw["calls"]) if raw["method"].get("time_hooks") else None}


def alt_lines(r: dict) -> list[str]:
    m = r["method"]
    what = ("one `vllm.LLM` process per arm (no API server); a call is one `generate` of <load> token-id prompts, "
            f"{m['input_len']} in / {m['output_len']} out (`ignore_eos`)") if r["mode"] == "offline" else (
            f"one `vllm serve` per arm; a call is a closed-loop burst of {m.get('burst')} streamed requests at concurrency <load> "
            f"from the load-test client, {m['input_len']} in / {m['output_len']} out")
    hooks = " The EngineCore ran inside each arm's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with the plugin's hooks timed." if m.get("time_hooks") else ""
    lines = [f"## Fast alternation ({r['mode']}): {r['shape']} — {r['run']} (measured)", "",
             f"All arms on one GPU and one CPU set ({len(m['arm_cpus']) if isinstance(m.get('arm_cpus'), list) else 'unpinned'} CPUs; "
             f"the controller/client on {len(m['client_cpus']) if isinstance(m.get('client_cpus'), list) else 'unpinned'} others); "
             f"{what}. One arm busy at a time; every cycle runs each arm once, order rotated per cycle; ratio = arm / stock of the same cycle. "
             "Energy from the GPU's NVML counter read between calls at its steps (each call's window includes < 100 ms of idle after it, "
             f"alike for every arm). `twin` is a second stock process: what the design reads with no difference.{hooks} "
             f"(start-up {r.get('startup_s') or 0:.0f} s; {r['date_utc']}; `benchmarks/h200_alternate.py`).", "",
             "| load | arm | cycles | throughput ratio to stock: median (mean, 95% CI) | J/token ratio to stock: median (mean, 95% CI) | sd of the per-cycle throughput ratios | throughput ratio to both stock processes (geometric mean of stock and twin): median | stock tok/s (median) | arm tok/s (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, v in r["summary"].items():
        t, j = v["throughput_ratio"], v["j_per_token_ratio"]
        if not t.get("n"):
            continue
        load = key.split(":")[0]
        lines.append(f"| {load} | {v['arm']} | {v['cycles']} | {t['median']:.3f} ({t['mean']:.3f}, {t['ci95'][0]:.3f}–{t['ci95'][1]:.3f}) | "
                     + (f"{j['median']:.3f} ({j['mean']:.3f}, {j['ci95'][0]:.3f}–{j['ci95'][1]:.3f})" if j.get("n") else "n/a")
                     + f" | {t['sd']:.3f} | "
                     + (f"{vc['median']:.3f}" if (vc := r.get("throughput_vs_both_controls", {}).get(key)) else "-")
                     + f" | {r['median_tok_per_s'].get(f'{load}:stock') or 0:.0f} | {r['median_tok_per_s'].get(key) or 0:.0f} |")
    if r.get("hooks"):
        lines += ["", "The plugin's time per engine step on this host (`perf_counter_ns` around on_step_start, on_step_end, on_arrival and "
                      "the LM-head hook without vLLM's own GEMM; not timed: the wrapper frames around execute_model / sample_tokens, the "
                      "scheduler's wrappers and the LM-head subclass's own frame, so these are lower bounds; EngineCore in the arm's process, "
                      "`VLLM_ENABLE_V1_MULTIPROCESSING=0`, where serving runs it in a process of its own. The publisher thread's "
                      "`publish` (which includes the trace and request flushes), which competes for the GIL but is not on the step's path, per "
                      "publish; it publishes every 0.5 s, whether the arm is busy or not):", "",
                  "| load | arm | steps | wall ms/step | on_step_start µs | on_step_end µs | LM-head hook µs | on_arrival µs | engine thread µs/step (share of step) | publisher ms per publish (share of 0.5 s) | step records drained, µs per step (publisher) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        f = (lambda x: f"{x:.1f}" if x is not None else "-")
        for key, h in r["hooks"].items():
            u = h["us_per_step"]
            # publish() includes the trace and request flushes (timed inside it as well): publish alone.
            n_pub, ns_pub = h["hooks"].get("publisher.publish", [0, 0])
            pub = ns_pub / 1e6 / n_pub if n_pub else None
            lines.append(f"| {key.split(':')[0]} | {key.split(':')[1]} | {h['steps']} | {h['wall_ms_per_step']:.3f} | {f(u.get('on_step_start'))} | "
                         f"{f(u.get('on_step_end'))} | {f(lm_head_us(u))} | {f(u.get('on_arrival'))} | "
                         f"{h['engine_thread_us_per_step']:.1f} ({100 * h['engine_thread_share']:.2f} %) | "
                         + (f"{pub:.2f} ({pub / 5:.2f} %) |" if pub is not None else "- |")
                         + f" {f(u.get('publisher.drain_steps'))} |")
    if r.get("notes"):
        lines += ["", f"Run notes: {'; '.join(r['notes'])}."]
    return [*lines, ""]


def lm_head_us(u: dict) -> float | None:
    """The LM-head hook's µs per step: ``chunked_head`` (every call before session 8; since, only
    calls that are split) plus ``head_chunks`` (since session 8, asked on every call)."""
    parts = [u[k] for k in ("chunked_head", "head_chunks") if u.get(k) is not None]
    return sum(parts) if parts else None


def plp_lines(r: dict) -> list[str]:
    arms = r["method"].get("arms", {})
    lines = [f"## Prompt logprobs: {r['shape']} — {r['run']} (measured)", "",
             f"{r['method'].get('input_len')}-token prompts, {r['method'].get('output_len')} output tokens, `prompt_logprobs={r['method'].get('prompt_logprobs')}`, requests not streamed (vLLM refuses prompt logprobs on streams), closed loop; A = {arms.get('A')}, B = {arms.get('B')}; order {r['method'].get('order', '').split(' (')[0]}; server args `{' '.join(r.get('serve_args') or [])}` ({r['date_utc']}).", "",
             "| load | pairs | throughput ratio B/A (95% CI) | J/token ratio B/A (95% CI) | req/s A / B | median E2E ms A / B | W A / B | total (prompt + output) tok/J A / B |",
             "|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        lo, hi = c["throughput_ratio_ci95"]
        jlo, jhi = c["j_per_token_ratio_ci95"]
        lines.append(f"| {c['load']} | {c['pairs']} | {c['throughput_ratio']:.3f} ({lo:.3f}–{hi:.3f}) | {c['j_per_token_ratio']:.3f} ({jlo:.3f}–{jhi:.3f}) | "
                     f"{c['unchunked_req_per_s']:.2f} / {c['chunked_req_per_s']:.2f} | {c['unchunked_median_e2e_ms']:.0f} / {c['chunked_median_e2e_ms']:.0f} | "
                     f"{c['unchunked_avg_power_w']:.0f} / {c['chunked_avg_power_w']:.0f} | {c['unchunked_total_tok_per_j']:.1f} / {c['chunked_total_tok_per_j']:.1f} |")
    pk = r["cuda_peak_allocated_bytes"]
    gib = (lambda x: f"{x / 2**30:.2f} GiB" if x else "n/a")
    rpc = r["lm_head_rows_per_call_mean_b"]
    lines += ["", f"LM-head calls by chunk count: A {r['lm_head_calls_by_chunks']['A'] or 'none (vLLM’s own LogitsProcessor: the hook is not installed where nothing can chunk)'}, "
                  f"B {r['lm_head_calls_by_chunks']['B']}" + (f" (mean {rpc:.0f} rows per call)" if rpc else "") + ". "
                  + ("**The policy chose more than one chunk in this run.**" if r["policy_engaged"] else
                     "**The policy never chose more than one chunk in this run**: B measured the hook, not chunking."),
              "", f"Peak CUDA memory allocated per worker: A {gib(pk['A'])}, B {gib(pk['B'])}; scope of the peak: {r['cuda_peak_scope']}.", ""]
    if r.get("notes"):
        lines += [f"Run notes: {'; '.join(r['notes'])}.", ""]
    return lines


def ratio_table(cases: list[dict]) -> list[str]:
    """Markdown rows: plugin / stock ratios per load with their 95 % intervals and both arms' figures."""
    lines = ["| load | pairs | throughput ratio (95% CI) | J/token ratio (95% CI) | stock tok/s | plugin tok/s | stock tok/J | plugin tok/J | stock W | plugin W | median SM MHz (A/B) | p99 TPOT ms (A/B) | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        lo, hi = c["throughput_ratio_ci95"]
        jlo, jhi = c["j_per_token_ratio_ci95"]
        lines.append(f"| {c['load']} | {c['pairs']} | {c['throughput_ratio']:.3f} ({lo:.3f}–{hi:.3f}) | {c['j_per_token_ratio']:.3f} ({jlo:.3f}–{jhi:.3f}) | "
                     f"{c['stock_out_tok_per_s']:.0f} | {c['plugin_out_tok_per_s']:.0f} | {c['stock_out_tok_per_j']:.2f} | {c['plugin_out_tok_per_j']:.2f} | "
                     f"{c['stock_avg_power_w']:.0f} | {c['plugin_avg_power_w']:.0f} | {c['stock_median_sm_clock_mhz']:.0f}/{c['plugin_median_sm_clock_mhz']:.0f} | "
                     f"{c['stock_p99_tpot_ms']:.2f}/{c['plugin_p99_tpot_ms']:.2f} | {c['verdict']} |")
    return lines


def concurrent_bisect_lines(b: dict) -> list[str]:
    """A concurrent bisect: every server driven at the same moment on one GPU, CPU sets rotated."""
    lines = [f"## Overhead bisect {b['tag']}: qwen2.5-0.5b at concurrency 8, servers driven at once on one GPU (measured)", "",
             f"{len(b['by_server'])} servers resident on one GPU ({', '.join(b['by_server'])}), all driven at the same moment in every "
             f"round (one forked client each, behind a barrier), their CPU sets rotated among them every round; {b['window_s']:.0f} s windows, "
             f"{b['rounds']} rounds ({b['date_utc']}, `benchmarks/h200_overhead_bisect.py --concurrent`). The GPU is time-sliced "
             "between the active servers, so each runs partly GPU-bound: this compares the servers in one shared state, not single-tenant "
             "throughput. S7 is a second stock server: its spread is what no difference looks like.", "",
             "| server | rounds | median tok/s | ratio to stock: median | mean (95% CI) | sd | min–max |", "|---|---|---|---|---|---|---|"]
    for name, r in b["per_round_ratio"].items():
        lo, hi = ci95(r) if len(r) > 1 else (math.nan, math.nan)
        lines.append(f"| {name} | {len(r)} | {st.median(b['by_server'][name]):.0f} | {st.median(r):.4f} | {st.mean(r):.4f} ({lo:.4f}–{hi:.4f}) | "
                     f"{st.stdev(r) if len(r) > 1 else 0:.4f} | {min(r):.3f}–{max(r):.3f} |")
    for name, prof in b["profiles"].items():
        for proc, pr in prof.items():
            if isinstance(pr, dict) and pr.get("gil_samples") is not None:
                top = pr.get("top") or []
                # Profiles taken before the scheduler wrapper joined the excluded wrappers counted its call
                # into vLLM's scheduler as the plugin's: take those samples out (the wrapper's own lines are few).
                wrapped = 0 if "make_schedule" in (pr.get("wrappers_excluded") or ()) else sum(
                    n for f, n in top if "make_schedule" in f or "make_add" in f)
                own = (pr.get("powersave_own_samples") or 0) - wrapped
                share = own / pr["gil_samples"] if pr["gil_samples"] else 0.0
                note = f" ({100 * (pr.get('share') or 0):.1f} % before taking out {wrapped} samples in the scheduler wrapper's call into vLLM)" if wrapped else ""
                names = "; ".join(f"{f.split(' (')[0]} ({n})" for f, n in top[:4] if not ("make_schedule" in f or "make_add" in f)) or "-"
                lines.append(f"| GIL profile {name} ({proc}): held {100 * (pr.get('gil_busy_share') or 0):.0f} % of the time, "
                             f"plugin's own {100 * share:.1f} %{note} | | | | | | {names} |")
    return [*lines, ""]


def markdown(doc: dict) -> str:
    lines = ["# vLLM + powersave vs stock vLLM on the H200 (measured)", "",
             f"- Device: {doc['device']['name']}, driver {doc['device'].get('driver')}, power limit {doc['device'].get('power_limit_w')} W; vLLM {doc['vllm_version']} (V1 engine, V2 model runner, torch.compile + CUDA graphs), `--load-format dummy`.",
             f"- When: {doc['date_utc']} (UTC). Script: `benchmarks/h200_ab.py` (device), `benchmarks/analyze_h200.py` (this report).",
             "- Method: both servers resident on the one GPU (0.42 of memory each), OpenAI `/v1/completions` streaming through `loadtests`, closed loop at the given concurrency, 128 prompt / 256 output tokens (`ignore_eos`), windows of 15 s of request starts (in-flight requests finish), 3 pairs; the order within pairs is given per run. Energy: the GPU's NVML total-energy counter over each window (whole GPU: the resting engine's idle draw is in both A and B windows). Ratios are plugin / stock per pair; CI is a t-interval over pairs.",
             "- Clocks: **never changed**. `POWERSAVE_FORCE_DRY_RUN=1`; the controller ran in dry-run with presets decode 1200 MHz, idle 345 MHz, dwell 200 ms, recording decisions. Chunking policy active with a table that selects 1 chunk at every row count seen (the H200 measurement below shows no gain from chunking).",
             "- Simulated numbers (marked *simulated*) are the simulated GPU's prediction for the recorded dry-run decisions; everything else is measured.", ""]
    for r in doc["runs"]:
        lines += [f"## {r['shape']} — {r['run']}", "", r.get("about", ""), "",
                  f"Order: {r.get('order') or 'A B per pair'}; requests {'streamed' if r.get('stream', True) else 'not streamed (TTFT = E2E, no TPOT)'}.", "",
                  f"Idle, both engines loaded, no requests: **{r['idle'].get('avg_power_w', float('nan')):.1f} W** (measured, median SM clock {r['idle'].get('median_sm_clock_mhz')} MHz). The idle preset (345 MHz lock) is predicted at {r['idle']['idle_preset_prediction_w']:.0f} W per GPU (*simulated*).", "",
                  *ratio_table(r["cases"])]
        lines += ["", "Phase mix of real serving (plugin server's step trace) and the dry-run controller:", "",
                  "| load | steps by phase | host ms per step (median) | step interval ms (median) | dry-run SM target share | predicted energy saving of those decisions (*simulated*) | predicted time change (*simulated*) | alt. policy: steps with ≤512 prefill tokens at 1200 MHz (*simulated*) |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in r["cases"]:
            pm, sd = c["phase_mix"], c["simulated_decision_energy"]
            share = ", ".join(f"{k}: {v:.0%}" for k, v in sorted(pm["dry_run_sm_target_share"].items()))
            fmt = (lambda x: f"{x:.1f} %" if x is not None else "n/a")
            hm = pm["host_step_ms_median"]
            si = pm["step_interval_ms_median"]
            lines.append(f"| {c['load']} | {pm['steps_by_phase']} | {hm:.2f} | {si:.2f} | {share} | {fmt(sd['energy_saving_pct_mean'])} | {fmt(sd['time_change_pct_mean'])} | {fmt(sd['alt_policy_saving_pct_mean'])} |"
                         if hm is not None and si is not None else f"| {c['load']} | {pm['steps_by_phase']} | n/a | n/a | {share} | n/a | n/a | n/a |")
        lines.append("")
    for r in doc.get("cross", []):
        lines += cross_lines(r)
    for r in doc.get("alternation", []):
        lines += alt_lines(r)
    for r in doc.get("prompt_logprobs", []):
        lines += plp_lines(r)
    for b in doc.get("bisects", []):
        if b.get("concurrent"):
            lines += concurrent_bisect_lines(b)
            continue
        lines += [f"## Overhead bisect {b['tag']}: qwen2.5-0.5b at concurrency 8 (measured)", "",
                  f"{len(b['by_server'])} servers resident on one GPU ({', '.join(b['by_server'])}: stock; the plugin as above; the plugin with every option off, or with one option off, as named), {b['window_s']:.0f} s closed-loop windows, the server order reversed every other round, {b['rounds']} rounds ({b['date_utc']}, `benchmarks/h200_overhead_bisect.py`). Output tokens/s per round:", "",
                  "| server | " + " | ".join(f"round {r}" for r in range(b["rounds"])) + " | median | ratio to stock (median of per-round ratios) |",
                  "|---|" + "---|" * b["rounds"] + "---|---|"]
        for name, xs in b["by_server"].items():
            xs = xs[:b["rounds"]]  # a budget stop can leave some servers a round ahead
            lines.append(f"| {name} | " + " | ".join(f"{x:.0f}" for x in xs) + f" | {st.median(xs):.0f} | {b['ratio_to_stock'].get(name, 1.0):.3f} |")
        if not b["profiles"]:
            lines += ["", "No GIL profile in this run (py-spy was not in the bundle).", ""]
            continue
        lines += ["", "GIL profile (`py-spy record --gil`, one window per server on its EngineCore process, where the TP=1 worker runs): share of GIL-holding samples whose innermost frame is the plugin's own code (calls from the plugin's wrappers into vLLM excluded):", "",
                  "| server | GIL samples | plugin's own | share | top plugin frames |", "|---|---|---|---|---|"]
        for name, prof in b["profiles"].items():
            # Session-3 raws hold the EngineCore's profile alone; later ones one per process.
            per_proc = {"EngineCore": prof} if "gil_samples" in prof else {{"engine": "EngineCore", "api": "API server"}.get(k, k): v for k, v in prof.items()}
            for proc, pr in per_proc.items():
                top = "; ".join(f"{f.split(' (')[0]} ({n})" for f, n in (pr.get("top") or [])[:4])
                busy = f", GIL held {100 * pr['gil_busy_share']:.0f} % of the time" if pr.get("gil_busy_share") is not None else ""
                lines.append(f"| {name} ({proc}{busy}) | {pr.get('gil_samples')} | {pr.get('powersave_own_samples')} | {100 * (pr.get('share') or 0):.1f} % | {top} |")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{f}]({f})" for f in doc.get("plots", [])] + [""]
    lines += ["## Findings", ""] + [f"- {x}" for x in doc.get("findings", [])] + [""]
    return "\n".join(lines)


def _read_text(path: Path) -> str:
    """A raw file as text, gzipped (the archived copies in docs/results/raw) or not."""
    return gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()


def _archive(raw: dict, src: Path, dest: Path) -> None:
    """Keep a gzipped copy of a raw file under docs/results/raw (an archived raw is kept as is)."""
    if not (dest.exists() and dest.resolve() == src.resolve()):
        with gzip.open(dest, "wt") as f:
            json.dump(raw, f)


def tagged_raws(specs: list[str], raw_dir: Path, prefix: str) -> list[tuple[str, dict]]:
    """``TAG=PATH`` arguments read (gzipped or not) and archived as ``raw_dir/PREFIX-TAG.json.gz``."""
    out = []
    for spec in specs:
        tag, path = spec.split("=", 1)
        raw = json.loads(_read_text(Path(path)))
        _archive(raw, Path(path), raw_dir / f"{prefix}-{tag}.json.gz")
        out.append((tag, raw))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw", nargs="+", help="TAG=PATH of raw h200_ab.py outputs")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--about", action="append", default=[], help="TAG=text")
    ap.add_argument("--finding", action="append", default=[])
    ap.add_argument("--bisect", action="append", default=[], help="[TAG=]PATH of a raw h200_overhead_bisect.py output (repeatable)")
    ap.add_argument("--plp", action="append", default=[], help="TAG=PATH of a raw prompt-logprob h200_ab.py output (both arms plugin)")
    ap.add_argument("--cross", action="append", default=[], help="TAG=PATH of a raw h200_ab_cross.py output (repeatable)")
    ap.add_argument("--alt", action="append", default=[], help="TAG=PATH of a raw h200_alternate.py output (repeatable)")
    ns = ap.parse_args()
    out = Path(ns.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    about = dict(a.split("=", 1) for a in ns.about)
    raws, runs = {}, []
    for spec in ns.raw:
        tag, path = spec.split("=", 1)
        raw = json.loads(_read_text(Path(path)))
        raws[tag] = raw
        r = analyze(raw, tag)
        r["about"] = about.get(tag, "")
        r["order"] = raw.get("method", {}).get("order")
        r["stream"] = raw.get("method", {}).get("stream", True)
        runs.append(r)
        _archive(raw, Path(path), out / "raw" / f"h200-ab-{tag}.json.gz")
    doc = {"what": "stock vLLM vs vLLM + powersave (clocks dry-run) on the H200 test GPU", "measured": True,
           "vllm_version": runs[0]["vllm_version"], "device": runs[0]["device"], "date_utc": runs[0]["date_utc"],
           "runs": runs, "findings": ns.finding}
    doc["cases"] = [c | {"run": r["run"]} for r in runs for c in r["cases"]]
    doc["plots"] = plots(runs, raws, out)
    doc["prompt_logprobs"] = []
    for tag, raw in tagged_raws(ns.plp, out / "raw", "h200-plp"):
        doc["prompt_logprobs"].append(analyze_plp(raw, tag))
    doc["bisects"] = []
    for n, spec in enumerate(ns.bisect):
        # TAG=PATH, or a bare path: the first bare one keeps the session-3 archive name, later ones get their index.
        tag, path = spec.split("=", 1) if "=" in spec and not Path(spec).exists() else ("" if n == 0 else str(n + 1), spec)
        braw = json.loads(_read_text(Path(path)))
        by: dict = {}
        for w in braw["windows"]:
            by.setdefault(w["server"], []).append(w["output_throughput"])
        rounds = min(len(v) for v in by.values())
        stock = by.get("S0-stock", [])
        if not stock:
            raise SystemExit(f"error: --bisect {spec}: no S0-stock windows, so no ratio to stock")
        # A round counts only if every server in it served (a failed client stores no throughput).
        ok = [i for i in range(rounds) if stock[i] and all(v[i] for v in by.values())]
        if not ok:
            raise SystemExit(f"error: --bisect {spec}: no round in which every server served")
        ratio = {k: st.median(v[i] / stock[i] for i in ok) for k, v in by.items()}
        per_round = {k: [v[i] / stock[i] for i in ok] for k, v in by.items()}
        doc["bisects"].append({"tag": tag or "1", "window_s": braw["window_s"], "rounds": rounds, "date_utc": braw["date_utc"],
                               "concurrent": bool(braw.get("design", "").startswith("concurrent")), "per_round_ratio": per_round,
                               "design": braw.get("design"), "server_cpus": braw.get("server_cpus"),
                               "by_server": by, "ratio_to_stock": ratio, "profiles": braw.get("profiles", {}),
                               "configs": braw.get("configs"), "notes": braw.get("notes", [])})
        _archive(braw, Path(path), out / "raw" / (f"h200-overhead-bisect-{tag}.json.gz" if tag else "h200-overhead-bisect.json.gz"))
    doc["cross"] = []
    for tag, raw in tagged_raws(ns.cross, out / "raw", "h200-cross"):
        r = analyze_cross(raw, tag)
        doc["cross"].append(r)
        # The most direct overhead measurement: its cases join the per-case list (design says how they were taken).
        doc["cases"] += [c | {"run": tag} for c in r["cases"] if c["arm"] != "twin"]  # the A/A control is no overhead case
    doc["alternation"] = []
    for tag, raw in tagged_raws(ns.alt, out / "raw", "h200-alt"):
        doc["alternation"].append(analyze_alt(raw, tag))
    (out / "h200-vllm.json").write_text(json.dumps(doc, indent=1, default=float))
    (out / "h200-vllm.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
