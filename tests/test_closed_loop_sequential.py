"""The closed loop's sequential probe test and the switch latency it learns from read-back
(everything on the GPU side here is simulated or a fake)."""

import re

from fakes import FakeNvml
from test_closed_loop_tracking import F_MAX, Decode, _controller, _drive, _loop_settings

from vllm_powersave.clocks.closed_loop import UNKNOWN, DecodeClockTuner
from vllm_powersave.sim.gpu import H200


def _rejects(tuner, knee):
    """(true slowdown, steps) of each rejected probe."""
    out = []
    for r in tuner.records:
        if r.event == "reject" and r.ran_at_mhz:
            n = int(re.search(r"median of (\d+) steps", r.reason).group(1))
            out.append((max(1.0, knee / r.ran_at_mhz) - 1.0, n))
    return out


def test_a_probe_over_the_target_is_stopped_by_the_sequential_test_within_tens_of_steps():
    # 1 % step noise, a knee that puts the next clock down 1.2 % slow (just over the 1 % budget):
    # those probes end after 20 steps or fewer on average (the earlier early look, every 4 steps
    # at one more standard error, needed ~50).
    found = []
    for seed in range(10):
        tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
        Decode(tuner, knee_mhz=774.0, noise=0.01, seed=seed).run(8000)
        found += [n for slow, n in _rejects(tuner, 774.0) if 0.01 < slow <= 0.02]
    assert len(found) >= 6
    assert sum(found) / len(found) <= 20, found


def test_the_sequential_test_rarely_stops_a_clock_with_no_slowdown():
    # A knee below every candidate: no probe is slower than the default, so every early stop is a
    # false one (type I at most alpha / (1 - beta), ~0.5 %, per probe).
    probes = stopped = 0
    for seed in range(12):
        tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
        Decode(tuner, knee_mhz=200.0, noise=0.01, seed=seed).run(4000)
        probes += tuner.n_probes
        stopped += sum(1 for r in tuner.records if r.event == "reject" and "stopped early" in r.reason)
    assert probes >= 30 and stopped <= max(1, 0.03 * probes), (stopped, probes)


class SlowNvml(FakeNvml):
    """A fake NVML whose SM clock reads back the clock before each set or reset for ``lag``
    reads after it."""

    def __init__(self, lag=0):
        super().__init__()
        self.lag, self.reads_since_set, self.before = lag, 0, F_MAX

    def nvmlDeviceGetSupportedGraphicsClocks(self, h, mem):
        return list(H200.sm_clocks_mhz)

    def _now(self):
        return self.locked[0] if self.locked else F_MAX

    def nvmlDeviceSetGpuLockedClocks(self, h, lo, hi):
        self.before, self.reads_since_set = self._now(), 0
        super().nvmlDeviceSetGpuLockedClocks(h, lo, hi)

    def nvmlDeviceResetGpuLockedClocks(self, h):
        self.before, self.reads_since_set = self._now(), 0
        super().nvmlDeviceResetGpuLockedClocks(h)

    def nvmlDeviceGetClockInfo(self, h, kind):
        self.reads_since_set += 1
        return self.before if self.reads_since_set <= self.lag else self._now()


def test_the_controller_learns_the_switch_latency_from_read_back(tmp_path):
    nvml = SlowNvml(lag=4)  # a switch shows in the 5th read after it: ~5 steps of ~10 ms
    ctl = _controller(tmp_path, nvml)
    _drive(ctl, nvml, 3000)
    assert ctl.switch_latency_s is not None and 0.03 <= ctl.switch_latency_s <= 0.08, ctl.switch_latency_s
    assert ctl.closed_loop.switch_latency_s == ctl.switch_latency_s
    assert ctl.closed_loop.snapshot()["switch_latency_ms"] == round(1e3 * ctl.switch_latency_s, 3)
    ctl.close()


def test_a_step_that_ended_while_the_old_lock_still_read_back_ran_at_it(tmp_path):
    nvml = SlowNvml(lag=3)
    ctl = _controller(tmp_path, nvml)
    t = _drive(ctl, nvml, 3000)
    old = nvml.locked[0] if nvml.locked else None
    assert old is not None
    ctl.on_phase("prefill", t)  # the default clock asked for; the lock still reads back 3 times
    ctl.observe_decode_step(t + 0.01, 64, 10.0, False)
    assert ctl.ran_at(t, t + 0.01) == old  # read back at its end: still the lock, so it ran at it
    assert ctl.ran_at(t + 0.005, t + 0.02) == UNKNOWN  # ends after the last read: not known
    ctl.close()


