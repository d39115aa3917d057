"""A prefill burst shaped like the H200's (docs/results/h200-request-energy.md, bursts): booked
prefill against the exact energy the GPU drew while the burst's work ran.

The fake GPU idles unboosted at 80 W; a burst's power ramps up (20 ms) to 650 W while its prefill
runs on the GPU for 0.2 s (docs/results/h200-energy-meter.md (a), (c): prefill-heavy steps draw
~470-690 W); the host returns from its two steps after 45 ms (vLLM's async scheduling, the account's
``gpu_runs_ahead``) and vLLM reports the requests finished 5 ms after the GPU's end (its empty
step, which flushes a tick). After the work the GPU rests at a boosted idle of 120 W for 1.8 s (the
perf boost held and clocks falling back), then 80 W. The counter steps every 100 ms to the exact
energy; the instant power lags the true power by 40 ms; the account ticks every 0.25 s
(``energy.tick_s``).

The truth is the phase's energy as docs/request-energy.md defines it: the steps own the time the
GPU runs them (under async scheduling, to the end of their GPU work, which vLLM reports with the
finished requests), and the GPU's rest after the work is idle. The instant reading's lag is no
energy: the counter is the truth.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
from fakes import Clock, FakeNvmlDevices, NVMLError

from vllm_powersave.device import NvmlGpu
from vllm_powersave.energy import NvmlEnergyMeter, PhaseEnergyAccount
from vllm_powersave.energy.meters import LoadHint


@dataclass(frozen=True, slots=True)
class BurstShape:
    """A burst on the fake GPU and how the account sees it (module docstring)."""

    idle_w: float = 80.0
    burst_w: float = 650.0
    boosted_w: float = 120.0
    ramp_s: float = 0.02  # the burst's power rises with this time constant
    work_s: float = 0.2  # GPU work of the burst
    host_s: float = 0.045  # the host's two steps
    rest_s: float = 1.8  # boosted rest after the work
    lag_s: float = 0.04  # the instant power's first-order lag
    tick_s: float = 0.25  # the account's tick (energy.tick_s)
    drain_glitch_w: float = 0.0  # added to the instant reading taken at vLLM's drain
    power_limit_w: float | None = 700.0  # the enforced power limit (None: NVML cannot read it)
    # vLLM's async scheduling: the schedule after the second step finds the first request done and
    # the others waiting on the GPU, so an empty step reports the first finished while the GPU
    # still runs the second (seen in the H100 step trace, docs/results/h200-request-energy.md).
    early_fin: bool = False
    # The tick that vLLM's drain flushes comes this late (s): the account's thread waited on the
    # GIL while the API server sent the batch's responses (the H100 step trace: 0.125 s after the
    # drain, docs/results/h200-request-energy.md), so one tick holds the GPU's last work and its rest.
    late_flush_s: float = 0.0
    # vLLM reports the batch finished this long after the GPU's work ended (its empty step).
    drain_lag_s: float = 0.005


H200 = BurstShape()


def _ramp_j(s: BurstShape, a: float, t: float) -> float:
    """Joules of the ramping burst power from ``a`` to ``t`` (t <= a + work_s)."""
    x = max(0.0, t - a)
    return s.idle_w * x + (s.burst_w - s.idle_w) * (x - s.ramp_s * (1 - math.exp(-x / s.ramp_s)))


class BurstGpu(FakeNvmlDevices):
    """Bursts starting at ``starts``: exact energy (counter steps every 100 ms at ``phase``) and a
    lagging instant power."""

    def __init__(self, clock: Clock, starts: list[float], phase: float, shape: BurstShape = H200) -> None:
        super().__init__(uuids=("GPU-h",), energy_mj=0)
        self.clock, self.starts, self.phase, self.s = clock, starts, phase, shape
        self._lag_t, self._lag_w = 0.0, shape.idle_w

    def true_w(self, t: float) -> float:
        s = self.s
        for a in reversed(self.starts):
            if t >= a:
                if t < a + s.work_s:
                    return s.idle_w + (s.burst_w - s.idle_w) * (1 - math.exp(-(t - a) / s.ramp_s))
                return s.boosted_w if t < a + s.work_s + s.rest_s else s.idle_w
        return s.idle_w

    def true_j(self, t: float) -> float:
        s, j, prev_end = self.s, 0.0, 0.0
        for a in self.starts:
            if t <= a:
                break
            j += s.idle_w * (a - prev_end) + _ramp_j(s, a, min(t, a + s.work_s))
            e = a + s.work_s
            j += s.boosted_w * max(0.0, min(t, e + s.rest_s) - e) + s.idle_w * max(0.0, t - e - s.rest_s)
            prev_end = max(t, a)
        return j + s.idle_w * max(0.0, t - prev_end)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self._hit("nvmlDeviceGetTotalEnergyConsumption")
        k = math.floor((self.clock() - self.phase) / 0.1)
        return 5_000_000 + int(round(self.true_j(max(0.0, self.phase + k * 0.1)) * 1000))

    def nvmlDeviceGetFieldValues(self, h, ids):
        t = self.clock()
        while self._lag_t < t:  # first-order lag, 0.5 ms steps
            dt = min(0.0005, t - self._lag_t)
            self._lag_w += (self.true_w(self._lag_t) - self._lag_w) * (1 - math.exp(-dt / self.s.lag_s))
            self._lag_t += dt
        drain = any(abs(t - (a + self.s.work_s + self.s.drain_lag_s)) < 1e-9 for a in self.starts)
        self.power_mw = [int((self._lag_w + (self.s.drain_glitch_w if drain else 0.0)) * 1000)]
        return super().nvmlDeviceGetFieldValues(h, ids)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        self._hit("nvmlDeviceGetEnforcedPowerLimit")
        if self.s.power_limit_w is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return int(self.s.power_limit_w * 1000)


def _chunks_s(shape: BurstShape) -> list[float]:
    """When the host launches the steps after a burst's first two (from its start, s)."""
    return [0.15 * j for j in range(1, 10) if 0.15 * (j + 1) < shape.work_s]


