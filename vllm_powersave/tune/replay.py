"""Simulated serving replay: a step trace driven through the real ClockController on a simulated GPU.

Everything here is **simulated** (``sim/gpu.py``, traces from ``sim/trace.py``). It judges clock
strategies (static presets, the closed-loop decode clock) on the same steps: each strategy replays
the same trace, so differences in time and energy come from the clocks alone. It lives with the
tuner rather than in ``sim/`` because it drives ``clocks/``, which sits above the simulator
(docs/design.md, "Layering").

* :func:`replay`: drives a :class:`~vllm_powersave.clocks.ClockController` (its dwell, leases
  and closed loop) whose clock requests take effect one switch latency later
  (:class:`LaggedBackend`); each step's time and energy come from the simulated GPU at the clock(s)
  in effect while it runs; the step time the controller *measures* carries multiplicative noise
  (host jitter), the same draw for every strategy.
* :func:`compare`: a replay's figures against the stock replay of the same trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..clocks.backends import ClockBackend
from ..clocks.controller import ClockController
from ..settings import ClockSettings
from ..sim.gpu import GpuSpec
from ..sim.trace import LaggedClock, Step, StepCost, Trace, idle_energy_j, memory_bound, run_at_clocks


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
    t: float = 0.0


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
    }


def _replay_idle(run: _ReplayRun, idle_s: float) -> None:
    """An idle gap: the runtime reports idle after 0.25 s without a step (``energy.idle_after_s``)."""
    t = run.t
    end = t + idle_s
    run.now[0] = t + 0.25 if idle_s > 0.25 else t
    if idle_s > 0.25:
        run.ctl.on_phase("idle", run.now[0])
    run.out["idle_j"] += idle_energy_j(run.spec, run.clock, t, end)
    run.t = max(t, end)


def _book_decode_step(run: _ReplayRun, s: Step, true_s: float, e: float, f_time: dict[int, float]) -> None:
    """A memory-bound step's energy, and its time against the same step at the stock clock."""
    out = run.out
    stock_s = run.cost.at(s, run.spec.f_max_mhz)[0]
    slow = true_s / stock_s
    out["decode_j"] += e
    out["decode_s"] += true_s
    out["decode_steps"] += 1
    out["decode_in_budget"] += slow <= run.limit + 1e-9
    out["worst_slowdown"] = max(out["worst_slowdown"], slow - 1)
    fmain = max(f_time, key=f_time.__getitem__)
    out["clock_mhz_steps"][fmain] = out["clock_mhz_steps"].get(fmain, 0) + 1


def _replay_step(run: _ReplayRun, s: Step, mb_tokens: int, on_step: Callable[[ClockController, float], None] | None) -> None:
    """One engine step: the controller decides, the GPU runs it at the clock(s) in effect."""
    spec, out, ctl = run.spec, run.out, run.ctl
    mb = memory_bound(s, mb_tokens)
    phase = "decode" if mb else ("prefill" if s.phase == "prefill" else "mixed")
    run.now[0] = start = run.t
    ctl.on_phase(phase, start)
    t, e, f_time = run_at_clocks(run.clock, start, lambda f: run.cost.at(s, f), spec.f_max_mhz)
    true_s = t - start
    noise = math.exp(run.rng.gauss(0.0, run.noise_sigma)) if run.noise_sigma > 0 else 1.0
    out["busy_s"] += true_s
    out["out_tokens"] += s.out_tokens
    if mb:
        _book_decode_step(run, s, true_s, e, f_time)
    else:
        out["other_j"] += e
    # The engine thread's wall time of the step, as the controller would measure it.
    ctl.observe_decode_step(t, s.decode, true_s * noise * 1e3, mb, s.ctx, s.tokens)
    if on_step is not None:
        on_step(ctl, t)
    if s.host_gap_s > 0:
        out["other_j"] += idle_energy_j(spec, run.clock, t, t + s.host_gap_s)
        t += s.host_gap_s
    run.t = t


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
) -> dict[str, Any]:
    """Replay ``trace`` under ``settings`` on GPU ``spec``; returns totals and per-decode-step facts.

    Decode steps (:func:`~vllm_powersave.sim.trace.memory_bound`) are judged against the same step
    at the stock clock on the same GPU: in budget if their time (noise-free) is at most
    ``1 + budget_pct / 100`` times it. Everything returned is simulated.
    """
    clock = LaggedClock(settings.switch_latency_ms / 1000.0)
    now = [0.0]
    ctl = ClockController(LaggedBackend(spec, clock, now), settings, asynchronous=False, clock=lambda: now[0], watchdog=False)
    run = _ReplayRun(
        spec, StepCost(spec, shape), clock, now, ctl, random.Random(noise_seed), noise_sigma, 1.0 + budget_pct / 100.0, _new_totals()
    )
    for kind, ev in trace.events:
        if kind == "idle":
            _replay_idle(run, ev)
        else:
            _replay_step(run, ev, settings.memory_bound_max_tokens, on_step)
    out = run.out
    out["wall_s"] = run.t
    out["switches"] = ctl.n_changes
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
