"""Records from ``benchmarks/h200_defaults.py`` raw files: stock vs the plugin's defaults.

``python -m benchmarks.h200_defaults_record RAW.json[.gz]... [--out-dir docs/results]`` writes
``h200-defaults.{json,md,png}`` (idle power, the request-rate sweep, starvation, checks) and
``h200-request-energy.{json,md}`` (identical requests at a steady batch). How the raw files are
made: docs/benchmarks.md.

Pairs: adjacent stock and defaults servers of one GPU, in run order over the raw files as given
(``S D D`` + ``S S D`` -> (S,D) (D,S) (S,D), ABBA-like across device calls). Ratios are defaults /
stock per pair; intervals are Student-t 95 % over pairs. ``idle_bound_saving`` of a rate = stock's
idle seconds in the window (GPU idle share x energy window) x (stock idle W - defaults idle W) /
stock's window energy: what the idle-power difference alone can save there. ``energy_saving`` =
1 - (defaults J per output token / stock's).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import tarfile
import time
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.burst_trace import trace_lines
from benchmarks.counter_lag import read_trace, segment_lag
from benchmarks.h200_defaults import judge_bursts
from benchmarks.lib.cli import one_line_errors
from benchmarks.lib.device import write_record
from benchmarks.lib.stats import mean_ci

ARMS = ("stock", "defaults")
SCRIPTS = ["benchmarks/h200_defaults.py", "benchmarks/h200_defaults_record.py"]
REQE_WHAT = "identical-length requests at a steady batch: the plugin's per-request energy"
#: How a bursts segment's truth was taken, by its method.
BURST_TRUTH = {
    "deep-idle baseline": "truth: the counter less deep-idle power outside the burst, which charges the burst with the GPU's "
    "tail above idle after it",
    "null-request control": "truth: the counter's difference between the burst's span and a null request's, so that tail cancels",
}
#: The request-energy twin keeps what is written by hand from this heading on (runs, findings).
REQE_KEEP_FROM = "## Runs"
#: A load window's throughput, energy and power figures under the record's names (:func:`pick`).
WINDOW = "out_tok_s=output_throughput out_tok_per_j=output_tokens_per_joule avg_w=gpu_avg_power_w gpu_idle_share=sampler.gpu_idle_share"
#: Per-pair figures of a rate (``per_pair``): defaults / stock tok/J and throughput, p50 TTFT delta, p99 TPOT
#: ratio, stock's GPU idle and low-power shares, the idle-power bound, the saving, each arm's tok/s, tok/J, W.
PAIR_FIGURES = "tokj thr ttft_d tpot share low_share bound saving stock_tps def_tps stock_tokj def_tokj stock_w def_w span".split()
ENERGY_WINDOWS = {
    True: "fixed span (>= --window-s from the first arrival, idle tail included)",
    False: "harness window (first request to last completion)",
}


def r(x: Any, nd: int = 4) -> Any:
    return round(x, nd) if isinstance(x, float) and math.isfinite(x) else x


def mean(xs: list[float], nd: int = 4) -> Any:
    return r(mean_ci(xs)[0], nd)


def put_mean_ci(row: dict, name: str, xs: list[float], nd: int = 4) -> None:
    """``row[name]``: the mean of ``xs``, ``row[name + "_ci95"]``: its 95 % interval (rounded)."""
    m, ci = mean_ci(xs)
    row[name], row[f"{name}_ci95"] = r(m, nd), [r(x, nd) for x in ci] if ci else None


def ratio(parts: tuple, den: float | None, nd: int = 5) -> float | None:
    """``sum(parts) / den`` rounded; None where a part is missing or ``den`` is 0 or missing."""
    return r(sum(parts) / den, nd) if den and None not in parts else None


def load(path: str) -> dict:
    p = Path(path)
    d = json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes())
    d["_file"] = p.name
    # The job writes defaults-<run>.json beside servers-<run>.tar.gz (benchmarks/h200_defaults.py).
    stem = p.name.removesuffix(".gz").removesuffix(".json")
    tar = p.with_name("servers-" + stem.removeprefix("defaults-") + ".tar.gz") if stem.startswith("defaults-") else None
    d["_servers_tar"] = str(tar) if tar is not None and tar.exists() else None
    return d


def counter_lag_of(raw: dict, server: str, seg: dict, cache: dict) -> dict | None:
    """The counter's lag over a segment (``benchmarks/counter_lag.py``), from the server's step trace
    in the raw file's servers tarball beside it; None without one (raw files do not outlive a
    session, so the record keeps the figure)."""
    if not raw.get("_servers_tar"):
        return None
    key = (raw["_servers_tar"], server)
    if key not in cache:
        try:
            cache[key] = read_trace(trace_lines(Path(raw["_servers_tar"]), server))
        except (
            OSError,
            EOFError,
            zlib.error,
            tarfile.TarError,
            json.JSONDecodeError,
            UnicodeDecodeError,
        ) as e:  # cut short by a lease's end
            print(f"note: {raw['_servers_tar']}: unreadable ({type(e).__name__}): no counter-lag fit", file=sys.stderr)
            cache[key] = None
        except ValueError:
            cache[key] = None  # no trace of that server (the trace is on in the defaults arm only)
    if cache[key] is None:
        return None
    lag = segment_lag(cache[key], {x["request_id"] for x in seg["lines"] if x.get("request_id")})
    return None if lag is None else lag.as_dict()


def ok(w: dict | None) -> bool:
    return bool(w) and not w.get("error") and bool(w.get("completed"))


def idle_w(s: dict) -> float | None:
    return (s.get("idle") or {}).get("avg_power_w")


def pick(d: dict, spec: str) -> dict:
    """``{name: d[key]}`` for each ``name=key`` in ``spec`` (``name`` alone: that key; missing: None);
    a key ``sampler.K`` reads the load window's NVML sampler figure K."""
    out = {}
    for name, _, key in (item.partition("=") for item in spec.split()):
        src, key = ((d.get("sampler") or {}), key[8:]) if key.startswith("sampler.") else (d, key or name)
        out[name] = src.get(key)
    return out