def tick_at(acc: PhaseEnergyAccount, meter: NvmlEnergyMeter, clock: Clock, events: list, t: float) -> None:
    """One tick of the account at ``t`` (later where the previous read returned after it): the
    counter's phase synced when due, then the engine's ``events`` up to then fed, oldest first
    (``(t, kind, arg)``: a prefill ``step`` of request tokens ``arg``, a step's ``end``, ``fin``
    of request ids ``arg``)."""
    clock.t = max(clock.t, t)
    if clock.t >= meter.sync_due:
        meter.sync_counter_phase(sleep=lambda s: setattr(clock, "t", clock.t + s))
    while events and events[0][0] <= clock.t:
        te, kind, arg = events.pop(0)
        if kind == "step":
            acc.on_step("prefill", prefill_tokens=sum(arg.values()), req_tokens=arg, t=te)
        elif kind == "end":
            acc.on_step_end(t=te)
        else:
            acc.on_finished(arg, t=te)
    acc.tick()


def _burst_events(starts: list[float], shape: BurstShape) -> tuple[list, list[float]]:
    """The engine's events for bursts at ``starts`` (``(t, kind, arg)``, :func:`tick_at`), four
    distinct requests each, and the times of the ticks vLLM's finishes flush."""
    events = []
    for i, a in enumerate(starts):
        ids = [f"b{i}-{k}" for k in range(4)]
        events += [(a, "step", {ids[0]: 1900}), (a + 0.024, "end", None)]
        events += [(a + 0.025, "step", {r: 1900 for r in ids[1:]}), (a + shape.host_s, "end", None)]
        # Longer work is chunked prefill: a step every 0.15 s, so that no host gap reaches idle_after_s.
        events += [(a + x, "step", dict.fromkeys(ids, 512)) for x in _chunks_s(shape)]
        events += [(a + x + 0.02, "end", None) for x in _chunks_s(shape)]
        if shape.early_fin:
            events += [(a + shape.host_s + 0.001, "fin", ids[:1])]
        events += [(a + shape.work_s + shape.drain_lag_s, "fin", ids[1:] if shape.early_fin else ids)]
    events.sort(key=lambda e: e[0])
    return events, sorted(t + shape.late_flush_s for t, kind, _ in events if kind == "fin")


@dataclass
class BurstRun:
    """``n`` bursts 5-5.3 s apart on the fake GPU, each with distinct requests, and the account
    ticking over them (every ``shape.tick_s`` and at each flush of vLLM's finishes)."""

    shape: BurstShape
    starts: list[float]
    gpu: BurstGpu
    clock: Clock
    meter: NvmlEnergyMeter
    acc: PhaseEnergyAccount

    @classmethod
    def build(cls, seed: int, shape: BurstShape, n: int, per_request: bool = True) -> BurstRun:
        rng, clock = random.Random(seed), Clock()
        starts = [2.0 + 5 * i + rng.uniform(0, 0.3) for i in range(n)]
        gpu = BurstGpu(clock, starts, phase=rng.uniform(0, 0.1), shape=shape)
        clock.t = 0.5
        meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-h"), clock=clock)
        acc = PhaseEnergyAccount(meter, idle_after_s=0.25, clock=clock, per_request=per_request, gpu_runs_ahead=True)
        return cls(shape, starts, gpu, clock, meter, acc)

    def ticks(self, until_s: float) -> Iterator[float]:
        """Tick up to ``until_s``; yields the clock after each tick."""
        events, flushes = _burst_events(self.starts, self.shape)
        clock, next_tick = self.clock, self.clock.t + self.shape.tick_s
        while clock.t < until_s:
            tick_at(self.acc, self.meter, clock, events, min([next_tick, *[f for f in flushes if f > clock.t]]))
            yield clock.t
            if clock.t >= next_tick:
                next_tick = clock.t + self.shape.tick_s


