"""Simulated serving replay: a step trace driven through the real ClockController on a simulated GPU.

Everything here is **simulated** (``sim/gpu.py``, traces from ``sim/trace.py``). It judges clock
strategies (static presets, the closed-loop decode clock) on the same steps: each strategy replays
the same trace, so differences in time and energy come from the clocks alone. It lives with the
tuner rather than in ``sim/`` because it drives ``clocks/``, which sits above the simulator
(docs/design.md, "Layering").

* :func:`replay`: drives a :class:`~vllm_powersave.clocks.ClockController` (its dwell, leases,
  read-back and closed loop) whose clock requests take effect one switch latency later
  (:class:`LaggedBackend`, which reads back the clock actually in effect); each step's time and
  energy come from the simulated GPU at the clock(s) in effect while it runs; the step time the
  controller *measures* carries multiplicative noise (host jitter), the same draw for every
  strategy. Idle gaps go through ``idle_begin`` every ``energy.tick_s`` (0.25 s) as the
  runtime's publisher calls it, so an idle preset's dwell passes as it does when serving. A
  :class:`~vllm_powersave.sim.scenarios.Scenario` makes the GPU drift, the clock misbehave or
  the measurement lie; each step is judged against the noise-free stock-clock step on the same
  GPU state.
* :func:`compare`: a replay's figures against the stock replay of the same trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..clocks.backends import ClockBackend
from ..clocks.controller import ClockController
from ..settings import ClockSettings
from ..sim.gpu import GpuSpec
from ..sim.scenarios import FaultyLaggedClock, Scenario
from ..sim.trace import LaggedClock, Step, StepCost, Trace, idle_energy_j, memory_bound, run_at_clocks

#: The runtime's publisher calls ``idle_begin`` about this often while no step runs (s).
_IDLE_TICK_S = 0.25


class LaggedBackend(ClockBackend):
    """Simulated clock backend whose settings land one switch latency after the request."""

    kind = "simulated"

    def __init__(self, spec: GpuSpec, clock: LaggedClock, now: list[float]) -> None:
        self.spec, self.clock, self.now = spec, clock, now
        self.locked = False

    def supported_sm_clocks(self) -> tuple[int, ...]:
        return self.spec.sm_clocks_mhz

    def set_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int | None = None) -> None:
        self.locked = True
        self.clock.request(self.now[0], int(sm_clock_mhz))

    def reset(self) -> None:
        self.locked = False
        self.clock.request(self.now[0], None)

    def read_sm_clock_mhz(self) -> int | None:
        """The clock in effect now on the simulated GPU (simulated)."""
        f = self.clock.at(self.now[0])
        return self.spec.f_max_mhz if f is None else f


@dataclass
class _ReplayRun:
    """State of one replay: the simulated GPU and its lagged clock, the controller, the totals."""

    spec: GpuSpec
    cost: StepCost
    clock: LaggedClock
    now: list[float]  # the controller's clock (s), shared with the backend
    ctl: ClockController
    rng: random.Random  # noise on the step time the controller measures
    noise_sigma: float
    limit: float  # a decode step is in budget at most this times its stock-clock time
    out: dict[str, Any]
    scenario: Scenario | None = None
    shape: str = "qwen2.5-7b"
    costs: dict[GpuSpec, StepCost] = field(default_factory=dict)  # per GPU state (drift)
    t: float = 0.0

    def cost_at(self, t: float) -> tuple[StepCost, float]:
        """The step prices of the GPU state at ``t`` and the time factor on them (drift)."""
        if self.scenario is None:
            return self.cost, 1.0
        d = self.scenario.drift
        spec = d.spec_at(self.spec, t)
        cost = self.costs.get(spec)
        if cost is None:
            cost = self.costs[spec] = StepCost(spec, self.shape)
        return cost, d.time_factor(t)


def _new_totals() -> dict[str, Any]:
    return {
        "decode_j": 0.0,
        "decode_s": 0.0,
        "decode_steps": 0,
        "decode_in_budget": 0,
        "other_j": 0.0,
        "idle_j": 0.0,
        "busy_s": 0.0,
        "out_tokens": 0,
        "worst_slowdown": 0.0,
        "clock_mhz_steps": {},
        "oob_causes": {},  # out-of-budget decode steps by cause (:func:`_oob_cause`)
        "phase_steps": {},  # decode steps by what the closed loop's clock was for (DecodeClockTuner.phase_of)
    }


def _replay_idle(run: _ReplayRun, idle_s: float) -> None:
    """An idle gap: the runtime reports idle after 0.25 s without a step (``energy.idle_after_s``),
    then its publisher calls ``idle_begin`` again every tick until a step comes (so the idle
    preset's dwell can pass)."""
    t = run.t
    end = t + idle_s
    tick = t + 0.25
    while tick < end:
        run.now[0] = tick
        run.ctl.idle_begin(tick)
        tick += _IDLE_TICK_S
    run.now[0] = max(t, min(end, run.now[0]))
    run.out["idle_j"] += idle_energy_j(run.spec, run.clock, t, end)
    run.t = max(t, end)


def _oob_cause(run: _ReplayRun, s: Step, f_time: dict[int, float], phase: str, f_start: int) -> str:
    """Why a decode step ran out of budget: ``after_idle`` (it started at the idle clock, before
    the raise landed), ``raise_pending`` (it started below the clock asked for: a raise still
    landing, or lost), ``switch_in_step`` (a switch landed inside it), ``mixed`` (prompt tokens rode along), else what the closed loop's clock
    was for (:meth:`~vllm_powersave.clocks.closed_loop.DecodeClockTuner.phase_of`: ``probe``,
    ``step_down``, ``held``, ``reference``, ``other_bucket``, ...)."""
    idle = run.ctl.presets.get("idle")
    want = run.ctl.current.sm_clock_mhz or run.spec.f_max_mhz
    if idle is not None and idle.sm_clock_mhz == f_start and want != f_start:
        return "after_idle"
    if f_start < want:
        return "raise_pending"
    if len(f_time) > 1 or f_start != want:
        return "switch_in_step"
    if s.tokens != s.decode:
        return "mixed"
    return phase


def _book_decode_step(
    run: _ReplayRun, s: Step, true_s: float, e: float, f_time: dict[int, float], stock_s: float, why: tuple[str, int]
) -> None:
    """A memory-bound step's energy, and its time against the same step at the stock clock on
    the same GPU state (``stock_s``, noise-free); ``why``: what the loop's clock was for and the
    clock in effect at the step's start (for an out-of-budget step's cause)."""
    out = run.out
    slow = true_s / stock_s
    out["decode_j"] += e
    out["decode_s"] += true_s
    out["decode_steps"] += 1
    out["phase_steps"][why[0]] = out["phase_steps"].get(why[0], 0) + 1
    ok = slow <= run.limit + 1e-9
    out["decode_in_budget"] += ok
    if not ok:
        cause = _oob_cause(run, s, f_time, *why)
        out["oob_causes"][cause] = out["oob_causes"].get(cause, 0) + 1
    out["worst_slowdown"] = max(out["worst_slowdown"], slow - 1)
    fmain = max(f_time, key=f_time.__getitem__)
    out["clock_mhz_steps"][fmain] = out["clock_mhz_steps"].get(fmain, 0) + 1


def _replay_step(run: _ReplayRun, s: Step, mb_tokens: int, on_step: Callable[[ClockController, float], None] | None) -> None:
    """One engine step: the controller decides, the GPU runs it at the clock(s) in effect."""
    spec, out, ctl = run.spec, run.out, run.ctl
    mb = memory_bound(s, mb_tokens)
    phase = "decode" if mb else ("prefill" if s.phase == "prefill" else "mixed")
    run.now[0] = start = run.t
    ctl.on_step(phase, start, start, None)  # the step hook: leaves idle (idle_end) where idle_begin ran
    cost, k = run.cost_at(start)
    f_start = run.clock.at(start) or spec.f_max_mhz
    phase_of = ctl.closed_loop.phase_of(s.decode) if ctl.closed_loop is not None and ctl.closed_loop_active else "off"
    t, e, f_time = run_at_clocks(run.clock, start, lambda f: _scaled(cost.at(s, f), k), spec.f_max_mhz)
    true_s = t - start
    noise = math.exp(run.rng.gauss(0.0, run.noise_sigma)) if run.noise_sigma > 0 else 1.0
    sc = run.scenario
    if sc is not None and sc.outlier_share > 0 and run.rng.random() < sc.outlier_share:
        noise *= sc.outlier_factor  # a host hiccup in the measurement, not in the GPU's time
    out["busy_s"] += true_s
    out["out_tokens"] += s.out_tokens
    if mb:
        _book_decode_step(run, s, true_s, e, f_time, cost.at(s, spec.f_max_mhz)[0] * k, (phase_of, f_start))
    else:
        out["other_j"] += e
    # The engine thread's wall time of the step, as the controller would measure it (read back at its end).
    run.now[0] = t
    if sc is not None:
        # The co-tenant is in NVML's process list while it runs: seen at the step's start and end.
        ctl.observe_gpu_tenants(start, sc.drift.tenants_at(start))
        ctl.observe_gpu_tenants(t, sc.drift.tenants_at(t))
    ctl.observe_decode_step(t, s.decode, true_s * noise * 1e3, mb, s.ctx, s.tokens)
    if on_step is not None:
        on_step(ctl, t)
    if s.host_gap_s > 0:
        out["other_j"] += idle_energy_j(spec, run.clock, t, t + s.host_gap_s)
        t += s.host_gap_s
    run.t = t


def _scaled(price: tuple[float, float], k: float) -> tuple[float, float]:
    return (price[0] * k, price[1] * k) if k != 1.0 else price


def replay(
    trace: Trace,
    spec: GpuSpec,
    settings: ClockSettings,
    *,
    noise_sigma: float = 0.0,
    noise_seed: int = 0,
    budget_pct: float = 1.0,
    shape: str = "qwen2.5-7b",
    on_step: Callable[[ClockController, float], None] | None = None,
    close: bool = True,
    scenario: Scenario | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` under ``settings`` on GPU ``spec``; returns totals and per-decode-step facts.

    Decode steps (:func:`~vllm_powersave.sim.trace.memory_bound`) are judged against the same step
    at the stock clock on the same GPU (and GPU state, under a ``scenario``'s drift): in budget if
    their time (noise-free) is at most ``1 + budget_pct / 100`` times it. Everything returned is
    simulated.
    """
    lat = settings.switch_latency_ms / 1000.0
    faults = scenario.faults if scenario is not None else None
    clock = LaggedClock(lat) if faults is None else FaultyLaggedClock(lat, faults)
    now = [0.0]
    ctl = ClockController(LaggedBackend(spec, clock, now), settings, asynchronous=False, clock=lambda: now[0], watchdog=False)
    run = _ReplayRun(
        spec,
        StepCost(spec, shape),
        clock,
        now,
        ctl,
        random.Random(noise_seed),
        noise_sigma,
        1.0 + budget_pct / 100.0,
        _new_totals(),
        scenario,
        shape,
    )
    for kind, ev in trace.events:
        if kind == "idle":
            _replay_idle(run, ev)
        else:
            _replay_step(run, ev, settings.memory_bound_max_tokens, on_step)
    out = run.out
    out["wall_s"] = run.t
    out["switches"] = ctl.n_changes
    out["readback_off"] = ctl.readback_off
    out["closed_loop"] = ctl.closed_loop.snapshot() if ctl.closed_loop is not None else None
    out["records"] = list(ctl.closed_loop.records) if ctl.closed_loop is not None else []
    out["controller"] = ctl
    if close:
        ctl.close()
    return out


def compare(base: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    """The figures of ``r`` against the stock replay ``base`` of the same trace (simulated)."""
    return {
        "decode_energy_ratio": round(r["decode_j"] / base["decode_j"], 4),
        "slo_attainment": round(r["decode_in_budget"] / max(1, r["decode_steps"]), 5),
        "throughput_ratio": round(base["busy_s"] / r["busy_s"], 4),
        "switches_per_s": round(r["switches"] / r["wall_s"], 3),
        "e2e_energy_ratio": round((r["decode_j"] + r["other_j"] + r["idle_j"]) / (base["decode_j"] + base["other_j"] + base["idle_j"]), 4),
        "worst_decode_slowdown_pct": round(100 * r["worst_slowdown"], 2),
        "decode_steps": r["decode_steps"],
    }


__all__ = ["LaggedBackend", "compare", "replay"]
