#!/usr/bin/env python3
"""Records from ``benchmarks/h200_defaults.py`` raw files: stock vs the plugin's defaults.

``python -m benchmarks.h200_defaults_record RAW.json[.gz]... [--out-dir docs/results]`` writes

* ``h200-defaults.json`` + ``.md`` + ``.png``: ``pairs``; ``idle`` (``stock_w``, ``defaults_w``,
  ``power_ratio``); ``rates`` (per request rate: ``stock_gpu_idle_share``, ``idle_bound_saving``,
  ``out_tok_per_j_ratio`` and its ``_ci95``, ``throughput_ratio``, ``p50_ttft_ms_delta``,
  ``p99_tpot_ratio``, and the figures behind them); ``starvation`` (``idle_while_busy_j``,
  ``advice``, ``after_fix``); ``checks`` against the targets;
* ``h200-request-energy.json`` + ``.md``: identical requests at a steady batch (the plugin's
  per-request figures: p5 / p50 / p95 / max over the median; requests + idle against the counter;
  the tail / idle split).

Pairs: adjacent stock and defaults servers of one GPU, in run order over the raw files as given
on the command line (their server sequences concatenated: ``S D D`` + ``S S D`` -> (S,D) (D,S)
(S,D), ABBA-like across device calls). Ratios are defaults / stock per pair; intervals are Student-t 95 % over pairs.
``idle_bound_saving`` of a rate = stock's idle seconds in the window (GPU idle share x energy
window) x (stock idle W - defaults idle W of the pair) / stock's window energy: what the idle-power
difference alone can save there. ``energy_saving`` = 1 - (defaults J per output token / stock's).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.stats import mean_ci95

ARMS = ("stock", "defaults")


def mean_ci(xs: list[float]) -> tuple[float | None, list[float] | None]:
    """Mean and t-based 95 % interval of the finite values (lib.stats); no interval below 2."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None, None
    if len(xs) < 2:
        return xs[0], None
    m, lo, hi = mean_ci95(xs)
    return m, [lo, hi]


def r(x: Any, nd: int = 4) -> Any:
    return round(x, nd) if isinstance(x, float) and math.isfinite(x) else x


def load(path: str) -> dict:
    p = Path(path)
    data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    d = json.loads(data)
    d["_file"] = p.name
    return d


def pair_servers(raws: list[dict]) -> list[dict]:
    """Adjacent stock/defaults servers, greedily in run order over the raw files *in the order
    given* (their server sequences concatenated): one GPU running ``stock,defaults,defaults`` then
    ``stock,stock,defaults`` gives the pairs (S1,D1) (D2,S2) (S3,D3), ABBA-like across the calls.
    Give the raw files of one GPU in run order; files of different GPUs are paired per GPU."""
    seqs: dict[Any, list[tuple[dict, dict]]] = {}
    for raw in raws:
        for s in raw["servers"]:
            if s["arm"] in ARMS and (s.get("idle") or s.get("windows")):
                seqs.setdefault(raw.get("gpu"), []).append((raw, s))
    pairs = []
    for seq in seqs.values():
        i = 0
        while i + 1 < len(seq):
            (ra, a), (rb, b) = seq[i], seq[i + 1]
            if a["arm"] != b["arm"]:
                stock, dflt = (a, b) if a["arm"] == "stock" else (b, a)
                files = ra["_file"] if ra is rb else f"{ra['_file']}+{rb['_file']}"
                pairs.append(
                    {
                        "file": files,
                        "gpu": ra.get("gpu"),
                        "order": f"{a['arm']},{b['arm']}",
                        "servers": f"{a['label']},{b['label']}",
                        "stock": stock,
                        "defaults": dflt,
                    }
                )
                i += 2
            else:
                i += 1
    return pairs


def ok(w: dict | None) -> bool:
    return bool(w) and not w.get("error") and bool(w.get("completed"))


def rate_key(rate: str) -> float:
    return math.inf if rate == "sat" else float(rate)


def span(w: dict) -> dict:
    """The window's fixed-length span figures (``h200_defaults.py``: at least ``--window-s`` of wall
    time from the first arrival, idle tail included), if measured; else {} (harness window only)."""
    sp = w.get("span") or {}
    return sp if sp.get("energy_j") is not None else {}


def idle_w(s: dict) -> float | None:
    return (s.get("idle") or {}).get("avg_power_w")


#: Per-pair figures of a rate (``per_pair`` in the record): ratios and deltas defaults / stock, the
#: stock GPU's idle and low-power shares, the idle-power bound, the saving, each arm's tok/s, tok/J
#: and W, and whether the fixed-length span was used.
PAIR_FIGURES = "tokj thr ttft_d tpot share low_share bound saving stock_tps def_tps stock_tokj def_tokj stock_w def_w span".split()


def put_mean_ci(row: dict, name: str, xs: list[float], nd: int = 4) -> None:
    """``row[name]``: the mean of ``xs``, ``row[name + "_ci95"]``: its 95 % interval (rounded)."""
    m, ci = mean_ci(xs)
    row[name], row[f"{name}_ci95"] = r(m, nd), [r(x, nd) for x in ci] if ci else None


