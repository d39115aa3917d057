"""What the closed loop's GPU step timer sees and costs (``device/step_timer.py``), on one GPU.

A stand-in decode step (a bf16 GEMV over a 7B-sized weight slab: memory-bound, its time set by
bandwidth) is launched back to back without synchronising, as vLLM's async scheduling does:

* **what it sees**: the step's span from CUDA events against the host's launch time (what the
  engine thread measured before) and against a synchronised wall time of the same work;
* **what it costs**: host (engine-thread) time per step with the timer vs without, in interleaved
  blocks (mean and 95 % interval over blocks): two records per step, and the previous step's
  events read and released on the same thread, as the plugin's step path does.

Read-only on GPU settings; refuses to start without ``POWERSAVE_FORCE_DRY_RUN=1``.

    python -m benchmarks.step_timer [--blocks 8] [--steps 2000] [--out step-timer.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import deque
from pathlib import Path

from benchmarks.lib.device import require_dry_run, utc_now
from benchmarks.lib.stats import mean_ci95


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8, help="interleaved blocks per arm")
    ap.add_argument("--steps", type=int, default=2000, help="steps per block")
    ap.add_argument("--weight-gib", type=float, default=2.0, help="weights read per stand-in step (GiB)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_dry_run()
    import torch

    from vllm_powersave.device.step_timer import CudaEventStepTimer

    n = int(args.weight_gib * 2**30 / 2 / 8192)
    w = torch.randn(n, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 1, device="cuda", dtype=torch.bfloat16)
    timer = CudaEventStepTimer(torch.cuda.current_device())

    def run(steps: int) -> tuple[list[float], list[float]]:
        """GPU ms per step (events) and host launch ms per step, steps launched back to back."""
        q: deque = deque()
        gpu_ms: list[float] = []
        done = threading.Event()

        def reader() -> None:  # spans only (no graph capture here): read once the GPU passed the end event
            while not (done.is_set() and not q):
                while q:
                    ms = timer.elapsed_ms(q[0])
                    if ms is None:
                        break
                    gpu_ms.append(ms)
                    timer.release(q.popleft())
                time.sleep(0.01)

        th, launch_ms = threading.Thread(target=reader), []
        th.start()
        for _ in range(steps):
            a = time.perf_counter()
            mark = timer.start()
            torch.mm(w, x)
            timer.stop(mark)
            q.append(mark)
            launch_ms.append((time.perf_counter() - a) * 1e3)
        torch.cuda.synchronize()
        done.set()
        th.join()
        return gpu_ms, launch_ms

    run(200)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        torch.mm(w, x)
    torch.cuda.synchronize()
    sync_ms = (time.perf_counter() - t) / 200 * 1e3
    # Host cost: only the timer's own calls, so time them alone around a tiny launch per step.
    xs = torch.randn(16, device="cuda")
    cost: dict[bool, list[float]] = {False: [], True: []}
    for b in range(2 * args.blocks):
        timed = bool(b % 2) ^ (b // 2 % 2 == 1)  # ABBA
        torch.cuda.synchronize()
        t = time.perf_counter()
        prev = None
        for _ in range(args.steps):
            if timed and prev is not None and timer.elapsed_ms(prev) is not None:
                timer.release(prev)  # as the plugin does: read at a later step's start, same thread
                prev = None
            mark = timer.start() if timed else None
            xs.add_(1.0)
            if timed:
                timer.stop(mark)
                if prev is None:
                    prev = mark
                else:
                    timer.release(mark)
        torch.cuda.synchronize()
        cost[timed].append((time.perf_counter() - t) / args.steps * 1e6)
    ev = torch.cuda.Event(enable_timing=True)
    per_call = {}
    for name, call in (("event_record_public_us", ev.record), ("timer_record_us", lambda: timer._record_now(ev))):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            call()
        per_call[name] = round((time.perf_counter() - t) / args.steps * 1e6, 3)
        torch.cuda.synchronize()
    gpu_ms, launch_ms = run(200)  # 3 launches per step: stays inside the ~1,024-entry launch queue
    gpu_ms.sort()
    launch_ms.sort()
    diff = [a - b for a, b in zip(cost[True], cost[False])]
    m, lo, hi = mean_ci95(diff)
    out = {"what": "CUDA-event step timer: GPU span vs launch time, and its host cost (measured)", "date": utc_now()}
    out.update(device=torch.cuda.get_device_name(), stand_in_step=f"bf16 GEMV over {args.weight_gib} GiB of weights")
    out.update(sync_wall_ms_per_step=round(sync_ms, 4), event_ms_p50=round(gpu_ms[len(gpu_ms) // 2], 4))
    out["event_ms_p5_p95"] = [round(gpu_ms[len(gpu_ms) // 20], 4), round(gpu_ms[-len(gpu_ms) // 20], 4)]
    out["host_launch_ms_p50"] = round(launch_ms[len(launch_ms) // 2], 4)
    out["timer_host_us_per_step"] = {"mean": round(m, 3), "ci95": [round(lo, 3), round(hi, 3)], "blocks": args.blocks}
    out.update(host_us_per_step_without=round(sum(cost[False]) / len(cost[False]), 3), **per_call)
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
