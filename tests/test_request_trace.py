"""benchmarks/request_trace.py: a request-energy segment's spread read back from a step trace,
by where each request finished in the counter's period, and its outliers tick by tick."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import request_trace as rt
from vllm_powersave.energy.account import TickRecord
from vllm_powersave.energy.meters import CounterStep
from vllm_powersave.stats_contract import tick_line


def _files(tmp_path, with_gains: bool = True):
    """Ten requests, one made final per 0.1 s tick; r7 gained 4 J more than the others, in a tick
    whose read saw a counter step of +3 J; tick i's read came 4 + i ms after it began (traces
    without gains are older: no read lag either)."""
    lines, energy = [], {}
    for i in range(10):
        rid, t0 = f"r{i}", 1.0 + 0.1 * i
        gains = ((rid, 10.0 + (4.0 if i == 7 else 0.0)),) if with_gains else ()
        steps = (CounterStep(t0 + 0.03, 3.0 if i == 7 else 0.1, t0 - 0.07, 40.0),)
        rec = TickRecord(t0, t0 + 0.1, 40.0, 0.1, 0.0, 0.0, 0.0, [rid], 0.0, None, None, steps, gains, 0.004 + 0.001 * i)
        line = json.loads(tick_line(rec))
        if not with_gains:
            del line["tick"]["read_lag_s"]
        lines.append(json.dumps(line))
        energy[rid] = 10.0 + (4.0 if i == 7 else 0.0)
    trace = tmp_path / "defaults0-trace-rank0.jsonl.gz"
    trace.write_bytes(gzip.compress("\n".join(lines).encode()))
    raw = {"servers": [{"reqenergy_runs": [{"lines": [{"request_id": r, "energy_j": j} for r, j in energy.items()]}]}]}
    return trace, raw


def test_the_outliers_are_told_with_the_ticks_that_gave_them_joules(tmp_path):
    trace, raw = _files(tmp_path)
    out = rt.report(rt.trace_lines(trace, None), rt.segment_lines(raw, 0), top=1)
    assert out.startswith("6 steady requests over their median")  # the middle 60 % of ten
    assert "r7: 1.400 of the median" in out and "gain +14.000 J" in out and "steps 1.730 +3.0 J" in out
    assert "70-90" not in out and "60-80 ms after a step: n   6" in out  # each finished 70 ms after a step
    # the steady requests' ticks (2 to 7) read 6 to 11 ms after they began
    assert "counter reads after their tick began (6 ticks): p50 9.0 ms  p95 10.0 ms  max 11.0 ms" in out


def test_a_trace_without_request_gains_says_so_and_a_missing_segment_is_one_line(tmp_path):
    trace, raw = _files(tmp_path, with_gains=False)
    out = rt.report(rt.trace_lines(trace, None), rt.segment_lines(raw, 0), top=1)
    assert "carry no request_j" in out and "gain +" not in out and "counter reads after" not in out
    with pytest.raises(ValueError, match="--segment 3: the file has 1 request-energy segment"):
        rt.segment_lines(raw, 3)
    with pytest.raises(ValueError, match="the run file has no server"):
        rt.segment_lines({"servers": []}, 0)
    assert json.loads(tick_line(TickRecord(0.0, 0.1, 1.0, 0.1, 0.0, 0.0, 0.0, [])))["tick"]["request_j"] == {}