def rates_block(pairs: list[dict]) -> list[dict]:
    rates = sorted({w["request_rate"] for p in pairs for s in (p["stock"], p["defaults"]) for w in s["windows"]}, key=rate_key)
    out = []
    for rate in rates:
        per: dict[str, list] = {k: [] for k in PAIR_FIGURES}
        n = 0
        for p in pairs:
            ws = next((w for w in p["stock"]["windows"] if w["request_rate"] == rate), None)
            wd = next((w for w in p["defaults"]["windows"] if w["request_rate"] == rate), None)
            if not (ok(ws) and ok(wd)):
                continue
            n += 1
            per["thr"].append(wd["output_throughput"] / ws["output_throughput"] if ws.get("output_throughput") else None)
            per["stock_tps"].append(ws.get("output_throughput"))
            per["def_tps"].append(wd.get("output_throughput"))
            if ws.get("median_ttft_ms") is not None and wd.get("median_ttft_ms") is not None:
                per["ttft_d"].append(wd["median_ttft_ms"] - ws["median_ttft_ms"])
            if ws.get("p99_tpot_ms") and wd.get("p99_tpot_ms") is not None:
                per["tpot"].append(wd["p99_tpot_ms"] / ws["p99_tpot_ms"])
            # Both arms' fixed-length spans where both have them (idle tail of a low rate included),
            # else the harness's own window (first request to last completion).
            sps, spd = span(ws), span(wd)
            use_span = bool(sps and spd)
            fs = (
                sps
                if use_span
                else {
                    "energy_j": ws.get("gpu_energy_j"),
                    "seconds": ws.get("energy_window_s") or ws.get("duration"),
                    "out_tok_per_j": ws.get("output_tokens_per_joule"),
                    "avg_power_w": ws.get("gpu_avg_power_w"),
                    **{k: (ws.get("sampler") or {}).get(k) for k in ("gpu_idle_share", "gpu_low_power_share")},
                }
            )
            fd = spd if use_span else {"out_tok_per_j": wd.get("output_tokens_per_joule"), "avg_power_w": wd.get("gpu_avg_power_w")}
            per["span"].append(use_span)
            share = fs.get("gpu_idle_share")
            per["share"].append(share)
            per["low_share"].append(fs.get("gpu_low_power_share"))
            ts, td = fs.get("out_tok_per_j"), fd.get("out_tok_per_j")
            per["stock_tokj"].append(ts)
            per["def_tokj"].append(td)
            per["stock_w"].append(fs.get("avg_power_w"))
            per["def_w"].append(fd.get("avg_power_w"))
            if ts and td:
                per["tokj"].append(td / ts)
                per["saving"].append(1.0 - ts / td)
            iw_s, iw_d = idle_w(p["stock"]), idle_w(p["defaults"])
            e_s, win_s = fs.get("energy_j"), fs.get("seconds")
            if None not in (share, iw_s, iw_d, e_s, win_s) and e_s > 0:
                per["bound"].append(share * win_s * (iw_s - iw_d) / e_s)
        row: dict = {
            "request_rate": rate if rate == "sat" else float(rate),
            "pairs": n,
            "energy_window": (
                "fixed span (>= --window-s from the first arrival, idle tail included)"
                if per["span"] and all(per["span"])
                else "harness window (first request to last completion)"
                if not any(per["span"])
                else "mixed"
            ),
        }
        put_mean_ci(row, "out_tok_per_j_ratio", per["tokj"])
        row["stock_gpu_idle_share"] = r(mean_ci(per["share"])[0], 3)
        row["stock_gpu_low_power_share"] = r(mean_ci(per["low_share"])[0], 3)
        row["idle_bound_saving"] = r(mean_ci(per["bound"])[0])
        row["energy_saving"] = r(mean_ci(per["saving"])[0])
        row["bound_attained"] = (
            r(row["energy_saving"] / row["idle_bound_saving"]) if row["energy_saving"] is not None and row["idle_bound_saving"] else None
        )
        put_mean_ci(row, "throughput_ratio", per["thr"])
        put_mean_ci(row, "p50_ttft_ms_delta", per["ttft_d"], 2)
        put_mean_ci(row, "p99_tpot_ratio", per["tpot"])
        row["per_pair"] = {k: [r(x) for x in v] for k, v in per.items()}
        for k, name in (
            ("stock_tps", "stock_out_tok_s"),
            ("def_tps", "defaults_out_tok_s"),
            ("stock_tokj", "stock_out_tok_per_j"),
            ("def_tokj", "defaults_out_tok_per_j"),
            ("stock_w", "stock_avg_w"),
            ("def_w", "defaults_avg_w"),
        ):
            row[name] = r(mean_ci(per[k])[0], 2)
        out.append(row)
    return out


