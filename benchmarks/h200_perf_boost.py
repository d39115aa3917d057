#!/usr/bin/env python3
"""The unprivileged energy mode (``cuda_perf_boost: "off"``) against the default, on one GPU, read-only.

Runs ON the GPU machine after the bundle is up (see ``.gpu-bundle/README.md``). One vLLM OpenAI
server with the plugin at a time (the boost request belongs to each CUDA session, so the two modes
cannot share the GPU: a resident default-mode engine would keep the GPU boosted), servers started
in the order given by ``--order`` (e.g. ``off,on,on,off``: mode off = default boost, mode on =
``CUDA_DISABLE_PERF_BOOST=1`` set by the plugin in the engine processes, mode auto = unboosted engine
boosted by the plugin's side context while it is busy, ``cuda_perf_boost: "auto"``). Per server:

1. checks that the variable is (or is not) in the EngineCore process's environment and that
   ``/metrics`` reports the mode;
2. idle: engine loaded, no requests, power and SM clock over ``--idle-window`` s;
3. wake-up: TTFT of one request after the idle window (10 s), after 1 s, and with ``--long-idle``
   after 60 s (idle power over that minute recorded too), plus a warm baseline;
4. loads through the load-test harness, ``--window`` s each: a low and a medium Poisson rate and
   saturation (closed loop); energy from the GPU's NVML counter (measured), median SM clock from
   a 10 Hz sampler;
5. with ``--booster`` (mode-on servers only): the same idle and medium windows while a side
   process holds a default CUDA context (``vllm_powersave.clocks.boost.BoostHolder``), to test
   whether the boost can be switched at run time without privilege.

Clocks are never changed: refuses to run unless ``POWERSAVE_FORCE_DRY_RUN=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import h200_ab as ab  # noqa: E402

ENERGY = os.environ.get("BOOST_BENCH_ENERGY", "nvml")  # "none" for a CPU dry run of the script
SUMMARY_KEYS = (*ab.SUMMARY_KEYS, "request_goodput", "p50_ttft_ms", "p50_tpot_ms", "mean_tpot_ms")


def engine_env_flags(server_pid: int) -> dict:
    """CUDA_DISABLE_PERF_BOOST in every process of the server's session (api server, engine core)."""
    out = {}
    for pid, comm, d in ab.session_processes(server_pid):
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
        except OSError:
            continue
        out[f"{pid}:{comm}"] = {"cmd": cmd, "CUDA_DISABLE_PERF_BOOST": next(
            (e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"CUDA_DISABLE_PERF_BOOST=")), None)}
    return out


