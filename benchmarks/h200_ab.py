#!/usr/bin/env python3
"""Stock vLLM vs vLLM + powersave on one GPU, through the OpenAI server and our load-test harness.

Runs ON the GPU machine (see ``benchmarks/README.md``). Both servers stay resident on the same GPU
for the whole run (each with ``--gpu-memory-utilization`` ~0.4), and load windows alternate
A B A B ... so that drift (temperature, other tenants) hits both equally. Energy of a window is the
GPU's NVML total-energy counter (whole GPU, so the resting engine's idle draw is in both A's and B's
windows alike). Clocks are never changed: this script refuses to run unless
``POWERSAVE_FORCE_DRY_RUN=1``, and the plugin's controller runs in dry-run, recording decisions.

Output: one JSON file (``--out``) with the device facts, the idle window, every load window (harness
summary), a 10 Hz power/SM-clock timeline and the plugin's per-step trace (phases, tokens, dry-run
clock decisions), written incrementally so that a run cut short still returns what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

T0 = time.monotonic()
SERVE_EXTRA: list[str] = []


def log(*a: object) -> None:
    print(f"[ab +{time.monotonic() - T0:6.1f}s]", *a, flush=True)


class Sampler(threading.Thread):
    """NVML power (W), SM clock (MHz) and energy counter (mJ) at ~10 Hz; read-only."""

    def __init__(self, index: int | list[int] = 0, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        import pynvml as N

        N.nvmlInit()
        idx = index if isinstance(index, list) else [index]
        # Several GPUs (TP): power and energy summed, SM clock of the first, per-GPU power kept.
        self.N, self.hs, self.period = N, [N.nvmlDeviceGetHandleByIndex(i) for i in idx], period_s
        self.rows: list[tuple[float, float, int, int]] = []
        self.per_gpu_w: list[tuple[float, ...]] = []
        self.stop_ev = threading.Event()

    def run(self) -> None:
        N, hs = self.N, self.hs
        while not self.stop_ev.is_set():
            try:
                ws = [N.nvmlDeviceGetPowerUsage(h) / 1000.0 for h in hs]
                self.rows.append((time.monotonic(), sum(ws), N.nvmlDeviceGetClockInfo(hs[0], N.NVML_CLOCK_SM),
                                  sum(N.nvmlDeviceGetTotalEnergyConsumption(h) for h in hs)))
                self.per_gpu_w.append(tuple(ws))
            except Exception:
                pass
            time.sleep(self.period)

    def window(self, t0: float, t1: float) -> dict:
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        if len(rows) < 2:
            return {}
        clocks = sorted(r[2] for r in rows)
        return {"avg_power_w": sum(r[1] for r in rows) / len(rows), "median_sm_clock_mhz": clocks[len(clocks) // 2],
                "energy_j_counter": (rows[-1][3] - rows[0][3]) / 1000.0, "seconds": rows[-1][0] - rows[0][0]}


class NullSampler:
    rows: list = []
    per_gpu_w: list = []
    stop_ev = threading.Event()

    def start(self) -> None:
        pass

    def window(self, t0: float, t1: float) -> dict:
        return {}


def device_facts(index: int = 0) -> dict:
    import pynvml as N

    try:
        N.nvmlInit()
    except Exception as exc:
        return {"name": f"no NVML ({exc})"}
    try:
        h = N.nvmlDeviceGetHandleByIndex(index)
        name = N.nvmlDeviceGetName(h)
        return {"name": name.decode() if isinstance(name, bytes) else name,
                "driver": str(N.nvmlSystemGetDriverVersion()),
                "power_limit_w": N.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0}
    finally:
        N.nvmlShutdown()  # no NVML state left open for run_together's forked clients


def make_model(shape: str, shapes_dir: Path, tok_dir: Path) -> Path:
    d = Path("/tmp/models") / shape
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(shapes_dir / f"{shape}.json", d / "config.json")
    for f in tok_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, d / f.name)
    return d


# NVLink multicast stays off (a program using it can take a shared host's GPUs out of service);
# vLLM's symmetric-memory all-reduce would use it on Hopper, so that path is off too.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
GPU_ENV: dict[str, str] = dict(NO_MULTICAST)


def parse_cpulist(text: str) -> set[int]:
    """CPUs of a kernel cpulist such as ``0-15,32-47`` (sysfs ``local_cpulist``); empty text: none."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus(gpu: int, bus_ids: list[str], sysfs: Path = Path("/sys/bus/pci/devices"),
                   allowed: set[int] | None = None) -> set[int] | None:
    """This GPU's share of the CPUs on its NUMA node, disjoint from the other GPUs' on that node.

    ``bus_ids``: every GPU's PCI bus id in index order (nvidia-smi's ``00000000:18:00.0`` form).
    Where several GPUs share a node (two device jobs run side by side), the node's CPUs are split
    between them in index order, so two jobs never pin servers to the same cores. None where sysfs
    has no locality for the GPU.
    """
    def local(bus: str) -> set[int]:
        f = sysfs / bus.lower()[-12:] / "local_cpulist"
        return parse_cpulist(f.read_text()) if f.exists() else set()

    mine = local(bus_ids[gpu])
    if allowed is not None:
        mine &= allowed
    if not mine:
        return None
    sharing = [i for i, b in enumerate(bus_ids) if local(b) and local(b) == local(bus_ids[gpu])]
    return split_cpus(mine, len(sharing))[sharing.index(gpu)]