def starvation_block(raws: list[dict]) -> dict:
    runs, fixes = [], []
    last = None  # a fix run in a later file is compared with the latest starvation window before it
    for raw in raws:
        for s in raw["servers"]:
            if s.get("starvation"):
                st = s["starvation"]
                w = st["window"]
                e = w.get("gpu_energy_j")
                last = {
                    "file": raw["_file"],
                    "server": s["label"],
                    "idle_while_busy_j": st.get("idle_while_busy_j"),
                    "idle_while_busy_s": st.get("idle_while_busy_s"),
                    "frontend_busy_s": st.get("frontend_busy_s"),
                    "share_of_window_energy": (st["idle_while_busy_j"] / e) if st.get("idle_while_busy_j") is not None and e else None,
                    "how": st["starvation"]["how"],
                    "series": st["starvation"]["series"],
                    "warnings": st["warnings"],
                    "advise_ok": st["advise"]["ok"],
                    "advise_output": st["advise"]["output"],
                    "advise_cmds": [a["cmd"] for a in st["advise"]["attempts"]],
                    "fix_args": st["advise"]["fix_args"],
                    "concurrency": w.get("concurrency"),
                    "out_tok_s": w.get("output_throughput"),
                    "out_tok_per_j": w.get("output_tokens_per_joule"),
                    "avg_w": w.get("gpu_avg_power_w"),
                    "gpu_idle_share": (w.get("sampler") or {}).get("gpu_idle_share"),
                    "util0_energy_j_nvml": (w.get("sampler") or {}).get("util0_energy_j"),
                }
                runs.append(last)
            if s.get("fix_window") and ok(s["fix_window"]):
                fw = s["fix_window"]
                after = {
                    "out_tok_s": fw.get("output_throughput"),
                    "out_tok_per_j": fw.get("output_tokens_per_joule"),
                    "avg_w": fw.get("gpu_avg_power_w"),
                    "gpu_idle_share": (fw.get("sampler") or {}).get("gpu_idle_share"),
                    "p50_ttft_ms": fw.get("median_ttft_ms"),
                    "p99_tpot_ms": fw.get("p99_tpot_ms"),
                }
                before = {k: last.get(k) for k in ("out_tok_s", "out_tok_per_j", "avg_w", "gpu_idle_share")} if last else None
                fx = {
                    "file": raw["_file"],
                    "server": s["label"],
                    "fix_args": s.get("fix_args"),
                    "fix_source": s.get("fix_source"),
                    "before_from": f"{last['file']} {last['server']}" if last else None,
                    "before": before,
                    "after": after,
                }
                if before and before.get("out_tok_s") and after["out_tok_s"]:
                    fx["throughput_ratio"] = r(after["out_tok_s"] / before["out_tok_s"])
                if before and before.get("out_tok_per_j") and after["out_tok_per_j"]:
                    fx["out_tok_per_j_ratio"] = r(after["out_tok_per_j"] / before["out_tok_per_j"])
                fixes.append(fx)
    js = [x["idle_while_busy_j"] for x in runs if x["idle_while_busy_j"] is not None]
    # The latest run whose plugin counters were found speaks for the figure, its advice and its fix
    # (an earlier run may predate the counters on /metrics).
    counted = [x for x in runs if x["idle_while_busy_j"] is not None]
    if counted:
        runs = [counted[-1], *(x for x in runs if x is not counted[-1])]
        fixes = [f for f in fixes if f["before_from"] == f"{counted[-1]['file']} {counted[-1]['server']}"] or fixes
    advice = next((x["advise_output"] for x in runs if x["advise_ok"]), None)
    nv = [x["util0_energy_j_nvml"] for x in runs if x.get("util0_energy_j_nvml") is not None]
    return {
        "idle_while_busy_j": r(statistics.fmean(js), 1) if js else None,
        "util0_energy_j_nvml": r(statistics.fmean(nv), 1) if nv else None,
        "idle_while_busy_share": r(mean_ci([x["share_of_window_energy"] for x in runs])[0]),
        "warning": next((x["warnings"][0] for x in runs if x["warnings"]), None),
        "advice": advice.strip().splitlines()[:20] if advice else None,
        "after_fix": fixes[-1] if fixes else None,
        "runs": runs,
    }


def checks(idle: dict, rates: list[dict], starv: dict) -> dict:
    c: dict = {"idle_power_30pct_lower": None if idle["power_ratio"] is None else idle["power_ratio"] <= 0.70}
    for row in rates:
        k = f"rate_{row['request_rate']}"
        b = row["idle_bound_saving"]
        c[k] = {
            "saving_ge_80pct_of_bound": None if row["bound_attained"] is None else row["bound_attained"] >= 0.8,
            "tokj_ci_above_1_where_bound_ge_10pct": (
                None if b is None or b < 0.10 or not row["out_tok_per_j_ratio_ci95"] else row["out_tok_per_j_ratio_ci95"][0] > 1.0
            ),
            "p50_ttft_le_plus_5ms": None if row["p50_ttft_ms_delta"] is None else row["p50_ttft_ms_delta"] <= 5.0,
            "throughput_ratio_ge_0_99": None if row["throughput_ratio"] is None else row["throughput_ratio"] >= 0.99,
            "p99_tpot_le_plus_5pct": None if row["p99_tpot_ratio"] is None else row["p99_tpot_ratio"] <= 1.05,
        }
    fx = starv["after_fix"] if isinstance(starv["after_fix"], dict) else None
    c["starvation_figure_and_warning"] = starv["idle_while_busy_j"] is not None and starv["warning"] is not None
    c["fix_measured"] = bool(fx and fx.get("out_tok_per_j_ratio") is not None)
    return c


