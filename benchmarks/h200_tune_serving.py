"""``vllm-powersave tune-serving`` on the H200 at the issue's two loads (docs/tune-serving.md).

Loads (issue 32, "Must show"):

* ``rate4``: Poisson 4 req/s, input uniform 128-1024 and output uniform 32-512 tokens (independent
  integer draws), streamed; SLO 99 % of requests with TTFT <= 2000 ms and TPOT <= 50 ms.
* ``c128``: saturation, 128 concurrent streams, input 512 and output 256 tokens; SLO 99 % of
  requests with TTFT <= 20000 ms and TPOT <= 60 ms.

Each load is one ``tune-serving`` search (its space below, 20 s first windows, successive halving
with eta 2 and at most 4 configurations; rate4: decode pacing off and on, one round) and 3 ABBA pairs of the winner against vLLM's defaults, in a
budget of 20 minutes of GPU time per load (``--budget-min 20``). The command runs from the plugin's
site (``--plugin-site`` before ``--stock-site`` on PYTHONPATH): the defaults arm is vLLM with the
plugin importable but not enabled, which changes nothing but accepting ``--plugin``; configurations
with ``cuda_perf_boost`` load it. Energy: the local NVML counter for every window (measured). Clocks
are never set on a shared GPU: this script refuses to start without ``POWERSAVE_FORCE_DRY_RUN=1``,
which also makes tune-serving skip the closed-loop budget (stated in the report).

A device call is limited (about 10 minutes): ``--call-budget-s`` interrupts the search in time
(SIGINT: the server is stopped, every finished window is in ``state.jsonl``) and a later call with
``--resume-from`` the earlier call's output continues where it stopped, nothing measured twice.
A load takes about 20 minutes in all: 2-3 calls. Outputs: ``$OUT/ts-<load>/`` (tune-serving's
files); ``h200_tune_serving_record.py`` builds ``docs/results/h200-tune-serving.{json,md,png}``.

Run on the GPU machine::

    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.h200_tune_serving --load rate4 --call-budget-s 560
    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.h200_tune_serving --load rate4 --resume-from runs/h200-ts/ts-rate4
    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.h200_tune_serving --load rate4 --resume-from DIR --pairs 6 --budget-min 30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .lib import load
from .lib.device import log, make_model, require_dry_run, utc_now, write_json_atomic
from .lib.serve import NO_MULTICAST, SERVER_ENV

#: The loads: tune-serving's traffic and SLO flags, and the space searched (YAML written per load).
LOADS = {
    "rate4": {
        "traffic": ["--rate", "4", "--input-len", "128:1024", "--output-len", "32:512"],
        "slo": ["--slo-ttft-ms", "2000", "--slo-tpot-ms", "50", "--slo-attainment", "0.99"],
        # Decode pacing off (vLLM's defaults: the plugin not loaded) and at 0.7 of the TPOT SLO
        # (the built-in space's larger share, ahead of 20 ms on the simulated H200:
        # results/sim-decode-pacing.md). An earlier search of
        # max_num_batched_tokens x cuda_perf_boost read all four within 1.3 % here
        # (results/h200-tune-serving.md).
        "space": {"decode_pacing_tpot_ms": [None, 35.0]},
        # Two configurations, one round: the device time goes to the pairs.
        "search": ["--max-configs", "2"],
    },
    "c128": {
        "traffic": ["--concurrency", "128", "--input-len", "512", "--output-len", "256"],
        "slo": ["--slo-ttft-ms", "20000", "--slo-tpot-ms", "60", "--slo-attainment", "0.99"],
        # The front end is this load's limit (results/h200-under-load.md): API servers, and tokens
        # per streamed chunk. Perf boost read within 1.9 % here on an H100 (results/h200-tune-serving.md).
        "space": {
            "api_server_count": [1, 4],
            "stream_interval": [1, 8],
        },
    },
}
#: Search flags common to both loads (see the module docstring); ``--pairs`` and ``--budget-min`` follow this script's own.
SEARCH = ["--window-s", "20", "--eta", "2", "--max-configs", "4", "--warmups", "8"]


def tune_cmd(ns: argparse.Namespace, load: str, model: Path, out: Path, space: Path) -> list[str]:
    """The ``vllm-powersave tune-serving`` command of one load."""
    spec = LOADS[load]
    serve = [f"--serve-arg={a}" for a in ("--max-model-len", "2048", "--load-format", "dummy", *ns.serve_args.split())]
    return [
        sys.executable,
        "-m",
        "vllm_powersave.cli",
        "tune-serving",
        "--model",
        str(model),
        "--out",
        str(out),
        "--space",
        str(space),
        *spec["traffic"],
        *spec["slo"],
        *SEARCH,
        *("--pairs", str(ns.pairs), "--budget-min", f"{ns.budget_min:g}"),
        *spec.get("search", []),
        *serve,
        "--startup-timeout",
        str(ns.start_timeout_s),
        "--no-progress",
    ]


def write_space(load: str, path: Path) -> Path:
    """The load's space as a YAML file (JSON is YAML)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(LOADS[load]["space"]) + "\n")
    return path