def burst_ratios(seed: int, shape: BurstShape = H200, per_request: bool = True) -> list[float]:
    """Six bursts over 30 s (:class:`BurstRun`); returns each burst's booked prefill over the
    exact energy of its work."""
    run = BurstRun.build(seed, shape, 6, per_request)
    seen = [(t, run.acc.energy_j["prefill"]) for t in run.ticks(31.0)]  # (t, prefill J) at each tick
    assert run.acc.total_j() == pytest.approx(run.acc.read_j, abs=1e-6)  # nothing lost or made up
    ratios = []
    for a in run.starts:
        before = [j for t, j in seen if t <= a][-1]
        after = [j for t, j in seen if t <= a + 4.5][-1]
        ratios.append((after - before) / (run.gpu.true_j(a + shape.work_s) - run.gpu.true_j(a)))
    return ratios


def test_an_h200_shaped_burst_books_the_energy_of_its_work_within_5_percent():
    """The requirement's bound (docs/request-energy.md, short bursts). Before, the GPU's rest after
    a burst was priced at the idle power learnt before it unless a read came 0.15 s after the
    work (and at the idle power whenever the rest price came out above the span's joules), and a
    read at vLLM's drain extended the counter as if the work ran on: 24 bursts read 0.978-1.069.
    Now the rest is priced at the instant reading and settled by the counter's next span of rest
    only: 0.997-1.032."""
    ratios = [x for seed in range(4) for x in burst_ratios(seed)]
    assert max(abs(x - 1) for x in ratios) <= 0.05, (min(ratios), max(ratios))


@pytest.mark.parametrize(
    "shape",
    [replace(H200, lag_s=0.06), replace(H200, ramp_s=0.01), replace(H200, work_s=0.4), replace(H200, tick_s=0.5)],
    ids=["lag-60ms", "ramp-10ms", "work-0.4s", "tick-0.5s"],
)
def test_other_burst_shapes_book_the_energy_of_their_work_within_5_percent(shape):
    """Not tuned to the fake's numbers: a slower instant power, a faster ramp, a longer burst and
    ticks twice as far apart read 0.997-1.032, 0.996-1.031, 1.001-1.015 and 0.984-1.016."""
    ratios = [x for seed in range(4) for x in burst_ratios(seed, shape)]
    assert max(abs(x - 1) for x in ratios) <= 0.05, (min(ratios), max(ratios))


def test_a_burst_of_0_1_s_books_the_energy_of_its_work_within_10_percent():
    """A 0.1 s burst is mostly edges: 1.002-1.090 (0.725-1.113 before). Open: the +9 %."""
    ratios = [x for seed in range(4) for x in burst_ratios(seed, replace(H200, work_s=0.1))]
    assert max(abs(x - 1) for x in ratios) <= 0.10, (min(ratios), max(ratios))


def test_an_instant_reading_1000_w_high_at_the_drain_books_a_burst_within_10_percent():
    """Instant readings under a batch swing far past the average (to 1,270 W on the H200); one
    1,000 W high at the read that ends the burst extended the counter past the GPU's power limit
    and booked 1.022-1.764. The extension is bounded by the enforced power limit: 1.022-1.067."""
    ratios = [x for seed in range(4) for x in burst_ratios(seed, replace(H200, drain_glitch_w=1000.0))]
    assert max(abs(x - 1) for x in ratios) <= 0.10, (min(ratios), max(ratios))


def test_a_gpu_without_a_readable_power_limit_keeps_its_meter():
    """The limit is optional: where NVML cannot read it the meter counts no fault, stays
    available and books the plain burst as before."""
    clock = Clock()
    gpu = BurstGpu(clock, [2.0], phase=0.03, shape=replace(H200, power_limit_w=None))
    meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-h"), clock=clock)
    clock.t = 1.0
    assert meter.energy_j() is not None and meter.faults == 0 and meter.unavailable_reason is None
    ratios = burst_ratios(0, replace(H200, power_limit_w=None))
    assert max(abs(x - 1) for x in ratios) <= 0.05, ratios