def request_energy(raws: list[dict], drop: float) -> dict:
    segs = []
    for raw in raws:
        for s in raw["servers"]:
            seg = s.get("reqenergy")
            if not seg:
                continue
            lines = seg["lines"]
            js = [x["energy_j"] for x in lines if isinstance(x.get("energy_j"), (int, float))]
            k = int(len(js) * drop)
            steady = js[k : len(js) - k] if len(js) > 2 * k else js

            def spread(v: list[float]) -> dict | None:
                if len(v) < 2:
                    return None
                q = statistics.quantiles(v, n=100, method="inclusive")
                med = statistics.median(v)
                return {
                    "n": len(v),
                    "median_j": r(med),
                    "p5_over_median": r(q[4] / med),
                    "p50_over_median": 1.0,
                    "p95_over_median": r(q[94] / med),
                    "max_over_median": r(max(v) / med),
                    "min_over_median": r(min(v) / med),
                }

            phases = seg.get("plugin_energy_j_by_phase") or {}
            extra = {}
            for x in lines:  # per-request parts the plugin may add (e.g. a tail share): summed by name
                for key, v in x.items():
                    if key != "energy_j" and key.endswith("_j") and isinstance(v, (int, float)):
                        extra[key] = extra.get(key, 0.0) + v
            req_sum = sum(js)
            idle_j = phases.get("idle")
            counter = seg.get("counter_j")
            harness_j = seg.get("counter_harness_window_j")  # NVML counter, first request to last completion
            segs.append(
                {
                    "file": raw["_file"],
                    "server": s["label"],
                    "device": raw["device"].get("name"),
                    "date_utc": raw.get("date_utc"),
                    "n_requests": seg["n"],
                    "lines": len(lines),
                    "with_energy": len(js),
                    "concurrency": seg["concurrency"],
                    "input_len": seg["input_len"],
                    "output_len": seg["output_len"],
                    "prompts": seg.get("prompts"),
                    "source": next((x.get("source") for x in lines), None),
                    "method": next((x.get("method") for x in lines), None),
                    "steady_rule": f"lines in finish order, first and last {drop:.0%} dropped",
                    "steady": spread(steady),
                    "all": spread(js),
                    "requests_sum_j": r(req_sum, 3),
                    "idle_j": r(idle_j, 3) if idle_j is not None else None,
                    "plugin_total_j": r(sum(phases.values()), 3) if phases else None,
                    "plugin_phases_j": {k2: r(v, 3) for k2, v in phases.items()},
                    "counter_j": r(counter, 3) if counter is not None else None,
                    "counter_harness_window_j": r(harness_j, 3) if harness_j is not None else None,
                    "requests_plus_tail_over_harness_window_counter": (
                        r((req_sum + seg["tail_j"]) / harness_j, 5) if harness_j and seg.get("tail_j") is not None else None
                    ),
                    "requests_plus_idle_over_counter": r((req_sum + idle_j) / counter, 5) if counter and idle_j is not None else None,
                    "requests_plus_idle_plus_tail_over_counter": (
                        r((req_sum + idle_j + seg["tail_j"]) / counter, 5)
                        if counter and idle_j is not None and seg.get("tail_j") is not None
                        else None
                    ),
                    "tail_idle_split": {
                        "idle_j": r(idle_j, 3) if idle_j is not None else None,
                        "tail_j": r(seg.get("tail_j"), 3),
                        "tail_j_metrics": r(seg.get("tail_j_metrics"), 3),
                        **{k2: r(v, 3) for k2, v in extra.items()},
                        "note": "idle_j: the plugin's idle phase over the span; tail_j: non-idle energy charged to no "
                        "request (snapshot request_energy_j_tail delta; tail_j_metrics: "
                        "powersave_request_tail_energy_joules_total delta); *_j: per-request parts summed",
                    },
                    "harness_out_tok_s": seg["harness"].get("output_throughput"),
                    "span_s": r(seg.get("span_s"), 3),
                }
            )
    return {"segments": segs}


#: Decode batch-size buckets of the closed loop (settings ``clocks.closed_loop.batch_buckets`` default).
BATCH_BUCKETS = (1, 8, 32, 64, 128, 256, 512)


