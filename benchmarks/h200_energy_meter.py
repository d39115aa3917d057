"""How far NVML's energy counter can be trusted, and what metering costs, on one GPU (read-only).

Runs ON the GPU machine (``bash benchmarks/device_run.sh meter@0``) with torch. Never changes a GPU
setting: it reads NVML through the plugin's own meters (``vllm_powersave.energy.meters``) and runs
matmuls. Parts (``--parts``):

a  Counter vs instant power. A steady bf16 matmul load runs while a thread samples, as fast as
   NVML answers, instant power and two meters: the raw counter (``interpolate=False``, quantised
   to its ~100 ms updates) and the plugin's interpolated meter (phase-synced as the plugin's
   publisher does). For windows of 2-30 s each energy is compared with the trapezoid integral of
   instant power: error = (meter - integral) / integral.
bgr Metering overhead as a server pays it: the plugin's whole ``WorkerRuntime`` (step hook,
   background publisher) around a GPU-bound CUDA-graph step (~1.5 ms), ``energy.meter`` "off" vs
   "nvml", ABBA pairs; reported: steps/s ratio nvml/off per pair, mean and 95 % interval.
c  Per-step attribution. Alternating "prefill" (large GEMMs), "decode" (small GEMMs) and idle
   segments attributed by ``PhaseEnergyAccount``; compared with each phase's power measured in
   steady single-phase windows x the phase's time.

Output: one JSON (``--out``), rewritten after every window.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch

from vllm_powersave.energy.account import PhaseEnergyAccount
from vllm_powersave.energy.meters import NvmlEnergyMeter

from .lib.ab import abba, ratio_summary
from .lib.device import log, require_dry_run, utc_now, write_json_atomic
from .lib.energy import device_facts, nvml_meters


class FastSampler(threading.Thread):
    """``(t, instant W, raw counter J, interpolated J)`` as fast as NVML answers; read-only."""

    def __init__(self, meter: NvmlEnergyMeter) -> None:
        super().__init__(daemon=True)
        self.interp = meter
        self.raw = NvmlEnergyMeter(meter.gpu, interpolate=False)
        self.interp.sync_counter_phase()
        self.rows: list[tuple[float, float, float, float]] = []
        self.stop_ev = threading.Event()

    def run(self) -> None:
        while not self.stop_ev.wait(0.0005):
            j = self.interp.energy_j()  # reads the counter and instant power
            w, raw = self.interp.power_w(), self.raw.energy_j()
            if None not in (j, w, raw):
                self.rows.append((time.monotonic(), w, raw, j))

    def window(self, t0: float, t1: float) -> dict:
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        if len(rows) < 10:
            return {}
        span = rows[-1][0] - rows[0][0]
        integral = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(rows, rows[1:]))
        raw, interp = rows[-1][2] - rows[0][2], rows[-1][3] - rows[0][3]
        updates = sum(1 for a, b in zip(rows, rows[1:]) if b[2] != a[2])
        return {
            "seconds": span,
            "samples": len(rows),
            "counter_updates": updates,
            "counter_update_period_ms": 1000 * span / max(updates, 1),
            "avg_power_w": integral / span,
            "integral_instant_j": integral,
            "counter_raw_j": raw,
            "counter_interpolated_j": interp,
            "rel_err_raw": (raw - integral) / integral,
            "rel_err_interpolated": (interp - integral) / integral,
        }


def steady_load(seconds: float, n: int = 8192) -> None:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(8):
            torch.mm(a, b)
        torch.cuda.synchronize()


def gemm_chain(rows: int, hidden: int, layers: int):
    """A step of ``layers`` chained [rows, hidden] x [hidden, hidden] GEMMs, then a sync."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5 for _ in range(layers)]

    def step() -> None:
        y = x
        for w in ws:
            y = torch.mm(y, w)
        torch.cuda.synchronize()

    return step


