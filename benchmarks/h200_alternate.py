"""Plugin overhead by fast alternation: one GPU, one arm busy at a time, arms taking turns every ~1-3 s.

Why this design (issue 7): on the lent H200 host a host-bound 0.5B server's speed drifts by 10-25 %
between windows taken one after another, and with servers driven at once (the cross A/B) each pair
still reads +-3-5 % (A/A control, session 7), because the forked clients and the servers compete
for vCPUs. Here every arm lives on the same GPU and the same CPU set; only one is busy at a time;
the arms take turns in short calls (offline: one ``LLM.generate`` of a fixed batch; serve: one
closed-loop burst through the OpenAI server), so slow drift cancels between neighbouring calls and
no arm ever has other CPUs than another. Each cycle runs every arm once, in an order rotated per cycle;
the ratio of a cycle is arm / stock of the same cycle.

Two modes, which tell the engine's cost from the API server's:

* ``offline``: each arm is a process holding a ``vllm.LLM`` (no HTTP, no API server); a call is
  ``generate`` of ``--batch`` token-id prompts (new ones every cycle, the same for every arm, so
  the prefix cache helps none) with ``max_tokens = --output-len`` and ``ignore_eos``.
* ``serve``: each arm is a ``vllm serve`` process; a call is a closed-loop burst of ``--burst``
  requests at concurrency ``--batch`` from this process's load-test client (``loadtests``).

Energy per call from the GPU's NVML total-energy counter, read by this process between calls only
(never while an arm runs): it waits for the counter to step before a call and after it, so a
call's energy is whole counter periods and includes < 100 ms of idle after the call (the same in
expectation for every arm). Time and tokens per call are exact. Read-only: no GPU setting is
changed; the script refuses without ``POWERSAVE_FORCE_DRY_RUN=1``.

Arms: ``stock`` and ``twin`` (vLLM alone, the A/A control), ``inert`` (the plugin installed, not
enabled), ``bare`` (enabled, every option off), ``full`` (the A/B's settings: trace, NVML meter,
dry-run presets, an LM-head hook that never chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import h200_ab as ab  # noqa: E402
from h200_ab_cross import plugin_config  # noqa: E402

NEVER_CHUNK = [{"min_rows": 1_000_000, "chunks": 2}]


def arm_config(arm: str, stats_dir: str) -> dict | None:
    """The plugin settings of ``arm`` (None: the plugin is not enabled); ``X-base`` = arm ``X`` run
    with the plugin build of ``--base-site`` (a before/after of the plugin code in one run)."""
    arm = arm.removesuffix("-base")
    if arm == "full":
        return plugin_config(stats_dir, NEVER_CHUNK)
    if arm == "bare":
        return {"powersave": {"chunking": {"table": []}, "clocks": {"backend": "dry-run"}, "energy": {"meter": "off"}}}
    return None


ARMS = ("stock", "twin", "inert", "bare", "full", "bare-base", "full-base")


def arm_site(arm: str, ns: argparse.Namespace) -> str:
    if arm in ("stock", "twin"):
        return ns.stock_site
    return f"{ns.base_site if arm.endswith('-base') else ns.plugin_site}:{ns.stock_site}"


def prompts_for(cycle: int, batch: int, input_len: int, vocab: int = 150_000) -> list[list[int]]:
    """``batch`` token-id prompts of ``input_len`` ids, the same for every arm in a cycle."""
    rng = random.Random(1_000_003 * cycle + batch)
    return [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(batch)]


# --------------------------------------------------------------------------------------------
# offline worker (a process per arm)
# --------------------------------------------------------------------------------------------
def worker_main(ns: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.loads(ns.worker_config) if ns.worker_config else None
    acc = time_hooks(ns.time_parts) if ns.time_hooks and cfg else None
    kw: dict[str, Any] = {"model": ns.model, "load_format": "dummy", "max_model_len": 2048, "max_num_seqs": 256,
                          "gpu_memory_utilization": ns.gpu_mem, "kv_cache_memory_bytes": ns.kv_cache_bytes, "seed": 0}
    if cfg:
        kw["additional_config"] = cfg
    llm = LLM(**kw)
    # Prompt ids below the tokenizer's size (the device's tokenizer has 151,936; a test model's fewer).
    vocab = min(len(llm.get_tokenizer()), 150_000)
    conn = Client(ns.worker_addr, authkey=b"alt")
    conn.send({"ready": ns.worker_name, "pid": os.getpid()})
    while True:
        msg = conn.recv()
        if msg is None:
            break
        batch, cycle, out_len, in_len = msg
        sp = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts_for(cycle, batch, in_len, vocab)]
        try:
            t = time.perf_counter()
            outs = llm.generate(ps, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            r = {"s": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
            if acc is not None:
                r["hooks"] = {k: list(v) for k, v in acc.items()}
                acc.clear()
            conn.send(r)
        except Exception as exc:  # reported to the controller, which stops the run with it
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
    return 0


def time_hooks(parts: bool = False) -> dict[str, list[int]]:
    """Wrap the plugin's per-step hooks (engine thread: ``on_step_start``, ``on_step_end``,
    ``on_arrival``, the LM-head hook without vLLM's own head GEMM) and its publisher-thread work
    (``publish``, which includes the trace and request flushes, timed separately too) with
    ``perf_counter_ns`` accumulators; returns {name: [calls, ns]}. Not timed, so the figures are a
    lower bound of the plugin's engine-thread time: the wrapper frames around ``execute_model`` /
    ``sample_tokens``, the scheduler's ``schedule`` / ``add_request`` wrappers and the LM-head
    subclass's own frame. Must run before the ``LLM`` is built: ``activate()`` installs the module
    functions current at that moment. Needs the EngineCore in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    import vllm_powersave.runtime as rt

    acc: dict[str, list[int]] = {}
    ns_ = time.perf_counter_ns

    def add(name: str, d: int) -> None:
        a = acc.get(name)
        if a is None:
            acc[name] = [1, d]
        else:
            a[0] += 1
            a[1] += d

    def timed(name: str, fn: Any) -> Any:
        def w(*a: Any, **k: Any) -> Any:
            t = ns_()
            try:
                return fn(*a, **k)
            finally:
                add(name, ns_() - t)
        return w

    for name in ("on_step_start", "on_step_end", "on_arrival"):
        setattr(rt, name, timed(name, getattr(rt, name)))
    for name in ("publish", "_flush_trace", "_flush_requests", "drain_steps"):
        if hasattr(rt.WorkerRuntime, name):  # drain_steps: builds since session 8 (X-base arms run an earlier one)
            setattr(rt.WorkerRuntime, name, timed(f"publisher.{name}", getattr(rt.WorkerRuntime, name)))
    if hasattr(rt, "head_chunks"):
        # Since session 8 the LM-head subclass asks head_chunks first and calls vLLM's head directly
        # for 0; chunked_head (below) runs only for calls that are split.
        rt.head_chunks = timed("head_chunks", rt.head_chunks)
    if parts:
        time_parts(rt, timed, add)
    orig_head = rt.chunked_head

    def chunked_head(head: Any, hidden: Any, *n: Any) -> Any:
        inner = [0]

        def head2(x: Any) -> Any:
            t = ns_()
            try:
                return head(x)
            finally:
                inner[0] += ns_() - t
        t = ns_()
        try:
            return orig_head(head2, hidden, *n)
        finally:
            add("chunked_head", ns_() - t - inner[0])

    rt.chunked_head = chunked_head
    return acc


