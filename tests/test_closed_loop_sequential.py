"""The closed loop's sequential probe test (everything on the GPU side here is simulated or a
fake)."""

import re

from test_closed_loop_tracking import Decode, _loop_settings

from vllm_powersave.clocks.closed_loop import DecodeClockTuner
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