def test_an_empty_step_reporting_part_of_the_batch_does_not_end_the_burst():
    """Under async scheduling the schedule after the second prefill finds the first request done
    and the rest waiting on the GPU: its empty step reports one request while the GPU still runs
    three. Taken as the batch's drain, the burst's rest began there and it booked 0.165-0.549 (the
    H100 step trace showed the same, 0.33-0.78, docs/results/h200-request-energy.md). The batch
    drains once every request of its last step is reported: 1.003-1.054 (the extra read inside the
    burst; 0.997-1.032 without the early report)."""
    ratios = [x for seed in range(4) for x in burst_ratios(seed, replace(H200, early_fin=True))]
    assert max(abs(x - 1) for x in ratios) <= 0.06, (min(ratios), max(ratios))


@pytest.mark.parametrize("work_s, bound", [(0.2, 0.05), (0.1, 0.10)])
def test_without_per_request_energy_a_burst_books_the_same(work_s, bound):
    """Per-request energy is opt-in; the phases must not depend on it. Without the request ids
    the account learnt a batch's drain only after idle_after_s without a step, and the GPU's rest
    until then went to the burst: 1.003-1.050 for 0.2 s of work, 1.002-1.464 for 0.1 s. The step's
    ids and vLLM's empty steps now reach the walk either way: 0.997-1.032 and 1.002-1.090."""
    ratios = [x for seed in range(4) for x in burst_ratios(seed, replace(H200, work_s=work_s), per_request=False)]
    assert max(abs(x - 1) for x in ratios) <= bound, (min(ratios), max(ratios))


@pytest.mark.parametrize("late_s", [0.05, 0.125, 0.2])
def test_a_tick_that_comes_late_after_the_drain_still_gives_the_gpus_last_work_to_the_burst(late_s):
    """One tick then holds the gap after the last step (the GPU finishing the batch under async
    scheduling) and the rest after vLLM's drain; at one average price the rest took the work's
    joules: 0.747-1.046 at 0.125 s (the H100 read 0.638 in such a burst). The rest is priced at
    the rest power the counter measured after earlier work: 0.997-1.025 over 0.05-0.2 s late after
    a server's first burst. The first, its rest power not yet measured, took the idle power for
    it: up to 1.111; priced at the instant reading where the tick came 0.1 s or more after the
    drain (the reading has settled near the rest power by then), 0.985-1.054."""
    per_seed = [burst_ratios(seed, replace(H200, late_flush_s=late_s)) for seed in range(4)]
    assert min(x for r in per_seed for x in r) >= 0.95, per_seed
    assert max(x for r in per_seed for x in r[1:]) <= 1.03, per_seed
    assert max(r[0] for r in per_seed) <= 1.06, per_seed


def test_the_rest_power_is_learnt_from_the_counter_after_work():
    """The account's rest power is what the counter measured over rest only after a burst (the
    fake GPU rests at 120 W, idles at 80 W), not the idle power or the lagging instant reading."""
    clock = Clock()
    gpu = BurstGpu(clock, [2.0], phase=0.03)
    clock.t = 0.5
    meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-h"), clock=clock)
    acc = PhaseEnergyAccount(meter, idle_after_s=0.25, clock=clock, gpu_runs_ahead=True)
    assert acc.rest_power_w is None
    events = [(2.0, "step", {"r": 1900}), (2.045, "end", None), (2.205, "fin", ["r"])]
    while clock.t < 3.5:
        tick_at(acc, meter, clock, events, min([clock.t + 0.25, *[t for t, *_ in events if t > clock.t]]))
    assert acc.rest_power_w == pytest.approx(120.0, rel=0.05)


def test_each_tick_hands_the_trace_its_counter_steps_and_powers():
    """The step trace's tick lines say what the meter saw (docs/request-energy.md): the account
    passes each tick's counter steps, instant power and learnt rest power to ``on_tick``."""
    clock = Clock()
    gpu = BurstGpu(clock, [2.0], phase=0.03)
    clock.t = 0.5
    meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-h"), clock=clock)
    ticks = []
    acc = PhaseEnergyAccount(meter, idle_after_s=0.25, clock=clock, gpu_runs_ahead=True, on_tick=ticks.append)

    def sleep(s: float) -> None:
        clock.t += s

    while clock.t < 3.0:
        clock.t += 0.25
        if clock.t >= meter.sync_due:
            meter.sync_counter_phase(sleep=sleep)
        acc.tick()
    steps = [c for t in ticks for c in t.counter_steps]
    assert len(steps) >= 8 and all(a.t_s < b.t_s for a, b in zip(steps, steps[1:]))  # one per read at least, in order
    assert all(t.power_w is not None and t.power_w > 0 for t in ticks)


