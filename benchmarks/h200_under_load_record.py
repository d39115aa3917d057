"""The under-load record from ``benchmarks/h200_under_load.py`` raw files: stock vs the plugin's defaults.

``python -m benchmarks.h200_under_load_record [NAME=]RAW.json... [--rates [NAME=]DEFAULTS.json...] [--out-dir docs/results]``
writes ``h200-under-load.{json,md,png}``. Each pair's ratios are defaults / stock (throughput, J per
output token, p99 TPOT) and its TTFT figure is the p50 difference (ms); a load's figure is the mean
over its pairs with a Student-t 95 % interval (lib.stats). Pairs are kept as the raw files hold them
(ABBA order inside each file); NAME names the device lease each file ran in. Pairs of other arms
than stock and defaults (``--arms`` ablations) go to ``ablations``; ``--rates`` files add the
Poisson-rate loads; ``--merge`` keeps what the committed record holds and these files do not rebuild
(raw files stay out of git, so a later lease adds to the record this way).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import h200_defaults_record as defaults_record
from benchmarks.lib import stats
from benchmarks.lib.cli import one_line_errors
from benchmarks.lib.device import write_record

#: Record name of each load point of the raw files, with its kind and closed-loop concurrency.
LOADS = {
    "c64": dict(name="c64-streamed-512-256", kind="saturation", concurrency=64),
    "c256": dict(name="c256-streamed-128-128", kind="saturation", concurrency=256),
    "c16": dict(name="c16-streamed-512-256", kind="saturation", concurrency=16),
}
#: Loads the issue asks for that no raw file here holds yet (they need one server at a time: the
#: side-by-side job keeps a CUDA context up, which hides perf boost's idle saving).
#: The twin's hand-written part starts at this heading and survives a rebuild.
KEEP_FROM = "## Reading"
PLANNED = ["rate 0.5 req/s", "rate 2 req/s", "rate 8 req/s"]


def _ratio(d: dict, s: dict, key: str) -> float | None:
    a, b = d.get(key), s.get(key)
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def arms_of(p: dict) -> tuple[str, str]:
    """(reference, variant) of a pair; files from before ``--arms`` hold stock and defaults."""
    ref, variant = p.get("arms") or ("stock", "defaults")
    return ref, variant


def pair_figures(p: dict) -> dict[str, float | None]:
    """One pair's figures: variant (defaults) over reference (stock), and the p50 TTFT difference
    (variant - reference, ms)."""
    s, d = (p[a] for a in arms_of(p))
    ttft = d.get("median_ttft_ms"), s.get("median_ttft_ms")
    return {
        "throughput_ratio": _ratio(d, s, "output_throughput"),
        "j_per_out_token_ratio": _ratio(d, s, "gpu_energy_per_output_token_j"),
        "p99_tpot_ratio": _ratio(d, s, "p99_tpot_ms"),
        "p50_ttft_delta_ms": ttft[0] - ttft[1] if None not in ttft else None,
    }


#: Pairs a ``loads`` entry needs (the record's contract: 6 adjacent pairs at a saturation point,
#: 3 at a rate); an entry with fewer goes to ``probes``, shown but claiming nothing.
MIN_PAIRS = {"saturation": 6, "rate": 3}


def split_probes(entries: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(loads, probes)``: entries with the pairs their kind needs (:data:`MIN_PAIRS`), and the rest."""
    enough = [e for e in entries if e.get("pairs", 0) >= MIN_PAIRS.get(e.get("kind"), 3)]
    return enough, [e for e in entries if e not in enough]


def mean_ci(xs: list[float | None], nd: int = 4) -> dict[str, Any]:
    """``{"mean", "ci95"}`` over the finite values, rounded (no interval below 2 values)."""
    m, ci = stats.mean_ci(xs)
    return {"mean": None if m is None else round(m, nd), "ci95": None if ci is None else [round(x, nd) for x in ci]}