def graph_step(rows: int = 64, hidden: int = 4096, layers: int = 32, repeat: int = 4):
    """A GPU-bound decode-like step: one CUDA-graph replay of ``repeat`` x ``layers`` GEMMs, then a
    sync (like vLLM's wait for sampled tokens); a few µs of host work per step."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5 for _ in range(layers)]

    def body():
        y = x
        for _ in range(repeat):
            for w in ws:
                y = torch.mm(y, w)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()

    def step() -> None:
        g.replay()
        torch.cuda.synchronize()

    return step


def part_a(sampler: FastSampler, windows: list[tuple[float, int]], result: dict, save) -> None:
    steady_load(5.0)  # thermal / clock settle
    for secs, reps in windows:
        for r in range(reps):
            t0 = time.monotonic()
            steady_load(secs)
            w = {**sampler.window(t0, time.monotonic()), "window_s": secs, "repeat": r}
            result["a_windows"].append(w)
            log(
                f"a {secs:>4} s #{r}: raw err {100 * w.get('rel_err_raw', 0):+.2f} %, interp err {100 * w.get('rel_err_interpolated', 0):+.2f} %"
            )
            save()


def part_b_runtime(gpu: int, result: dict, save, pairs: int, window: float) -> None:
    import vllm_powersave.vllm_compat as vc
    from vllm_powersave.runtime import WorkerRuntime
    from vllm_powersave.settings import load_settings

    from .hook_overhead import sched  # the CPU micro-benchmark's stand-in scheduler output

    vc.runner_identity = lambda r: {"rank": 0, "device_type": "cuda", "device_index": gpu}
    step, so = graph_step(), sched(64)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        step()

    def rate(meter: str, d: str) -> dict:
        rt = WorkerRuntime(object(), load_settings({"energy": {"meter": meter}, "clocks": {"backend": "dry-run"}, "stats_dir": d}, env={}))
        try:
            it, t0 = 0, time.monotonic()
            while time.monotonic() < t0 + window:
                rt.on_step_start(so)
                step()
                rt.on_step_end()
                it += 1
            return {"steps_per_s": it / (time.monotonic() - t0)}
        finally:
            rt.close()

    rows = result["b_runtime_pairs"]
    with tempfile.TemporaryDirectory() as d:
        for pair, arm in abba(("off", "nvml"), pairs):
            rows.append({"pair": pair, "arm": arm, **rate(arm, d)})
            log(f"bgr pair {pair} meter {arm}: {rows[-1]['steps_per_s']:.2f} steps/s")
            save()
    result["meter_overhead_ratio_runtime"] = ratio_summary(rows, "steps_per_s", a="off", b="nvml")


def part_c(meter: NvmlEnergyMeter, sampler: FastSampler, result: dict, save) -> None:
    big_a = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    big_w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    decode = gemm_chain(64, 4096, 8)

    def prefill() -> None:
        for _ in range(6):
            torch.mm(big_a, big_w)
        torch.cuda.synchronize()

    ref = {}  # each phase's power in a steady single-phase window
    for name, fn in (("prefill", prefill), ("decode", decode)):
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            fn()
        t0 = time.monotonic()
        while time.monotonic() < t0 + 4.0:
            fn()
        ref[name] = sampler.window(t0, time.monotonic()).get("avg_power_w")
    time.sleep(1.0)
    t0 = time.monotonic()
    time.sleep(3.0)
    ref["idle"] = sampler.window(t0, time.monotonic()).get("avg_power_w")
    acct = PhaseEnergyAccount(meter, idle_after_s=0.25)
    stop = threading.Event()

    def ticks() -> None:  # the publisher's tick, every 0.25 s
        while not stop.wait(0.25):
            acct.tick()

    th = threading.Thread(target=ticks, daemon=True)
    th.start()
    c0, t_start = sampler.raw.energy_j(), time.monotonic()
    for _ in range(6):  # 6 cycles of 2 s prefill steps, 2 s decode steps, 1 s idle
        for phase, fn in (("prefill", prefill), ("decode", decode)):
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                acct.on_step(phase, 2048 if phase == "prefill" else 0, 64 if phase == "decode" else 0)
                fn()
                acct.on_step_end()
        time.sleep(1.0)
    time.sleep(0.6)
    acct.tick()
    stop.set()
    th.join()
    expected = {p: (ref.get(p) or 0.0) * acct.time_s.get(p, 0.0) for p in ("prefill", "decode", "idle")}
    result["c_attribution"] = {
        "reference_power_w": ref,
        "attributed_j": dict(acct.energy_j),
        "time_s": dict(acct.time_s),
        "expected_j_from_reference_power": expected,
        "rel_err_by_phase": {p: (acct.energy_j.get(p, 0) - e) / e for p, e in expected.items() if e},
        "attributed_total_j": sum(acct.energy_j.values()),
        "counter_total_j": sampler.raw.energy_j() - c0,
        "wall_s": time.monotonic() - t_start,
        "method": "PhaseEnergyAccount (tick 0.25 s, time-share split of counter deltas) vs steady-window power x phase time",
    }
    log("c attribution:", result["c_attribution"]["rel_err_by_phase"])
    save()


def main(argv: list[str] | None = None) -> int:
    require_dry_run()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", type=int, default=0, help="CUDA / NVML index (PCI bus order)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", default="2:4,5:3,10:3,30:1", help="part a: seconds:repeats,...")
    ap.add_argument("--pairs", type=int, default=12, help="part bgr: ABBA pairs")
    ap.add_argument("--pair-window", type=float, default=4.0, help="part bgr: seconds per window")
    ap.add_argument("--parts", default="a,bgr,c", help="subset of a,bgr,c")
    ns = ap.parse_args(argv)
    torch.cuda.set_device(ns.gpu)
    out = Path(ns.out)
    result: dict = {
        "what": "NVML energy counter vs instant power, metering overhead, per-step attribution (measured, read-only)",
        "measured": True,
        "device": device_facts(ns.gpu),
        "torch": torch.__version__,
        "date_utc": utc_now(),
        "a_windows": [],
        "b_runtime_pairs": [],
        "notes": [],
    }

    def save() -> None:
        write_json_atomic(out, result, indent=1)

    def sampled(part):
        meter = nvml_meters([ns.gpu])[0]
        s = FastSampler(meter)  # a fresh sampler per part; none during bgr, whose GIL contention would be noise
        s.start()
        try:
            part(meter, s)
        finally:
            s.stop_ev.set()
            s.join()

    windows = [(float(a), int(b)) for a, b in (x.split(":") for x in ns.windows.split(","))]
    parts = {
        "a": lambda: sampled(lambda m, s: part_a(s, windows, result, save)),
        "bgr": lambda: part_b_runtime(ns.gpu, result, save, ns.pairs, ns.pair_window),
        "c": lambda: sampled(lambda m, s: part_c(m, s, result, save)),
    }
    for name in ns.parts.split(","):
        try:
            parts[name]()
        except Exception as exc:  # keep what the other parts measured
            result["notes"].append(f"part {name} failed: {type(exc).__name__}: {exc}")
            log(f"part {name} failed:", exc)
    save()
    log("saved", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