#: An H100-shaped burst (docs/results/h200-request-energy.md, the H100 runs): deep idle at 70 W,
#: ~121-125 W held for 1.5-2.1 s after any request, prefill near the 700 W limit for ~0.16 s.
H100 = replace(H200, idle_w=70.0, boosted_w=125.0, burst_w=700.0, work_s=0.16)


def test_an_h100_shaped_burst_books_the_energy_of_its_work_within_5_percent():
    """After the work the meter extended the counter at the deep-idle power while the GPU held its
    rest power, and the counter's next step took the difference back onto the work's last sliver
    in that period (12.8 J of a 125 J burst in the H100 step trace, read 1.067). The quiet time
    just after work is now extended at the learnt rest power: 240 bursts read 1.001-1.050
    (1.001-1.056 before, 7 outside 5 %). The rest's excess in a counter step's jump is measured
    against that price too: against the idle price it was taken from the burst twice (0.987)."""
    ratios = [x for seed in range(40) for x in burst_ratios(seed, H100)]
    assert max(abs(x - 1) for x in ratios) <= 0.05, (min(ratios), max(ratios))
    assert min(ratios) >= 0.99, min(ratios)


@pytest.mark.parametrize("shape", [H100, H200], ids=["h100", "h200"])
@pytest.mark.parametrize("drain_lag_s", [0.02, 0.03])
def test_a_drain_reported_well_after_the_gpus_work_books_the_burst_within_5_percent(shape, drain_lag_s):
    """vLLM may report the batch drained tens of ms after the GPU's work ended (26 ms in an H100
    burst, docs/results/h200-request-energy.md). The meter extended the counter to the drain at
    the work's power, and the counter's next step took the excess back from the idle after it
    (a phase cannot give joules back): 20 ms read up to 1.139 (H100-shaped) and 1.114 (H200),
    30 ms 1.208 and 1.336. Extended at the quiet price, the next step adds what the GPU still
    worked: 20 ms 1.014-1.030 and 1.012-1.025; 30 ms 1.027-1.043 and 1.022-1.030 past a server's
    first burst, whose rest power is not yet learnt (one read 1.096; simulated)."""
    runs = [burst_ratios(seed, replace(shape, drain_lag_s=drain_lag_s)) for seed in range(20)]
    ratios = [x for r in runs for x in (r if drain_lag_s <= 0.02 else r[1:])]
    assert max(abs(x - 1) for x in ratios) <= 0.05, (min(ratios), max(ratios))


@pytest.mark.parametrize("phase_known", [True, False], ids=["phase-known", "phase-unknown"])
def test_a_drains_gap_is_work_in_the_meters_hint_only_where_no_counter_step_corrects_it(phase_known):
    """With the counter's phase known the meter reports its steps, and the next one books what the
    GPU still worked in a drain's gap back over it: the gap is hinted as quiet. Without the phase
    no step is reported, and hinted as quiet the GPU's last work went to idle: bursts read
    0.49-1.28 of their work against 0.70-1.28 (H100-shaped fake, drain 20 ms after the work)."""
    run = BurstRun.build(3, replace(H100, drain_lag_s=0.02), 2)
    if not phase_known:
        run.meter.sync_due = math.inf  # never synced: the phase stays unknown
    hints: list[LoadHint] = []
    real_hint = run.meter.hint_load
    run.meter.hint_load = lambda h: (hints.append(h), real_hint(h))  # type: ignore[method-assign]
    for _ in run.ticks(9.0):
        pass
    assert run.meter.counter_phase_known is phase_known
    drains = [a + run.shape.work_s + run.shape.drain_lag_s for a in run.starts]
    hinted = [s for h in hints if h is not None for s in h.busy_spans if any(abs(s[1] - d) < 1e-9 for d in drains)]
    assert bool(hinted) is not phase_known, hinted[:3]


@pytest.mark.parametrize("tick_s", [0.05, 0.1, 0.25])
def test_the_idle_power_is_learnt_from_the_counter_whatever_the_ticks_spacing(tick_s):
    """Learnt from ticks of idle only, a tick shorter than the counter's period held mostly the
    meter's extension at the idle power it was hinted, and learnt that price back: after a burst's
    rest at 125 W the H100-shaped GPU idled at 70 W for 2.7 s and was still priced at 125 W with
    ticks 50 ms apart, and its bursts read 0.954-1.000 (0.972-1.009 learnt from the counter's
    spans; simulated)."""
    run = BurstRun.build(0, replace(H100, tick_s=tick_s), 2)
    for _ in run.ticks(run.starts[1] - 0.05):
        pass
    assert run.acc.idle_power_w == pytest.approx(H100.idle_w, abs=2.0)


