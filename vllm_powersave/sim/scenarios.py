"""Adversarial conditions for simulated replays: a GPU that changes while it serves, a clock that
misbehaves, step times that lie. Everything here is **simulated** and must be labelled so.

* :class:`GpuDrift`: the GPU's state as a function of time: a memory-bound knee that moves
  (``knee_from_mhz`` -> ``knee_to_mhz``), a whole-step slowdown that grows (thermals) and periods
  when another tenant slows every step. The stock-clock step is priced on the same state, so a
  strategy is judged only on what its clocks add.
* :class:`ClockFaults` and :class:`FaultyLaggedClock`: a clock that lands later than configured,
  ignores every set, drops some requests, or is reset to the default behind the controller's back.
* :class:`Scenario`: both, plus measurement outliers (a share of steps whose *measured* time is a
  multiple of the true one: host hiccups).

The replay that drives the real controller through them is ``tune/replay.py`` (``sim/`` does not
import ``clocks/``: docs/design.md, "Layering").
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field, replace

from .gpu import GpuSpec
from .trace import LaggedClock, Step, StepCost, Trace

#: Knee positions are priced on a 5 MHz grid, so that drifting states share cached step prices.
_KNEE_GRID_MHZ = 5


@dataclass(frozen=True)
class GpuDrift:
    """A GPU whose state changes with time (s from the replay's start). Simulated.

    ``knee_*_mhz``: the memory-bound knee (``GpuSpec.mem_bound_min_mhz``) moves linearly from one
    to the other over ``start_s .. start_s + over_s`` (``None``: unchanged); ``slow_to``: the
    whole step's time factor reached at the same end, from 1 (thermals: every clock, stock
    included); ``cotenant_*``: for ``cotenant_for_s`` of every ``cotenant_every_s`` another job
    shares the GPU and every step takes ``cotenant_factor`` times as long (stock included).
    """

    knee_from_mhz: int | None = None
    knee_to_mhz: int | None = None
    start_s: float = 0.0
    over_s: float = 300.0
    slow_to: float = 1.0
    cotenant_every_s: float = 0.0
    cotenant_for_s: float = 0.0
    cotenant_factor: float = 1.0

    def progress(self, t: float) -> float:
        """Share of the drift reached at ``t`` (0..1)."""
        return min(1.0, max(0.0, (t - self.start_s) / self.over_s)) if self.over_s > 0 else 1.0

    def spec_at(self, spec: GpuSpec, t: float) -> GpuSpec:
        """``spec`` with the knee at time ``t`` (on a 5 MHz grid)."""
        if self.knee_from_mhz is None or self.knee_to_mhz is None:
            return spec
        knee = self.knee_from_mhz + (self.knee_to_mhz - self.knee_from_mhz) * self.progress(t)
        knee = int(round(knee / _KNEE_GRID_MHZ) * _KNEE_GRID_MHZ)
        return spec if knee == spec.mem_bound_min_mhz else replace(spec, mem_bound_min_mhz=knee)

    def time_factor(self, t: float) -> float:
        """Factor on every step's time and energy at ``t`` (thermal slowdown, another tenant)."""
        k = 1.0 + (self.slow_to - 1.0) * self.progress(t)
        if self.tenants_at(t):
            k *= self.cotenant_factor
        return k

    def tenants_at(self, t: float) -> int:
        """Other compute processes on the GPU at ``t``: the co-tenant, visible in NVML's process
        list while it runs (``nvmlDeviceGetComputeRunningProcesses``)."""
        return int(self.cotenant_every_s > 0 and (t % self.cotenant_every_s) < self.cotenant_for_s)

    def worst_knee_mhz(self, spec: GpuSpec) -> int:
        """The highest knee the drift reaches (what a static clock must stay above)."""
        knees = [k for k in (self.knee_from_mhz, self.knee_to_mhz) if k is not None]
        return max(knees) if knees else spec.mem_bound_min_mhz


@dataclass(frozen=True)
class ClockFaults:
    """How the simulated clock misbehaves. Simulated.

    ``latency_s``: the true switch latency (``None``: as configured); ``ignore_sets``: every lock
    request is accepted and has no effect (resets too: the clock stays at the default);
    ``drop_share``: share of requests (locks and resets) silently lost; ``reset_every_s``: the
    driver returns to the default clock this often on its own (another process, a GPU reset).
    """

    latency_s: float | None = None
    ignore_sets: bool = False
    drop_share: float = 0.0
    reset_every_s: float = 0.0
    seed: int = 0


class FaultyLaggedClock(LaggedClock):
    """A :class:`LaggedClock` with :class:`ClockFaults`. Simulated."""

    def __init__(self, latency_s: float, faults: ClockFaults) -> None:
        super().__init__(faults.latency_s if faults.latency_s is not None else latency_s)
        self.faults = faults
        self.rng = random.Random(faults.seed)
        self.next_reset = faults.reset_every_s if faults.reset_every_s > 0 else math.inf
        self.dropped = 0

    def request(self, t: float, f: int | None) -> None:
        if self.faults.ignore_sets or (self.faults.drop_share > 0 and self.rng.random() < self.faults.drop_share):
            self.dropped += 1
            return
        super().request(t, f)

    def _reset_due(self, t: float) -> None:
        while self.next_reset <= t:
            times = [c[0] for c in self.changes]
            self.changes.insert(bisect.bisect_right(times, self.next_reset), (self.next_reset, None))
            self.next_reset += self.faults.reset_every_s

    def at(self, t: float) -> int | None:
        self._reset_due(t)
        return super().at(t)

    def next_change(self) -> float:
        return min(super().next_change(), self.next_reset)


@dataclass(frozen=True)
class Scenario:
    """One adversarial condition for a replay (``tune/replay.py``). Simulated.

    ``outlier_share`` of steps are *measured* ``outlier_factor`` times as long as they ran (the
    GPU time is unchanged: a host hiccup in the measurement).
    """

    name: str
    drift: GpuDrift = field(default_factory=GpuDrift)
    faults: ClockFaults | None = None
    outlier_share: float = 0.0
    outlier_factor: float = 3.0


__all__ = ["ClockFaults", "FaultyLaggedClock", "GpuDrift", "Scenario", "decode_trace"]


def decode_trace(
    duration_s: float,
    seed: int,
    spec: GpuSpec,
    batches: tuple[int, ...],
    run_steps: tuple[int, int] = (20, 200),
    ctx_per_req: tuple[int, int] = (500, 3000),
    shape: str = "qwen2.5-7b",
) -> Trace:
    """Decode-only serving whose batch jumps between ``batches`` every ``run_steps`` steps
    (uniform), each request holding ``ctx_per_req`` KV tokens, growing one per step. Simulated:
    e.g. large batches near the compute ridge, or bursty batch-bucket changes."""
    rng = random.Random(seed)
    cost = StepCost(spec, shape)
    events: list = []
    t = 0.0
    while t < duration_s:
        batch = rng.choice(batches)
        ctx = batch * rng.randint(*ctx_per_req)
        for _ in range(rng.randint(*run_steps)):
            s = Step(0, batch, ctx, batch, 0.0005)
            events.append(("step", s))
            t += cost.at(s, spec.f_max_mhz)[0] + s.host_gap_s
            ctx += batch
    note = f"decode-only, batch jumping between {list(batches)} every {run_steps[0]}-{run_steps[1]} steps, {duration_s:.0f} s (simulated)"
    return Trace(f"decode-seed{seed}", events, [note])
