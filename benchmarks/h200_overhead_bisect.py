#!/usr/bin/env python3
"""Where does the plugin's throughput cost on a small, host-bound model come from? (GPU, read-only)

Three servers of the same model resident on one GPU: stock vLLM, the plugin as configured in
``h200_ab.py`` (NVML meter, step trace, dry-run clock presets, chunking table), and the plugin with
everything optional off (meter off, no trace, no presets, empty chunking table: only the hooks).
Closed-loop windows at one concurrency rotate S0 S1 S2 for ``--rounds`` rounds; then, if
``py-spy`` is importable from ``--plugin-site``, one window per plugin server is profiled with
``py-spy record --gil`` on its EngineCore process (the worker runs there at TP=1), so the cost can be
read off as the share of GIL samples inside ``vllm_powersave``. Refuses without
``POWERSAVE_FORCE_DRY_RUN=1``; never changes a GPU setting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import h200_ab as ab  # noqa: E402


def engine_core_pid(server_pid: int) -> int | None:
    return next((pid for pid, comm, _ in ab.session_processes(server_pid) if "EngineCor" in comm), None)


#: Plugin frames that only wrap a vLLM call: samples below them are vLLM's time, not the plugin's.
WRAPPER_FRAMES = ("execute_model", "sample_tokens", "<lambda>", "make_schedule", "make_add")


def gil_profile(pyspy: str, pid: int, seconds: float, out: Path) -> dict:
    out.unlink(missing_ok=True)  # a profile left by an earlier run must not pass for this one
    subprocess.run([pyspy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--gil", "--nonblocking",
                    "--format", "raw", "-o", str(out)], capture_output=True, timeout=seconds + 30)
    if not out.exists():
        return {"error": "no profile"}
    res = parse_gil_profile(out.read_text())
    # py-spy samples 100 times a second; with --gil only while a thread holds the GIL.
    res["gil_busy_share"] = res["gil_samples"] / (100 * seconds)
    return res


def profile_servers(pyspy: str, servers: dict[str, int], seconds: float, prefix: str) -> tuple[dict[str, dict[str, dict]], list]:
    """GIL profiles of both processes of each server (name -> API-server pid): the EngineCore
    (scheduler + TP=1 worker) and the API server (HTTP, detokenization, streaming), which a
    host-bound 0.5B may also wait on. Returns ``(boxes[name][engine|api], threads)``: start the
    threads with the load, join them, and the boxes hold :func:`gil_profile`'s results. Profiles
    stay in /tmp (``prefix-<name>-<process>.txt``): the device tool brings back at most 8 files."""
    import threading

    boxes: dict[str, dict[str, dict]] = {}
    ths = []
    for name, pid in servers.items():
        boxes[name] = {}
        for proc, target in (("engine", engine_core_pid(pid)), ("api", pid)):
            if target is None:
                continue
            box = boxes[name][proc] = {}
            out = Path(f"{prefix}-{name}-{proc}.txt")
            ths.append(threading.Thread(target=lambda box=box, target=target, out=out: box.update(gil_profile(pyspy, target, seconds, out))))
    return boxes, ths


def parse_gil_profile(text: str) -> dict:
    """Share of GIL samples in the plugin's own code, from py-spy's ``raw`` (collapsed stacks) output."""
    total, own, top = 0, 0, Counter()
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        try:
            k = int(n)
        except ValueError:
            continue
        total += k
        frames = stack.split(";")
        ps = [f for f in frames if "vllm_powersave" in f]
        if not ps:
            continue
        deepest = ps[-1]
        # The wrappers' call into vLLM's own execute_model / sample_tokens / LM head / scheduler is not ours.
        if frames[-1] is not deepest and any(w in deepest for w in WRAPPER_FRAMES):
            continue
        own += k
        top[deepest[:140]] += k
    return {"gil_samples": total, "powersave_own_samples": own, "share": own / total if total else None,
            "wrappers_excluded": list(WRAPPER_FRAMES),
            "top": top.most_common(12)}


#: Prompts generated per closed-loop window: above what a 10 s window of the 0.5B serves even at
#: concurrency 256 (~60 requests/s), without generating 100k prompts (~10 s of host time) per window.
WINDOW_PROMPTS = 4000


def set_tree_affinity(server_pid: int, cpus: set[int]) -> int:
    """Move every thread of every process in the server's session to ``cpus``; returns threads moved.
    (Threads started later inherit their creator's affinity.)"""
    moved = 0
    for pid, _, d in ab.session_processes(server_pid):
        try:
            tids = [int(t) for t in os.listdir(d / "task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
                moved += 1
            except OSError:
                pass  # a thread that ended meanwhile
    return moved


def concurrent_rounds(ns: argparse.Namespace, procs: dict, cpu_sets: list[set[int]] | None, result: dict, save: Any,
                      pyspy: str | None = None) -> None:
    """Rounds in which every server serves its own closed loop at the same time.

    Why: a host-bound 0.5B server's tokens/s drifts by 10-25 % between 10 s windows taken one after
    the other (bisect 1 and 2), far more than the cost sought. Windows taken at the same moment see
    the same host and GPU state, so the drift cancels in the per-round ratio; rotating the CPU sets
    every round cancels what a set itself adds. The servers share the GPU meanwhile (time-sliced
    between processes), the same for all of them, so the ratio is a relative cost, not a
    single-tenant throughput. With ``pyspy``, the last round also profiles both processes of every
    server (EngineCore and API server, ``--gil``), all under the same load."""
    names = list(procs)
    round_s = ns.window + 15.0
    for r in range(ns.rounds):
        t_round = time.monotonic()
        left = ns.budget_s - (t_round - ab.T0)
        if left < round_s + 10:
            result["notes"].append("budget reached")
            return
        last = r == ns.rounds - 1 or left < 2 * round_s + 10
        placed = {}
        if cpu_sets:
            for i, name in enumerate(names):
                cpus = cpu_sets[(i + r) % len(cpu_sets)]
                set_tree_affinity(procs[name][0].pid, cpus)
                placed[name] = sorted(cpus)
        profs, ths = (profile_servers(pyspy, {n: procs[n][0].pid for n in names}, ns.window - 2, f"/tmp/gil-{ns.gpu}")
                      if last and pyspy else ({}, []))
        cfgs = [dict(base_url=f"http://127.0.0.1:{procs[n][1]}", model="model", num_prompts=WINDOW_PROMPTS,
                     max_concurrency=ns.concurrency, input_len=128, output_len=ns.output_len, duration_s=ns.window,
                     energy="none", seed=r, label=n) for n in names]
        got = ab.run_together(cfgs, ns.window + 120, after_start=lambda ths=ths: [th.start() for th in ths])
        for th in ths:
            th.join()
        for n, boxes in profs.items():
            result["profiles"][n] = {**boxes, "round": r, "concurrent": True}
        for pos, name in enumerate(names):
            res = got.get(name, {"error": "no result"})
            w = {"server": name, "round": r, "position": pos, "concurrent": True, "cpus": placed.get(name),
                 "first_send_s": res.get("first_send_s"),
                 **{k: res.get(k) for k in ("completed", "output_throughput", "median_tpot_ms", "median_itl_ms",
                                             "median_ttft_ms", "duration_s", "error")}}
            result["windows"].append(w)
        ab.log(f"concurrent r{r}: " + ", ".join(f"{n} {got.get(n, {}).get('output_throughput') or 0:.0f}" for n in names) + " tok/s")
        save()
        round_s = max(round_s, time.monotonic() - t_round)
        if last:
            return


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.28, help="per server; ~0.9 / number of variants")
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 30,
                    help="KV cache per server (--kv-cache-memory-bytes): servers started together on one GPU must not "
                         "size their cache by profiling it, each one sees the others' memory and the last gets a negative budget")
    ap.add_argument("--variants", default="S0,S1,S2", help="servers to compare, from S0 (stock) .. S7 (a second stock server; see configs)")
    ab.add_bundle_args(ap)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                    help="pin each server to its own equal share of the GPU's NUMA-local CPUs (h200_ab.server_cpu_sets)")
    ap.add_argument("--concurrent", action="store_true",
                    help="drive every server at once (one client process each, started together) instead of one "
                         "after the other; with --pin-cpus the CPU sets rotate among the servers every round")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    model = ab.device_prologue(ns, str(ns.gpu))
    if model is None:
        return 2
    from loadtests import BenchConfig, run

    out_file = Path(ns.out)
    stats = f"/tmp/bisect-stats-gpu{ns.gpu}"  # per GPU: two jobs in parallel must not share rank files
    full = {"powersave": {"stats_dir": stats, "trace_steps": True,
                          "chunking": {"table": [{"min_rows": 1_000_000, "chunks": 2}]},
                          "clocks": {"backend": "dry-run", "min_dwell_ms": 200,
                                     "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}}},
                          "energy": {"meter": "nvml"}}}
    bare = {"powersave": {"chunking": {"table": []}, "clocks": {"backend": "dry-run"}, "energy": {"meter": "off"}}}

    def without(**changes: object) -> dict:
        return {"powersave": {**full["powersave"], **changes}}

    # One option off at a time from the A/B's configuration (h200_ab.py), so that a cost found in
    # the A/B can be pinned to the option that brings it.
    configs = {"S0-stock": None, "S1-plugin-full": full, "S2-plugin-bare": bare,
               "S3-no-lmhead-hook": without(chunking={"table": []}, stats_dir=f"{stats}-s3"),
               "S4-no-trace": without(trace_steps=False, stats_dir=f"{stats}-s4"),
               "S5-no-meter": without(energy={"meter": "off"}, stats_dir=f"{stats}-s5"),
               "S6-no-presets": without(clocks={**full["powersave"]["clocks"], "presets": {}}, stats_dir=f"{stats}-s6"),
               # A second stock server: its ratio to S0 is the design's own spread (what "no difference" looks like).
               "S7-stock-twin": None}
    for c in configs.values():
        if c is not None and c["powersave"].get("stats_dir"):
            shutil.rmtree(c["powersave"]["stats_dir"], ignore_errors=True)  # no trace left from an earlier run
    short = {n.split("-", 1)[0]: n for n in configs}
    asked = [v.strip() for v in ns.variants.split(",")]
    if unknown := [v for v in asked if v not in short]:
        print(f"error: --variants {ns.variants!r}: unknown {unknown}; choose from {sorted(short)}", file=sys.stderr)
        return 2
    chosen = [short[v] for v in dict.fromkeys(asked)]
    configs = {n: configs[n] for n in chosen}
    variants = {n: ([] if c is None else ["--plugin", "powersave", "--additional-config", json.dumps(c)]) for n, c in configs.items()}
    result: dict = {"what": "plugin overhead bisect, qwen2.5-0.5b, closed loop (measured)", "measured": True,
                    "device": ab.device_facts(ns.gpu), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "concurrency": ns.concurrency, "window_s": ns.window, "configs": configs,
                    "windows": [], "profiles": {}, "notes": []}

    def save() -> None:
        ab.write_json_atomic(out_file, result, indent=1)

    procs = {}
    cpu_sets = ab.server_cpu_sets(ns.gpu, len(variants)) if ns.pin_cpus else None
    result["server_cpus"] = ({n: sorted(c) for n, c in zip(variants, cpu_sets)} if cpu_sets
                             else "not pinned" + ("" if ns.pin_cpus else " (--no-pin-cpus)"))
    for i, (name, extra) in enumerate(variants.items()):
        site = ns.stock_site if not extra else f"{ns.plugin_site}:{ns.stock_site}"
        kv = ["--kv-cache-memory-bytes", str(ns.kv_cache_bytes)]
        procs[name] = (ab.start_server(name, model, ab.job_port(ns.gpu, 20 + i), [*extra, *kv], site, out_file.parent, ns.gpu_mem,
                                       cpus=cpu_sets[i] if cpu_sets else None),
                       ab.job_port(ns.gpu, 20 + i))
    try:
        ab.wait_healthy(procs, timeout_s=300)
        result["startup_s"] = time.monotonic() - ab.T0
        for name, (_, port) in procs.items():
            run(BenchConfig(base_url=f"http://127.0.0.1:{port}", model="model", num_prompts=64, max_concurrency=ns.concurrency,
                            input_len=128, output_len=64, energy="none", label=f"warm-{name}"))
        if ns.concurrent:
            result["design"] = ("concurrent: every server driven at the same time by its own client process"
                                + (", CPU sets rotated among the servers every round" if cpu_sets else ", servers not pinned"))
            pyspy_bin = Path(ns.plugin_site) / "bin" / "py-spy"
            concurrent_rounds(ns, procs, cpu_sets, result, save, str(pyspy_bin) if pyspy_bin.exists() else None)
            if not pyspy_bin.exists():
                result["notes"].append("py-spy not available")
        for r in range(0 if ns.concurrent else ns.rounds):
            order = list(procs) if r % 2 == 0 else list(reversed(procs))
            for name in order:
                if time.monotonic() - ab.T0 > ns.budget_s - 60:
                    raise TimeoutError
                port = procs[name][1]
                res = run(BenchConfig(base_url=f"http://127.0.0.1:{port}", model="model", num_prompts=WINDOW_PROMPTS,
                                      max_concurrency=ns.concurrency, input_len=128, output_len=ns.output_len,
                                      duration_s=ns.window, energy="none", seed=r, label=f"{name}-{r}"))
                w = {"server": name, "round": r, "position": order.index(name), **{k: res.get(k) for k in (
                    "completed", "output_throughput", "median_tpot_ms", "median_itl_ms", "median_ttft_ms")}}
                result["windows"].append(w)
                ab.log(f"{name} r{r}: {w['output_throughput']:.0f} tok/s, TPOT {w['median_tpot_ms']:.3f} ms, ITL p50 {w['median_itl_ms']:.3f} ms")
                save()
        pyspy = next((str(p) for p in (Path(ns.plugin_site) / "bin" / "py-spy",) if p.exists()), None)
        if ns.concurrent:
            pass  # profiled inside the last concurrent round
        elif pyspy:
            for name in procs:
                if time.monotonic() - ab.T0 > ns.budget_s - 30:
                    break
                p, port = procs[name]
                by_name, ths = profile_servers(pyspy, {name: p.pid}, ns.window - 2, f"/tmp/gil-{ns.gpu}")
                boxes = by_name[name]
                for th in ths:
                    th.start()
                run(BenchConfig(base_url=f"http://127.0.0.1:{port}", model="model", num_prompts=WINDOW_PROMPTS, max_concurrency=ns.concurrency,
                                input_len=128, output_len=256, duration_s=ns.window, energy="none", label=f"prof-{name}"))
                for th in ths:
                    th.join()
                result["profiles"][name] = boxes
                ab.log(f"profile {name}:", json.dumps(boxes)[:500])
                save()
        else:
            result["notes"].append("py-spy not available")
    except TimeoutError:
        result["notes"].append("budget reached")
    except Exception as exc:
        result["notes"].append(f"error: {type(exc).__name__}: {exc}")
        ab.log("error:", exc)
    finally:
        for p, _ in procs.values():
            ab.stop(p)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