def test_the_meter_extends_the_quiet_time_just_after_work_at_the_rest_power():
    """:class:`LoadHint`: ``rest_w`` for ``rest_s`` after each span's end, ``quiet_w`` after that
    and before work; a span still running has no rest after it."""
    from vllm_powersave.energy.meters import LoadHint

    hint = LoadHint(((1.0, 1.2),), quiet_w=70.0, rest_w=121.0, rest_s=0.5)
    assert hint.quiet_j(1.2, 1.4) == pytest.approx(0.2 * 121.0)
    assert hint.quiet_j(0.8, 1.3) == pytest.approx(0.2 * 70.0 + 0.1 * 121.0)  # 0.2 s of work left out
    assert hint.quiet_j(1.6, 2.0) == pytest.approx(0.1 * 121.0 + 0.3 * 70.0)
    assert (hint.quiet_w_at(1.3), hint.quiet_w_at(1.8), hint.quiet_w_at(0.9)) == (121.0, 70.0, 70.0)
    assert LoadHint(((1.0, 1.2),), quiet_w=70.0).quiet_j(1.2, 1.4) == pytest.approx(0.2 * 70.0)
    running = LoadHint(((1.0, math.inf),), quiet_w=70.0, rest_w=121.0, rest_s=0.5)
    assert running.busy_now and running.quiet_j(0.5, 1.0) == pytest.approx(0.5 * 70.0)
    # the next burst's work inside the rest window is work, not rest
    remembered = LoadHint((), quiet_w=70.0, rest_w=121.0, rest_s=0.5, last_work_end_s=1.2)  # its span no longer kept
    assert remembered.quiet_j(1.4, 1.8) == pytest.approx(0.3 * 121.0 + 0.1 * 70.0) and remembered.quiet_w_at(1.6) == 121.0
    two = LoadHint(((1.0, 1.2), (1.3, 1.4)), quiet_w=70.0, rest_w=121.0, rest_s=0.5)
    assert two.busy_s(1.2, 1.5) == pytest.approx(0.1) and two.quiet_j(1.2, 1.5) == pytest.approx(0.2 * 121.0)


def test_the_account_hints_the_learnt_rest_power_to_the_meter():
    """The account tells the meter its learnt rest power with the spans of work, and no rest price
    before it has learnt one."""
    seen = []

    from vllm_powersave.energy.meters import EnergyMeter

    class Meter(EnergyMeter):
        def energy_j(self):
            return 0.0

        def power_w(self):
            return None

        def sm_clock_mhz(self):
            return None

        def hint_load(self, hint):
            seen.append(hint)

    clock = Clock()
    acc = PhaseEnergyAccount(Meter(), idle_after_s=0.25, clock=clock, gpu_runs_ahead=True)
    acc.idle_power_w = 70.0
    acc.on_step("prefill", prefill_tokens=100, t=0.1)
    acc.on_step_end(t=0.15)
    clock.t = 0.3
    acc.tick()
    assert seen[-1].quiet_w == 70.0 and seen[-1].rest_w is None
    acc.rest_power_w = 121.0
    clock.t = 0.6
    acc.tick()
    assert seen[-1].rest_w == 121.0 and seen[-1].rest_s > 0.2
    # The account keeps its spans for about two counter periods; the last work's end outlives them,
    # so that the rest window lasts rest_s whatever the ticks' spacing (it lasted ~0.2 s).
    for t in (0.62, 0.64, 0.6 + 0.01 * 3):
        clock.t = t
        acc.tick()
    end, last = seen[1].last_work_end_s, seen[-1]
    assert end is not None and last.busy_spans == () and last.last_work_end_s == end  # spans gone, the end kept
    assert last.quiet_w_at(end + 0.45) == 121.0 and last.quiet_w_at(end + 0.55) == last.quiet_w


