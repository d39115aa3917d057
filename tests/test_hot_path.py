"""The per-step (hot) path trimmed for host time gives what the straightforward code gave.

Each rewritten piece is checked against a reference: the plain per-request loop, ``json.dumps``,
or a copy of the earlier implementation (regime filter, clock dwell, energy-account tick) driven by
the same random step sequences, with results required to be equal to the bit.
"""

from __future__ import annotations

import json
import math
import random
import sys
import types
from collections import deque
from types import SimpleNamespace

import pytest

from vllm_powersave import runtime, vllm_compat
from vllm_powersave.chunking.policy import ChunkPolicy
from vllm_powersave.clocks import ClockController, DryRunClockBackend
from vllm_powersave.energy import PhaseEnergyAccount
from vllm_powersave.energy.account import TickPieces, TickRecord
from vllm_powersave.energy.meters import EnergyMeter
from vllm_powersave.phases import IDLE, ReqSched, StepInfo, classify, classify_counts
from vllm_powersave.runtime import RegimeFilter, clock_phase
from vllm_powersave.settings import PowersaveSettings, load_settings
from vllm_powersave.stats_contract import TRACE_KEYS, trace_line


# --- StepInfo -------------------------------------------------------------------------------------
def test_step_info_keeps_its_fields_property_equality_and_immutability():
    a = classify_counts(0, 0, 8, 8, 0, 100)
    assert a == StepInfo("decode", 8, 0, 8, 0, 8, 0, 8, 100) == classify([ReqSched(1, computed=100)] + [ReqSched(1)] * 7)
    assert (a.phase, a.num_reqs, a.decode_tokens, a.lm_head_rows, a.decode_ctx_tokens, a.num_tokens) == ("decode", 8, 8, 8, 100, 8)
    assert hash(a) == hash(StepInfo("decode", 8, 0, 8, 0, 8, 0, 8, 100))
    # Equality by type and fields, as the frozen dataclass had it: never equal to a plain tuple.
    assert a != tuple(a) and tuple(a) != a and (a == tuple(a)) is False and (tuple(a) == a) is False
    assert a != StepInfo("decode", 8, 0, 8, 0, 8, 0, 8, 101) and a != "decode"
    assert repr(IDLE) == (
        "StepInfo(phase='idle', num_reqs=0, prefill_reqs=0, decode_reqs=0, prefill_tokens=0, "
        "decode_tokens=0, spec_tokens=0, lm_head_rows=0, decode_ctx_tokens=0)"
    )
    with pytest.raises(AttributeError):
        a.phase = "prefill"  # type: ignore[misc]
    assert classify_counts(2, 0, 0, 0) is IDLE and classify_counts(0, 0, 3, 2, 4).decode_tokens == 2


# --- Scheduler look-ahead -------------------------------------------------------------------------
def _reference_tokens(waiting) -> int:
    tokens = 0
    for i, r in enumerate(waiting):
        if i >= vllm_compat.LOOKAHEAD_MAX_REQS:
            break
        tokens += max(0, int(r.num_prompt_tokens) - int(getattr(r, "num_computed_tokens", 0) or 0))
    return tokens


def test_waiting_prompt_tokens_equals_the_per_request_loop():
    rng = random.Random(7)
    odd = [0, 5, -3, None, 2.5, 7.0, True, 4000, 0.0]
    for _ in range(3000):
        reqs = []
        for _ in range(rng.randint(1, 90)):
            r = SimpleNamespace(num_prompt_tokens=rng.randint(0, 5000) if rng.random() < 0.95 else rng.choice([3.9, True, 0, -2, 2048]))
            u = rng.random()
            if u < 0.03:
                pass  # no num_computed_tokens at all
            elif u < 0.08:
                r.num_computed_tokens = rng.choice(odd)
            elif u < 0.3:
                r.num_computed_tokens = rng.randint(0, 6000)
            else:
                r.num_computed_tokens = 0
            reqs.append(r)
        waiting = deque(reqs) if rng.random() < 0.5 else reqs
        want = _reference_tokens(waiting)
        got = vllm_compat.waiting_prompt_tokens(waiting)
        assert got == want and type(got) is type(want)
    with pytest.raises(TypeError):  # a None prompt fails as it always did (the hook then logs it)
        vllm_compat.waiting_prompt_tokens([SimpleNamespace(num_prompt_tokens=None, num_computed_tokens=0)])


