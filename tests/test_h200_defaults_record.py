"""benchmarks/h200_defaults_record.py: pairing, the idle-power bound and the request-energy spread."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import h200_defaults_record as rec

ROOT = Path(__file__).resolve().parents[1]


def window(rate, tps, tokj, energy_j, window_s, idle_share, ttft=20.0, tpot=8.0):
    return {
        "request_rate": rate,
        "completed": 10,
        "output_throughput": tps,
        "output_tokens_per_joule": tokj,
        "gpu_energy_j": energy_j,
        "energy_window_s": window_s,
        "median_ttft_ms": ttft,
        "p99_tpot_ms": tpot,
        "gpu_avg_power_w": None if energy_j is None else energy_j / window_s,
        "sampler": {"gpu_idle_share": idle_share},
    }


def server(arm, idle_w, windows, **extra):
    return {"arm": arm, "label": arm, "idle": {"avg_power_w": idle_w}, "windows": windows, **extra}


def raw(servers, name="r.json"):
    return {
        "_file": name,
        "gpu": 0,
        "device": {"name": "GPU"},
        "measured": True,
        "servers": servers,
        "method": {"order": [s["arm"] for s in servers]},
    }


def test_pairs_are_adjacent_stock_defaults_servers_of_one_file_in_either_order():
    r = raw(
        [
            server("stock", 120, []),
            server("defaults", 80, []),
            server("defaults", 80, []),
            server("stock", 120, []),
            server("stock", 120, []),
        ]
    )
    pairs = rec.pair_servers([r])
    assert [p["order"] for p in pairs] == ["stock,defaults", "defaults,stock"]
    assert all(p["stock"]["arm"] == "stock" and p["defaults"]["arm"] == "defaults" for p in pairs)


def test_idle_bound_is_stock_idle_seconds_times_idle_power_difference_over_stock_energy():
    # stock: 10 s window, 60 % idle, 1000 J; idle powers 120 vs 80 W -> bound 6 s * 40 W / 1000 J = 0.24.
    s = server("stock", 120.0, [window("1", 100.0, 1.0, 1000.0, 10.0, 0.6)])
    d = server("defaults", 80.0, [window("1", 100.0, 1.25, 800.0, 10.0, 0.6)])
    row = rec.rates_block(rec.pair_servers([raw([s, d])]))[0]
    assert abs(row["idle_bound_saving"] - 0.24) < 1e-9
    assert abs(row["energy_saving"] - 0.2) < 1e-9  # 1 - 1.0 / 1.25
    assert abs(row["bound_attained"] - 0.2 / 0.24) < 1e-3
    assert row["out_tok_per_j_ratio"] == 1.25 and row["throughput_ratio"] == 1.0


def test_failed_window_leaves_its_pair_out_of_that_rate_only():
    bad = dict(window("4", 1.0, 1.0, 1.0, 1.0, 0.0), error="0 requests completed", completed=0)
    r = raw(
        [
            server("stock", 120, [window("1", 100, 1.0, 1000, 10, 0.5), bad]),
            server("defaults", 80, [window("1", 100, 1.1, 900, 10, 0.5), window("4", 400, 2.0, 2000, 10, 0.1)]),
        ]
    )
    rows = {x["request_rate"]: x for x in rec.rates_block(rec.pair_servers([r]))}
    assert rows[1.0]["pairs"] == 1 and rows[4.0]["pairs"] == 0 and rows[4.0]["out_tok_per_j_ratio"] is None


def test_ci_needs_two_pairs_and_brackets_the_mean():
    m, ci = rec.mean_ci([1.0])
    assert m == 1.0 and ci is None
    m, ci = rec.mean_ci([1.0, 1.2, 1.1])
    assert ci[0] < m < ci[1]


def test_record_cli_writes_both_records_and_degrades_without_energy(tmp_path):
    lines = [{"request_id": f"r{i}", "energy_j": 6.0 + (i % 5) * 0.1, "source": "measured"} for i in range(20)]
    d = server(
        "defaults",
        None,
        [dict(window("1", 100, None, None, 10, None), gpu_energy_j=None)],
        reqenergy={
            "n": 20,
            "concurrency": 4,
            "input_len": 128,
            "output_len": 96,
            "lines": lines,
            "plugin_energy_j_by_phase": {"idle": 10.0, "decode": 120.0},
            "counter_j": 130.0,
            "harness": {},
        },
    )
    s = server("stock", None, [dict(window("1", 100, None, None, 10, None), gpu_energy_j=None)])
    f = tmp_path / "raw.json"
    f.write_text(json.dumps({**raw([s, d]), "measured": False}))
    subprocess.run(
        [sys.executable, "-m", "benchmarks.h200_defaults_record", str(f), "--out-dir", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    out = json.loads((tmp_path / "h200-defaults.json").read_text())
    assert out["pairs"] == 1 and out["measured"] is False and out["rates"][0]["out_tok_per_j_ratio"] is None
    assert set(out["idle"]) >= {"stock_w", "defaults_w", "power_ratio"}
    assert set(out["starvation"]) >= {"idle_while_busy_j", "advice", "after_fix"}
    reqe = json.loads((tmp_path / "h200-request-energy.json").read_text())
    seg = reqe["segments"][0]
    assert seg["steady"]["n"] == 12  # 20 lines, 20 % dropped at each end
    assert abs(seg["requests_plus_idle_over_counter"] - (sum(x["energy_j"] for x in lines) + 10.0) / 130.0) < 1e-4


def test_pairs_run_across_raw_files_in_argument_order_abba_like():
    # Call A: S D D, call B: S S D (one GPU): (S,D) in A, (D,S) across A|B, (S,D) in B.
    a = raw([server("stock", 120, []), server("defaults", 80, []), server("defaults", 80, [])], name="a.json")
    b = raw([server("stock", 120, []), server("stock", 120, []), server("defaults", 80, [])], name="b.json")
    pairs = rec.pair_servers([a, b])
    assert [p["order"] for p in pairs] == ["stock,defaults", "defaults,stock", "stock,defaults"]
    assert [p["file"] for p in pairs] == ["a.json", "a.json+b.json", "b.json"]
    assert pairs[1]["defaults"] is a["servers"][2] and pairs[1]["stock"] is b["servers"][0]
    # The order given decides: B then A (S S D S D D) gives two pairs, each within one file.
    assert [(p["file"], p["order"]) for p in rec.pair_servers([b, a])] == [("b.json", "stock,defaults"), ("a.json", "stock,defaults")]


def test_pairs_never_span_two_gpus():
    a = raw([server("stock", 120, [])], name="a.json")
    b = {**raw([server("defaults", 80, [])], name="b.json"), "gpu": 1}
    assert rec.pair_servers([a, b]) == []


def test_fixed_span_figures_win_over_the_harness_window_when_both_arms_have_them():
    # Harness window says tok/J 1.0 vs 1.0; the fixed span (idle tail included) says 0.5 vs 0.6.
    ws = dict(
        window("0.2", 10, 1.0, 100.0, 5.0, 0.0),
        span={"energy_j": 1000.0, "seconds": 10.0, "out_tok_per_j": 0.5, "gpu_idle_share": 0.5, "avg_power_w": 100.0},
    )
    wd = dict(
        window("0.2", 10, 1.0, 100.0, 5.0, 0.0),
        span={"energy_j": 833.3, "seconds": 10.0, "out_tok_per_j": 0.6, "gpu_idle_share": 0.5, "avg_power_w": 83.3},
    )
    row = rec.rates_block(rec.pair_servers([raw([server("stock", 120.0, [ws]), server("defaults", 80.0, [wd])])]))[0]
    assert abs(row["out_tok_per_j_ratio"] - 1.2) < 1e-9 and row["stock_gpu_idle_share"] == 0.5
    assert abs(row["idle_bound_saving"] - 0.5 * 10.0 * 40.0 / 1000.0) < 1e-9
    assert row["energy_window"].startswith("fixed span")
    # One arm without a span: both fall back to the harness window.
    wd2 = {k: v for k, v in wd.items() if k != "span"}
    row = rec.rates_block(rec.pair_servers([raw([server("stock", 120.0, [ws]), server("defaults", 80.0, [wd2])])]))[0]
    assert row["out_tok_per_j_ratio"] == 1.0 and row["energy_window"].startswith("harness")


def test_trace_out_summarises_closed_loop_decisions_per_bucket(tmp_path):
    import gzip
    import io
    import tarfile

    steps = [
        {
            "t": i * 0.02,
            "phase": "decode",
            "prefill": 0,
            "decode": 40,
            "rows": 40,
            "ctx": 4000,
            "reqs": 40,
            "sm_target": None,
            "t_end": i * 0.02 + 0.010 + 0.0001 * (i % 11),
        }
        for i in range(50)
    ]
    steps += [{"t": 2.0, "phase": "prefill", "prefill": 512, "decode": 0, "rows": 1, "ctx": 0, "reqs": 1, "sm_target": None, "t_end": 2.05}]
    recs = [
        {
            "t_s": 1.0,
            "event": "baseline_done",
            "bucket": 32,
            "batch": 40,
            "sm_clock_mhz": None,
            "ran_at_mhz": None,
            "step_ms": 10.2,
            "ratio": None,
            "target_ratio": 1.01,
            "margin": None,
            "baseline_ms": 10.3,
            "spread_pct": 0.8,
            "probes": 0,
            "reason": "12 default-clock steps",
        },
        {
            "t_s": 1.1,
            "event": "probe",
            "bucket": 32,
            "batch": 40,
            "sm_clock_mhz": 1410,
            "ran_at_mhz": None,
            "step_ms": None,
            "ratio": None,
            "target_ratio": 1.01,
            "margin": None,
            "baseline_ms": None,
            "spread_pct": 0.8,
            "probes": 1,
            "reason": "bisection",
        },
        {
            "t_s": 1.5,
            "event": "unmeasured",
            "bucket": 32,
            "batch": 40,
            "sm_clock_mhz": None,
            "ran_at_mhz": None,
            "step_ms": 10.1,
            "ratio": None,
            "target_ratio": 1.01,
            "margin": None,
            "baseline_ms": None,
            "spread_pct": 0.8,
            "probes": 1,
            "reason": "dry-run: no step ran at 1410 MHz, counted as a reject",
        },
    ]
    text = "".join(json.dumps(x) + "\n" for x in steps) + "".join(json.dumps({"closed_loop": x}) + "\n" for x in recs)
    tar_f = tmp_path / "servers-t1.tar.gz"
    with tarfile.open(tar_f, "w:gz") as t:
        data = gzip.compress(text.encode())
        info = tarfile.TarInfo("defaults1-trace-rank0.jsonl.gz")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    d = server("defaults", 80, [window("1", 100, 1.0, 1000, 10, 0.5)], snapshot={"closed_loop": {"active_bucket": 32}})
    d["label"] = "defaults1"
    s = server("stock", 120, [window("1", 100, 1.0, 1000, 10, 0.5)])
    f = tmp_path / "defaults-t1.json"
    f.write_text(json.dumps({**raw([s, d]), "tag": "t1"}))
    stem = tmp_path / "cl" / "h200-closed-loop-decisions"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.h200_defaults_record",
            str(f),
            "--out-dir",
            str(tmp_path),
            "--trace-out",
            str(stem),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    out = json.loads(stem.with_suffix(".json").read_text())
    (srv,) = out["servers"]
    assert srv["decisions_by_kind"] == {"baseline_done": 1, "probe": 1, "unmeasured": 1}
    assert srv["steps_observed"] == 51 and srv["decode_steps"] == 50
    b = srv["buckets"]["32"]
    assert b["default_clock_step_ms"]["n"] == 50 and 10.0 <= b["default_clock_step_ms"]["median"] <= 11.1
    assert b["default_clock_step_ms"]["p10"] <= b["default_clock_step_ms"]["median"] <= b["default_clock_step_ms"]["p90"]
    assert b["would_probe_mhz"] == [1410] and b["controller_baseline_ms"] == [10.3]
    assert srv["snapshot_closed_loop"] == {"active_bucket": 32}
    assert "1410" in stem.with_suffix(".md").read_text()
