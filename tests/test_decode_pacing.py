"""Decode pacing (pacing/pacer.py): decode-only steps spaced to a TPOT target while nothing waits;
arrivals and prefills never held; the busy-loop hook on vLLM's own EngineCoreProc."""

import logging
import queue
import types

import pytest

from vllm_powersave.pacing import DecodePacer, PaceFacts
from vllm_powersave.pacing.pacer import CHECK_AFTER_S, HoldTally
from vllm_powersave.settings import PowersaveSettings, SettingsError, load_settings

DECODE = PaceFacts(running=8, waiting=0, max_running=256, prefill_pending=False)


class FakeTime:
    """A clock that only moves when the pacer sleeps (and when a test says so)."""

    def __init__(self):
        self.now = 100.0
        self.slept = []

    def clock(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


def _pacer(ms=30.0):
    t = FakeTime()
    return DecodePacer(ms, clock=t.clock, sleep=t.sleep), t


def test_a_decode_step_is_held_until_the_tpot_target_since_the_last_step():
    p, t = _pacer(30.0)
    assert p.hold(DECODE, lambda: True) == 0.0  # the first step after start goes at once
    t.now += 0.008  # the step took 8 ms
    held = p.hold(DECODE, lambda: True)
    assert held == pytest.approx(0.022)
    assert p.stats.held_steps == 1 and p.stats.held_s == pytest.approx(0.022)
    t.now += 0.040  # a step longer than the target: no gap after it
    assert p.hold(DECODE, lambda: True) == 0.0


@pytest.mark.parametrize(
    "facts",
    [
        PaceFacts(running=8, waiting=1, max_running=256, prefill_pending=False),
        PaceFacts(running=8, waiting=0, max_running=256, prefill_pending=True),
        PaceFacts(running=256, waiting=0, max_running=256, prefill_pending=False),
        PaceFacts(running=0, waiting=0, max_running=256, prefill_pending=False),
    ],
    ids=["a-request-waits", "a-prefill-is-pending", "the-batch-is-full", "nothing-runs"],
)
def test_no_step_is_held_while_pacing_cannot_grow_the_batch_or_would_delay_a_prefill(facts):
    p, t = _pacer(30.0)
    p.hold(DECODE, lambda: True)
    t.now += 0.005
    assert p.hold(facts, lambda: True) == 0.0
    assert t.slept == [] and p.stats.held_steps == 0


def test_an_arriving_request_ends_the_gap_within_one_poll():
    p, t = _pacer(100.0)
    p.hold(DECODE, lambda: True)
    t.now += 0.005
    polls = iter([True, True, True, False])  # the queue gets a request on the fourth look
    held = p.hold(DECODE, lambda: next(polls))
    assert held == pytest.approx(2 * 0.0005)  # two polls slept, then woken: not the 95 ms due
    assert p.stats.woken_early == 1


def test_a_request_already_queued_is_never_held():
    p, t = _pacer(100.0)
    p.hold(DECODE, lambda: True)
    t.now += 0.005
    assert p.hold(DECODE, lambda: False) == 0.0 and t.slept == []


def test_the_first_step_after_an_idle_spell_goes_at_once():
    p, t = _pacer(30.0)
    p.hold(DECODE, lambda: True)
    t.now += 0.005
    p.hold(PaceFacts(0, 0, 256, False), lambda: True)  # the batch drained: the engine idles
    t.now += 0.001
    assert p.hold(DECODE, lambda: True) == 0.0


def test_tpot_target_is_bounded_and_savings_off_refuses_it():
    assert PowersaveSettings().decode_pacing.tpot_target_ms is None  # off by default
    with pytest.raises(SettingsError, match="decode_pacing.tpot_target_ms"):
        load_settings({"decode_pacing": {"tpot_target_ms": 0}})
    for bad in (True, "fast", 0.01):  # strict: no booleans or words read as numbers; 0.1 ms at least
        with pytest.raises(SettingsError, match="decode_pacing.tpot_target_ms"):
            load_settings({"decode_pacing": {"tpot_target_ms": bad}})
    # vLLM's dotted --additional-config.powersave.decode_pacing.tpot_target_ms form may pass text.
    assert load_settings({"decode_pacing": {"tpot_target_ms": "50"}}).decode_pacing.tpot_target_ms == 50.0
    with pytest.raises(SettingsError, match="decode_pacing.tpot_target_ms.*savings 'off'"):
        load_settings({"savings": "off", "decode_pacing": {"tpot_target_ms": 30}})
    with pytest.raises(ValueError):
        DecodePacer(0.0)


def test_the_start_line_names_decode_pacing_and_its_basis():
    from vllm_powersave.savings import savings_state, start_line

    choice = types.SimpleNamespace(controller="off", backend="dry-run", reason="clocks off")
    on = PowersaveSettings.model_validate({"decode_pacing": {"tpot_target_ms": 35}})
    state = savings_state(on, choice, None, on_gpu=False)
    assert state["decode_pacing"] == {"state": "on", "basis": "predicted", "why": "decode steps spaced to 35 ms"}
    assert "decode pacing on (decode steps spaced to 35 ms)" in start_line(state)
    lost = savings_state(on, choice, None, on_gpu=False, lost={"pacing": "gone"})
    assert lost["decode_pacing"]["state"] == "off" and "gone" in lost["decode_pacing"]["why"]
    assert savings_state(PowersaveSettings(), choice, None, on_gpu=False)["decode_pacing"]["state"] == "off"


# -- the hook on vLLM's own busy loop ---------------------------------------------------------
vllm_core = pytest.importorskip("vllm.v1.engine.core")


class _Req:
    """A running request as the scheduler holds it: decoding unless ``computed`` says otherwise."""

    def __init__(self, prompt, out=4, computed=None):
        self.num_prompt_tokens, self.num_output_tokens = prompt, out
        self.num_tokens = prompt + out
        self.num_computed_tokens = self.num_tokens - 1 if computed is None else computed


def _core(running, waiting=(), inputs=()):
    """A stand-in engine core: vLLM's real ``_process_input_queue`` runs on it."""
    q = queue.Queue()
    for item in inputs:
        q.put(item)
    handled = []
    core = types.SimpleNamespace(
        scheduler=types.SimpleNamespace(running=list(running), waiting=list(waiting), max_num_running_reqs=256),
        input_queue=q,
        aborts_queue=queue.Queue(),
        process_input_queue_block=True,
        has_work=lambda: True,
        is_running=lambda: True,
        _notify_idle_state_callbacks=lambda: None,
        _handle_client_request=lambda *req: handled.append(req),
    )
    return core, handled


@pytest.fixture
def hooked(monkeypatch):
    from vllm_powersave import vllm_compat

    monkeypatch.setattr(vllm_compat, "_PATCHED", set())
    monkeypatch.setattr(vllm_compat, "_INSTALLED", set())
    monkeypatch.setattr(vllm_compat, "_PACER", [])
    monkeypatch.setattr(vllm_core.EngineCoreProc, "_process_input_queue", vllm_core.EngineCoreProc._process_input_queue)
    p, t = _pacer(30.0)
    assert vllm_compat.install_pacing_hook(p)
    return p, t, vllm_core.EngineCoreProc._process_input_queue


def test_the_hook_holds_vllms_loop_then_runs_it_and_reads_the_schedulers_state(hooked):
    p, t, loop = hooked
    core, _ = _core([_Req(100), _Req(50)])
    loop(core)
    t.now += 0.004
    loop(core)
    assert p.stats.held_steps == 1 and p.stats.held_s == pytest.approx(0.026)
    arrived, handled = _core([_Req(100)], inputs=[("ADD", "req-1")])
    t.now += 0.004
    loop(arrived)
    assert p.stats.held_steps == 1 and handled == [("ADD", "req-1")]  # vLLM's loop took it at once
    assert tuple(p.figures()) == (30.0, 1, pytest.approx(0.026), 0, None, False, 0, 0, 0, False)


@pytest.mark.parametrize(
    "newcomer",
    [
        _Req(4000, out=0, computed=2048),  # a chunked prefill half done
        _Req(100, out=0, computed=100),  # prefilled, its first token not collected yet (async scheduling)
        _Req(100, out=30, computed=64),  # preempted, recomputing prompt and output in chunks
    ],
    ids=["chunked-prefill", "first-token-under-async-scheduling", "preempted-recompute"],
)
def test_a_step_that_still_owes_a_request_its_prefill_or_first_token_is_never_held(hooked, newcomer):
    p, t, loop = hooked
    core, _ = _core([_Req(100), newcomer])
    loop(core)
    t.now += 0.004
    loop(core)
    assert p.stats.held_steps == 0


def test_with_a_queue_or_a_full_batch_the_requests_are_not_even_read(hooked):
    p, t, loop = hooked
    queued, handled = _core([object(), object()], waiting=[object()], inputs=[("ADD", "x")])  # no request fields at all
    loop(queued)
    t.now += 0.004
    loop(queued)
    assert p.stats.held_steps == 0 and p.off_reason is None and handled == [("ADD", "x")]


def test_a_scheduler_that_drifted_turns_pacing_off_with_one_warning_and_the_loop_runs_on(hooked, caplog):
    from vllm_powersave import vllm_compat

    p, t, loop = hooked
    broken, handled = _core([_Req(100)], inputs=[("ADD", "a")])
    del broken.scheduler.max_num_running_reqs  # a scheduler that drifted
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        loop(broken)
        broken.input_queue.put(("ADD", "b"))
        loop(broken)
    assert handled == [("ADD", "a"), ("ADD", "b")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "decode pacing" in warnings[0] and "max_num_running_reqs" in warnings[0]
    assert "pacing" in vllm_compat.disabled_features() and p.off_reason.startswith("vLLM's scheduler drifted")
    good, _ = _core([_Req(100)])
    loop(good)
    t.now += 0.004
    loop(good)
    assert p.stats.held_steps == 0  # off for good
    assert vllm_compat._PACER == [p] and p.figures().off_reason == p.off_reason  # the reason rides on the steps


def test_a_pacer_fault_turns_it_off_with_one_traceback(hooked, caplog, monkeypatch):
    p, t, loop = hooked
    monkeypatch.setattr(p, "gap_s", lambda now, facts: 1 / 0)
    core, _ = _core([_Req(100)])
    with caplog.at_level(logging.ERROR, logger="vllm.powersave"):
        loop(core)
        loop(core)
    assert sum("decode pacing" in r.getMessage() for r in caplog.records) == 1
    assert p.off_reason == "fault (ZeroDivisionError)"


def test_a_pacer_that_turned_off_shows_failed_in_the_savings_state():
    from vllm_powersave.savings import savings_state

    choice = types.SimpleNamespace(controller="off", backend="dry-run", reason="clocks off")
    on = PowersaveSettings.model_validate({"decode_pacing": {"tpot_target_ms": 35}})
    state = savings_state(on, choice, None, on_gpu=False, pacing_off="fault (ZeroDivisionError)")
    assert state["decode_pacing"] == {"state": "failed", "basis": "", "why": "fault (ZeroDivisionError): decode steps unspaced"}


# --- closed-loop clients (pacer.ClosedLoopGuard) ---------------------------------------------------


def _drive(p, t, arrivals, step_s=0.007, steps=400):
    """Steps of a batch of 8 at a 30 ms target; ``arrivals(i)``: (a request finished before step
    i's hold, seconds into the hold when a new one arrives, or None for none)."""
    load = 8
    p.hold(PaceFacts(load, 0, 256, False), lambda: True)
    p.after_intake(load)
    for i in range(steps):
        t.now += step_s
        finished, after_s = arrivals(i)
        load -= 1 if finished and load > 2 else 0  # a finished request leaves before the next hold
        start = t.now
        p.hold(PaceFacts(load, 0, 256, False), lambda: after_s is None or t.now - start < after_s)
        load += 1 if after_s is not None else 0  # an arrival joins after the hold it cut short
        p.after_intake(load)


def _closed_loop(i):
    return (i % 3 == 0, 0.004) if i % 3 == 0 else (False, None)  # 4 ms after each end, never else


def test_clients_whose_round_trip_outlasts_the_gap_pause_pacing_from_the_next_loops_intake():
    # Each client's next request lands during the step after the finish: it is in the queue when
    # the next loop starts (no hold there), so no hold is ever cut short by it.
    p, t = _pacer(30.0)
    load, pending = 8, False
    p.hold(PaceFacts(load, 0, 256, False), lambda: True)
    p.after_intake(load)
    for i in range(600):
        t.now += 0.007
        finished = i % 3 == 0 and load > 2
        load -= finished
        queued = pending
        p.hold(PaceFacts(load, 0, 256, False), lambda: not queued)
        load += queued
        p.after_intake(load)
        pending = finished
        if p.guard.pauses:
            break
    assert p.stats.woken_early == 0 and p.guard.pauses == 1
    assert "1 loop(s) after a held step that followed a finished request" in p.guard.take_notice()


def test_arrivals_one_round_trip_after_each_finished_request_pause_pacing_and_it_looks_again_later():
    from vllm_powersave.pacing.pacer import PAUSE_S

    p, t = _pacer(30.0)
    _drive(p, t, _closed_loop)
    assert p.guard.pauses == 1 and p.figures().paused and p.figures().closed_loop_pauses == 1
    notice = p.guard.take_notice()
    assert "paused for 30 s" in notice and "holds after a finished request" in notice
    assert p.guard.take_notice() is None  # said once per pause
    held = p.stats.held_steps
    t.now += 1.0
    p.hold(DECODE, lambda: True)
    assert p.stats.held_steps == held  # paused: no hold
    t.now += PAUSE_S[0]
    assert not p.figures().paused  # the pause ran out, whether or not a loop has looked since
    p.hold(DECODE, lambda: True)  # pacing again, the loop judged afresh
    t.now += 0.007
    p.hold(DECODE, lambda: True)
    assert p.stats.held_steps == held + 1 and not p.figures().paused
    _drive(p, t, _closed_loop)
    assert p.guard.pauses == 2 and "paused for 60 s" in p.guard.take_notice()  # the loop persists: twice as long


@pytest.mark.parametrize("finish_every", [1, 3])
@pytest.mark.parametrize("rate", [8.0, 50.0, 150.0])
def test_open_loop_poisson_arrivals_never_pause_pacing(finish_every, rate):
    import random

    rng = random.Random(7)
    p, t = _pacer(30.0)
    # Poisson: the first arrival after a hold starts is exponential (early in the gap at high rates);
    # requests finish at every step or every third, independently of the arrivals (as many of them).
    # Arrivals tied to loops speed up with them, as a closed loop's do: the holds' verdict alone is
    # judged, before the first scheduled check (CHECK_AFTER_S; checks: test_scheduled_check_*).
    _drive(p, t, lambda i: (i % finish_every == 0, rng.expovariate(rate) if rng.random() < 1 / finish_every else None), steps=1900)
    assert t.now - 100.0 < CHECK_AFTER_S[0] and p.guard.checks == 0
    assert p.stats.woken_early > 100 and p.guard.pauses == 0 and not p.figures().paused


def test_a_few_clients_in_a_closed_loop_pause_pacing_after_a_few_finishes_if_every_one_saw_an_arrival():
    from vllm_powersave.pacing.pacer import EARLY_HOLDS, FINISHED_HOLDS

    # 4 clients at 35 ms finish a request every ~2.4 s: 32 finishes took 76 s on the simulated H200,
    # 8 took 11-19 s; the verdict comes within the first 5 finishes (docs/decode-pacing.md).
    assert EARLY_HOLDS < FINISHED_HOLDS
    p, t = _pacer(30.0)
    _drive(p, t, lambda i: (i % 10 == 0, 0.004) if i % 10 == 0 else (False, None), steps=45)
    assert p.guard.pauses == 1 and f"requests arrived {EARLY_HOLDS} of {EARLY_HOLDS} times" in p.guard.take_notice()
    # One of the first finishes without a client behind it: no early verdict, the count goes on to 32.
    p, t = _pacer(30.0)
    miss = 10 * (EARLY_HOLDS - 2)
    _drive(p, t, lambda i: (i % 10 == 0, 0.004 if i != miss else None) if i % 10 == 0 else (False, None), steps=85)
    assert p.guard.pauses == 0 and p.guard.tally(0)[0] == HoldTally(holds=9, woken=8)


def _constant_rate_open_loop(p, t, seconds, period_s=0.1):
    """Open-loop arrivals every ``period_s`` whatever the engine does; with fixed lengths the request
    before each one finishes 20 ms earlier, so finishes sit at a fixed phase before arrivals."""
    load, end, next_s, finished_for = 8, t.now + seconds, t.now + period_s, None
    p.hold(PaceFacts(load, 0, 256, False), lambda: True)
    p.after_intake(load)
    while t.now < end:
        t.now += 0.007
        if t.now >= next_s - 0.02 and finished_for != next_s:
            load, finished_for = load - 1, next_s
        p.hold(PaceFacts(load, 0, 256, False), lambda: t.now < next_s)
        if t.now >= next_s:
            load, next_s = load + 1, next_s + period_s
        p.after_intake(load)


def test_open_loop_arrivals_whose_finishes_line_up_with_them_get_their_pause_withdrawn():
    from vllm_powersave.pacing.pacer import HOLDOFF_S, PROBE_S

    p, t = _pacer(30.0)
    _constant_rate_open_loop(p, t, seconds=20.0)
    assert p.guard.pauses == 1 and p.guard.withdrawn == 1  # paused, then withdrawn; held off since
    first, again = p.guard.take_notice(), p.guard.take_notice()  # the withdrawal's line replaced the pause's
    assert again is None and "did not speed up while paused" in first and "against 10.00 paced" in first
    assert f"resumed {PROBE_S:.0f} s into its 30 s pause" in first and f"not judged again for {HOLDOFF_S[0]:.0f} s" in first
    assert not p.figures().paused and p.figures().pauses_withdrawn == 1
    held = p.stats.held_steps
    _constant_rate_open_loop(p, t, seconds=1.0)
    assert p.stats.held_steps > held + 20  # pacing again
    _constant_rate_open_loop(p, t, seconds=40.0)  # the hold-off ran out: judged again, paused, withdrawn
    assert p.guard.pauses == 2 and p.guard.withdrawn == 2
    assert "not judged again for 60 s" in p.guard.take_notice()


def test_a_closed_loop_pause_stands_once_its_probe_sees_arrivals_speed_up():
    p, t = _pacer(30.0)
    _drive(p, t, _closed_loop, steps=1200)  # the loop goes on while paused: unheld steps every 7 ms
    assert p.guard.pauses == 1 and p.guard.withdrawn == 0
    assert p.guard.probe is None and p.figures().paused  # decided: it stands
    assert "paused for 30 s" in p.guard.take_notice()


def _paced(g, t0_s, seconds, per_s):
    """Guard-level traffic: a quiet hold and one arrival every 1/per_s s from t0_s; returns the end."""
    n = int(seconds * per_s)
    for i in range(n):
        g.observe_hold(False, False, t0_s + i / per_s)
        g.observe_arrivals(1, t0_s + i / per_s)
    return t0_s + n / per_s


def _signature(g, now_s):
    """The closed-loop signature, all at ``now_s``: 32 quiet holds after none, 32 woken after a finish."""
    from vllm_powersave.pacing.pacer import CONTROL_HOLDS, FINISHED_HOLDS

    for _ in range(CONTROL_HOLDS):
        g.observe_hold(False, False, now_s)
    pauses = g.pauses
    for _ in range(FINISHED_HOLDS):  # no hold runs once paused
        if g.pauses == pauses:
            g.observe_hold(True, True, now_s)


def test_a_probe_ends_with_its_pause_when_too_few_arrivals_came_in_it():
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    end = _paced(g, 0.0, 6.0, 10.0)
    _signature(g, end)
    assert g.pauses == 1 and g.probe is not None
    g.observe_arrivals(1, end + 1.0)
    for i in range(10):  # the engine sat idle past the pause's end; then new traffic
        g.observe_arrivals(1, end + 41.0 + 0.01 * i)
    assert g.probe is None and g.withdrawn == 0 and "resumed" not in (g.take_notice() or "")


def test_an_idle_engine_in_a_pause_leaves_the_pause_standing_untested():
    p, t = _pacer(30.0)
    end = _paced(p.guard, t.now, 6.0, 10.0)
    t.now = end
    _signature(p.guard, end)
    assert p.guard.probe is not None
    p.hold(PaceFacts(0, 0, 256, False), lambda: True)  # the batch drained: vLLM's intake blocks
    t.now += 2.0
    p.after_intake(0, 1)  # the next request, 2 s later
    assert p.guard.probe is None and p.figures().paused and p.guard.withdrawn == 0


def test_an_arrival_taken_with_an_abort_in_one_intake_is_still_an_arrival():
    p, t = _pacer(30.0)
    p.hold(DECODE, lambda: True)
    p.after_intake(8, 0)
    t.now += 0.007
    p.hold(DECODE, lambda: False)  # queued: a stop string's abort and a client's next request
    p.after_intake(7, 1)  # one request left the running queue, one joined the waiting queue
    assert list(p.guard.arrivals_s) == [t.now]
    t.now += 0.007
    p.hold(PaceFacts(7, 1, 256, False), lambda: True)
    assert p._after_finish  # the abort still counts as a finish for the next hold


def test_requests_that_come_in_groups_read_their_true_rate():
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    for k in range(4):  # ten at once every 1.5 s: 6.67 req/s
        g.observe_arrivals(10, 1.5 * k)
    assert g._rate_since(0.0) == (40, pytest.approx(30 / 4.5))
    assert g._rate_since(1.0)[1] == pytest.approx(20 / 3.0)


def test_a_pause_soon_after_a_pause_ran_out_stands_untested_and_a_later_one_is_probed_once_settled():
    from vllm_powersave.pacing import ClosedLoopGuard
    from vllm_powersave.pacing.pacer import PACED_WINDOW_S, PAUSE_S

    g = ClosedLoopGuard()
    end = _paced(g, 0.0, 6.0, 10.0)
    _signature(g, end)
    g.probe = None  # say the probe saw the loop speed up: the pause stands
    resumed = end + PAUSE_S[0]
    assert not g.paused(resumed)  # it ran out; pacing resumes, a closed loop's rate still settling
    end = _paced(g, resumed, 3.0, 10.0)
    _signature(g, end)
    assert g.pauses == 2 and g.probe is None  # 3 s after: no settled window, untested
    g.paused_until = None  # (as if that pause ran out too, at once)
    g.resumed_s = end
    end = _paced(g, end, 8.0, 10.0)
    _signature(g, end)
    assert g.pauses == 3 and g.probe is not None
    assert g.probe.paced_per_s == pytest.approx(10.0)  # read over the window from 5 s after resuming
    assert end - (g.resumed_s or 0.0) >= PACED_WINDOW_S


def test_a_light_loads_short_idle_gaps_do_not_cancel_a_probe_but_a_long_idle_does():
    p, t = _pacer(30.0)
    end = _paced(p.guard, t.now, 6.0, 10.0)
    t.now = end
    _signature(p.guard, end)
    p.hold(PaceFacts(0, 0, 256, False), lambda: True)
    t.now += 0.3  # a gap between a light load's requests
    p.after_intake(0, 1)
    assert p.guard.probe is not None
    p.hold(PaceFacts(0, 0, 256, False), lambda: True)
    t.now += 5.0  # between two runs
    p.after_intake(0, 1)
    assert p.guard.probe is None and p.figures().paused


def test_traffic_switching_between_open_loop_rates_it_has_probed_keeps_its_hold_off():
    p, t = _pacer(30.0)
    _constant_rate_open_loop(p, t, seconds=20.0)  # 10 req/s: paused, withdrawn
    _constant_rate_open_loop(p, t, seconds=45.0, period_s=0.05)  # 20 req/s: hold-off ended, paused, withdrawn
    assert p.guard.withdrawn == 2 and p.guard.holdoff_until_s is not None
    _constant_rate_open_loop(p, t, seconds=7.0)  # back to 10 req/s: an open loop it has seen
    assert p.guard.holdoff_until_s is not None


def test_requests_whose_kv_a_connector_holds_count_as_waiting():
    from vllm_powersave import vllm_compat

    sched = types.SimpleNamespace(running=[object()], waiting=[], kv_holding_waiting=[object()], max_num_running_reqs=256)
    assert vllm_compat.pace_facts(sched).waiting == 1  # vLLM 0.32: a ready request, no hold
    del sched.kv_holding_waiting  # vLLM 0.25 has no such queue
    assert vllm_compat.waiting_requests(sched) == 0


def test_a_hold_off_ends_when_the_arrival_rate_moves():
    p, t = _pacer(30.0)
    _constant_rate_open_loop(p, t, seconds=20.0)
    assert p.guard.withdrawn == 1 and p.guard.holdoff_until_s is not None
    _constant_rate_open_loop(p, t, seconds=7.0)  # the same open loop: the hold-off runs on
    assert p.guard.holdoff_until_s is not None
    _constant_rate_open_loop(p, t, seconds=7.0, period_s=0.05)  # twice the rate: new traffic
    # The hold-off ended 5 s in, and the new traffic was judged at once: paused, probed over its own
    # rate only (not the 10 req/s before the shift), withdrawn.
    assert p.guard.pauses == 2 and p.guard.withdrawn == 2
    assert list(p.guard.open_rates_per_s) == [pytest.approx(10.0, rel=0.01), pytest.approx(20.0, rel=0.01)]


def test_a_hold_cut_short_by_an_abort_is_no_arrival_and_the_abort_counts_as_a_finish():
    p, t = _pacer(30.0)
    p.hold(DECODE, lambda: True)
    p.after_intake(8)
    t.now += 0.007
    start = t.now
    p.hold(DECODE, lambda: t.now - start < 0.001)  # a stop string's abort lands 1 ms in
    p.after_intake(7)  # the loop took it: one request fewer
    assert p.guard.tally(0) == (HoldTally(), HoldTally())
    t.now += 0.007
    start = t.now
    p.hold(PaceFacts(7, 0, 256, False), lambda: t.now - start < 0.004)  # the client's next request
    p.after_intake(8)
    assert p.guard.tally(0)[0] == HoldTally(holds=1, woken=1)  # after a finish (the abort), woken


def test_a_pacer_turned_off_during_a_pause_does_not_read_paused():
    p, t = _pacer(30.0)
    _drive(p, t, _closed_loop)
    assert p.figures().paused
    p.turn_off("fault (ZeroDivisionError)")
    assert not p.figures().paused


def test_the_hook_logs_a_pause_once(hooked, caplog):
    p, t, loop = hooked
    _signature(p.guard, t.now)
    core, _ = _core([_Req(100)])
    with caplog.at_level(logging.INFO):
        loop(core)
        loop(core)
    assert sum("decode pacing paused for 30 s" in r.getMessage() for r in caplog.records) == 1


def test_an_arrival_after_an_idle_spell_is_no_arrival_loops_after_the_last_held_step():
    # Open loop: every 3 s two requests, the second one loop behind, 64 tokens each. The second ends
    # one step after the first, in a held loop after a finish; then the engine drains and vLLM's
    # intake blocks (hold at load 0) until the next pair, seconds later.
    p, t = _pacer(20.0)
    for _ in range(40):
        p.hold(PaceFacts(0, 0, 256, False), lambda: True)
        t.now += 3.0  # idle until the next pair
        p.after_intake(1)
        t.now += 0.02
        p.hold(PaceFacts(1, 0, 256, False), lambda: True)
        p.after_intake(2)
        for i in range(64):
            t.now += 0.008
            load = 2 if i < 62 else (1 if i == 62 else 0)
            if load:
                p.hold(PaceFacts(load, 0, 256, False), lambda: True)
                p.after_intake(load)
    assert p.guard.pauses == 0, p.guard.take_notice()


def test_the_simulated_sweeps_report_when_the_guard_first_paused_and_poisson_never_pauses():
    from benchmarks.sim_decode_pacing import SWEEPS, guard_sweep, simulate

    closed = simulate("c16", None, 16, 35.0, 20.0, 1)
    assert closed["closed_loop_pauses"] >= 1 and 0.0 < closed["first_pause_s"] < 20.0
    open_loop = simulate("rate8", 8.0, None, 35.0, 20.0, 1)
    assert open_loop["closed_loop_pauses"] == 0 and open_loop["first_pause_s"] is None
    assert "poisson" in SWEEPS
    sweep = guard_sweep(20.0, 1, "poisson")
    assert (sweep.configs, sweep.paused, sweep.first_pause_s) == (16, 0, None)
    # Open-loop requests in groups of equal ones: whole groups arrive, finish together, never pause.
    grouped = simulate("g16", 1.0, None, 35.0, 20.0, 1, fixed_lengths=(256, 64), group=16)
    assert grouped["requests"] % 16 == 0 and grouped["requests"] > 0 and grouped["closed_loop_pauses"] == 0
    assert "grouped_open_loop" in SWEEPS


def test_one_woken_hold_after_a_group_of_finishes_does_not_pause_pacing():
    # Open-loop requests sent in groups with fixed lengths also finish in groups: a hold after 4
    # finishes that one arrival cuts short is one case, not 4 (counted as 4, bursty open-loop loads
    # paused in 21 of 48 simulated runs, most pauses standing 30-60 s).
    p, t = _pacer(30.0)
    _drive(p, t, lambda i: (False, None), steps=40)  # quiet holds after no finish, at 8: the control
    t.now += 0.007
    load = 8 - 4
    start = t.now
    p.hold(PaceFacts(load, 0, 256, False), lambda: t.now - start < 0.004)
    p.after_intake(load + 1)
    assert p.guard.pauses == 0 and p.guard.tally(0)[0] == HoldTally(holds=1, woken=1)


def _emptying_rounds(p, t, rounds, back_s, load=16, steps=49):
    """Clients that all finish in one step (equal lengths): vLLM runs one empty step, then its
    intake blocks until their next requests, ``back_s`` later; ``steps`` paced steps between rounds."""
    p.hold(PaceFacts(load, 0, 256, False), lambda: True)
    p.after_intake(load)
    for _ in range(rounds):
        for _ in range(steps):
            t.now += 0.007
            p.hold(PaceFacts(load, 0, 256, False), lambda: True)
            p.after_intake(load)
        t.now += 0.007
        p.hold(PaceFacts(0, 0, 256, False), lambda: True)  # finished ids still to send: no block
        p.after_intake(0)
        t.now += 0.001
        p.hold(PaceFacts(0, 0, 256, False), lambda: True)  # the intake blocks
        t.now += back_s
        p.after_intake(0, load)


def test_clients_that_all_finish_together_and_come_back_within_a_gap_pause_pacing():
    # No hold follows such a finish; counted as none, fixed-length clients that finish in one step
    # never paused in simulation (docs/decode-pacing.md).
    from vllm_powersave.pacing.pacer import EARLY_HOLDS

    p, t = _pacer(30.0)
    _emptying_rounds(p, t, EARLY_HOLDS, back_s=0.004)
    assert p.guard.pauses == 1 and f"{EARLY_HOLDS} of {EARLY_HOLDS} times" in p.guard.take_notice()
    # The next requests half a second later (as open-loop traffic that emptied the engine): never
    # woken. Shorter rounds keep this inside the first scheduled check (CHECK_AFTER_S), which would
    # find these loop-tied arrivals speed up unpaced.
    p, t = _pacer(30.0)
    _emptying_rounds(p, t, 40, back_s=0.5, steps=20)
    assert t.now - 100.0 < CHECK_AFTER_S[0] and p.guard.checks == 0
    assert p.guard.pauses == 0 and 0 in p.guard.open_verdicts  # 32 cases, none woken: an open-loop verdict
    # An engine idle past IDLE_RESET_S is not a case at all.
    p, t = _pacer(30.0)
    _emptying_rounds(p, t, 3, back_s=2.0)
    assert p.guard.tally(0)[0] == HoldTally(holds=0, woken=0)
    # Nor is one while pacing is paused (no hold is judged then either).
    p, t = _pacer(30.0)
    p.guard.paused_until = t.now + 100.0
    _emptying_rounds(p, t, 5, back_s=0.004)
    assert p.guard.tally(0)[0] == HoldTally(holds=0, woken=0)


def _round(g, start_s, clients=128, per_step=16, step_s=0.19, until_s=None):
    """One round of a closed loop with equal lengths: its clients come back in groups of
    ``per_step``, one group per chunked-prefill step, from ``start_s`` (those before ``until_s``)."""
    for k in range(clients // per_step):
        at_s = start_s + k * step_s
        if until_s is not None and at_s >= until_s:
            return
        g.observe_arrivals(per_step, at_s)


def test_a_closed_loop_whose_arrivals_come_in_rounds_keeps_its_pause():
    # 128 clients of 512 / 256 tokens: a round every 10 s at 35 ms, every 3 s unpaced, each spread
    # over 1.5 s. Read over 5 s, the paced rate was a round's spread (84 req/s), and the probe
    # withdrew 12 of 14 such pauses (docs/results/sim-decode-pacing.md).
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    g.observe_hold(False, False, 0.0)
    for k in range(3):
        _round(g, 10.0 * k)
    _round(g, 30.0, until_s=30.6)  # the fourth round has begun when the signature is reached
    _signature(g, 30.6)
    assert g.pauses == 1 and g.probe is not None and g.probe.round_s is not None
    assert g.probe.paced_per_s == pytest.approx(128 / 10.0)  # the last whole round
    _round(g, 30.0)  # the rest of that round, then rounds every 3 s while paused
    for k in range(1, 4):
        _round(g, 30.0 + 3.0 * k)
    assert g.withdrawn == 0 and g.probe is None and g.paused(40.0)  # decided: 42.7 req/s, it stands


def test_an_open_loop_in_groups_whose_rate_holds_while_paused_gets_its_pause_withdrawn():
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    g.observe_hold(False, False, 0.0)
    for k in range(6):  # 16 requests every 2 s, spread over 0.57 s: 8 req/s
        _round(g, 2.0 * k, clients=16, per_step=4)
    _signature(g, 10.6)
    assert g.probe is not None and g.probe.round_s is not None and g.probe.paced_per_s == pytest.approx(8.0)
    for k in range(6, 10):  # the same groups while paused
        _round(g, 2.0 * k, clients=16, per_step=4)
    assert g.withdrawn == 1 and not g.paused(19.0) and "did not speed up" in g.take_notice()


def test_rounds_before_an_idle_spell_do_not_shape_how_the_next_traffic_is_read():
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    g.observe_hold(False, False, 0.0)
    for k in range(4):
        _round(g, 10.0 * k)
    g.observe_idle(8.0, 40.0)  # the loop stopped; 8 s later new traffic, 10 req/s at a constant rate
    end = _paced(g, 40.0, 6.0, 10.0)
    assert g._paced_rate(end) == (pytest.approx(10.0, rel=0.02), None)


def test_the_round_rate_matches_a_direct_count_over_any_arrivals():
    # Differential: the one-pass scan against round starts and counts taken the slow way.
    import random

    from vllm_powersave.pacing import ClosedLoopGuard
    from vllm_powersave.pacing.pacer import ROUND_GAP_S

    rng = random.Random(7)
    for _ in range(200):
        g, t = ClosedLoopGuard(), 0.0
        for _ in range(rng.randint(1, 60)):
            t += rng.choice([0.0, 0.01, 0.2, 0.6, 3.0]) * rng.random() * 2
            g.observe_arrivals(rng.randint(1, 3), t)
        times = list(g.arrivals_s)
        start = rng.uniform(-1.0, t)
        starts = [x for i, x in enumerate(times) if x >= start and (i == 0 or x - times[i - 1] > ROUND_GAP_S)]
        n, per_s = g._rate_in_rounds(start)
        if len(starts) < 2:
            assert (n, per_s) == (0, None)
            continue
        direct = sum(1 for x in times if starts[0] <= x < starts[-1])
        assert n == direct and per_s == pytest.approx(direct / (starts[-1] - starts[0]))


def test_a_probe_reads_its_rates_once_per_arrival_not_every_loop(monkeypatch):
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    end = _paced(g, 0.0, 6.0, 10.0)
    _signature(g, end)
    reads = []
    real = g._rate_since
    monkeypatch.setattr(g, "_rate_since", lambda s: reads.append(s) or real(s))
    g.observe_arrivals(1, end + 3.5)  # past PROBE_S: read (too few arrivals yet)
    for i in range(50):  # engine loops that took nothing
        g.observe_arrivals(0, end + 3.5 + 0.01 * i)
    assert len(reads) == 1 and g.probe is not None


def test_a_constant_load_after_a_spell_of_poisson_traffic_is_not_read_in_rounds():
    # Poisson traffic at 2 req/s has silences like rounds; reading a constant load that followed it
    # as rounds left its mistaken pauses untested (an adversarial review: x2.18 -> x1.14 tokens per
    # joule over 600 s simulated).
    import random

    from vllm_powersave.pacing import ClosedLoopGuard

    g, rng, t = ClosedLoopGuard(), random.Random(3), 0.0
    g.observe_hold(False, False, 0.0)
    while t < 40.0:
        t += rng.expovariate(2.0)
        g.observe_arrivals(1, t)
    end = _paced(g, 40.0, 10.0, 16.0)
    _signature(g, end)
    assert g.probe is not None and g.probe.round_s is None
    _paced(g, end, 4.0, 16.0)  # the same rate while paused
    assert g.withdrawn == 1


def test_short_rounds_are_read_over_the_last_seconds_as_any_traffic():
    # Groups of 2 every 0.55 s: a 5 s window holds nine of them; read in rounds, the paced window's
    # two whole rounds held too few arrivals and the pause stood untested (an adversarial review).
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    g.observe_hold(False, False, 0.0)
    for k in range(20):
        g.observe_arrivals(2, 0.55 * k)
    _signature(g, 0.55 * 19)
    assert g.probe is not None and g.probe.round_s is None


def test_short_rounds_read_while_paused_are_read_round_to_round_too():
    # 24 requests every 1.2 s, spread over 0.3 s, the same while paused: read from the first arrival
    # to the middle of a round, the paused rate looked 14-32 % higher and the pause stood (a review:
    # x1.23 -> x1.08 tokens per joule over 1800 s simulated).
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    g.observe_hold(False, False, 0.0)
    for k in range(10):
        _round(g, 1.2 * k, clients=24, per_step=6, step_s=0.1)
    _signature(g, 1.2 * 9 + 0.75)  # between two rounds: 3 s on, the first read falls mid-round
    assert g.probe is not None and g.probe.round_s == pytest.approx(1.2)
    for k in range(10, 16):
        _round(g, 1.2 * k, clients=24, per_step=6, step_s=0.1)
    assert g.withdrawn == 1 and "did not speed up" in g.take_notice()


# --- scheduled checks: clients that think before their next request --------------------------------


def _poisson_in_time(p, t, rate, seconds, seed=3):
    """Open-loop Poisson arrivals in time, whatever the engine's loops do, at the pacer's target:
    steps of 7 ms, a request finishing every third step."""
    import random

    rng = random.Random(seed)
    next_s, load, i, end = t.now + rng.expovariate(rate), 8, 0, t.now + seconds
    while t.now < end:
        t.now += 0.007
        i += 1
        load -= 1 if i % 3 == 0 and load > 2 else 0
        p.hold(PaceFacts(load, 0, 256, False), lambda: next_s > t.now)
        came = 0
        while next_s <= t.now:
            came, next_s = came + 1, next_s + rng.expovariate(rate)
        load += came
        p.after_intake(load)


def _thinking_clients(p, t, seconds, clients=16, think_s=(0.3, 2.0), tokens=60, seed=5):
    """A closed loop whose clients think ``think_s`` (uniform) after each request of ``tokens``
    decode steps of 7 ms before sending the next."""
    import random

    rng = random.Random(seed)
    left, back, end = [tokens] * clients, [], t.now + seconds
    while t.now < end:
        t.now += 0.007
        left = [n - 1 for n in left]
        back += [t.now + rng.uniform(*think_s) for n in left if n == 0]
        left = [n for n in left if n > 0]
        p.hold(PaceFacts(len(left), 0, 256, False), lambda: min(back, default=float("inf")) > t.now)
        came = sum(b <= t.now for b in back)
        back = [b for b in back if b > t.now]
        left += [tokens] * came
        p.after_intake(len(left))


def test_a_scheduled_check_resumes_pacing_where_open_loop_arrivals_keep_their_rate():
    from vllm_powersave.pacing.pacer import CHECK_S

    p, t = _pacer(30.0)
    _poisson_in_time(p, t, 8.0, CHECK_AFTER_S[0] + 1.0)
    assert p.guard.checks == 1 and p.guard.probe is not None and p.guard.probe.check
    assert p.figures().checking and not p.figures().paused  # /metrics tells a check from a pause
    held = p.stats.held_steps
    _poisson_in_time(p, t, 8.0, CHECK_S + 4.0, seed=4)
    assert not p.figures().paused and not p.figures().checking and p.stats.held_steps > held  # decided within a few seconds: paced again
    assert p.guard.pauses == 0 and p.guard.take_notice() is None
    assert p.guard.check_after_s == 2 * CHECK_AFTER_S[0]  # the next check waits twice as long
    assert p.figures().closed_loop_checks == 1


def test_clients_that_think_before_their_next_request_pause_pacing_at_a_scheduled_check():
    # Their next request comes seconds after a finish, in no loop near it: the holds show no
    # signature, and pacing cost such loops x0.26-0.44 throughput at 35 ms (simulated H200).
    p, t = _pacer(30.0)
    _thinking_clients(p, t, CHECK_AFTER_S[0] - 1.0)
    assert p.guard.checks == 0 and p.guard.pauses == 0  # nothing in the holds
    _thinking_clients(p, t, 20.0, seed=6)  # a rise in the check, then a fall paced again (the recheck)
    assert p.guard.checks == 1 and p.guard.pauses == 1 and p.figures().paused and not p.figures().checking
    notice = p.guard.take_notice()
    assert "paused for 30 s" in notice and "check without pacing and fell back" in notice
    # The loop persists: the next check comes 15 s into pacing, and its pause is twice as long, though
    # the holds' own verdicts read open-loop arrivals meanwhile.
    _thinking_clients(p, t, 30.0 + 15.0 + 25.0, seed=7)
    assert p.guard.checks == 2 and p.guard.pauses == 2 and "paused for 60 s" in p.guard.take_notice()


def test_open_loop_arrivals_whose_rate_steps_up_during_a_check_resume_pacing_after_the_recheck():
    # The rise alone looked like a closed loop (Poisson alternating 2 and 6 req/s every 60 s lost
    # x2.31 -> x1.69-1.89 tokens per joule to such pauses, simulated): paced again, the rate holds.
    p, t = _pacer(30.0)
    _poisson_in_time(p, t, 3.0, CHECK_AFTER_S[0] + 0.5)
    assert p.guard.checks == 1 and p.guard.probe is not None and p.guard.probe.check
    _poisson_in_time(p, t, 9.0, 30.0, seed=8)  # three times the rate from the check's start on
    assert p.guard.pauses == 0 and p.guard.recheck is None and not p.figures().paused
    assert p.guard.check_after_s == 2 * CHECK_AFTER_S[0] and p.guard.take_notice() is None


def test_a_check_that_finds_no_closed_loop_starts_a_later_loops_pause_from_the_first_length():
    from vllm_powersave.pacing.pacer import CHECK_MAX_S, PAUSE_S

    p, t = _pacer(30.0)
    _thinking_clients(p, t, CHECK_AFTER_S[0] + 20.0)
    assert p.guard.pauses == 1 and p.guard.pause_s == 2 * PAUSE_S[0]
    t.now += PAUSE_S[0]
    # The clients left; open-loop traffic, checked 15 s in, for CHECK_MAX_S at most.
    _poisson_in_time(p, t, 8.0, 15.0 + CHECK_MAX_S + 1.0)
    assert p.guard.checks == 2 and p.guard.pauses == 1 and p.guard.pause_s == PAUSE_S[0] and not p.figures().paused


def test_the_checks_poisson_tail_is_exact_and_holds_at_thousands_of_arrivals():
    from vllm_powersave.pacing.pacer import _upper_tail

    assert _upper_tail(3, 4, 0.5) == pytest.approx(5 / 16)
    assert _upper_tail(0, 5, 0.3) == 1.0
    assert _upper_tail(1, 2, 0.25) == pytest.approx(1 - 0.75**2)
    assert 0.0 < _upper_tail(1300, 2000, 0.5) < 1e-30  # no overflow in the logs
    from math import comb

    exact = sum(comb(1000, i) * 0.35**i * 0.65 ** (1000 - i) for i in range(400, 1001))
    assert _upper_tail(400, 1000, 0.35) == pytest.approx(exact, rel=1e-9)  # the sum stops early, not short


def test_simulated_thinking_clients_pause_pacing_and_poisson_arrivals_are_checked_but_never_paused():
    from benchmarks.sim_decode_pacing import simulate

    thinking = simulate("think", None, 16, 35.0, 120.0, 0, think_s=(0.3, 2.0))
    assert thinking["closed_loop_pauses"] >= 1 and CHECK_AFTER_S[0] <= thinking["first_pause_s"] < CHECK_AFTER_S[0] + 25.0
    poisson = simulate("rate4", 4.0, None, 35.0, 120.0, 0)
    assert poisson["closed_loop_checks"] >= 1 and poisson["closed_loop_pauses"] == 0


def test_a_long_idle_spell_ends_the_checks_back_off_and_a_light_loads_gaps_do_not():
    from vllm_powersave.pacing import ClosedLoopGuard
    from vllm_powersave.pacing.pacer import CHECK_RESET_IDLE_S

    g = ClosedLoopGuard()
    g.check_after_s = CHECK_AFTER_S[1]  # backed off after open-loop checks
    g.observe_idle(2.0, 100.0)  # a gap between a light load's requests
    assert g.check_after_s == CHECK_AFTER_S[1]
    g.observe_idle(CHECK_RESET_IDLE_S + 1.0, 200.0)  # the traffic stopped: whatever comes next is new
    assert g.check_after_s == CHECK_AFTER_S[0]


def test_few_clients_that_think_are_checked_over_a_wider_paced_window_and_pause():
    # 4 clients paced at 35 ms send ~0.37 requests a second: 20 s of pacing held too few arrivals to
    # check, and pacing kept them at x0.245 throughput (simulated H200, docs/results/sim-decode-pacing.md).
    from benchmarks.sim_decode_pacing import simulate

    few = simulate("think", None, 4, 35.0, 150.0, 1, think_s=(0.3, 2.0))
    assert few["closed_loop_checks"] >= 1 and few["closed_loop_pauses"] >= 1
    light = simulate("rate0.5", 0.5, None, 35.0, 300.0, 2)
    assert light["closed_loop_checks"] >= 1 and light["closed_loop_pauses"] == 0


def _guard_in_a_check(paced_per_s, seconds=60.0):
    """A guard paced for ``seconds`` at ``paced_per_s`` arrivals a second, then lifted as a check."""
    from vllm_powersave.pacing import ClosedLoopGuard

    g = ClosedLoopGuard()
    g.observe_hold(False, False, 0.0)
    for i in range(int(seconds * paced_per_s)):
        g.observe_arrivals(1, (i + 0.5) / paced_per_s)
    g.observe_hold(False, False, seconds)
    assert g.checks == 1 and g.probe is not None and g.probe.check
    return g


def test_a_short_idle_spell_ends_a_check_only_where_arrivals_did_not_rise():
    from vllm_powersave.pacing.pacer import CHECK_RESET_IDLE_S, CHECK_S

    # Few thinking clients: unpaced, their requests finish before they come back (an idle spell in
    # the check's first seconds), then they come back twice as often as paced: the check goes on.
    g = _guard_in_a_check(0.4)
    g.observe_idle(2.0, 62.0)
    assert g.probe is not None and g.probe.check
    for i in range(8):
        g.observe_arrivals(1, 62.0 + i * 1.25)
    g.observe_idle(2.0, 72.0)
    assert g.probe is not None and g.probe.check
    # A light open load keeps its rate: its first idle spell past CHECK_S ends the check, and the
    # next one waits twice as long.
    g = _guard_in_a_check(0.4)
    for i in range(3):
        g.observe_arrivals(1, 61.0 + i * 2.5)
    g.observe_idle(2.0, 60.0 + CHECK_S + 1.0)
    assert g.probe is None and g.paused_until is None and g.check_after_s == 2 * CHECK_AFTER_S[0]
    # An idle spell long enough to end the traffic ends any check.
    g = _guard_in_a_check(0.4)
    g.observe_idle(CHECK_RESET_IDLE_S + 1.0, 62.0)
    assert g.probe is None and g.paused_until is None
