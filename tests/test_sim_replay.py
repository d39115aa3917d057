"""The simulated serving replay's parts (all simulated): lagged clock, clock-split pricing, V1 scheduling."""

import random

import pytest

from vllm_powersave.sim.gpu import H200, KernelGroupCost, idle_power_w, simulate_kernel
from vllm_powersave.sim.trace import GroupStepCost, LaggedClock, idle_energy_j, onoff_arrivals, run_at_clocks, schedule_v1


def test_simulated_switch_latency_delays_each_request():
    c = LaggedClock(0.006)
    c.request(1.0, 900)
    c.request(1.002, None)
    assert c.at(1.0059) is None and c.next_change() == pytest.approx(1.006)
    assert c.at(1.006) == 900 and c.at(1.0079) == 900 and c.at(1.008) is None


def test_work_is_split_where_a_clock_change_lands_inside_it():
    c = LaggedClock(0.0)
    c.request(0.5, 900)
    price = {1980: (1.0, 100.0), 900: (2.0, 60.0)}.__getitem__  # 900 MHz: twice the time, 60 % of the energy
    t, e, f_time = run_at_clocks(c, 0.0, price, 1980)
    # Half the work at the default clock (0.5 s, 50 J), the other half at 900 MHz (1 s, 30 J).
    assert t == pytest.approx(1.5) and e == pytest.approx(80.0)
    assert f_time == pytest.approx({1980: 0.5, 900: 1.0})
    t2, e2, f2 = run_at_clocks(c, 2.0, price, 1980)  # no change ahead: all at 900 MHz
    assert (t2, e2) == pytest.approx((4.0, 60.0)) and f2 == pytest.approx({900: 2.0})


def test_idle_energy_prices_each_stretch_at_the_clock_in_effect():
    c = LaggedClock(0.1)
    c.request(0.9, 345)  # lands at 1.0
    e = idle_energy_j(H200, c, 0.0, 3.0)
    assert e == pytest.approx(idle_power_w(H200, None) * 1.0 + idle_power_w(H200, 345) * 2.0)
    assert idle_power_w(H200, 345) < idle_power_w(H200, None)
    assert idle_energy_j(H200, c, 3.0, 3.0) == 0.0


def _steps(arrivals, step_s=0.1, budget=8192):
    def make_step(pre, dec, waiting, out):
        return {"prefill": [c for _, c in pre], "decode": len(dec), "out": out, "waiting": len(waiting)}

    return schedule_v1(arrivals, make_step, lambda s: step_s, budget_tokens=budget)


def test_v1_schedule_runs_decodes_first_and_chunks_prompts_within_the_budget():
    events = _steps([(0.0, 10_000, 2), (0.0, 100, 3)])
    steps = [s for kind, s in events if kind == "step"]
    # Step 1: the long prompt takes the whole budget; the second request waits.
    assert steps[0] == {"prefill": [8192], "decode": 0, "out": 0, "waiting": 1}
    # Step 2: the rest of the long prompt, then the short one: both sample their first token.
    assert steps[1] == {"prefill": [1808, 100], "decode": 0, "out": 2, "waiting": 0}
    # Then decodes, one token per request per step, until each reaches its output length.
    assert [(s["decode"], s["out"]) for s in steps[2:]] == [(2, 2), (1, 1)]
    assert all(kind == "step" for kind, _ in events)


def test_v1_schedule_idles_until_the_next_arrival():
    events = _steps([(0.0, 10, 1), (5.0, 10, 1)])
    assert [kind for kind, _ in events] == ["step", "idle", "step"]
    assert events[1][1] == pytest.approx(4.9)  # one 0.1 s step, then nothing until t = 5


def test_onoff_arrivals_are_sorted_within_the_duration_and_come_in_bursts():
    lengths = lambda rng: (rng.randint(32, 64), rng.randint(4, 8))
    a = onoff_arrivals(random.Random(3), 600.0, (2.0,), 8.0, lengths)
    assert a == sorted(a) and all(0.0 <= t < 600.0 for t, _, _ in a)
    assert all(32 <= p <= 64 and 4 <= o <= 8 for _, p, o in a)
    times = [t for t, _, _ in a]
    assert max(times.count(t) for t in set(times)) >= 16  # a batch job: 16-64 requests at one instant
    assert a == onoff_arrivals(random.Random(3), 600.0, (2.0,), 8.0, lengths)  # seeded: reproducible


def test_group_pricing_runs_each_layer_group_once_per_layer_at_the_clock():
    price = GroupStepCost(H200, "qwen2.5-7b")
    works = price.works(64, 64, 40_000, 0)
    groups = KernelGroupCost.for_shape("qwen2.5-7b").groups(64, 64, 40_000, 0)
    assert [g for g, _ in groups[:2] + groups[-2:]] == list(price.GROUPS) and len(groups) == 2 * price.layers + 2
    for f in (1980, 900):
        exact = [simulate_kernel(H200, w, f) for _, w in groups]
        t, e = price.run(works, f)
        # Works are quantised to 3 significant digits for the cache: prices agree to well within 1 %.
        assert t == pytest.approx(sum(r.time_s for r in exact), rel=5e-3) and e == pytest.approx(sum(r.energy_j for r in exact), rel=5e-3)
    assert price.run(works, 900)[1] < price.run(works, 1980)[1]  # a memory-bound decode step: less energy at a lower clock
    # Context sums within 0.5 % share one cached price.
    assert price.works(64, 64, 40_010, 0) == works and price.works(64, 64, 41_000, 0) != works
