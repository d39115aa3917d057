"""Stock vLLM against the plugin's defaults under load, through ``vllm serve`` as a user starts it.

Both servers run side by side on one GPU (``--gpu-memory-utilization`` 0.42 each) and take the
load in turn, in adjacent pairs in ABBA order (pair 1 stock then defaults, pair 2 defaults then
stock, ...), each pair with its own seed and the same prompts for both arms. A server that is not
under load is idle: it draws no GPU time, and the GPU's counter is shared, so each arm's window
holds its own load only. Side by side saves a restart per run (~1 min each for a 7B shape), which
is what lets 6 pairs fit in one lease; it also keeps a CUDA context on the GPU at all times, so
the idle-power saving of ``cuda_perf_boost`` cannot show here: this job is for saturation points
(rates run with one server at a time in ``h200_defaults.py``).

Stock runs without the plugin installed (``--stock-site``); the defaults arm adds only
``--plugin powersave`` (its API-server pool, perf boost, dry-run clocks). Every window is measured
by the local NVML counter and scrapes ``/metrics`` at its edges alike (loadtests'
``metrics_interval_s``). Raw results go to ``$OUT/under-load-<tag>.json`` after every run, so a
job stopped at its time limit keeps what it measured; ``h200_under_load_record.py`` builds the
record from one or more such files.

Ablations (``--arms stock,defaults-1api,meter-only,no-watch-1api``): each arm after the first is
paired with the first in the same ABBA order, all servers side by side (0.88 of the GPU's memory
split evenly); the arms are :data:`ABLATIONS`, the defaults with one part taken away.

Run on the GPU machine (refuses to start without ``POWERSAVE_FORCE_DRY_RUN=1``)::

    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.h200_under_load --points c64 --pairs 6 --budget-s 560
    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.h200_under_load --points c256 --pairs 4 \
        --arms stock,defaults-1api,meter-only,no-watch-1api
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_powersave.serving import api_servers_in_log

from .lib import load
from .lib.device import log, make_model, require_dry_run, utc_now, write_json_atomic
from .lib.serve import NO_MULTICAST, SERVER_ENV, check_port_free, stop, tcp_listeners, wait_healthy

#: Load points (the issue's saturation points): closed loop at a concurrency, streamed.
POINTS = {
    "c64": dict(max_concurrency=64, input_len=512, output_len=256, num_prompts=400),
    "c256": dict(max_concurrency=256, input_len=128, output_len=128, num_prompts=1536),
    # A light closed loop, where decode pacing's closed-loop guard must give the throughput back
    # (docs/decode-pacing.md): 12 rounds of 16 clients, so a window holds the guard's first
    # pause (after 21-37 s in the simulator at these fixed lengths) and the unpaced rounds after it.
    "c16": dict(max_concurrency=16, input_len=512, output_len=256, num_prompts=192),
}
#: Arms: extra ``vllm serve`` flags; stock has no plugin on its path at all.
ARMS = {"stock": [], "defaults": ["--plugin", "powersave"]}
#: Ablations of the defaults where one API server is the limit (docs/under-load.md): each arm runs
#: ``--plugin powersave`` with these settings (its POWERSAVE_CONFIG file) and is paired with the
#: first arm of ``--arms``, normally stock. "1api": the plugin's API-server pool off.
ABLATIONS = {
    "defaults-1api": {"api_server_count": 1},
    "meter-only": {"savings": "off"},
    "boost-only-1api": {"api_server_count": 1, "cuda_perf_boost": "on", "clocks": {"mode": "off"}, "chunking": {"enabled": False}},
    "no-clocks-1api": {"api_server_count": 1, "clocks": {"mode": "off"}},
    "no-watch-1api": {"api_server_count": 1, "energy": {"starvation_watch": False}},
    # Decode pacing at the rate4 winner's target (docs/results/h100-decode-pacing.md) on a closed
    # loop, paired with the defaults (``--arms defaults,pacing-35``): what its guard costs.
    "pacing-35": {"decode_pacing": {"tpot_target_ms": 35.0}},
}
for _name in ABLATIONS:
    ARMS[_name] = ARMS["defaults"]
FRONT_END_LINE = re.compile(r"front end (\d+) API servers?|front end vLLM's choice \(([^)]*)\)")


@dataclass
class Arm:
    """One running server: its label, port, process and log."""

    label: str
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    facts: dict = field(default_factory=dict)

    def api_servers(self) -> int | None:
        """API-server processes the server started, counted in its log."""
        return api_servers_in_log(self.log_path)

    def front_end_line(self) -> str | None:
        """The plugin's start-line clause on the front end, where it logged one."""
        try:
            m = FRONT_END_LINE.search(self.log_path.read_text(errors="replace"))
        except OSError:
            return None
        return m.group(0) if m else None