@pytest.mark.parametrize("count_tokens", [None, True, False])
def test_scheduler_stamp_scans_the_queue_only_for_the_lookahead(monkeypatch, count_tokens):
    class Scheduler:
        def schedule(self, *a, **k):
            return SimpleNamespace()

        def add_request(self, request):
            self.waiting.append(request)

    mod = types.ModuleType("vllm.v1.core.sched.scheduler")
    mod.Scheduler = Scheduler
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(vllm_compat, "_PATCHED", set())
    # count_tokens None: from this process's settings (look-ahead off here).
    monkeypatch.setenv("POWERSAVE_SETTINGS_JSON", PowersaveSettings.model_validate({"clocks": {"lookahead": False}}).model_dump_json())
    arrivals = []
    assert vllm_compat.install_scheduler_hooks(arrivals.append, count_tokens=count_tokens)
    s = Scheduler()
    s.waiting = deque()
    t, n, tokens = vllm_compat.step_lookahead(Scheduler.schedule(s))
    assert (n, tokens) == (0, 0) and t > 0
    for p in [512, 300] + [10] * 100:
        Scheduler.add_request(s, SimpleNamespace(num_prompt_tokens=p, num_computed_tokens=0))
    assert arrivals[:3] == [512, 300, 10]
    t2, n, tokens = vllm_compat.step_lookahead(Scheduler.schedule(s))
    assert t2 >= t and n == 102
    assert tokens == (512 + 300 + 62 * 10 if count_tokens else 0)


# --- Step trace -----------------------------------------------------------------------------------
def test_trace_line_equals_json_dumps():
    np = pytest.importorskip("numpy")

    class Int(int):
        pass

    rng = random.Random(3)
    floats = [1234.5678901234, 0.0, 1e-300, 1e300, 50523.123456789, -0.0]
    odd_floats = [math.nan, math.inf, -math.inf, None, 5, np.float64(3.25)]
    ints = [0, 8, 10**20, -3]
    odd_ints = [True, Int(4), np.int64(7), 2.5, None]
    phases = ["prefill", "decode", "mixed"]
    odd_phases = ["idle", "wéird", 'q"uote', 3]
    n = 0
    for _ in range(20000):
        r = [
            rng.choice(floats) if rng.random() < 0.8 else rng.choice(odd_floats),
            rng.choice(phases) if rng.random() < 0.85 else rng.choice(odd_phases),
        ]
        r += [rng.choice(ints) if rng.random() < 0.85 else rng.choice(odd_ints) for _ in range(5)]
        r += [
            rng.choice([None, 1200, 345, True, np.int64(5)]),
            rng.choice(floats + [None]) if rng.random() < 0.85 else rng.choice(odd_floats),
        ]
        try:
            want = json.dumps(dict(zip(TRACE_KEYS, r))) + "\n"
        except TypeError:
            with pytest.raises(TypeError):
                trace_line(r)
            continue
        assert trace_line(r) == want
        assert trace_line(tuple(r)) == want
        n += 1
    assert n > 10000


def _decode_so(n, t=None, new=0):
    """n decoding requests (100 KV tokens, 5 outputs each), plus ``new`` new 10-token prompts."""
    ids = [f"r{i}" for i in range(n)]
    news = [
        SimpleNamespace(req_id=f"n{i}", sampling_params=None, prompt_token_ids=list(range(10)), num_computed_tokens=0) for i in range(new)
    ]
    so = SimpleNamespace(
        scheduled_new_reqs=news,
        scheduled_spec_decode_tokens={},
        total_num_scheduled_tokens=n + 10 * new,
        finished_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(req_ids=ids, num_computed_tokens=[100] * n, num_output_tokens=[5] * n),
        num_scheduled_tokens={**{r: 1 for r in ids}, **{r.req_id: 10 for r in news}},
    )
    if t is not None:
        setattr(so, vllm_compat.LOOKAHEAD_ATTR, (t, 0, 0))
    return so


