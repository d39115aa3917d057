"""Per-step host cost of the plugin's hooks (CPU, in-process): the overhead guard.

vLLM's engine loop is host-bound for small models (a 0.5B decode step is ~2.2 ms on the H200,
``docs/results/h200-vllm.md``), so every microsecond the plugin adds per step shows up in throughput
(10 us ~ 0.45 %). For 8 / 64 / 256 decoding requests: the aggregate step classification, the worker
hook alone (:data:`HOOKS`), the whole step path with the H200 A/B's settings minus the bare loop
(:data:`STEPS`), the scheduler wrapper alone (:data:`SCHEDULERS`); medians over ``--repeats`` fresh
child processes, alternating with the plugin code of ``--baseline-rev REV`` where given. Prints each
round's whole step path per side (``hook-overhead-split.md`` pairs them), then the medians as Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.device import utc_now

REPO = Path(__file__).resolve().parents[1]
NS = (8, 64, 256)
WAITING = 200
#: The H200 A/B's chunk table: chunks only from a million rows on, i.e. never, but the hook is installed.
AB_TABLE = [{"min_rows": 1_000_000, "chunks": 2}]
#: The worker hook alone (``on_step_start`` + ``on_step_end``): key, label, energy meter.
HOOKS = [
    ("hook_meter_off_us", "worker hook alone, meter off", "off"),
    ("hook_meter_simulated_us", "worker hook alone, simulated meter", "simulated"),
]
#: The whole step path with the A/B settings: key, label, energy meter, waiting requests.
STEPS = [
    ("ab_step_us", "**whole step path, A/B settings, meter off, empty queue**", "off", 0),
    ("ab_step_waiting_us", f"whole step path, A/B settings, {WAITING} waiting (look-ahead scan)", "off", WAITING),
    ("ab_step_stub_nvml_us", "whole step path, A/B settings, energy account (stub NVML meter)", "stub-nvml", 0),
]
#: The scheduler wrapper alone (the EngineCore's side; independent of the batch): key, label, waiting requests, look-ahead.
SCHEDULERS = [
    ("sched_empty_us", "empty waiting queue", 0, True),
    ("sched_waiting_lookahead_on_us", f"{WAITING} waiting, look-ahead on (first 64 scanned)", WAITING, True),
    ("sched_waiting_lookahead_off_us", f"{WAITING} waiting, look-ahead off", WAITING, False),
]


def ab_settings(stats_dir: str, meter: str = "off", lookahead: bool = True) -> dict:
    clocks = {"backend": "dry-run", "min_dwell_ms": 200, "lookahead": lookahead}
    clocks["presets"] = {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}}
    return {"stats_dir": stats_dir, "trace_steps": True, "chunking": {"table": AB_TABLE}, "clocks": clocks, "energy": {"meter": meter}}


# Child: measures the vllm_powersave package first on sys.path.
def per_call_us(fn, reps: int = 2000, rounds: int = 7, after=None) -> float:
    """Median over ``rounds`` of the time per call; ``after()`` runs inside each round's timing."""
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if after is not None:
            after()
        ts.append((time.perf_counter() - t) / reps * 1e6)
    return st.median(ts)


def sched(n: int):
    """A scheduler output of ``n`` decoding requests, in the shape the plugin's step hook reads."""
    import types

    ids = [f"r{i}" for i in range(n)]
    cached = types.SimpleNamespace(req_ids=ids, num_computed_tokens=[100 + i for i in range(n)], num_output_tokens=[5] * n)
    so = types.SimpleNamespace(scheduled_new_reqs=[], scheduled_spec_decode_tokens={}, total_num_scheduled_tokens=n, finished_req_ids=set())
    so.scheduled_cached_reqs, so.num_scheduled_tokens = cached, {r: 1 for r in ids}
    return so