def pair_servers(raws: list[dict]) -> list[dict]:
    """Adjacent stock/defaults servers of one GPU, greedily in run order over ``raws`` (see above)."""
    seqs: dict[Any, list[tuple[dict, dict]]] = defaultdict(list)
    for raw in raws:
        for s in raw["servers"]:
            if s["arm"] in ARMS and (s.get("idle") or s.get("windows")):
                seqs[raw.get("gpu")].append((raw, s))
    pairs = []
    for seq in seqs.values():
        i = 0
        while i + 1 < len(seq):
            (ra, a), (rb, b) = seq[i], seq[i + 1]
            if a["arm"] == b["arm"]:
                i += 1
                continue
            files = ra["_file"] if ra is rb else f"{ra['_file']}+{rb['_file']}"
            pairs.append({"file": files, "gpu": ra.get("gpu"), "order": f"{a['arm']},{b['arm']}", "servers": f"{a['label']},{b['label']}"})
            pairs[-1].update({s["arm"]: s for s in (a, b)})
            i += 2
    return pairs


def pair_figures(p: dict, rate: str) -> dict | None:
    """One pair's :data:`PAIR_FIGURES` at ``rate``, each left out where its inputs are missing;
    None where either arm's window failed."""
    ws, wd = (next((w for w in p[arm]["windows"] if w["request_rate"] == rate), None) for arm in ARMS)
    if not (ok(ws) and ok(wd)):
        return None
    # Both arms' fixed-length spans (>= --window-s of wall time from the first arrival, idle tail
    # included) where both have them, else the harness's own windows (first request to last completion).
    fs, fd = (w.get("span") or {} for w in (ws, wd))
    use_span = fs.get("energy_j") is not None and fd.get("energy_j") is not None
    if not use_span:
        spec = "energy_j=gpu_energy_j out_tok_per_j=output_tokens_per_joule avg_power_w=gpu_avg_power_w"
        spec += " gpu_idle_share=sampler.gpu_idle_share gpu_low_power_share=sampler.gpu_low_power_share"
        fs, fd = ({**pick(w, spec), "seconds": w.get("energy_window_s") or w.get("duration")} for w in (ws, wd))
    ts, td, tps_s = fs.get("out_tok_per_j"), fd.get("out_tok_per_j"), ws.get("output_throughput")
    f = {"thr": wd["output_throughput"] / tps_s if tps_s else None, "share": fs.get("gpu_idle_share")}
    f.update(low_share=fs.get("gpu_low_power_share"), stock_tps=tps_s, def_tps=wd.get("output_throughput"), stock_tokj=ts, def_tokj=td)
    f.update(stock_w=fs.get("avg_power_w"), def_w=fd.get("avg_power_w"), span=use_span)
    if ws.get("median_ttft_ms") is not None and wd.get("median_ttft_ms") is not None:
        f["ttft_d"] = wd["median_ttft_ms"] - ws["median_ttft_ms"]
    if ws.get("p99_tpot_ms") and wd.get("p99_tpot_ms") is not None:
        f["tpot"] = wd["p99_tpot_ms"] / ws["p99_tpot_ms"]
    if ts and td:
        f["tokj"], f["saving"] = td / ts, 1.0 - ts / td
    iw_s, iw_d, e_s, win_s = idle_w(p["stock"]), idle_w(p["defaults"]), fs.get("energy_j"), fs.get("seconds")
    if None not in (f["share"], iw_s, iw_d, e_s, win_s) and e_s > 0:
        f["bound"] = f["share"] * win_s * (iw_s - iw_d) / e_s
    return f


