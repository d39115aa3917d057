#!/usr/bin/env python3
"""The load-test harness's own overhead (measured, CPU): two parts, one run.

(a) Requests/s the harness drives from ONE core against the fake server: the harness runs in a child
    process pinned to CPU 0 (``os.sched_setaffinity``), the fake server (``loadtests.fake_server``,
    zero TTFT/ITL) in another process pinned to CPU 1. Closed loop, streaming, 16 output tokens per
    request. Besides requests/s, the harness's CPU time per request is recorded: if the harness core
    is not saturated (utilisation < ~95 %), the server side was the limit and ``1 / cpu-s per
    request`` is the harness's own ceiling on one core.

(b) Our harness vs ``vllm bench serve`` (the same vLLM from .venv) on one CPU vLLM server (stock, no
    plugin, tiny model) and the same workload: a synthetic ShareGPT-format file (identical prompt
    selection in both tools: ``tests/test_loadtests_shapes.py::test_sharegpt_selection_equals_vllm_bench_serve``),
    the model's own tokenizer directory (offline), fixed output length with ``ignore_eos``, greedy
    sampling in both (``vllm bench serve --temperature 0``; ours always sends temperature 0), closed
    loop. Runs are interleaved A B, B A, ... (A = ours, B = vllm bench) because the 2-core machine is
    shared and noisy; per pair the ratios ours / vllm of output throughput and median TTFT are taken,
    and reported with their spread and 95 % t-interval. The vLLM server runs on one core and each client
    run on the other (:func:`server_pinning`), after discarded warm-up runs of both tools; ``--only-b2``
    re-runs this part alone and merges it into the existing result file.

(b2c) The same comparison with both tools at the same time (``--only-b2-concurrent``, merged into the
    existing file): each at half the concurrency with the same requests, on a server without prefix
    caching, so that the server's drift is common to both and cancels in each pair's ratio; the two
    measured windows' overlap is recorded per pair (:func:`concurrent_pairs`).

Writes docs/results/harness-overhead.{json,md}. Usage::

    .venv/bin/python benchmarks/harness_overhead.py [--pairs 5] [--skip-vllm | --only-b2 | --only-b2-concurrent] [--no-pin]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import platform
import random
import re
import resource
import statistics as st
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.ab import ratio_ci  # noqa: E402
from loadtests.datasets import WORDS  # noqa: E402

PY = sys.executable

_HARNESS_CHILD = r"""
import json, os, sys, time
os.sched_setaffinity(0, {cpu})
from loadtests import BenchConfig, run
cfg = BenchConfig(base_url={url!r}, num_prompts={n}, max_concurrency={conc}, input_len=16, output_len=16,
                  num_warmups=50, progress=False, seed=0)
c0, w0 = time.process_time(), time.perf_counter()
r = run(cfg)
cpu, wall = time.process_time() - c0, time.perf_counter() - w0
print(json.dumps({{"completed": r["completed"], "failed": r["failed"], "duration_s": r["duration"], "wall_s": wall,
                  "request_throughput": r["request_throughput"], "output_throughput": r["output_throughput"],
                  "harness_cpu_s": cpu, "median_ttft_ms": r["median_ttft_ms"]}}))
