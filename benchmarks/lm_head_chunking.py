#!/usr/bin/env python3
"""LM-head chunking on a real GPU: time, energy and peak memory per chunk count and row count.

Measures ``vllm_powersave.chunking.apply.apply_chunked`` (the code the plugin runs) on bf16 weights
of real model shapes, in two modes:

* ``mm``: logits only (``[rows, hidden] x [hidden, vocab]``), the decode / speculative case;
* ``mm+lsm``: logits, fp32 log-softmax and a gather per chunk, keeping only ``[rows]`` values: the
  prompt-logprob pattern, where chunking bounds the ``[rows, vocab]`` fp32 peak.

Each configuration repeats the call until the window lasts ``--window`` seconds (NVML's energy
counter updates every 100 ms; windows of ~1 s keep its quantisation near ±5 %, and the A/B of chunk
counts is interleaved per row count so drift cancels). Time from CUDA events; energy from
``nvmlDeviceGetTotalEnergyConsumption`` (measured). Read-only on GPU settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from vllm_powersave.chunking.apply import apply_chunked  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="896x151936,3584x152064")
    ap.add_argument("--rows", default="8,64,256,1024,4096,16384")
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--modes", default="mm,mm+lsm")
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    import pynvml as N

    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    dev = torch.device("cuda:0")
    results = []
    t_start = time.monotonic()
    for shape in ns.shapes.split(","):
        hidden, vocab = (int(x) for x in shape.split("x"))
        w = torch.randn(vocab, hidden, device=dev, dtype=torch.bfloat16) * 0.02
        for mode in ns.modes.split(","):
            for rows in (int(r) for r in ns.rows.split(",")):
                x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
                idx = torch.randint(0, vocab, (rows, 1), device=dev)

                def head(hs):
                    return hs @ w.t()

                def call(c):
                    if mode == "mm":
                        return apply_chunked(head, x, c)
                    parts = [head_rows(xs, ids) for xs, ids in zip(torch.tensor_split(x, c), torch.tensor_split(idx, c))] if c > 1 else [head_rows(x, idx)]
                    return torch.cat(parts)

                def head_rows(xs, ids):
                    return torch.log_softmax((xs @ w.t()).float(), dim=-1).gather(-1, ids)

                chunk_list = [int(c) for c in ns.chunks.split(",") if int(c) <= rows]
                for rep in range(ns.repeats):
                    for c in (chunk_list if rep % 2 == 0 else list(reversed(chunk_list))):
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats(dev)
                        base = torch.cuda.memory_allocated(dev)
                        call(c)
                        torch.cuda.synchronize()
                        peak_mib = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
                        # calibrate iterations for the window
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        for _ in range(3):
                            call(c)
                        e.record()
                        torch.cuda.synchronize()
                        per = max(s.elapsed_time(e) / 3, 1e-3)
                        iters = max(3, int(ns.window * 1000 / per))
                        e0 = N.nvmlDeviceGetTotalEnergyConsumption(h)
                        s.record()
                        for _ in range(iters):
                            call(c)
                        e.record()
                        torch.cuda.synchronize()
                        e1 = N.nvmlDeviceGetTotalEnergyConsumption(h)
                        ms = s.elapsed_time(e) / iters
                        results.append({"hidden": hidden, "vocab": vocab, "mode": mode, "rows": rows, "chunks": c, "repeat": rep,
                                        "ms": ms, "j_per_call": (e1 - e0) / 1000.0 / iters, "window_s": ms * iters / 1000,
                                        "peak_mib": peak_mib, "sm_clock_mhz": N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM)})
                        print(json.dumps(results[-1]), flush=True)
                with open(ns.out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": results}, f)
        del w
        torch.cuda.empty_cache()
    print(f"done in {time.monotonic() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