def bucket_of(batch: int, edges: tuple[int, ...] = BATCH_BUCKETS) -> int:
    b = edges[0]
    for e in edges:
        if e <= batch:
            b = e
    return b


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def trace_members(tar_path: Path) -> dict[str, list[dict]]:
    """``{server label: parsed lines}`` of the step traces (``<label>-trace-rank<N>.jsonl.gz``) in a
    servers tarball of ``h200_defaults.py``."""
    import tarfile

    out: dict[str, list[dict]] = {}
    with tarfile.open(tar_path) as t:
        for m in t.getmembers():
            if "-trace-rank" not in m.name or not m.isfile():
                continue
            try:
                data = t.extractfile(m).read()  # type: ignore[union-attr]
                if m.name.endswith(".gz"):
                    data = gzip.decompress(data)
            except (OSError, EOFError) as exc:  # a truncated or corrupt member: the others still count
                print(f"warning: {tar_path.name}: {m.name}: {exc}", file=sys.stderr)
                continue
            rows = []
            for ln in data.splitlines():
                try:
                    rows.append(json.loads(ln))
                except ValueError:
                    pass
            out.setdefault(m.name.split("-trace-rank")[0], []).extend(rows)
    return out


def closed_loop_summary(raws: list[dict], tars: dict[str, Path | None]) -> dict:
    """What the closed-loop decode clock decided in dry-run (nothing was set) on the
    defaults servers: decision records by kind; per decode-batch bucket the step time measured at
    the default clock (every step of a dry-run ran there), the clocks it would have probed and held,
    and the steps observed; the worker snapshot's ``closed_loop`` state at the end."""
    servers = []
    for raw in raws:
        tar = tars.get(raw["_file"])
        traces = trace_members(tar) if tar is not None and tar.is_file() else {}
        for s in raw["servers"]:
            if s["arm"] == "stock":
                continue
            rows = traces.get(s["label"], [])
            recs = [x["closed_loop"] for x in rows if isinstance(x.get("closed_loop"), dict)]
            steps = [x for x in rows if "phase" in x]
            kinds: dict[str, int] = {}
            for x in recs:
                k = str(x.get("event") or x.get("kind") or "?")
                kinds[k] = kinds.get(k, 0) + 1
            per: dict[int, dict] = {}
            for x in steps:
                if x.get("phase") != "decode" or x.get("t_end") is None or not x.get("decode"):
                    continue
                b = per.setdefault(bucket_of(int(x["decode"])), {"ms": [], "sm_target": set()})
                b["ms"].append(1e3 * (x["t_end"] - x["t"]))
                if x.get("sm_target") is not None:
                    b["sm_target"].add(x["sm_target"])
            for x in recs:
                if x.get("bucket") is None:
                    continue
                b = per.setdefault(int(x["bucket"]), {"ms": [], "sm_target": set()})
                ev = x.get("event")
                clk = x.get("sm_clock_mhz") if ev in ("probe", "hold") else x.get("ran_at_mhz") if ev in ("accept", "reject") else None
                if ev in ("probe", "accept", "reject", "unmeasured"):
                    m = re.search(r"at (\d+) MHz", str(x.get("reason", ""))) if ev == "unmeasured" else None
                    clk = int(m.group(1)) if m else clk
                    if clk is not None:
                        b.setdefault("probed", set()).add(clk)
                if ev == "hold":
                    b.setdefault("held", []).append(clk)
                if ev == "baseline_done":
                    b.setdefault("controller_baseline_ms", []).append(x.get("baseline_ms"))
                    b.setdefault("spreads", []).append(x.get("spread_pct"))
                    b["spread_pct"] = x.get("spread_pct")
            snap = (s.get("snapshot") or {}).get("closed_loop")
            buckets = {}
            for e, b in sorted(per.items()):
                ms = b["ms"]
                buckets[str(e)] = {
                    "default_clock_step_ms": {
                        "median": r(quantile(ms, 0.5), 3),
                        "p10": r(quantile(ms, 0.1), 3),
                        "p90": r(quantile(ms, 0.9), 3),
                        "n": len(ms),
                    },
                    "decode_steps_observed": len(ms),
                    "would_probe_mhz": sorted(b.get("probed", ())),
                    "would_hold_mhz": b.get("held", []),  # None: the default clock "sm_target_in_trace_mhz": sorted(b["sm_target"]),
                    "controller_baseline_ms": [r(v, 3) for v in b.get("controller_baseline_ms", [])],
                    "controller_spread_pct": [r(v, 3) for v in b.get("spreads", [])],
                    "spread_pct": r(b.get("spread_pct"), 3),
                }
            servers.append(
                {
                    "file": raw["_file"],
                    "server": s["label"],
                    "device": raw["device"].get("name"),
                    "trace": "found" if rows else ("no trace in " + (tar.name if tar else "no servers tarball")),
                    "steps_observed": len(steps),
                    "decode_steps": sum(len(b["ms"]) for b in per.values()),
                    "decisions": len(recs),
                    "decisions_by_kind": dict(sorted(kinds.items())),
                    # where the closed loop's own step times came from (device/step_timer.py)
                    "step_time_source": sorted({str(x["step_time_source"]) for x in recs if x.get("step_time_source")}) or ["engine_wall"],
                    "buckets": buckets,
                    "snapshot_closed_loop": snap,
                    "clock_backend": (s.get("snapshot") or {}).get("clock_backend"),
                    "clock_mode": (s.get("snapshot") or {}).get("clock_mode"),
                }
            )
    return {
        "what": "closed-loop decode clock decisions in dry-run (POWERSAVE_FORCE_DRY_RUN=1: no clock was set; every step "
        "ran at the driver's default clock, so probes cannot be measured and time out as 'unmeasured')",
        "step_ms": "default_clock_step_ms: engine-thread wall time of pure decode steps (trace t_end - t), bucketed by "
        f"decode batch ({', '.join(map(str, BATCH_BUCKETS))}): launch time under async scheduling; "
        "controller_baseline_ms / controller_spread_pct: the closed loop's own default-clock fit per bucket and its "
        "relative step noise, from the step times it measured (step_time_source: cuda_events = on the GPU)",
        "servers": servers,
    }


