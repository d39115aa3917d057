"""LM-head chunking on a GPU: time and energy per chunk count and row count, for the chunking tuner.

Runs ``vllm_powersave.tune.lmhead.measure`` (which calls ``apply_chunked``, the plugin's own code) on
bf16 weights of real model shapes over a grid of row counts: decode batches and speculative rows
(logits only, ``mm``) and prompt-logprob lengths (logits + fp32 log-softmax + gather, ``mm+lsm``).

Energy: NVML's total-energy counter between two counter updates (it advances every ~100 ms), taken
while the GPU runs the call back to back for >= ``--window`` s; time: CUDA events. Read-only on
GPU settings: no clock, power limit or other setting is touched. Without a GPU it still runs (time
on the CPU, energy simulated for an H200, labelled ``simulated`` in every point).

Defaults measure qwen2.5-0.5b (hidden 896, vocab 151936) and llama3-8b (4096, 128256): 80 points,
116 s wall on an H200 with a 2 s warm-up (measured 2026-11-30), ~114 s with the default 1 s. Needs only torch, nvidia-ml-py and this repository: ``python -m benchmarks.lm_head_chunking --out
RAW.json`` from its root. Turn the output into the record with ``python -m benchmarks.lmhead_chunking_record``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_powersave.tune import lmhead

from .lib.device import require_dry_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=lmhead.DEFAULT_SHAPES, help="HIDDENxVOCAB,... (default: %(default)s)")
    ap.add_argument("--rows", default=lmhead.DEFAULT_GRID, help="ROWS:KIND,... with KIND decode|spec|logprobs (default: %(default)s)")
    ap.add_argument("--chunks", default=lmhead.DEFAULT_CHUNKS, help="candidate chunk counts (default: %(default)s)")
    ap.add_argument("--window", type=float, default=1.0, help="energy window per point, s (>= 1 on a GPU; default 1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=1.0, help="per shape, s of the heaviest call before measuring (default 1)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--out", required=True, help="raw JSON output path")
    ns = ap.parse_args(argv)
    if ns.device != "cpu":
        require_dry_run()  # a GPU job: only on a machine where nothing may change a GPU setting
    try:
        shapes, grid = lmhead.parse_shapes(ns.shapes), lmhead.parse_grid(ns.rows)
        chunks = lmhead.parse_ints(ns.chunks, "--chunks")
        if ns.repeats < 1:
            raise ValueError(f"--repeats = {ns.repeats}: must be >= 1")
        if not 0 < ns.window <= 60:
            raise ValueError(f"--window = {ns.window}: must be in (0, 60] s")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = lmhead.planned_points(shapes, grid, chunks, ns.repeats)
    print(f"[lm-head] {n} points, window {ns.window} s each (~{n * (ns.window + 0.3) + len(shapes) * ns.warmup:.0f} s)", flush=True)
    done = [0]
    t0 = time.monotonic()

    def progress(pt: dict) -> None:
        done[0] += 1
        print(
            f"[lm-head {done[0]}/{n} {time.monotonic() - t0:5.1f}s] {pt['hidden']}x{pt['vocab']} {pt['kind']:8s} rows {pt['rows']:6d} "
            f"chunks {pt['chunks']}: {pt['ms']:.3f} ms, {pt['j_per_call']:.4f} J ({pt['energy_source']}, window {pt['window_s']:.2f} s)",
            flush=True,
        )

    doc = lmhead.run_benchmark(
        ns.shapes, ns.rows, ns.chunks, window_s=ns.window, repeats=ns.repeats, warmup_s=ns.warmup, device=ns.device, progress=progress
    )
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(doc, indent=1))
    print(f"[lm-head] wrote {ns.out} ({len(doc['results'])} points, {doc['elapsed_s']:.0f} s, energy {doc['results'][0]['energy_source']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
