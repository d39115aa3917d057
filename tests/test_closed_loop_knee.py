"""Knee mode of the closed-loop decode clock (docs/closed-loop.md, "Noisy steps: locate the knee"):
where the step noise is too high for the one test to resolve the budget, the loop bounds the
memory-bound knee from a probe with a large slowdown and holds above the bound. The GPU here is a
driver of the tuner alone (simulated step times, no GPU)."""

import random

from vllm_powersave.clocks.closed_loop import DecodeClockTuner
from vllm_powersave.settings import load_settings
from vllm_powersave.sim.gpu import H200

F_MAX = 1980


def _tuner(**cl):
    s = load_settings({"clocks": {"closed_loop": {"enabled": True, **cl}}}, env={}).clocks.closed_loop
    return DecodeClockTuner(s, H200.sm_clocks_mhz)


class KneeGpu:
    """A step at ``f`` takes ``4 ms + ctx`` times ``1 + share x (knee / f - 1)`` below the knee
    (``share``: the part of the step that slows; the rest, launches, does not), times lognormal
    noise; the clock asked for applies from the next step. ``knee_at(t)`` may move the knee."""

    def __init__(self, tuner, noise, seed, share=0.96, knee_at=lambda t: 780.0):
        self.tuner, self.noise, self.share, self.knee_at = tuner, noise, share, knee_at
        self.rng = random.Random(seed)
        self.clock, self.t, self.ctx = None, 0.0, 20_000.0
        self.slow: list[float] = []  # true slowdown of each step
        self.below: list[bool] = []  # ran below the default clock

    def run(self, steps, batch=8):
        for _ in range(steps):
            f = self.clock or F_MAX
            slow = self.share * max(0.0, self.knee_at(self.t) / f - 1.0)
            true_ms = (4.0 + 2e-5 * self.ctx) * (1.0 + slow)
            self.t += true_ms / 1e3
            self.slow.append(slow)
            self.below.append(f < F_MAX)
            ms = true_ms * self.rng.lognormvariate(0.0, self.noise)
            self.clock = self.tuner.observe(self.t, batch, ms, self.clock, self.ctx)
            self.ctx = 20_000.0 + (self.ctx - 20_000.0 + batch) % 20_000.0
        return self

    def in_budget(self):
        return sum(s <= 0.01 for s in self.slow) / len(self.slow)


def test_under_6pct_noise_the_loop_holds_below_the_default_and_keeps_the_budget():
    # 6 % step noise needs ~6,000-step windows to resolve a 1 % budget: without knee mode the
    # bucket keeps the default clock (below it in ~0 % of steps).
    for seed in (1, 2):
        g = KneeGpu(_tuner(), noise=0.06, seed=seed).run(60_000)
        assert sum(g.below) / len(g.below) >= 0.9
        assert g.in_budget() >= 0.995
        held = g.tuner.snapshot()["buckets"][8]["held_mhz"]
        assert held is not None and 780 <= held <= 780 * 1.15


def test_without_knee_mode_a_noisy_bucket_keeps_the_default_clock():
    g = KneeGpu(_tuner(knee_locate=False), noise=0.06, seed=1).run(20_000)
    assert sum(g.below) / len(g.below) < 0.05
    assert g.tuner.knee is None


def test_the_knee_bound_is_above_the_knee_and_located_from_few_steps():
    g = KneeGpu(_tuner(), noise=0.08, seed=3).run(20_000)
    kb = g.tuner.knee
    assert kb is not None and 780 <= kb.mhz <= 780 * 1.08
    probe_steps = sum(1 for r in g.tuner.records if r.event == "probe")
    assert probe_steps <= 6  # a staircase down from 0.7 x the default, then re-locates


def test_a_knee_moving_up_is_followed():
    # The knee rises 780 -> 1000 MHz over 300 s under 5 % noise: the guard (a slowdown of 3x the
    # room) and the scheduled re-locates raise the held clock. Steps the guard is too slow to
    # catch (slowdown 1-3 %) stay out of budget until it fires: 98.0-99.6 % in budget on seeds
    # 4-6 (docs/closed-loop.md).
    g = KneeGpu(_tuner(), noise=0.05, seed=4, knee_at=lambda t: 780.0 + 220.0 * min(1.0, max(0.0, (t - 60.0) / 300.0))).run(120_000)
    assert g.in_budget() >= 0.975
    held = g.tuner.snapshot()["buckets"][8]["held_mhz"]
    assert held is not None and held >= 1000
