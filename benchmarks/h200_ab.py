"""Stock vLLM vs vLLM + powersave on one GPU (or a TP/PP group), through the OpenAI server and loadtests.

Runs ON the GPU machine (``bash benchmarks/device_run.sh ab05b@1``). Both servers stay resident on
the same GPU(s) for the whole run, and load windows run in ABBA order (A B, B A, ...) so that
drift hits both arms alike. A window's energy is the GPU's total-energy counter over the harness
window (whole GPU: the resting engine's idle draw is in A's and B's windows alike). Clocks are
never changed: the script refuses to start without ``POWERSAVE_FORCE_DRY_RUN=1`` and the plugin's
controller runs in dry-run, recording its decisions.

Output (``--out``, rewritten after every window): device facts, the idle window, every load window
(harness summary + sampler window), B/A ratios per load with 95 % intervals, a 5 Hz power/SM-clock
timeline and the plugin's per-step trace (with several ranks: their decision streams compared).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from .lib.ab import abba, ratio_summary
from .lib.device import T0, add_bundle_args, log, make_model, require_dry_run, utc_now, write_json_atomic
from .lib.energy import EnergySampler, NullSampler, device_facts, nvml_meters
from .lib.serve import SUMMARY_KEYS, job_port, server_cpu_sets, start_server, stop, wait_healthy

#: B's default chunk table: the LM-head hook installed, but chunking only from a million rows (never).
NEVER_CHUNK = [{"min_rows": 1_000_000, "chunks": 2}]
RATIO_KEYS = ("output_throughput", "gpu_energy_per_output_token_j", "p99_tpot_ms")


def compare_decision_streams(traces: dict[str, list[dict]]) -> dict:
    """Per-step (phase, tokens, clock target) of every rank against rank 0's, step by step."""
    keys = ("phase", "prefill", "decode", "reqs", "sm_target")
    ranks = sorted(traces)
    ref = [tuple(r.get(k) for k in keys) for r in traces[ranks[0]]]
    out = {"ranks": ranks, "steps_per_rank": {r: len(traces[r]) for r in ranks}, "fields": keys, "by_rank": {}}
    for r in ranks[1:]:
        other = [tuple(x.get(k) for k in keys) for x in traces[r]]
        n = min(len(ref), len(other))
        diff = [i for i in range(n) if ref[i] != other[i]]
        out["by_rank"][r] = {
            "compared_steps": n,
            "differing_steps": len(diff),
            "first_differences": [{"step": i, "rank0": ref[i], f"rank{r}": other[i]} for i in diff[:10]],
        }
    out["identical"] = all(v["differing_steps"] == 0 for v in out["by_rank"].values()) and len(set(out["steps_per_rank"].values())) == 1
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--loads", default="8,64,256", help="concurrency of each load, comma-separated")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--window", type=float, default=15.0, help="seconds per load window")
    ap.add_argument("--idle-window", type=float, default=15.0)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.42)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra vllm serve arguments for both servers")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no window after this many seconds")
    ap.add_argument(
        "--pin-cpus",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin each server to its own equal share of the GPU's NUMA-local CPUs",
    )
    ap.add_argument("--prompt-logprobs", type=int, default=None, help="ask every request for this many prompt logprobs")
    ap.add_argument("--b-chunking", default=None, help="B's LM-head chunk table (JSON list); default: never chunks")
    ap.add_argument("--a-chunking", default=None, help="run A as the plugin with this chunk table (JSON) instead of stock")
    add_bundle_args(ap)
    ap.add_argument("--gpus", default="0", help="NVML/CUDA indices (PCI bus order) the servers use, e.g. 1 or 0,1")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    require_dry_run()
    ns = parse_args(argv)
    gpus = [int(x) for x in ns.gpus.split(",")]
    out_file = Path(ns.out)
    out_dir = out_file.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    model = make_model(ns.shape, Path(ns.shapes_dir), Path(ns.tok_dir))
    serve_extra = [a for arg in ns.serve_arg for a in arg.split()]
    gpu_env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ns.gpus}
    import vllm

    from loadtests import BenchConfig, run

    stats = {arm: Path("/tmp/powersave-stats") / f"{ns.shape}-{arm}" for arm in "AB"}
    for d in stats.values():
        shutil.rmtree(d, ignore_errors=True)
    table_b = json.loads(ns.b_chunking) if ns.b_chunking else NEVER_CHUNK
    plugin_cfg = {
        "stats_dir": str(stats["B"]),
        "trace_steps": True,
        "chunking": {"table": table_b},
        "clocks": {"backend": "dry-run", "min_dwell_ms": 200, "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}}},
        "energy": {"meter": "nvml"},
    }
    plugin_path = f"{ns.plugin_site}:{ns.stock_site}"
    args = {"B": (["--plugin", "powersave", "--additional-config", json.dumps({"powersave": plugin_cfg})], plugin_path)}
    if ns.a_chunking is None:
        args["A"] = ([], ns.stock_site)
    else:  # A is the plugin too: same settings, its own chunk table and stats directory (policy vs none)
        cfg_a = {**plugin_cfg, "stats_dir": str(stats["A"]), "trace_steps": False, "chunking": {"table": json.loads(ns.a_chunking)}}
        args["A"] = (["--plugin", "powersave", "--additional-config", json.dumps({"powersave": cfg_a})], plugin_path)
    stream = not ns.prompt_logprobs  # vLLM returns prompt logprobs only on non-streamed requests
    cpu_sets = server_cpu_sets(gpus[0], 2) if ns.pin_cpus else None
    result: dict = {
        "shape": ns.shape,
        "device": device_facts(gpus[0]),
        "gpus": gpus,
        "serve_args": serve_extra,
        "vllm_version": vllm.__version__,
        "date_utc": utc_now(),
        "measured": True,
        "method": {
            "pairs": ns.pairs,
            "window_s": ns.window,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "order": "ABBA: A B, B A, A B, ... per pair, both servers resident",
            "arms": {
                "A": "stock vLLM" if ns.a_chunking is None else f"vLLM + powersave, chunk table {ns.a_chunking}",
                "B": f"vLLM + powersave, chunk table {json.dumps(table_b)}",
            },
            "energy": "NVML total-energy counter of the whole GPU over each harness window (measured)",
            "clocks": "never changed: POWERSAVE_FORCE_DRY_RUN=1, controller dry-run",
            "prompt_logprobs": ns.prompt_logprobs,
            "stream": stream,
            "server_cpus": {"A": sorted(cpu_sets[0]), "B": sorted(cpu_sets[1])} if cpu_sets else "not pinned",
        },
        "idle": {},
        "windows": [],
        "ratios": {},
        "timeline": [],
        "trace": [],
        "notes": [],
    }
    try:
        sampler: EnergySampler = EnergySampler(nvml_meters(gpus))
    except Exception as exc:  # no NVML (a CPU dry run of this script): keep going without a timeline
        log("no NVML sampler:", exc)
        sampler = NullSampler()
    sampler.start()
    ports = {"A": job_port(gpus[0], 1), "B": job_port(gpus[0], 2)}
    procs = {
        arm: (
            start_server(
                arm,
                model,
                ports[arm],
                [*args[arm][0], *serve_extra],
                args[arm][1],
                out_dir,
                ns.gpu_mem,
                env_extra=gpu_env,
                cpus=cpu_sets[i] if cpu_sets else None,
            ),
            ports[arm],
        )
        for i, arm in enumerate("AB")
    }
    try:
        wait_healthy(procs, timeout_s=300)
        time.sleep(3)
        t0 = time.monotonic()
        time.sleep(ns.idle_window)  # idle: both engines loaded, no requests
        result["idle"] = sampler.window(t0, time.monotonic())
        log("idle", result["idle"])
        for load in [int(x) for x in ns.loads.split(",")]:
            for arm, port in ports.items():  # warm-up: compile/graph paths for this batch size
                run(
                    BenchConfig(
                        base_url=f"http://127.0.0.1:{port}",
                        model="model",
                        num_prompts=load,
                        max_concurrency=load,
                        input_len=ns.input_len,
                        output_len=32,
                        energy="none",
                        label=f"warm-{arm}",
                        prompt_logprobs=ns.prompt_logprobs,
                        stream=stream,
                    )
                )
            for pair, arm in abba("AB", ns.pairs):
                if time.monotonic() - T0 > ns.budget_s:
                    result["notes"].append(f"budget reached before load {load} pair {pair} {arm}")
                    raise TimeoutError
                t0 = time.monotonic()
                res = run(
                    BenchConfig(
                        base_url=f"http://127.0.0.1:{ports[arm]}",
                        model="model",
                        num_prompts=20000,
                        max_concurrency=load,
                        input_len=ns.input_len,
                        output_len=ns.output_len,
                        duration_s=ns.window,
                        energy="nvml",
                        gpus=gpus,
                        seed=pair,
                        label=f"{arm}-{load}-{pair}",
                        prompt_logprobs=ns.prompt_logprobs,
                        stream=stream,
                    )
                )
                if not res.get("completed"):  # a window of failures is no measurement: stop and say why
                    first = next((e for e in res.get("errors") or [] if e), None)
                    raise RuntimeError(f"load {load} pair {pair} {arm}: 0 of {res.get('failed')} requests completed; first error: {first}")
                w = {
                    "server": arm,
                    "arm": arm,
                    "load": load,
                    "pair": pair,
                    "t0": t0,
                    "t1": time.monotonic(),
                    **{k: res.get(k) for k in SUMMARY_KEYS},
                    "sampler": sampler.window(t0, time.monotonic()),
                }
                result["windows"].append(w)
                log(f"load {load} pair {pair} {arm}: {w['output_throughput']:.0f} tok/s, {w['output_tokens_per_joule']} tok/J")
                result["ratios"][str(load)] = {k: ratio_summary([x for x in result["windows"] if x["load"] == load], k) for k in RATIO_KEYS}
                write_json_atomic(out_file, result)
    except TimeoutError:
        log("budget reached; saving partial results")
    except Exception as exc:
        result["notes"].append(f"error: {type(exc).__name__}: {exc}")
        log("error:", exc)
    finally:
        sampler.stop_ev.set()
        for p, _ in procs.values():
            stop(p)
        result["timeline"] = [(round(t, 3), round(w, 1), c) for t, w, c, _ in sampler.rows[::2]]
        if len(gpus) > 1:
            result["timeline_per_gpu_w"] = [tuple(round(w, 1) for w in ws) for ws in sampler.per_gpu_w[::2]]
        traces = {
            f.stem.removeprefix("trace-rank"): [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            for f in sorted(stats["B"].glob("trace-rank*.jsonl"))
        }
        result["trace"] = traces.get("0", next(iter(traces.values()), []))
        if len(traces) > 1:
            result["decision_streams"] = compare_decision_streams(traces)
        for arm, d in stats.items():
            result[f"plugin_snapshots_{arm}"] = {
                f.stem.removeprefix("rank"): json.loads(f.read_text()) for f in sorted(d.glob("rank*.json"))
            }
        write_json_atomic(out_file, result)
        log(f"saved {out_file} ({out_file.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