def metrics_mode(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("powersave_info"):
                    return line
    except Exception as exc:
        return f"error: {exc}"
    return None


def boost_metrics(port: int) -> dict:
    """powersave_cuda_boost_held / _switches_total from /metrics (auto mode's side context), {} if absent."""
    out: dict = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(("powersave_cuda_boost_held", "powersave_cuda_boost_switches_total")):
                    name, _, val = line.rpartition(" ")
                    out[name] = float(val)
    except Exception as exc:
        out["error"] = str(exc)
    return out


def probe_ttft(port: int) -> dict:
    """One streamed completion; TTFT in ms (time to the first chunk with text)."""
    body = json.dumps({"model": "model", "prompt": "Hello " * 64, "max_tokens": 8, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft = None
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if ttft is None and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                ttft = (time.monotonic() - t0) * 1000
    return {"ttft_ms": ttft, "e2e_ms": (time.monotonic() - t0) * 1000, "t_send": t0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--order", default="off,on,on,off")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--rates", default="4,40", help="low,medium Poisson request rates (req/s)")
    ap.add_argument("--sat-concurrency", type=int, default=256)
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--idle-window", type=float, default=10.0)
    ap.add_argument("--long-idle", default="", help="comma list of server positions (0-based) that also wait 60 s idle")
    ap.add_argument("--booster", default="", help="comma list of server positions (mode on) that run the side-context test")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--slo", default="ttft:200,tpot:20", help="goodput SLO, ms")
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--budget-s", type=float, default=560.0)
    ab.add_bundle_args(ap)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    model = ab.device_prologue(ns, str(ns.gpu))
    if model is None:
        return 2
    from loadtests import BenchConfig, run
    from vllm_powersave.clocks.boost import BoostHolder, BoostUnavailable

    order = ns.order.split(",")
    long_idle = {int(x) for x in ns.long_idle.split(",") if x}
    booster_at = {int(x) for x in ns.booster.split(",") if x}
    rates = [float(x) for x in ns.rates.split(",")]
    slo = {k: float(v) for k, v in (x.split(":") for x in ns.slo.split(","))}
    out_file = Path(ns.out)
    import vllm

    result: dict = {"what": "cuda_perf_boost mode off (default) vs on (CUDA_DISABLE_PERF_BOOST=1 in engine processes), measured",
                    "measured": True, "tag": ns.tag, "shape": ns.shape, "gpu": ns.gpu, "device": ab.device_facts(ns.gpu),
                    "vllm_version": vllm.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "method": {"order": order, "window_s": ns.window, "idle_window_s": ns.idle_window, "rates_req_s": rates,
                               "sat_concurrency": ns.sat_concurrency, "input_len": ns.input_len, "output_len": ns.output_len,
                               "goodput_slo_ms": slo,
                               "energy": "NVML total-energy counter of the GPU over each harness window (measured)",
                               "clocks": "never changed; the mode is a per-process CUDA variable, no device setting"},
                    "servers": [], "notes": []}

    def save() -> None:
        ab.write_json_atomic(out_file, result)

    try:
        sampler = ab.Sampler(ns.gpu)
    except Exception as exc:  # a CPU dry run of this script: no timeline, no idle power
        ab.log("no NVML sampler:", exc)
        sampler = ab.NullSampler()
    sampler.start()
    port = ab.job_port(ns.gpu, 10)
    for pos, mode in enumerate(order):
        if time.monotonic() - ab.T0 > ns.budget_s - 90:
            result["notes"].append(f"budget: server {pos} ({mode}) not started")
            break
        port += 1
        srv: dict = {"pos": pos, "mode": mode, "windows": [], "wake": [], "notes": []}
        result["servers"].append(srv)
        # mode "on" = the energy mode (boost off in the engine); "auto" = engine unboosted, side context boosts it when busy.
        boost_setting = {"on": "off", "off": "on", "auto": "auto"}[mode]
        cfg = {"powersave": {"cuda_perf_boost": boost_setting, "energy": {"meter": "nvml"},
                             "clocks": {"backend": "dry-run"}, "chunking": {"table": []}}}
        t_start = time.monotonic()
        p = ab.start_server(f"{mode}{pos}", model, port, ["--plugin", "powersave", "--additional-config", json.dumps(cfg)],
                            f"{ns.plugin_site}:{ns.stock_site}", out_file.parent, ns.gpu_mem)
        holder = None
        try:
            ab.wait_healthy({mode: (p, port)}, timeout_s=300)
            srv["startup_s"] = time.monotonic() - t_start
            srv["engine_env"] = engine_env_flags(p.pid)
            base = f"http://127.0.0.1:{port}"
            # Warm-up: compile / CUDA-graph paths for the batch sizes used below.
            run(BenchConfig(base_url=base, model="model", num_prompts=64, max_concurrency=64, input_len=ns.input_len,
                            output_len=16, energy="none", label="warm"))
            srv["metrics_info"] = metrics_mode(port)
            probe_ttft(port)
            srv["wake"].append({"idle_s": 0.0, **probe_ttft(port)})
            time.sleep(1.0)
            # Idle window, then the request that ends it: TTFT after 10 s idle.
            t0 = time.monotonic()
            time.sleep(ns.idle_window)
            srv["idle"] = sampler.window(t0 + 0.5, time.monotonic())
            srv["idle"]["boost_metrics"] = boost_metrics(port)
            srv["wake"].append({"idle_s": ns.idle_window, **probe_ttft(port)})
            time.sleep(1.0)
            srv["wake"].append({"idle_s": 1.0, **probe_ttft(port)})
            if pos in long_idle:
                t0 = time.monotonic()
                time.sleep(60.0)
                srv["idle_60s"] = sampler.window(t0 + 0.5, time.monotonic())
                srv["wake"].append({"idle_s": 60.0, **probe_ttft(port)})
            log_w = lambda w: ab.log(f"[{mode}{pos}] {w['load']}: {w.get('output_throughput') or 0:.0f} tok/s, "  # noqa: E731
                                     f"{w.get('output_tokens_per_joule')} tok/J, {w.get('gpu_avg_power_w')} W, "
                                     f"SM {w['sampler'].get('median_sm_clock_mhz')} MHz, p99 TPOT {w.get('p99_tpot_ms')}")
            loads = [("low", dict(request_rate=rates[0], max_concurrency=None)),
                     ("medium", dict(request_rate=rates[1], max_concurrency=None)),
                     ("saturation", dict(request_rate=float("inf"), max_concurrency=ns.sat_concurrency))]
            for name, kw in loads:
                t0 = time.monotonic()
                res = run(BenchConfig(base_url=base, model="model", num_prompts=100000, input_len=ns.input_len,
                                      output_len=ns.output_len, duration_s=ns.window, energy=ENERGY, gpus=[ns.gpu],
                                      goodput=slo, seed=pos, label=f"{mode}-{name}", **kw))
                t1 = time.monotonic()
                w = {"load": name, **kw, "t0": t0, "t1": t1, **{k: res.get(k) for k in SUMMARY_KEYS}, "sampler": sampler.window(t0, t1),
                     "boost_metrics": boost_metrics(port)}
                srv["windows"].append(w)
                log_w(w)
                save()
            if pos in booster_at:
                holder = BoostHolder(str(ns.gpu))
                try:
                    ms = holder.set(True)
                    srv["booster"] = {"hold_ms": ms}
                    time.sleep(2.0)
                    t0 = time.monotonic()
                    time.sleep(ns.idle_window)
                    srv["booster"]["idle"] = sampler.window(t0, time.monotonic())
                    srv["booster"]["wake"] = {"idle_s": ns.idle_window, **probe_ttft(port)}
                    t0 = time.monotonic()
                    res = run(BenchConfig(base_url=base, model="model", num_prompts=100000, input_len=ns.input_len,
                                          output_len=ns.output_len, duration_s=ns.window, energy=ENERGY, gpus=[ns.gpu],
                                          goodput=slo, seed=pos, label=f"{mode}-medium-booster", request_rate=rates[1]))
                    t1 = time.monotonic()
                    srv["booster"]["medium"] = {"t0": t0, "t1": t1, **{k: res.get(k) for k in SUMMARY_KEYS},
                                                "sampler": sampler.window(t0, t1)}
                    srv["booster"]["release_ms"] = holder.set(False)
                    time.sleep(2.0)
                    t0 = time.monotonic()
                    time.sleep(6.0)
                    srv["booster"]["idle_after_release"] = sampler.window(t0, time.monotonic())
                    ab.log(f"[{mode}{pos}] booster:", json.dumps({k: v for k, v in srv["booster"].items() if k != "medium"})[:400])
                except BoostUnavailable as exc:
                    srv["booster"] = {"error": str(exc)}
                save()
        except Exception as exc:
            srv["notes"].append(f"error: {type(exc).__name__}: {exc}")
            ab.log("error:", exc)
        finally:
            if holder is not None:
                holder.close()
            ab.stop(p)
            srv["timeline"] = [(round(t, 2), round(w, 1), c) for t, w, c, _ in sampler.rows if t >= t_start][::2]
            save()
            time.sleep(3.0)  # let the GPU drop its context before the next server
    sampler.stop_ev.set()
    save()
    ab.log("saved", out_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