def core_groups(cpus: set[int], sysfs_cpu: Path = Path("/sys/devices/system/cpu")) -> list[set[int]]:
    """``cpus`` grouped by physical core (hyperthread siblings together, from sysfs
    ``topology/thread_siblings_list``), in order of their lowest CPU; a CPU without topology
    information is a core of its own."""
    seen: set[int] = set()
    groups = []
    for c in sorted(cpus):
        if c in seen:
            continue
        f = sysfs_cpu / f"cpu{c}" / "topology" / "thread_siblings_list"
        g = (parse_cpulist(f.read_text()) if f.exists() else {c}) & cpus or {c}
        seen |= g
        groups.append(g)
    return groups


def split_cpus(cpus: set[int], n: int, sysfs_cpu: Path = Path("/sys/devices/system/cpu")) -> list[set[int]]:
    """``cpus`` in ``n`` disjoint slices of equal size, whole physical cores each (two servers on two
    hyperthreads of one core would share it), contiguous in core order; the remainder is left unused."""
    groups = core_groups(cpus, sysfs_cpu)
    k = len(groups) // n
    if k == 0:
        raise ValueError(f"cannot split {len(groups)} cores ({len(cpus)} CPUs) between {n} servers")
    return [set().union(*groups[i * k:(i + 1) * k]) for i in range(n)]


def gpu_bus_ids() -> list[str]:
    """PCI bus ids of the GPUs in index order (nvidia-smi, a read-only query)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def server_cpu_sets(gpu: int, n: int) -> list[set[int]] | None:
    """One disjoint CPU set per co-resident server, all on the GPU's NUMA node.

    Why: a host-bound small model's step time depends on where its API server and EngineCore run;
    left to the OS, servers of one A/B land on different cores (and nodes) for the whole run, which
    session 5 suspected behind per-server differences of 10 % in both directions. Pinned, every
    server gets the same number of GPU-local cores of its own. None: no locality known (unpinned).
    """
    try:
        local = gpu_local_cpus(gpu, gpu_bus_ids(), allowed=os.sched_getaffinity(0))
        if not local or len(local) < 2 * n:
            # An API server and an EngineCore busy loop each want a core: fewer would measure the pinning.
            log(f"CPU pinning skipped: {len(local or ())} GPU-local CPUs for {n} servers (2 each needed)")
            return None
        return split_cpus(local, n)
    except Exception as exc:  # pinning is an improvement, never a reason not to measure
        log("CPU pinning unavailable:", exc)
        return None


def start_server(label: str, model: Path, port: int, extra: list[str], pythonpath: str, out: Path, gpu_mem: float,
                 env_extra: dict[str, str] | None = None, cpus: set[int] | None = None) -> subprocess.Popen:
    """``cpus``: the server's CPU affinity, inherited by its EngineCore and worker processes."""
    check_port_free(port)
    extra = [*extra, *SERVE_EXTRA]
    env = {**os.environ, "PYTHONPATH": pythonpath, **GPU_ENV, **(env_extra or {})}  # env_extra wins (a server's own GPU)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "model",
           "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
           "--max-num-seqs", "256", "--gpu-memory-utilization", str(gpu_mem), *extra]
    logf = open(out / f"server-{label}.log", "wb")
    logf.write((" ".join(cmd) + "\n").encode())
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=pin)


