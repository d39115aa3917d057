#!/usr/bin/env python3
"""Our load-test harness vs ``vllm bench serve`` against one stock vLLM server on the H200 (read-only).

The CPU comparison in ``harness_overhead.py`` (b2) cannot resolve 2 %: the one-core CPU server's
own throughput varies 13-19 % between runs. A GPU server's does not, so this runs the same
interleaved protocol (``harness_overhead.interleaved``: A = loadtests, B = vllm bench serve, same
ShareGPT-format prompts, same tokenizer, fixed output length, greedy, closed loop) against a
stock vLLM server on one H200 and writes the pairs (``--out``). Clocks are never changed: refuses
to run unless ``POWERSAVE_FORCE_DRY_RUN=1`` (the server has no plugin at all).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import h200_ab as ab  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--requests", type=int, default=2000, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--warmup-runs", type=int, default=1)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--budget-s", type=float, default=520.0, help="no pair starts after this many seconds")
    ab.add_bundle_args(ap)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    model = ab.device_prologue(ns, str(ns.gpu))
    if model is None:
        return 2
    import harness_overhead as ho
    import vllm

    out = Path(ns.out)

    port = ab.job_port(ns.gpu, 40)
    p = ab.start_server("stock", model, port, [], ns.stock_site, out.parent, ns.gpu_mem)
    try:
        ab.wait_healthy({"stock": (p, port)}, timeout_s=300)
        with tempfile.TemporaryDirectory(prefix="bench-compare-") as d:
            data = Path(d) / "sharegpt.json"
            ho._sharegpt_file(data, max(400, 2 * ns.requests), 48)
            t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            config = {"n": ns.requests, "conc": ns.concurrency, "output_len": ns.output_len,
                      "server": f"vllm OpenAI server, {ns.shape} (--load-format dummy), stock, GPU {ns.gpu}",
                      "order": "A B, B A, A B, ... (A = loadtests, B = vllm bench serve)",
                      "warmups": f"{ns.warmup_runs} discarded run(s) of each tool, then 1 warm-up request per run in both tools"}

            device = ab.device_facts(ns.gpu)

            def save(runs: list[dict], final: bool) -> None:
                doc = {"what": "loadtests vs vllm bench serve, same stock vLLM server on one GPU (measured)", "measured": True,
                       "device": device, "vllm_version": vllm.__version__, "date_utc": t0,
                       "complete": final and len(runs) == ns.pairs, **ho.summarize_pairs(runs, config)}
                ab.write_json_atomic(out, doc, indent=1)  # after every pair: a cut run keeps its pairs
                if final:
                    ab.log("saved", out, f"{len(runs)} pairs, throughput ratio", doc["output_throughput_ratio"],
                           "TTFT ratio", doc["median_ttft_ratio"])

            runs = ho.interleaved("gpu", f"http://127.0.0.1:{port}", model, data, ns.pairs, ns.requests, ns.concurrency,
                                  ns.output_len, Path(d), warmup_runs=ns.warmup_runs,
                                  on_pair=lambda r: save(r, False), deadline=ab.T0 + ns.budget_s)
            if runs:
                save(runs, True)
    finally:
        ab.stop(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
