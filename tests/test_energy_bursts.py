"""Short prefill bursts between idle spells, metered through a 100 ms NVML counter whose instant
power lags the true power: the burst's phase energy against the truth.

The fake GPU draws 80 W idle (the H200's, docs/h200-facts.md) and 600 W while a burst runs (a
prefill-heavy step on the H200 draws ~470-690 W, docs/results/h200-energy-meter.md (a), (c)); the
counter steps every 100 ms to the true energy; the instant power reading is the true power through
a first-order lag of 30 or 60 ms. The H200 record shows power lagging the work by "tens of ms"
(docs/results/h200-energy-meter.md (c): the decode-to-idle tail lands in idle), so 30 ms is the
middle of that and 60 ms its upper end.
"""

from __future__ import annotations

import math
import random

import pytest
from fakes import Clock, FakeNvmlDevices

from vllm_powersave.device import NvmlGpu
from vllm_powersave.energy import NvmlEnergyMeter, PhaseEnergyAccount

IDLE_W, BURST_W = 80.0, 600.0


class LaggingBurstGpu(FakeNvmlDevices):
    """True power: ``BURST_W`` inside each ``(start, end)`` burst, ``IDLE_W`` elsewhere. The
    counter steps every ``period`` s (at ``phase`` + k x period) to the true energy; the instant
    power is the true power through a first-order lag of ``lag_s``."""

    def __init__(self, clock: Clock, bursts: list[tuple[float, float]], lag_s: float, phase: float, period: float = 0.1) -> None:
        super().__init__(uuids=("GPU-b",), energy_mj=0)
        self.clock, self.bursts, self.lag_s, self.phase, self.period = clock, bursts, lag_s, phase, period

    def true_j(self, t: float) -> float:
        return IDLE_W * t + sum((BURST_W - IDLE_W) * max(0.0, min(t, b) - a) for a, b in self.bursts)

    def lagged_w(self, t: float) -> float:
        p = IDLE_W
        for a, b in self.bursts:
            if t <= a:
                break
            p += (BURST_W - IDLE_W) * (1 - math.exp(-(t - a) / self.lag_s))
            if t > b:
                p -= (BURST_W - IDLE_W) * (1 - math.exp(-(t - b) / self.lag_s))
        return p

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self._hit("nvmlDeviceGetTotalEnergyConsumption")
        k = math.floor((self.clock() - self.phase) / self.period)
        return 7_000_000 + int(round(self.true_j(max(0.0, self.phase + k * self.period)) * 1000))

    def nvmlDeviceGetFieldValues(self, h, ids):
        self.power_mw = [int(self.lagged_w(self.clock()) * 1000)]
        return super().nvmlDeviceGetFieldValues(h, ids)


def burst_errors(duration_s: float, lag_s: float, seed: int, flush_after_s: float | None = None, poll_s: float = 0.001) -> list[float]:
    """Bursts of ``duration_s`` (steps of 30 ms) 1-1.5 s apart over 20 s; the account ticks every
    0.25 s (``energy.tick_s``), and also ``flush_after_s`` after each burst's end where given (a
    request finishing flushes its figure); the counter's phase is synced by polling every
    ``poll_s`` as the publisher does. Returns each burst's prefill joules over the truth, less 1:
    the truth is the burst's true energy plus the idle power over the rest of the time the account
    booked as prefill (the gap after the last step, before it turns idle)."""
    rng, clock = random.Random(seed), Clock()
    bursts, t = [], 2.0
    while t < 20:
        a = t + rng.uniform(0, 0.1)
        bursts.append((a, a + duration_s))
        t = a + duration_s + rng.uniform(1.0, 1.5)
    gpu = LaggingBurstGpu(clock, bursts, lag_s, phase=rng.uniform(0, 0.1))
    clock.t = 0.5
    meter = NvmlEnergyMeter(NvmlGpu(gpu, 0, "GPU-b"), clock=clock)
    acc = PhaseEnergyAccount(meter, idle_after_s=0.25, clock=clock)
    events = []
    for a, b in bursts:
        s = a
        while s < b - 1e-9:
            events += [(s, "prefill"), (min(b, s + 0.03), None)]
            s += 0.03

    def sleep(s: float) -> None:
        clock.t += s

    seen = []  # (t, prefill J, prefill s) at each tick
    next_tick = clock.t + 0.25
    while clock.t < 21:
        clock.t = max(clock.t, next_tick)
        if clock.t >= meter.sync_due:
            meter.sync_counter_phase(poll_s=poll_s, sleep=sleep)
        while events and events[0][0] <= clock.t:
            te, phase = events.pop(0)
            acc.on_step(phase, t=te) if phase else acc.on_step_end(t=te)
        acc.tick()
        seen.append((clock.t, acc.energy_j["prefill"], acc.time_s["prefill"]))
        next_tick = clock.t + 0.25
        if flush_after_s is not None:
            ends = [b + flush_after_s for _, b in bursts if clock.t < b + flush_after_s < next_tick]
            next_tick = min([next_tick, *ends])
    assert acc.total_j() == pytest.approx(meter.energy_j(), abs=BURST_W * 0.1)  # nothing lost or made up
    errors = []
    for (a, b), (nxt, _) in zip(bursts, [*bursts[1:], (21.0, 0.0)]):
        before = [x for x in seen if x[0] <= a][-1]
        after = [x for x in seen if x[0] <= nxt][-1]
        joules, seconds = after[1] - before[1], after[2] - before[2]
        errors.append(joules / (BURST_W * (b - a) + IDLE_W * (seconds - (b - a))) - 1)
    return errors


@pytest.mark.parametrize("lag_s", [0.03, 0.06])
@pytest.mark.parametrize("duration_s", [0.1, 0.2, 0.3, 0.5])
def test_a_burst_between_idle_spells_is_booked_within_5_percent_at_the_tick_period(duration_s, lag_s):
    """Ticks 0.25 s apart see several counter steps at once. Before, the counter was extended
    past its last step at a rate that spanned the burst's edge, and the correction came with the
    next read, after the burst, where an idle-only tick took it as idle: bursts of 0.1-0.3 s read
    up to 25 % low or 20 % high."""
    errors = [e for seed in range(4) for e in burst_errors(duration_s, lag_s, seed)]
    assert max(abs(e) for e in errors) <= 0.05, (min(errors), max(errors))


@pytest.mark.parametrize("duration_s", [0.1, 0.2, 0.3, 0.5])
def test_a_burst_with_a_flush_just_after_it_is_booked_within_5_percent(duration_s):
    """A request's finish flushes a tick 5 ms after the burst's end, while the instant power still
    reads most of the burst's: before, that read extended the burst's power over the idle after
    it, or re-priced the burst's part of the period at the falling reading (down to 56 % low).
    The counter's phase is pinned to 0.1 ms here: a read that falls within the phase's error of
    a counter step (a 1 ms poll leaves ~1 ms; ~1 % of reads) cannot tell whether the counter has
    stepped, and either guess puts up to a period's joules in the wrong tick. That is a limit of
    placing steps by a learnt phase (energy/meters.py, ``_since_update``), not of bursts."""
    errors = [e for seed in range(6) for lag_s in (0.03, 0.06) for e in burst_errors(duration_s, lag_s, seed, 0.005, poll_s=0.0001)]
    assert max(abs(e) for e in errors) <= 0.05, (min(errors), max(errors))