def rates_block(pairs: list[dict]) -> list[dict]:
    rates = {w["request_rate"] for p in pairs for arm in ARMS for w in p[arm]["windows"]}
    out = []
    for rate in sorted(rates, key=lambda x: math.inf if x == "sat" else float(x)):
        figs = [f for f in (pair_figures(p, rate) for p in pairs) if f is not None]
        per = {k: [f[k] for f in figs if k in f] for k in PAIR_FIGURES}
        spans = per["span"]
        window = "mixed" if any(spans) and not all(spans) else ENERGY_WINDOWS[any(spans)]
        row: dict = {"request_rate": rate if rate == "sat" else float(rate), "pairs": len(figs), "energy_window": window}
        put_mean_ci(row, "out_tok_per_j_ratio", per["tokj"])
        row["stock_gpu_idle_share"], row["stock_gpu_low_power_share"] = mean(per["share"], 3), mean(per["low_share"], 3)
        row["idle_bound_saving"], row["energy_saving"] = bound, saving = mean(per["bound"]), mean(per["saving"])
        row["bound_attained"] = r(saving / bound) if saving is not None and bound else None
        put_mean_ci(row, "throughput_ratio", per["thr"])
        put_mean_ci(row, "p50_ttft_ms_delta", per["ttft_d"], 2)
        put_mean_ci(row, "p99_tpot_ratio", per["tpot"])
        row["per_pair"] = {k: [r(x) for x in v] for k, v in per.items()}
        for k, name in (("tps", "out_tok_s"), ("tokj", "out_tok_per_j"), ("w", "avg_w")):
            row[f"stock_{name}"], row[f"defaults_{name}"] = mean(per[f"stock_{k}"], 2), mean(per[f"def_{k}"], 2)
        out.append(row)
    return out


def idle_block(pairs: list[dict]) -> dict:
    ir = [idle_w(p["defaults"]) / idle_w(p["stock"]) for p in pairs if idle_w(p["stock"]) and idle_w(p["defaults"]) is not None]
    idle = {f"{arm}_w": mean([idle_w(p[arm]) for p in pairs], 1) for arm in ARMS}
    put_mean_ci(idle, "power_ratio", ir)
    idle["pairs"] = len(ir)
    for arm in ARMS:
        idle[f"{arm}_sm_mhz"] = [(p[arm].get("idle") or {}).get("median_sm_clock_mhz") for p in pairs]
    return idle


def starvation_block(raws: list[dict]) -> dict:
    runs, fixes = [], []
    last = None  # a fix run in a later file is compared with the latest starvation window before it
    for raw in raws:
        for s in raw["servers"]:
            if st := s.get("starvation"):
                w, j, adv = st["window"], st.get("idle_while_busy_j"), st["advise"]
                last = {"file": raw["_file"], "server": s["label"], **pick(st, "idle_while_busy_j idle_while_busy_s frontend_busy_s")}
                last["share_of_window_energy"] = j / w["gpu_energy_j"] if j is not None and w.get("gpu_energy_j") else None
                last.update(pick(st["starvation"], "how series"), warnings=st["warnings"], advise_ok=adv["ok"], advise_output=adv["output"])
                last.update(advise_cmds=[a["cmd"] for a in adv["attempts"]], fix_args=adv["fix_args"])
                last.update(pick(w, f"concurrency {WINDOW} util0_energy_j_nvml=sampler.util0_energy_j"))
                runs.append(last)
            if ok(fw := s.get("fix_window")):
                after = pick(fw, f"{WINDOW} p50_ttft_ms=median_ttft_ms p99_tpot_ms")
                before = pick(last, "out_tok_s out_tok_per_j avg_w gpu_idle_share") if last else None
                fx = {"file": raw["_file"], "server": s["label"], "fix_args": s.get("fix_args"), "fix_source": s.get("fix_source")}
                fx.update(before_from=f"{last['file']} {last['server']}" if last else None, before=before, after=after)
                for k, name in (("out_tok_s", "throughput_ratio"), ("out_tok_per_j", "out_tok_per_j_ratio")):
                    if before and before[k] and after[k]:
                        fx[name] = r(after[k] / before[k])
                fixes.append(fx)
    # The latest run whose plugin counters were found speaks for the figure, its advice and its fix
    # (an earlier run may predate the counters on /metrics).
    counted = [x for x in runs if x["idle_while_busy_j"] is not None]
    if counted:
        runs = [counted[-1], *(x for x in runs if x is not counted[-1])]
        fixes = [f for f in fixes if f["before_from"] == f"{counted[-1]['file']} {counted[-1]['server']}"] or fixes
    advice = next((x["advise_output"] for x in runs if x["advise_ok"]), None)
    nv = [x["util0_energy_j_nvml"] for x in runs if x.get("util0_energy_j_nvml") is not None]
    out = {"idle_while_busy_j": r(statistics.fmean(x["idle_while_busy_j"] for x in counted), 1) if counted else None}
    out["util0_energy_j_nvml"] = r(statistics.fmean(nv), 1) if nv else None
    out["idle_while_busy_share"] = mean([x["share_of_window_energy"] for x in runs])
    out["warning"] = next((x["warnings"][0] for x in runs if x["warnings"]), None)
    out["advice"] = advice.strip().splitlines()[:20] if advice else None
    return {**out, "after_fix": fixes[-1] if fixes else None, "runs": runs}