def stub_nvml():
    """``(access, use)``: ``access`` stands a stub GPU in for NVML (runtime.NvmlAccess: a meter read
    only by the background tick, as the real one), so the energy account's per-step bookkeeping runs
    as with ``meter: nvml`` on a GPU; ``use(on)`` makes the runner a CUDA device (on) or a CPU one
    (off, the start)."""
    import types

    import vllm_powersave.vllm_compat as vc
    from vllm_powersave.energy.meters import EnergyMeter
    from vllm_powersave.runtime import NvmlAccess

    cpu_ident = lambda r: {"rank": 0, "device_type": "cpu", "device_index": None}
    gpu_ident = lambda r: {"rank": 0, "device_type": "cuda", "device_index": 0}
    vc.runner_identity = cpu_ident

    class StubNvmlMeter(EnergyMeter):
        def __init__(self, gpu_id: str) -> None:
            self.gpu_id = gpu_id

        def energy_j(self) -> float:
            return time.monotonic() * 300.0

        def power_w(self) -> float:
            return 300.0

        def sm_clock_mhz(self) -> int:
            return 1980

    access = NvmlAccess(
        init=lambda: types.SimpleNamespace(),
        gpu_for_device=lambda index, nvml: types.SimpleNamespace(uuid="GPU-bench", is_mig=lambda: False),
        open_meter=lambda gpu, sample_period_s: StubNvmlMeter(gpu.uuid),
    )

    def use(on: bool) -> None:
        vc.runner_identity = gpu_ident if on else cpu_ident

    return access, use


def stand_in_runners() -> tuple[type, type]:
    """``(BareRunner, Runner)``: stand-ins for vLLM's runner class, the second wrapped by the
    plugin's own installer."""
    import types

    import vllm_powersave.vllm_compat as vc
    from vllm_powersave import runtime

    class BareRunner:
        def execute_model(self, scheduler_output, *args, **kwargs):
            return None  # V1 with sampling: the output comes from sample_tokens

        def sample_tokens(self, *args, **kwargs):
            return 0

    class Runner(BareRunner):
        execute_model = BareRunner.execute_model
        sample_tokens = BareRunner.sample_tokens

    mod = sys.modules["powersave_bench_runner"] = types.ModuleType("powersave_bench_runner")
    mod.Runner = Runner
    vc.RUNNER_CLASSES = (("bench", mod.__name__, "Runner"),)
    assert vc.install_step_hooks(runtime.on_step_start, runtime.on_step_end) == ["bench"]
    return BareRunner, Runner


def scheduler(so, waiting: int, wrapped: bool):
    """A stand-in scheduler returning ``so`` with ``waiting`` requests queued; ``wrapped``: a fresh
    class wrapped by the plugin's installer as if it were vLLM's (its look-ahead reads the settings anew)."""
    import types
    from collections import deque

    import vllm_powersave.vllm_compat as vc
    from vllm_powersave import runtime

    class Scheduler:
        def schedule(self, *args, **kwargs):
            return so

        def add_request(self, request, *args, **kwargs):
            self.waiting.append(request)

    if wrapped:
        m = types.ModuleType("vllm.v1.core.sched.scheduler")
        m.Scheduler, saved = Scheduler, sys.modules.get(m.__name__)
        sys.modules[m.__name__] = m
        vc.forget_patches("sched.schedule", "sched.add_request")
        try:
            assert vc.install_scheduler_hooks(runtime.on_arrival)
        finally:
            del sys.modules[m.__name__]
            if saved is not None:
                sys.modules[m.__name__] = saved
    s = Scheduler()
    s.waiting = deque(types.SimpleNamespace(num_prompt_tokens=300 + i, num_computed_tokens=0) for i in range(waiting))
    return s


def head(h):
    """The LM-head GEMM's stand-in."""
    return h


def runtime_for(settings: dict, nvml):
    """The process's runtime for ``settings``, its publisher thread stopped: the publisher's
    per-step work is timed in the measuring thread."""
    from vllm_powersave import runtime
    from vllm_powersave.settings import ENV_SETTINGS_JSON, load_settings

    s = load_settings(settings, env={})
    os.environ[ENV_SETTINGS_JSON] = s.model_dump_json()  # chunk_policy() and the scheduler read it
    runtime.set_chunk_policy(None)
    rt = runtime.WorkerRuntime(object(), s, nvml=nvml)
    rt.stop_publisher_thread()
    runtime.install_runtime(rt)
    return rt