def _arm_mean(pairs: list[dict], arm: str, key: str) -> float | None:
    return mean_ci([p[arm].get(key) for p in pairs], 2)["mean"]


def load_entry(point: str, pairs: list[dict]) -> dict:
    """One ``loads`` (or ``ablations``) entry: the issue's fields, each arm's means, and the pairs."""
    figs = [pair_figures(p) for p in pairs]
    ref, variant = arms_of(pairs[0])
    entry: dict[str, Any] = {**LOADS[point], "pairs": len(pairs)}
    if (ref, variant) != ("stock", "defaults"):
        entry.update(name=f"{LOADS[point]['name']}-{variant}", reference=ref, variant=variant, settings=pairs[0].get("settings"))
    entry["api_server_count_stock"] = max((p[ref].get("api_servers") or 1 for p in pairs), default=1)
    entry["api_server_count_defaults"] = max((p[variant].get("api_servers") or 1 for p in pairs), default=1)
    for k in ("throughput_ratio", "j_per_out_token_ratio", "p99_tpot_ratio"):
        entry[k] = mean_ci([f[k] for f in figs])
    entry["p50_ttft_delta_ms"] = mean_ci([f["p50_ttft_delta_ms"] for f in figs], 2)
    # Stock vLLM publishes no starvation counter (the plugin's powersave_idle_while_busy_*): null.
    entry["starvation_j"] = {arm: _arm_mean(pairs, arm, "idle_while_busy_j") for arm in (ref, variant)}
    entry["arms"] = {
        arm: {k: _arm_mean(pairs, arm, k) for k in ("output_throughput", "gpu_energy_per_output_token_j", "p99_tpot_ms", "median_itl_ms")}
        for arm in (ref, variant)
    }
    entry["device"] = _devices(pairs)
    entry["pair_list"] = [
        {
            "lease": p.get("lease"),
            "device": p.get("device"),
            "order": p["order"],
            "started_utc": p[p["order"][0]].get("started_utc"),
            **{k: stats.rounded(v) for k, v in f.items()},
        }
        for p, f in zip(pairs, figs)
    ]
    return entry


def _devices(pairs: list[dict]) -> str | None:
    """The device names the pairs ran on, joined (one name where all ran on one kind)."""
    names = [str(p["device"]) for p in pairs if p.get("device")]
    return " + ".join(dict.fromkeys(names)) or None


def build(raws: list[dict], rate_raws: list[dict] | None = None) -> dict:
    """The record from raw files (each with its ``lease`` name set): ``raws`` of this job, and
    ``rate_raws`` of ``h200_defaults.py`` (Poisson rates, one server at a time)."""
    by_point: dict[tuple[str, str, str], list[dict]] = {}
    for raw in raws:
        for p in raw["pairs"]:
            ref, variant = arms_of(p)
            if p.get(ref) and p.get(variant):
                settings = (raw.get("arms") or {}).get(variant)
                by_point.setdefault((p["point"], ref, variant), []).append(
                    {**p, "lease": raw.get("lease"), "settings": settings, "device": (raw.get("device") or {}).get("name")}
                )
    dev = next((r.get("device") for r in raws if r.get("device")), {})
    main_loads = [load_entry(k[0], ps) for k, ps in by_point.items() if k[1:] == ("stock", "defaults")]
    rate_loads, rate_ablations = rate_loads_and_ablations(rate_raws or [])
    loads, probes = split_probes(main_loads + rate_loads)
    measured_rates = {f"rate {e['rate']:g} req/s" for e in loads + probes if e["kind"] == "rate"}
    return {
        "name": "h200-under-load",
        "measured": True,
        "what": "stock vLLM 0.25 vs vllm serve --plugin powersave (defaults), side by side on one GPU at a time (each load "
        "names its device), through the OpenAI server and loadtests (streamed, local NVML counter, /metrics scraped at the "
        "window edges for both arms)",
        "device": dev,
        "shape": raws[0].get("shape") if raws else None,
        "serve_args": raws[0].get("serve_args") if raws else None,
        "runs": [
            {
                "lease": r.get("lease"),
                "tag": r.get("tag"),
                "started_utc": r.get("started_utc") or r.get("date_utc"),
                "ended_utc": r.get("ended_utc"),
                "device": (r.get("device") or {}).get("name"),
            }
            for r in [*raws, *(rate_raws or [])]
        ],
        "loads": loads,
        "probes": probes,
        "ablations": [load_entry(k[0], ps) for k, ps in by_point.items() if k[1:] != ("stock", "defaults")] + rate_ablations,
        "not_yet_measured": [x for x in PLANNED if x not in measured_rates],
    }


