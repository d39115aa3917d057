#!/usr/bin/env python3
"""Per-request energy of identical requests at a steady batch, and the sum against the counter.

Starts ``vllm serve MODEL --plugin powersave`` with ``per_request_energy`` on (no clock presets: it
never changes a GPU setting), sends ``--requests`` identical non-streaming completions (a prompt of
exactly ``--prompt-tokens`` token ids, ``--output-tokens`` out, ``ignore_eos``) from
``--concurrency`` client threads, and reads each response's ``x-powersave-energy-j``. The first and
last ``2 x concurrency`` requests (ramp-up and drain) are left out of the spread, as in
docs/request-energy.md's steady-batch figures.

Reported: p5 / p50 / p95 / max of the steady requests' joules (and each over the median); from
/metrics before and after (idle on both sides), the GPU energy delta against requests + idle +
tail. The energy source (``measured`` on a GPU with NVML, else ``simulated``) is the server's own
label and is written into every output.

    python benchmarks/request_energy_fairness.py --model /path/to/model --out docs/results/h200-request-energy.json
    python benchmarks/request_energy_fairness.py --tiny --requests 40 --concurrency 4 --out /tmp/cpu.json  # CPU build
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from vllm_powersave.serving import VllmServer, default_serve_args

_LINE = re.compile(r"^(powersave_[a-z_]+)\{([^}]*)\} ([-0-9.e+]+)$")


def scrape(url: str) -> dict[str, float]:
    """Sums of the energy counters this benchmark reads, over GPUs (J)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {"gpu_j": 0.0, "idle_j": 0.0, "requests_j": 0.0, "tail_j": 0.0, "requests": 0.0}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, v = m.group(1), m.group(2), float(m.group(3))
        if name == "powersave_gpu_energy_joules_total":
            out["gpu_j"] += v
            if 'phase="idle"' in labels:
                out["idle_j"] += v
        elif name == "powersave_request_energy_joules_total":
            out["requests_j"] += v
        elif name == "powersave_request_tail_energy_joules_total":
            out["tail_j"] += v
        elif name == "powersave_requests_finished_total":
            out["requests"] += v
    return out


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="reqenergy-"))
    model = args.model
    if args.tiny:
        from vllm_powersave.modelgen import make_model

        model = str(make_model(tmp / "qwen2-tiny", "qwen2-tiny"))
    cfg = {
        "powersave": {
            "per_request_energy": True,
            "stats_dir": str(tmp / "stats"),
            "cuda_perf_boost": "off",
            "energy": {"response_wait_ms": 3000},
        }
    }
    srv = VllmServer(
        default_serve_args(model)
        + ["--max-num-seqs", str(args.concurrency), "--plugin", "powersave", "--additional-config", json.dumps(cfg)],
        log_path=tmp / "server.log",
    )
    srv.start()
    try:
        body = json.dumps(
            {
                "model": "model",
                "prompt": [100 + i % 1000 for i in range(args.prompt_tokens)],
                "max_tokens": args.output_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
        ).encode()

        def one() -> tuple[float | None, str]:
            req = urllib.request.Request(srv.base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
                h = r.headers
            j = h.get("x-powersave-energy-j")
            return (float(j) if j else None), h.get("x-powersave-energy-source", "?")

        one()  # warm-up (graphs, caches); not counted
        time.sleep(args.settle_s)
        before = scrape(srv.base_url)
        results: list[tuple[int, float, float, float | None, str]] = []
        lock, next_i = threading.Lock(), [0]

        def client() -> None:
            while True:
                with lock:
                    i = next_i[0]
                    if i >= args.requests:
                        return
                    next_i[0] += 1
                t0 = time.monotonic()
                j, src = one()
                with lock:
                    results.append((i, t0, time.monotonic(), j, src))

        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        t_start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall_s = time.monotonic() - t_start
        time.sleep(args.settle_s)  # idle detected, the last figures published
        after = scrape(srv.base_url)
    finally:
        srv.stop()
    results.sort(key=lambda r: r[1])  # in order of sending
    skip = 2 * args.concurrency
    steady = [r[3] for r in results[skip : len(results) - skip] if r[3] is not None]
    missing = sum(1 for r in results if r[3] is None)
    sources = sorted({r[4] for r in results})
    d = {k: after[k] - before[k] for k in after}
    rec: dict = {
        "what": "identical requests at a steady batch: per-request energy spread, and requests + idle + tail against the GPU counter",
        "where": platform.node(),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": ",".join(sources),  # 'measured' (NVML counter) or 'simulated'
        "config": {k: getattr(args, k) for k in ("requests", "concurrency", "prompt_tokens", "output_tokens")} | {"model": model},
        "wall_s": round(wall_s, 2),
        "requests_without_figure": missing,
        "steady_requests": len(steady),
    }
    if len(steady) >= 20:
        med = statistics.median(steady)
        q = statistics.quantiles(steady, n=20)
        rec["steady_j"] = {"p5": q[0], "p50": med, "p95": q[-1], "max": max(steady), "min": min(steady)}
        rec["steady_over_median"] = {"p5": q[0] / med, "p95": q[-1] / med, "max": max(steady) / med}
    rec["sum_check_j"] = {
        "gpu_counter": d["gpu_j"],
        "requests": d["requests_j"],
        "idle": d["idle_j"],
        "tail": d["tail_j"],
        "residual": d["gpu_j"] - d["requests_j"] - d["idle_j"] - d["tail_j"],
        "requests_counted": d["requests"],
    }
    return rec


def markdown(rec: dict) -> str:
    s = rec.get("steady_j", {})
    r = rec.get("steady_over_median", {})
    c = rec["sum_check_j"]
    lines = [f"# Per-request energy at a steady batch ({rec['source']})", "", f"{rec['when']} on {rec['where']}; {rec['config']}.", ""]
    if s:
        lines += [
            f"Steady requests ({rec['steady_requests']}): p5 / p50 / p95 / max = {s['p5']:.3f} / {s['p50']:.3f} / "
            f"{s['p95']:.3f} / {s['max']:.3f} J ({r['p5']:.3f} / 1 / {r['p95']:.3f} / {r['max']:.3f} of the median).",
            "",
        ]
    lines += [
        f"Counter {c['gpu_counter']:.1f} J = requests {c['requests']:.1f} + idle {c['idle']:.1f} + tail {c['tail']:.1f} "
        f"(residual {c['residual']:.3f} J, in flight or pending at the end).",
        "",
        "Figures are labelled with the server's energy source; method: docs/request-energy.md.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory")
    p.add_argument("--tiny", action="store_true", help="generate and serve the tiny test model (CPU build)")
    p.add_argument("--requests", type=int, default=480)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument("--settle-s", type=float, default=2.0, help="idle wait before and after the run, s")
    p.add_argument("--out", required=True, help="JSON record (a Markdown twin is written next to it)")
    args = p.parse_args()
    if not args.model and not args.tiny:
        p.error("--model or --tiny is required")
    rec = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rec))
    print(markdown(rec))


if __name__ == "__main__":
    main()
