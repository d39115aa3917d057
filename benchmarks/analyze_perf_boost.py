#!/usr/bin/env python3
"""Turn raw ``h200_perf_boost.py`` runs into docs/results/h200-perf-boost.{json,md,png}.

Pairs: servers are paired in the order they ran within each raw file (an "off" and the adjacent
"on" server on the same GPU), so drift and GPU-to-GPU differences cancel within a pair. Ratios are
mode on / mode off. Everything here is measured; nothing is simulated.

Servers whose load windows must not count (``--invalid TAG:POS=reason``, e.g. two benchmark jobs
that shared a port, so one server served both jobs' requests while the other idled) keep their
idle windows (the sampler reads the right GPU and no request was in flight) but lose their load
windows and wake-up probes, and the pairs they are part of count for idle only.

Usage: python benchmarks/analyze_perf_boost.py RAW.json [RAW.json ...] [--invalid TAG:POS=reason] --out docs/results
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadtests.ab import ratio_ci  # noqa: E402

LOADS = ("low", "medium", "saturation")
FIELDS = {"output_throughput": "out_tok_per_s", "request_throughput": "req_per_s", "median_ttft_ms": "p50_ttft_ms",
          "p99_ttft_ms": "p99_ttft_ms", "median_tpot_ms": "p50_tpot_ms", "p99_tpot_ms": "p99_tpot_ms",
          "request_goodput": "goodput_req_per_s", "output_tokens_per_joule": "out_tok_per_j", "gpu_avg_power_w": "avg_power_w"}


def window_fields(w: dict) -> dict:
    out = {v: w.get(k) for k, v in FIELDS.items()}
    out["median_sm_clock_mhz"] = (w.get("sampler") or {}).get("median_sm_clock_mhz")
    out["completed"] = w.get("completed")
    return out


def pairs_of(raw: dict) -> list[tuple[dict, dict]]:
    """Adjacent (off, on) servers in run order, each server used once."""
    done = [s for s in raw["servers"] if s.get("windows") or s.get("idle")]
    out, i = [], 0
    while i + 1 < len(done):
        a, b = done[i], done[i + 1]
        if {a["mode"], b["mode"]} == {"off", "on"}:
            out.append((a, b) if a["mode"] == "off" else (b, a))
            i += 2
        else:
            i += 1
    return out


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return st.median(xs) if xs else None


def mark_invalid(raws: list[dict], invalid: dict[tuple[str, int], tuple[set[str] | None, str]]) -> list[dict]:
    """Drop what ``invalid`` names: per (tag, server position) a set of items (load names such as
    ``low``, wake probes as ``wake<idle s>``, e.g. ``wake60``, which also drops the 60 s idle window),
    or None for all load windows, wake probes, the 60 s idle and the side-context test."""
    out = []
    for raw in raws:
        raw = {**raw, "servers": [dict(s) for s in raw["servers"]]}
        for s in raw["servers"]:
            items, reason = invalid.get((raw.get("tag"), s["pos"]), (set(), ""))
            if items == set():
                continue
            keep_w = [w for w in s.get("windows", []) if items is not None and w["load"] not in items]
            keep_k = [w for w in s.get("wake", []) if items is not None and f"wake{w['idle_s']:g}" not in items]
            s["invalid_load_windows"] = {"reason": reason, "items": "all" if items is None else sorted(items),
                                         "dropped_windows": len(s.get("windows", [])) - len(keep_w),
                                         "dropped_wake": len(s.get("wake", [])) - len(keep_k)}
            s["windows"], s["wake"] = keep_w, keep_k
            if items is None or "wake60" in items:
                s.pop("idle_60s", None)
            if items is None:
                s.pop("booster", None)
        out.append(raw)
    return out


def parse_invalid(specs: list[str], raws: list[dict]) -> dict[tuple[str, int], tuple[set[str] | None, str]]:
    """``--invalid TAG:POS[:ITEM,...]=reason`` specs as :func:`mark_invalid` takes them. ValueError for
    a spec that is malformed or names no server or item of ``raws`` (an exclusion that silently
    matched nothing would leave the windows it meant to drop in the record), or a server named twice."""
    servers = {(raw.get("tag"), s["pos"]): s for raw in raws for s in raw["servers"]}
    out: dict[tuple[str, int], tuple[set[str] | None, str]] = {}
    for spec in specs:
        key, eq, reason = spec.partition("=")
        parts = key.split(":")
        if not eq or not reason.strip() or len(parts) not in (2, 3):
            raise ValueError(f"--invalid {spec!r}: expected TAG:POS[:ITEM,...]=reason")
        tag, pos_s, *items = parts
        try:
            pos = int(pos_s)
        except ValueError:
            raise ValueError(f"--invalid {spec!r}: server position {pos_s!r} is not an integer") from None
        s = servers.get((tag, pos))
        if s is None:
            raise ValueError(f"--invalid {spec!r}: no server {pos} in a run tagged {tag!r} "
                             f"(servers: {', '.join(f'{t}:{p}' for t, p in servers)})")
        if (tag, pos) in out:
            raise ValueError(f"--invalid {spec!r}: server {tag}:{pos} is named twice; give one spec with all its items")
        sel: set[str] | None = None
        if items:
            sel = {x.strip() for x in items[0].split(",") if x.strip()}
            known = set(LOADS) | {f"wake{w['idle_s']:g}" for w in s.get("wake", [])}
            if not sel or sel - known:
                raise ValueError(f"--invalid {spec!r}: unknown items {sorted(sel - known) or '(none given)'}; "
                                 f"server {tag}:{pos} has {', '.join(sorted(known))}")
        out[(tag, pos)] = (sel, reason)
    return out


def analyze(raws: list[dict]) -> dict:
    pairs = [(p, raw) for raw in raws for p in pairs_of(raw)]
    servers = [s for raw in raws for s in raw["servers"]]
    doc: dict = {"what": "cuda_perf_boost energy mode on (CUDA_DISABLE_PERF_BOOST=1 in engine processes) vs off, vLLM OpenAI server",
                 "measured": True, "simulated": False, "device": raws[0]["device"], "vllm_version": raws[0]["vllm_version"],
                 "shape": raws[0]["shape"], "date_utc": raws[0]["date_utc"], "method": raws[0]["method"],
                 "runs": [{"tag": r.get("tag"), "gpu": r.get("gpu"), "order": r["method"]["order"], "date_utc": r["date_utc"]} for r in raws],
                 "pairs": len(pairs), "loads": {}}
    # Idle (engine loaded, no requests).
    idle = {m: [s["idle"] for s in servers if s["mode"] == m and s.get("idle")] for m in ("off", "on")}
    doc["loads"]["idle"] = {
        f"mode_{m}": {"avg_power_w": med([x.get("avg_power_w") for x in v]), "median_sm_clock_mhz": med([x.get("median_sm_clock_mhz") for x in v]),
                      "n": len(v)} for m, v in idle.items()}
    doc["loads"]["idle"]["power_ratio_per_pair"] = [b["idle"]["avg_power_w"] / a["idle"]["avg_power_w"]
                                                   for (a, b), _ in pairs if a.get("idle") and b.get("idle")]
    doc["loads"]["idle"]["pairs"] = len(doc["loads"]["idle"]["power_ratio_per_pair"])
    for load in LOADS:
        per_mode = {m: [window_fields(w) for s in servers if s["mode"] == m for w in s.get("windows", []) if w["load"] == load]
                    for m in ("off", "on")}
        entry: dict = {}
        for m, ws in per_mode.items():
            entry[f"mode_{m}"] = {k: med([w[k] for w in ws]) for k in (*FIELDS.values(), "median_sm_clock_mhz")} | {"n": len(ws)}
        ratios: dict[str, list[float]] = {"out_tok_per_s": [], "out_tok_per_j": [], "p99_tpot_ms": [], "p99_ttft_ms": [], "avg_power_w": []}
        for (a, b), _ in pairs:
            wa = next((window_fields(w) for w in a.get("windows", []) if w["load"] == load), None)
            wb = next((window_fields(w) for w in b.get("windows", []) if w["load"] == load), None)
            if wa and wb:
                for k in ratios:
                    if wa.get(k) and wb.get(k) is not None:
                        ratios[k].append(wb[k] / wa[k])
        entry["pairs"] = len(ratios["out_tok_per_s"])
        for k, xs in ratios.items():
            if xs:
                mean, lo, hi = ratio_ci(xs) if len(xs) > 1 else (xs[0], float("nan"), float("nan"))
                entry[f"ratio_on_off_{k}"] = {"per_pair": xs, "median": st.median(xs), "mean": mean, "ci95": [lo, hi],
                                              "inside_noise": bool(len(xs) > 1 and lo <= 1 <= hi)}
        doc["loads"][load] = entry
    # Wake-up TTFT after idle periods.
    wake: dict = {}
    for m in ("off", "on"):
        for s in servers:
            if s["mode"] != m:
                continue
            for w in s.get("wake", []):
                wake.setdefault(m, {}).setdefault(str(w["idle_s"]), []).append(w.get("ttft_ms"))
    doc["wake_ttft_ms"] = {f"mode_{m}": {k: {"median": med(v), "values": v} for k, v in sorted(d.items(), key=lambda kv: float(kv[0]))}
                           for m, d in wake.items()}
    long_idle = {m: [s["idle_60s"] for s in servers if s["mode"] == m and s.get("idle_60s")] for m in ("off", "on")}
    doc["idle_60s"] = {f"mode_{m}": v for m, v in long_idle.items()}
    doc["side_context_test"] = [{"gpu": raw.get("gpu"), "pos": s["pos"], **{k: v for k, v in s["booster"].items() if k != "medium"},
                                 "medium": window_fields(s["booster"]["medium"]) if s["booster"].get("medium") else None,
                                 "same_server_medium_without": next((window_fields(w) for w in s["windows"] if w["load"] == "medium"), None),
                                 "same_server_idle_without": s.get("idle")}
                                for raw in raws for s in raw["servers"] if s.get("booster")]
    doc["excluded"] = [{"tag": raw.get("tag"), "gpu": raw.get("gpu"), "pos": s["pos"], "mode": s["mode"], **s["invalid_load_windows"]}
                       for raw in raws for s in raw["servers"] if s.get("invalid_load_windows")]
    doc["auto"] = [{"tag": raw.get("tag"), "gpu": raw.get("gpu"), "idle": s.get("idle"),
                    "idle_boost_metrics": (s.get("idle") or {}).get("boost_metrics"),
                    "loads": {w["load"]: {**window_fields(w), "boost_metrics": w.get("boost_metrics")} for w in s.get("windows", [])},
                    "wake_ttft_ms": {str(w["idle_s"]): w.get("ttft_ms") for w in s.get("wake", [])},
                    "idle_60s": s.get("idle_60s")}
                   for raw in raws for s in raw["servers"] if s["mode"] == "auto"]
    doc["engine_env_check"] = [{"mode": s["mode"], "pos": s["pos"], "gpu": raw.get("gpu"),
                                "processes_with_var": sorted(k.split(":", 1)[1] for k, v in s.get("engine_env", {}).items()
                                                             if v.get("CUDA_DISABLE_PERF_BOOST") == "1"),
                                "metrics_info": s.get("metrics_info") if (s.get("invalid_load_windows") or {}).get("items") != "all"
                                else "not attributable: another server answered on the shared port"} for raw in raws for s in raw["servers"] if s.get("engine_env")]
    return doc


def plot(doc: dict, raws: list[dict], out: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, color in (("off", "tab:red"), ("on", "tab:green")):
        xs, tpj, tpot = [], [], []
        for load in LOADS:
            e = doc["loads"][load].get(f"mode_{m}") or {}
            if e.get("out_tok_per_s"):
                xs.append(e["out_tok_per_s"])
                tpj.append(e["out_tok_per_j"])
                tpot.append(e["p99_tpot_ms"])
        label = "mode on (CUDA_DISABLE_PERF_BOOST=1)" if m == "on" else "mode off (default boost)"
        a1.plot(xs, tpj, "o-", color=color, label=label)
        a2.plot(xs, tpot, "o-", color=color, label=label)
        for load, x, y in zip(LOADS, xs, tpj):
            a1.annotate(load, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for a in doc.get("auto", []):
        pts = [(a["loads"][ld]["out_tok_per_s"], a["loads"][ld]["out_tok_per_j"], a["loads"][ld]["p99_tpot_ms"]) for ld in LOADS if ld in a["loads"]]
        if pts:
            a1.plot([x for x, _, _ in pts], [y for _, y, _ in pts], "s--", color="tab:blue", label="auto (side context while busy)")
            a2.plot([x for x, _, _ in pts], [z for _, _, z in pts], "s--", color="tab:blue", label="auto (side context while busy)")
    a1.set_xlabel("output tokens/s (median over servers)")
    a1.set_ylabel("output tokens per joule (measured)")
    a2.set_xlabel("output tokens/s (median over servers)")
    a2.set_ylabel("p99 TPOT, ms")
    a1.legend(fontsize=8)
    a1.set_title(f"{doc['shape']} on {doc['device'].get('name')}: tokens/J vs load")
    a2.set_title("p99 TPOT vs load")
    fig.tight_layout()
    p = out / "h200-perf-boost.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p.name


def fmt(x: object, nd: int = 1) -> str:
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown(doc: dict) -> str:
    orders = ", ".join(" ".join(r["order"]) + " (GPU " + str(r["gpu"]) + ")" for r in doc["runs"])
    L = ["# Unprivileged energy mode (`cuda_perf_boost: \"off\"`) on the H200 (measured)", "",
         f"- Device: {doc['device'].get('name')}, driver {doc['device'].get('driver')}, power limit {doc['device'].get('power_limit_w')} W; vLLM {doc['vllm_version']}, model shape `{doc['shape']}` (`--load-format dummy`), one server at a time per GPU, all with the plugin.",
         f"- When (UTC): {', '.join(r['tag'] + ' ' + r['date_utc'] for r in doc['runs'])}. Scripts: `benchmarks/h200_perf_boost.py` (device), `benchmarks/analyze_perf_boost.py` (this report).",
         f"- Method: OpenAI `/v1/completions` streaming through `loadtests`, {doc['method']['input_len']} prompt / {doc['method']['output_len']} output tokens, windows of {doc['method']['window_s']:.0f} s of request starts; low and medium = Poisson at {doc['method']['rates_req_s'][0]:g} and {doc['method']['rates_req_s'][1]:g} req/s, saturation = closed loop at {doc['method']['sat_concurrency']} concurrent. Goodput SLO: {', '.join(f'{k} ≤ {v:g} ms' for k, v in doc['method']['goodput_slo_ms'].items())}. Energy: the GPU's NVML total-energy counter per window; SM clock: NVML at 10 Hz (read-only). Servers ran in the orders {orders}; pairs are adjacent off/on servers on one GPU; ratios are on / off.",
         f"- Pairs (adjacent off/on servers on one GPU): **{doc['loads']['idle']['pairs']}** for idle; under load, **{min(doc['loads'][x].get('pairs', 0) for x in LOADS)}** (windows excluded below do not count). Mode on = the plugin sets `CUDA_DISABLE_PERF_BOOST=1` in the EngineCore/worker processes before CUDA starts (checked in `/proc/<pid>/environ` for every server below); no GPU setting is changed by either mode.", "",
         "## Idle (engine loaded, no requests)", ""]
    i = doc["loads"]["idle"]
    L += ["| | mode off | mode on | on/off per pair |", "|---|---|---|---|",
          f"| power W | {fmt(i['mode_off']['avg_power_w'])} | {fmt(i['mode_on']['avg_power_w'])} | {', '.join(f'{x:.3f}' for x in i['power_ratio_per_pair'])} |",
          f"| SM clock MHz (median) | {fmt(i['mode_off']['median_sm_clock_mhz'], 0)} | {fmt(i['mode_on']['median_sm_clock_mhz'], 0)} | |", ""]
    L += ["## Under load", "", "| load | mode | out tok/s | tok/J | avg W | SM MHz | TTFT p50 / p99 ms | TPOT p50 / p99 ms | goodput req/s | n |", "|---|---|---|---|---|---|---|---|---|---|"]
    for load in LOADS:
        for m in ("off", "on"):
            e = doc["loads"][load].get(f"mode_{m}", {})
            L.append(f"| {load} | {m} | {fmt(e.get('out_tok_per_s'), 0)} | {fmt(e.get('out_tok_per_j'), 2)} | {fmt(e.get('avg_power_w'), 0)} | {fmt(e.get('median_sm_clock_mhz'), 0)} | "
                     f"{fmt(e.get('p50_ttft_ms'))} / {fmt(e.get('p99_ttft_ms'))} | {fmt(e.get('p50_tpot_ms'), 2)} / {fmt(e.get('p99_tpot_ms'), 2)} | {fmt(e.get('goodput_req_per_s'), 2)} | {e.get('n')} |")
    L += ["", "Ratios on / off per pair (mean, 95 % t-interval over pairs):", "", "| load | pairs | throughput | tokens/J | avg power | p99 TPOT | p99 TTFT |", "|---|---|---|---|---|---|---|"]
    for load in LOADS:
        e = doc["loads"][load]

        def r(k: str) -> str:
            x = e.get(f"ratio_on_off_{k}")
            if not x:
                return "n/a"
            lo, hi = x["ci95"]
            ci = f" ({lo:.2f}–{hi:.2f})" if lo == lo else ""
            return f"{x['mean']:.3f}{ci} [{', '.join(f'{v:.2f}' for v in x['per_pair'])}]"
        L.append(f"| {load} | {e.get('pairs')} | {r('out_tok_per_s')} | {r('out_tok_per_j')} | {r('avg_power_w')} | {r('p99_tpot_ms')} | {r('p99_ttft_ms')} |")
    L += ["", "## Wake-up: TTFT of one request after an idle period (ms, 64-token prompt)", "", "| idle before | mode off | mode on |", "|---|---|---|"]
    keys = sorted({k for d in doc["wake_ttft_ms"].values() for k in d}, key=float)
    for k in keys:
        L.append(f"| {float(k):g} s | {fmt((doc['wake_ttft_ms'].get('mode_off', {}).get(k) or {}).get('median'))} | {fmt((doc['wake_ttft_ms'].get('mode_on', {}).get(k) or {}).get('median'))} |")
    if doc["side_context_test"]:
        L += ["", "## Run-time switch without privilege: a side CUDA context", "",
              "A mode-on server (engine unboosted) with `vllm_powersave.clocks.boost.BoostHolder` holding a default-boost CUDA context in a helper process, then releasing it:", "",
              "| GPU | hold ms | idle W / SM MHz without | idle W / SM MHz with side context | after release | medium: tok/s, tok/J, SM MHz without | with side context |", "|---|---|---|---|---|---|---|"]
        for b in doc["side_context_test"]:
            wo, w = b.get("same_server_medium_without") or {}, b.get("medium") or {}
            iw, ib, ia = b.get("same_server_idle_without") or {}, b.get("idle") or {}, b.get("idle_after_release") or {}
            L.append(f"| {b['gpu']} | {fmt(b.get('hold_ms'))} (release {fmt(b.get('release_ms'))}) | {fmt(iw.get('avg_power_w'))} / {iw.get('median_sm_clock_mhz')} | "
                     f"{fmt(ib.get('avg_power_w'))} / {ib.get('median_sm_clock_mhz')} | {fmt(ia.get('avg_power_w'))} / {ia.get('median_sm_clock_mhz')} | "
                     f"{fmt(wo.get('out_tok_per_s'), 0)}, {fmt(wo.get('out_tok_per_j'), 2)}, {wo.get('median_sm_clock_mhz')} | {fmt(w.get('out_tok_per_s'), 0)}, {fmt(w.get('out_tok_per_j'), 2)}, {w.get('median_sm_clock_mhz')} |")
    if doc.get("auto"):
        L += ["", "## `cuda_perf_boost: \"auto\"` (engine unboosted; the plugin's side context boosts it while the engine is busy)", "",
              "One server, measured alone on its GPU; compared with the medians of the mode-off and mode-on servers above (other servers on the same GPU model, not adjacent pairs):", "",
              "| load | auto: out tok/s | tok/J | avg W | SM MHz | TTFT p50 / p99 ms | TPOT p50 / p99 ms | boost held at window end | boost switches so far | off: tok/J | on: tok/J |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for a in doc["auto"]:
            i = a.get("idle") or {}
            bm = a.get("idle_boost_metrics") or {}
            held = next((v for k, v in bm.items() if k.startswith("powersave_cuda_boost_held")), None)
            L.append(f"| idle | | | {fmt(i.get('avg_power_w'))} | {fmt(i.get('median_sm_clock_mhz'), 0)} | | | {fmt(held, 0)} | | "
                     f"{fmt(doc['loads']['idle']['mode_off']['avg_power_w'])} W | {fmt(doc['loads']['idle']['mode_on']['avg_power_w'])} W |")
            for load in LOADS:
                w = a["loads"].get(load)
                if not w:
                    continue
                bm = w.get("boost_metrics") or {}
                held = next((v for k, v in bm.items() if k.startswith("powersave_cuda_boost_held")), None)
                sw = next((v for k, v in bm.items() if k.startswith("powersave_cuda_boost_switches_total")), None)
                L.append(f"| {load} | {fmt(w.get('out_tok_per_s'), 0)} | {fmt(w.get('out_tok_per_j'), 2)} | {fmt(w.get('avg_power_w'), 0)} | "
                         f"{fmt(w.get('median_sm_clock_mhz'), 0)} | {fmt(w.get('p50_ttft_ms'))} / {fmt(w.get('p99_ttft_ms'))} | "
                         f"{fmt(w.get('p50_tpot_ms'), 2)} / {fmt(w.get('p99_tpot_ms'), 2)} | {fmt(held, 0)} | {fmt(sw, 0)} | "
                         f"{fmt(doc['loads'][load]['mode_off'].get('out_tok_per_j'), 2)} | {fmt(doc['loads'][load]['mode_on'].get('out_tok_per_j'), 2)} |")
            wk = a.get("wake_ttft_ms") or {}
            L += ["", "Wake-up TTFT in auto mode (ms): " + ", ".join(f"after {float(k):g} s idle {fmt(v)}" for k, v in sorted(wk.items(), key=lambda kv: float(kv[0]))) + "."]
    if doc.get("excluded"):
        L += ["", "## Excluded load windows", "",
              "| run | GPU | server | mode | dropped | windows dropped | wake probes dropped | reason |", "|---|---|---|---|---|---|---|---|"]
        for e in doc["excluded"]:
            what = e["items"] if isinstance(e["items"], str) else ", ".join(e["items"])
            L.append(f"| {e['tag']} | {e['gpu']} | #{e['pos']} | {e['mode']} | {what} | {e['dropped_windows']} | {e['dropped_wake']} | {e['reason']} |")
    L += ["", "## Process check", "", "| server | processes with CUDA_DISABLE_PERF_BOOST=1 | /metrics |", "|---|---|---|"]
    for e in doc["engine_env_check"]:
        L.append(f"| {e['mode']} #{e['pos']} (GPU {e['gpu']}) | {', '.join(e['processes_with_var']) or 'none'} | `{e['metrics_info']}` |")
    if doc.get("plot"):
        L += ["", f"![tokens/J and p99 TPOT vs load]({doc['plot']})"]
    L += ["", "## Findings", ""] + [f"- {x}" for x in doc.get("findings", [])] + [""]
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw", nargs="+")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--finding", action="append", default=[])
    ap.add_argument("--invalid", action="append", default=[], help="TAG:POS[:ITEM,...]=reason: drop that server's load windows and wake probes (all, or the items named: low, medium, saturation, wake1, wake10, wake60)")
    ns = ap.parse_args()
    out = Path(ns.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    raws = [json.loads((gzip.open if p.endswith(".gz") else open)(p, "rt").read()) for p in ns.raw]
    try:
        invalid = parse_invalid(ns.invalid, raws)
    except ValueError as e:
        ap.error(str(e))
    def archived(dest: Path) -> dict | None:
        if not dest.exists():
            return None
        with gzip.open(dest, "rt") as f:
            return json.load(f)

    dests = [out / "raw" / f"h200-perf-boost-{raw.get('tag') or i}.json.gz" for i, raw in enumerate(raws)]
    for p, raw, dest in zip(ns.raw, raws, dests):  # an archived raw is never replaced by another run
        if dests.count(dest) > 1 or archived(dest) not in (None, raw):
            ap.error(f"{p}: {dest} already holds another run with tag {raw.get('tag')!r}; give this run its own tag")
    raws_in = raws
    raws = mark_invalid(raws, invalid)
    doc = analyze(raws)
    doc["findings"] = ns.finding
    doc["plot"] = plot(doc, raws, out)
    for raw, dest in zip(raws_in, dests):  # the raw files as measured (exclusions apply to the report only); kept once copied
        if not dest.exists():
            with gzip.open(dest, "wt") as f:
                json.dump(raw, f)
    (out / "h200-perf-boost.json").write_text(json.dumps(doc, indent=1, default=float))
    (out / "h200-perf-boost.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