def rate_loads_and_ablations(rate_raws: list[dict]) -> tuple[list[dict], list[dict]]:
    """Rate ``loads`` from the files whose defaults arm ran the product's defaults, and rate
    ``ablations`` (one entry per rate and ``--defaults-settings`` object) from the files whose
    defaults arm ran with settings on top: an ablation is never averaged into a load."""
    groups: dict[str, list[dict]] = {}
    for raw in (part for r in rate_raws for part in split_ablation_arm(r)):
        settings = (raw.get("method") or {}).get("defaults_settings") or {}
        groups.setdefault(json.dumps(settings, sort_keys=True) if settings else "", []).append(raw)
    loads = rate_entries(groups.pop("", []))
    ablations = []
    for key, raws in groups.items():
        settings = json.loads(key)
        slug = ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
        for e in rate_entries(raws):
            ablations.append({**e, "name": f"{e['name']}-{slug}", "reference": "stock", "variant": "defaults", "settings": settings})
    return loads, ablations


def split_ablation_arm(raw: dict) -> list[dict]:
    """A file whose order ran an ``ablation`` arm beside plain ``defaults`` servers, as two files:
    the defaults servers with the stock servers run next to them, and the ablation servers (named
    defaults, their settings as the file's ``defaults_settings``) with theirs, so that each pair
    stays adjacent in time (S D A S pairs S-D and A-S). An arm server with no stock server beside it
    (S A D, where the call's time limit cut the trailing stock) takes the one two places away, with
    only the other arm's server between: a stock server may then be the reference of both
    comparisons, never of two pairs in one. Other files are returned as they are."""
    servers = raw.get("servers") or []
    if not any(s.get("arm") == "ablation" for s in servers):
        return [raw]
    method = raw.get("method") or {}

    def is_stock(j: int) -> bool:
        return 0 <= j < len(servers) and servers[j].get("arm") == "stock"

    def beside(arm: str) -> list[dict]:  # the arm's servers and the stock servers nearest to each
        near: set[int] = set()
        for i in (i for i, s in enumerate(servers) if s.get("arm") == arm):
            adjacent = {j for j in (i - 1, i + 1) if is_stock(j)}
            near |= adjacent or {next((j for j in (i - 2, i + 2) if is_stock(j)), -1)}
        return [s for i, s in enumerate(servers) if s.get("arm") == arm or i in near]

    plain = {**raw, "method": {**method, "defaults_settings": {}}, "servers": beside("defaults")}
    abl_servers = [{**s, "arm": "defaults"} if s.get("arm") == "ablation" else s for s in beside("ablation")]
    return [plain, {**raw, "_file": f"{raw['_file']}#ablation", "servers": abl_servers}]