def step_us(so, n: int, d: str, runner: type, stub, meter: str = "off", waiting: int = 0) -> float:
    """The whole step path with the A/B settings: scheduler, runner and LM-head hooks, and the
    publisher's trace flush (and account tick) amortised per step."""
    import torch

    from vllm_powersave import runtime

    access, use_stub = stub
    on = meter == "stub-nvml"
    use_stub(on)
    rt = runtime_for(ab_settings(d, "nvml" if on else meter), access)
    hs = torch.empty((n, 8))
    s, r = scheduler(so, waiting, True), runner()
    schedule, execute, sample, chunked = s.schedule, r.execute_model, r.sample_tokens, runtime.chunked_head

    def step():
        out = schedule()
        execute(out)
        chunked(head, hs)
        sample()

    def publisher():  # what the publisher thread does with these steps' records
        rt.publisher.flush_trace()
        if rt.account is not None:
            rt.account.tick()

    # Past the 200 ms dwell: the steady state of a serving engine (8 and 64 requests: the decode
    # clock applied; 256 tokens are compute-bound: default clock; with 200 waiting, 64 x ~330
    # prompt tokens exceed prefill_burst_tokens: the look-ahead holds the prefill clock).
    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end:
        for _ in range(100):
            step()
        publisher()
    us = per_call_us(step, after=publisher)
    rt.close()
    runtime.install_runtime(None)
    use_stub(False)
    return us


def bare_step_us(so, n: int, runner: type) -> float:
    """The same loop without the plugin."""
    import torch

    hs = torch.empty((n, 8))
    s, r = scheduler(so, 0, False), runner()
    schedule, execute, sample = s.schedule, r.execute_model, r.sample_tokens

    def step():
        out = schedule()
        execute(out)
        head(hs)
        sample()

    return per_call_us(step)