def time_parts(rt: Any, timed: Any, add: Any) -> None:
    """``--time-parts``: inside the hooks, the pieces (nested in the hook figures, named ``part.*``):
    the step classification (``decode_step_tokens``, and ``step_info`` for other steps), the
    regime filter, the clock controller's step call, the chunk policy (the last three only where
    the hooks call them); and, before each LM-head hook call, what reading the hidden states' ``dim()`` and
    ``shape[0]`` costs on vLLM's real tensors, with whether a torch-function mode or override is
    active there (``fact.*``: calls where it was)."""
    import torch
    from vllm_powersave import vllm_compat
    from vllm_powersave.chunking.policy import ChunkPolicy
    from vllm_powersave.clocks.controller import ClockController

    ns_ = time.perf_counter_ns
    vllm_compat.step_info = timed("part.step_info", vllm_compat.step_info)
    if hasattr(vllm_compat, "decode_step_tokens"):  # the decode-step fast path (session 8)
        vllm_compat.decode_step_tokens = timed("part.decode_step_tokens", vllm_compat.decode_step_tokens)
    rt.RegimeFilter.phase = timed("part.regime", rt.RegimeFilter.phase)
    ClockController.on_phase = timed("part.on_phase", ClockController.on_phase)
    ChunkPolicy.take = timed("part.policy_take", ChunkPolicy.take)
    name = "head_chunks" if hasattr(rt, "head_chunks") else "chunked_head"
    inner = getattr(rt, name)

    def probe(*a: Any, **k: Any) -> Any:
        h = a[-1] if name == "head_chunks" else a[1]
        t = ns_()
        h.dim()
        t1 = ns_()
        h.shape[0]  # noqa: B018 - timed on purpose
        t2 = ns_()
        add("part.torch_dim", t1 - t)
        add("part.torch_shape", t2 - t1)
        if torch._C._is_torch_function_mode_enabled():
            add("fact.torch_function_mode", 0)
        if torch.overrides.has_torch_function((h,)):
            add("fact.torch_function_override", 0)
        return inner(*a, **k)

    setattr(rt, name, probe)


