#!/usr/bin/env python3
"""Plugin overhead, stock vs plugin measured at the same moment on two GPUs (GPU, read-only).

Why: on a host-bound model (qwen2.5-0.5b, ~2 ms decode steps) the tokens/s of windows taken one
after the other drifts by 10-25 % (h200-vllm.md, bisects 1 and 2), so sequential A/B pairs cannot
resolve a 0.5 % cost. Driving several servers on *one* GPU at once cancels the drift (bisect c) but
time-slices the GPU between them, hiding host costs. Here each GPU of a 2-GPU host holds one stock
and one plugin server (each GPU-local, pinned to its own CPU share); a round drives one server per
GPU at the same moment, stock on one GPU and the plugin on the other, each alone on its GPU:

    round X: stock on GPU a, plugin on GPU b        round Y: plugin on GPU a, stock on GPU b

Both windows of a round see the same host at the same moment (drift cancels); X and Y swap the GPUs
(a GPU's own speed and power cancel). Per pair, the ratio is the geometric mean of the two rounds'
plugin/stock ratios: sqrt((P_b / S_a)_X * (P_a / S_b)_Y), for tokens/s and for J/token, energy from
each GPU's own NVML total-energy counter over its window (measured; the idle co-resident server's
draw is on both GPUs alike). X/Y order alternates per pair. Clocks never change: refuses without
``POWERSAVE_FORCE_DRY_RUN=1``; the plugin's controller runs dry-run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import h200_ab as ab  # noqa: E402

#: Prompts generated per window: more than a 15 s window of the 0.5B serves at concurrency 256.
WINDOW_PROMPTS = 6000


def plugin_config(stats_dir: str, table: list[dict]) -> dict:
    """The A/B's plugin settings (h200_ab.py): chunk table that never chunks, dry-run presets, NVML meter."""
    return {"powersave": {"stats_dir": stats_dir, "trace_steps": True, "chunking": {"table": table},
                          "clocks": {"backend": "dry-run", "min_dwell_ms": 200,
                                     "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}}},
                          "energy": {"meter": "nvml"}}}


#: Plugin arms: the A/B's settings, or everything optional off (only the hooks, the middleware and
#: the plugin's loading remain), to tell a cost of the options from one of the plugin's presence.
ARMS = {
    "full": lambda stats, table: plugin_config(stats, table),
    "bare": lambda stats, table: {"powersave": {"chunking": {"table": []}, "clocks": {"backend": "dry-run"},
                                                "energy": {"meter": "off"}}},
    # A second stock server (A/A): what the design reads when there is no difference at all.
    "twin": None,
}


def pair_ratio(x: tuple[float, float], y: tuple[float, float]) -> float | None:
    """Geometric mean of plugin/stock over the two placements: ``x`` = (stock on a, plugin on b),
    ``y`` = (stock on b, plugin on a); a GPU's own factor cancels. None if a figure is missing or 0."""
    vals = [*x, *y]
    if any(v is None or not math.isfinite(v) or v <= 0 for v in vals):
        return None
    return math.sqrt((x[1] / x[0]) * (y[1] / y[0]))


def windows_ratio(rounds: dict[str, dict], key: str) -> float | None:
    """:func:`pair_ratio` of ``key`` over one pair's windows, keyed ``X:stock``, ``X:plugin``,
    ``Y:stock``, ``Y:plugin``."""
    return pair_ratio((rounds["X:stock"].get(key), rounds["X:plugin"].get(key)),
                      (rounds["Y:stock"].get(key), rounds["Y:plugin"].get(key)))


def profile_rounds(ns: argparse.Namespace, procs: dict, placement: dict, arms: list[str], gpus: list[int], load: int,
                   pyspy: str, result: dict, save: Any) -> None:
    """One more round per arm (stock on GPU a, the arm on GPU b) with ``py-spy record --gil`` on the
    EngineCore and the API server of both servers: where each process spends its GIL time, and the
    share of it in the plugin's own frames (h200_overhead_bisect.parse_gil_profile)."""
    import h200_overhead_bisect as bis

    a, b = gpus
    for arm in arms:
        pair = (f"stock@{a}", f"{arm}@{b}")
        by_name, ths = bis.profile_servers(pyspy, {n: procs[n][0].pid for n in pair}, ns.window - 2, "/tmp/gil-cross")
        boxes = {f"{n}:{proc}": box for n, d in by_name.items() for proc, box in d.items()}
        cfgs = [{"base_url": f"http://127.0.0.1:{procs[n][1]}", "model": "model", "num_prompts": WINDOW_PROMPTS,
                 "max_concurrency": load, "input_len": ns.input_len, "output_len": ns.output_len, "duration_s": ns.window,
                 "energy": "none", "seed": 999_000 + arms.index(arm), "label": n} for n in pair]
        got = ab.run_together(cfgs, ns.window + 180, after_start=lambda ths=ths: [t.start() for t in ths])
        for t in ths:
            t.join()
        result["profiles"].append({"arm": arm, "load": load, "placement": "X", "profiles": boxes,
                                   "output_throughput": {n: got.get(n, {}).get("output_throughput") for n in pair}})
        ab.log(f"profile {arm}: " + json.dumps({k: (v.get("gil_busy_share"), v.get("share")) for k, v in boxes.items()}))
        save()


def rotate_cpus(procs: dict, placement: dict, cpu_sets: dict, order: list[str], k: int) -> None:
    """Give each GPU's servers the pinned CPU sets shifted by ``k`` (server i gets set (i + k) mod n),
    so that over the pairs every arm runs on every set: a set's own speed (interrupts, a busy
    sibling) cancels like a GPU's does."""
    import h200_overhead_bisect as bis

    for g, sets in cpu_sets.items():
        if not sets:
            continue
        for i, arm in enumerate(order):
            name = f"{arm}@{g}"
            cpus = sets[(i + k) % len(sets)]
            bis.set_tree_affinity(procs[name][0].pid, cpus)
            placement[name]["cpus_now"] = sorted(cpus)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--gpus", default="0,1", help="two NVML/CUDA indices (PCI bus order)")
    ap.add_argument("--loads", default="8,64,256")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--window", type=float, default=15.0, help="s of request starts per window (NVML counter: >= 15)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.42)
    ap.add_argument("--kv-cache-bytes", type=int, default=4 << 30,
                    help="--kv-cache-memory-bytes per server: two servers starting on one GPU must not size the cache by profiling it")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting rounds after this (s since start)")
    ap.add_argument("--arms", default="full", help=f"arms compared with stock, comma-separated, from {sorted(ARMS)} "
                                                    "(twin: a second stock server, the A/A control)")
    ap.add_argument("--rotate-cpus", action=argparse.BooleanOptionalAction, default=True,
                    help="rotate the pinned CPU sets among each GPU's servers every pair, so that no arm keeps the same CPUs")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="after the pairs, one more round per arm (last load, placement X) with py-spy --gil on both "
                         "processes of both servers, if py-spy is in the plugin site")
    ab.add_bundle_args(ap)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    gpus = [int(g) for g in ns.gpus.split(",")]
    if len(gpus) != 2 or gpus[0] == gpus[1]:
        print(f"error: --gpus {ns.gpus!r}: needs two different GPU indices", file=sys.stderr)
        return 2
    arms = [a.strip() for a in ns.arms.split(",") if a.strip()]
    if not arms or (bad := [a for a in arms if a not in ARMS]):
        print(f"error: --arms {ns.arms!r}: unknown {bad or 'empty'}; choose from {sorted(ARMS)}", file=sys.stderr)
        return 2
    model = ab.device_prologue(ns, ns.gpus)
    if model is None:
        return 2
    from loadtests import BenchConfig, run

    out_file = Path(ns.out)
    import vllm  # noqa: F401 - version only

    result: dict = {
        "what": "plugin overhead, stock and plugin at the same moment on two GPUs, placements swapped (measured)",
        "measured": True, "shape": ns.shape, "device": ab.device_facts(gpus[0]), "gpus": gpus,
        "vllm_version": vllm.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": {"pairs": ns.pairs, "window_s": ns.window, "input_len": ns.input_len, "output_len": ns.output_len,
                   "design": "round X: stock on GPU a + plugin on GPU b; round Y: plugin on a + stock on b; "
                             "both windows of a round at once, one forked client each; ratio per pair = "
                             "sqrt(ratio_X * ratio_Y); X/Y order alternates per pair",
                   "energy": "each GPU's NVML total-energy counter over its client's window (measured)",
                   "clocks": "never changed: POWERSAVE_FORCE_DRY_RUN=1, controller dry-run",
                   "chunking": "table selects 1 chunk at every row count seen (hook installed)",
                   "first_send_s": "each window's first request, s after the clients were started (the clients' own t0)"},
        "windows": [], "pairs": [], "notes": []}

    def save() -> None:
        ab.write_json_atomic(out_file, result)

    never_chunk = [{"min_rows": 1_000_000, "chunks": 2}]
    procs: dict[str, tuple] = {}
    placement: dict[str, dict] = {}
    cpu_sets: dict[int, list[set[int]] | None] = {}
    for g in gpus:
        cpus = ab.server_cpu_sets(g, 1 + len(arms))
        kv = ["--kv-cache-memory-bytes", str(ns.kv_cache_bytes)]
        for slot, arm in enumerate(["stock", *arms]):
            if ARMS.get(arm) is None:  # stock, or the stock twin
                extra, site = [], ns.stock_site
            else:
                stats = f"/tmp/powersave-stats/cross-{ns.shape}-{arm}-g{g}"
                shutil.rmtree(stats, ignore_errors=True)
                cfg = ARMS[arm](stats, never_chunk)
                extra, site = ["--plugin", "powersave", "--additional-config", json.dumps(cfg)], f"{ns.plugin_site}:{ns.stock_site}"
            name = f"{arm}@{g}"
            port = ab.job_port(g, 30 + slot)
            procs[name] = (ab.start_server(f"{arm}-g{g}", model, port, [*extra, *kv], site, out_file.parent, ns.gpu_mem,
                                           env_extra={"CUDA_VISIBLE_DEVICES": str(g)}, cpus=cpus[slot] if cpus else None), port)
            placement[name] = {"gpu": g, "cpus": sorted(cpus[slot]) if cpus else "not pinned",
                               "config": None if ARMS.get(arm) is None else ARMS[arm]("<stats_dir>", never_chunk)}
        cpu_sets[g] = cpus
    result["method"]["servers"] = placement
    result["method"]["rotate_cpus"] = bool(ns.rotate_cpus and any(cpu_sets.values()))
    result["method"]["arms"] = arms
    a, b = gpus
    pyspy = Path(ns.plugin_site) / "bin" / "py-spy"
    result["profiles"] = []
    try:
        ab.wait_healthy(procs, timeout_s=300)
        result["startup_s"] = time.monotonic() - ab.T0
        round_s = ns.window + 25.0
        reserve = (ns.window + 30.0) * len(arms) if ns.profile and pyspy.exists() else 0.0  # the profiled rounds
        for load_i, load in enumerate(int(x) for x in ns.loads.split(",")):
            for name, (_, port) in procs.items():  # warm-up: compile/graph paths for this batch size
                run(BenchConfig(base_url=f"http://127.0.0.1:{port}", model="model", num_prompts=load, max_concurrency=load,
                                input_len=ns.input_len, output_len=32, energy="none", label=f"warm-{name}"))
            for pair, arm in ((pr, am) for pr in range(ns.pairs) for am in arms):
                if ns.rotate_cpus and arm == arms[0]:
                    rotate_cpus(procs, placement, cpu_sets, ["stock", *arms], pair)
                rounds = {"X": (f"stock@{a}", f"{arm}@{b}"), "Y": (f"stock@{b}", f"{arm}@{a}")}
                seed = 1 + load_i * 10_000 + pair * 100 + arms.index(arm)
                got_pair: dict[str, dict] = {}
                for kind in (("X", "Y") if pair % 2 == 0 else ("Y", "X")):
                    if time.monotonic() - ab.T0 > ns.budget_s - round_s - reserve:
                        result["notes"].append(f"budget reached before load {load} pair {pair} round {kind}")
                        raise TimeoutError
                    t_round = time.monotonic()
                    stock, plugin = rounds[kind]
                    cfgs = [{"base_url": f"http://127.0.0.1:{procs[n][1]}", "model": "model", "num_prompts": WINDOW_PROMPTS,
                             "max_concurrency": load, "input_len": ns.input_len, "output_len": ns.output_len,
                             # A seed per (load, pair, arm): the stock server serves every arm's rounds, and
                             # vLLM's prefix cache would give it the prompts an earlier arm's round already sent.
                             "duration_s": ns.window, "energy": "nvml", "gpus": [placement[n]["gpu"]], "seed": seed,
                             "label": n} for n in (stock, plugin)]
                    got = ab.run_together(cfgs, ns.window + 180)
                    for n in (stock, plugin):
                        res = got.get(n, {"error": "no result"})
                        if not res.get("completed"):
                            raise RuntimeError(f"load {load} pair {pair} round {kind} {n}: nothing completed "
                                               f"({res.get('error') or next((e for e in res.get('errors') or [] if e), None)})")
                        w = {"server": n, "arm": n.split("@")[0], "gpu": placement[n]["gpu"], "load": load, "pair": pair,
                             "round": kind, "first_send_s": res.get("first_send_s"), "cpus": placement[n].get("cpus_now"),
                             **{k: res.get(k) for k in ab.SUMMARY_KEYS}}
                        result["windows"].append(w)
                        got_pair[f"{kind}:{'stock' if w['arm'] == 'stock' else 'plugin'}"] = w
                    ab.log(f"load {load} pair {pair} {arm} {kind}: " + ", ".join(
                        f"{n} {got[n]['output_throughput']:.0f} tok/s {got[n].get('output_tokens_per_joule')} tok/J" for n in (stock, plugin)))
                    round_s = max(round_s, time.monotonic() - t_round)
                    save()

                tok_j = windows_ratio(got_pair, "output_tokens_per_joule")
                p = {"arm": arm, "load": load, "pair": pair, "throughput_ratio": windows_ratio(got_pair, "output_throughput"),
                     # J per output token = 1 / (output tokens per J)
                     "j_per_token_ratio": 1.0 / tok_j if tok_j else None,
                     "itl_p50_ratio": windows_ratio(got_pair, "median_itl_ms")}
                result["pairs"].append(p)
                ab.log(f"load {load} pair {pair} {arm}: ratios plugin/stock " + ", ".join(
                    f"{k.removesuffix('_ratio')} {v:.4f}" if v is not None else f"{k.removesuffix('_ratio')} n/a"
                    for k, v in p.items() if k.endswith("_ratio")))
                save()
        if ns.profile and pyspy.exists():
            profile_rounds(ns, procs, placement, arms, gpus, int(ns.loads.split(",")[-1]), str(pyspy), result, save)
        elif ns.profile:
            result["notes"].append("py-spy not available: no profile")
    except TimeoutError:
        ab.log("budget reached; saving partial results")
    except Exception as exc:
        result["notes"].append(f"error: {type(exc).__name__}: {exc}")
        ab.log("error:", exc)
    finally:
        for p_, _ in procs.values():
            ab.stop(p_)
        snaps = {}
        for g in gpus:
            for arm in arms:
                f = Path(f"/tmp/powersave-stats/cross-{ns.shape}-{arm}-g{g}/rank0.json")
                if f.exists():
                    snaps[f"{arm}@{g}"] = json.loads(f.read_text())
        result["plugin_snapshots"] = snaps
        save()
        ab.log(f"saved {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
