"""benchmarks/h200_decode_pacing_record.py: the pacing record from a tune-serving state file."""

import json

from benchmarks.h200_decode_pacing_record import main, same_request_ratios, windows


def _m(step, key, seed, tok_per_j, joules, duration_s):
    figures = {
        "output_tokens_per_joule": tok_per_j,
        "gpu_energy_j": joules,
        "energy_source": "measured",
        "completed": 10,
        "good": 10,
        "sent": 10,
        "duration_s": duration_s,
        "p99_ttft_ms": 50.0,
        "p99_tpot_ms": 5.0,
    }
    return {"kind": "measurement", "step": step, "key": key, "seed": seed, "figures": figures}


def test_the_record_pairs_windows_of_the_same_requests_and_says_none_is_settled(tmp_path, capsys):
    lines = [
        {"kind": "header"},
        _m("search/r0/decode_pacing_tpot_ms=off", "decode_pacing_tpot_ms=off", 0, 2.0, 1000.0, 20.0),
        _m("search/r0/decode_pacing_tpot_ms=35", "decode_pacing_tpot_ms=35", 0, 3.0, 2000.0 / 3.0, 33.0),
        _m("final/p1/winner", "decode_pacing_tpot_ms=35", 1001, 2.5, 400.0, 30.0),  # its stock arm not yet run
    ]
    (tmp_path / "state.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    ws = windows(tmp_path / "state.jsonl")
    assert [w["paced"] for w in ws] == [False, True, True] and [w["output_tokens"] for w in ws] == [2000, 2000, 1000]
    (r,) = same_request_ratios(ws)
    assert r == {
        "seed": 0,
        "kind": "search",
        "tok_per_j_ratio": 1.5,
        "energy_ratio": 0.667,
        "same_tokens": True,
        "duration_s": [33.0, 20.0],
    }
    assert main([str(tmp_path), "--device", "NVIDIA H200", "--lease", "L", "--out-dir", str(tmp_path / "out")]) == 0
    rec = json.loads((tmp_path / "out" / "h200-decode-pacing.json").read_text())
    assert rec["measured"] is True and rec["pairs"] == 0 and "no claim settled" in rec["status"]
    assert "x1.5" in (tmp_path / "out" / "h200-decode-pacing.md").read_text()