def rate_entries(rate_raws: list[dict]) -> list[dict]:
    """``loads`` entries from ``h200_defaults.py`` raw files (each with ``lease`` and ``_file``
    set): that job's adjacent stock/defaults servers and their pair figures per window
    (``h200_defaults_record``), under this record's names. Poisson windows make entries of kind
    ``rate``; closed-loop windows (``sat``) entries of kind ``saturation`` named for their
    concurrency and lengths with ``one-server``: one server on the GPU at a time, full GPU
    memory, so perf boost's idle behaviour shows, unlike the side-by-side saturation rows. J per
    output token is the inverse of tokens per joule (over the fixed span where both arms have one)."""
    by_file = {r["_file"]: r for r in rate_raws}
    by_lease: dict[str, list[dict]] = {}
    for r in rate_raws:  # servers of different leases never ran next to each other: pair within one
        by_lease.setdefault(str(r.get("lease")), []).append(r)
    pairs = []
    for p in (p for group in by_lease.values() for p in defaults_record.pair_servers(group)):
        raws_of = [by_file.get(f) or {} for f in p["file"].split("+")]
        devices = list(dict.fromkeys(name for r in raws_of if (name := (r.get("device") or {}).get("name"))))
        if len(devices) > 1:
            continue  # a stock server on one GPU against a defaults server on another is no pair
        p["lease"] = "+".join(dict.fromkeys(str(r.get("lease")) for r in raws_of))
        p["device"] = devices[0] if devices else None
        pairs.append(p)
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for p in pairs:
        method = (by_file.get(p["file"].split("+")[0]) or {}).get("method") or {}
        for rate in {w["request_rate"] for a in ("stock", "defaults") for w in p[a]["windows"]}:
            if (f := defaults_record.pair_figures(p, rate)) is not None:
                groups.setdefault(_window_key(rate, method), []).append((p, f))
    return [_entry(key, both, by_file) for key, both in sorted(groups.items(), key=lambda kv: (kv[0][0] == "saturation", kv[0][1:]))]


def _window_key(rate: str, method: dict) -> tuple:
    """The entry a window belongs to: ``("rate", rate)``, or ``("saturation", concurrency,
    input, output)`` for a closed-loop window (the defaults of ``h200_defaults.py`` where the file
    does not say)."""
    if rate != "sat":
        return ("rate", float(rate))
    return (
        "saturation",
        int(method.get("sat_concurrency") or 64),
        int(method.get("input_len") or 512),
        int(method.get("output_len") or 256),
    )


def _window_starvation_j(both: list[tuple[dict, dict]], methods: list[dict], arm: str, key: tuple) -> float | None:
    """Mean idle-while-busy joules of ``arm``'s windows that make entry ``key`` (:func:`_window_key`
    with each pair's method): the plugin's starvation counter as the harness read it at each
    window's edges. None where no window holds it: stock publishes no such counter, and windows
    recorded before it was kept lack it."""
    found = [
        w.get("gpu_idle_while_busy_energy_j")
        for (p, _), method in zip(both, methods)
        for w in p[arm]["windows"]
        if _window_key(w["request_rate"], method) == key
    ]
    return mean_ci(found, 2)["mean"]


def _entry(key: tuple, both: list[tuple[dict, dict]], by_file: dict) -> dict:
    """One ``loads`` entry from its pairs' figures (:func:`rate_entries`)."""
    figs = [f for _, f in both]
    if key[0] == "rate":
        entry: dict[str, Any] = {"name": f"rate-{key[1]:g}", "kind": "rate", "rate": key[1], "pairs": len(figs)}
    else:
        _, conc, n_in, n_out = key
        entry = {"name": f"c{conc}-one-server-{n_in}-{n_out}", "kind": "saturation", "concurrency": conc, "pairs": len(figs)}
    entry["api_server_count_stock"] = max((p["stock"].get("api_servers") or 1 for p, _ in both), default=1)
    entry["api_server_count_defaults"] = max((p["defaults"].get("api_servers") or 1 for p, _ in both), default=1)
    entry["throughput_ratio"] = mean_ci([f.get("thr") for f in figs])
    entry["j_per_out_token_ratio"] = mean_ci([1.0 / f["tokj"] if f.get("tokj") else None for f in figs])
    entry["p99_tpot_ratio"] = mean_ci([f.get("tpot") for f in figs])
    entry["p50_ttft_delta_ms"] = mean_ci([f.get("ttft_d") for f in figs], 2)
    methods = [(by_file.get(p["file"].split("+")[0]) or {}).get("method") or {} for p, _ in both]
    entry["starvation_j"] = {arm: _window_starvation_j(both, methods, arm, key) for arm in ("stock", "defaults")}
    entry["energy_window"] = "fixed span" if all(f.get("span") for f in figs) else "harness window"
    entry["device"] = _devices([p for p, _ in both])
    entry["serve_args"] = next((m.get("serve_args") for m in methods if m.get("serve_args")), None)
    # The defaults arm of h200_defaults.py may turn on observation settings (step trace,
    # per-request energy) beside the defaults: the record says which, since they are not free.
    entry["defaults_observe"] = sorted({m.get("defaults_observe") or "none" for m in methods})
    entry["pair_list"] = [
        {
            "lease": p.get("lease"),
            "device": p.get("device"),
            "file": p["file"],
            "order": p["order"].split(","),
            **{k: stats.rounded(f.get(k)) for k in ("thr", "tokj", "tpot", "ttft_d")},
        }
        for p, f in both
    ]
    return entry