def job_port(gpu: int, slot: int) -> int:
    """A port per (first GPU, server slot): device_run.sh runs one job per GPU in parallel, and two
    jobs on one port once sent both jobs' requests to one server (uvicorn's SO_REUSEPORT lets a second
    server bind the same port silently)."""
    return 8000 + 50 * gpu + slot


PROC_NET_TCP = ("/proc/net/tcp", "/proc/net/tcp6")


def tcp_listeners(port: int) -> int:
    """Sockets in LISTEN state on ``port`` (IPv4 and IPv6), from /proc/net/tcp*; -1 where no table is
    readable (a kernel without IPv6 has no tcp6: the IPv4 table still counts)."""
    n, read = 0, 0
    for f in PROC_NET_TCP:
        try:
            lines = Path(f).read_text().splitlines()[1:]
        except OSError:
            continue
        read += 1
        n += sum(1 for ln in lines if (c := ln.split()) and int(c[1].rsplit(":", 1)[1], 16) == port and c[3] == "0A")
    return n if read else -1


def write_json_atomic(path: Path, obj: object, indent: int | None = None) -> None:
    """Write ``obj`` as JSON through a temporary file: a job killed mid-write (the call's time
    limit) leaves the previous, complete file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    tmp.replace(path)


def check_port_free(port: int) -> None:
    """Refuse to start a server on a port something already listens on (RuntimeError)."""
    if tcp_listeners(port) > 0:
        raise RuntimeError(f"port {port} already has a listener: another benchmark job is using it")


def wait_healthy(procs: dict[str, tuple[subprocess.Popen, int]], timeout_s: float) -> None:
    """Wait for /health of every server; RuntimeError if one exits, times out, or shares its port."""
    pending = dict(procs)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for label, (p, port) in list(pending.items()):
            if p.poll() is not None:
                raise RuntimeError(f"server {label} exited with {p.returncode} during start-up")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        if (n := tcp_listeners(port)) > 1:
                            raise RuntimeError(f"server {label}: {n} listeners on port {port}; "
                                               "requests would reach another server")
                        log(f"server {label} healthy")
                        pending.pop(label)
            except RuntimeError:
                raise
            except Exception:
                pass
        time.sleep(1)
    if pending:
        raise RuntimeError(f"servers {sorted(pending)} not healthy after {timeout_s:.0f} s")


def stop(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 5)):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
            p.wait(wait)
        except Exception:
            pass


SUMMARY_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms",
                "gpu_energy_j", "gpu_avg_power_w", "gpu_energy_per_output_token_j", "output_tokens_per_joule",
                "total_tokens_per_joule", "energy_source", "energy_window_s")


def session_processes(server_pid: int) -> list[tuple[int, str, Path]]:
    """``(pid, comm, /proc/<pid>)`` of every process in the server's session (API server, EngineCore, workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) == server_pid:
                out.append((int(d.name), (d / "comm").read_text().strip(), d))
        except OSError:
            continue
    return out


def _together_client(cfg: dict, barrier: Any, box: Any, barrier_s: float) -> None:
    try:
        from loadtests import BenchConfig, run

        barrier.wait(timeout=barrier_s)  # every client starts its window at the same moment
        box.put((cfg["label"], run(BenchConfig(**cfg))))
    except BaseException as exc:  # the parent must hear from every client, whatever happened
        box.put((cfg["label"], {"error": f"{type(exc).__name__}: {exc}"}))


