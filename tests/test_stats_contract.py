"""stats_contract.py: what the worker writes is what the contract declares, in the same JSON as before."""

import json
from types import SimpleNamespace

from vllm_powersave import stats_contract as sc
from vllm_powersave import vllm_compat
from vllm_powersave.runtime import WorkerRuntime
from vllm_powersave.settings import PowersaveSettings


def test_file_names_match_their_globs():
    from fnmatch import fnmatch

    for rank in (0, 7, 12):
        assert fnmatch(sc.snapshot_name(rank), sc.SNAPSHOT_GLOB) and fnmatch(sc.requests_name(rank), sc.REQUESTS_GLOB)
        assert fnmatch(sc.trace_name(rank), sc.TRACE_GLOB)
    assert sc.snapshot_name(3) == "rank3.json" and sc.requests_name(3) == "requests-rank3.jsonl" and sc.trace_name(3) == "trace-rank3.jsonl"
    assert not fnmatch(sc.requests_name(0), sc.SNAPSHOT_GLOB) and not fnmatch(sc.trace_name(0), sc.SNAPSHOT_GLOB)


def test_request_line_is_the_earlier_json_and_reads_back():
    line = sc.RequestLine("cmpl-1-0", 1.23456789, "measured", "energy-counter", "GPU-a", 2)
    earlier = (
        json.dumps(
            {
                "request_id": "cmpl-1-0",
                "energy_j": round(1.23456789, 6),
                "source": "measured",
                "method": "energy-counter",
                "gpu": "GPU-a",
                "rank": 2,
            }
        )
        + "\n"
    )
    assert line.to_json() == earlier
    assert sc.RequestLine.from_json(json.loads(earlier)) == sc.RequestLine("cmpl-1-0", 1.234568, "measured", "energy-counter", "GPU-a", 2)
    unavailable = sc.RequestLine("r", None, "measured", "energy-counter", "GPU-a", 0)
    assert json.loads(unavailable.to_json())["energy_j"] is None


def test_trace_line_round_trips():
    r = sc.TraceLine(1.5, "decode", 0, 4, 4, 400, 4, 1200, 1.502)
    d = json.loads(r.to_json())
    assert list(d) == list(sc.TRACE_KEYS) and sc.TraceLine.from_json(d) == r


def test_every_key_the_worker_writes_is_declared(monkeypatch, tmp_path):
    """A simulated worker with every optional part on (meter, trace, per-request energy, presets):
    its snapshot's keys, and those of its window and steady dicts, are all in the contract."""
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    rt = WorkerRuntime(
        SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=2, async_scheduling=False)),
        PowersaveSettings.model_validate(
            {
                "stats_dir": str(tmp_path),
                "trace_steps": True,
                "per_request_energy": True,
                "energy": {"meter": "simulated", "idle_after_s": 20.0},
                "clocks": {"backend": "simulated", "presets": {"decode": {"sm_clock_mhz": 1200}}},
            }
        ),
    )
    try:
        snap = rt.snapshot()
    finally:
        rt.close()
    assert snap["energy_available"] is True and "window" in snap and "steady" in snap
    assert set(snap) <= set(sc.WorkerSnapshot.__annotations__), set(snap) - set(sc.WorkerSnapshot.__annotations__)
    assert set(snap["window"]) <= set(sc.Window.__annotations__)
    assert set(snap["steady"]) <= set(sc.Steady.__annotations__)
    on_disk = sc.snapshot_from_json((tmp_path / sc.snapshot_name(0)).read_text())
    assert set(on_disk) <= set(sc.WorkerSnapshot.__annotations__)


def test_tick_and_boost_trace_lines_name_their_kind_and_keep_the_steps_clock():
    from vllm_powersave.clocks.boost import BoostSwitch
    from vllm_powersave.energy.account import TickRecord
    from vllm_powersave.stats_contract import boost_line, tick_line

    tick = json.loads(tick_line(TickRecord(10.1234567, 10.3, 42.0, 0.15, 0.02, 0.0, 0.0, ["r1"])))
    assert list(tick) == ["tick"] and tick["tick"]["t0_s"] == 10.123457 and tick["tick"]["finished"] == ["r1"]
    assert json.loads(boost_line(BoostSwitch(5.5, False, 70.0))) == {"boost": {"t_s": 5.5, "held": False, "ms": 70.0}}
    assert tick["tick"]["counter_steps"] == [] and tick["tick"]["power_w"] is None


def test_a_tick_line_carries_the_counter_steps_and_powers_behind_its_booking():
    """Where a burst's joules went is read from the trace: each tick's instant and rest power and
    the counter steps its reads saw (time, jump, the span they close)."""
    from vllm_powersave.energy.account import TickRecord
    from vllm_powersave.energy.meters import CounterStep
    from vllm_powersave.stats_contract import tick_line

    rec = TickRecord(1.0, 1.25, 30.0, 0.1, 0.0, 0.15, 11.0, [], 2.5, 431.27, 127.04, (CounterStep(1.2, 12.61234567, 1.1, 40.0),))
    d = json.loads(tick_line(rec))["tick"]
    assert (d["power_w"], d["rest_power_w"]) == (431.3, 127.0)
    assert d["counter_steps"] == [{"t_s": 1.2, "jump_j": 12.612346, "span_t0_s": 1.1, "span_j": 40.0, "read_t0_s": None, "ext_j": None}]


def test_rank_decisions_of_a_trace_with_ticks_boosts_and_decisions_are_its_steps_only(tmp_path):
    """The tensor-parallel and Ray tests compare the ranks' step lines; the same file carries the
    closed loop's decisions, boost switches and energy ticks, which have no phase."""
    from fakes import rank_decisions

    from vllm_powersave.clocks.boost import BoostSwitch
    from vllm_powersave.energy.account import TickRecord

    step = sc.TraceLine(10.0, "decode", 0, 4, 4, 400, 4, 1200, 10.01)
    for r in (0, 1):
        (tmp_path / sc.trace_name(r)).write_text(
            sc.trace_line(step)
            + sc.boost_line(BoostSwitch(10.2, True, 170.0))
            + sc.tick_line(TickRecord(10.0, 10.25, 40.0, 0.01, 0.24, 0.0, 0.0, []))
            + json.dumps({sc.CLOSED_LOOP_KEY: {"event": "bucket"}})
            + "\n"
        )
    assert rank_decisions(tmp_path) == {0: [("decode", 0, 4, 1200)], 1: [("decode", 0, 4, 1200)]}