def test_trace_records_get_their_end_time_and_the_newest_stays_in_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    rt = runtime.WorkerRuntime(
        object(),
        PowersaveSettings.model_validate(
            {
                "stats_dir": str(tmp_path),
                "trace_steps": True,
                "energy": {"meter": "off", "idle_after_s": 20.0},
                "clocks": {"presets": {"decode": {"sm_clock_mhz": 1200}}},
            }
        ),
    )
    try:
        for i in range(5):
            rt.on_step_start(_decode_so(4, t=10.0 + i))
            rt.on_step_end()
            rt.on_step_end()  # a second end (execute_model output and sample_tokens) changes nothing
        rt.on_step_start(_decode_so(2, t=20.0))  # still running: its end time is not known yet
        rt.publish()
        lines = (tmp_path / "trace-rank0.jsonl").read_text().splitlines()
        steps = [json.loads(x) for x in lines]
        assert len(steps) == 5 and all(list(s) == list(TRACE_KEYS) for s in steps)
        assert all(s["t_end"] >= s["t"] and (s["phase"], s["reqs"], s["rows"], s["ctx"]) == ("decode", 4, 4, 400) for s in steps)
        assert lines[0] == json.dumps(steps[0])
        rt.on_step_end()
    finally:
        rt.close()
    steps = [json.loads(x) for x in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
    assert len(steps) == 6 and steps[-1]["reqs"] == 2 and steps[-1]["t_end"] is not None


def test_step_hook_does_per_step_work_only_for_options_that_read_steps(monkeypatch, tmp_path):
    """Every option off: after the first served step the hook classifies nothing and keeps no
    record. Presets alone: the clock decision runs, no records are kept. A trace: records are
    kept and drained (with the running step's record held until its end is known)."""
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    classified = []
    real = vllm_compat.step_info
    monkeypatch.setattr(vllm_compat, "step_info", lambda so, ctx=True: classified.append(ctx) or real(so, ctx))

    def make(**extra):  # every option off: clocks.mode off too (its default runs the closed loop)
        return runtime.WorkerRuntime(
            object(),
            PowersaveSettings.model_validate(
                {"stats_dir": str(tmp_path), "energy": {"meter": "off", "idle_after_s": 20.0}, "clocks": {"mode": "off"}, **extra}
            ),
        )

    bare = make()
    try:
        for i in range(3):
            bare.on_step_start(_decode_so(4, t=1.0 + i))
            bare.on_step_end()
        assert (bare.step_path.per_step, bare.drain.handoff.steps, classified) == (False, None, [])
    finally:
        bare.close()
    presets = make(clocks={"presets": {"decode": {"sm_clock_mhz": 1200}}})
    try:
        for i in range(3):
            presets.on_step_start(_decode_so(4, t=1.0 + i))
            presets.on_step_end()
        assert presets.drain.handoff.steps is None and classified == []  # decode-only steps: decode_step_tokens, no StepInfo
        assert presets.clocks.phase == "decode"
        presets.on_step_start(_decode_so(4, t=5.0, new=1))  # any other step: step_info, without the ctx sum
        assert classified == [False]
    finally:
        presets.close()
    traced = make(trace_steps=True)
    try:
        traced.on_step_start(_decode_so(4, t=1.0))
        traced.on_step_end()
        traced.on_step_start(_decode_so(2, t=2.0))
        traced.drain_steps()
        assert (
            len(traced.drain.handoff.steps) == 1 and len(traced.drain.trace) == 1 and traced.drain.trace[0][6] == 4
        )  # reqs of the ended step
        assert classified[1:] == [True, True]  # no presets: the drain classifies (ctx included), the running step too
    finally:
        traced.close()


# --- Regime filter and clock dwell against the earlier code --------------------------------------------
class ReferenceRegime(RegimeFilter):
    def phase(self, info, now, waiting_tokens=0):
        own = clock_phase(info, self.mb_tokens)
        x = 0.0 if own == "decode" else 1.0
        if self._t is None:
            self.share = x
        else:
            a = math.exp(-max(0.0, now - self._t) / self.window_s)
            self.share = a * self.share + (1 - a) * x
        self._t = now
        if waiting_tokens >= self.burst_tokens or info.phase == "prefill" and info.num_tokens >= self.burst_tokens:
            return "prefill"
        return "decode" if self.share < self.share_max else own


class ReferenceController(ClockController):
    def decide(self, phase, now=None):
        from vllm_powersave.clocks.controller import ClockPreset, _rank

        target = self._all_targets.get(phase) or ClockPreset()
        if target == self.current:
            self._down_since = None
            return None
        if _rank(target) > _rank(self.current):
            self._down_since = None
            return target
        t = self.clock() if now is None else now
        if self._down_since is None or self._down_target != target:
            self._down_since, self._down_target, self._down_steps = t, target, 0
        self._down_steps += 1
        if t - self._down_since >= self.min_dwell_s and self._down_steps > self.host_ahead_steps:
            self._down_since = None
            return target
        return None


def _random_steps(rng, n):
    t = 0.0
    for _ in range(n):
        t += rng.choice([0.0, 0.0005, 0.002, 0.002, 0.03, 0.4, 3.0])
        dec = rng.choice([0, 1, 8, 64, 256])
        new = rng.choice([0, 0, 0, 1, 3])
        tokens = dec + new * rng.choice([16, 300, 4000])
        yield t, classify_counts(new, 0, dec, tokens, 0, 1000 * dec), rng.choice([0, 0, 0, 100, 5000])


@pytest.mark.parametrize("seed", range(4))
def test_regime_filter_and_clock_decisions_equal_the_earlier_code(seed):
    rng = random.Random(seed)
    c = load_settings(
        {
            "clocks": {
                "min_dwell_ms": rng.choice([0, 50, 200]),
                "presets": {
                    "decode": {"sm_clock_mhz": 1200},
                    "idle": {"sm_clock_mhz": 345},
                    "mixed": {"sm_clock_mhz": 1500} if seed % 2 else {},
                },
            }
        },
        env={},
    ).clocks
    args = (c.regime_window_s, c.compute_share_max, c.prefill_burst_tokens, c.memory_bound_max_tokens)
    new, ref = RegimeFilter(*args), ReferenceRegime(*args)
    ctl = ClockController(DryRunClockBackend(), c, asynchronous=False, watchdog=False, host_ahead_steps=seed % 2)
    ctl_ref = ReferenceController(DryRunClockBackend(), c, asynchronous=False, watchdog=False, host_ahead_steps=seed % 2)
    for t, info, waiting in _random_steps(rng, 3000):
        if info.phase == "idle" or rng.random() < 0.01:
            engine_idled = rng.random() < 0.5
            for x in (ctl, ctl_ref):
                x.idle_begin(t)
                x.idle_end(engine_idled, t)
            continue
        p = new.phase(info, t, waiting)
        assert p == ref.phase(info, t, waiting) and new.share == ref.share
        ctl.on_phase(p, t)
        ctl_ref.on_phase(p, t)
        assert ctl.current == ctl_ref.current
    assert list(ctl.decisions) == list(ctl_ref.decisions) and ctl.n_changes > 3
    ctl.close()
    ctl_ref.close()


# --- Energy account tick against the earlier code --------------------------------------------------
class ReferenceAccount(PhaseEnergyAccount):
    """The account's event walk written plainly: one function cuts the time from the current
    state to the next event (or the tick) into pieces; the pricing (``_price``) is shared."""

    def _cut(self, st, te, at_tick):
        """Pieces of ``[st.t, te]`` and what becomes of a gap left pending earlier."""
        t, phase, end_t, req, ctx, steady, drained = st[:7]
        if phase == "idle":
            return [("idle", te - t)] if te > t else [], None
        if end_t is None:
            return ([("busy", (te - t, phase, req, ctx, steady))] if te > t else []), None
        g0 = max(t, end_t)
        out = [("busy", (g0 - t, phase, req, ctx, steady))] if g0 > t else []
        if te - end_t >= self.idle_after_s:
            return out + ([("idle", te - g0)] if te > g0 else []), "tail"
        dest = "tail" if drained else ("pending" if at_tick else "req")
        if te > g0:
            out.append(("gap", (te - g0, phase, req, ctx, steady, dest)))
        return out, (None if at_tick and not drained else ("tail" if drained else "req"))

    def tick(self):
        with self._lock:
            t_now = self.clock()
            st = list(self._state)
            pieces, finished, settle = [], [], None
            while self._events:
                te, ev, ev_req, ev_fin, ev_steady, ev_ctx = self._events.popleft()
                te = max(te, st[0])
                if ev is None:
                    st[2] = te
                    if st[1] != "idle" and st[6] and st[7] is not None and not st[7]:  # reported before its end
                        settle = settle or ("tail" if self._pending_j > 0 else None)
                        pieces += self._cut(st, te, False)[0]
                        st = [te, "idle", None, None, None, False, False, None]
                elif ev == "":
                    finished.extend(ev_fin)
                    if st[1] != "idle" and st[7] is not None:
                        st[7] = st[7] - set(ev_fin)  # the last step's requests not yet reported
                    if st[1] != "idle" and not st[7]:  # drained: tail, then idle (at the step's end)
                        st[6] = True
                        if st[2] is not None:
                            settle = settle or ("tail" if self._pending_j > 0 else None)
                            pieces += self._cut(st, te, False)[0]
                            st = [te, "idle", None, None, None, False, False, None]
                else:
                    if not st[6] and st[7] is not None and not st[7] - set(ev_fin or ()):
                        st[6] = True  # every request of the step before the gap has finished
                    cut, what = self._cut(st, te, False)
                    pieces += cut
                    if self._pending_j > 0 and settle is None and what is not None:
                        settle = what if what == "tail" else ("req", st[3], st[4])
                    st = [te, ev, None, ev_req, ev_ctx, ev_steady, False, frozenset(ev_req) if ev_req else None]
                    finished.extend(ev_fin or ())
            cut, what = self._cut(st, t_now, True)
            pieces += cut
            if what == "tail" and self._pending_j > 0 and settle is None:
                settle = "tail"
            if st[1] != "idle" and st[2] is not None and t_now - st[2] >= self.idle_after_s:
                st = [t_now, "idle", None, None, None, False, False, None]
            busy = [p for k, p in pieces if k == "busy"]
            gaps = [p for k, p in pieces if k == "gap"]
            idle_s = sum(p for k, p in pieces if k == "idle")
            if idle_s > 0:
                self.meter.on_idle(idle_s)
            e_now = self.meter.energy_j()
            resolved = [settle[1:]] if isinstance(settle, tuple) else []
            pieces = TickPieces(
                busy,
                gaps,
                idle_s,
                0.0,
                sum(b[0] for b in busy),
                idle_s + sum(g[0] for g in gaps),
                resolved,
                settle == "tail",
                finished,
                st[1],
            )
            idle_j = self._price(pieces, energy_j=e_now - self._e, span_s=t_now - self._t, book={})
            done = []
            for rid in finished:
                j = self.request_j.pop(rid, None)
                if j is not None:
                    done.append(rid)
                    self.finished_request_j += j
                    self.finished_requests += 1
                    if self.on_request_done is not None:
                        self.on_request_done(rid, j)
            if self.on_tick is not None:
                gap_s = sum(g[0] for g in gaps)
                self.on_tick(TickRecord(self._t, t_now, e_now - self._e, sum(b[0] for b in busy), gap_s, idle_s, idle_j, done))
            self._t, self._e = t_now, e_now
            st[0] = t_now
            self._state = tuple(st)
            self._window.append((t_now, self.total_j(), self.tokens["prefill"], self.tokens["decode"]))
            while len(self._window) > 2 and t_now - self._window[1][0] >= self.window_s:
                self._window.popleft()


class Meter(EnergyMeter):
    def __init__(self, clock):
        self.clock = clock

    def energy_j(self):
        return 300.0 * self.clock() + 0.1 * math.sin(self.clock())

    def power_w(self):
        return None

    def sm_clock_mhz(self):
        return None


@pytest.mark.parametrize("per_request", [False, True])
def test_account_tick_equals_the_earlier_code(per_request):
    rng = random.Random(11 + per_request)
    now = [0.0]
    clock = lambda: now[0]
    done_new, done_ref, ticks_new, ticks_ref = [], [], [], []
    new = PhaseEnergyAccount(
        Meter(clock),
        0.25,
        clock=clock,
        per_request=per_request,
        on_request_done=lambda r, j: done_new.append((r, j)),
        on_tick=ticks_new.append,
    )
    ref = ReferenceAccount(
        Meter(clock),
        0.25,
        clock=clock,
        per_request=per_request,
        on_request_done=lambda r, j: done_ref.append((r, j)),
        on_tick=ticks_ref.append,
    )
    live: list[str] = []
    for i in range(4000):
        now[0] += rng.choice([0.0, 0.0001, 0.002, 0.002, 0.01, 0.3, 1.0])
        u = rng.random()
        if u < 0.02:
            fin = set(rng.sample(live, min(len(live), 2)))
            live = [r for r in live if r not in fin]
            for a in (new, ref):
                a.on_finished(fin)
        elif u < 0.6:
            if rng.random() < 0.2:
                live.append(f"q{i}")
            reqs = {r: rng.choice([1, 1, 4, 300]) for r in live} or None
            fin = set(rng.sample(live, 1)) if live and rng.random() < 0.05 else set()
            live = [r for r in live if r not in fin]
            phase = rng.choice(["decode", "decode", "prefill", "mixed"])
            steady = rng.random() < 0.3
            pre, dec = rng.randint(0, 500), rng.randint(0, 64)
            for a in (new, ref):
                a.on_step(phase, pre, dec, reqs, fin, steady)
        elif u < 0.95:
            for a in (new, ref):
                a.on_step_end()
        if rng.random() < 0.05:
            new.tick()
            ref.tick()
            assert new.energy_j == ref.energy_j and new.time_s == ref.time_s
            assert (new.steady_j, new.steady_s, new.request_j) == (ref.steady_j, ref.steady_s, ref.request_j)
            assert (new.tail_j, new.pending_j, new.idle_power_w) == (ref.tail_j, ref.pending_j, ref.idle_power_w)
    new.tick()
    ref.tick()
    assert new.energy_j == ref.energy_j and new.time_s == ref.time_s and new.steps == ref.steps and new.tokens == ref.tokens
    assert done_new == done_ref and new.window() == ref.window() and sum(new.time_s.values()) > 0
    if per_request:
        assert new.finished_requests > 10
    # The trace's tick records: the same spans, joules, split and finished requests as the plain walk
    # (seconds to rounding: the sums run in another order), each span split without loss.
    assert len(ticks_new) == len(ticks_ref) > 100
    for a, b in zip(ticks_new, ticks_ref):
        assert (a.t0_s, a.t1_s, a.energy_j, a.idle_j, a.finished) == (b.t0_s, b.t1_s, b.energy_j, b.idle_j, b.finished)
        assert (a.busy_s, a.gap_s, a.idle_s) == pytest.approx((b.busy_s, b.gap_s, b.idle_s), abs=1e-9)
        assert min(a.busy_s, a.gap_s, a.idle_s) >= 0 and a.busy_s + a.gap_s + a.idle_s == pytest.approx(a.t1_s - a.t0_s, abs=1e-9)
    assert all(a.t1_s == b.t0_s for a, b in zip(ticks_new, ticks_new[1:]))
    assert sum(x.energy_j for x in ticks_new) == pytest.approx(new.total_j())  # every joule the account booked
    if per_request:
        assert sorted(r for x in ticks_new for r in x.finished) == sorted(r for r, _ in done_new)


# --- LM-head hook ------------------------------------------------------------------------------------
def test_chunk_policy_take_is_chunks_then_record():
    table = [{"min_rows": 4, "chunks": 2}, {"min_rows": 100, "chunks": 8}]
    for enabled, tab in ((True, table), (False, table), (True, []), (True, [{"min_rows": 1_000_000, "chunks": 2}])):
        s = load_settings({"chunking": {"enabled": enabled, "table": tab}}, env={}).chunking
        a, b = ChunkPolicy(s), ChunkPolicy(s)
        for rows in [0, 1, 3, 4, 5, 99, 100, 7, 1000, 2, 1]:
            n = a.chunks(rows)
            a.record(n, rows)
            assert b.take(rows) == n
        assert a.calls == b.calls and a.rows_total == b.rows_total


@pytest.fixture
def process_hooks():
    """The process's chunk policy and runtime, set by a test through runtime's public seams and
    cleared after it."""
    saved = runtime.process_runtime()
    yield
    runtime.set_chunk_policy(None)
    runtime.install_runtime(saved)


def test_chunked_head_calls_the_head_once_for_one_chunk(process_hooks):
    torch = pytest.importorskip("torch")
    s = load_settings({"chunking": {"table": [{"min_rows": 4, "chunks": 2}]}}, env={}).chunking
    policy = ChunkPolicy(s)
    runtime.set_chunk_policy(policy)
    runtime.install_runtime(None)
    seen = []

    def head(h):
        seen.append(h.shape[0])
        return h * 2

    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(runtime.chunked_head(head, x), x * 2) and seen == [3]
    y = torch.arange(8.0).reshape(4, 2)
    # A plain-GEMM head (weight given) is split into 2 blocks written by the plugin's own GEMM ...
    w = 2 * torch.eye(2)
    assert torch.equal(runtime.chunked_head(head, y, None, (w, None)), y * 2) and seen == [3]
    # ... any other head runs once, unchunked: splitting it would hold block results beside the output.
    assert torch.equal(runtime.chunked_head(head, y), y * 2) and seen == [3, 4]
    assert dict(policy.calls) == {1: 1, 2: 2} and policy.rows_total == 11


def test_head_chunks_is_zero_where_vllms_own_call_applies(process_hooks):
    """0 (the subclass calls vLLM's head directly) for one chunk and no lm_head group preset; the
    chunk count otherwise, and 1 where only the group preset applies. Every call is recorded."""
    torch = pytest.importorskip("torch")
    s = load_settings({"chunking": {"table": [{"min_rows": 4, "chunks": 2}]}}, env={}).chunking
    policy = ChunkPolicy(s)
    runtime.set_chunk_policy(policy)
    runtime.install_runtime(None)
    assert runtime.head_chunks(torch.ones(3, 2)) == 0
    assert runtime.head_chunks(torch.ones(4, 2)) == 2
    assert runtime.head_chunks(torch.ones(2)) == 0  # one row
    grouped = type("C", (), {"groups": {"prefill": {}}, "has_group": lambda self, g: g == "lm_head"})()
    runtime.install_runtime(type("RT", (), {"clocks": grouped, "head_groups": True})())
    assert runtime.head_chunks(torch.ones(3, 2)) == 1 and runtime.head_chunks(torch.ones(5, 2)) == 2
    assert dict(policy.calls) == {1: 3, 2: 2} and policy.rows_total == 3 + 4 + 1 + 3 + 5


def test_chunked_head_fails_open_on_its_own_faults_but_not_on_the_heads(monkeypatch, caplog, process_hooks):
    import torch

    class Broken:
        def take(self, rows):
            raise KeyError("table")

    runtime.set_chunk_policy(Broken())
    monkeypatch.setattr(vllm_compat, "_HOOK_ERRORS", set())
    x = torch.ones(3, 4)
    with caplog.at_level("ERROR", logger="vllm.powersave"):
        assert torch.equal(runtime.chunked_head(lambda h: h * 2, x), x * 2)
        assert torch.equal(runtime.chunked_head(lambda h: h * 3, x), x * 3)
    assert sum("LM-head hook policy failed" in r.getMessage() for r in caplog.records) == 1  # logged once

    def oom(h):
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        runtime.chunked_head(oom, x)  # the head's own error is vLLM's to handle, as without the plugin


@pytest.mark.parametrize("seed", [3, 4])
def test_decode_fast_path_decides_as_the_regime_filter_and_controller(monkeypatch, tmp_path, seed):
    """The step hook's decode-only fast path (decode_step_tokens, the regime update and the
    controller's no-change return inlined) against the general path (step_info, RegimeFilter.phase,
    ClockController.on_phase) on random step sequences: the same regime share to the bit, the same
    phase per step and the same decision stream."""
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    rng = random.Random(seed)
    seq = []
    t = 100.0
    for _ in range(600):
        t += rng.choice((0.002, 0.004, 0.03, 0.3))
        n = rng.choice((1, 4, 64, 200, 256))
        so = _decode_so(n, t=t, new=1 if rng.random() < 0.1 else 0)
        setattr(so, vllm_compat.LOOKAHEAD_ATTR, (t, 1, rng.choice((0, 0, 0, 100, 5000))))
        seq.append(so)
    runs = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(vllm_compat, "decode_step_tokens", lambda so: -1)
        rt = runtime.WorkerRuntime(
            object(),
            PowersaveSettings.model_validate(
                {
                    "stats_dir": str(tmp_path),
                    "energy": {"meter": "off", "idle_after_s": 20.0},
                    "clocks": {
                        "min_dwell_ms": 50,
                        "memory_bound_max_tokens": 128,
                        "presets": {"decode": {"sm_clock_mhz": 1200}, "mixed": {"sm_clock_mhz": 1600}, "prefill": {"sm_clock_mhz": 1980}},
                    },
                }
            ),
        )
        try:
            got = []
            for so in seq:
                rt.on_step_start(so)
                rt.on_step_end()
                got.append((rt.regime.share.hex(), rt.clocks.phase, rt.clocks.current.sm_clock_mhz))
            runs.append((got, [(d.phase, d.sm_clock_mhz) for d in rt.clocks.decisions]))
        finally:
            rt.close()
    assert runs[0] == runs[1]
    phases = {p for _, p, _ in runs[0][0]}
    assert {"decode", "mixed", "prefill"} <= phases and len(runs[0][1]) > 10


def test_decode_step_tokens_and_step_info_ctx():
    """decode_step_tokens: the token count where step_info says decode with one token per request,
    -1 for every other step; step_info's ctx sum is there by default and left out with ctx=False."""
    so = _decode_so(4)
    assert vllm_compat.decode_step_tokens(so) == 4 and vllm_compat.step_info(so).num_tokens == 4
    assert vllm_compat.step_info(so).decode_ctx_tokens == 400 and vllm_compat.step_info(so, ctx=False).decode_ctx_tokens == 0
    assert vllm_compat.decode_step_tokens(_decode_so(4, new=1)) == -1 and vllm_compat.step_info(_decode_so(4, new=1)).phase == "mixed"
    spec = _decode_so(2)
    spec.scheduled_spec_decode_tokens = {"r0": [1, 2]}
    spec.total_num_scheduled_tokens = 4
    assert vllm_compat.decode_step_tokens(spec) == -1 and vllm_compat.step_info(spec).phase == "decode"
    ctx = _decode_so(3)
    ctx.scheduled_cached_reqs.num_output_tokens = [5, 0, 5]  # a chunked prefill continuing
    ctx.total_num_scheduled_tokens = 40
    assert vllm_compat.decode_step_tokens(ctx) == -1 and vllm_compat.step_info(ctx).phase == "mixed"
    resumed = _decode_so(2)
    resumed.total_num_scheduled_tokens = 30  # a preempted request recomputing
    assert vllm_compat.decode_step_tokens(resumed) == -1
    assert vllm_compat.decode_step_tokens(_decode_so(0)) == -1 and vllm_compat.step_info(_decode_so(0)).phase == "idle"


# --- Faults and warm-ups on the record path ------------------------------------------------------------
def _warmup_so(n=4, prompt=512, decode=False):
    """vLLM V2's kernel warm-up step: ``_warmup_{i}_`` requests, a prefill of new ones or their decode."""
    ids = [f"_warmup_{i}_" for i in range(n)]
    if decode:
        return SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_spec_decode_tokens={},
            total_num_scheduled_tokens=n,
            finished_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(req_ids=ids, num_computed_tokens=[prompt] * n, num_output_tokens=[1] * n),
            num_scheduled_tokens=dict.fromkeys(ids, 1),
        )
    news = [SimpleNamespace(req_id=r, sampling_params=None, prompt_token_ids=list(range(prompt)), num_computed_tokens=0) for r in ids]
    return SimpleNamespace(
        scheduled_new_reqs=news,
        scheduled_spec_decode_tokens={},
        total_num_scheduled_tokens=n * prompt,
        finished_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], num_output_tokens=[]),
        num_scheduled_tokens=dict.fromkeys(ids, prompt),
    )


