"""An energy read that returns milliseconds after the tick asked for it (docs/request-energy.md).

Under load the publisher's NVML read returned 4-14 ms after the tick took its time, the latest just
after the counter's update (the H100 step trace, docs/results/h200-request-energy.md). The value read is the energy up to the read's return, and the
engine's steps go on meanwhile. A tick that priced that value over the span up to its own earlier
time gave the span the energy of the milliseconds after it and the next tick too little: at a
constant arrival rate, prompts landing just before the counter's step read ~1.06 of the median and
those just after ~0.96 (H100, 256 in / 64 out at 40 req/s)."""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from fakes import Clock
from test_request_energy_cost import SHAPE, ExactMeter, TraceCounterGpu, advance, schedule_step, sync_while_running

from vllm_powersave.device import NvmlGpu
from vllm_powersave.energy import NvmlEnergyMeter, PhaseEnergyAccount
from vllm_powersave.energy.request_cost import RequestCostModel, step_weights
from vllm_powersave.sim.gpu import ModelCost, SimulatedGpu

#: The fake counter steps at 0.037 s + k x 0.1 s (TraceCounterGpu).
_COUNTER_T0_S, _PERIOD_S = 0.037, 0.1


def read_lag_s(t_call: float, lag_after_step_s: float, lag_s: float) -> float:
    """How long after the tick took its time (``t_call``) the read returns: longest where the
    counter stepped up to 8 ms before (the H100 step trace: ~13 ms there, ~5 ms elsewhere)."""
    since_step = (t_call - _COUNTER_T0_S) % _PERIOD_S
    return lag_after_step_s if since_step < 0.008 else lag_s


class LaggedReads(TraceCounterGpu):
    """The fake counter GPU whose energy read returns ``lag_s(t_call)`` after its call, with the
    value from the call, or from the return with ``value_at="return"`` (where inside a slow NVML
    read the driver takes the value is not known; the engine's steps go on meanwhile; the
    account's ``feed`` delivers them as the worker runtime's drain does)."""

    def __init__(self, clock: Clock, rng: random.Random, lag_s: Callable[[float], float], value_at: str = "call") -> None:
        super().__init__(clock, rng)
        self.lag_s = lag_s
        self.value_at = value_at

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        lag_s = self.lag_s(self.clock.t)
        if self.value_at == "return":
            self.clock.t += lag_s
            return super().nvmlDeviceGetTotalEnergyConsumption(h)
        mj = super().nvmlDeviceGetTotalEnergyConsumption(h)
        self.clock.t += lag_s
        return mj


@dataclass
class SpikyReadings:
    """The fake's instant-reading noise (it draws ``uniform``): x(lo, hi) of the trace's power, and
    a ``spike_p`` share of readings at x(spike_lo, spike_hi)."""

    rng: random.Random
    lo: float
    hi: float
    spike_p: float
    spike_lo: float
    spike_hi: float

    def uniform(self, a: float, b: float) -> float:
        if self.rng.random() < self.spike_p:
            return self.rng.uniform(self.spike_lo, self.spike_hi)
        return self.rng.uniform(self.lo, self.hi)


class EngineEvents:
    """The step hook's calls, held until their time: the account sees an event only once the
    clock of the thread that reads has passed it."""

    def __init__(self) -> None:
        self._q: list = []
        self._n = itertools.count()

    def put(self, t: float, call: Callable[[], None]) -> None:
        heapq.heappush(self._q, (t, next(self._n), call))

    def deliver(self, upto: float) -> None:
        while self._q and self._q[0][0] <= upto:
            heapq.heappop(self._q)[2]()