def test_a_late_tick_that_also_holds_the_last_step_prices_the_rest_after_the_drain_at_rest_power():
    """A tick 0.125 s after the drain that also holds the batch's last step priced the idle after
    the drain (the GPU's rest) at the idle power, and the steps took the rest's excess: 68 of 240
    H100-shaped bursts outside 5 %, one traced at 1.072. Priced at the learnt rest power: 1.009 for
    that burst, and once the server has learnt its rest power (from its third burst on) every burst
    within 5 % (0.994-1.017); the first two, before it, up to 1.125 at the idle price, 1.084 since
    the settled instant reading prices a late tick's rest (simulated)."""
    per_seed = [burst_ratios(seed, replace(H100, late_flush_s=0.125)) for seed in range(40)]
    assert min(x for r in per_seed for x in r) >= 0.95, per_seed
    assert max(abs(x - 1) for r in per_seed for x in r[2:]) <= 0.05, per_seed
    assert max(x for r in per_seed for x in r[:2]) <= 1.09, per_seed


@pytest.mark.parametrize("late_s", [0.125, 0.2])
def test_a_servers_first_burst_prices_a_late_ticks_rest_at_the_settled_instant_reading(late_s):
    """Before the counter has measured a rest power, the rest after the drain in a tick 0.125 s or
    0.2 s late was priced at the idle power: 39 of 40 H100-shaped first bursts above 1.05 (up to
    1.143). At the instant reading, settled that long after the work and capped by the tick's
    average power: 12 of 40, up to 1.118 (simulated). Open: those 12, whose rest lies in the tick
    that holds the work, under 0.1 s after it, where the reading still lags the work's power."""
    firsts = [burst_ratios(seed, replace(H100, late_flush_s=late_s))[0] for seed in range(40)]
    assert sum(abs(x - 1) > 0.05 for x in firsts) <= 13, firsts
    assert 0.95 <= min(firsts) and max(firsts) <= 1.12, firsts


class LateReturnGpu(BurstGpu):
    """The counter's value is taken when a read is called; the call returns 3 ms later."""

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        mj = super().nvmlDeviceGetTotalEnergyConsumption(h)
        self.clock.t += 0.003
        return mj


def test_a_read_taken_before_the_counter_stepped_but_returning_after_it_teaches_no_rest_power():
    """After a burst the GPU rests at 120 W. One read is called 1 ms before the counter's update
    and returns 2 ms after it, with the value from before: taken as having seen the step, it left
    the step for the next read, as a span of 2 ms holding the period's 12 J. Learnt from that span,
    the rest power read 23,471 W on an H100 (docs/results/h200-request-energy.md), and the meter
    then extended every quiet read at it. A span that short is no counter period."""
    clock = Clock()
    gpu = LateReturnGpu(clock, [2.0], phase=0.03)
    clock.t = 0.5
    meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-h"), clock=clock)
    acc = PhaseEnergyAccount(meter, idle_after_s=0.25, clock=clock, gpu_runs_ahead=True)
    events = [(2.0, "step", {"r": 1900}), (2.045, "end", None), (2.205, "fin", ["r"])]
    for t in sorted({0.5 + 0.25 * k for k in range(1, 14) if k != 7} | {2.205, 2.225, 2.329, 2.4}):
        tick_at(acc, meter, clock, events, t)
    assert acc.rest_power_w is None or acc.rest_power_w < 200.0, acc.rest_power_w


def test_a_quiet_price_above_the_power_limit_extends_the_counter_at_the_limit():
    """The account hints the meter a rest price; one above the enforced power limit (700 W here)
    is no rest, and the meter extends the counter at the limit at most (at 23,471 W a read 50 ms
    after the counter's step returned 1,174 J more than the counter had)."""
    clock = Clock()
    gpu = BurstGpu(clock, [], phase=0.03)
    clock.t = 0.5
    meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-h"), clock=clock)

    def sleep(s: float) -> None:
        clock.t += s

    assert meter.sync_counter_phase(sleep=sleep)
    clock.t = 1.031  # just after the counter's step at 1.03
    e0 = meter.energy_j()
    meter.hint_load(LoadHint((), quiet_w=80.0, rest_w=23_470.9, rest_s=0.5, last_work_end_s=1.0))
    clock.t = 1.081
    assert meter.energy_j() - e0 <= 700.0 * 0.055  # ~52 ms since the counter stepped


class StraddlingReadGpu(BurstGpu):
    """One energy read, called at ``straddle_s``, returns 10 ms later with the value from its call."""

    straddle_s = 2.435

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        mj = super().nvmlDeviceGetTotalEnergyConsumption(h)
        if abs(self.clock.t - self.straddle_s) < 1e-9:
            self.clock.t += 0.010
        return mj