def serve_cmd(model: Path, port: int, extra: list[str], serve_args: str) -> list[str]:
    """``vllm serve`` through vLLM's own CLI entry (the bundle has no console script)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--served-model-name", "model"]
    cmd += ["--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port), *serve_args.split(), *extra]
    return cmd


def arm_env(ns: argparse.Namespace, label: str) -> dict[str, str]:
    """The server environment of arm ``label``: stock without the plugin on its path; an ablation
    with its settings in a POWERSAVE_CONFIG file (written to ``--workdir``)."""
    site = ns.stock_site if label == "stock" else f"{ns.plugin_site}:{ns.stock_site}"
    env = {**SERVER_ENV, **NO_MULTICAST, "PYTHONPATH": site}
    if label in ABLATIONS:
        cfg = Path(ns.workdir) / f"powersave-{label}.json"
        cfg.write_text(json.dumps({"powersave": ABLATIONS[label]}))
        env["POWERSAVE_CONFIG"] = str(cfg)
    return env


def start_arm(ns: argparse.Namespace, arm: Arm, model: Path) -> None:
    """Start ``arm``'s server (refused if its port is taken) in its own session, logging to its file."""
    check_port_free(arm.port)
    env = {**os.environ, **arm_env(ns, arm.label)}
    cmd = serve_cmd(model, arm.port, ARMS[arm.label], f"{ns.serve_args} --gpu-memory-utilization {gpu_share(ns)}")
    with open(arm.log_path, "wb") as logf:
        logf.write((" ".join(cmd) + "\n").encode())
        arm.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log(f"[{arm.label}] starting on port {arm.port}")


def run_one(ns: argparse.Namespace, arm: Arm, point: str, seed: int) -> dict:
    """One measured window of ``point`` against ``arm`` (streamed; local NVML; same client for both)."""
    started_utc = utc_now()
    w = load.run_window(arm.port, f"{arm.label}-{point}", seed=seed, energy="nvml", gpus=[0], stream=True, **POINTS[point])
    res = w["res"]
    out = load.summary(res)
    out.update(
        started_utc=started_utc,
        api_servers=arm.api_servers(),
        idle_while_busy_j=res.get("gpu_idle_while_busy_energy_j"),
        idle_while_busy_share=res.get("idle_while_busy_share"),
    )
    log(
        f"[{arm.label}] {point}: {out.get('output_throughput') or 0:.0f} tok/s, "
        f"{out.get('gpu_energy_per_output_token_j')} J/tok, TPOT p99 {out.get('p99_tpot_ms')} ms, "
        f"TTFT p50 {out.get('median_ttft_ms')} ms, {out['api_servers']} API server(s)"
    )
    return out


def gpu_share(ns: argparse.Namespace) -> float:
    """Each server's ``--gpu-memory-utilization``: ``--gpu-share``, else 0.42 for two servers and
    0.88 split evenly for more (a 7B shape needs ~15 GiB of weights, well inside 0.2 of an H200)."""
    return ns.gpu_share or min(0.42, round(0.88 / len(ns.arms.split(",")), 2))


def pair_schedule(arms: list[str], pairs: int) -> list[tuple[int, str, tuple[str, str]]]:
    """(pair number, variant, run order) in run order: each variant of ``arms[1:]`` against
    ``arms[0]``, round by round, ABBA within each variant (reference first in odd pairs)."""
    ref, out = arms[0], []
    for i in range(pairs):
        for v in arms[1:]:
            out.append((i + 1, v, (ref, v) if i % 2 == 0 else (v, ref)))
    return out


def run_pairs(ns: argparse.Namespace, arms: dict[str, Arm], record: dict, save) -> None:
    """Adjacent pairs in ABBA order at each point until ``--pairs`` or the time budget runs out."""
    for point in ns.points.split(","):
        est_s = 60.0
        ref = ns.arms.split(",")[0]
        for n, variant, order in pair_schedule(ns.arms.split(","), ns.pairs):
            if time.monotonic() - T_START + 2 * est_s + 10 > ns.budget_s:
                log(f"{point}: pair {n} ({variant}) and later skipped: {2 * est_s:.0f} s would pass the budget")
                break
            pair = {"point": point, "pair": n, "arms": [ref, variant], "order": list(order), "seed": 1000 + n - 1}
            t0 = time.monotonic()
            for label in order:
                pair[label] = run_one(ns, arms[label], point, pair["seed"])
            est_s = (time.monotonic() - t0) / 2
            record["pairs"].append(pair)
            save()