@pytest.mark.parametrize("decides", [False, True])
def test_kernel_warmup_on_a_serving_worker_is_neither_traced_nor_decided(monkeypatch, tmp_path, decides):
    """vLLM 0.32 re-runs the V2 kernel warm-up on a worker already serving (elastic-EP scale-up):
    its prefill and decode steps are left out of the trace, the account and the clock decisions,
    whether the hook decides (presets) or the drain classifies (trace and meter only)."""
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    extra = {"clocks": {"presets": {"decode": {"sm_clock_mhz": 1200}}}} if decides else {}
    rt = runtime.WorkerRuntime(
        object(),
        PowersaveSettings.model_validate(
            {"stats_dir": str(tmp_path), "trace_steps": True, "energy": {"meter": "simulated", "idle_after_s": 20.0}, **extra}
        ),
    )
    rt.step_path.drain_inline = False  # as with NVML: the publisher drains (here: by hand)
    try:
        seq = [
            _warmup_so(),
            _warmup_so(decode=True),  # start-up warm-up
            _decode_so(2, t=1.0),
            _decode_so(2, t=1.01),  # serving
            _warmup_so(),
            _warmup_so(decode=True),
            _warmup_so(decode=True),  # warm-up again
            _decode_so(3, t=1.05),
        ]
        phases = []
        for so in seq:
            rt.on_step_start(so)
            phases.append(rt.clocks.phase)
            rt.on_step_end()
        rt.drain_steps(final=True)
        assert [(r[1], r[3], r[6]) for r in rt.drain.trace] == [("decode", 2, 2), ("decode", 2, 2), ("decode", 3, 3)]
        assert rt.account.steps["decode"] == 3 and rt.account.steps["prefill"] == 0
        assert rt.account.tokens == {"prefill": 0, "decode": 7}
        if decides:
            assert "prefill" not in phases and phases[-1] == "decode"
    finally:
        rt.close()