def checks(idle: dict, rates: list[dict], starv: dict) -> dict:
    c: dict = {"idle_power_30pct_lower": None if idle["power_ratio"] is None else idle["power_ratio"] <= 0.70}
    for row in rates:
        b, ci, att = row["idle_bound_saving"], row["out_tok_per_j_ratio_ci95"], row["bound_attained"]
        ttft, thr, tpot = row["p50_ttft_ms_delta"], row["throughput_ratio"], row["p99_tpot_ratio"]
        c[f"rate_{row['request_rate']}"] = {
            "saving_ge_80pct_of_bound": None if att is None else att >= 0.8,
            "tokj_ci_above_1_where_bound_ge_10pct": None if b is None or b < 0.10 or not ci else ci[0] > 1.0,
            "p50_ttft_le_plus_5ms": None if ttft is None else ttft <= 5.0,
            "throughput_ratio_ge_0_99": None if thr is None else thr >= 0.99,
            "p99_tpot_le_plus_5pct": None if tpot is None else tpot <= 1.05,
        }
    c["starvation_figure_and_warning"] = starv["idle_while_busy_j"] is not None and starv["warning"] is not None
    c["fix_measured"] = bool(starv["after_fix"] and starv["after_fix"].get("out_tok_per_j_ratio") is not None)
    return c


def spread(v: list[float]) -> dict | None:
    """Count, median J and p5 / p50 / p95 / max / min over the median (None below 2 values)."""
    if len(v) < 2:
        return None
    q, med = statistics.quantiles(v, n=100, method="inclusive"), statistics.median(v)
    over = (("p5", q[4]), ("p50", med), ("p95", q[94]), ("max", max(v)), ("min", min(v)))
    return {"n": len(v), "median_j": r(med), **{f"{k}_over_median": r(x / med) for k, x in over}}


def reqe_runs(s: dict) -> list[dict]:
    """A server's request-energy runs: ``reqenergy_runs`` (one per --reqe-shapes item), or the one
    ``reqenergy`` of files written before that option."""
    return list(s.get("reqenergy_runs") or ([s["reqenergy"]] if s.get("reqenergy") else []))


