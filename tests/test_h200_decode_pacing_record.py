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
        "tok_per_j_ratio_raw": 1.5,
        "energy_ratio": 0.667,
        "same_tokens": True,
        "duration_s": [33.0, 20.0],
    }
    assert main([str(tmp_path), "--device", "NVIDIA H200", "--lease", "L", "--out-dir", str(tmp_path / "out")]) == 0
    rec = json.loads((tmp_path / "out" / "h200-decode-pacing.json").read_text())
    assert rec["measured"] is True and rec["pairs"] == 0 and "no claim is settled" in rec["status"]
    assert rec["pair_tok_per_j_ratio"] is None
    assert "x1.5" in (tmp_path / "out" / "h200-decode-pacing.md").read_text()


def test_pairs_get_a_95_percent_interval_and_six_of_them_settle_the_claim():
    from benchmarks.h200_decode_pacing_record import pair_interval, status

    def pair(x):
        return {"kind": "pair", "tok_per_j_ratio": x}

    three = [pair(1.4), pair(1.5), pair(1.3)]
    assert pair_interval(three) == {"mean": 1.4, "ci95": [1.152, 1.648], "n": 3}
    assert "fewer than 6 adjacent pairs" in status(three) and "x1.4 (95 % CI 1.152-1.648)" in status(three)
    assert "fewer than 6" not in status(three * 2) and status(three * 2).startswith("6 ABBA pair(s)")


def test_a_record_of_another_gpu_gets_its_own_name(tmp_path, capsys):
    lines = [_m("final/p1/winner", "decode_pacing_tpot_ms=35", 1001, 2.5, 400.0, 30.0)]
    (tmp_path / "state.jsonl").write_text(json.dumps(lines[0]) + "\n")
    out = tmp_path / "out"
    assert (
        main([str(tmp_path), "--device", "NVIDIA H100 80GB HBM3", "--lease", "L", "--out-dir", str(out), "--name", "h100-decode-pacing"])
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["h100-decode-pacing.json", "h100-decode-pacing.md"]
    assert (out / "h100-decode-pacing.md").read_text().startswith("# h100-decode-pacing: ")


def test_a_bad_name_is_one_line_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "state.jsonl").write_text(json.dumps(_m("final/p1/winner", "decode_pacing_tpot_ms=35", 1001, 2.5, 400.0, 30.0)) + "\n")
    for name in ("", "a/b", "../x", ".hidden"):
        assert main([str(tmp_path), "--device", "D", "--lease", "L", "--out-dir", str(tmp_path / "out"), "--name", name]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "x.json").exists()


def test_the_pairs_interval_is_of_the_unrounded_ratios():
    from benchmarks.h200_decode_pacing_record import pair_interval, same_request_ratios

    ws = [
        {
            "step": f"final/p{i}/{arm}",
            "seed": 1000 + i,
            "paced": arm == "winner",
            "tok_per_j": t,
            "gpu_energy_j": 1.0,
            "output_tokens": 1,
            "duration_s": 1.0,
        }
        for i, pair in enumerate([(3.0797, 2.1967), (3.4073, 2.3932), (3.0157, 2.1769)], start=1)
        for arm, t in zip(("winner", "defaults"), pair)
    ]
    assert pair_interval(same_request_ratios(ws))["ci95"] == [1.356, 1.452]  # the rounded ratios gave 1.355