def merge(old: dict, new: dict) -> dict:
    """``new`` with what of ``old`` it does not rebuild: loads and ablations by name, runs by lease
    and tag, the product comparison; ``not_yet_measured`` less what either measured. Raw files stay
    out of git, so a later lease adds to the committed record this way."""
    out = dict(new)
    old_dev = (old.get("device") or {}).get("name")
    # A rebuilt entry replaces the old one of its name, except that a probe never replaces a load:
    # its few pairs would drop the load's claim (the raw files behind the load stay out of git).
    new_loads, new_probes = ({e["name"] for e in new.get(k, [])} for k in ("loads", "probes"))
    replaced = {"loads": new_loads, "probes": new_loads | new_probes, "ablations": {e["name"] for e in new.get("ablations", [])}}
    for key, names in replaced.items():
        kept = [{**e, "device": e.get("device") or old_dev} for e in old.get(key, []) if e["name"] not in names]
        out[key] = kept + new.get(key, [])
    out["loads"], short = split_probes(out["loads"])
    out["probes"] = out["probes"] + short
    seen = {(r.get("lease"), r.get("tag")) for r in new["runs"]}
    kept_runs = [{**r, "device": r.get("device") or old_dev} for r in old.get("runs", []) if (r.get("lease"), r.get("tag")) not in seen]
    out["runs"] = kept_runs + new["runs"]
    out["product_compare"] = new.get("product_compare") or old.get("product_compare")
    for k in ("device", "shape", "serve_args"):
        out[k] = new.get(k) or old.get(k)
    measured = {f"rate {e['rate']:g} req/s" for e in out["loads"] + out["probes"] if e.get("kind") == "rate"}
    out["not_yet_measured"] = [x for x in PLANNED if x not in measured]
    return {k: v for k, v in out.items() if v is not None}


def product_compare(cmp: dict, lease: str) -> dict:
    """The product's own ``vllm-powersave compare`` (one adjacent off/on pair): its ratios, as a check
    that the benchmark's side-by-side servers measure what a user's run measures."""
    res = cmp["results"]
    off, on = res["off"], res["on"]
    pair = {"stock": off, "defaults": on}
    figs = pair_figures(pair)
    return {
        "lease": lease,
        "command": "vllm-powersave compare --rates inf --concurrency 64 --input-len 512 --output-len 256 --num-prompts 400 --order off,on",
        "api_servers": {"stock": off.get("api_server_count"), "defaults": on.get("api_server_count")},
        **{k: stats.rounded(v) for k, v in figs.items()},
        "output_throughput": {"stock": stats.rounded(off.get("output_throughput")), "defaults": stats.rounded(on.get("output_throughput"))},
        "median_itl_ms": {"stock": stats.rounded(off.get("median_itl_ms")), "defaults": stats.rounded(on.get("median_itl_ms"))},
    }


def _fmt(ci: dict, nd: int = 3) -> str:
    if ci["mean"] is None:
        return "n/a"
    if ci["ci95"] is None:
        return f"{ci['mean']:.{nd}f} (one pair)"
    return f"{ci['mean']:.{nd}f} ({ci['ci95'][0]:.{nd}f}–{ci['ci95'][1]:.{nd}f})"


