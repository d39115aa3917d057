#!/usr/bin/env python3
"""How far NVML's energy counter can be trusted, and what metering costs, on one GPU (read-only).

Runs ON the GPU machine with torch + pynvml (+ this package for part c). Never changes a GPU
setting: it only reads NVML and runs matmuls.

(a) Counter vs instant power. A steady bf16 matmul load runs while a sampler thread reads
    ``NVML_FI_DEV_POWER_INSTANT`` (falls back to ``nvmlDeviceGetPowerUsage``) and the total-energy
    counter as fast as it can (~1-2 kHz). For windows of 2, 5, 10 and 30 s it compares three
    energies: the raw counter difference (quantised to its ~100 ms updates), the counter with both
    edges interpolated by instant power (counter at its last update + P_instant x time since), and
    the trapezoid integral of instant power. Reported error: (counter - integral) / integral.
(b) Metering overhead. A decode-like loop of small GEMMs (launch-bound, like decode) runs in
    alternating 5 s windows without and with the plugin's metering as it runs in a server: a
    background thread reading the counter, power, SM clock and extras every 0.25 s, plus the
    per-step hook (``PhaseEnergyAccount.on_step`` / ``on_step_end``) on every iteration.
    Reported: iterations/s ratio with / without (median of pairs).
(c) Per-step attribution. Alternating "prefill" (large GEMMs), "decode" (small GEMMs) and idle
    segments are attributed by ``PhaseEnergyAccount`` from the counter; the per-phase split is
    compared with power measured in steady single-phase windows x the phase's time.

Output: one JSON (``--out``), written incrementally.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import pynvml as N
import torch

T0 = time.monotonic()


def log(*a: object) -> None:
    print(f"[meter +{time.monotonic() - T0:6.1f}s]", *a, flush=True)


class FastSampler(threading.Thread):
    """(t, instant W, counter mJ) as fast as NVML answers; read-only."""

    def __init__(self, handle) -> None:
        super().__init__(daemon=True)
        self.h = handle
        self.rows: list[tuple[float, float, int]] = []
        self.stop_ev = threading.Event()
        self.instant = True
        try:
            self._instant_w()
        except Exception:
            self.instant = False

    def _instant_w(self) -> float:
        v = N.nvmlDeviceGetFieldValues(self.h, [N.NVML_FI_DEV_POWER_INSTANT])[0]
        if v.nvmlReturn != N.NVML_SUCCESS:
            raise RuntimeError(f"POWER_INSTANT: {v.nvmlReturn}")
        return v.value.uiVal / 1000.0

    def power_w(self) -> float:
        return self._instant_w() if self.instant else N.nvmlDeviceGetPowerUsage(self.h) / 1000.0

    def run(self) -> None:
        while not self.stop_ev.is_set():
            try:
                t = time.monotonic()
                self.rows.append((t, self.power_w(), N.nvmlDeviceGetTotalEnergyConsumption(self.h)))
            except Exception:
                pass
            time.sleep(0.0005)

    def window(self, t0: float, t1: float) -> dict:
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        if len(rows) < 10:
            return {}
        integral = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(rows, rows[1:]))
        raw = (rows[-1][2] - rows[0][2]) / 1000.0

        def interp(i: int) -> float:
            # Counter at its last update before row i, plus instant power since that update.
            j = i
            while j > 0 and self.rows_all[j - 1][2] == self.rows_all[i][2]:
                j -= 1
            t_upd = self.rows_all[j][0]
            return self.rows_all[i][2] / 1000.0 + self.rows_all[i][1] * (self.rows_all[i][0] - t_upd)

        self.rows_all = self.rows
        i0 = self.rows.index(rows[0])
        i1 = self.rows.index(rows[-1])
        interp_j = interp(i1) - interp(i0)
        updates = sum(1 for a, b in zip(rows, rows[1:]) if b[2] != a[2])
        span = rows[-1][0] - rows[0][0]
        return {"seconds": span, "samples": len(rows), "counter_updates": updates,
                "counter_update_period_ms": 1000 * span / max(updates, 1),
                "avg_power_w": integral / span, "integral_instant_j": integral, "counter_raw_j": raw,
                "counter_interpolated_j": interp_j,
                "rel_err_raw": (raw - integral) / integral, "rel_err_interpolated": (interp_j - integral) / integral}


def steady_load(seconds: float, n: int = 8192) -> int:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    end, it = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for _ in range(8):
            torch.mm(a, b)
        torch.cuda.synchronize()
        it += 8
    return it


class DecodeLike:
    """A launch-bound loop: per 'step' a chain of small GEMMs like a decode step of a 0.5B model."""

    def __init__(self, rows: int = 64, hidden: int = 896, layers: int = 24) -> None:
        self.x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        self.w = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5 for _ in range(layers)]

    def step(self) -> None:
        y = self.x
        for w in self.w:
            y = torch.mm(y, w)
        torch.cuda.synchronize()


def part_a(handle, sampler: FastSampler, windows: list[tuple[float, int]], result: dict, save) -> None:
    log("part a: steady load, windows", windows)
    steady_load(5.0)  # thermal / clock settle
    for secs, reps in windows:
        for r in range(reps):
            t0 = time.monotonic()
            steady_load(secs)
            t1 = time.monotonic()
            w = sampler.window(t0, t1)
            w.update(window_s=secs, repeat=r)
            result["a_windows"].append(w)
            log(f"  {secs:>4} s #{r}: integral {w.get('integral_instant_j', 0):.1f} J, raw err {100 * w.get('rel_err_raw', 0):+.2f} %, "
                f"interp err {100 * w.get('rel_err_interpolated', 0):+.2f} %")
            save()


def metering_ab(handle, step, pairs: int, window: float, key: str, result: dict, save) -> list[dict]:
    """Alternating windows of ``step`` without / with the plugin's metering as it runs in a server
    (a thread ticking ``PhaseEnergyAccount`` and reading counter, power, SM clock and the extras
    every 0.25 s, plus ``on_step`` / ``on_step_end`` around every step); order alternates per pair."""
    from vllm_powersave.energy.account import PhaseEnergyAccount
    from vllm_powersave.energy.meters import NvmlEnergyMeter

    def run(with_meter: bool) -> float:
        stop = threading.Event()
        acct = th = None
        if with_meter:
            meter = NvmlEnergyMeter(N, handle, "bench")
            acct = PhaseEnergyAccount(meter, idle_after_s=0.25)

            def tick() -> None:
                while not stop.wait(0.25):
                    acct.tick()
                    meter.power_w()
                    meter.sm_clock_mhz()
                    meter.extra()
            th = threading.Thread(target=tick, daemon=True)
            th.start()
        it = 0
        t0 = time.monotonic()
        end = t0 + window
        while time.monotonic() < end:
            if acct is not None:
                acct.on_step("decode", 0, 64)
            step()
            if acct is not None:
                acct.on_step_end()
            it += 1
        rate = it / (time.monotonic() - t0)
        stop.set()
        if th is not None:
            th.join()
        return rate

    rows = result.setdefault(key, [])
    for p in range(pairs):
        order = (False, True) if p % 2 == 0 else (True, False)
        rates = {m: run(m) for m in order}
        ratio = rates[True] / rates[False]
        rows.append({"pair": p, "steps_per_s_without": rates[False], "steps_per_s_with": rates[True], "ratio": ratio})
        log(f"  pair {p}: without {rates[False]:.2f}/s, with {rates[True]:.2f}/s, ratio {ratio:.5f}")
        save()
    return rows


def part_b(handle, result: dict, save, pairs: int, window: float) -> None:
    log("part b: metering overhead on a launch-bound loop, pairs", pairs)
    loop = DecodeLike()
    for _ in range(200):
        loop.step()
    ratios = [x["ratio"] for x in metering_ab(handle, loop.step, pairs, window, "b_pairs", result, save)]
    result["meter_overhead_ratio"] = statistics.median(ratios)
    result["meter_overhead_ratio_spread"] = [min(ratios), max(ratios)]


class GraphStep:
    """A GPU-bound decode-like step: one CUDA-graph replay of 32 layers of [64, 4096] x [4096, 4096]
    GEMMs, 4 times over (~1-2 ms of GPU work), then a sync, like vLLM's wait for sampled tokens.
    Host work per step is a few µs, so window-to-window noise comes from the GPU, not the host."""

    def __init__(self, rows: int = 64, hidden: int = 4096, layers: int = 32, repeat: int = 4) -> None:
        self.x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        self.w = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5 for _ in range(layers)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self._body(repeat)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._body(repeat)
        torch.cuda.synchronize()

    def _body(self, repeat: int):
        y = self.x
        for _ in range(repeat):
            for w in self.w:
                y = torch.mm(y, w)
        return y

    def step(self) -> None:
        self.graph.replay()
        torch.cuda.synchronize()


def part_b_graph(handle, result: dict, save, pairs: int, window: float) -> None:
    """Like part b, on a GPU-bound CUDA-graph step (what a server's step looks like)."""
    log("part b (graph): metering overhead on a GPU-bound step, pairs", pairs)
    loop = GraphStep()
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        loop.step()
    rows = metering_ab(handle, loop.step, pairs, window, "b_graph_pairs", result, save)
    ratios = [x["ratio"] for x in rows]
    result["meter_overhead_ratio_graph"] = statistics.median(ratios)
    result["meter_overhead_ratio_graph_spread"] = [min(ratios), max(ratios)]
    result["graph_step_ms"] = 1000 / statistics.median(x["steps_per_s_without"] for x in rows)


def part_b_runtime(gpu: int, result: dict, save, pairs: int, window: float) -> None:
    """Metering overhead as the server pays it: the plugin's whole ``WorkerRuntime`` (step hook,
    background publisher with its tick / gauge / counter-phase schedule, rank-file writes) around a
    GPU-bound CUDA-graph step, with ``energy.meter`` "off" vs "nvml"; clocks dry-run, no presets.
    Both arms run the same hook; only the meter differs. Order rotates per pair."""
    import tempfile

    import vllm_powersave.vllm_compat as vc
    from hook_overhead import sched  # the same stand-in scheduler output as the CPU micro-benchmark
    from vllm_powersave.runtime import WorkerRuntime
    from vllm_powersave.settings import load_settings

    log("part b (runtime): meter off vs nvml inside the plugin's WorkerRuntime, pairs", pairs)
    vc.runner_identity = lambda r: {"rank": 0, "device_type": "cuda", "device_index": gpu}
    loop = GraphStep()
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        loop.step()
    so = sched(64)

    def run(meter: str, d: str) -> float:
        s = load_settings({"energy": {"meter": meter}, "clocks": {"backend": "dry-run"}, "stats_dir": d}, env={})
        rt = WorkerRuntime(object(), s)
        try:
            it, t0 = 0, time.monotonic()
            end = t0 + window
            while time.monotonic() < end:
                rt.on_step_start(so)
                loop.step()
                rt.on_step_end()
                it += 1
            return it / (time.monotonic() - t0)
        finally:
            rt.close()

    rows = result.setdefault("b_runtime_pairs", [])
    with tempfile.TemporaryDirectory() as d:
        for p in range(pairs):
            order = ("off", "nvml") if p % 2 == 0 else ("nvml", "off")
            rates = {m: run(m, d) for m in order}
            ratio = rates["nvml"] / rates["off"]
            rows.append({"pair": p, "steps_per_s_meter_off": rates["off"], "steps_per_s_meter_nvml": rates["nvml"], "ratio": ratio})
            log(f"  pair {p}: meter off {rates['off']:.2f}/s, nvml {rates['nvml']:.2f}/s, ratio {ratio:.5f}")
            save()
    ratios = [x["ratio"] for x in rows]
    result["meter_overhead_ratio_runtime"] = statistics.median(ratios)
    result["meter_overhead_ratio_runtime_spread"] = [min(ratios), max(ratios)]
    result["runtime_graph_step_ms"] = 1000 / statistics.median(x["steps_per_s_meter_off"] for x in rows)


def part_c(handle, sampler: FastSampler, result: dict, save) -> None:
    from vllm_powersave.energy.account import PhaseEnergyAccount
    from vllm_powersave.energy.meters import NvmlEnergyMeter

    log("part c: per-step attribution")
    n = 4096
    big_a = torch.randn(2048, n, device="cuda", dtype=torch.bfloat16)
    big_w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    small = DecodeLike(rows=64, hidden=4096, layers=8)

    def prefill_step() -> None:
        for _ in range(6):
            torch.mm(big_a, big_w)
        torch.cuda.synchronize()

    # Reference power of each phase in steady single-phase windows.
    ref = {}
    for name, fn in (("prefill", prefill_step), ("decode", small.step)):
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            fn()
        t0 = time.monotonic()
        end = t0 + 4.0
        while time.monotonic() < end:
            fn()
        ref[name] = sampler.window(t0, time.monotonic()).get("avg_power_w")
    torch.cuda.synchronize()
    time.sleep(1.0)
    t0 = time.monotonic()
    time.sleep(3.0)
    ref["idle"] = sampler.window(t0, time.monotonic()).get("avg_power_w")
    log("  reference power W:", ref)

    meter = NvmlEnergyMeter(N, handle, "bench")
    acct = PhaseEnergyAccount(meter, idle_after_s=0.25)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.25):
            acct.tick()
    th = threading.Thread(target=tick, daemon=True)
    th.start()
    c0 = N.nvmlDeviceGetTotalEnergyConsumption(handle)
    t_start = time.monotonic()
    # 6 cycles of: 2 s prefill steps, 2 s decode steps, 1 s idle.
    for _ in range(6):
        for phase, fn, secs in (("prefill", prefill_step, 2.0), ("decode", small.step, 2.0)):
            end = time.monotonic() + secs
            while time.monotonic() < end:
                acct.on_step(phase, 2048 if phase == "prefill" else 0, 64 if phase == "decode" else 0)
                fn()
                acct.on_step_end()
        time.sleep(1.0)
    time.sleep(0.6)
    acct.tick()
    stop.set()
    th.join()
    counter_j = (N.nvmlDeviceGetTotalEnergyConsumption(handle) - c0) / 1000.0
    attributed = dict(acct.energy_j)
    seconds = dict(acct.time_s)
    expected = {p: (ref.get(p) or 0.0) * seconds.get(p, 0.0) for p in ("prefill", "decode", "idle")}
    result["c_attribution"] = {
        "reference_power_w": ref, "attributed_j": attributed, "time_s": seconds,
        "expected_j_from_reference_power": expected,
        "rel_err_by_phase": {p: (attributed.get(p, 0) - e) / e for p, e in expected.items() if e},
        "attributed_total_j": sum(attributed.values()), "counter_total_j": counter_j,
        "wall_s": time.monotonic() - t_start,
        "method": "PhaseEnergyAccount (tick 0.25 s, time-share split of counter deltas) vs steady-window power x phase time",
    }
    log("  attribution:", json.dumps(result["c_attribution"])[:600])
    save()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int, default=0, help="CUDA / NVML index (PCI bus order)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", default="2:4,5:3,10:3,30:1", help="seconds:repeats,...")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--pair-window", type=float, default=4.0)
    ap.add_argument("--parts", default="a,b,c", help="subset of a,b,bg,bgr,c (bg: part b on a CUDA-graph step; bgr: bg inside the plugin's WorkerRuntime)")
    ns = ap.parse_args()

    N.nvmlInit()
    handle = N.nvmlDeviceGetHandleByIndex(ns.gpu)
    torch.cuda.set_device(ns.gpu)
    name = N.nvmlDeviceGetName(handle)
    result: dict = {"what": "NVML energy counter vs instant power, metering overhead, per-step attribution (measured, read-only)",
                    "measured": True,
                    "device": name.decode() if isinstance(name, bytes) else name,
                    "driver": str(N.nvmlSystemGetDriverVersion()), "torch": torch.__version__,
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "a_windows": [], "b_pairs": [], "notes": []}
    out = Path(ns.out)

    def save() -> None:
        out.with_suffix(".tmp").write_text(json.dumps(result, indent=1))
        out.with_suffix(".tmp").replace(out)

    windows = [(float(a), int(b)) for a, b in (x.split(":") for x in ns.windows.split(","))]

    def sampled(fn):
        # A fresh fast sampler per part; none during part b, whose GIL contention would be noise.
        s = FastSampler(handle)
        result["instant_power_source"] = "NVML_FI_DEV_POWER_INSTANT" if s.instant else "nvmlDeviceGetPowerUsage"
        s.start()
        try:
            fn(s)
        finally:
            s.stop_ev.set()
            s.join()

    parts = ns.parts.split(",")
    for name_, fn in (("a", lambda: sampled(lambda s: part_a(handle, s, windows, result, save))),
                      ("b", lambda: part_b(handle, result, save, ns.pairs, ns.pair_window)),
                      ("bg", lambda: part_b_graph(handle, result, save, ns.pairs, ns.pair_window)),
                      ("bgr", lambda: part_b_runtime(ns.gpu, result, save, ns.pairs, ns.pair_window)),
                      ("c", lambda: sampled(lambda s: part_c(handle, s, result, save)))):
        if name_ not in parts:
            continue
        try:
            fn()
        except Exception as exc:  # keep what the other parts measured
            result["notes"].append(f"part {name_} failed: {type(exc).__name__}: {exc}")
            log(f"part {name_} failed:", exc)
    save()
    log("saved", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