# --------------------------------------------------------------------------------------------
# controller
# --------------------------------------------------------------------------------------------
def summarize(calls: list[dict], arms: list[str], loads: list[int]) -> dict[str, Any]:
    """Per (load, arm): median and 95 % CI (t) of the per-cycle ratio to stock, for tokens/s and J/token."""
    out: dict[str, Any] = {}
    by = {(c["load"], c["cycle"], c["arm"]): c for c in calls if c.get("tokens")}
    for load in loads:
        for arm in arms:
            if arm == "stock":
                continue
            thr, jpt = [], []
            for (ld, cyc, a), c in by.items():
                if ld != load or a != arm or (ld, cyc, "stock") not in by:
                    continue
                s = by[(ld, cyc, "stock")]
                thr.append((c["tokens"] / c["s"]) / (s["tokens"] / s["s"]))
                if c.get("energy_j") and s.get("energy_j"):
                    jpt.append((c["energy_j"] / c["tokens"]) / (s["energy_j"] / s["tokens"]))
            out[f"{load}:{arm}"] = {"load": load, "arm": arm, "cycles": len(thr),
                                    "throughput_ratio": stats(thr), "j_per_token_ratio": stats(jpt)}
    return out


def hook_summary(calls: list[dict]) -> dict[str, Any]:
    """Per (load, arm): the plugin's time per engine step, by hook (us; steps = on_step_start calls),
    and the call's wall time per step (ms)."""
    out: dict[str, Any] = {}
    for c in calls:
        h = c.get("hooks")
        if not h:
            continue
        o = out.setdefault(f"{c['load']}:{c['arm']}", {"calls": 0, "wall_s": 0.0, "hooks": {}})
        o["calls"] += 1
        o["wall_s"] += c["s"]
        for name, (n, ns_) in h.items():
            a = o["hooks"].setdefault(name, [0, 0])
            a[0] += n
            a[1] += ns_
    for o in out.values():
        steps = o["hooks"].get("on_step_start", [0, 0])[0]
        o["steps"] = steps
        o["wall_ms_per_step"] = 1e3 * o["wall_s"] / steps if steps else None
        o["us_per_step"] = {name: (ns_ / 1e3 / steps if steps else None) for name, (n, ns_) in o["hooks"].items()}
        # part.* and fact.* are nested in the hooks (--time-parts): not added again.
        engine = sum(v for k, v in o["us_per_step"].items() if v is not None and not k.startswith(("publisher.", "part.", "fact.")))
        o["engine_thread_us_per_step"] = engine
        o["engine_thread_share"] = engine / 1e3 / o["wall_ms_per_step"] if o["wall_ms_per_step"] else None
    return out


def stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    from loadtests.ab import ratio_ci  # the t-interval of every other A/B record

    n = len(xs)
    mean, lo, hi = ratio_ci(xs)
    return {"n": n, "median": statistics.median(xs), "mean": mean, "sd": statistics.stdev(xs) if n > 1 else float("nan"), "ci95": [lo, hi],
            "geomean": math.exp(statistics.fmean(math.log(x) for x in xs))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("offline", "serve"), default="offline")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--arms", default="stock,twin,bare,full", help=f"from {ARMS}; stock first")
    ap.add_argument("--loads", default="8", help="offline: prompts per generate call; serve: concurrency")
    ap.add_argument("--burst", type=int, default=32, help="serve: requests per call")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--gpu-mem", type=float, default=0.15)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--client-cpus", type=int, default=4, help="CPUs of the GPU's node kept for this process (the client)")
    ab.add_bundle_args(ap)
    ap.add_argument("--base-site", default="/tmp/psite-base", help="the plugin build of the X-base arms (an earlier wheel installed there)")
    ap.add_argument("--out", default=None)
    # worker side (internal)
    ap.add_argument("--worker-addr", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-name", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--time-hooks", action="store_true",
                    help="offline only: EngineCore in each worker's process, the plugin's hooks timed (perf_counter_ns); "
                         "results per call under 'hooks'")
    ap.add_argument("--time-parts", action="store_true",
                    help="with --time-hooks: also time the pieces inside the hooks (step classification, regime, clock call, chunk policy, torch accessors)")
    ns = ap.parse_args()
    if ns.worker_addr:
        return worker_main(ns)
    arms = [a for a in ns.arms.split(",") if a]
    if not arms or arms[0] != "stock" or (bad := [a for a in arms if a not in ARMS]) or len(set(arms)) != len(arms):
        print(f"error: --arms {ns.arms!r}: arms from {ARMS}, each once, stock first", file=sys.stderr)
        return 2
    if any(a.endswith("-base") for a in arms) and not Path(ns.base_site, "vllm_powersave").is_dir():
        print(f"error: --base-site {ns.base_site!r}: no vllm_powersave there for the -base arms", file=sys.stderr)
        return 2
    if ns.time_hooks and ns.mode != "offline":
        print("error: --time-hooks needs --mode offline", file=sys.stderr)
        return 2
    if ns.out is None:
        print("error: --out is required", file=sys.stderr)
        return 2
    loads = [int(x) for x in ns.loads.split(",")]
    model = ab.device_prologue(ns, str(ns.gpu))
    if model is None:
        return 2
    out_file = Path(ns.out)
    out_dir = out_file.parent
    local = None
    try:
        local = sorted(ab.gpu_local_cpus(ns.gpu, ab.gpu_bus_ids(), allowed=os.sched_getaffinity(0)))
    except Exception as exc:
        ab.log("CPU locality unknown:", exc)
    arm_cpus = client_cpus = None
    if local and len(local) > ns.client_cpus + 4:
        client_cpus, arm_cpus = set(local[-ns.client_cpus:]), set(local[:-ns.client_cpus])
        os.sched_setaffinity(0, client_cpus)
    import vllm

    result: dict[str, Any] = {
        "what": f"plugin overhead by fast alternation on one GPU ({ns.mode}; measured)", "measured": True,
        "mode": ns.mode, "shape": ns.shape, "device": ab.device_facts(ns.gpu), "gpu": ns.gpu, "vllm_version": vllm.__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "arms": arms, "loads": loads,
        "method": {"input_len": ns.input_len, "output_len": ns.output_len, "burst": ns.burst if ns.mode == "serve" else None,
                   "arm_cpus": sorted(arm_cpus) if arm_cpus else "not pinned", "client_cpus": sorted(client_cpus) if client_cpus else "not pinned",
                   "configs": {a: arm_config(a, "<stats_dir>") for a in arms}, "time_hooks": ns.time_hooks, "time_parts": ns.time_parts,
                   "energy": "GPU NVML total-energy counter, read between calls at its steps (measured)",
                   "clocks": "never changed: POWERSAVE_FORCE_DRY_RUN=1, controller dry-run"},
        "calls": [], "notes": []}

    def save() -> None:
        ab.write_json_atomic(out_file, result, indent=None)

    env_gpu = {"CUDA_VISIBLE_DEVICES": str(ns.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    pin = (lambda: os.sched_setaffinity(0, arm_cpus)) if arm_cpus else None
    procs: dict[str, subprocess.Popen] = {}
    conns: dict[str, Any] = {}
    ports: dict[str, int] = {}
    listener = None
    try:
        if ns.mode == "offline":
            addr = f"/tmp/alt-{os.getpid()}.sock"
            listener = Listener(addr, authkey=b"alt")
            for arm in arms:
                stats = f"/tmp/powersave-stats/alt-{ns.mode}-{arm}"
                shutil.rmtree(stats, ignore_errors=True)
                cfg = arm_config(arm, stats)
                cmd = [sys.executable, __file__, "--worker-addr", addr, "--worker-name", arm, "--model", str(model),
                       "--gpu-mem", str(ns.gpu_mem), "--kv-cache-bytes", str(ns.kv_cache_bytes)]
                if cfg:
                    cmd += ["--worker-config", json.dumps(cfg)]
                env = {**os.environ, **ab.GPU_ENV, **env_gpu, "PYTHONPATH": arm_site(arm, ns)}
                if ns.time_hooks:
                    cmd.append("--time-hooks")
                    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the EngineCore (and the hooks) in the worker
                if ns.time_parts:
                    cmd.append("--time-parts")
                logf = open(out_dir / f"server-{arm}.log", "wb")
                procs[arm] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=pin)
            # Accept with a short timeout and check the workers in between: one that dies at start-up
            # is reported as such at once (not after the whole start-up allowance).
            listener._listener._socket.settimeout(5)  # type: ignore[attr-defined]
            deadline = time.monotonic() + 420
            while len(conns) < len(arms):
                dead = [a for a, p in procs.items() if p.poll() is not None and a not in conns]
                if dead:
                    raise RuntimeError(f"worker(s) {dead} exited during start-up (see server-<arm>.log)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers {sorted(set(arms) - set(conns))} not ready after 420 s")
                try:
                    c = listener.accept()
                except OSError:  # the accept timeout (socket.timeout)
                    continue
                hello = c.recv()
                conns[hello["ready"]] = c
                ab.log(f"worker {hello['ready']} ready")
        else:
            for i, arm in enumerate(arms):
                stats = f"/tmp/powersave-stats/alt-{ns.mode}-{arm}"
                shutil.rmtree(stats, ignore_errors=True)
                cfg = arm_config(arm, stats)
                extra = ["--plugin", "powersave", "--additional-config", json.dumps(cfg)] if cfg else []
                port = ab.job_port(ns.gpu, 40 + i)
                procs[arm] = ab.start_server(arm, model, port, [*extra, "--kv-cache-memory-bytes", str(ns.kv_cache_bytes)],
                                             arm_site(arm, ns), out_dir, ns.gpu_mem, env_extra=env_gpu, cpus=arm_cpus)
                ports[arm] = port
            ab.wait_healthy({a: (procs[a], ports[a]) for a in arms}, timeout_s=420)
        result["startup_s"] = time.monotonic() - ab.T0
        ab.log(f"all {len(arms)} arms up after {result['startup_s']:.0f} s")
        # The harness's own NVML reader; each read waits for the counter's next step (aligned edges).
        from loadtests.energy import NvmlEnergy

        counter, why = NvmlEnergy.open([ns.gpu])
        if counter is None:
            raise RuntimeError(f"GPU {ns.gpu}: {why}")

        def counter_j() -> tuple[float, float]:
            t, per_gpu = asyncio.run(counter.aligned_per_gpu_j(max_wait_s=0.3, poll_s=0.001))
            return per_gpu[str(ns.gpu)], t

        def call(arm: str, load: int, cycle: int) -> dict[str, Any]:
            if ns.mode == "offline":
                conns[arm].send((load, cycle, ns.output_len, ns.input_len))
                r = conns[arm].recv()
                if "error" in r:
                    raise RuntimeError(f"{arm}: {r['error']}")
                return r
            from loadtests import BenchConfig, run

            t = time.perf_counter()
            r = run(BenchConfig(base_url=f"http://127.0.0.1:{ports[arm]}", model="model", num_prompts=ns.burst,
                                max_concurrency=load, input_len=ns.input_len, output_len=ns.output_len, energy="none",
                                seed=10_000 + 1000 * load + cycle, label=arm))  # new prompts per (load, cycle)
            return {"s": r.get("duration") or (time.perf_counter() - t), "tokens": r.get("total_output_tokens"),
                    "failed": r.get("failed"), "median_itl_ms": r.get("median_itl_ms"), "median_ttft_ms": r.get("median_ttft_ms")}

        for load in loads:  # warm-up: graphs and compile paths of this batch size, prefix cache of nothing reused
            for arm in arms:
                call(arm, load, -1 - load)
        cycle = 0
        round_s = 0.0
        while True:
            for load in loads:
                order = arms[cycle % len(arms):] + arms[:cycle % len(arms)]
                for arm in order:
                    if time.monotonic() - ab.T0 > ns.budget_s - round_s:
                        raise TimeoutError
                    t_round = time.monotonic()
                    e0, t0 = counter_j()
                    r = call(arm, load, cycle)
                    e1, t1 = counter_j()
                    rec = {"cycle": cycle, "load": load, "arm": arm, **r, "energy_j": e1 - e0, "energy_window_s": t1 - t0}
                    result["calls"].append(rec)
                    round_s = max(round_s, time.monotonic() - t_round)
            if cycle % 5 == 4:
                result["summary"] = summarize(result["calls"], arms, loads)
                save()
                ab.log(f"cycle {cycle}: " + "; ".join(
                    f"{k} thr {v['throughput_ratio'].get('median', float('nan')):.4f} J/tok {v['j_per_token_ratio'].get('median', float('nan')):.4f}"
                    for k, v in result["summary"].items()))
            cycle += 1
    except TimeoutError:
        ab.log("budget reached")
    except Exception as exc:
        result["notes"].append(f"error: {type(exc).__name__}: {exc}")
        ab.log("error:", repr(exc))
    finally:
        result["summary"] = summarize(result["calls"], arms, loads)
        if ns.time_hooks:
            result["hooks"] = hook_summary(result["calls"])
            for k, v in result["hooks"].items():
                ab.log(f"hooks {k}: {json.dumps(v)}")
        for arm, c in conns.items():
            try:
                c.send(None)
            except Exception:
                pass
        # Stopped at once, not one after another: each may take up to 25 s, and the job's margin is 30 s.
        stoppers = [threading.Thread(target=ab.stop, args=(p,)) for p in procs.values()]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        if listener is not None:
            listener.close()
        snaps = {}
        for arm in arms:
            f = Path(f"/tmp/powersave-stats/alt-{ns.mode}-{arm}/rank0.json")
            if f.exists():
                snaps[arm] = json.loads(f.read_text())
        result["plugin_snapshots"] = snaps
        save()
        for k, v in result["summary"].items():
            ab.log(f"{k}: cycles {v['cycles']} throughput {json.dumps(v['throughput_ratio'])} J/token {json.dumps(v['j_per_token_ratio'])}")
        ab.log(f"saved {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
