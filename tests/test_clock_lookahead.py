"""Controller decisions: look-ahead, arrival ramp, async scheduling, rank agreement, kernel groups."""

import json
import subprocess
import sys

import pytest

from vllm_powersave.clocks import ClockController, DryRunClockBackend
from vllm_powersave.clocks.controller import group_gate
from vllm_powersave.phases import StepInfo
from vllm_powersave.runtime import RegimeFilter
from vllm_powersave.settings import load_settings


def _settings(**kw):
    c = {"min_dwell_ms": 200, "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}}}
    c.update(kw)
    return load_settings({"clocks": c}, env={}).clocks


def _ctl(clock=lambda: 0.0, **kw):
    host_ahead = kw.pop("host_ahead_steps", 0)
    return ClockController(
        DryRunClockBackend(), _settings(**kw), asynchronous=False, clock=clock, watchdog=False, host_ahead_steps=host_ahead
    )


def _step(phase, tokens, reqs=32):
    dec = reqs if phase in ("decode", "mixed") else 0
    return StepInfo(phase, reqs, reqs - dec, dec, tokens - dec, dec, 0, reqs, 1000)


def test_waiting_queue_raises_the_clock_before_the_burst_starts():
    f = RegimeFilter(window_s=0.5, share_max=0.3, burst_tokens=2048, memory_bound_max_tokens=150)
    ctl = _ctl()
    t = 0.0
    for _ in range(100):  # a decode regime
        t += 0.005
        ctl.on_phase(f.phase(_step("decode", 32), t), t)
    assert ctl.target_sm_clock_mhz == 1200
    # A 100-token mixed step on its own is memory-bound (decode clock) ...
    t += 0.005
    assert f.phase(_step("mixed", 132), t, waiting_tokens=0) == "decode"
    # ... but with 16 prompts of 512 tokens waiting, the next steps are a prefill burst: raise now.
    t += 0.005
    ctl.on_phase(f.phase(_step("mixed", 132), t, waiting_tokens=16 * 512), t)
    assert ctl.target_sm_clock_mhz is None and ctl.decisions[-1].sm_clock_mhz is None


def test_idle_gpu_ramps_up_when_a_request_arrives_but_decode_regime_does_not():
    ctl = _ctl()
    ctl.on_phase("idle", 0.0)
    ctl.on_phase("idle", 0.3)
    assert ctl.target_sm_clock_mhz == 345
    ctl.on_arrival(0.31)
    assert ctl.target_sm_clock_mhz is None and [d.phase for d in ctl.decisions][-1] == "arrival"
    for i in range(60):
        ctl.on_phase("decode", 0.32 + i * 0.005)
    assert ctl.target_sm_clock_mhz == 1200
    n = ctl.n_changes
    ctl.on_arrival(0.7)  # arrivals during decode join the running batch: no ramp
    assert ctl.n_changes == n and ctl.target_sm_clock_mhz == 1200
    off = _ctl(lookahead=False)
    off.on_phase("idle", 0.0)
    off.on_phase("idle", 0.3)
    off.on_arrival(0.31)
    assert off.target_sm_clock_mhz == 345


def test_async_scheduling_lowers_one_step_later_and_raises_at_once():
    sync, ahead = _ctl(min_dwell_ms=0), _ctl(min_dwell_ms=0, host_ahead_steps=1)
    for c in (sync, ahead):
        c.on_phase("prefill", 0.0)
        c.on_phase("decode", 0.01)
    # The step the host schedules is not yet running: the prefill before it is still on the GPU.
    assert sync.target_sm_clock_mhz == 1200 and ahead.target_sm_clock_mhz is None
    ahead.on_phase("decode", 0.02)
    assert ahead.target_sm_clock_mhz == 1200
    ahead.on_phase("prefill", 0.03)
    assert ahead.target_sm_clock_mhz is None  # raising is never delayed


def test_ranks_with_different_local_clocks_take_identical_decisions():
    """Each rank's own clock differs (start skew, jitter); the scheduler stamp they all receive is one."""
    import random

    rng = random.Random(4)
    phases = []
    while len(phases) < 3000:  # decode runs between bursts of compute-bound steps
        phases += ["decode"] * rng.randint(20, 300) + [rng.choice(["prefill", "mixed"]) for _ in range(rng.randint(5, 60))]
    stamps = [i * 0.004 for i in range(len(phases))]
    streams = []
    for skew in (0.0, 0.0031):
        local = {"t": 0.0}
        f = RegimeFilter(0.5, 0.3, 2048, 150)
        ctl = _ctl(clock=lambda: local["t"])
        for ph, t in zip(phases, stamps):
            local["t"] = t + skew + rng.uniform(0, 0.002)  # what this rank's own clock says
            info = _step(ph, 32 if ph == "decode" else 600)
            ctl.on_phase(f.phase(info, t), t)
        streams.append([(d.t_monotonic_s, d.phase, d.sm_clock_mhz) for d in ctl.decisions])
    assert len(streams[0]) >= 8 and streams[0] == streams[1]


def test_group_presets_gated_by_measured_duration_versus_switch_latency():
    s = _settings(
        presets={
            "prefill": {
                "groups": {
                    "lm_head": {"sm_clock_mhz": 1200, "duration_ms": 50.9},
                    "attention": {"sm_clock_mhz": 1500, "duration_ms": 0.7},
                    "sampling": {"sm_clock_mhz": 990},
                }
            }
        },
        switch_latency_ms=6.0,
        group_min_switch_multiple=5.0,
    )
    active, ignored = group_gate(s)
    assert {ph: sorted(g) for ph, g in active.items()} == {"prefill": ["lm_head"]}
    assert active["prefill"]["lm_head"].sm_clock_mhz == 1200
    assert sorted(line.split(":")[0] for line in ignored) == [
        "clocks.presets.prefill.groups.attention",
        "clocks.presets.prefill.groups.sampling",
    ]
    assert "0.7 ms < 5 x switch latency 6 ms" in " ".join(ignored) and "no measured duration_ms" in " ".join(ignored)
    # With the default multiple (10 x 6 ms = 60 ms) even the 50.9 ms LM head is ignored.
    assert group_gate(_settings(presets=s.model_dump()["presets"]))[0] == {}

    ctl = ClockController(DryRunClockBackend(), s, asynchronous=False, watchdog=False)
    ctl.on_phase("prefill", 0.0)
    ctl.on_group("attention", 0.001)  # ignored group: nothing happens
    ctl.on_group("lm_head", 0.01)
    assert ctl.target_sm_clock_mhz == 1200
    ctl.end_group(0.07)
    assert ctl.target_sm_clock_mhz is None
    ctl.on_phase("decode", 0.08)
    ctl.on_group("lm_head", 0.09)  # no lm_head preset in decode
    assert [(d.phase, d.sm_clock_mhz) for d in ctl.decisions] == [("prefill/lm_head", 1200), ("prefill", None)]


def test_group_duration_must_be_positive():
    from vllm_powersave.settings import SettingsError

    with pytest.raises(SettingsError, match=r"clocks.presets.prefill.groups.mlp.duration_ms' = -1"):
        _settings(presets={"prefill": {"groups": {"mlp": {"sm_clock_mhz": 1200, "duration_ms": -1}}}})
    with pytest.raises(SettingsError, match=r"clocks.presets.prefill.groups.softmax"):
        _settings(presets={"prefill": {"groups": {"softmax": {"sm_clock_mhz": 1200}}}})


PROBE = r"""
import json, pickle
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.output import SchedulerOutput
# Stand-ins for the real methods (which need a whole engine); our wrappers go around them.
Scheduler.schedule = lambda self, *a, **k: SchedulerOutput.make_empty()
Scheduler.add_request = lambda self, request: self.waiting.append(request)
from vllm_powersave import vllm_compat
arrivals = []
assert vllm_compat.install_scheduler_hooks(arrivals.append)
class Req:
    def __init__(self, p, c): self.num_prompt_tokens, self.num_computed_tokens = p, c
class Sched: pass
s = Sched(); s.waiting = []
for p, c in [(512, 0), (2048, 1024)] + [(10, 0)] * 100:
    Scheduler.add_request(s, Req(p, c))
out = pickle.loads(pickle.dumps(Scheduler.schedule(s)))   # the broadcast to the workers pickles it
t, n, tokens = vllm_compat.step_lookahead(out)
print(json.dumps({"arrivals": arrivals[:3], "n": n, "tokens": tokens, "t": t > 0}))
"""


def test_scheduler_hooks_stamp_lookahead_that_survives_the_broadcast():
    pytest.importorskip("vllm")
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # 102 waiting; tokens summed over the first 64: 512 + 1024 + 62 * 10.
    assert r == {"arrivals": [512, 2048, 10], "n": 102, "tokens": 512 + 1024 + 620, "t": True}


def test_lm_head_group_switches_around_the_lm_head_hook(monkeypatch):
    """The runtime's LM-head hook applies an lm_head group preset that passed the gate, and back."""
    import torch

    from vllm_powersave import runtime

    s = _settings(presets={"prefill": {"groups": {"lm_head": {"sm_clock_mhz": 900, "duration_ms": 70}}}})
    backend = DryRunClockBackend()
    ctl = ClockController(backend, s, asynchronous=False, watchdog=False)
    saved = runtime.process_runtime()
    runtime.install_runtime(type("RT", (), {"clocks": ctl, "head_groups": True})())
    try:
        ctl.on_phase("decode", 0.0)
        out = runtime.chunked_head(lambda h: h * 2, torch.ones(3, 4))
        assert torch.equal(out, torch.full((3, 4), 2.0)) and list(backend.calls) == []  # no lm_head preset in decode
        ctl.on_phase("prefill", 0.1)
        runtime.chunked_head(lambda h: h * 2, torch.ones(3, 4))
    finally:
        runtime.install_runtime(saved)
    assert [(d.phase, d.sm_clock_mhz) for d in ctl.decisions] == [("prefill/lm_head", 900), ("prefill", None)]
    assert list(backend.calls) == [("set", 900, None), ("reset", None, None)]


def test_group_switch_waits_for_the_gpu_to_reach_the_group():
    import threading

    s = _settings(presets={"prefill": {"groups": {"lm_head": {"sm_clock_mhz": 900, "duration_ms": 70}}}})
    backend = DryRunClockBackend()
    ctl = ClockController(backend, s, asynchronous=True, watchdog=False)
    gpu_there = threading.Event()
    ctl.on_phase("prefill", 0.0)
    ctl.on_group("lm_head", 0.01, ready=gpu_there.wait)
    assert ctl.target_sm_clock_mhz == 900  # decided at once on the host ...
    assert not gpu_there.wait(0.05) and list(backend.calls) == []  # ... applied only once the GPU is there
    gpu_there.set()
    import time

    for _ in range(500):
        if list(backend.calls):
            break
        time.sleep(0.01)
    assert list(backend.calls) == [("set", 900, None)]
    ctl.close()


def test_ranks_agree_across_idle_gaps_seen_differently_by_their_own_timers(monkeypatch, tmp_path):
    """Rank 0's own timer sees every gap as idle (its publisher moves it to the idle preset), rank
    1's sees none: the next step reconciles both from the scheduler stamps, so every step's
    decision is the same on both ranks, for short gaps (back to the pre-idle state) and long ones
    (both continue from idle)."""
    import random
    from types import SimpleNamespace

    from vllm_powersave import runtime as rt_mod
    from vllm_powersave import vllm_compat
    from vllm_powersave.settings import PowersaveSettings

    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": r.rank, "device_type": "cpu", "device_index": None})
    settings = PowersaveSettings.model_validate(
        {
            "energy": {"meter": "off", "idle_after_s": 0.25},
            "clocks": {
                "backend": "dry-run",
                "min_dwell_ms": 1500,
                "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}},
            },
        }
    )
    ranks = [
        rt_mod.WorkerRuntime(SimpleNamespace(rank=r, scheduler_config=SimpleNamespace(max_num_seqs=8, async_scheduling=False)), settings)
        for r in (0, 1)
    ]
    rng = random.Random(7)
    t, streams = 0.0, [[], []]
    try:
        for burst in range(40):
            gap = rng.choice([0.01, 0.02, 0.4, 0.7, 3.0])  # no idle, short idle on one timer, long idle
            t += gap
            for r, rt in enumerate(ranks):
                if r == 0 and gap >= 0.25:  # only rank 0's publisher noticed (twice: dwell passes)
                    rt.clocks.idle_begin(t - gap + 0.26)
                    rt.clocks.idle_begin(t - gap + 0.26 + 1.6)
            resume = rng.random() < 0.5  # a slow step or client: decode continues after the gap
            for i in range(rng.randint(3, 60)):
                phase = "prefill" if i == 0 and not resume else "decode"
                reqs = {"a": 300} if phase == "prefill" else {"a": 1, "b": 1}
                out = SimpleNamespace(
                    scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=0)] if phase == "prefill" else [],
                    scheduled_cached_reqs=SimpleNamespace(
                        req_ids=[] if phase == "prefill" else ["a", "b"], num_computed_tokens=[10, 10], num_output_tokens=[1, 1]
                    ),
                    num_scheduled_tokens=reqs,
                    total_num_scheduled_tokens=sum(reqs.values()),
                    scheduled_spec_decode_tokens={},
                    finished_req_ids=set(),
                )
                setattr(out, vllm_compat.LOOKAHEAD_ATTR, (t, 0, 0))
                for r, rt in enumerate(ranks):
                    rt.on_step_start(out)
                    streams[r].append(rt.clocks.target_sm_clock_mhz)
                    rt.on_step_end()
                t += 0.01
    finally:
        for rt in ranks:
            rt.close()
    assert len(streams[0]) > 200 and streams[0] == streams[1]
    assert {345, 1200} <= set(streams[0]) or {None, 1200} <= set(streams[0])
