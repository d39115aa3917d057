"""Simulated serving traces: steps, their prices on a simulated GPU, and a clock that lags its requests.

Everything here is **simulated** (``sim/gpu.py``). It is what clock strategies are judged on (the
replay through the real controller lives with the tuner, ``tune/replay.py``, because the simulator
sits below ``clocks/``: docs/design.md, "Layering"); each strategy replays the same trace, so
differences in time and energy come from the clocks alone.

* :func:`serving_trace`: open-loop serving with bursty arrivals, long decode runs and idle gaps,
  scheduled like vLLM V1 (chunked prefill, token budget, sequence cap) at stock clocks; its parts,
  :func:`onoff_arrivals` and :func:`schedule_v1`, serve other trace shapes too
  (``benchmarks/sim_clock_presets.py``).
* :func:`idle_energy_j` and :func:`run_at_clocks`: energy of idle time and time and energy of a
  piece of GPU work while the clock changes under it (a change splits the work where it lands);
  :class:`GroupStepCost` prices a step per kernel group, so a change can land between groups.
* :class:`LaggedClock`: the SM clock the simulated GPU runs, one switch latency behind the request.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from .gpu import GpuSpec, KernelGroupCost, ModelCost, StepWork, idle_power_w, simulate_kernel, simulate_step


@dataclass(frozen=True)
class Step:
    """One engine step: scheduled prompt tokens, decoding requests, their context (KV tokens)."""

    prefill: int
    decode: int
    ctx: int
    out_tokens: int
    host_gap_s: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prefill + self.decode

    @property
    def phase(self) -> str:
        return "prefill" if not self.decode else ("decode" if not self.prefill else "mixed")


@dataclass
class Trace:
    name: str
    events: list  # ("step", Step) | ("idle", seconds)
    notes: list[str] = field(default_factory=list)


class StepCost:
    """Prices steps of one model shape on one simulated GPU (cached: traces repeat shapes)."""

    def __init__(self, spec: GpuSpec, shape: str = "qwen2.5-7b") -> None:
        self.spec = spec
        self.cost = ModelCost.for_shape(shape)

    def work(self, s: Step) -> StepWork:
        rows = s.decode + (1 if s.prefill else 0)
        return self.cost.step_work(s.tokens, rows, s.ctx, self.cost.vocab_params)

    def at(self, s: Step, f: int) -> tuple[float, float]:
        """(seconds, joules) of step ``s`` at requested SM clock ``f`` (power cap applied)."""
        w = self.work(s)
        return _price(self.spec, _q(w.flops), _q(w.bytes), int(f))


def _q(x: float) -> float:
    return float(f"{x:.4g}")


@lru_cache(maxsize=500_000)
def _price(spec: GpuSpec, flops: float, nbytes: float, f: int) -> tuple[float, float]:
    r = simulate_step(spec, StepWork(flops, nbytes), f)
    return r.time_s, r.energy_j


class GroupStepCost:
    """Prices steps of one model shape per kernel group on one simulated GPU (:class:`KernelGroupCost`:
    per layer attention and MLP, then LM head and sampling). Cached: works are quantised to three
    significant digits and context sums to 0.5 %, so that similar steps share a price."""

    GROUPS = ("attention", "mlp", "lm_head", "sampling")

    def __init__(self, spec: GpuSpec, shape: str = "qwen2.5-7b") -> None:
        self.spec = spec
        self.cost = KernelGroupCost.for_shape(shape)
        self.layers = self.cost.layers
        self._kernel = lru_cache(maxsize=400_000)(self._price)
        self._works = lru_cache(maxsize=200_000)(self._group_works)

    def works(self, tokens: int, rows: int, decode_ctx: int, prefill_attend: int) -> tuple[StepWork, ...]:
        """The work of each of :attr:`GROUPS` (attention and MLP: one layer's)."""
        return self._works(tokens, rows, int(_q3(decode_ctx)), int(_q3(prefill_attend)))

    def kernel(self, w: StepWork, f: int) -> tuple[float, float]:
        """(seconds, joules) of one group's work at requested SM clock ``f`` (power cap applied)."""
        return self._kernel(_q3(w.flops), _q3(w.bytes), f)

    def run(self, works: tuple[StepWork, ...], f: int) -> tuple[float, float]:
        """(seconds, joules) of all of a step's groups at SM clock ``f`` (without the fixed step time)."""
        a, m, lm, smp = (self.kernel(w, f) for w in works)
        return self.layers * (a[0] + m[0]) + lm[0] + smp[0], self.layers * (a[1] + m[1]) + lm[1] + smp[1]

    def _price(self, flops: float, nbytes: float, f: int) -> tuple[float, float]:
        r = simulate_kernel(self.spec, StepWork(flops, nbytes), f)
        return r.time_s, r.energy_j

    def _group_works(self, tokens: int, rows: int, decode_ctx: int, prefill_attend: int) -> tuple[StepWork, ...]:
        return (*self.cost.layer(tokens, decode_ctx, prefill_attend), *self.cost.head(rows))


def _q3(x: float) -> float:
    return float(f"{x:.3g}")


def _lengths(rng: random.Random, long_share: float) -> tuple[int, int]:
    p = int(min(8192, max(32, rng.lognormvariate(math.log(800), 0.9))))
    if rng.random() < long_share:  # long generations (reasoning, long answers): long decode runs
        o = int(min(4096, max(512, rng.lognormvariate(math.log(1500), 0.5))))
    else:
        o = int(min(2048, max(4, rng.lognormvariate(math.log(180), 0.9))))
    return p, o


Arrival = tuple[float, int, int]  # (time s, prompt tokens, output tokens)


def onoff_arrivals(
    rng: random.Random, duration_s: float, rates: tuple[float, ...], off_mean_s: float, lengths: Callable[[random.Random], tuple[int, int]]
) -> list[Arrival]:
    """On/off arrivals, sorted: on-periods (mean 30 s) of Poisson arrivals at a rate drawn from
    ``rates`` (req/s), 30 % of them opening with a batch job of 16-64 requests at once (a prefill
    burst); off-periods (mean ``off_mean_s``) with no arrivals (idle gaps)."""
    arrivals: list[Arrival] = []
    t, on = 0.0, True
    while t < duration_s:
        if on:
            span = rng.expovariate(1 / 30.0)
            rate = rng.choice(rates)
            if rng.random() < 0.3:
                arrivals += [(t, *lengths(rng)) for _ in range(rng.randint(16, 64))]
            u = t
            while True:
                u += rng.expovariate(rate)
                if u >= t + span:
                    break
                arrivals.append((u, *lengths(rng)))
        else:
            span = rng.expovariate(1 / off_mean_s)
        t += span
        on = not on
    return sorted(a for a in arrivals if a[0] < duration_s)


def schedule_v1(
    arrivals: list[Arrival],
    make_step: Callable[[list[tuple[dict, int]], list[tuple[dict, int]], deque, int], Any],
    step_s: Callable[[Any], float],
    budget_tokens: int = 8192,
    max_seqs: int = 256,
) -> list:
    """``("step", step) | ("idle", seconds)`` events of vLLM V1's scheduler (FCFS, chunked prefill)
    serving ``arrivals``: each step, running decodes first (one token each), then continuing
    prefills, then new requests, within ``budget_tokens`` and ``max_seqs``.

    ``make_step(prefills, decodes, waiting, out_tokens)`` builds a step from ``(request, tokens)``
    pairs as they stand before the step runs (a request is a dict: ``prompt``, ``out_target``,
    ``computed``, ``out``); ``step_s(step)``: its wall time, which moves the arrival clock.
    """
    events: list = []
    waiting: deque = deque()
    running: list[dict] = []
    i, now = 0, 0.0
    while i < len(arrivals) or waiting or running:
        while i < len(arrivals) and arrivals[i][0] <= now:
            waiting.append({"prompt": arrivals[i][1], "out_target": arrivals[i][2], "computed": 0, "out": 0})
            i += 1
        if not waiting and not running:
            events.append(("idle", arrivals[i][0] - now))
            now = arrivals[i][0]
            continue
        budget = budget_tokens
        sched: list[tuple[dict, int]] = []
        for r in running:
            if r["computed"] >= r["prompt"]:
                sched.append((r, 1))
                budget -= 1
        for r in running:
            if r["computed"] < r["prompt"] and budget > 0:
                c = min(r["prompt"] - r["computed"], budget)
                sched.append((r, c))
                budget -= c
        while waiting and budget > 0 and len(running) < max_seqs:
            r = waiting.popleft()
            running.append(r)
            c = min(r["prompt"], budget)
            sched.append((r, c))
            budget -= c
        dec = [(r, c) for r, c in sched if r["computed"] >= r["prompt"]]
        pre = [(r, c) for r, c in sched if r["computed"] < r["prompt"]]
        # A prefill that completes its prompt samples the request's first token in this step.
        s = make_step(pre, dec, waiting, len(dec) + sum(1 for r, c in pre if r["computed"] + c >= r["prompt"]))
        for r, c in pre:
            r["computed"] += c
            if r["computed"] >= r["prompt"]:
                r["out"] += 1
        for r, _ in dec:
            r["out"] += 1
        running = [r for r in running if r["out"] < r["out_target"]]
        events.append(("step", s))
        now += step_s(s)
    return events


def serving_trace(
    duration_s: float, seed: int, spec: GpuSpec, shape: str = "qwen2.5-7b", host_gap_s: float = 0.0005, long_share: float = 0.3
) -> Trace:
    """Bursty open-loop serving at stock clocks, scheduled like vLLM V1 (chunked prefill, FCFS).

    On/off arrivals: on-periods (~30 s) at 1, 4 or 10 requests/s, 30 % of them opening with a
    batch job of 16-64 requests (a prefill burst); off-periods (~6 s) with no arrivals (idle gaps).
    ``long_share`` of requests generate 512-4096 tokens (long decode runs).
    """
    rng = random.Random(seed)
    cost = StepCost(spec, shape)
    arrivals = onoff_arrivals(rng, duration_s, (1.0, 4.0, 10.0), 6.0, lambda g: _lengths(g, long_share))

    def make_step(pre: list[tuple[dict, int]], dec: list[tuple[dict, int]], waiting: deque, out: int) -> Step:
        return Step(sum(c for _, c in pre), len(dec), sum(r["prompt"] + r["out"] for r, _ in dec), out, host_gap_s)

    events = schedule_v1(arrivals, make_step, lambda s: cost.at(s, spec.f_max_mhz)[0] + host_gap_s)
    n_req = len(arrivals)
    return Trace(
        f"serving-seed{seed}",
        events,
        [
            f"{n_req} requests over {duration_s:.0f} s (simulated): on/off arrivals (on ~30 s at 1/4/10 req/s, 30 % opening with a 16-64 "
            f"request burst; off ~6 s idle); prompts lognormal median 800 (32-8192); {100 * long_share:.0f} % long generations "
            "(512-4096 tokens), the rest median 180 (4-2048); chunked prefill 8192 tokens, 256 sequences"
        ],
    )


class LaggedClock:
    """The SM clock the simulated GPU runs: a request takes effect ``latency_s`` later."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.f: int | None = None
        self.changes: deque[tuple[float, int | None]] = deque()

    def request(self, t: float, f: int | None) -> None:
        self.changes.append((t + self.latency_s, f))

    def at(self, t: float) -> int | None:
        while self.changes and self.changes[0][0] <= t:
            self.f = self.changes.popleft()[1]
        return self.f

    def next_change(self) -> float:
        return self.changes[0][0] if self.changes else math.inf


def idle_energy_j(spec: GpuSpec, clock: LaggedClock, t0: float, t1: float) -> float:
    """Energy of the GPU idling from ``t0`` to ``t1`` at the clock(s) in effect (changes applied)."""
    e, t = 0.0, t0
    while t < t1:
        f = clock.at(t)
        seg = min(t1, clock.next_change())
        e += idle_power_w(spec, f) * (seg - t)
        t = seg
    return e


def run_at_clocks(
    clock: LaggedClock, t: float, price: Callable[[int], tuple[float, float]], f_default: int
) -> tuple[float, float, dict[int, float]]:
    """Run one piece of GPU work from ``t``: ``price(f)`` is its (seconds, joules) at SM clock ``f``
    (``f_default`` while no clock is set); a clock change landing inside it runs the rest at the
    new clock. Returns the end time, the energy and the seconds spent at each clock."""
    remaining, e = 1.0, 0.0
    f_time: dict[int, float] = {}
    while remaining > 1e-12:
        f = clock.at(t)
        f = f_default if f is None else f
        ts, es = price(f)
        if ts <= 0:
            break
        nxt = clock.next_change()
        if nxt < t + remaining * ts:
            frac = (nxt - t) / ts
            e += es * frac
            remaining -= frac
            f_time[f] = f_time.get(f, 0.0) + (nxt - t)
            t = nxt
        else:
            e += es * remaining
            f_time[f] = f_time.get(f, 0.0) + remaining * ts
            t += remaining * ts
            remaining = 0.0
    return t, e, f_time


def memory_bound(s: Step, max_tokens: int) -> bool:
    """A step the decode clock applies to: decode, or a mixed step of at most ``max_tokens``."""
    return s.decode > 0 and (s.prefill == 0 or s.tokens <= max_tokens)


__all__ = [
    "Arrival",
    "GroupStepCost",
    "LaggedClock",
    "Step",
    "StepCost",
    "Trace",
    "idle_energy_j",
    "memory_bound",
    "onoff_arrivals",
    "run_at_clocks",
    "schedule_v1",
    "serving_trace",
]