def bring_up(ns: argparse.Namespace, model: Path) -> dict[str, Arm]:
    """Both servers, one after the other (vLLM checks free memory at start), or the ones already up."""
    labels = ns.arms.split(",")
    arms = {label: Arm(label, ns.port + k, Path(ns.workdir) / f"server-{label}.log") for k, label in enumerate(labels)}
    for arm in arms.values():
        if tcp_listeners(arm.port) > 0:
            log(f"[{arm.label}] reusing the server on port {arm.port}")
            continue
        start_arm(ns, arm, model)
        wait_healthy({arm.label: (arm.proc, arm.port)}, ns.start_timeout_s, {arm.label: arm.log_path})
    return arms


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="c64", help=f"comma-separated load points: {', '.join(POINTS)}")
    ap.add_argument("--pairs", type=int, default=6, help="adjacent stock/defaults pairs per point (ABBA order)")
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--shapes-dir", default=".gpu-bundle/shapes")
    ap.add_argument("--tok-dir", default="/tmp/model_cfg")
    ap.add_argument("--arms", default="stock,defaults", help=f"reference arm first, then the arms paired with it: {', '.join(ARMS)}")
    ap.add_argument("--serve-args", default="--max-model-len 2048 --max-num-seqs 256")
    ap.add_argument("--gpu-share", type=float, default=None, help="--gpu-memory-utilization of each server (default: see gpu_share)")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--plugin-site", default="/tmp/psite")
    ap.add_argument("--stock-site", default="/tmp/site")
    ap.add_argument("--workdir", default="/tmp/under-load")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--keep-servers", action="store_true", help="leave both servers up for the next call (they run in their own session)")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--budget-s", type=float, default=560.0, help="start no pair that cannot end by this (s since start)")
    return ap.parse_args(argv)


T_START = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    require_dry_run()  # first: nothing may touch a GPU before this
    ns = parse_args(argv)
    if bad := [p for p in ns.points.split(",") if p not in POINTS]:
        print(f"error: --points: unknown point {bad[0]!r} ({', '.join(POINTS)})", file=sys.stderr)
        return 2
    labels = ns.arms.split(",")
    if bad := [a for a in labels if a not in ARMS]:
        print(f"error: --arms: unknown arm {bad[0]!r} ({', '.join(ARMS)})", file=sys.stderr)
        return 2
    if len(set(labels)) != len(labels) or len(labels) < 2:
        print(f"error: --arms: {ns.arms!r}: give two or more different arms, the reference first", file=sys.stderr)
        return 2
    sys.path[:0] = [ns.plugin_site]
    Path(ns.workdir).mkdir(parents=True, exist_ok=True)
    tag = ns.tag or time.strftime("%m%d%H%M%S", time.gmtime())
    out = Path(ns.out) / f"under-load-{tag}.json"
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    model = make_model(ns.shape, Path(ns.shapes_dir), Path(ns.tok_dir))
    record = {"tag": tag, "started_utc": utc_now(), "device": load.device_facts(0), "shape": ns.shape}
    record["serve_args"] = f"{ns.serve_args} --gpu-memory-utilization {gpu_share(ns)}"
    record.update(points={p: POINTS[p] for p in ns.points.split(",")}, arms={a: ABLATIONS.get(a) for a in labels}, pairs=[])
    arms = bring_up(ns, model)
    record["front_end"] = {k: {"api_servers": a.api_servers(), "start_line": a.front_end_line()} for k, a in arms.items()}
    log(f"front end: {json.dumps(record['front_end'])}")
    try:
        run_pairs(ns, arms, record, lambda: write_json_atomic(out, record, indent=1))
    finally:
        record["ended_utc"] = utc_now()
        write_json_atomic(out, record, indent=1)
        if not ns.keep_servers:
            for a in arms.values():
                if a.proc is not None:
                    stop(a.proc)
    for p in record["pairs"]:
        a, b = (p[x] for x in p["arms"])
        ratio = (b.get("output_throughput") or 0) / (a.get("output_throughput") or 1)
        log(f"{p['point']} pair {p['pair']} {'/'.join(p['order'])}: {p['arms'][1]} throughput x{ratio:.3f}", tag="sum")
    return 0


if __name__ == "__main__":
    sys.exit(main())