def child() -> dict:
    import vllm_powersave.vllm_compat as vc
    from vllm_powersave.phases import classify
    from vllm_powersave.runtime import WorkerRuntime
    from vllm_powersave.settings import ENV_SETTINGS_JSON, load_settings

    stub = stub_nvml()
    vc.runner_model_cost = lambda r: {"n_params": 4.9e8, "vocab_params": 1.36e8, "kv_bytes_per_token": 12288.0, "weight_bytes": 9.9e8}
    bare_runner, runner = stand_in_runners()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in NS:
            so = sched(n)
            row = {
                "decode_requests": n,
                "classify_per_request_us": per_call_us(lambda: classify(vc.step_requests(so)), reps=max(200, 16000 // n)),
            }
            row["classify_aggregate_us"] = per_call_us(lambda: vc.step_info(so))
            for key, _, meter in HOOKS:
                settings = {"clocks": {"presets": {"decode": {"sm_clock_mhz": 1200}}}, "energy": {"meter": meter}, "stats_dir": d}
                rt = WorkerRuntime(object(), load_settings(settings, env={}))
                row[key] = per_call_us(lambda rt=rt, so=so: (rt.on_step_start(so), rt.on_step_end()))
                rt.close()
            row["bare_step_us"] = bare = bare_step_us(so, n, bare_runner)
            for key, _, meter, waiting in STEPS:
                row[key] = step_us(so, n, d, runner, stub, meter, waiting) - bare
            rows.append(row)
        so, sch = sched(8), {}
        for key, _, waiting, lookahead in SCHEDULERS:
            os.environ[ENV_SETTINGS_JSON] = load_settings(ab_settings(d, lookahead=lookahead), env={}).model_dump_json()
            bare = per_call_us(scheduler(so, waiting, False).schedule, reps=5000)
            sch[key] = per_call_us(scheduler(so, waiting, True).schedule, reps=5000) - bare
    return {"rows": rows, "scheduler": sch}


# Parent: child processes of this tree (and of --baseline-rev), alternating.
def run_child(tree: Path) -> dict:
    # cwd and PYTHONPATH first: the plugin code of ``tree``; this repository after it for ``benchmarks``.
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}"}
    for k in ("POWERSAVE_SETTINGS_JSON", "POWERSAVE_CONFIG", "POWERSAVE_FORCE_DRY_RUN"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "benchmarks.hook_overhead", "--child"]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"error: child for {tree} failed (rc {p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(line[7:])


def median_of(results: list[dict]) -> dict:
    rows = [
        {k: (v if k == "decode_requests" else st.median(r["rows"][i][k] for r in results)) for k, v in r0.items()}
        for i, r0 in enumerate(results[0]["rows"])
    ]
    return {"rows": rows, "scheduler": {k: st.median(r["scheduler"][k] for r in results) for k in results[0]["scheduler"]}}


def markdown(doc: dict) -> str:
    sides = [s for s in ("before", "after") if s in doc]
    row_labels = [("classify_aggregate_us", "aggregate classification (`step_info`)"), *[x[:2] for x in HOOKS + STEPS]]

    def table(head: str, suffix: str, labels: list, cell) -> list[str]:
        return [f"| {head} | " + " | ".join(s + suffix for s in sides) + " |", "|---|" + "---|" * len(sides)] + [
            f"| {label} | " + " | ".join(cell(doc[s], k) for s in sides) + " |" for k, label, *_ in labels
        ]

    md = [
        "# Plugin host cost per engine step (measured, CPU)\n",
        f"- When: {doc['date_utc']} (UTC). Where: {doc['machine']} (a CPU micro-benchmark: no GPU, no vLLM; the scheduler, "
        "runner and LM head are do-nothing stand-ins wrapped by the plugin's own installers).",
        f"- What ran: `python -m benchmarks.hook_overhead` at `{doc['head']}`; {doc['method']}."
        + (f" Before = the plugin code of `{doc['baseline_rev'][:10]}`." if doc.get("baseline_rev") else ""),
        "\n## Per step (µs), decoding requests 8 / 64 / 256\n",
        *table("what", " (8 / 64 / 256)", row_labels, lambda side, k: " / ".join(f"{r[k]:.2f}" for r in side["rows"])),
        "\n## Scheduler wrapper alone (µs added to `Scheduler.schedule`)\n",
        *table("waiting queue", "", SCHEDULERS, lambda side, k: f"{side['scheduler'][k]:.2f}"),
    ]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline-rev", default=None, help="git revision whose plugin code runs as 'before'")
    ap.add_argument("--repeats", type=int, default=3, help="child processes per side (default 3)")
    ap.add_argument("--no-write", action="store_true", help=argparse.SUPPRESS)  # printing is the only mode (the split record's command)
    ns = ap.parse_args(argv)
    if ns.child:
        print("RESULT " + json.dumps(child()), flush=True)
        return 0
    runs: dict[str, list] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("after", REPO)]
        if ns.baseline_rev:
            base = Path(tmp) / "baseline"
            base.mkdir()
            arch = subprocess.run(["git", "-C", str(REPO), "archive", ns.baseline_rev, "vllm_powersave"], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(base)], input=arch.stdout, check=True)
            trees.insert(0, ("before", base))
        for i in range(ns.repeats):
            for side, tree in trees if i % 2 == 0 else trees[::-1]:  # alternating which side goes first
                r = run_child(tree)
                runs[side].append(r)
                print(f"round {i + 1} {side}: " + ", ".join(f"n={x['decode_requests']} step {x['ab_step_us']:.2f} us" for x in r["rows"]))
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    doc = {"date_utc": utc_now(), "machine": machine, "head": git.stdout.strip(), "baseline_rev": ns.baseline_rev}
    doc["method"] = f"medians of 7 rounds x 2000 calls per child process, then over {ns.repeats} child processes per side; "
    doc["method"] += "step figures are the wrapped loop minus the bare loop"
    doc.update({side: median_of(rs) for side, rs in runs.items() if rs})
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