def _rate_notes(rec: dict) -> list[str]:
    """One line on how the rate loads ran: serve flags and any observation settings of the defaults arm."""
    rates = [e for e in rec["loads"] + rec.get("probes", []) if e.get("kind") == "rate" and "defaults_observe" in e]
    if not rates:
        return []
    observe = sorted({x for e in rates for x in e["defaults_observe"]})
    serve = sorted({str(e.get("serve_args") or "?") for e in rates})
    return [
        f"Rate loads: `benchmarks/h200_defaults.py`, one server at a time, serve flags `{'`, `'.join(serve)}`; the defaults "
        f"arm's observation settings: {', '.join(observe)} (`--defaults-observe`; trace = step trace, reqenergy = per-request energy).",
        "",
    ]


def markdown(rec: dict, png: str | None) -> str:
    rows = [
        f"| {e['name']} | {e.get('device') or '?'} | {e['pairs']} | {e['api_server_count_stock']} / {e['api_server_count_defaults']} | {_fmt(e['throughput_ratio'])} | "
        f"{_fmt(e['j_per_out_token_ratio'])} | {_fmt(e['p99_tpot_ratio'])} | {_fmt(e['p50_ttft_delta_ms'], 1)} | "
        f"{e['starvation_j']['defaults'] if e['starvation_j']['defaults'] is not None else 'n/a'} |"
        for e in rec["loads"]
    ]
    runs = "; ".join(
        f"{r['lease']} ({r.get('device') or '?'}): {r.get('started_utc') or '?'}" + (f" to {r['ended_utc']}" if r.get("ended_utc") else "")
        for r in rec["runs"]
    )
    devices = ", ".join(dict.fromkeys(str(e.get("device")) for e in rec["loads"] if e.get("device"))) or rec["device"].get("name", "?")
    lines = [
        "# Under load on Hopper GPUs: stock vLLM vs the plugin's defaults (measured)",
        "",
        f"What ran: {rec['what']}. Model: {rec.get('shape') or '?'} shape, dummy weights; serve flags `{rec.get('serve_args') or '?'}`. "
        f"Devices: {devices} (each load's in its row; compare ratios within a load, not across devices). "
        f"Leases and times (UTC): {runs}. Clocks were never changed "
        "(POWERSAVE_FORCE_DRY_RUN=1: the closed loop ran dry).",
        "",
        "Ratios are defaults / stock per adjacent pair (ABBA order), mean and Student-t 95 % interval over pairs; "
        "TTFT is the p50 difference in ms. Starvation: the plugin's idle-while-busy joules per run (stock publishes none).",
        "",
        "| load | device | pairs | API servers stock / defaults | throughput | J per output token | p99 TPOT | p50 TTFT Δ ms | starvation J (defaults) |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *_rate_notes(rec),
        f"Not yet measured here: {', '.join(rec['not_yet_measured']) or 'nothing'} (one server at a time, `benchmarks/h200_defaults.py`).",
        "Raw per-pair figures: `pair_list` in the JSON twin. How to rerun: docs/benchmarks.md.",
    ]
    if rec.get("probes"):
        lines += ["", "Probes: fewer pairs than a load needs (6 at saturation, 3 at a rate), so no claim (measured).", ""]
        lines += ["| load | device | pairs | throughput | J per output token | p99 TPOT | p50 TTFT Δ ms |", "|---|---|---|---|---|---|---|"]
        lines += [
            f"| {e['name']} | {e.get('device') or '?'} | {e['pairs']} | {_fmt(e['throughput_ratio'])} | {_fmt(e['j_per_out_token_ratio'])} | "
            f"{_fmt(e['p99_tpot_ratio'])} | {_fmt(e['p50_ttft_delta_ms'], 1)} |"
            for e in rec["probes"]
        ]
    if rec.get("ablations"):
        lines += ["", "Ablations: each arm over its reference (first column of the pair), same ABBA pairs (measured).", ""]
        lines += [
            "| load | arm / reference | settings | pairs | throughput | J per output token | p99 TPOT | p50 TTFT Δ ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {e['name']} | {e['variant']} / {e['reference']} | `{json.dumps(e.get('settings'))}` | {e['pairs']} | {_fmt(e['throughput_ratio'])} | "
            f"{_fmt(e['j_per_out_token_ratio'])} | {_fmt(e['p99_tpot_ratio'])} | {_fmt(e['p50_ttft_delta_ms'], 1)} |"
            for e in rec["ablations"]
        ]
    if pc := rec.get("product_compare"):
        lines += [
            "",
            f"The product's own `{pc['command']}` ({pc['lease']}; one pair, fresh servers, full GPU memory): "
            f"throughput x{pc['throughput_ratio']:.3f}, J per output token x{pc['j_per_out_token_ratio']:.3f}, "
            f"p99 TPOT x{pc['p99_tpot_ratio']:.3f}, p50 TTFT {pc['p50_ttft_delta_ms']:+.1f} ms; API servers "
            f"{pc['api_servers']['stock']} / {pc['api_servers']['defaults']}; ITL p50 {pc['median_itl_ms']['stock']} / "
            f"{pc['median_itl_ms']['defaults']} ms (measured).",
        ]
    if png:
        lines += ["", f"![defaults / stock per load, 95 % intervals]({png})"]
    return "\n".join(lines) + "\n"