def test_slow_switches_stretch_the_retry_schedule():
    # A held clock is retried one step lower after retry_after_s (20 s); a failed lowering costs
    # the steps a raise takes to land, so a 200 ms switch (~20 steps of 10 ms) waits ~5x longer.
    waits = {}
    for lag_s in (None, 0.2):
        tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
        tuner.switch_latency_s = lag_s
        d = Decode(tuner).run(3000)
        held_t = next(r.t_s for r in tuner.records if r.event == "hold")
        d.run(12_000)
        waits[lag_s] = next(r.t_s for r in tuner.records if r.event == "retry") - held_t
    assert 19.0 <= waits[None] <= 25.0, waits
    assert waits[0.2] >= 4 * waits[None], waits


def test_a_probe_asks_for_the_default_clock_ahead_of_its_verdict_when_switches_are_slow():
    # Under a 200 ms switch a probe 4 % over the target asks for the default clock before the
    # sequential test rejects it; the steps still run at the probe clock decide, as without lag.
    tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
    tuner.switch_latency_s = 0.2
    d = Decode(tuner, knee_mhz=780.0, noise=0.01, seed=3)
    ahead = 0
    for _ in range(6000):
        asked = d.clock
        d.run(1)
        b = tuner.buckets.get(64)
        if b is not None and b.state == "probe" and asked is not None and d.clock is None:
            ahead += 1
    assert ahead >= 1
    assert "reject" in d.events() and tuner.snapshot()["buckets"][64]["held_mhz"] is not None


class Cotenant(Decode):
    """Every step 30 % slower while the tuner measures the default clock after its first probe
    (another job on the GPU then: the second probe's reference), and not after."""

    def run(self, steps, batch=64):
        for _ in range(steps):
            b = self.tuner.buckets.get(64)
            slow = b is not None and b.state == "ref" and b.probes == 1
            f = self.clock or F_MAX
            true_ms = (10.0 + 1e-5 * self.ctx) * max(1.0, self.knee / f) * (1.3 if slow else 1.0)
            ms = true_ms * (self.rng.gauss(1.0, self.noise) if self.noise else 1.0)
            self.t += true_ms / 1e3
            self.clock = self.tuner.observe(self.t, batch, ms, self.clock, self.ctx)
            self.ctx += batch / 8
        return self


def test_a_probe_faster_than_its_reference_measures_the_default_clock_again():
    # The reference before a probe was taken under another tenant: the probe's steps look 23 %
    # faster than the default clock, which a lower clock never is. The mirror sequential test
    # calls the reference stale and measures it again before the probe goes on.
    tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
    Cotenant(tuner, noise=0.01, seed=1).run(4000)
    stale = [r for r in tuner.records if r.event == "rebaseline" and "faster than the default clock" in r.reason]
    assert stale
    assert tuner.snapshot()["buckets"][64]["held_mhz"] is not None


def test_a_probe_that_turns_slow_midway_is_still_stopped_by_the_sequential_test():
    # The probe clock is fine for 30 steps (the test sits at its floor), then 5 % slow (the GPU
    # changed under it): the floored test still stops it within tens of steps, not after the
    # full window (~120 steps at 1 % noise).
    tuner = DecodeClockTuner(_loop_settings(), H200.sm_clocks_mhz)
    d = Decode(tuner, knee_mhz=200.0, noise=0.01, seed=5)
    changed_at = None
    for i in range(20_000):
        d.run(1)
        b = tuner.buckets.get(64)
        if changed_at is None and b is not None and b.state == "probe" and b.probes >= 2 and len(b.samples) == 30:
            d.knee, changed_at, probe = tuner.cands[b.probe] * 1.05, i, tuner.cands[b.probe]
        if changed_at is not None and tuner.last.event in ("reject", "accept"):
            break
    assert changed_at is not None
    assert tuner.last.event == "reject" and tuner.last.ran_at_mhz == probe
    assert i - changed_at <= 30, i - changed_at