def run_together(cfgs: list[dict], timeout_s: float, after_start: Any = None) -> dict[str, dict]:
    """Run one ``loadtests`` window per config at the same moment, each in its own forked process
    (the clients must not share one event loop or GIL); returns each result by ``label``.

    Every result gets ``first_send_s``: when its first request went out, in seconds after the
    clients were started (CLOCK_MONOTONIC, comparable across processes); equal values mean one shared
    window. Call with no NVML handle or thread open in this process (fork); ``after_start()`` runs
    once the clients are forked (e.g. to start profilers' threads)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("fork")
    barrier, box = ctx.Barrier(len(cfgs)), ctx.Queue()
    # Daemons: a client left behind (the parent gave up waiting) must not keep the job alive.
    kids = [ctx.Process(target=_together_client, args=(c, barrier, box, 120.0), daemon=True) for c in cfgs]
    t_start = time.perf_counter()
    got: dict[str, dict] = {}
    try:
        for k in kids:
            k.start()
        if after_start is not None:
            after_start()
        deadline = time.monotonic() + timeout_s
        while len(got) < len(kids):
            try:
                label, res = box.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                got[label] = res
            except queue.Empty:
                if time.monotonic() > deadline or not any(k.is_alive() for k in kids):
                    break  # a client died without a word, or the window overran: report what came
    finally:
        for k in kids:
            k.join(timeout=5 if len(got) == len(kids) else 0.1)
            if k.is_alive():
                k.kill()
    for c in cfgs:
        got.setdefault(c["label"], {"error": "the client process gave no result"})
    for res in got.values():
        # Request start times count from the client's own t0 (perf_counter, comparable across processes).
        starts = [t for t in res.get("start_times") or () if t is not None]
        t0 = res.get("t0_perf_counter")
        res["first_send_s"] = (t0 - t_start + min(starts)) if starts and t0 is not None else None
    return got


def add_bundle_args(ap: argparse.ArgumentParser) -> None:
    """Where the device scripts find the vLLM bundle, the model shapes and the plugin's wheel."""
    ap.add_argument("--shapes-dir", default=".gpu-bundle/shapes")
    ap.add_argument("--tok-dir", default="/tmp/model_cfg")
    ap.add_argument("--plugin-site", default="/tmp/psite")
    ap.add_argument("--stock-site", default="/tmp/site")


def device_prologue(ns: argparse.Namespace, gpus: str) -> Path | None:
    """The device scripts' common start: the dry-run guard, the plugin's wheel first on ``sys.path``,
    the servers' GPUs (``CUDA_VISIBLE_DEVICES``, PCI bus order), the output folder of ``ns.out``
    and the model directory of ``ns.shape``, which is returned. None: refused (one line printed)."""
    if not dry_run_forced():
        return None
    sys.path[:0] = [ns.plugin_site]
    GPU_ENV.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=gpus)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    return make_model(ns.shape, Path(ns.shapes_dir), Path(ns.tok_dir))


