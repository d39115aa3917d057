"""benchmarks/counter_lag.py: how late the counter's periods are against the step trace's work,
found on a synthetic trace whose counter covers the energy up to a known time before each step."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from benchmarks import counter_lag as cl
from vllm_powersave.energy.account import TickRecord
from vllm_powersave.energy.meters import CounterStep
from vllm_powersave.stats_contract import TraceLine, tick_line

IDLE_W, DECODE_W, PREFILL_W = 120.0, 450.0, 700.0


def _serving(seed: int, span_s: float = 20.0) -> list[tuple[float, float, int]]:
    """``(start, end, prefill tokens)`` of each step: a 1024-token prefill (50 ms) about every
    100 ms with jitter, 2.5 ms decode steps 6 ms apart between them, as at 1024 / 32 at 10 req/s."""
    rng, steps, t = random.Random(seed), [], 1.0
    next_prefill = t + rng.uniform(0.0, 0.1)
    while t < 1.0 + span_s:
        if t >= next_prefill:
            steps.append((t, t + 0.05, 1024))
            t += 0.05 + 0.001
            next_prefill += 0.1 + rng.uniform(-0.04, 0.04)
        else:
            steps.append((t, t + 0.0025, 0))
            t += 0.006
    return steps


def _energy_j(steps: list[tuple[float, float, int]], a: float, b: float) -> float:
    """The GPU's energy over [a, b]: idle power, plus each step's extra power while it runs."""
    e = IDLE_W * (b - a)
    for s, t, prefill in steps:
        overlap = max(0.0, min(t, b) - max(s, a))
        e += overlap * ((PREFILL_W if prefill else DECODE_W) - IDLE_W)
    return e


def _trace(tmp_path, lag_s: float, seed: int = 0):
    steps = _serving(seed)
    lines = [TraceLine(s, "prefill" if p else "decode", p, 0 if p else 2, 2, 2048, 2, None, t).to_json() for s, t, p in steps]
    t_step = 1.0 + 0.037  # the counter's phase
    while t_step + 0.1 < steps[-1][1]:
        a, b = t_step, t_step + 0.1
        step = CounterStep(b, 0.0, a, _energy_j(steps, a - lag_s, b - lag_s))
        rec = TickRecord(b, b + 0.01, 1.0, 0.01, 0.0, 0.0, 0.0, [], 0.0, None, None, (step,), (), 0.004)
        lines.append(tick_line(rec))
        t_step = b
    path = tmp_path / "defaults0-trace-rank0.jsonl.gz"
    path.write_bytes(gzip.compress("".join(lines).encode()))
    return path


@pytest.mark.parametrize("lag_ms", [0, 20, 40])
def test_the_lag_of_a_counter_that_covers_the_energy_up_to_a_time_before_its_step_is_found(tmp_path, lag_ms):
    lines = cl.trace_lines(_trace(tmp_path, lag_ms / 1000.0), None)
    steps, periods = cl.steps_and_periods(lines)
    fits = cl.fit_lags(steps, periods)
    best = cl.best_fit(fits)
    assert abs(best.lag_ms - lag_ms) <= 5, [(f.lag_ms, round(f.r2, 3)) for f in fits]
    assert best.r2 > 0.9
    if lag_ms >= 20:
        assert next(f for f in fits if f.lag_ms == 0).r2 < best.r2 - 0.1  # booking at the step misses it


def test_the_report_names_each_stretch_of_serving_and_its_best_lag(tmp_path):
    out = cl.report(cl.trace_lines(_trace(tmp_path, 0.02), None))
    head = out.splitlines()[0]
    assert head.startswith("stretch 1.0-") and "best lag +20 ms" in head and "against 0 ms" in head
    assert out.count("\n    lag ") == len(cl.LAGS_MS)


def test_a_trace_without_counter_steps_says_so_in_one_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(TraceLine(1.0, "decode", 0, 2, 2, 10, 2, None, 1.01).to_json())
    assert cl.main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no counter steps with their spans" in err[0]


def test_each_stretch_keeps_the_periods_of_its_own_typical_length(tmp_path):
    lines = [json.loads(x) for x in gzip.decompress(_trace(tmp_path, 0.02).read_bytes()).decode().splitlines()]
    long = TickRecord(50.0, 50.1, 1.0, 0.0, 0.0, 0.0, 0.0, [], 0.0, None, None, (CounterStep(50.0, 0.0, 49.7, 90.0),), (), 0.0)
    lines.append(json.loads(tick_line(long)))  # a read that saw three periods at once
    _, periods = cl.steps_and_periods(lines)
    assert any(abs(p.t1_s - p.t0_s - 0.3) < 0.005 for p in periods)
    assert all(abs(p.t1_s - p.t0_s - 0.1) < 0.005 for p in cl.typical(periods))
    # The H100's counter steps every 0.3 s at idle: 100 s of it outnumber the 20 s of serving's
    # 0.1 s periods over the whole trace, and must not hide them from the serving stretch's fit.
    for i in range(333):
        b = 30.0 + 0.3 * (i + 1)
        idle = TickRecord(b, b + 0.01, 1.0, 0.0, 0.0, 0.0, 0.0, [], 0.0, None, None, (CounterStep(b, 0.0, b - 0.3, 36.0),), (), 0.0)
        lines.append(json.loads(tick_line(idle)))
    _, periods = cl.steps_and_periods(lines)
    assert abs(cl.typical(periods)[0].t1_s - cl.typical(periods)[0].t0_s - 0.3) < 0.005  # the run's median: idle's
    head = cl.report(lines).splitlines()[0]
    assert head.startswith("stretch 1.0-") and "best lag +20 ms" in head


def test_periods_whose_joules_do_not_vary_give_no_lag_rather_than_the_first_one_tried(tmp_path):
    lines = [json.loads(x) for x in gzip.decompress(_trace(tmp_path, 0.0).read_bytes()).decode().splitlines()]
    for x in lines:
        for c in (x.get("tick") or {}).get("counter_steps") or ():
            c["span_j"] = 50.0
    steps, periods = cl.steps_and_periods(lines)
    assert cl.fit_lags(steps, periods) == []
    assert cl.segment_lag(cl.read_trace(lines), {"r0"}) is None
    with pytest.raises(ValueError, match="joules vary"):
        cl.report(lines)


def test_lags_that_fit_alike_report_the_one_nearest_0_ms():
    fits = [cl.LagFit(-30, 0.5, 1.0), cl.LagFit(-5, 0.5003, 1.0), cl.LagFit(0, 0.5, 1.0), cl.LagFit(25, 0.4, 1.0)]
    assert cl.best_fit(fits).lag_ms == 0
    assert cl.best_fit([*fits, cl.LagFit(25, 0.6, 0.9)]).lag_ms == 25


def test_a_counter_step_without_its_span_is_left_out_of_the_fit(tmp_path):
    lines = [json.loads(x) for x in gzip.decompress(_trace(tmp_path, 0.02).read_bytes()).decode().splitlines()]
    n = len(cl.steps_and_periods(lines)[1])
    ticks = [x["tick"] for x in lines if "tick" in x]
    ticks[3]["counter_steps"][0]["span_t0_s"] = None  # declared Optional in CounterStep
    assert len(cl.steps_and_periods(lines)[1]) == n - 1


def test_a_trace_without_step_end_times_says_so_in_one_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(TraceLine(1.0, "decode", 0, 2, 2, 10, 2, None, None).to_json())
    assert cl.main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no step with an end time (t_end)" in err[0]