def test_a_record_that_cannot_be_fed_loses_only_its_step(monkeypatch, tmp_path, caplog):
    """A fault while draining one record (here: a SchedulerOutput that step_info cannot read) is
    logged once; the records behind it, the account's tick, the publish and close() carry on."""
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    vllm_compat._HOOK_ERRORS.clear()
    rt = runtime.WorkerRuntime(
        object(),
        PowersaveSettings.model_validate(
            {
                "stats_dir": str(tmp_path),
                "trace_steps": True,
                "energy": {"meter": "simulated", "idle_after_s": 20.0},
                "clocks": {"mode": "off"},
            }
        ),
    )  # the drain path alone: no per-step clock decision
    rt.stop_publisher_thread()  # the publisher's work is driven by hand below
    rt.step_path.drain_inline = False

    def bad_so():
        so = _decode_so(4)
        so.scheduled_spec_decode_tokens = {"r0": None}  # len(None) inside step_info
        return so

    caplog.set_level("ERROR", logger="vllm.powersave")
    for i in range(40):
        rt.on_step_start(bad_so() if i in (10, 20) else _decode_so(4))
        rt.on_step_end()
    rt.account.tick()  # drains through its feed: raised before the fix
    assert rt.account.steps["decode"] == 38 and rt.account.tokens["decode"] == 38 * 4
    assert len(rt.drain.handoff.steps) == 0  # every record ended, the two bad ones included
    assert sum("feeding a step record" in r.getMessage() for r in caplog.records) == 1  # once, not per step
    rt.on_step_start(bad_so())  # still pending at close(): the final publish and trace flush happen anyway
    rt.on_step_end()
    rt.on_step_start(_decode_so(4))  # running at close(): drained as final
    rt.close()
    snap = json.loads((tmp_path / "rank0.json").read_text())
    assert snap["steps"]["decode"] == 39
    lines = [json.loads(x) for x in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
    assert sum("t" in x for x in lines) == 39  # step lines; energy ticks are lines of their own


def test_close_writes_its_final_files_when_one_final_step_fails(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    vllm_compat._HOOK_ERRORS.clear()
    rt = runtime.WorkerRuntime(
        object(),
        PowersaveSettings.model_validate(
            {"stats_dir": str(tmp_path), "trace_steps": True, "energy": {"meter": "simulated", "idle_after_s": 20.0}}
        ),
    )
    for i in range(5):
        rt.on_step_start(_decode_so(2, t=1.0 + i))
        rt.on_step_end()

    def broken_tick():
        raise RuntimeError("meter gone")

    monkeypatch.setattr(rt.account, "tick", broken_tick)
    caplog.set_level("WARNING", logger="vllm.powersave")
    rt.close()
    assert not rt.publisher.running  # joined before the final writes
    assert json.loads((tmp_path / "rank0.json").read_text())["steps"]["decode"] == 5
    lines = (tmp_path / "trace-rank0.jsonl").read_text().splitlines()
    assert len([x for x in lines if "t" in json.loads(x)]) == 5  # step lines (decisions and energy ticks beside them)
    assert any("final energy tick" in r.getMessage() for r in caplog.records)