def dry_run_forced() -> bool:
    """The device scripts' guard: clocks may never be set on the shared GPU (one line if not forced)."""
    if os.environ.get("POWERSAVE_FORCE_DRY_RUN") == "1":
        return True
    print("error: refusing to run: POWERSAVE_FORCE_DRY_RUN=1 must be set on a shared GPU", file=sys.stderr)
    return False


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
        out["by_rank"][r] = {"compared_steps": n, "differing_steps": len(diff), "first_differences": [
            {"step": i, "rank0": ref[i], f"rank{r}": other[i]} for i in diff[:10]]}
    out["identical"] = all(v["differing_steps"] == 0 for v in out["by_rank"].values()) and len(set(out["steps_per_rank"].values())) == 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--loads", default="8,64,256")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--idle-window", type=float, default=15.0)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.42)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra vllm serve argument for both servers")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting windows after this (s since start)")
    ap.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                    help="pin each server to its own equal share of the GPU's NUMA-local CPUs (server_cpu_sets)")
    ap.add_argument("--prompt-logprobs", type=int, default=None, help="ask every request for this many prompt logprobs")
    ap.add_argument("--b-chunking", default=None, help="B's LM-head chunk table (JSON list); default: a table that never chunks")
    ap.add_argument("--a-chunking", default=None,
                    help="run A as vLLM + powersave with this chunk table (JSON list) instead of stock vLLM: policy vs none")
    add_bundle_args(ap)
    ap.add_argument("--gpus", default="0", help="NVML/CUDA indices (PCI bus order) the servers use, e.g. 1 or 0,1")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    gpus = [int(x) for x in ns.gpus.split(",")]
    model = device_prologue(ns, ns.gpus)
    if model is None:
        return 2
    SERVE_EXTRA.extend(a for arg in ns.serve_arg for a in arg.split())
    from loadtests import BenchConfig, run

    out_file = Path(ns.out)
    out_dir = out_file.parent
    stats_dir = Path("/tmp/powersave-stats") / ns.shape
    stats_dir_a = Path("/tmp/powersave-stats") / f"{ns.shape}-A"
    for d in (stats_dir, stats_dir_a):
        shutil.rmtree(d, ignore_errors=True)
    never_chunk = [{"min_rows": 1_000_000, "chunks": 2}]
    table_b = json.loads(ns.b_chunking) if ns.b_chunking else never_chunk
    import vllm  # noqa: F401 - version only

    result: dict = {"shape": ns.shape, "device": device_facts(gpus[0]), "gpus": gpus, "serve_args": SERVE_EXTRA, "vllm_version": vllm.__version__,
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "method": {"pairs": ns.pairs, "window_s": ns.window, "input_len": ns.input_len, "output_len": ns.output_len,
                               "order": "A B, B A, A B, ... per pair (A = stock vLLM, B = vLLM + powersave), both servers resident",
                               "energy": "NVML total-energy counter of the whole GPU over each harness window (measured)",
                               "clocks": "never changed: POWERSAVE_FORCE_DRY_RUN=1, controller dry-run"},
                    "idle": {}, "windows": [], "timeline": [], "trace": [], "notes": []}

    def save() -> None:
        write_json_atomic(out_file, result)

    plugin_cfg = {"powersave": {
        "stats_dir": str(stats_dir), "trace_steps": True,
        # Policy active but choosing 1 chunk at every row count seen here (H200: no gain measured).
        "chunking": {"table": table_b},
        "clocks": {"backend": "dry-run", "min_dwell_ms": 200,
                   "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}}},
        "energy": {"meter": "nvml"}}}
    try:
        sampler = Sampler(gpus)
    except Exception as exc:  # no NVML (a CPU dry run of this script): keep going without a timeline
        log("no NVML sampler:", exc)
        sampler = NullSampler()
    sampler.start()
    port_a, port_b = job_port(gpus[0], 1), job_port(gpus[0], 2)
    if ns.a_chunking is None:
        a_args, a_path = [], ns.stock_site
    else:
        # A is the plugin too, same settings but its own chunk table and stats directory.
        cfg_a = {"powersave": {**plugin_cfg["powersave"], "stats_dir": str(stats_dir_a), "trace_steps": False,
                               "chunking": {"table": json.loads(ns.a_chunking)}}}
        a_args, a_path = ["--plugin", "powersave", "--additional-config", json.dumps(cfg_a)], f"{ns.plugin_site}:{ns.stock_site}"
    result["method"]["arms"] = {"A": "stock vLLM" if ns.a_chunking is None else f"vLLM + powersave, chunk table {ns.a_chunking}",
                                "B": f"vLLM + powersave, chunk table {json.dumps(table_b)}"}
    result["method"]["prompt_logprobs"] = ns.prompt_logprobs
    cpu_sets = server_cpu_sets(gpus[0], 2) if ns.pin_cpus else None
    result["method"]["server_cpus"] = ({"A": sorted(cpu_sets[0]), "B": sorted(cpu_sets[1])} if cpu_sets
                                       else "not pinned" + ("" if ns.pin_cpus else " (--no-pin-cpus)"))
    procs = {
        "A": (start_server("A", model, port_a, a_args, a_path, out_dir, ns.gpu_mem, cpus=cpu_sets[0] if cpu_sets else None), port_a),
        "B": (start_server("B", model, port_b, ["--plugin", "powersave", "--additional-config", json.dumps(plugin_cfg)],
                           f"{ns.plugin_site}:{ns.stock_site}", out_dir, ns.gpu_mem, cpus=cpu_sets[1] if cpu_sets else None), port_b),
    }
    try:
        wait_healthy(procs, timeout_s=300)
        result["startup_s"] = time.monotonic() - T0
        # Idle: both engines loaded, no requests.
        time.sleep(3)
        t0 = time.monotonic()
        time.sleep(ns.idle_window)
        result["idle"] = sampler.window(t0, time.monotonic())
        log("idle", result["idle"])
        save()
        stream = not ns.prompt_logprobs  # vLLM returns prompt logprobs only on non-streamed requests
        result["method"]["stream"] = stream  # non-streamed: TTFT = E2E and TPOT = 0
        for load in [int(x) for x in ns.loads.split(",")]:
            for label, (_, port) in procs.items():  # warm-up: compile/graph paths for this batch size
                run(BenchConfig(base_url=f"http://127.0.0.1:{port}", model="model", num_prompts=load, max_concurrency=load,
                                input_len=ns.input_len, output_len=32, energy="none", label=f"warm-{label}",
                                prompt_logprobs=ns.prompt_logprobs, stream=stream))
            for pair in range(ns.pairs):
                # A B, B A, A B, ...: a cost of going first or second (a neighbour's leftovers, drift
                # within a pair) falls on both servers equally over the pairs.
                order = list(procs.items()) if pair % 2 == 0 else list(reversed(procs.items()))
                for label, (_, port) in order:
                    if time.monotonic() - T0 > ns.budget_s:
                        result["notes"].append(f"budget reached before load {load} pair {pair} {label}")
                        raise TimeoutError
                    t0 = time.monotonic()
                    res = run(BenchConfig(base_url=f"http://127.0.0.1:{port}", model="model", num_prompts=20000,
                                          max_concurrency=load, input_len=ns.input_len, output_len=ns.output_len,
                                          duration_s=ns.window, energy="nvml", gpus=gpus, seed=pair, label=f"{label}-{load}-{pair}",
                                          prompt_logprobs=ns.prompt_logprobs, stream=stream))
                    t1 = time.monotonic()
                    if not res.get("completed"):  # a window of failures is no measurement: stop and say why
                        errs = res.get("errors") or []
                        raise RuntimeError(f"load {load} pair {pair} {label}: 0 of {res.get('failed')} requests "
                                           f"completed; first error: {next((e for e in errs if e), None)}")
                    w = {"server": label, "load": load, "pair": pair, "t0": t0, "t1": t1, **{k: res.get(k) for k in SUMMARY_KEYS},
                         "sampler": sampler.window(t0, t1)}
                    result["windows"].append(w)
                    log(f"load {load} pair {pair} {label}: {w['output_throughput']:.0f} tok/s, "
                        f"{w['output_tokens_per_joule']} tok/J, {w['gpu_avg_power_w']} W")
                    save()
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
        result["timeline_per_gpu_w"] = [tuple(round(w, 1) for w in ws) for ws in sampler.per_gpu_w[::2]] if len(gpus) > 1 else []
        traces = {}
        for f in sorted(stats_dir.glob("trace-rank*.jsonl")):
            traces[f.stem.removeprefix("trace-rank")] = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        result["trace"] = traces.get("0", next(iter(traces.values()), []))
        if len(traces) > 1:
            result["decision_streams"] = compare_decision_streams(traces)
        snaps = {}
        for f in sorted(stats_dir.glob("rank*.json")):
            snaps[f.stem.removeprefix("rank")] = json.loads(f.read_text())
        result["plugin_snapshot"] = snaps.get("0", next(iter(snaps.values()), {}))
        result["plugin_snapshots_by_rank"] = snaps
        if ns.a_chunking is not None:
            result["plugin_a_snapshots_by_rank"] = {f.stem.removeprefix("rank"): json.loads(f.read_text())
                                                    for f in sorted(stats_dir_a.glob("rank*.json"))}
        save()
        log(f"saved {out_file} ({out_file.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