def test_a_rest_span_that_holds_the_bursts_work_teaches_no_rest_power():
    """H100-shaped bursts (700 W work for 0.16 s, rest at 125 W). The tick at the first burst's
    drain comes late and its read straddles the counter's update at 2.442 (called at 2.435, the
    value from then, back at 2.445); the next read, a period later, saw two periods at once, one of
    them the burst's work, and the span after the drain read as a rest of 668 W, which later bursts
    were priced against (0.87-0.88 of their work). A rest measured above the instant reading it
    was held at (which lags the falling power: an upper bound) held work, and is not learnt."""
    clock = Clock()
    starts = [2.255, 5.255, 8.255]
    gpu = StraddlingReadGpu(clock, starts, phase=0.042, shape=H100)
    clock.t = 0.5
    meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-h"), clock=clock)
    acc = PhaseEnergyAccount(meter, idle_after_s=0.25, clock=clock, gpu_runs_ahead=True)
    events = []
    for a in starts:
        events += [(a, "step", {"x": 1900}), (a + 0.024, "end", None), (a + 0.025, "step", {"y": 1900, "z": 1900})]
        events += [(a + 0.045, "end", None), (a + 0.165, "fin", ["x", "y", "z"])]
    ticks = sorted({0.5 + 0.25 * k for k in range(1, 40) if not 2.2 < 0.5 + 0.25 * k < 2.6} | {2.185, 2.435, 2.6, 5.42, 8.42})
    seen = []
    for t in ticks:
        tick_at(acc, meter, clock, events, t)
        seen.append((clock.t, acc.energy_j["prefill"]))
        assert acc.rest_power_w is None or acc.rest_power_w < 200.0, (clock.t, acc.rest_power_w)
    for a in starts[1:]:
        before, after = [j for t, j in seen if t <= a][-1], [j for t, j in seen if t <= a + 1.5][-1]
        assert (after - before) / (gpu.true_j(a + H100.work_s) - gpu.true_j(a)) == pytest.approx(1.0, abs=0.05)


def test_a_read_time_that_is_no_number_leaves_the_tick_at_its_own_time():
    """A meter of another shape whose ``read_t_s`` is a method, a string or NaN: the tick ends at
    its own time, as for a meter without one (a comparison with it raised on every tick)."""
    for odd in (lambda: 1.0, "1.0", float("nan"), None):
        clock = Clock()

        class Meter:
            read_t_s = odd

            def energy_j(self):
                return 100.0 * clock.t

            def on_idle(self, seconds):
                pass

        acc = PhaseEnergyAccount(Meter(), clock=clock)
        for k in range(1, 4):
            clock.t = 0.1 * k
            acc.on_step("decode", decode_tokens=1, t=clock.t - 0.05)
            acc.tick()
        assert acc.total_j() == pytest.approx(30.0)


def _fuzzed_shape(rng: random.Random) -> BurstShape:
    return replace(
        H200,
        lag_s=rng.uniform(0.005, 0.08),
        ramp_s=rng.uniform(0.005, 0.05),
        work_s=rng.uniform(0.08, 0.5),
        tick_s=rng.choice([0.05, 0.1, 0.25, 0.5]),
        drain_lag_s=rng.uniform(0.001, 0.06),
        late_flush_s=rng.choice([0.0, 0.0, 0.05, 0.125, 0.2]),
        early_fin=rng.random() < 0.3,
        drain_glitch_w=rng.choice([0.0, 0.0, 300.0, 1000.0]),
        boosted_w=rng.uniform(85.0, 200.0),
        burst_w=rng.uniform(250.0, 700.0),
    )


def _published_drops(seed: int) -> list[tuple[float, str, float]]:
    """Five bursts of a fuzzed shape (:func:`_fuzzed_shape`); every fall of a published counter
    (the phases, the tail, steady state) from one tick to the next, and the balance checked."""
    run = BurstRun.build(seed, _fuzzed_shape(random.Random(seed)), 5)
    acc, drops, prev = run.acc, [], None
    for t in run.ticks(26.0):
        now = {**acc.energy_j, "tail": acc.tail_j, "steady": acc.steady_j}
        drops += [(t, k, now[k] - prev[k]) for k in now if prev is not None and now[k] < prev[k] - 1e-9]
        prev = now
    assert acc.total_j() == pytest.approx(acc.read_j, abs=1e-6)  # everything read is booked once
    return drops


def test_no_published_counter_falls_under_fuzzed_burst_shapes():
    """Prometheus reads a drop as a counter reset. A rest settled out of a tick's idle before the
    same tick's negative counter jump took back from it left the jump short, and the rest was
    booked as a negative lump: idle fell by up to 7.6 J in 12 of 150 fuzzed shapes. The jumps now
    take back first; 0 of 300 (simulated)."""
    drops = [(seed, *d) for seed in range(90) for d in _published_drops(seed)]
    assert not drops, drops[:5]