def request_energy(raws: list[dict], drop: float) -> dict:
    segs, traces = [], {}
    for raw, s, seg in ((raw, s, seg) for raw in raws for s in raw["servers"] for seg in reqe_runs(s)):
        lines = seg["lines"]
        js = [x["energy_j"] for x in lines if isinstance(x.get("energy_j"), (int, float))]
        k = int(len(js) * drop)
        extra: dict[str, float] = {}
        for x in lines:  # per-request parts the plugin may add (e.g. a tail share): summed by name
            for key, v in x.items():
                if key != "energy_j" and key.endswith("_j") and isinstance(v, (int, float)):
                    extra[key] = extra.get(key, 0.0) + v
        phases = seg.get("plugin_energy_j_by_phase") or {}
        req_sum, idle_j, counter, tail_j = sum(js), phases.get("idle"), seg.get("counter_j"), seg.get("tail_j")
        harness_j = seg.get("counter_harness_window_j")  # NVML counter, first request to last completion
        o = {"file": raw["_file"], "server": s["label"], "device": raw["device"].get("name"), "date_utc": raw.get("date_utc")}
        o.update(
            n_requests=seg["n"],
            lines=len(lines),
            with_energy=len(js),
            **pick(seg, "concurrency input_len output_len request_rate batch_p5_p50_p95 prompts"),
        )
        o.update({key: next((x.get(key) for x in lines), None) for key in ("source", "method")})
        # Counter phase losses over the segment (a lost phase leaves each counter jump in its tick:
        # docs/request-energy.md, placing a step); None in raw files that predate the field.
        o["counter_phase_losses"] = seg.get("counter_phase_losses")
        o["steady_rule"] = f"lines in finish order, first and last {drop:.0%} dropped"
        o.update(steady=spread(js[k : len(js) - k] if len(js) > 2 * k else js), all=spread(js), requests_sum_j=r(req_sum, 3))
        o.update(idle_j=r(idle_j, 3), plugin_total_j=r(sum(phases.values()), 3) if phases else None)
        o.update(plugin_phases_j={key: r(v, 3) for key, v in phases.items()}, counter_j=r(counter, 3))
        o["counter_harness_window_j"] = r(harness_j, 3)
        o["requests_plus_tail_over_harness_window_counter"] = ratio((req_sum, tail_j), harness_j)
        o["requests_plus_idle_over_counter"] = ratio((req_sum, idle_j), counter)
        o["requests_plus_idle_plus_tail_over_counter"] = ratio((req_sum, idle_j, tail_j), counter)
        split = {"idle_j": r(idle_j, 3), "tail_j": r(tail_j, 3), "tail_j_metrics": r(seg.get("tail_j_metrics"), 3)}
        o["tail_idle_split"] = {
            **split,
            **{key: r(v, 3) for key, v in extra.items()},
            "note": "idle_j: the plugin's idle phase over the span; tail_j: non-idle energy charged to no request (snapshot "
            "request_energy_j_tail delta; tail_j_metrics: powersave_request_tail_energy_joules_total delta); *_j: per-request parts summed",
        }
        o["checks"] = reqe_checks(o)
        o["counter_lag"] = counter_lag_of(raw, s["label"], seg, traces)
        segs.append({**o, "harness_out_tok_s": seg["harness"].get("output_throughput"), "span_s": r(seg.get("span_s"), 3)})
    return {"segments": segs, "bursts": bursts_block(raws)}


def bursts_block(raws: list[dict]) -> list[dict]:
    """Per server with a ``bursts`` segment: the plugin's busy joules of each prefill burst over the
    counter's (less idle power outside the burst), their spread, and the cross-check gauge."""
    out = []
    for raw, s in ((raw, s) for raw in raws for s in raw["servers"] if s.get("bursts")):
        b = s["bursts"]
        ratios = [x["busy_over_truth"] for x in b["runs"] if x.get("busy_over_truth") is not None]
        o = {"file": raw["_file"], "server": s["label"], "date_utc": raw.get("date_utc"), **pick(b, "n conc input_len idle_w")}
        o["method"] = b.get("method") or "deep-idle baseline"  # before the null-request control: idle power outside the burst
        o.update(busy_over_truth=spread_plain(ratios), crosscheck=b.get("crosscheck"))
        o["within_5pct"] = None if not ratios else all(abs(x - 1.0) <= 0.05 for x in ratios)
        if b.get("lease") or raw.get("_lease"):
            o["lease"] = b.get("lease") or raw["_lease"]
        # The phase-energy truth (burst_pair_figures): recomputed from the spans, so older raw files get it too.
        pairs = judge_bursts([x for x in b["runs"] if "burst" in x and "null" in x], b.get("idle_w"))
        phase = [x["phase_over_truth"] for x in pairs if x.get("phase_over_truth") is not None]
        o["truth_method"] = sorted({x["truth_method"] for x in pairs if x.get("truth_method")})
        o["phase_over_truth"] = spread_plain(phase)
        o["phase_over_truth_runs"] = [r(x) for x in phase]
        to_idle = [x["phase_over_truth_to_idle"] for x in pairs if x.get("phase_over_truth_to_idle") is not None]
        o["phase_over_truth_to_idle"] = spread_plain(to_idle)
        o["plugin_phase_j"] = spread_plain([x["plugin_phase_j"] for x in pairs if x.get("plugin_phase_j") is not None])
        o["not_judged"] = [n for x in pairs if (n := x.get("note") or (x.get("cut") or {}).get("note"))]
        o["phase_within_5pct"] = None if not phase else all(abs(x - 1.0) <= 0.05 for x in phase)
        out.append(o)
    return out


def spread_plain(v: list[float]) -> dict | None:
    return {"n": len(v), "median": r(statistics.median(v)), "min": r(min(v)), "max": r(max(v))} if v else None


