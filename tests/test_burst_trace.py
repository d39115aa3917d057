"""benchmarks/burst_trace.py: a server's step trace read back as bursts, their steps, and the
energy ticks and counter steps around them."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

from benchmarks import burst_trace as bt
from vllm_powersave.energy.account import TickRecord
from vllm_powersave.energy.meters import CounterStep
from vllm_powersave.stats_contract import tick_line


def _trace() -> list[str]:
    step = {"phase": "prefill", "decode": 0, "rows": 1, "reqs": 1, "sm_target": None}
    lines = [json.dumps({**step, "t": 1.0, "prefill": 8, "t_end": 1.01})]  # a null request: no burst
    for t0 in (5.0, 10.0):  # two bursts of two steps each
        lines += [
            json.dumps({**step, "t": t0, "prefill": 1900, "t_end": t0 + 0.02}),
            json.dumps({**step, "t": t0 + 0.02, "prefill": 5700, "reqs": 3, "t_end": t0 + 0.04}),
        ]
        lines.append(tick_line(TickRecord(t0 - 0.25, t0 - 0.01, 18.0, 0.0, 0.0, 0.24, 18.0, [])).strip())
        rec = TickRecord(
            t0 - 0.01, t0 + 0.2, 110.0, 0.04, 0.15, 0.02, 2.0, ["a", "b"], 5.0, 431.0, 127.0, (CounterStep(t0 + 0.1, 12.5, t0, 60.0),)
        )
        lines.append(tick_line(rec).strip())
    lines.append(json.dumps({"tick": {"t0_s": 10.2, "t1_s": 10.45, "energy_j": 30.0, "busy_s": 0, "gap_s": 0, "idle_s": 0.25, "idle_j": 30.0, "finished": []}}))  # fmt: skip
    return lines


def test_bursts_are_told_with_their_steps_ticks_and_counter_steps(tmp_path):
    path = tmp_path / "defaults0-trace-rank0.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(_trace()).encode()))
    out = bt.report(bt.trace_lines(path, None), 1000, 1.0)
    assert out.count("burst ") == 2 and "2 step(s), 7600 prefill tokens" in out and "8 tokens" not in out
    assert "counter step at 5.100: jump +12.5 J, 60.0 J since 5.000" in out and "power 431.0 W  rest 127.0 W" in out
    last = out.splitlines()[-1]  # a tick line from before the counter-step fields: no power, no steps
    assert last.startswith("  tick 10.200-10.450") and "power" not in last
    assert bt.report(bt.trace_lines(path, None), 10_000, 1.0).startswith("no prefill step of at least 10000")


def test_a_servers_tarball_is_read_by_server_label_and_a_missing_one_is_one_line(tmp_path, capsys):
    tar_path = tmp_path / "servers.tar.gz"
    data = gzip.compress("\n".join(_trace()).encode())
    with tarfile.open(tar_path, "w:gz") as tar:
        info = tarfile.TarInfo("defaults0-trace-rank0.jsonl.gz")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert len(bt.find_bursts(bt.trace_lines(tar_path, "defaults0"), 1000)) == 2
    assert bt.main([str(tar_path), "--server", "stock0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no step trace of server 'stock0'" in err


def _raw(tmp_path):
    def span(prefill_j, counter_j, cut_j, end_w, busy_s):
        cut = {"cut_s": 1.3, "counter_j": cut_j, "end_power_w": end_w}
        return {
            "span_s": 3.0,
            "busy_s": busy_s,
            "counter_j": counter_j,
            "plugin_phases_j": {"prefill": prefill_j, "idle": 300.0},
            "cut": cut,
        }

    null = span(2.0, 324.0, 156.0, 125.0, 0.04)
    runs = [
        {"order": ["null", "burst"], "burst": span(130.0, 440.0, 270.0, 125.0, 0.2), "null": null},
        {"order": ["burst", "null"], "burst": span(131.0, 441.0, 271.0, 150.0, 0.2), "null": null},
    ]
    bursts = {"n": 2, "conc": 4, "input_len": 1900, "idle_w": 72.0, "runs": runs}
    path = tmp_path / "defaults-gpu0-1.json"
    path.write_text(json.dumps({"servers": [{"label": "defaults0", "bursts": bursts}]}))
    return path


def test_with_the_runs_json_each_burst_of_the_segments_size_is_headed_by_its_pairs_figures(tmp_path):
    """Pairs match bursts of conc x input_len prompt tokens (within 10 %) in order; the null
    request's 8 tokens and any other burst are no pair's. The truth: cut difference 114 J, hold
    125 W x 0.16 s extra busy time, the null's work 2 J: 136 J against a 130 J booking."""
    trace = tmp_path / "defaults0-trace-rank0.jsonl.gz"
    trace.write_bytes(gzip.compress("\n".join(_trace()).encode()))
    out = bt.report(bt.trace_lines(trace, None), 1000, 1.0, bt.PairFigures.load(_raw(tmp_path), None))
    heads = [x for x in out.splitlines() if x.startswith("burst ")]
    assert heads[0].endswith("; pair 0: phase / truth 0.956 (130.0 J / 136.0 J)"), heads[0]
    assert "; pair 1: not judged (cuts end 150 W vs 125 W" in heads[1], heads[1]


def test_a_runs_json_without_a_bursts_segment_is_one_line(tmp_path, capsys):
    trace = tmp_path / "defaults0-trace-rank0.jsonl.gz"
    trace.write_bytes(gzip.compress("\n".join(_trace()).encode()))
    raw = tmp_path / "defaults-gpu0-2.json"
    raw.write_text(json.dumps({"servers": [{"label": "defaults0"}]}))
    assert bt.main([str(trace), "--raw", str(raw)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no bursts segment" in err