def plot(rates: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    rows = [x for x in rates if x["out_tok_per_j_ratio"] is not None]
    if not rows:
        return False
    finite = [x["request_rate"] for x in rows if x["request_rate"] != "sat"]
    top = max(finite) * 3 if finite else 1.0
    xs = [top if x["request_rate"] == "sat" else x["request_rate"] for x in rows]
    ys = [x["out_tok_per_j_ratio"] for x in rows]
    lo = [y - (x["out_tok_per_j_ratio_ci95"] or [y, y])[0] for x, y in zip(rows, ys)]
    hi = [(x["out_tok_per_j_ratio_ci95"] or [y, y])[1] - y for x, y in zip(rows, ys)]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=4, label="defaults / stock (mean, 95 % CI over pairs)")
    bx = [x for x, row in zip(xs, rows) if row["idle_bound_saving"] is not None and row["idle_bound_saving"] < 1]
    by = [1 / (1 - row["idle_bound_saving"]) for row in rows if row["idle_bound_saving"] is not None and row["idle_bound_saving"] < 1]
    if bx:
        ax.plot(bx, by, "s--", color="gray", label="idle-power bound (stock idle s x idle W difference)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(["sat" if row["request_rate"] == "sat" else f"{row['request_rate']:g}" for row in rows])
    ax.set_xlabel("Poisson request rate (req/s)")
    ax.set_ylabel("output tokens per joule ratio")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, list):
        return "–".join(fmt(v, nd) for v in x)
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", nargs="+")
    ap.add_argument("--out-dir", default="docs/results")
    ap.add_argument("--name", default="h200-defaults")
    ap.add_argument("--reqe-name", default="h200-request-energy")
    ap.add_argument(
        "--trace-out",
        default=None,
        help="also write the closed-loop decision summary to TRACE_OUT.json/.md "
        "(e.g. docs/results/h200-closed-loop-decisions), from the servers tarballs",
    )
    ap.add_argument(
        "--servers",
        nargs="*",
        default=None,
        help="servers-<tag>.tar.gz per raw file, same order (default: beside each raw file, by its tag)",
    )
    ap.add_argument("--steady-drop", type=float, default=0.2, help="share of request lines dropped at each end (480 -> middle 288)")
    ns = ap.parse_args()
    raws = [load(p) for p in ns.raw]
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    measured = all(x.get("measured") for x in raws)
    pairs = pair_servers(raws)
    ir = [idle_w(p["defaults"]) / idle_w(p["stock"]) for p in pairs if idle_w(p["stock"]) and idle_w(p["defaults"]) is not None]
    idle = {f"{arm}_w": r(mean_ci([idle_w(p[arm]) for p in pairs])[0], 1) for arm in ARMS}
    put_mean_ci(idle, "power_ratio", ir)
    idle["pairs"] = len(ir)
    for arm in ARMS:
        idle[f"{arm}_sm_mhz"] = [(p[arm].get("idle") or {}).get("median_sm_clock_mhz") for p in pairs]
    rates = rates_block(pairs)
    starv = starvation_block(raws)
    devices = sorted({x["device"].get("name", "?") for x in raws})
    rec = {
        "what": "stock vLLM vs --plugin powersave with its defaults (no setting), one server at a time, ABBA",
        "measured": measured,
        "simulated": False,
        "energy": "NVML total-energy counter per load window" if measured else "unavailable (no NVML): energy figures are null",
        "devices": devices,
        "vllm_versions": sorted({str(x.get("vllm_version")) for x in raws}),
        "shapes": sorted({str(x.get("shape") or x.get("model")) for x in raws}),
        "runs": [
            {
                "file": x["_file"],
                "tag": x.get("tag"),
                "gpu": x.get("gpu"),
                "date_utc": x.get("date_utc"),
                "order": x["method"]["order"],
                "notes": x.get("notes"),
            }
            for x in raws
        ],
        "method": raws[0]["method"],
        "pairs": len(pairs),
        "pair_list": [{"file": p["file"], "gpu": p["gpu"], "order": p["order"], "servers": p["servers"]} for p in pairs],
        "idle": idle,
        "rates": rates,
        "starvation": starv,
        "checks": checks(idle, rates, starv),
        "startup_s": {a: [s.get("startup_s") for x in raws for s in x["servers"] if s["arm"] == a] for a in ("stock", "defaults", "fix")},
        "scripts": ["benchmarks/h200_defaults.py", "benchmarks/h200_defaults_record.py"],
        "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / f"{ns.name}.json").write_text(json.dumps(rec, indent=1))
    png = out / f"{ns.name}.png"
    has_png = plot(rates, png, f"{', '.join(devices)}: --plugin powersave defaults vs stock ({len(pairs)} pairs)")
    label = "measured" if measured else "NOT measured: no NVML (CPU smoke test), energy null"
    m = raws[0]["method"]
    md = [
        f"# Stock vLLM vs `--plugin powersave` defaults ({label})",
        "",
        f"- Device(s): {', '.join(devices)}; vLLM {', '.join(rec['vllm_versions'])}; model {', '.join(rec['shapes'])} (`--load-format dummy`).",
        "- Runs (UTC): " + "; ".join(f"{x['tag']} GPU {x['gpu']} {x['date_utc']} order {','.join(x['order'])}" for x in rec["runs"]) + ".",
        f"- Method: one server at a time; stock = vLLM alone (no plugin on the path, or `VLLM_PLUGINS=` empty); defaults = "
        f"`--plugin powersave` with no saving setting (observation only: {m.get('defaults_observe')}). Per server: "
        f"{m.get('idle_s')} s idle, then Poisson windows of {m.get('window_s')} s of request starts at "
        f"{', '.join(m.get('rates') or [])} req/s ({m.get('input_len')} in / {m.get('output_len')} out, streamed, "
        f"same seeds in both arms). Energy: {rec['energy']}. GPU idle share: {m.get('gpu_idle_share')}. Clocks never changed.",
        f"- Pairs: **{len(pairs)}** (adjacent stock/defaults servers on one GPU: "
        + ", ".join(f"{p['file']} GPU {p['gpu']} {p['servers']}" for p in rec["pair_list"])
        + ").",
        "",
        "## Idle, engine loaded",
        "",
        "| stock W | defaults W | ratio (95 % CI) | pairs |",
        "|---|---|---|---|",
        f"| {fmt(idle['stock_w'], 1)} | {fmt(idle['defaults_w'], 1)} | {fmt(idle['power_ratio'])} ({fmt(idle['power_ratio_ci95'])}) | {idle['pairs']} |",
        "",
        "## Request-rate sweep (defaults / stock per pair)",
        "",
        "| req/s | pairs | stock GPU idle share | idle bound | energy saving | tok/J ratio (95 % CI) | throughput ratio | p50 TTFT Δ ms | p99 TPOT ratio | stock / defaults tok/s | stock / defaults tok/J |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rates:
        md.append(
            f"| {x['request_rate']} | {x['pairs']} | {fmt(x['stock_gpu_idle_share'], 2)} | {fmt(x['idle_bound_saving'])} | "
            f"{fmt(x['energy_saving'])} | {fmt(x['out_tok_per_j_ratio'])} ({fmt(x['out_tok_per_j_ratio_ci95'])}) | "
            f"{fmt(x['throughput_ratio'])} | {fmt(x['p50_ttft_ms_delta'], 2)} | {fmt(x['p99_tpot_ratio'])} | "
            f"{fmt(x['stock_out_tok_s'], 0)} / {fmt(x['defaults_out_tok_s'], 0)} | {fmt(x['stock_out_tok_per_j'])} / {fmt(x['defaults_out_tok_per_j'])} |"
        )
    md += [
        "",
        "Energy window per rate: " + "; ".join(f"{x['request_rate']}: {x['energy_window']}" for x in rates) + ".",
        "Idle bound = stock's idle seconds in the window x (stock idle W - defaults idle W) / stock's window energy.",
    ]
    if has_png:
        md += ["", f"![tokens per joule ratio vs request rate]({png.name})"]
    fx = starv["after_fix"] if isinstance(starv["after_fix"], dict) else None
    md += [
        "",
        "## Starvation: one API server at high concurrency",
        "",
        f"- GPU energy spent idle while requests were running or waiting: {fmt(starv['idle_while_busy_j'], 1)} J "
        f"({fmt(starv['idle_while_busy_share'])} of the window's energy; {starv['runs'][0]['how'] if starv['runs'] else 'not run'}); "
        f"NVML cross-check, energy of samples at 0 % utilisation: {fmt(starv['util0_energy_j_nvml'], 1)} J.",
        f"- Warning in the server log: {('`' + starv['warning'][:300] + '`') if starv['warning'] else 'none found'}.",
        "- `vllm-powersave advise`:" + ("" if starv["advice"] else " no output"),
        *(["```", *starv["advice"], "```"] if starv["advice"] else []),
        (
            f"- Fix applied ({fx['fix_args']}, from {fx['fix_source']}): throughput {fmt((fx['before'] or {}).get('out_tok_s'), 0)} -> "
            f"{fmt(fx['after']['out_tok_s'], 0)} tok/s (x{fmt(fx.get('throughput_ratio'))}), tokens/J {fmt((fx['before'] or {}).get('out_tok_per_j'))} -> "
            f"{fmt(fx['after']['out_tok_per_j'])} (x{fmt(fx.get('out_tok_per_j_ratio'))})."
            if fx
            else "- Fix: not measured."
        ),
    ]
    md += ["", "## Checks against the targets", "", "```", json.dumps(rec["checks"], indent=1), "```"]
    (out / f"{ns.name}.md").write_text("\n".join(md) + "\n")

    reqe = request_energy(raws, ns.steady_drop)
    sim = any(seg["source"] == "simulated" for seg in reqe["segments"])
    reqe.update(
        {
            "what": "identical-length requests at a steady batch: the plugin's per-request energy",
            "measured": measured and not sim,
            "simulated": sim,
            "devices": devices,
            "scripts": rec["scripts"],
            "recorded_utc": rec["recorded_utc"],
        }
    )
    (out / f"{ns.reqe_name}.json").write_text(json.dumps(reqe, indent=1))
    md = [
        f"# Per-request energy of identical requests at a steady batch ({'simulated per-request figures; ' if sim else ''}{label})",
        "",
        "- Requests of equal length (distinct random prompts, no prefix-cache hits, `ignore_eos`) at a fixed concurrency through "
        "the defaults server; the plugin's per-request lines (`requests-rank<N>.jsonl`) against the NVML counter over the "
        "same span (plugin snapshot to snapshot). Steady batch: lines in finish order, first and last "
        f"{ns.steady_drop:.0%} dropped.",
        "",
        "| run | source / method | n (steady) | median J | p5 / p50 / p95 / max over median | requests + idle over counter | requests J | idle J | counter J | other parts J |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in reqe["segments"]:
        st = s["steady"] or {}
        other = {k: v for k, v in s["tail_idle_split"].items() if k not in ("idle_j", "note") and v is not None}
        md.append(
            f"| {s['file']} {s['server']} | {s['source']} / {s['method']} | {st.get('n')} | {fmt(st.get('median_j'))} | {fmt(st.get('p5_over_median'))} / 1 / "
            f"{fmt(st.get('p95_over_median'))} / {fmt(st.get('max_over_median'))} | {fmt(s['requests_plus_idle_over_counter'], 4)} | "
            f"{fmt(s['requests_sum_j'], 1)} | {fmt(s['idle_j'], 1)} | {fmt(s['counter_j'], 1)} | {json.dumps(other) if other else '–'} |"
        )
    (out / f"{ns.reqe_name}.md").write_text("\n".join(md) + "\n")
    if ns.trace_out:
        tars: dict[str, Path | None] = {}
        for k, (path, raw) in enumerate(zip(ns.raw, raws)):
            if ns.servers is not None:
                tars[raw["_file"]] = Path(ns.servers[k]) if k < len(ns.servers) else None
            else:
                tars[raw["_file"]] = Path(path).parent / f"servers-{raw.get('tag')}.tar.gz"
        cl = closed_loop_summary(raws, tars)
        cl.update({"measured": measured, "devices": devices, "scripts": rec["scripts"], "recorded_utc": rec["recorded_utc"]})
        stem = Path(ns.trace_out)
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(cl, indent=1))
        md = [
            f"# Closed-loop decode clock decisions in dry-run ({', '.join(devices)}; {label})",
            "",
            f"- {cl['what']}.",
            f"- Step time: {cl['step_ms']}.",
            "",
            "| run | steps | decode steps | decisions by kind | loop's step times | bucket: loop's default-clock step ms (noise %) "
            "/ engine-thread wall ms median (p10-p90, n) / would probe MHz / would hold MHz |",
            "|---|---|---|---|---|---|",
        ]
        for x in cl["servers"]:
            cells = "; ".join(
                f"{e}: {','.join(fmt(v) for v in b['controller_baseline_ms']) or '–'} "
                f"({','.join(fmt(v, 2) for v in b['controller_spread_pct']) or '–'}) / "
                f"{fmt(b['default_clock_step_ms']['median'])} ({fmt(b['default_clock_step_ms']['p10'])}-"
                f"{fmt(b['default_clock_step_ms']['p90'])}, {b['default_clock_step_ms']['n']}) / "
                f"{','.join(map(str, b['would_probe_mhz'])) or '–'} / {','.join('default' if h is None else str(h) for h in b['would_hold_mhz']) or '–'}"
                for e, b in x["buckets"].items()
            )
            md.append(
                f"| {x['file']} {x['server']} | {x['steps_observed']} | {x['decode_steps']} | "
                f"{json.dumps(x['decisions_by_kind']) if x['decisions_by_kind'] else '–'} | {', '.join(x['step_time_source'])} | "
                f"{cells or x['trace']} |"
            )
        stem.with_suffix(".md").write_text("\n".join(md) + "\n")
        print(f"wrote {stem}.json/.md ({sum(x['decisions'] for x in cl['servers'])} decision records)")
    print(
        f"wrote {out}/{ns.name}.json/.md{'/.png' if has_png else ''} ({len(pairs)} pairs) and {out}/{ns.reqe_name}.json/.md "
        f"({len(reqe['segments'])} segment(s))"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