def reqe_checks(o: dict) -> dict[str, bool | None]:
    """The request-energy targets (docs/request-energy.md): the steady spread around the median, and
    requests + idle + tail against the counter within 1 % (None where a figure is missing)."""
    st, total = o.get("steady") or {}, o.get("requests_plus_idle_plus_tail_over_counter")

    def at_most(x: Any, bound: float) -> bool | None:
        return None if x is None else x <= bound

    p5 = st.get("p5_over_median")
    return {
        "p5_ge_0_90": None if p5 is None else p5 >= 0.90,
        "p95_le_1_10": at_most(st.get("p95_over_median"), 1.10),
        "max_le_1_30": at_most(st.get("max_over_median"), 1.30),
        "sum_within_1pct": None if total is None else abs(total - 1.0) <= 0.01,
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
    cis = [x["out_tok_per_j_ratio_ci95"] or [y, y] for x, y in zip(rows, ys)]
    yerr = [[y - ci[0] for y, ci in zip(ys, cis)], [ci[1] - y for y, ci in zip(ys, cis)]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.errorbar(xs, ys, yerr=yerr, fmt="o-", capsize=4, label="defaults / stock (mean, 95 % CI over pairs)")
    bound = [(x, 1 / (1 - b)) for x, b in zip(xs, (row["idle_bound_saving"] for row in rows)) if b is not None and b < 1]
    if bound:
        ax.plot(*zip(*bound), "s--", color="gray", label="idle-power bound (stock idle s x idle W difference)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(["sat" if row["request_rate"] == "sat" else f"{row['request_rate']:g}" for row in rows])
    ax.set(xlabel="Poisson request rate (req/s)", ylabel="output tokens per joule ratio")
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


def write(path: Path, rec: dict, md: list[str], keep_from: str | None = None) -> None:
    """The record ``path`` (JSON) and its Markdown twin beside it; the twin's hand-written part,
    from the heading ``keep_from`` on, survives a rebuild (:func:`benchmarks.lib.device.write_record`)."""
    text = "\n".join(md) + "\n"
    write_record(path.parent, path.stem, rec, text + "\n" if keep_from else text, keep_from)


def defaults_record(raws: list[dict]) -> dict:
    measured, pairs = all(x.get("measured") for x in raws), pair_servers(raws)
    idle, rates, starv = idle_block(pairs), rates_block(pairs), starvation_block(raws)
    rec = {"what": "stock vLLM vs --plugin powersave with its defaults (no setting), one server at a time, ABBA", "measured": measured}
    rec["simulated"] = False
    rec["energy"] = "NVML total-energy counter per load window" if measured else "unavailable (no NVML): energy figures are null"
    rec["devices"] = sorted({x["device"].get("name", "?") for x in raws})
    rec["vllm_versions"] = sorted({str(x.get("vllm_version")) for x in raws})
    rec["shapes"] = sorted({str(x.get("shape") or x.get("model")) for x in raws})
    rec["runs"] = [
        {"file": x["_file"], **pick(x, "tag gpu date_utc"), "order": x["method"]["order"], "notes": x.get("notes")} for x in raws
    ]
    rec.update(method=raws[0]["method"], pairs=len(pairs), pair_list=[pick(p, "file gpu order servers") for p in pairs])
    rec.update(idle=idle, rates=rates, starvation=starv, checks=checks(idle, rates, starv))
    rec["startup_s"] = {a: [s.get("startup_s") for x in raws for s in x["servers"] if s["arm"] == a] for a in ("stock", "defaults", "fix")}
    return {**rec, "scripts": SCRIPTS, "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def defaults_md(rec: dict, label: str, png: str | None) -> list[str]:
    idle, starv, m, fx = rec["idle"], rec["starvation"], rec["method"], rec["starvation"]["after_fix"]
    md = [
        f"# Stock vLLM vs `--plugin powersave` defaults ({label})\n",
        f"- Device(s): {', '.join(rec['devices'])}; vLLM {', '.join(rec['vllm_versions'])}; model {', '.join(rec['shapes'])} (`--load-format dummy`).",
        "- Runs (UTC): " + "; ".join(f"{x['tag']} GPU {x['gpu']} {x['date_utc']} order {','.join(x['order'])}" for x in rec["runs"]) + ".",
        f"- Method: one server at a time; stock = vLLM alone (no plugin on the path, or `VLLM_PLUGINS=` empty); defaults = "
        f"`--plugin powersave` with no saving setting (observation only: {m.get('defaults_observe')}). Per server: "
        f"{m.get('idle_s')} s idle, then Poisson windows of {m.get('window_s')} s of request starts at "
        f"{', '.join(m.get('rates') or [])} req/s ({m.get('input_len')} in / {m.get('output_len')} out, streamed, "
        f"same seeds in both arms). Energy: {rec['energy']}. GPU idle share: {m.get('gpu_idle_share')}. Clocks never changed.",
        f"- Pairs: **{rec['pairs']}** (adjacent stock/defaults servers on one GPU: "
        + ", ".join(f"{p['file']} GPU {p['gpu']} {p['servers']}" for p in rec["pair_list"])
        + ").",
        "\n## Idle, engine loaded\n",
        "| stock W | defaults W | ratio (95 % CI) | pairs |\n|---|---|---|---|",
        f"| {fmt(idle['stock_w'], 1)} | {fmt(idle['defaults_w'], 1)} | {fmt(idle['power_ratio'])} ({fmt(idle['power_ratio_ci95'])}) | {idle['pairs']} |",
        "\n## Request-rate sweep (defaults / stock per pair)\n",
        "| req/s | pairs | stock GPU idle share | idle bound | energy saving | tok/J ratio (95 % CI) | throughput ratio | p50 TTFT Δ ms | "
        "p99 TPOT ratio | stock / defaults tok/s | stock / defaults tok/J |\n|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rec["rates"]:
        md.append(
            f"| {x['request_rate']} | {x['pairs']} | {fmt(x['stock_gpu_idle_share'], 2)} | {fmt(x['idle_bound_saving'])} | "
            f"{fmt(x['energy_saving'])} | {fmt(x['out_tok_per_j_ratio'])} ({fmt(x['out_tok_per_j_ratio_ci95'])}) | "
            f"{fmt(x['throughput_ratio'])} | {fmt(x['p50_ttft_ms_delta'], 2)} | {fmt(x['p99_tpot_ratio'])} | "
            f"{fmt(x['stock_out_tok_s'], 0)} / {fmt(x['defaults_out_tok_s'], 0)} | {fmt(x['stock_out_tok_per_j'])} / {fmt(x['defaults_out_tok_per_j'])} |"
        )
    md += [
        "\nEnergy window per rate: " + "; ".join(f"{x['request_rate']}: {x['energy_window']}" for x in rec["rates"]) + ".",
        "Idle bound = stock's idle seconds in the window x (stock idle W - defaults idle W) / stock's window energy.",
        *([f"\n![tokens per joule ratio vs request rate]({png})"] if png else []),
        "\n## Starvation: one API server at high concurrency\n",
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
        "\n## Checks against the targets\n",
        f"```\n{json.dumps(rec['checks'], indent=1)}\n```",
    ]
    return md


def _losses(n: float | None) -> str:
    """The counter phase losses of a segment, where recorded."""
    return "" if n is None else f", {int(n)} phase loss{'' if n == 1 else 'es'}"


def newest_line(segments: list[dict]) -> str:
    """The newest run's segments against the targets (:func:`reqe_checks`), one line for the top."""
    if not segments:
        return "- Newest run: none recorded.\n"
    newest = [s for s in segments if s["file"] == segments[-1]["file"]]
    checks = [c for s in newest for c in (s.get("checks") or {}).values()]
    verdict = "all met" if checks and all(c is True for c in checks) else "not all met"
    shapes = ", ".join(f"{s.get('input_len')}/{s.get('output_len')}" for s in newest)
    lags = [
        f"{s.get('input_len')}/{s.get('output_len')} {g['best_lag_ms']:+d} ms (R² {g['r2_best']:.3f} against {g['r2_at_0']:.3f} at 0 ms)"
        for s in newest
        if (g := s.get("counter_lag"))
    ]
    lag_note = f" Counter periods fit the steps' work best at (`benchmarks/counter_lag.py`): {', '.join(lags)}." if lags else ""
    return (
        f"- Newest run: {newest[0]['file']} ({newest[0].get('device') or 'device not recorded'}, {newest[0].get('date_utc') or 'date not recorded'}), "
        f"{len(newest)} segment(s) ({shapes}): p5 >= 0.90, p95 <= 1.10, max <= 1.30 over the median and requests + idle + tail within "
        f"1 % of the counter: {verdict} (`checks` in each segment of the JSON twin).{lag_note}\n"
    )


def request_energy_md(reqe: dict, title: str, drop: float) -> list[str]:
    md = [
        f"# Per-request energy of identical requests at a steady batch ({title})\n",
        "- Requests of equal length (distinct random prompts, no prefix-cache hits, `ignore_eos`) at a fixed concurrency through "
        "the defaults server; the plugin's per-request lines (`requests-rank<N>.jsonl`) against the NVML counter over the "
        f"same span (plugin snapshot to snapshot). Steady batch: lines in finish order, first and last {drop:.0%} dropped.\n",
        newest_line(reqe["segments"]),
        "| run | device | source / method | n (steady) | median J | p5 / p50 / p95 / max over median | requests + idle (+ tail) over counter | requests J | "
        "idle J | counter J | other parts J |\n|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in reqe["segments"]:
        st = s["steady"] or {}
        other = {k: v for k, v in s["tail_idle_split"].items() if k not in ("idle_j", "note") and v is not None}
        md.append(
            f"| {s['file']} {s['server']} {s.get('input_len')}/{s.get('output_len')} @ {s.get('request_rate')} req/s | {s.get('device') or '–'} | {s['source']} / {s['method']}{_losses(s.get('counter_phase_losses'))} | {st.get('n')} | {fmt(st.get('median_j'))} | {fmt(st.get('p5_over_median'))} / 1 / "
            f"{fmt(st.get('p95_over_median'))} / {fmt(st.get('max_over_median'))} | {fmt(s['requests_plus_idle_over_counter'], 4)} ({fmt(s.get('requests_plus_idle_plus_tail_over_counter'), 4)}) | "
            f"{fmt(s['requests_sum_j'], 1)} | {fmt(s['idle_j'], 1)} | {fmt(s['counter_j'], 1)} | {json.dumps(other) if other else '–'} |"
        )
    for b in reqe.get("bursts") or []:
        md.append(
            f"\nPrefill bursts between idle spells ({b['file']} {b['server']}: {b['n']} bursts of {b['conc']} x {b['input_len']} "
            f"prompt tokens; {BURST_TRUTH[b.get('method', 'deep-idle baseline')]}): the plugin's busy J over the truth {json.dumps(b['busy_over_truth'])}; "
            f"all within 5 %: {b['within_5pct']}; against the phase-energy truth (the burst's own booking over the difference plus "
            f"the power displaced by its extra busy time; {', '.join(b.get('truth_method') or ['spans to deep idle'])}) "
            f"{json.dumps(b.get('phase_over_truth'))}, all within 5 %: {b.get('phase_within_5pct')}; the plugin's burst booking "
            f"{json.dumps(b.get('plugin_phase_j'))} J; not judged: {b.get('not_judged') or 'none'}; "
            f"cross-check gauge {json.dumps(b['crosscheck'])}."
        )
    return md


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", nargs="+")
    ap.add_argument("--out-dir", default="docs/results")
    ap.add_argument("--name", default="h200-defaults")
    ap.add_argument("--reqe-name", default="h200-request-energy")
    ap.add_argument("--reqe-only", action="store_true", help="write only the request-energy record, its older segments kept before the new")
    ap.add_argument("--steady-drop", type=float, default=0.2, help="share of request lines dropped at each end (480 -> middle 288)")
    ap.add_argument("--lease", help='the machine and lease the raw files came from, e.g. "H200, 2026-12-06 03:21Z"')
    ns = ap.parse_args(argv)
    raws = [load(p) for p in ns.raw]
    for x in raws if ns.lease else ():
        x["_lease"] = ns.lease
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    measured = all(x.get("measured") for x in raws)
    label = "measured" if measured else "NOT measured: no NVML (CPU smoke test), energy null"
    if not ns.reqe_only:
        rec = defaults_record(raws)
        png = out / f"{ns.name}.png"
        has_png = plot(rec["rates"], png, f"{', '.join(rec['devices'])}: --plugin powersave defaults vs stock ({rec['pairs']} pairs)")
        write(out / f"{ns.name}.json", rec, defaults_md(rec, label, png.name if has_png else None))
        print(f"wrote {out}/{ns.name}.json/.md{'/.png' if has_png else ''} ({rec['pairs']} pairs)")
    devices = sorted({x["device"].get("name", "?") for x in raws})
    common = {"devices": devices, "scripts": SCRIPTS, "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    reqe = request_energy(raws, ns.steady_drop)
    older = out / f"{ns.reqe_name}.json"
    if ns.reqe_only and older.exists():  # newest last; a file rebuilt replaces its own older segments
        files = {seg["file"] for seg in reqe["segments"]}
        kept = [seg for seg in json.loads(older.read_text()).get("segments", []) if seg.get("file") not in files]
        reqe["segments"] = kept + reqe["segments"]
        files = {b["file"] for b in reqe["bursts"]}
        reqe["bursts"] = [b for b in json.loads(older.read_text()).get("bursts", []) if b.get("file") not in files] + reqe["bursts"]
    sim = any(seg.get("source") == "simulated" for seg in reqe["segments"])
    reqe.update(what=REQE_WHAT, measured=measured and not sim, simulated=sim, **common)
    # The record keeps older files' segments: its devices are all of theirs, not only this call's.
    reqe["devices"] = sorted({*devices, *(seg["device"] for seg in reqe["segments"] if seg.get("device"))})
    md = request_energy_md(reqe, f"{'simulated per-request figures; ' if sim else ''}{label}", ns.steady_drop)
    write(out / f"{ns.reqe_name}.json", reqe, md, keep_from=REQE_KEEP_FROM)
    print(f"wrote {out}/{ns.reqe_name}.json/.md ({len(reqe['segments'])} segment(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