def plot(rec: dict, path: Path) -> bool:
    """Defaults / stock ratios per load with their intervals; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = ("throughput_ratio", "j_per_out_token_ratio", "p99_tpot_ratio")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for j, e in enumerate(rec["loads"]):
        for i, k in enumerate(keys):
            c = e[k]
            if c["mean"] is None:
                continue
            lo, hi = c["ci95"] or (c["mean"], c["mean"])
            ax.errorbar(
                [j + (i - 1) * 0.2],
                [c["mean"]],
                yerr=[[c["mean"] - lo], [hi - c["mean"]]],
                fmt="o",
                capsize=4,
                color=f"C{i}",
                label=k if j == 0 else None,
            )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rec["loads"])), [e["name"] for e in rec["loads"]])
    ax.set_ylabel("defaults / stock (measured)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", nargs="*", help="raw files of h200_under_load.py; NAME=FILE names the lease it ran in")
    ap.add_argument(
        "--merge", action="store_true", help="keep the existing record's loads, ablations and runs that these files do not rebuild"
    )
    ap.add_argument("--out-dir", default="docs/results")
    ap.add_argument("--rates", nargs="*", default=[], help="NAME=FILE: raw files of h200_defaults.py (Poisson rates)")
    ap.add_argument("--compare", default=None, help="NAME=FILE: a comparison.json of vllm-powersave compare at c64 (one pair)")
    ns = ap.parse_args(argv)
    raws = []
    for arg in ns.raw:
        lease, _, path = arg.rpartition("=")
        raw = json.loads(Path(path).read_text())
        raws.append({**raw, "lease": lease or raw.get("tag")})
    rate_raws = []
    for arg in ns.rates:
        lease, _, path = arg.rpartition("=")
        raw = defaults_record.load(path)
        rate_raws.append({**raw, "lease": lease or raw.get("tag")})
    rec = build(raws, rate_raws)
    if ns.compare:
        lease, _, path = ns.compare.rpartition("=")
        rec["product_compare"] = product_compare(json.loads(Path(path).read_text()), lease)
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if ns.merge and (old := out / "h200-under-load.json").exists():
        rec = merge(json.loads(old.read_text()), rec)
    png = "h200-under-load.png" if plot(rec, out / "h200-under-load.png") else None
    write_record(out, "h200-under-load", rec, markdown(rec, png) + "\n", keep_from=KEEP_FROM)  # keeps the hand-written reading
    print(markdown(rec, png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