def resume(from_dir: Path | None, out: Path, gpu: str) -> int:
    """Copy an earlier call's ``state.jsonl`` into ``out``; the lines it holds (0: a fresh search).
    A search measured on another kind of GPU is refused: its windows and these would not compare."""
    if from_dir is None:
        return 0
    src = from_dir / "state.jsonl"
    if not src.is_file():
        raise SystemExit(f"error: --resume-from {from_dir}: no state.jsonl there")
    calls = json.loads((from_dir / "calls.json").read_text()) if (from_dir / "calls.json").is_file() else []
    other = sorted({c["gpu"] for c in calls if c.get("gpu") and c["gpu"] != gpu})
    if other:
        raise SystemExit(f"error: --resume-from {from_dir}: its windows ran on {other[0]}, this GPU is {gpu}")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("state.jsonl", "calls.json"):  # the finished windows, and the earlier calls' wall times
        if (from_dir / name).is_file() and (from_dir / name).resolve() != (out / name).resolve():
            shutil.copy(from_dir / name, out / name)
    return len(src.read_text().splitlines())


def run_call(cmd: list[str], env: dict[str, str], budget_s: float, log_path: Path) -> int:
    """Run tune-serving until it ends or ``budget_s`` passes (then SIGINT: it stops its server and keeps its state)."""
    with open(log_path, "ab") as logf:
        logf.write((" ".join(cmd) + "\n").encode())
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            return p.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            log(f"call budget {budget_s:.0f} s reached: interrupting (state kept; resume with --resume-from)")
            p.send_signal(signal.SIGINT)
            try:
                return p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
                return p.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", required=True, choices=sorted(LOADS))
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--shapes-dir", default=".gpu-bundle/shapes")
    ap.add_argument("--tok-dir", default="/tmp/model_cfg")
    ap.add_argument("--serve-args", default="--gpu-memory-utilization 0.9", help="more vllm serve arguments for every server")
    ap.add_argument("--plugin-site", default="/tmp/psite")
    ap.add_argument("--stock-site", default="/tmp/site")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--resume-from", type=Path, default=None, help="an earlier call's ts-<load> directory")
    ap.add_argument("--call-budget-s", type=float, default=560.0, help="interrupt the search after this many s (device call limit)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    # A resumed search may ask for more pairs than it started with (the count is not part of what
    # makes it the same search): 6 adjacent pairs settle a claim, the table needs 3.
    ap.add_argument("--pairs", type=int, default=3, help="final ABBA pairs, winner vs vLLM's defaults (default 3)")
    ap.add_argument("--budget-min", type=float, default=20.0, help="tune-serving's budget for search and pairs, min (default 20)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    require_dry_run()  # first: nothing may touch a GPU before this
    ns = parse_args(argv)
    out = Path(ns.out) / f"ts-{ns.load}"
    gpu = load.device_facts(0)["name"]  # a lease asked for one kind may come back another
    found = resume(ns.resume_from, out, gpu)
    model = make_model(ns.shape, Path(ns.shapes_dir), Path(ns.tok_dir))
    space = write_space(ns.load, out / "space.yaml")
    site = ":".join(p for p in (ns.plugin_site, ns.stock_site) if p)
    env = {**os.environ, **SERVER_ENV, **NO_MULTICAST, **({"PYTHONPATH": site} if site else {})}
    cmd = tune_cmd(ns, ns.load, model, out, space)
    log(
        f"{ns.load}: tune-serving ({'resuming from ' + str(found) + ' state lines' if found else 'fresh'}), call budget {ns.call_budget_s:.0f} s"
    )
    t0 = time.monotonic()
    rc = run_call(cmd, env, ns.call_budget_s, out / "tune-serving.log")
    calls = out / "calls.json"
    prior = json.loads(calls.read_text()) if calls.exists() else []
    prior.append(
        {"load": ns.load, "ended_utc": utc_now(), "wall_s": round(time.monotonic() - t0, 1), "exit": rc, "shape": ns.shape, "gpu": gpu}
    )
    write_json_atomic(calls, prior, indent=1)
    log(
        f"{ns.load}: tune-serving exit {rc} ({'done' if rc == 0 else 'rerun with --resume-from ' + str(out) if rc == 3 else 'see the log'})"
    )
    return 0 if rc in (0, 3, 4) else rc


if __name__ == "__main__":
    sys.exit(main())