"""


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (s), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fake_server_part(n: int, conc: int, reps: int) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    harness_cpu, server_cpu = cpus[0], cpus[1 % len(cpus)]
    srv = subprocess.Popen([PY, "-m", "loadtests.fake_server", "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                           preexec_fn=lambda: os.sched_setaffinity(0, {server_cpu}))
    try:
        assert srv.stdout is not None
        url = srv.stdout.readline().strip()
        runs = []
        for _ in range(reps):
            s0 = _proc_cpu_s(srv.pid)
            p = subprocess.run([PY, "-c", _HARNESS_CHILD.format(cpu={harness_cpu}, url=url, n=n, conc=conc)], cwd=REPO,
                               capture_output=True, text=True, timeout=600, check=True)
            r = json.loads(p.stdout.strip().splitlines()[-1])
            # CPU shares are over the whole run() call (warm-ups, checks, measured window, teardown), the
            # span both CPU times cover; CPU per request counts the 50 warm-ups too (same size).
            r["server_cpu_s"] = _proc_cpu_s(srv.pid) - s0
            r["harness_cpu_utilization"] = r["harness_cpu_s"] / r["wall_s"]
            r["server_cpu_utilization"] = r["server_cpu_s"] / r["wall_s"]
            r["harness_cpu_ms_per_request"] = 1000 * r["harness_cpu_s"] / (r["completed"] + 50)
            runs.append(r)
            print(f"[fake] {r['request_throughput']:.0f} req/s, harness core {100 * r['harness_cpu_utilization']:.0f} %, "
                  f"server core {100 * r['server_cpu_utilization']:.0f} %", flush=True)
    finally:
        srv.terminate()
        srv.wait(10)
    return {
        "config": {"num_prompts": n, "max_concurrency": conc, "input_len_words": 16, "output_tokens": 16, "stream": True,
                   "fake_server": "loadtests.fake_server, TTFT 0, ITL 0, own process", "harness_cpu": harness_cpu,
                   "server_cpu": server_cpu, "repetitions": reps},
        "runs": runs,
        "req_per_s_median": st.median(r["request_throughput"] for r in runs),
        "harness_cpu_ms_per_request_median": st.median(r["harness_cpu_ms_per_request"] for r in runs),
        "harness_cpu_utilization_median": st.median(r["harness_cpu_utilization"] for r in runs),
        "server_cpu_utilization_median": st.median(r["server_cpu_utilization"] for r in runs),
    }


def _sharegpt_file(path: Path, n: int, words: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    data = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join(rng.choice(WORDS) for _ in range(words))},
        {"from": "gpt", "value": " ".join(rng.choice(WORDS) for _ in range(words))}]} for i in range(n)]
    path.write_text(json.dumps(data))


def _tiny_model() -> Path:
    from vllm_powersave.modelgen import make_model

    model = REPO / ".models" / "qwen2-tiny"
    if not (model / "config.json").exists():
        make_model(model, "qwen2-tiny")
    return model


def _tool_cmds(base_url: str, model: Path, data: Path, n: int, conc: int, out_len: int,
               workdir: Path, rate: float | None = None, ours_trust_env: bool = False) -> tuple[list[str], list[str], dict[str, str]]:
    """(our command, vllm bench serve's command, their environment) for the same workload; each command
    still needs its result file (ours: ``--result-json``, vllm bench: ``--result-filename``).
    ``rate``: Poisson arrivals at this many requests/s in both tools (``conc`` then only caps them)."""
    ours_cmd = [PY, "-m", "loadtests", "--base-url", base_url, "--model", "model", "--dataset", f"sharegpt:{data}",
                "--tokenizer", str(model), "--sharegpt-output-len", str(out_len), "--num-prompts", str(n),
                "--max-concurrency", str(conc), "--num-warmups", "1", "--seed", "0", "--no-progress"]
    # vLLM's CLI through the launcher (the CPU build's `vllm` script is the same): works where the
    # environment has no `vllm` script, e.g. the H200 bundle on PYTHONPATH.
    vllm_cmd = [PY, "-m", "vllm_powersave.launcher", "bench", "serve", "--backend", "openai", "--base-url", base_url,
                "--endpoint", "/v1/completions", "--model", "model", "--tokenizer", str(model), "--dataset-name", "sharegpt",
                "--dataset-path", str(data), "--sharegpt-output-len", str(out_len), "--num-prompts", str(n),
                "--max-concurrency", str(conc), "--seed", "0", "--ignore-eos", "--temperature", "0", "--num-warmups", "1",
                "--disable-tqdm",
                "--save-result", "--result-dir", str(workdir)]
    if ours_trust_env:
        ours_cmd = ours_cmd + ["--trust-env"]  # vllm bench's session reads proxies and netrc per request
    if rate is not None:
        arrivals = ["--request-rate", f"{rate:g}", "--burstiness", "1"]  # gamma shape 1: Poisson in both tools
        ours_cmd, vllm_cmd = ours_cmd + arrivals, vllm_cmd + arrivals
    return ours_cmd, vllm_cmd, {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def interleaved(tag: str, base_url: str, model: Path, data: Path, pairs: int, n: int, conc: int, out_len: int,
                workdir: Path, client_cpus: set[int] | None = None, warmup_runs: int = 0,
                on_pair: Callable[[list[dict[str, Any]]], None] | None = None,
                deadline: float | None = None) -> list[dict[str, Any]]:
    """``pairs`` x (ours and vllm bench serve, alternating which goes first) on one server with the same
    workload; per-pair ratios.

    ``client_cpus``: both tools run with this affinity. ``warmup_runs``: that many discarded (ours, vllm)
    runs first, so the first pair does not pay for the server's first-request costs. ``on_pair``: called
    with the pairs so far after each one. ``deadline`` (``time.monotonic``): no pair starts after it.
    """
    ours_cmd, vllm_cmd, env = _tool_cmds(base_url, model, data, n, conc, out_len, workdir)
    pin = (lambda: os.sched_setaffinity(0, client_cpus)) if client_cpus else None
    runs: list[dict[str, Any]] = []
    last_pair_s = 0.0  # a pair that cannot finish before the deadline is not started
    for i in range(-warmup_runs, pairs):
        t_pair = time.monotonic()
        if deadline is not None and i >= 0 and time.monotonic() + last_pair_s > deadline:
            print(f"[{tag}] time budget reached after {len(runs)} pair(s)", flush=True)
            break
        # ours first in even pairs, vllm bench first in odd ones: whatever going first or second
        # costs on this server (measured: a few % either way) falls on both tools equally.
        order = ("ours", "vllm") if i % 2 == 0 else ("vllm", "ours")
        pair: dict[str, Any] = {"loadavg_1m": os.getloadavg()[0], "first": order[0]}
        for tool in order:
            out = workdir / f"{tag}-{tool}-{i}.json"
            cmd = ours_cmd + ["--result-json", str(out)] if tool == "ours" else vllm_cmd + ["--result-filename", out.name]
            t = time.time()
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env, preexec_fn=pin)
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            # The tool's whole CPU time (start-up, dataset, warm-up and the run): a client that needs
            # more of its one core than the run lasts cannot keep up with the stream it measures.
            cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            if p.returncode != 0:
                raise SystemExit(f"error: {tool} run {i} failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
            r = json.loads(out.read_text())
            if i < 0:
                print(f"[{tag}] warm-up {tool}: {r['output_throughput']:.1f} tok/s, TTFT p50 {r['median_ttft_ms']:.1f} ms", flush=True)
                continue
            pair[tool] = {k: r.get(k) for k in ("completed", "failed", "duration", "total_input_tokens",
                                               "total_output_tokens", "request_throughput", "output_throughput",
                                               "median_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "median_itl_ms")}
            pair[tool]["wall_s"] = time.time() - t
            pair[tool]["client_cpu_s"] = cpu_s
            print(f"[{tag}] pair {i} {tool}: {r['output_throughput']:.1f} tok/s, TTFT p50 {r['median_ttft_ms']:.1f} ms, "
                  f"TPOT p50 {r['median_tpot_ms']:.2f} ms, in/out tokens {r['total_input_tokens']}/{r['total_output_tokens']}, "
                  f"client CPU {cpu_s:.1f} s of {pair[tool]['wall_s']:.1f} s wall", flush=True)
        if i < 0:
            continue
        pair["output_throughput_ratio"] = pair["ours"]["output_throughput"] / pair["vllm"]["output_throughput"]
        pair["median_ttft_ratio"] = pair["ours"]["median_ttft_ms"] / pair["vllm"]["median_ttft_ms"]
        pair["median_tpot_ratio"] = pair["ours"]["median_tpot_ms"] / pair["vllm"]["median_tpot_ms"]
        runs.append(pair)
        last_pair_s = time.monotonic() - t_pair
        if on_pair is not None:  # results survive a run cut short by its caller's time limit
            on_pair(runs)
    return runs


# `python -m loadtests` unchanged, plus one line on stderr: the t0 of the measured run_load call, i.e. the
# time.perf_counter() its request start_times are relative to. perf_counter is CLOCK_MONOTONIC on Linux,
# the clock vllm bench's start_times are absolute on, so both tools' windows land on one clock without
# reading file times or log lines (our result's "date" has 1-s resolution and is taken after the metrics).
_OURS_WITH_T0 = r"""
import sys
import loadtests.runner as r
_run_load = r.run_load
async def run_load(*a, **k):
    if k.get("t0") is not None:
        print(f"loadtests-t0 {k['t0']!r}", file=sys.stderr, flush=True)
    return await _run_load(*a, **k)
r.run_load = run_load
from loadtests.__main__ import main
sys.exit(main(sys.argv[1:]))
"""

MIN_OVERLAP = 0.9
CONCURRENT_REQUESTS = 768


def run_window(result: dict[str, Any], t0: float = 0.0) -> tuple[float, float]:
    """(first request sent, last request finished) of a measured run, from its per-request start_times
    and latencies (``t0`` added: ours are relative to it, vllm bench's are absolute)."""
    starts, lats = result.get("start_times"), result.get("latencies")
    if not starts or not lats or len(starts) != len(lats):
        raise ValueError("result has no per-request start_times/latencies (vllm bench needs --save-detailed)")
    return t0 + min(starts), t0 + max(s + x for s, x in zip(starts, lats))


def overlap(ours: tuple[float, float], vllm: tuple[float, float]) -> dict[str, float]:
    """How far two measured windows coincide. ``overlap_fraction`` is the common time over the time
    either ran (intersection over union): 1 only if both start and end together, so it counts the skew
    at both ends. Skews are ours minus vllm bench (positive: ours later)."""
    inter = max(0.0, min(ours[1], vllm[1]) - max(ours[0], vllm[0]))
    union = max(ours[1], vllm[1]) - min(ours[0], vllm[0])
    return {"overlap_fraction": inter / union if union > 0 else 0.0,
            "ours_overlapped": inter / (ours[1] - ours[0]) if ours[1] > ours[0] else 0.0,
            "vllm_overlapped": inter / (vllm[1] - vllm[0]) if vllm[1] > vllm[0] else 0.0,
            "start_skew_s": ours[0] - vllm[0], "end_skew_s": ours[1] - vllm[1]}


def _cpu_between(samples: list[tuple[float, float]], a: float, b: float) -> float | None:
    """CPU seconds a process used between times ``a`` and ``b``, linearly interpolated between its
    (time, cumulative CPU) samples; None when the samples do not cover the span."""
    def at(t: float) -> float | None:
        for (t1, c1), (t2, c2) in itertools.pairwise(samples):
            if t1 <= t <= t2:
                return c1 + (c2 - c1) * (t - t1) / (t2 - t1) if t2 > t1 else c1
        return None

    ca, cb = at(a), at(b)
    return None if ca is None or cb is None else cb - ca


def _with_seed(cmd: list[str], seed: int) -> list[str]:
    """``cmd`` with the value after ``--seed`` replaced."""
    i = cmd.index("--seed")
    return [*cmd[:i + 1], str(seed), *cmd[i + 2:]]


def concurrent_pairs(tag: str, base_url: str, model: Path, data: Path, pairs: int, n: int, conc: int, out_len: int,
                     workdir: Path, client_cpus: set[int] | None = None, warmup_pairs: int = 2, stagger_s: float = 0.0,
                     on_pair: Callable[[list[dict[str, Any]]], None] | None = None,
                     deadline: float | None = None, rate: float | None = None, ours_trust_env: bool = False) -> list[dict[str, Any]]:
    """``pairs`` x (ours and vllm bench serve at the same time, ``conc`` each) on one server; per-pair ratios.
    ``rate``: each tool's Poisson arrival rate (requests/s); None: closed loop.

    vllm bench takes seconds longer than ours from launch to its first measured request (imports), so
    the faster-starting tool is launched that much later: by the median measured start-up difference of
    the last (up to 5) earlier staggered pairs, warm-up pairs included, plus a planned start skew of
    ``stagger_s`` / 2 that alternates in sign (ours ahead in even pairs, vllm bench in odd ones), so that
    whatever starting first is worth falls on both tools equally. Each tool's measured window comes from its
    per-request times on the shared monotonic clock; its CPU time from its rusage (whole process) and
    from /proc samples (the part inside its window). ``on_pair`` and ``deadline`` as in :func:`interleaved`.
    """
    ours_cmd, vllm_cmd, env = _tool_cmds(base_url, model, data, n, conc, out_len, workdir, rate, ours_trust_env)
    ours_cmd = [PY, "-c", _OURS_WITH_T0, *ours_cmd[3:]]  # ours_cmd[:3] is PY -m loadtests
    vllm_cmd = vllm_cmd + ["--save-detailed"]  # its per-request start_times, for the window
    pin = (lambda: os.sched_setaffinity(0, client_cpus)) if client_cpus else None
    startup_gaps: list[float] = []  # vllm bench's start-up minus ours, per pair
    runs: list[dict[str, Any]] = []
    last_pair_s = 0.0
    for i in range(-warmup_pairs, pairs):
        t_pair = time.monotonic()
        if deadline is not None and i >= 0 and t_pair + last_pair_s > deadline:
            print(f"[{tag}] time budget reached after {len(runs)} pair(s)", flush=True)
            break
        planned = (-stagger_s if i % 2 == 0 else stagger_s) / 2  # ours' start minus vllm bench's
        # Ours' launch minus vllm bench's. The first pair launches both at once (no estimate yet), so both
        # start-ups compete for the client core; once a staggered pair exists the first one's gap no longer
        # describes the launches to come, and only the recent staggered ones do.
        recent = (startup_gaps[1:] or startup_gaps)[-5:]
        offset = (st.median(recent) if recent else 0.0) + planned
        delays = {"vllm": max(0.0, -offset), "ours": max(0.0, offset)}
        files = {k: workdir / f"{tag}-{k}-{i}.json" for k in ("ours", "vllm")}
        cmds = {"ours": ours_cmd + ["--result-json", str(files["ours"])],
                "vllm": vllm_cmd + ["--result-filename", files["vllm"].name]}
        if rate is not None:
            # A seed per pair (the same in both tools): each tool's Poisson gaps come from its seed, and one fixed
            # draw would make every pair's arrivals the same, a burstier draw in one tool biasing all its TTFTs
            # (and its run's length: 256 gaps at 12/s summed to 18.5 s in ours and 21.5 s in vllm bench at seed 0).
            cmds = {k: _with_seed(c, 1000 + i) for k, c in cmds.items()}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        logs = {k: open(workdir / f"{tag}-{k}-{i}.log", "w+b") for k in cmds}
        launched: dict[str, float] = {}
        exited: dict[str, float] = {}
        cpu_samples: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
        cpu_s: dict[str, float] = {}
        load = os.getloadavg()[0]
        base = time.monotonic()
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            while len(cpu_s) < len(cmds):
                now = time.monotonic()
                for k in cmds:
                    if k not in procs and now - base >= delays[k]:
                        launched[k] = time.monotonic()
                        procs[k] = subprocess.Popen(cmds[k], cwd=REPO, stdout=logs[k], stderr=subprocess.STDOUT, env=env,
                                                    preexec_fn=pin)
                for k, p in procs.items():
                    if k in cpu_s:
                        continue
                    try:
                        cpu_samples[k].append((time.monotonic(), _proc_cpu_s(p.pid)))
                    except (OSError, IndexError):
                        pass
                    # One child reaped at a time, so the rusage step is that child's CPU alone.
                    if p.poll() is not None:
                        exited[k] = time.monotonic()
                        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                        cpu_s[k] = (ru1.ru_utime - ru.ru_utime) + (ru1.ru_stime - ru.ru_stime)
                        ru = ru1
                    elif now - launched[k] > 900:
                        raise SystemExit(f"error: {k} run {i} did not finish within 900 s (log: {logs[k].name})")
                time.sleep(0.2)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs.values():
                f.close()
        for k, p in procs.items():
            if p.returncode != 0:
                tail = Path(logs[k].name).read_text(errors="replace").strip().splitlines()[-1:]
                raise SystemExit(f"error: {k} run {i} failed (rc {p.returncode}): {tail}")
        res = {k: json.loads(f.read_text()) for k, f in files.items()}
        t0s = re.findall(r"^loadtests-t0 (\S+)$", Path(logs["ours"].name).read_text(errors="replace"), re.MULTILINE)
        if len(t0s) != 1:
            raise SystemExit(f"error: ours run {i} printed {len(t0s)} loadtests-t0 lines, expected 1")
        win = {"ours": run_window(res["ours"], float(t0s[0])), "vllm": run_window(res["vllm"])}
        startup_gaps.append((win["vllm"][0] - launched["vllm"]) - (win["ours"][0] - launched["ours"]))
        ov = overlap(win["ours"], win["vllm"])
        if i < 0:
            print(f"[{tag}] warm-up pair: ours {res['ours']['output_throughput']:.1f} tok/s, vllm bench "
                  f"{res['vllm']['output_throughput']:.1f} tok/s, overlap {ov['overlap_fraction']:.3f}, start skew "
                  f"{ov['start_skew_s']:+.2f} s, start-up gap {startup_gaps[-1]:.2f} s", flush=True)
            continue
        pair: dict[str, Any] = {"loadavg_1m": load, "first": "ours" if win["ours"][0] <= win["vllm"][0] else "vllm",
                                "planned_start_skew_s": planned, "launch_offset_s": offset, **ov}
        for k, r in res.items():
            pair[k] = {x: r.get(x) for x in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                                             "request_throughput", "output_throughput", "median_ttft_ms", "mean_ttft_ms",
                                             "median_tpot_ms", "median_itl_ms")}
            pair[k] |= {"wall_s": exited[k] - launched[k],
                        "client_cpu_s": cpu_s[k], "window_s": [win[k][0] - base, win[k][1] - base],
                        "startup_s": win[k][0] - launched[k], "window_cpu_s": _cpu_between(cpu_samples[k], *win[k])}
        pair["output_throughput_ratio"] = pair["ours"]["output_throughput"] / pair["vllm"]["output_throughput"]
        pair["median_ttft_ratio"] = pair["ours"]["median_ttft_ms"] / pair["vllm"]["median_ttft_ms"]
        pair["median_tpot_ratio"] = pair["ours"]["median_tpot_ms"] / pair["vllm"]["median_tpot_ms"]
        flag = "" if ov["overlap_fraction"] >= MIN_OVERLAP else f" (overlap below {MIN_OVERLAP})"
        print(f"[{tag}] pair {i}: tok/s ours {pair['ours']['output_throughput']:.1f} vllm {pair['vllm']['output_throughput']:.1f} "
              f"(ratio {pair['output_throughput_ratio']:.3f}), TTFT p50 ours {pair['ours']['median_ttft_ms']:.1f} vllm "
              f"{pair['vllm']['median_ttft_ms']:.1f} ms (ratio {pair['median_ttft_ratio']:.3f}), overlap "
              f"{ov['overlap_fraction']:.3f}{flag}, start skew {ov['start_skew_s']:+.2f} s, end skew {ov['end_skew_s']:+.2f} s, "
              f"client CPU ours {cpu_s['ours']:.1f} s vllm {cpu_s['vllm']:.1f} s", flush=True)
        runs.append(pair)
        last_pair_s = time.monotonic() - t_pair
        if on_pair is not None:
            on_pair(runs)
    return runs


_PAIR_LINE = re.compile(r"^\[(?P<tag>[\w-]+)\] pair (?P<i>\d+) (?P<tool>ours|vllm): (?P<tput>[\d.]+) tok/s, TTFT p50 "
                        r"(?P<ttft>[\d.]+) ms, TPOT p50 (?P<tpot>[\d.]+) ms, in/out tokens (?P<tin>\d+)/(?P<tout>\d+)(?:, .*)?$")


def runs_from_log(text: str) -> list[dict[str, Any]]:
    """The complete pairs printed by :func:`interleaved`, for a run whose JSON was lost (killed at its
    caller's time limit before writing it). Only the printed figures come back (throughput, median TTFT
    and TPOT, token counts); a pair missing either tool's line is dropped. ValueError if none is complete."""
    by_pair: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        m = _PAIR_LINE.match(line.strip())
        if m:
            by_pair.setdefault(int(m["i"]), {}).setdefault("first", m["tool"])  # lines print in run order
            by_pair[int(m["i"])][m["tool"]] = {
                "output_throughput": float(m["tput"]), "median_ttft_ms": float(m["ttft"]), "median_tpot_ms": float(m["tpot"]),
                "total_input_tokens": int(m["tin"]), "total_output_tokens": int(m["tout"])}
    runs = []
    for i in sorted(by_pair):
        pair = by_pair[i]
        if "ours" not in pair or "vllm" not in pair:
            continue
        pair["output_throughput_ratio"] = pair["ours"]["output_throughput"] / pair["vllm"]["output_throughput"]
        pair["median_ttft_ratio"] = pair["ours"]["median_ttft_ms"] / pair["vllm"]["median_ttft_ms"]
        pair["median_tpot_ratio"] = pair["ours"]["median_tpot_ms"] / pair["vllm"]["median_tpot_ms"]
        runs.append(pair)
    if not runs:
        raise ValueError("no complete pair (ours and vllm lines) in the log")
    return runs


def summarize_pairs(runs: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    def summary(key: str) -> dict[str, Any]:
        xs = [p[key] for p in runs]
        m, lo, hi = ratio_ci(xs)
        return {"mean": m, "median": st.median(xs), "per_pair": xs, "min": min(xs), "max": max(xs),
                "ci95": [lo, hi] if len(xs) > 1 else [None, None], "within_2pct": abs(m - 1) <= 0.02,
                # Equivalence: the whole 95 % interval of the mean ratio inside 1 +- 2 %.
                "equivalent_within_2pct": len(xs) > 1 and 0.98 <= lo and hi <= 1.02}

    return {
        "output_throughput_ratio": st.mean(p["output_throughput_ratio"] for p in runs),
        "median_ttft_ratio": st.mean(p["median_ttft_ratio"] for p in runs),
        "output_throughput": summary("output_throughput_ratio"),
        "median_ttft": summary("median_ttft_ratio"),
        "median_tpot": summary("median_tpot_ratio"),
        # Mean ratios by which tool ran first: a gap between the two is the position effect that the
        # alternating order cancels in the overall mean.
        "by_first": {first: {"pairs": len(sel), "output_throughput_ratio": st.mean(p["output_throughput_ratio"] for p in sel),
                             "median_ttft_ratio": st.mean(p["median_ttft_ratio"] for p in sel)}
                     for first in ("ours", "vllm") if (sel := [p for p in runs if p.get("first", "ours") == first])},
        "same_input_tokens_every_pair": all(p["ours"]["total_input_tokens"] == p["vllm"]["total_input_tokens"] for p in runs),
        "config": config,
        "pairs": runs,
    }


def summarize_concurrent(runs: list[dict[str, Any]], config: dict[str, Any], min_overlap: float = MIN_OVERLAP) -> dict[str, Any]:
    """:func:`summarize_pairs` plus how well the two windows coincided: per-pair overlap fractions and
    skews, the pairs below ``min_overlap`` (numbered from 1), and the mean ratios without them."""
    s = summarize_pairs(runs, config)
    ov = [p["overlap_fraction"] for p in runs]
    flagged = [i + 1 for i, x in enumerate(ov) if x < min_overlap]
    good = [p for p in runs if p["overlap_fraction"] >= min_overlap]
    s["overlap"] = {
        "min_overlap": min_overlap, "per_pair": ov, "min": min(ov), "median": st.median(ov), "flagged_pairs": flagged,
        "start_skew_s_per_pair": [p["start_skew_s"] for p in runs], "end_skew_s_per_pair": [p["end_skew_s"] for p in runs],
        "median_abs_start_skew_s": st.median(abs(p["start_skew_s"]) for p in runs),
        "median_abs_end_skew_s": st.median(abs(p["end_skew_s"]) for p in runs),
        "without_flagged": ({"pairs": len(good),
                             "output_throughput_ratio": st.mean(p["output_throughput_ratio"] for p in good),
                             "median_ttft_ratio": st.mean(p["median_ttft_ratio"] for p in good)}
                            if flagged and good else None),
    }
    # The server's own total per pair: its run-to-run spread is the noise the split is meant to cancel.
    s["server_output_throughput_per_pair"] = [p["ours"]["output_throughput"] + p["vllm"]["output_throughput"] for p in runs]
    return s


def server_pinning(pin: bool) -> tuple[set[int] | None, set[int] | None, dict[str, str]]:
    """(server CPUs, client CPUs, server env) for part (b2).

    Unpinned, the API server, the EngineCore, the worker process and the client all float over the 2
    cores, and the server flips between a smooth and a bursty mode depending on which of them the
    scheduler starves. Pinned, the whole server (its children inherit the affinity) owns the first core
    and each client the second, so the server's schedule no longer depends on the client's CPU use.

    On one core the default multiprocessing executor is still unstable (measured; see the Markdown's notes):
    EngineCore and worker wait for each other on a shared-memory queue by spinning with sched_yield for
    1 s after each message, so the spinner, the computing process and the API server share the core in
    proportions that change from run to run. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` makes vLLM's CPU platform
    keep the uni-process executor: the model runs inside the EngineCore (API server and EngineCore stay
    separate processes), so nothing spins. With no worker process vLLM's own OpenMP binding
    (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``, applied by the multiprocessing
    executor only) does not apply; ``OMP_NUM_THREADS=1`` gives Torch one thread for the one core.
    What still varied (measured: 2.1-2.5 k tok/s, same client, back to back) was the EngineCore's CPU time
    for the same work: see :func:`_nice_engine_core` for the last step.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None, {}
    return {cpus[0]}, {cpus[1]}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


ENGINE_CORE_NICE = 10


def _nice_engine_core(server_pid: int) -> list[int]:
    """Lower the priority of the EngineCore's main thread (its busy loop) below the API server's.

    Sharing one core, the EngineCore never blocks while requests run, so when the API server gets to
    accept a new request or to stream out a step's tokens depends on where the scheduler preempts the
    loop; late arrivals mean smaller batches, more steps and more EngineCore CPU for the same tokens
    (measured: 7.3-8.3 CPU-s for the same run). The API server first whenever it is runnable should keep
    the batches full; one trial (same client back to back) gave 2.84-3.06 k tok/s instead of 2.13-2.48 k,
    but the recorded run still spread 13-19 % (docs/results/harness-overhead.md). Linux nice is per
    thread: only the main thread is changed, the EngineCore's socket threads are not. Returns the pids
    changed.
    """
    import psutil

    changed = []
    for c in psutil.Process(server_pid).children(recursive=True):
        if c.name().startswith("VLLM::EngineCor"):
            c.nice(ENGINE_CORE_NICE)
            changed.append(c.pid)
    return changed


def vllm_part(pairs: int, n: int, conc: int, out_len: int, workdir: Path, pin: bool = True, warmup_runs: int = 1) -> dict[str, Any]:
    import vllm

    from vllm_powersave.serving import VllmServer, default_serve_args

    model = _tiny_model()
    data = workdir / "sharegpt.json"
    # More conversations than requests: with fewer, the tools fill up the rest differently (measured at
    # 512 of 400: input-token totals 37583 vs 37480), and the workloads would differ.
    convs = max(400, 2 * n)
    _sharegpt_file(data, convs, 48)
    server_cpus, client_cpus, server_env = server_pinning(pin)
    server = VllmServer(default_serve_args(str(model)), env=server_env, log_path=workdir / "server.log", cpus=server_cpus)
    server.start()
    if server_cpus and not _nice_engine_core(server.proc.pid):
        server.stop()
        raise SystemExit("error: no VLLM::EngineCore process under the server to renice")
    t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load0 = os.getloadavg()[0]
    try:
        runs = interleaved("vllm", server.base_url, model, data, pairs, n, conc, out_len, workdir, client_cpus, warmup_runs)
    finally:
        server.stop()
    return {**summarize_pairs(runs, {
        "n": n, "conc": conc, "output_len": out_len, "vllm_version": vllm.__version__,
        "server": "vllm serve .models/qwen2-tiny (stock, no plugin) " + " ".join(default_serve_args("M")[1:]),
        "dataset": f"synthetic ShareGPT file, {convs} conversations, 48-word prompts, seed 0",
        "order": "A B, B A, A B, ... (A = loadtests, B = vllm bench serve)",
        "warmups": f"{warmup_runs} discarded run(s) of each tool, then 1 warm-up request per run in both tools (--num-warmups 1)",
        "server_cpus": sorted(server_cpus) if server_cpus else None,
        "client_cpus": sorted(client_cpus) if client_cpus else None,
        "server_env": server_env, "engine_core_nice": ENGINE_CORE_NICE if server_cpus else None}),
        "date_utc": t0, "loadavg_1m_at_start": load0, "loadavg_1m_at_end": os.getloadavg()[0]}


def vllm_concurrent_part(pairs: int, n: int, conc: int, out_len: int, workdir: Path, pin: bool = True, warmup_pairs: int = 2,
                         stagger_s: float = 0.0, on_summary: Callable[[dict[str, Any]], None] | None = None,
                         deadline: float | None = None, rate: float | None = None, ours_trust_env: bool = False) -> dict[str, Any]:
    """Part (b2c): :func:`concurrent_pairs` on one CPU vLLM server without prefix caching (both tools send
    the same prompts at nearly the same time: with the cache the later one's prefills would be hits)."""
    import vllm

    from vllm_powersave.serving import VllmServer, default_serve_args

    model = _tiny_model()
    data = workdir / "sharegpt.json"
    convs = max(400, 2 * n)  # as in vllm_part: both tools then draw the same prompts
    _sharegpt_file(data, convs, 48)
    server_cpus, client_cpus, server_env = server_pinning(pin)
    serve_args = default_serve_args(str(model)) + ["--no-enable-prefix-caching"]
    server = VllmServer(serve_args, env=server_env, log_path=workdir / "server.log", cpus=server_cpus)
    server.start()
    # The server logs its cache config; trust the log, not the flag, that the cache is off.
    m = re.search(r"enable_prefix_caching=(\w+)", server.log_path.read_text(errors="replace"))
    if not m or m[1] != "False":
        server.stop()
        raise SystemExit(f"error: server log does not show enable_prefix_caching=False (log: {server.log_path})")
    if server_cpus and not _nice_engine_core(server.proc.pid):
        server.stop()
        raise SystemExit("error: no VLLM::EngineCore process under the server to renice")
    t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load0 = os.getloadavg()[0]
    config = {
        "n_per_tool": n, "conc_per_tool": conc, "total_conc": 2 * conc, "output_len": out_len, "vllm_version": vllm.__version__,
        "server": "vllm serve .models/qwen2-tiny (stock, no plugin) " + " ".join(serve_args[1:]), "prefix_caching": False,
        "dataset": f"synthetic ShareGPT file, {convs} conversations, 48-word prompts, seed 0 (same prompts in both tools)",
        "design": ("per pair both tools run at the same time against the one server, each closed loop at half the total "
                   "concurrency with the same requests; ratios ours / vllm bench per pair") if rate is None else
                  (f"per pair both tools run at the same time against the one server, each with Poisson arrivals at {rate:g} "
                   f"requests/s (open loop, at most {conc} in flight) and the same requests; ratios ours / vllm bench per pair"),
        "arrivals": "closed loop" if rate is None else f"Poisson, {rate:g} requests/s per tool",
        "rate_per_tool_req_s": rate,
        "ours_trust_env": ours_trust_env,
        "launch": "the tool with the longer measured start-up (launch to first measured request; vllm bench) is launched "
                  "first, the other after the median start-up difference of the last (up to 5) earlier staggered pairs plus "
                  "the planned start skew",
        "planned_start_skew_s": stagger_s / 2,  # magnitude; ours ahead in pairs 1, 3, ..., vllm bench in 2, 4, ...
        "overlap": "intersection over union of the two measured windows (first request sent to last request finished, "
                   f"from per-request times on the shared monotonic clock); pairs below {MIN_OVERLAP} are flagged",
        "warmups": f"{warmup_pairs} discarded concurrent pair(s) (they also calibrate the launch delay), then 1 warm-up "
                   "request per run in both tools (--num-warmups 1)",
        "server_cpus": sorted(server_cpus) if server_cpus else None,
        "client_cpus": sorted(client_cpus) if client_cpus else None, "clients_share_cpus": True,
        "server_env": server_env, "engine_core_nice": ENGINE_CORE_NICE if server_cpus else None}

    def section(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {**summarize_concurrent(runs, config), "date_utc": t0, "loadavg_1m_at_start": load0,
                "loadavg_1m_at_end": os.getloadavg()[0], "pairs_planned": pairs, "complete": len(runs) == pairs}

    try:
        runs = concurrent_pairs("b2c" if rate is None else "b2p", server.base_url, model, data, pairs, n, conc, out_len, workdir,
                                client_cpus, warmup_pairs, stagger_s,
                                on_pair=(lambda rs: on_summary(section(rs))) if on_summary else None, deadline=deadline,
                                rate=rate, ours_trust_env=ours_trust_env)
    finally:
        server.stop()
    if not runs:
        raise SystemExit("error: no concurrent pair completed")
    return section(runs)


def fake_timing_part(pairs: int, n: int, conc: int, out_len: int, ttft_ms: float, itl_ms: float, workdir: Path) -> dict[str, Any]:
    """Both tools against the fake server with exact TTFT / ITL: what each one reports vs the truth."""
    model = _tiny_model()
    data = workdir / "sharegpt.json"
    _sharegpt_file(data, 400, 48)
    srv = subprocess.Popen([PY, "-m", "loadtests.fake_server", "--port", "0", "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)],
                           cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None
        url = srv.stdout.readline().strip()
        runs = interleaved("fake", url, model, data, pairs, n, conc, out_len, workdir)
    finally:
        srv.terminate()
        srv.wait(10)
    res = summarize_pairs(runs, {"n": n, "conc": conc, "output_len": out_len, "fake_ttft_ms": ttft_ms, "fake_itl_ms": itl_ms,
                                 "order": "A B, B A, A B, ... (A = loadtests, B = vllm bench serve)", "warmups": "1 each"})
    for tool in ("ours", "vllm"):
        res[f"{tool}_median_ttft_ms_minus_true"] = st.median(p[tool]["median_ttft_ms"] - ttft_ms for p in runs)
        res[f"{tool}_median_tpot_ms_minus_true"] = st.median(p[tool]["median_tpot_ms"] - itl_ms for p in runs)
    return res


def _fmt_ratio(s: dict[str, Any]) -> str:
    ci = f"95 % CI {s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}" if s["ci95"][0] is not None else "no CI (one pair)"
    return (f"mean {s['mean']:.3f}, median {s['median']:.3f} (pairs {', '.join(f'{x:.3f}' for x in s['per_pair'])}; "
            f"range {s['min']:.3f}-{s['max']:.3f}; {ci}; mean {'within' if s['within_2pct'] else 'NOT within'} 2 % of 1)")


def _pair_table(v: dict[str, Any]) -> list[str]:
    lines = ["| pair | load avg | ours tok/s | vllm bench tok/s | throughput ratio | ours TTFT p50 (ms) | vllm bench TTFT p50 (ms) "
             "| TTFT ratio | ours TPOT p50 (ms) | vllm bench TPOT p50 (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(v["pairs"]):
        load = f"{p['loadavg_1m']:.1f}" if "loadavg_1m" in p else "n/a"
        lines.append(f"| {i + 1} | {load} | {p['ours']['output_throughput']:.1f} | {p['vllm']['output_throughput']:.1f} | "
                     f"{p['output_throughput_ratio']:.3f} | {p['ours']['median_ttft_ms']:.1f} | {p['vllm']['median_ttft_ms']:.1f} | "
                     f"{p['median_ttft_ratio']:.3f} | {p['ours']['median_tpot_ms']:.2f} | {p['vllm']['median_tpot_ms']:.2f} |")
    return lines + ["", f"- output_throughput_ratio (ours / vllm bench): {_fmt_ratio(v['output_throughput'])}",
                    f"- median_ttft_ratio (ours / vllm bench): {_fmt_ratio(v['median_ttft'])}",
                    f"- median TPOT ratio: {_fmt_ratio(v['median_tpot'])}",
                    f"- Same prompts in both tools (equal input-token totals in every pair): {v['same_input_tokens_every_pair']}."]


def write_md(doc: dict[str, Any], path: Path) -> None:
    f = doc["fake_server"]
    busy = f["harness_cpu_utilization_median"]
    lines = [
        "# Load-test harness overhead (measured, CPU)",
        "",
        f"- Date (UTC): {doc['date_utc']}" + (f" for (a) and (b1); (b2) re-run {doc['vs_vllm_bench']['date_utc']}"
                                              if "date_utc" in doc.get("vs_vllm_bench", {}) else "") + f". Machine: {doc['host']['machine']}, {doc['host']['cpus']} CPUs, Python {doc['host']['python']}, "
        f"aiohttp {doc['host']['aiohttp']}. Script: `benchmarks/harness_overhead.py`. All numbers measured; no energy involved.",
        f"- The machine is shared with other jobs (1-min load average {doc['host']['loadavg_1m_at_start']:.1f} at the start "
        "of the (a)/(b1) run, "
        f"{doc['host']['loadavg_1m_at_end']:.1f} at the end, on 2 cores): repetitions and interleaving show the noise, they do not remove it.",
        *_summary_lines(doc),
        "",
        "## (a) Requests/s from one core against the fake server",
        "",
        f"Harness pinned to CPU {f['config']['harness_cpu']}, fake server (TTFT 0, ITL 0) in its own process on CPU "
        f"{f['config']['server_cpu']}; closed loop at concurrency {f['config']['max_concurrency']}, {f['config']['num_prompts']} "
        "streamed requests of 16 output tokens (16 chunks + usage + [DONE]) after 50 warm-ups; default sampling of the "
        "fake server's `/metrics` every 0.5 s. CPU shares are over the whole `run()` call.",
        "",
        "| run | req/s | output tok/s | harness core busy | server core busy | harness CPU ms / request |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(f["runs"]):
        lines.append(f"| {i + 1} | {r['request_throughput']:.0f} | {r['output_throughput']:.0f} | {100 * r['harness_cpu_utilization']:.0f} % | "
                     f"{100 * r['server_cpu_utilization']:.0f} % | {r['harness_cpu_ms_per_request']:.3f} |")
    lines += ["", f"**fake_server_req_per_s_one_core = {doc['fake_server_req_per_s_one_core']:.0f}**: requests per second of the "
              f"harness's own CPU time (median {f['harness_cpu_ms_per_request_median']:.3f} ms of CPU per request, warm-ups and "
              f"set-up included), i.e. what one fully available core drives. Observed rate: median "
              f"{doc['fake_server_observed_req_per_s_median']:.0f} req/s with the harness core {100 * busy:.0f} % busy (server core "
              f"{100 * f['server_cpu_utilization_median']:.0f} %): "
              + ("the harness's one core was the limit." if busy >= 0.9 else
                 "the pinned core was shared with other jobs' processes, so the observed rate is lower than what the core "
                 "can drive.")]
    for e in doc.get("earlier_runs", []):
        lines.append(f"- Earlier run ({e['date_utc']}, same script): {e['summary']}")
    for key, title in (("vs_vllm_bench_fake_server", "(b1) loadtests vs `vllm bench serve` against the fake server (known truth)"),
                       ("vs_vllm_bench_fake_server_high_rate", "(b1, high rate) the same at ~10 k output tokens/s, "
                                                                 "the rate of the GPU comparison (b3)")):
        if doc.get(key):
            lines += _b1_lines(doc[key], title)
    v = doc.get("vs_vllm_bench")
    if v:
        lines += _b2_lines(v, doc)
    c = doc.get("vs_vllm_bench_concurrent")
    if c and doc.get("vs_vllm_bench_concurrent_poisson"):
        xs = [p["median_ttft_ratio"] for p in c["pairs"]]
        doc["vs_vllm_bench_concurrent_poisson"]["b2c_ttft_ratio_range"] = [min(xs), max(xs)]
    for key in ("vs_vllm_bench_concurrent", "vs_vllm_bench_concurrent_poisson", "vs_vllm_bench_concurrent_poisson_trust_env"):
        if doc.get(key):
            lines += _b2c_lines(doc[key])
    for key, label in GPU_SECTIONS.items():
        if doc.get(key):
            lines += _b3_lines(doc[key], label)
    path.write_text("\n".join(lines) + "\n")


def _b1_lines(c: dict[str, Any], title: str) -> list[str]:
    cc = c["config"]
    lines = ["", f"## {title}", "",
             f"The fake server (own process, unpinned) answers every request with TTFT {cc['fake_ttft_ms']:g} ms and one chunk "
             f"every {cc['fake_itl_ms']:g} ms; {cc['n']} requests, {cc['output_len']} output tokens, concurrency {cc['conc']}, "
             f"same ShareGPT file and tokenizer in both tools; order {cc['order']}. Whatever a tool reports above "
             f"{cc['fake_ttft_ms']:g} / {cc['fake_itl_ms']:g} ms is its own overhead (plus the machine's noise)."]
    if "date_utc" in c:
        lines.append(f"Run {c['date_utc']} (UTC).")
    lines.append("")
    lines += _pair_table(c)
    lines += [f"- Median over pairs of (median TTFT - true TTFT): ours {c['ours_median_ttft_ms_minus_true']:+.2f} ms, "
              f"vllm bench {c['vllm_median_ttft_ms_minus_true']:+.2f} ms; (median TPOT - true ITL): ours "
              f"{c['ours_median_tpot_ms_minus_true']:+.3f} ms, vllm bench {c['vllm_median_tpot_ms_minus_true']:+.3f} ms."]
    return lines


def _spread(xs: list[float]) -> str:
    m = st.median(xs)
    return f"{min(xs):.1f}-{max(xs):.1f} ({100 * (max(xs) - min(xs)) / m:.1f} % of the median)"


def _b2_lines(v: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    cv = v["config"]
    pinned = cv.get("server_cpus") is not None
    lines = ["", "## (b2) loadtests vs `vllm bench serve` on the same CPU vLLM server", ""]
    if "date_utc" in v:
        lines.append(f"- Run {v['date_utc']} (UTC) on this machine ({doc['host']['machine']}, {doc['host']['cpus']} CPUs, no GPU), "
                     f"separately from (a)/(b1); 1-min load average {v['loadavg_1m_at_start']:.1f} at its start, "
                     f"{v['loadavg_1m_at_end']:.1f} at its end (the server's and the client's own processes included).")
    lines.append(f"- vLLM {cv['vllm_version']} CPU build; server: `{cv['server']}`; workload: {cv['dataset']}, "
                 f"{cv['n']} requests per run, output {cv['output_len']} tokens (ignore_eos, greedy), closed loop at concurrency "
                 f"{cv['conc']}, both tools with `--tokenizer` = the model directory (offline); warm-up: {cv['warmups']}; "
                 f"order {cv['order']}.")
    if pinned:
        env = " ".join(f"{k}={x}" for k, x in cv["server_env"].items())
        lines.append(f"- Pinning: the server (API server and EngineCore; affinity set before exec, inherited) on CPU "
                     f"{','.join(map(str, cv['server_cpus']))} with `{env}`, the EngineCore's main thread at nice "
                     f"{cv['engine_core_nice']} (the API server at 0); each client run on CPU "
                     f"{','.join(map(str, cv['client_cpus']))}. The uni-process executor (model inside the EngineCore) because "
                     "with vLLM's default multiprocessing executor the EngineCore and the worker process spin-wait "
                     "(sched_yield) on each other, and on one core with the API server that spinning takes a share "
                     "of the core that changes from run to run. The nice value is meant to put the API server first whenever "
                     "it has a request to accept or tokens to stream, so that the batches stay full instead of depending "
                     "on where the scheduler preempts the EngineCore's busy loop.")
    else:
        lines.append("- Unpinned: server and client share the 2 cores, so the client's CPU use and the other jobs' load feed "
                     "straight into the server's throughput and TTFT.")
    lines.append("")
    lines += _pair_table(v)
    pairs = v["pairs"]
    bf = v.get("by_first") or {}
    if len(bf) == 2:
        lines.append("- Position: " + "; ".join(f"with {'ours' if k == 'ours' else 'vllm bench'} first ({x['pairs']} pairs) the mean "
                                                f"throughput ratio is {x['output_throughput_ratio']:.3f} and TTFT ratio "
                                                f"{x['median_ttft_ratio']:.3f}" for k, x in bf.items())
                     + " (the overall mean weighs both orders equally when the pair count is even).")
    if all("client_cpu_s" in p["ours"] and "client_cpu_s" in p["vllm"] for p in v["pairs"]):
        # Start-up (imports, tokenizer, dataset) keeps the core busy, so CPU - (wall - run duration) estimates the
        # CPU spent while requests ran.
        run_cpu = {k: st.median((p[k]["client_cpu_s"] - (p[k]["wall_s"] - p[k]["duration"])) / p[k]["duration"] for p in v["pairs"])
                   for k in ("ours", "vllm")}
        lines.append(f"- Client CPU while the requests ran (estimate: the tool process's CPU time minus its start-up, taken as "
                     f"wall - run duration, over the run duration; median over pairs): ours {100 * run_cpu['ours']:.0f} %, "
                     f"vllm bench {100 * run_cpu['vllm']:.0f} % of the client's one core.")
    lines += [f"- Server stability (each tool's own runs across pairs): output tok/s ours {_spread([p['ours']['output_throughput'] for p in pairs])}, "
              f"vllm bench {_spread([p['vllm']['output_throughput'] for p in pairs])}; TTFT p50 (ms) ours "
              f"{_spread([p['ours']['median_ttft_ms'] for p in pairs])}, vllm bench {_spread([p['vllm']['median_ttft_ms'] for p in pairs])}."]
    lines += _pair_verdict_lines(v)
    e = v.get("earlier_run")
    if e:
        fx = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        lines.append(f"- Earlier run ({e['date_utc']}, unpinned, default executor, {e['config']['n']} requests per run): "
                     f"per-pair output throughput ratios {fx(e['output_throughput_per_pair'])}, median TTFT ratios "
                     f"{fx(e['median_ttft_per_pair'])}: the server switched between a smooth and a bursty mode (TTFT up to "
                     "0.7 s) depending on how much CPU its API server got.")
    return lines


def _planned_skew(pairs: list[dict[str, Any]]) -> str:
    sk = {abs(p.get("planned_start_skew_s", 0.0)) for p in pairs}
    if sk <= {0.0}:
        return "none (aimed at both starting together)"
    return f"+-{max(sk):g} s (ours ahead in pairs 1, 3, ..., vllm bench in 2, 4, ...)"


def _b2c_lines(v: dict[str, Any]) -> list[str]:
    cv = v["config"]
    pairs = v["pairs"]
    ov = v["overlap"]
    if cv.get("rate_per_tool_req_s") is not None:
        return _b2p_intro(v) + _b2c_body(v, cv, pairs, ov)
    lines = ["", "## (b2c) loadtests vs `vllm bench serve` at the same time on the same CPU vLLM server (concurrent split)", "",
             "Why: in (b2) the two tools run one after the other, so every change of the one-core server between the two "
             "runs (its throughput spreads by tens of % from run to run) lands in the ratio. Here both tools load the server "
             "at the same time, each with half the concurrency and the same requests, so both see the same server at every "
             "moment: its drift is common to both and cancels in the per-pair ratio, which keeps the tools' own measurement "
             "differences and client overheads. Limits: each tool measures a server that the other loads as well (half the "
             "batch is the other tool's), both clients share one core, and the windows do not coincide exactly (start-up "
             "skew at the start, different finishing times at the end), during which one tool has the server to itself.", ""]
    if "date_utc" in v:
        lines.append(f"- Run {v['date_utc']} (UTC), {len(pairs)} of {v.get('pairs_planned', len(pairs))} planned pairs; 1-min load "
                     f"average {v['loadavg_1m_at_start']:.1f} at its start, {v['loadavg_1m_at_end']:.1f} at its end (server and "
                     "clients included).")
    lines += [f"- vLLM {cv['vllm_version']} CPU build; server: `{cv['server']}` (prefix caching off: both tools send the same "
              f"prompts at nearly the same time, and the later one's prefills would otherwise be cache hits); workload: "
              f"{cv['dataset']}, {cv['n_per_tool']} requests per tool, output {cv['output_len']} tokens (ignore_eos, greedy), "
              f"closed loop at concurrency {cv['conc_per_tool']} per tool ({cv['total_conc']} in all); warm-up: {cv['warmups']}."]
    return lines + _b2c_body(v, cv, pairs, ov)


def _b2c_ttft_range(v: dict[str, Any]) -> str:
    c = v.get("b2c_ttft_ratio_range")
    return f" (TTFT ratio {c[0]:.2f}-{c[1]:.2f})" if c else ""


def _b2p_intro(v: dict[str, Any]) -> list[str]:
    cv = v["config"]
    if cv.get("ours_trust_env"):
        return ["", "## (b2e) (b2p) again, ours with `--trust-env` (vllm bench's session setting)", "",
                "Why: in (b2p) ours read a lower TTFT than vllm bench in every pair. In one process, one event loop and one "
                "connection pool against the fake server, vllm bench's request function measured the same TTFT as ours; "
                "with vllm bench's session setting `trust_env=True` (aiohttp then looks up proxies and ~/.netrc for every "
                "request, after the TTFT clock has started) it measured more (`ttft-session-probe.md`). Here ours runs "
                "with that setting too.", "", *_b2p_run_lines(v)]
    lines = ["", "## (b2p) the same concurrent split with Poisson arrivals (open loop)", "",
             "Why: in the closed-loop split (b2c) throughput agreed closely but the two tools' median TTFTs differed per pair "
             "in either direction" + _b2c_ttft_range(v) + ". A closed loop sends a tool's next request the moment one "
             "of its own requests ends, which ties each tool's arrivals to the server's step boundaries in its own way for a "
             "whole run, so the two tools' requests meet systematically different queues. With independent Poisson arrivals "
             "in both tools every request of either tool meets the server in a random state, and the per-pair TTFT ratio "
             "keeps only the tools' measurement differences and sampling noise. Throughput is set by the arrival rate here, "
             "so its ratio mostly checks how each tool delimits its run.", ""]
    return lines + _b2p_run_lines(v)


def _b2p_run_lines(v: dict[str, Any]) -> list[str]:
    cv = v["config"]
    lines = []
    if "date_utc" in v:
        lines.append(f"- Run {v['date_utc']} (UTC), {len(v['pairs'])} of {v.get('pairs_planned', len(v['pairs']))} planned pairs; "
                     f"1-min load average {v['loadavg_1m_at_start']:.1f} at its start, {v['loadavg_1m_at_end']:.1f} at its end.")
    lines.append(f"- vLLM {cv['vllm_version']} CPU build; server: `{cv['server']}` (prefix caching off); workload: {cv['dataset']}, "
                 f"{cv['n_per_tool']} requests per tool, output {cv['output_len']} tokens (ignore_eos, greedy), {cv['arrivals']} "
                 f"(at most {cv['conc_per_tool']} in flight per tool); warm-up: {cv['warmups']}.")
    return lines


def _b2c_body(v: dict[str, Any], cv: dict[str, Any], pairs: list[dict[str, Any]], ov: dict[str, Any]) -> list[str]:
    lines = [f"- Launch: {cv['launch']}; planned start skew {_planned_skew(pairs)}. Overlap: {cv['overlap']}."]
    if cv.get("server_cpus") is not None:
        env = " ".join(f"{k}={x}" for k, x in cv["server_env"].items())
        lines.append(f"- Pinning as in (b2): the server on CPU {','.join(map(str, cv['server_cpus']))} with `{env}` and the "
                     f"EngineCore's main thread at nice {cv['engine_core_nice']}; both clients together on CPU "
                     f"{','.join(map(str, cv['client_cpus']))}.")
    lines += ["", "| pair | first | start skew (s) | end skew (s) | overlap | ours tok/s | vllm bench tok/s | throughput ratio "
              "| ours TTFT p50 (ms) | vllm bench TTFT p50 (ms) | TTFT ratio | client CPU s ours / vllm bench |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(pairs):
        flag = " (low)" if p["overlap_fraction"] < ov["min_overlap"] else ""
        lines.append(f"| {i + 1} | {'ours' if p['first'] == 'ours' else 'vllm bench'} | {p['start_skew_s']:+.2f} | "
                     f"{p['end_skew_s']:+.2f} | {p['overlap_fraction']:.3f}{flag} | {p['ours']['output_throughput']:.1f} | "
                     f"{p['vllm']['output_throughput']:.1f} | {p['output_throughput_ratio']:.3f} | "
                     f"{p['ours']['median_ttft_ms']:.1f} | {p['vllm']['median_ttft_ms']:.1f} | {p['median_ttft_ratio']:.3f} | "
                     f"{p['ours']['client_cpu_s']:.1f} / {p['vllm']['client_cpu_s']:.1f} |")
    lines += ["", f"- output_throughput_ratio (ours / vllm bench): {_fmt_ratio(v['output_throughput'])}",
              f"- median_ttft_ratio (ours / vllm bench): {_fmt_ratio(v['median_ttft'])}",
              f"- median TPOT ratio: {_fmt_ratio(v['median_tpot'])}",
              f"- Same prompts in both tools (equal input-token totals in every pair): {v['same_input_tokens_every_pair']}."]
    low = ov["flagged_pairs"]
    lines.append(f"- Overlap (intersection over union of the two windows): median {ov['median']:.3f}, min {ov['min']:.3f}; "
                 f"median |start skew| {ov['median_abs_start_skew_s']:.2f} s, median |end skew| {ov['median_abs_end_skew_s']:.2f} s; "
                 + (f"pairs below {ov['min_overlap']}: none." if not low else
                    f"pairs below {ov['min_overlap']}: {', '.join(map(str, low))}"
                    + (f" (without them, {ov['without_flagged']['pairs']} pairs: mean throughput ratio "
                       f"{ov['without_flagged']['output_throughput_ratio']:.3f}, TTFT ratio "
                       f"{ov['without_flagged']['median_ttft_ratio']:.3f})." if ov.get("without_flagged") else ".")))
    bf = v.get("by_first") or {}
    if bf:
        lines.append("- Position (which tool's window started first): " + "; ".join(
            f"{'ours' if k == 'ours' else 'vllm bench'} first in {x['pairs']} pairs: mean throughput ratio "
            f"{x['output_throughput_ratio']:.3f}, TTFT ratio {x['median_ttft_ratio']:.3f}" for k, x in bf.items()) + ".")
    skews = [p["start_skew_s"] for p in pairs]
    if len(pairs) > 2 and len(set(skews)) > 1:
        # Whether starting earlier (having the server alone for a moment) buys a tool throughput or TTFT.
        fit = {key: (st.correlation(skews, [p[key] for p in pairs]), st.linear_regression(skews, [p[key] for p in pairs]).slope)
               for key in ("output_throughput_ratio", "median_ttft_ratio")}
        lines.append("- Start skew vs ratio (skew = ours' start minus vllm bench's): throughput ratio r = "
                     f"{fit['output_throughput_ratio'][0]:+.2f}, slope {fit['output_throughput_ratio'][1]:+.4f} per s; "
                     f"TTFT ratio r = {fit['median_ttft_ratio'][0]:+.2f}, slope {fit['median_ttft_ratio'][1]:+.4f} per s.")
    if all(p[k].get("mean_ttft_ms") for p in pairs for k in ("ours", "vllm")):
        # A median can jump between the modes of a lumpy TTFT distribution; the mean shows whether the
        # whole distribution moved.
        xs = [p["ours"]["mean_ttft_ms"] / p["vllm"]["mean_ttft_ms"] for p in pairs]
        m, lo, hi = ratio_ci(xs)
        lines.append(f"- Mean TTFT ratio (whole distribution, not the verdict's median): mean {m:.3f}, range "
                     f"{min(xs):.3f}-{max(xs):.3f}" + (f", 95 % CI {lo:.3f}-{hi:.3f}." if len(xs) > 1 else "."))
    if all("window_s" in p[k] and p[k].get("duration") for p in pairs for k in ("ours", "vllm")):
        # Both tools' durations match their request windows, so a throughput gap is the windows' lengths
        # (how fast each closed loop got through the same requests), not how duration is defined.
        gap = {k: st.median(p[k]["duration"] - (p[k]["window_s"][1] - p[k]["window_s"][0]) for p in pairs) for k in ("ours", "vllm")}
        lines.append(f"- Reported duration minus own request window (first sent to last finished), median: ours {gap['ours']:+.3f} s, "
                     f"vllm bench {gap['vllm']:+.3f} s; ours' duration minus vllm bench's for the same requests, median "
                     f"{st.median(p['ours']['duration'] - p['vllm']['duration'] for p in pairs):+.3f} s.")
    if all(p[k].get("window_cpu_s") is not None for p in pairs for k in ("ours", "vllm")):
        share = {k: st.median(p[k]["window_cpu_s"] / (p[k]["window_s"][1] - p[k]["window_s"][0]) for p in pairs)
                 for k in ("ours", "vllm")}
        lines.append(f"- Client CPU while each tool's own requests ran (from /proc samples every 0.2 s, median over pairs): "
                     f"ours {100 * share['ours']:.0f} %, vllm bench {100 * share['vllm']:.0f} % of the shared client core; "
                     f"whole process (start-up included), median: ours "
                     f"{st.median(p['ours']['client_cpu_s'] for p in pairs):.1f} s, vllm bench "
                     f"{st.median(p['vllm']['client_cpu_s'] for p in pairs):.1f} s.")
    lines.append(f"- Server stability: its total output tok/s (both tools) per pair {_spread(v['server_output_throughput_per_pair'])}; "
                 f"each tool's own tok/s ours {_spread([p['ours']['output_throughput'] for p in pairs])}, vllm bench "
                 f"{_spread([p['vllm']['output_throughput'] for p in pairs])}. The ratio's spread is what is left after "
                 "the common-mode cancellation.")
    lines += _pair_verdict_lines(v)
    return lines


def _pair_verdict_lines(v: dict[str, Any]) -> list[str]:
    """Per ratio, the pairs outside 2 % of 1; then the verdict (:func:`_target_lines`) and the notes."""
    lines, met = [], []
    for key, name in (("output_throughput_ratio", "output throughput"), ("median_ttft_ratio", "median TTFT")):
        xs = [p[key] for p in v["pairs"]]
        out = [f"{i + 1} ({x:.3f})" for i, x in enumerate(xs) if abs(x - 1) > 0.02]
        lines.append(f"- {name}: " + ("every pair's ratio is within 2 % of 1." if not out else
                                       f"{len(out)} of {len(xs)} pairs outside 2 % of 1: {', '.join(out)}."))
        met.append(not out)
    return lines + _target_lines(v, all(met)) + [f"- {n}" for n in v.get("notes", [])]


def _target_lines(v: dict[str, Any], every_pair: bool) -> list[str]:
    """The verdict on "same within 2 %". Either every pair agrees within 2 %, or, where the server's
    own run-to-run noise is larger than 2 % (a single pair can then not agree), the 95 % interval of
    the mean ratio over the pairs lies inside 0.98-1.02 for both throughput and median TTFT
    (equivalence). A mean inside 2 % with a wider interval is not evidence of agreement."""
    if every_pair:
        return ["- **Target (same within 2 %): met: every pair within 2 % in both ratios.**"]
    eq = {k: v[k].get("equivalent_within_2pct", False) for k in ("output_throughput", "median_ttft")}
    ci = {k: v[k]["ci95"] for k in eq}
    desc = "; ".join(f"{k.replace('_', ' ')} {ci[k][0]:.3f}-{ci[k][1]:.3f}" for k in eq if ci[k][0] is not None)
    if all(eq.values()):
        return [f"- **Target (same within 2 %): met as equivalence over {len(v['pairs'])} pairs: the 95 % interval of the mean "
                f"ratio lies inside 0.98-1.02 for both ({desc}).** Single pairs differ by more, as the server's own runs do."]
    return [f"- **Target (same within 2 %): NOT met: single pairs differ by more than 2 %, and the 95 % interval of the mean ratio "
            f"is not inside 0.98-1.02 for both ({desc}).**"]


#: Record keys of the H200 comparisons and their section titles' suffix (newest first).
GPU_SECTIONS = {"vs_vllm_bench_gpu": "", "vs_vllm_bench_gpu_earlier": ", earlier run"}


def _b3_lines(g: dict[str, Any], label: str = "") -> list[str]:
    cg = g["config"]
    dev = g["device"]
    if isinstance(dev, dict):  # the script's own JSON: device facts as read on the machine
        pl = dev.get("power_limit_w")
        dev = f"{dev.get('name')} (driver {dev.get('driver')}" + (f", power limit {pl:g} W)" if pl is not None else ")")
    lines = ["", f"## (b3) loadtests vs `vllm bench serve` on the same GPU vLLM server (H200, measured{label})", "",
             f"- Run {g['date_utc']} (UTC) on {dev}; vLLM {g['vllm_version']}; server: {cg['server']}; "
             f"{cg['n']} requests per run, output {cg['output_len']} tokens (ignore_eos, greedy), closed loop at concurrency "
             f"{cg['conc']}, same ShareGPT-format file and tokenizer in both tools; warm-up: {cg['warmups']}; order {cg['order']}. "
             f"Script: `benchmarks/h200_bench_compare.py` (device job `benchcmp@GPU`).",
             f"- Source of these figures: {g['source']}.", ""]
    lines += _pair_table(g)
    pairs = g["pairs"]
    bf = g.get("by_first") or {}
    if len(bf) == 2:
        lines.append("- Position: " + "; ".join(f"with {'ours' if k == 'ours' else 'vllm bench'} first ({x['pairs']} pairs) the mean "
                                                f"throughput ratio is {x['output_throughput_ratio']:.3f} and TTFT ratio "
                                                f"{x['median_ttft_ratio']:.3f}" for k, x in bf.items()) + ".")
    lines.append(f"- Server stability (each tool's own runs across pairs): output tok/s ours "
                 f"{_spread([p['ours']['output_throughput'] for p in pairs])}, vllm bench "
                 f"{_spread([p['vllm']['output_throughput'] for p in pairs])}.")
    met = all(abs(p[k] - 1) <= 0.02 for p in pairs for k in ("output_throughput_ratio", "median_ttft_ratio"))
    lines += _target_lines(g, met)
    lines += [f"- {n}" for n in g.get("notes", [])]
    return lines


def merge_gpu(doc: dict[str, Any], src: Path, config: dict[str, Any] | None, notes: list[str],
              key: str = "vs_vllm_bench_gpu") -> None:
    """Put the H200 comparison (``h200_bench_compare.py``'s JSON, or its log when the JSON was lost) into
    ``doc[key]`` (one of :data:`GPU_SECTIONS`)."""
    if key not in GPU_SECTIONS:
        raise ValueError(f"--gpu-key {key!r}: choose from {', '.join(GPU_SECTIONS)}")
    text = (gzip.open(src, "rt") if src.suffix == ".gz" else open(src)).read()
    if text.lstrip().startswith("{"):
        g = json.loads(text)
        g["source"] = f"the run's JSON (`{src.name}`)"
    else:
        if config is None:
            raise ValueError("a log carries no run configuration: give --gpu-config")
        runs = runs_from_log(text)
        meta = {k: config.pop(k) for k in ("date_utc", "device", "vllm_version") if k in config}
        g = {"what": "loadtests vs vllm bench serve, same stock vLLM server on one GPU (measured)", "measured": True,
             **meta, **summarize_pairs(runs, config),
             "source": f"the pair lines of the run's log (`{src.name}`): the run was stopped at its time limit before it "
                       "wrote its JSON, so only the printed figures (throughput, TTFT p50, TPOT p50, token counts) exist"}
    g["notes"] = list(g.get("notes", [])) + notes
    doc[key] = g


def save(doc: dict[str, Any], out: Path) -> None:
    """The record as JSON at ``out`` and its Markdown twin beside it (the summary over the comparison
    designs is recomputed first: any part may have been re-run or merged)."""
    doc["vs_vllm_bench_summary"] = comparison_summary(doc)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    write_md(doc, out.with_suffix(".md"))


#: The comparisons with vllm bench serve, in the order the summary lists them: (record key, design).
COMPARISONS = (
    ("vs_vllm_bench", "(b2) CPU server, one tool after the other"),
    ("vs_vllm_bench_concurrent", "(b2c) CPU server, both at once, closed loop"),
    ("vs_vllm_bench_concurrent_poisson", "(b2p) CPU server, both at once, Poisson arrivals"),
    ("vs_vllm_bench_concurrent_poisson_trust_env", "(b2e) as (b2p), ours with --trust-env like vllm bench's session"),
    ("vs_vllm_bench_gpu", "(b3) H200 server, one tool after the other"),
)


def comparison_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Per design: pairs, mean ratios with their 95 % intervals, and whether each is shown equivalent
    within 2 % (the whole interval inside 0.98-1.02). Every design is listed, agreeing or not."""
    rows = []
    for key, design in COMPARISONS:
        v = doc.get(key)
        if not v or "output_throughput" not in v:
            continue
        rows.append({"key": key, "design": design, "pairs": len(v["pairs"]),
                     **{f"{m}_{x}": v[m][y] for m in ("output_throughput", "median_ttft")
                        for x, y in (("ratio", "mean"), ("ci95", "ci95"), ("equivalent_within_2pct", "equivalent_within_2pct"))}})
    return {"designs": rows,
            "throughput_shown_within_2pct_by": [r["key"] for r in rows if r["output_throughput_equivalent_within_2pct"]],
            "median_ttft_shown_within_2pct_by": [r["key"] for r in rows if r["median_ttft_equivalent_within_2pct"]]}


def _b2_spread_note(doc: dict[str, Any]) -> str:
    """The sequential design's server spread, from its own pairs (each tool's throughput across pairs)."""
    v = doc.get("vs_vllm_bench")
    if not v or not v.get("pairs"):
        return ""
    xs = [p[k]["output_throughput"] for p in v["pairs"] for k in ("ours", "vllm")]
    return f" ((b2): each run's throughput spreads {100 * (max(xs) - min(xs)) / st.median(xs):.0f} % of the median across pairs)"


def _summary_lines(doc: dict[str, Any]) -> list[str]:
    sm = doc.get("vs_vllm_bench_summary") or comparison_summary(doc)
    if not sm["designs"]:
        return []
    ci = lambda c: f"{c[0]:.3f}-{c[1]:.3f}" if c and c[0] is not None else "n/a"  # noqa: E731
    lines = ["", "## Summary: agreement with `vllm bench serve` (ratios ours / vllm bench, measured)", "",
             "| design | pairs | output throughput: mean (95 % CI) | within 2 % shown | median TTFT: mean (95 % CI) | within 2 % shown |",
             "|---|---|---|---|---|---|"]
    for r in sm["designs"]:
        lines.append(f"| {r['design']} | {r['pairs']} | {r['output_throughput_ratio']:.3f} ({ci(r['output_throughput_ci95'])}) | "
                     f"{'yes' if r['output_throughput_equivalent_within_2pct'] else 'no'} | {r['median_ttft_ratio']:.3f} "
                     f"({ci(r['median_ttft_ci95'])}) | {'yes' if r['median_ttft_equivalent_within_2pct'] else 'no'} |")
    names = dict(COMPARISONS)
    says = lambda keys: ", ".join(names[k].split(")")[0] + ")" for k in keys) or "no design"  # noqa: E731
    lines += ["", f"Within 2 % shown (95 % interval of the mean ratio inside 0.98-1.02): throughput by {says(sm['throughput_shown_within_2pct_by'])}; "
              f"median TTFT by {says(sm['median_ttft_shown_within_2pct_by'])}. One tool after the other, the server's own "
              "run-to-run change lands in each ratio" + _b2_spread_note(doc) + "; run at the same time, it is common to both "
              "tools and cancels. Details per design below."]
    p, f = doc.get("vs_vllm_bench_concurrent_poisson"), doc.get("vs_vllm_bench_fake_server")
    if p and f and "ours_median_ttft_ms_minus_true" in f:
        # TTFT in ms, not as a ratio: a fixed client-side difference is a large share of a ~10 ms TTFT.
        d = [x["ours"]["median_ttft_ms"] - x["vllm"]["median_ttft_ms"] for x in p["pairs"]]
        ttft = st.median(x["vllm"]["median_ttft_ms"] for x in p["pairs"])
        fo, fv = f["ours_median_ttft_ms_minus_true"], f["vllm_median_ttft_ms_minus_true"]
        same_sign = all(x < 0 for x in d) and fo < fv or all(x > 0 for x in d) and fo > fv
        lines.append(f"\nTTFT in milliseconds: in (b2p) ours' median TTFT minus vllm bench's is {st.mean(d):+.2f} ms on average "
                     f"(per pair from {min(d):+.2f} to {max(d):+.2f} ms) at a median TTFT of {ttft:.1f} ms; ours lower in "
                     f"{sum(x < 0 for x in d)} of {len(d)} pairs. Against the fake server, whose TTFT is known (b1, TTFT "
                     f"{f['config']['fake_ttft_ms']:g} ms, concurrency {f['config']['conc']}), vllm bench reads {fv:+.1f} ms and ours "
                     f"{fo:+.1f} ms from the truth"
                     + (": the same direction in every pair, so the gap is client-side time one tool adds, not a server effect."
                        if same_sign else "."))
    return lines


def _derive(doc: dict[str, Any]) -> None:
    """Headline figures. The requests/s of one core is counted per second of the harness's own CPU
    time: on this shared 2-core machine other jobs take part of the pinned core, so the observed rate
    understates what one core drives (the observed rates and core shares are kept beside it)."""
    f = doc["fake_server"]
    doc["fake_server_req_per_s_one_core"] = 1000.0 / f["harness_cpu_ms_per_request_median"]
    doc["fake_server_observed_req_per_s_median"] = f["req_per_s_median"]
    doc["vs_vllm_bench_summary"] = comparison_summary(doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--fake-requests", type=int, default=5000)
    ap.add_argument("--fake-concurrency", type=int, default=64)
    ap.add_argument("--fake-reps", type=int, default=3)
    ap.add_argument("--fake-timing-requests", type=int, default=128, help="(b1): requests per run")
    # 512 requests keep one (b2) run above 10 s on the pinned one-core server (~2.6 k tok/s)
    ap.add_argument("--vllm-requests", type=int, default=512, help="(b2): requests per run")
    ap.add_argument("--vllm-concurrency", type=int, default=8)
    ap.add_argument("--vllm-output-len", type=int, default=64)
    ap.add_argument("--vllm-warmup-runs", type=int, default=2, help="(b2): discarded runs of each tool before the pairs")
    ap.add_argument("--no-pin", action="store_true", help="(b2): server and clients unpinned, default executor")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--only-b2", action="store_true",
                    help="re-run (b2) only and merge it into --out, keeping (a) and (b1) and their host data")
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "harness-overhead.json"))
    ap.add_argument("--from-json", default=None, help="only re-render the Markdown (and derived fields) of a result file")
    ap.add_argument("--merge-gpu", default=None, metavar="FILE",
                    help="merge the H200 comparison (h200_bench_compare.py's JSON or log, .gz ok) into --out and re-render")
    ap.add_argument("--gpu-config", default=None, help="JSON object: run configuration and date_utc/device/vllm_version, for a log")
    ap.add_argument("--gpu-note", action="append", default=[], help="a finding for the H200 comparison (repeatable)")
    ap.add_argument("--gpu-key", default="vs_vllm_bench_gpu", choices=list(GPU_SECTIONS),
                    help="which H200 section --merge-gpu fills (the newest run: vs_vllm_bench_gpu)")
    ap.add_argument("--only-b1-high-rate", action="store_true",
                    help="run (b1) at ~10 k tok/s (concurrency 64, TTFT 20 ms, ITL 5 ms) and merge it into --out")
    ap.add_argument("--only-b2-concurrent", action="store_true",
                    help="run (b2c), both tools at the same time on one server, and merge it into --out")
    ap.add_argument("--concurrent-requests", type=int, default=CONCURRENT_REQUESTS, help="(b2c): requests per tool and run")
    ap.add_argument("--concurrent-concurrency", type=int, default=4, help="(b2c): concurrency per tool")
    ap.add_argument("--concurrent-stagger-s", type=float, default=0.0,
                    help="(b2c): planned gap between the two tools' starts, alternating which leads")
    # Two: the first launches both tools at once (no start-up estimate yet), the second staggered as the pairs are.
    ap.add_argument("--concurrent-warmup-pairs", type=int, default=2, help="(b2c): discarded concurrent pairs first")
    ap.add_argument("--max-minutes", type=float, default=None, help="(b2c): start no pair that would end after this")
    ap.add_argument("--concurrent-rate", type=float, default=None, metavar="R",
                    help="(b2c) with Poisson arrivals at R requests/s per tool (open loop, --concurrent-concurrency caps "
                         "in-flight requests): recorded as vs_vllm_bench_concurrent_poisson (b2p)")
    ap.add_argument("--concurrent-ours-trust-env", action="store_true",
                    help="(b2c/b2p): ours with --trust-env, vllm bench's session setting; recorded apart (b2e)")
    ns = ap.parse_args()
    if ns.only_b2_concurrent:
        out = Path(ns.out)
        doc = json.loads(out.read_text())

        key = ("vs_vllm_bench_concurrent" if ns.concurrent_rate is None else
               "vs_vllm_bench_concurrent_poisson_trust_env" if ns.concurrent_ours_trust_env else "vs_vllm_bench_concurrent_poisson")

        def keep(section: dict[str, Any]) -> None:  # each pair on disk at once: a run cut short keeps its pairs
            doc[key] = section
            save(doc, out)

        with tempfile.TemporaryDirectory(prefix="harness-overhead-") as d:
            keep(vllm_concurrent_part(ns.pairs, ns.concurrent_requests, ns.concurrent_concurrency, ns.vllm_output_len, Path(d),
                                      pin=not ns.no_pin, warmup_pairs=ns.concurrent_warmup_pairs,
                                      stagger_s=ns.concurrent_stagger_s, on_summary=keep,
                                      deadline=time.monotonic() + 60 * ns.max_minutes if ns.max_minutes else None,
                                      rate=ns.concurrent_rate, ours_trust_env=ns.concurrent_ours_trust_env))
        print("\n".join(_b2c_lines(doc[key])))
        return 0
    if ns.only_b1_high_rate:
        out = Path(ns.out)
        doc = json.loads(out.read_text())
        with tempfile.TemporaryDirectory(prefix="harness-overhead-") as d:
            t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            doc["vs_vllm_bench_fake_server_high_rate"] = {**fake_timing_part(ns.pairs, 1000, 64, 64, 20.0, 5.0, Path(d)),
                                                          "date_utc": t0}
        save(doc, out)
        return 0
    if ns.merge_gpu:
        out = Path(ns.out)
        doc = json.loads(out.read_text())
        merge_gpu(doc, Path(ns.merge_gpu), json.loads(ns.gpu_config) if ns.gpu_config else None, ns.gpu_note, ns.gpu_key)
        save(doc, out)
        return 0
    if ns.from_json:
        src = Path(ns.from_json)
        doc = json.loads(src.read_text())
        _derive(doc)
        save(doc, src)
        return 0
    if ns.only_b2:
        out = Path(ns.out)
        doc = json.loads(out.read_text())
        prev = doc.get("vs_vllm_bench")
        with tempfile.TemporaryDirectory(prefix="harness-overhead-") as d:
            doc["vs_vllm_bench"] = vllm_part(ns.pairs, ns.vllm_requests, ns.vllm_concurrency, ns.vllm_output_len, Path(d),
                                             pin=not ns.no_pin, warmup_runs=ns.vllm_warmup_runs)
        if prev:  # the run this one replaces, kept short for the before/after in the Markdown
            doc["vs_vllm_bench"]["earlier_run"] = prev.get("earlier_run") or {
                "date_utc": doc["date_utc"], "config": prev["config"],
                "output_throughput_per_pair": prev["output_throughput"]["per_pair"],
                "median_ttft_per_pair": prev["median_ttft"]["per_pair"]}
        save(doc, out)
        print(out.with_suffix(".md").read_text())
        return 0
    import aiohttp

    doc: dict[str, Any] = {
        "benchmark": "harness-overhead", "measured": True,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "aiohttp": aiohttp.__version__},
    }
    doc["host"]["loadavg_1m_at_start"] = os.getloadavg()[0]
    fake = fake_server_part(ns.fake_requests, ns.fake_concurrency, ns.fake_reps)
    doc["fake_server"] = fake
    _derive(doc)
    if not ns.skip_vllm:
        with tempfile.TemporaryDirectory(prefix="harness-overhead-") as d:
            doc["vs_vllm_bench_fake_server"] = fake_timing_part(ns.pairs, ns.fake_timing_requests, ns.vllm_concurrency,
                                                                ns.vllm_output_len, 50.0, 10.0, Path(d))
        with tempfile.TemporaryDirectory(prefix="harness-overhead-") as d:
            doc["vs_vllm_bench"] = vllm_part(ns.pairs, ns.vllm_requests, ns.vllm_concurrency, ns.vllm_output_len, Path(d),
                                             pin=not ns.no_pin, warmup_runs=ns.vllm_warmup_runs)
    doc["host"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save(doc, out)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