@dataclass
class _LaggedRig:
    """A per-request account on a 100 ms counter whose reads return late (:class:`LaggedReads`)."""

    clock: Clock
    gpu: LaggedReads
    meter: NvmlEnergyMeter
    acc: PhaseEnergyAccount
    events: EngineEvents
    cost: RequestCostModel
    done: dict

    @classmethod
    def build(cls, lag_after_step_s: float, lag_s: float, seed: int, value_at: str, swing) -> _LaggedRig:
        clock, cost, events, done = Clock(), RequestCostModel.for_shape(SHAPE), EngineEvents(), {}
        readings = random.Random(seed + 1) if swing is None else SpikyReadings(random.Random(seed + 7), *swing)
        gpu = LaggedReads(clock, readings, lambda t_call: read_lag_s(t_call, lag_after_step_s, lag_s), value_at)
        clock.t = 0.5
        meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-x"), clock=clock, counter_period_s=_PERIOD_S)
        acc = PhaseEnergyAccount(
            meter,
            clock=clock,
            per_request=True,
            cost=cost,
            on_request_done=done.__setitem__,
            gpu_runs_ahead=True,
            feed=lambda: events.deliver(clock.t),
        )
        return cls(clock, gpu, meter, acc, events, cost, done)


def serve_at_a_constant_rate(
    lag_after_step_s: float,
    lag_s: float,
    *,
    n_requests=320,
    rate=40.0,
    prompt=256,
    out=64,
    seed=0,
    stall_p=0.0,
    value_at="call",
    swing=None,
):
    """Identical requests arriving every ``1 / rate`` s (four per counter period, so their prompts
    keep their place against the counter's step) on the simulated H200, metered through a 100 ms
    counter. The account ticks at request finishes (at most every 10 ms) and every 100 ms; each
    read returns :func:`read_lag_s` after its tick took its time. Returns each request's figure
    over the median and over its truth (the cost model over the true step energies, a stall's
    split equally), middle 60 % by arrival. ``stall_p``: the share of steps with a prompt whose
    engine thread stalls 4-12 ms after launching them while the GPU, done with the step, draws
    150 W. ``swing``: instant readings at x(lo, hi) of the trace's power, a share at
    x(spike_lo, spike_hi) (:class:`SpikyReadings`)."""
    rng = random.Random(seed)
    gpu_sim, mc = SimulatedGpu(), ModelCost.for_shape(SHAPE)
    rig = _LaggedRig.build(lag_after_step_s, lag_s, seed, value_at, swing)
    clock, gpu, meter, acc, events, cost, done = rig.clock, rig.gpu, rig.meter, rig.acc, rig.events, rig.cost, rig.done
    truth = {}

    def tick(t_call: float) -> None:
        # A tick begins once the previous read returned, a moment later: a walk of no time at all
        # tells the meter of no running step, which no real clock gives.
        clock.t = max(t_call, clock.t + 1e-6)
        if clock.t >= meter.sync_due:
            sync_while_running(gpu, meter, clock)
        acc.tick()

    for k in range(15):  # idle first: the idle power, and the counter's phase
        tick(0.6 + 0.1 * k)
    t, t_first = 2.1, 2.1
    ticks = [t + 0.1]  # times the account ticks at (t_call), in order
    running, admitted, finished = {}, 0, []
    while admitted < n_requests or running:
        while admitted < n_requests and t_first + admitted / rate <= t:
            admitted += 1
            running[f"r{admitted:04d}"] = [0, out]
        if not running:
            t = t_first + admitted / rate
            continue
        req, ctx, rows, decode_ctx = schedule_step(running, prompt, 2048)
        phase = "decode" if all(v == 1 for v in req.values()) else "mixed"
        events.put(t, lambda p=phase, r=req, f=finished, c=ctx, t0=t: acc.on_step(p, req_tokens=r, finished=f, req_ctx=c, t=t0))
        res = gpu_sim.run(mc.step_work(sum(req.values()), rows, decode_ctx, mc.vocab_params))
        w = step_weights(cost, req, ctx)
        for rid, x in w.items():
            truth[rid] = truth.get(rid, 0.0) + res.energy_j * x / sum(w.values())
        stall_s = rng.uniform(0.004, 0.012) if phase == "mixed" and rng.random() < stall_p else 0.0
        for rid in w:
            truth[rid] += 150.0 * stall_s / len(w)
        t_host = t + res.time_s * rng.uniform(0.4, 0.9) + stall_s
        events.put(t_host, lambda te=t_host: acc.on_step_end(te))
        gpu.run(t, res.energy_j / res.time_s)
        if stall_s:
            gpu.run(t + res.time_s, 150.0)
        t += res.time_s + stall_s
        finished = []
        advance(running, req, prompt, finished)
        if finished and t - ticks[-1] >= 0.01:
            ticks.append(t)
        while ticks[-1] + 0.1 < t:
            ticks.append(ticks[-1] + 0.1)
        while len(ticks) > 1 and ticks[0] + 0.02 < t:  # its read returns before the next step ends
            tick(ticks.pop(0))
    events.put(t, lambda f=finished, te=t: acc.on_finished(f, t=te))
    gpu.run(t, 80.0)
    for t_call in (*ticks, t + 0.25, t + 0.5):
        tick(t_call)
    mid = [f"r{i:04d}" for i in range(n_requests // 5 + 1, 4 * n_requests // 5 + 1)]
    med = statistics.median(done[r] for r in mid)
    return [done[r] / med for r in mid], [done[r] / truth[r] for r in mid], acc


def _p5_p95(xs):
    q = statistics.quantiles(xs, n=20)
    return q[0], q[-1]


def test_a_read_that_returns_late_prices_the_time_up_to_its_return():
    """At 39.7 req/s the prompts' place against the counter's step drifts through the period
    over the run; reads return 13 ms after their tick just after the counter's step and 5 ms
    elsewhere. Priced up to the tick's own time the requests read 0.93 / 1.05 (p5 / p95) of the
    median; up to the read's return, as the prompt reads do."""
    rel, err, acc = serve_at_a_constant_rate(0.013, 0.005, n_requests=400, rate=39.7)
    (lo, hi), (elo, ehi) = _p5_p95(rel), _p5_p95(err)
    assert 0.98 < lo and hi < 1.02 and max(rel) < 1.03, (lo, hi, max(rel))
    assert 0.98 < elo and ehi < 1.02, (elo, ehi)
    assert acc.meter.phase_losses == 0 and acc.meter.counter_resets == 0


def test_a_tick_inside_the_gap_after_a_step_the_gpu_still_runs_prices_the_gap_as_work():
    """Requests a and b take turns in steps of 5 ms on a GPU drawing 400 W throughout (100 W
    idle); the engine thread returns 1 ms into each step (async scheduling), and the account
    ticks 2 ms into each of a's steps, inside the gap the GPU still runs a's step in. At the idle
    price that gap's first millisecond read 100 W and the rest of the tick took the difference:
    a read 0.92 of its 40 J. As work, each reads its 20 steps x 5 ms x 400 W
    (in flight: how a batch ends is not the point here)."""
    clock, meter = Clock(), ExactMeter()
    acc = PhaseEnergyAccount(meter, idle_after_s=0.25, clock=clock, per_request=True, gpu_runs_ahead=True)
    clock.t, meter.j = 2.0, 200.0  # an idle-only second first: the account learns the idle power (100 W)
    acc.tick()

    def run(seconds: float) -> None:
        clock.t += seconds
        meter.j += 400.0 * seconds

    for k in range(41):
        rid = "ab"[k % 2] if k < 40 else "c"  # c's step: b's last gap was b's step's GPU time
        acc.on_step("decode", decode_tokens=1, req_tokens={rid: 1}, t=clock.t)
        acc.on_step_end(clock.t + 1e-3)
        run(2e-3)
        if rid != "b":
            acc.tick()
        run(3e-3)
    assert acc.request_j["a"] == pytest.approx(20 * 5e-3 * 400.0, rel=1e-9)
    assert acc.request_j["b"] == pytest.approx(acc.request_j["a"], rel=1e-9)


def test_a_stall_of_the_engine_thread_is_shared_by_the_steps_requests():
    """A third of the steps with a prompt stall their engine thread 4-12 ms after launching them
    (on an H100 the same prefill step took 9-24 ms of host time, and its request read 0.99-1.18
    of the median by that time, docs/results/h200-request-energy.md). Split by the requests'
    modelled work, a stalled step gave most of the stall to its prompt: p5 / p95 / max 0.915 /
    1.191 / 1.274 of the median. Split equally beyond the step's work: within 0.93 / 1.07. (The
    stall's time is still priced like the tick's work, while the GPU drew 150 W there: what is
    left.)"""
    rel, err, _ = serve_at_a_constant_rate(0.005, 0.005, n_requests=400, rate=39.7, stall_p=0.33)
    (lo, hi), (elo, ehi) = _p5_p95(rel), _p5_p95(err)
    assert 0.92 < lo and hi < 1.08 and max(rel) < 1.15, (lo, hi, max(rel))
    assert 0.94 < elo and ehi < 1.06, (elo, ehi)


_ONE_PERIOD_LONG = "not yet placed: a value taken at the read's call one period past the phase (docs/request-energy.md)"


@pytest.mark.parametrize(
    ("value_at", "lag_s"), [pytest.param("call", 0.005, marks=pytest.mark.xfail(strict=True, reason=_ONE_PERIOD_LONG)), ("return", 0.013)]
)
def test_long_prompts_drifting_through_the_counter_period_each_keep_their_energy(value_at, lag_s):
    """1,024-token prompts with 32 outputs at 9.7 req/s: about one prompt per counter period, its
    place against the counter's step drifting 3 ms per request, reads ``lag_s`` late just after
    the step and 5 ms elsewhere. A read that lands within a few ms of the step, against a phase the
    sync learnt from reads as slow, misses or doubles a period. Decided by the instant power, it
    took a -66 J jump, then +66 J over a span of no width (docs/request-energy.md): a few requests
    in a row read 0.32-0.34 of their truth, one up to 1.83 (simulated; the H100's 1,024 / 32
    segments read p5 0.87-0.93 of the median, docs/results/h200-request-energy.md). Decided by the
    counter's own periods, the one-short reads (the value taken at the read's return): 0.966-1.026.
    The one-long reads (the value taken at the call) are not yet placed."""
    _, err, acc = serve_at_a_constant_rate(lag_s, 0.005, n_requests=150, rate=9.7, prompt=1024, out=32, value_at=value_at)
    assert acc.meter.phase_losses == 0
    assert 0.9 <= min(err) and max(err) <= 1.1, (min(err), max(err))


_INSTANT_OUTLIERS = "not yet placed: a reading past LOAD_CHANGE_RATIO under work prices the extension (docs/request-energy.md)"


@pytest.mark.parametrize(
    "swing",
    [(0.6, 1.5, 0.1, 1.9, 2.3), pytest.param((0.3, 2.3, 0.0, 0.0, 0.0), marks=pytest.mark.xfail(strict=True, reason=_INSTANT_OUTLIERS))],
    ids=["spikes-to-2.3x", "swing-0.3-2.3x"],
)
def test_long_prompts_keep_their_energy_under_instant_power_as_noisy_as_the_h200s(swing):
    """The drifting 1,024 / 32 prompts, the value taken at the read's return, with instant
    readings as far off as the H200's under a batch (docs/results/h200-request-energy.md): x0.6-1.5
    with one in ten at x1.9-2.3; or x0.3-2.3. With the instant power deciding the straddling reads:
    0.684-1.629 of the truth either way (simulated); now 0.966-1.026, and 0.584-1.366 where single
    readings past the load-change ratio still price the counter's extension."""
    _, err, acc = serve_at_a_constant_rate(0.013, 0.005, n_requests=150, rate=9.7, prompt=1024, out=32, value_at="return", swing=swing)
    assert acc.meter.phase_losses == 0
    assert 0.9 <= min(err) and max(err) <= 1.1, (min(err), max(err))
