"""benchmarks/h200_defaults_record.py: pairing, the idle-power bound and the request-energy spread."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def _reqe_run(inp, out, rate, js, idle_j, tail_j, counter_j):
    lines = [{"request_id": f"r{i}", "energy_j": j, "source": "measured", "method": "energy-counter"} for i, j in enumerate(js)]
    return {"n": len(js), "concurrency": 16, "input_len": inp, "output_len": out, "request_rate": rate, "lines": lines,
            "plugin_energy_j_by_phase": {"idle": idle_j, "decode": 1.0}, "counter_j": counter_j, "tail_j": tail_j, "harness": {}}  # fmt: skip


def test_several_request_energy_shapes_of_one_server_are_one_segment_each_with_their_checks():
    good = _reqe_run(256, 64, 40.0, [1.0] * 10, idle_j=5.0, tail_j=1.0, counter_j=16.0)  # (10 + 5 + 1) / 16 = 1.0
    spread = _reqe_run(1024, 32, 10.0, [1.0] * 8 + [0.5, 2.0], idle_j=5.0, tail_j=0.0, counter_j=20.0)  # 15.5 / 20: 22 % short
    d = server("defaults", 80, [], reqenergy_runs=[good, spread])
    segs = rec.request_energy([raw([d])], drop=0.0)["segments"]
    assert [(s["input_len"], s["output_len"], s["request_rate"]) for s in segs] == [(256, 64, 40.0), (1024, 32, 10.0)]
    assert segs[0]["checks"] == {"p5_ge_0_90": True, "p95_le_1_10": True, "max_le_1_30": True, "sum_within_1pct": True}
    assert segs[1]["checks"]["max_le_1_30"] is False and segs[1]["checks"]["sum_within_1pct"] is False


def test_request_energy_only_keeps_the_older_segments_before_the_new(tmp_path):
    run = _reqe_run(128, 256, 8.0, [2.0] * 5, 1.0, 0.0, 11.0)
    (old := tmp_path / "old.json").write_text(json.dumps(raw([server("defaults", 80, [], reqenergy_runs=[run])], name="x")))
    rec.main([str(old), "--out-dir", str(tmp_path), "--reqe-only", "--steady-drop", "0"])
    f = tmp_path / "new.json"
    f.write_text(
        json.dumps(raw([server("defaults", 80, [], reqenergy_runs=[_reqe_run(128, 256, 8.0, [2.0] * 5, 1.0, 0.0, 11.0)])], name="x"))
    )
    rec.main([str(f), "--out-dir", str(tmp_path), "--reqe-only", "--steady-drop", "0"])
    segs = json.loads((tmp_path / "h200-request-energy.json").read_text())["segments"]
    assert [s["file"] for s in segs] == ["old.json", "new.json"] and not (tmp_path / "h200-defaults.json").exists()
    rec.main([str(f), "--out-dir", str(tmp_path), "--reqe-only", "--steady-drop", "0"])  # rebuilt: replaces its own
    assert [s["file"] for s in json.loads((tmp_path / "h200-request-energy.json").read_text())["segments"]] == ["old.json", "new.json"]


def test_a_request_energy_record_names_the_devices_of_every_segment_it_keeps(tmp_path):
    """The record keeps older files' segments; its ``devices`` named only the last call's GPU (an
    H100 record of 30 H100 and 7 H200 segments said H100 alone)."""
    run = _reqe_run(128, 256, 8.0, [2.0] * 5, 1.0, 0.0, 11.0)
    for name, gpu in (("old.json", "NVIDIA H200"), ("new.json", "NVIDIA H100 80GB HBM3")):
        r = raw([server("defaults", 80, [], reqenergy_runs=[run])], name="x") | {"device": {"name": gpu}}
        (tmp_path / name).write_text(json.dumps(r))
        rec.main([str(tmp_path / name), "--out-dir", str(tmp_path), "--reqe-only", "--steady-drop", "0"])
    out = json.loads((tmp_path / "h200-request-energy.json").read_text())
    assert out["devices"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert [s["device"] for s in out["segments"]] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]


def test_the_request_energy_twin_keeps_its_hand_written_runs_and_findings(tmp_path):
    run = _reqe_run(128, 256, 8.0, [2.0] * 5, 1.0, 0.0, 11.0)
    (f := tmp_path / "a.json").write_text(json.dumps(raw([server("defaults", 80, [], reqenergy_runs=[run])], name="x")))
    rec.main([str(f), "--out-dir", str(tmp_path), "--reqe-only", "--steady-drop", "0"])
    twin = tmp_path / "h200-request-energy.md"
    twin.write_text(twin.read_text() + "\n## Runs\n\nwritten by hand\n")
    rec.main([str(f), "--out-dir", str(tmp_path), "--reqe-only", "--steady-drop", "0"])
    text = twin.read_text()
    assert text.count("written by hand") == 1 and text.index("| run |") < text.index("## Runs")


def test_request_energy_shapes_parse_or_name_the_bad_item():
    import argparse

    from benchmarks import h200_defaults as job

    ns = argparse.Namespace(reqe_shapes="256:64:40:480,128:256:auto:160", reqe_in=1, reqe_out=1, reqe_rate="auto", reqe_n=1)
    a, b = job.reqe_shapes(ns)
    assert (a.input_len, a.output_len, a.start_rate(48, 5.5), a.n) == (256, 64, 40.0, 480)
    assert b.start_rate(48, 5.5) == pytest.approx(48 / ((256 * 5.5 + 50) / 1e3))
    for bad in ("256:64:40", "256:0:40:10", "256:64:fast:10", "256:64:-1:10"):
        with pytest.raises(ValueError, match=f"--reqe-shapes: '{bad}'"):
            job.reqe_shapes(argparse.Namespace(**{**vars(ns), "reqe_shapes": bad}))


def test_bursts_give_the_busy_over_truth_spread_and_whether_each_is_within_5pct():
    runs = [{"busy_over_truth": x} for x in (0.97, 1.02, 1.04)] + [{"note": "no plugin snapshot with energy_j"}]
    b = {
        "n": 4,
        "conc": 4,
        "input_len": 1900,
        "idle_w": 80.0,
        "runs": runs,
        "crosscheck": {'powersave_energy_crosscheck_ratio{gpu="0"}': 1.01},
    }
    (o,) = rec.bursts_block([raw([server("defaults", 80, [], bursts=b)])])
    assert o["busy_over_truth"] == {"n": 3, "median": 1.02, "min": 0.97, "max": 1.04} and o["within_5pct"] is True
    runs.append({"busy_over_truth": 0.8})
    assert rec.bursts_block([raw([server("defaults", 80, [], bursts=b)])])[0]["within_5pct"] is False


def test_a_snapshot_span_is_read_on_perf_counter_and_diffed_by_phase():
    from benchmarks.h200_defaults import SnapMark, snap_between

    m0 = SnapMark(wall=1000.0, perf=50.0, snap={"t": 1000.4, "energy_j": {"idle": 10.0, "decode": 5.0}})
    m1 = SnapMark(wall=1010.0, perf=60.0, snap={"t": 1011.0, "energy_j": {"idle": 12.0, "decode": 9.0, "prefill": 1.0}})
    assert abs(m0.perf_t - 50.4) < 1e-9 and m1.perf_t == 61.0
    assert snap_between(m0, m1) == {"idle": 2.0, "decode": 4.0, "prefill": 1.0}
    assert snap_between(m0, SnapMark(1010.0, 60.0, None)) is None and SnapMark(1.0, 2.0, None).perf_t == 2.0


def _span(span_s, busy_j, tail_j, idle_w=70.0):
    """A span at ``idle_w`` with ``busy_j`` of work and ``tail_j`` above deep idle after it,
    which the plugin books as idle."""
    return {"span_s": span_s, "busy_s": 0.1, "counter_j": idle_w * span_s + busy_j + tail_j,
            "plugin_phases_j": {"prefill": busy_j, "decode": 0.0, "idle": idle_w * span_s + tail_j}}  # fmt: skip


def test_a_burst_is_judged_against_a_null_request_so_the_tail_after_any_request_cancels():
    from benchmarks.h200_defaults import burst_pair_figures

    f = burst_pair_figures(_span(3.0, 150.0, 35.0), _span(3.02, 5.0, 35.0), 70.0)
    assert f["true_busy_j"] == pytest.approx(145.0) and f["busy_over_truth"] == pytest.approx(1.0)
    assert f["idle_above_deep_j"] == {"burst": pytest.approx(35.0), "null": pytest.approx(35.0)}
    # Against deep idle alone, the tail would count as the burst's: 150 / 185, the H100's first reading.
    assert 150.0 / (150.0 + 35.0) < 0.95
    under = burst_pair_figures(_span(3.0, 120.0, 65.0), _span(3.0, 5.0, 35.0), 70.0)  # the plugin books 30 J of it as idle
    assert under["busy_over_truth"] == pytest.approx(115.0 / 145.0)
    missing = burst_pair_figures({**_span(3.0, 150.0, 35.0), "counter_j": None}, _span(3.0, 5.0, 35.0), 70.0)
    assert missing["busy_over_truth"] is None and "note" in missing
    for tiny in (5.001, 4.0):  # truth 0.001 J, then -1 J: no ratio, a note
        f = burst_pair_figures(_span(3.0, tiny, 35.0), _span(3.0, 5.0, 35.0), 70.0)
        assert f["busy_over_truth"] is None and "not judged" in f["note"]


def test_every_burst_and_null_request_has_its_own_seed_in_alternating_order(monkeypatch):
    import argparse
    import time

    from benchmarks import h200_defaults as job

    calls = []

    class FakeSampler:
        def energy_between(self, t_a, t_b):
            return 70.0 * (t_b - t_a)

    class FakeServer(job.Server):
        def harness(self, name, **kw):
            calls.append((name, kw["seed"], kw["num_prompts"], kw["input_len"]))
            return {"res": {"duration": 0.001}, "t0": time.perf_counter()}

        def mark(self):
            return job.SnapMark(time.time(), time.perf_counter(), {"energy_j": {"prefill": 0.0, "idle": 0.0}})

    monkeypatch.setattr(job.load, "scrape", lambda port: ({}, ""))
    ns = argparse.Namespace(burst_n=3, burst_gap_s=0.0, burst_span_s=0.001, burst_conc=4, burst_in=1900, burst_cut_s=1.2)
    out = FakeServer(ns, FakeSampler(), 0, "d0", None, None).bursts(70.0)
    # Each span's cut: from 0.1 s before its request to 1.2 s after, with the power over its last 0.4 s.
    assert out["cut_s"] == pytest.approx(1.3) and out["runs"][0]["burst"]["cut"]["counter_j"] == pytest.approx(70.0 * 1.3)
    assert out["runs"][0]["null"]["cut"]["end_power_w"] == pytest.approx(70.0)
    assert [c[0][:4] for c in calls] == ["null", "burs", "burs", "null", "null", "burs"]
    seeds = [c[1] for c in calls if c[0].startswith("burst")]
    assert len(set(seeds)) == 3 and all(c[2:] == (4, 1900) for c in calls if c[0].startswith("burst"))
    assert out["method"] == "null-request control" and [r["order"] for r in out["runs"]][:2] == [["null", "burst"], ["burst", "null"]]


def test_an_ablation_runs_the_defaults_arm_with_its_settings_and_refuses_a_bad_one(tmp_path):
    import argparse

    from benchmarks import h200_defaults as job

    ns = job.parse_args(["--defaults-settings", '{"cuda_perf_boost": "on"}', "--defaults-observe", "none", "--gpu", "0"])
    s = job.Server(ns, None, 0, "defaults1", tmp_path, tmp_path / "stats")
    srv = {"arm": "defaults"}
    _, extra, env = job.launch(ns, s, srv, None)
    assert json.loads(Path(env["POWERSAVE_CONFIG"]).read_text()) == {"powersave": {"cuda_perf_boost": "on"}}
    assert srv["ablation_settings"] == {"cuda_perf_boost": "on"} and extra == ["--plugin", "powersave"]
    assert "POWERSAVE_CONFIG" not in job.launch(job.parse_args([]), s, {"arm": "stock"}, None)[2]
    fix = {"arm": "fix"}
    job.launch(ns, s, fix, None)  # the fix arm keeps its serve flags alone: no ablation settings
    assert "ablation_settings" not in fix
    for bad, why in (('{"cuda_perf_boost": "sometimes"}', "cuda_perf_boost"), ("[1]", "not a JSON object")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            job.defaults_settings(bad)


def test_an_ablation_arm_runs_beside_plain_defaults_in_one_order_and_needs_its_settings(tmp_path, monkeypatch, capsys):
    from benchmarks import h200_defaults as job

    args = ["--order", "stock,defaults,ablation,stock", "--defaults-settings", '{"cuda_perf_boost": "on"}', "--defaults-observe", "none"]
    ns = job.parse_args([*args, "--gpu", "0"])
    s = job.Server(ns, None, 0, "x", tmp_path, tmp_path / "stats")
    plain, abl = {"arm": "defaults"}, {"arm": "ablation"}
    assert "POWERSAVE_CONFIG" not in job.launch(ns, s, plain, None)[2]  # the product's defaults, untouched
    _, extra, env = job.launch(ns, s, abl, None)
    assert json.loads(Path(env["POWERSAVE_CONFIG"]).read_text()) == {"powersave": {"cuda_perf_boost": "on"}}
    assert extra == ["--plugin", "powersave"] and abl["ablation_settings"] == {"cuda_perf_boost": "on"}
    ns.segments = "idle,sweep,reqenergy"
    assert job.server_segments(ns, ns.order.split(","), 2) == ["idle", "sweep"]  # measured like stock
    monkeypatch.setenv("POWERSAVE_FORCE_DRY_RUN", "1")
    assert job.main(["--order", "stock,ablation", "--plan-only"]) == 2
    assert "ablation arm needs --defaults-settings" in capsys.readouterr().err


def test_a_load_window_records_the_side_contexts_switches_and_hold_and_stock_none(monkeypatch):
    import argparse

    from benchmarks import h200_defaults as job

    series = iter(
        [
            {'powersave_cuda_boost_switches_total{gpu="0"}': 3.0, 'powersave_cuda_boost_held{gpu="0"}': 0.0},
            {'powersave_cuda_boost_switches_total{gpu="0"}': 4.0, 'powersave_cuda_boost_held{gpu="0"}': 1.0, "powersave_x": 1.0},
        ]
    )
    monkeypatch.setattr(job.load, "scrape", lambda port: (next(series), ""))
    monkeypatch.setattr(job.load, "rate_window", lambda *a, **kw: {"sampler": {}})
    ns = argparse.Namespace(window_s=1.0, sat_concurrency=4, input_len=8, output_len=8, energy="none", gpu=0)
    w = job.Server(ns, None, 0, "d1", None, None).load_window("8", 1, None)
    assert w["boost"] == {
        "switches": {'powersave_cuda_boost_switches_total{gpu="0"}': 1.0},
        "at_end": {'powersave_cuda_boost_held{gpu="0"}': 1.0},
    }
    monkeypatch.setattr(job.load, "scrape", lambda port: ({}, "# scrape failed"))
    assert "boost" not in job.Server(ns, None, 0, "s0", None, None).load_window("8", 1, None)


def test_a_bursts_phase_truth_adds_the_idle_power_its_longer_busy_time_displaced():
    """The null-control difference removes the idle power the burst's extra busy time displaced
    from the end of its span; phase energy includes the GPU's baseline while it works. The burst's
    own booking is judged, not less the null's (which depends on where its ticks fell)."""
    from benchmarks.h200_defaults import burst_pair_figures

    burst, null = {**_span(3.0, 160.0, 35.0), "busy_s": 0.2}, {**_span(3.0, 25.0, 35.0), "busy_s": 0.05}
    f = burst_pair_figures(burst, null, 80.0)
    assert f["true_busy_j"] == pytest.approx(135.0)  # the old truth is kept for comparison
    assert f["true_phase_j"] == pytest.approx(135.0 + 80.0 * 0.15)
    assert f["plugin_phase_j"] == pytest.approx(160.0) and f["null_plugin_busy_j"] == pytest.approx(25.0)
    assert f["phase_over_truth"] == pytest.approx(160.0 / 147.0)


def _held_span(busy_j, busy_s, hold_s, cut_s=1.3, span_s=3.0, idle_w=72.0, hold_w=127.0, lead_s=0.1):
    """A span whose request starts ``lead_s`` into its cut: ``busy_j`` over ``busy_s``, then the
    post-request clock hold at ``hold_w`` for ``hold_s``, then deep idle. The plugin books the work
    and calls the hold idle. The cut ends inside the hold where ``hold_s`` reaches past it."""
    in_cut_hold = min(hold_s, cut_s - lead_s - busy_s)
    cut_j = idle_w * lead_s + busy_j + hold_w * in_cut_hold + idle_w * max(0.0, cut_s - lead_s - busy_s - hold_s)
    rest_s = span_s - busy_s - hold_s
    counter_j = busy_j + hold_w * hold_s + idle_w * rest_s
    end_w = hold_w if hold_s >= cut_s - lead_s - busy_s else idle_w
    return {
        "span_s": span_s, "busy_s": busy_s, "counter_j": counter_j,
        "plugin_phases_j": {"prefill": busy_j, "decode": 0.0, "idle": counter_j - busy_j},
        "cut": {"cut_s": cut_s, "counter_j": cut_j, "end_power_w": end_w},
    }  # fmt: skip


def test_a_bursts_truth_is_cut_inside_the_post_request_hold_so_the_holds_length_drops_out():
    """The H100's clock hold after a request lasted 1.5 or 2.1 s at ~127 W (docs/results/
    h200-request-energy.md): spans to deep idle add that +-30 J to a ~130 J burst's truth. Cut at the
    same time after each request, inside the hold, the truth is the burst's own work."""
    from benchmarks.h200_defaults import burst_pair_figures

    burst, null = _held_span(130.0, 0.2, 1.5), _held_span(5.0, 0.05, 2.1)
    f = burst_pair_figures(burst, null, 72.0)
    assert f["truth_method"] == "cut in the post-request hold"
    assert f["phase_over_truth"] == pytest.approx(1.0)
    assert abs(f["phase_over_truth_to_idle"] - 1.0) > 0.15  # the spans to deep idle carry the holds' difference
    swapped = burst_pair_figures(_held_span(130.0, 0.2, 2.1), _held_span(5.0, 0.05, 1.5), 72.0)
    assert swapped["phase_over_truth"] == pytest.approx(1.0) and swapped["cut"]["hold_w"] == pytest.approx(127.0)


def test_a_burst_whose_cut_ends_in_another_power_state_than_its_nulls_is_not_judged():
    from benchmarks.h200_defaults import burst_pair_figures

    f = burst_pair_figures(_held_span(130.0, 0.2, 1.5), _held_span(5.0, 0.05, 0.5), 72.0)  # the null's hold ended before its cut
    assert f["phase_over_truth"] is None and "different power states" in f["cut"]["note"]
    old = burst_pair_figures({**_held_span(130.0, 0.2, 1.5), "cut": None}, _held_span(5.0, 0.05, 1.5), 72.0)
    assert old["truth_method"] == "spans to deep idle" and old["phase_over_truth"] == old["phase_over_truth_to_idle"]


def test_the_nulls_work_is_the_median_of_the_segments_null_bookings():
    """One null span's booking held a counter jump booked back onto its step (17.9 J against
    2.4-5.1 J on the H100): the truth adds the median null booking, not that one."""
    from benchmarks.h200_defaults import burst_pair_figures, null_work_j

    runs = [{"burst": _held_span(130.0, 0.2, 1.5), "null": _held_span(w, 0.05, 2.1)} for w in (3.0, 4.0, 5.0)]
    runs[2]["burst"]["plugin_phases_j"]["prefill"] = 116.0  # this burst's last 14 J landed in its null's span
    runs[2]["null"]["plugin_phases_j"]["prefill"] = 18.0
    assert null_work_j(runs) == pytest.approx(4.0)
    own = burst_pair_figures(runs[2]["burst"], runs[2]["null"], 72.0)
    med = burst_pair_figures(runs[2]["burst"], runs[2]["null"], 72.0, null_work_j(runs))
    assert med["cut"]["null_work_j"] == pytest.approx(4.0) and med["true_phase_j"] < own["true_phase_j"] - 13.0


def test_a_burst_cut_outside_its_span_is_refused_with_one_line():
    from benchmarks import h200_defaults as job

    assert job.check_args(job.parse_args(["--gpu", "0", "--segments", "idle,bursts"]), ["defaults"]) is None
    for bad in ("0.2", "2.95", "-1"):
        line = job.check_args(job.parse_args(["--gpu", "0", "--segments", "idle,bursts", "--burst-cut-s", bad]), ["defaults"])
        assert line is not None and line.startswith("--burst-cut-s: ") and "\n" not in line
    # Without the bursts segment the cut is never used: a short span for other segments is fine.
    assert job.check_args(job.parse_args(["--gpu", "0", "--segments", "reqenergy", "--burst-span-s", "1.0"]), ["defaults"]) is None


def test_a_burst_is_judged_by_the_minimum_on_the_truth_that_judges_it():
    """The 10 J floor applies to the truth that judges the pair: a 30 J burst whose null held its
    clocks 0.6 s longer reads -19 J on the spans to deep idle but 30 J on the cut, and is judged;
    a 6 J burst whose own hold ran longer reads 23 J on the spans but 6 J on the cut, and is not."""
    from benchmarks.h200_defaults import burst_pair_figures

    small = burst_pair_figures(_held_span(30.0, 0.2, 1.5), _held_span(5.0, 0.05, 2.1), 72.0)
    assert small["true_busy_j"] < 0 and small["phase_over_truth"] == pytest.approx(1.0)
    tiny = burst_pair_figures(_held_span(6.0, 0.2, 2.1), _held_span(5.0, 0.05, 1.5), 72.0)
    assert tiny["true_busy_j"] >= 10.0 and tiny.get("phase_over_truth") is None and "not judged" in tiny["note"]


def test_the_bursts_block_lists_every_pair_it_did_not_judge():
    from benchmarks.h200_defaults_record import bursts_block

    runs = [{"burst": _held_span(130.0, 0.2, 1.5), "null": _held_span(5.0, 0.05, 1.5)} for _ in range(3)]
    runs[2]["burst"]["counter_j"] = None  # the sampler missed this span, and its cut
    runs[2]["burst"]["cut"] = None
    b = {"n": 3, "conc": 4, "input_len": 1900, "idle_w": 72.0, "method": "null-request control", "runs": runs}
    (o,) = bursts_block([{"_file": "f.json", "servers": [{"label": "d0", "bursts": b}]}])
    assert o["phase_over_truth"]["n"] == 2 and o["not_judged"] == ["a span without counter or plugin energy"]


def test_the_bursts_log_line_prints_the_judged_ratios_and_the_pairs_not_judged():
    from benchmarks.h200_defaults import bursts_line

    runs = [{"phase_over_truth": 1.067, "busy_over_truth": 1.32}, {"phase_over_truth": 0.99, "busy_over_truth": 0.83}]
    runs.append({"phase_over_truth": None, "busy_over_truth": 1.2, "note": "different power states"})
    line = bursts_line(runs)
    assert "[0.99, 1.067] (1 of 2 within 5 %)" in line and "1 not judged" in line and "1.32" not in line


def test_a_segments_counter_phase_losses_are_recorded_where_the_raw_file_has_them():
    with_losses = {**_reqe_run(256, 64, 40.0, [1.0] * 10, idle_j=5.0, tail_j=1.0, counter_j=16.0), "counter_phase_losses": 3}
    older = _reqe_run(1024, 32, 10.0, [1.0] * 10, idle_j=5.0, tail_j=1.0, counter_j=16.0)  # predates the field
    reqe = rec.request_energy([raw([server("defaults", 80, [], reqenergy_runs=[with_losses, older])])], drop=0.0)
    assert [s["counter_phase_losses"] for s in reqe["segments"]] == [3, None]
    md = "\n".join(rec.request_energy_md(reqe, "measured", 0.0))
    assert "energy-counter, 3 phase losses |" in md and md.count("phase loss") == 1


def test_the_request_energy_twin_opens_with_the_newest_runs_verdict_on_the_targets():
    ok = {"p5_ge_0_90": True, "p95_le_1_10": True, "max_le_1_30": True, "sum_within_1pct": True}
    seg = {"file": "a.json", "device": "NVIDIA H200", "date_utc": "T1", "input_len": 256, "output_len": 64, "checks": ok}
    newer = [seg | {"file": "b.json", "device": "NVIDIA H100 80GB HBM3"}, seg | {"file": "b.json", "input_len": 1024, "output_len": 32}]
    line = rec.newest_line([seg, *newer])
    assert "b.json (NVIDIA H100 80GB HBM3, T1), 2 segment(s) (256/64, 1024/32)" in line and ": all met" in line
    newer[1] = newer[1] | {"checks": ok | {"max_le_1_30": False}}
    assert ": not all met" in rec.newest_line([seg, *newer])
    assert rec.newest_line([]).startswith("- Newest run: none")


def test_each_segment_keeps_the_counter_lag_its_trace_shows_where_the_servers_tarball_is_beside(tmp_path):
    """Raw files do not outlive a session; the record keeps each segment's counter-lag fit from the
    servers tarball beside the raw file (docs/request-energy.md, the counter's lag)."""
    import io
    import tarfile

    from test_counter_lag import _energy_j, _serving

    from benchmarks import counter_lag as cl
    from vllm_powersave.energy.account import TickRecord
    from vllm_powersave.energy.meters import CounterStep
    from vllm_powersave.stats_contract import TraceLine, tick_line

    steps, lines, b = _serving(seed=1), [], 1.037
    lines += [TraceLine(s, "prefill" if p else "decode", p, 0 if p else 2, 2, 2048, 2, None, t).to_json() for s, t, p in steps]
    while b + 0.1 < steps[-1][1]:
        step = CounterStep(b + 0.1, 0.0, b, _energy_j(steps, b - 0.02, b + 0.08))  # covers up to 20 ms before its step
        gains = (("r0", 1.0),) if b < 1.1 else ()
        done = ["r9"] if b + 0.2 >= steps[-1][1] else []
        lines.append(tick_line(TickRecord(b + 0.1, b + 0.11, 1.0, 0.01, 0.0, 0.0, 0.0, done, 0.0, None, None, (step,), gains, 0.004)))
        b += 0.1
    trace = gzip.compress("".join(lines).encode())
    with tarfile.open(tmp_path / "servers-gpu0-1.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("defaults-trace-rank0.jsonl.gz")
        info.size = len(trace)
        tar.addfile(info, io.BytesIO(trace))
    run = _reqe_run(1024, 32, 10.0, [1.0] * 10, idle_j=5.0, tail_j=1.0, counter_j=16.0)
    (tmp_path / "defaults-gpu0-1.json").write_text(json.dumps(raw([server("defaults", 80, [], reqenergy_runs=[run])], name="x")))
    (tmp_path / "defaults-gpu0-2.json").write_text(json.dumps(raw([server("defaults", 80, [], reqenergy_runs=[run])], name="y")))
    lagged, bare = (rec.request_energy([rec.load(str(tmp_path / f"defaults-gpu0-{k}.json"))], 0.0)["segments"][0] for k in (1, 2))
    g = lagged["counter_lag"]
    assert abs(g["best_lag_ms"] - 20) <= 5 and g["r2_best"] > g["r2_at_0"] + 0.1 and g["periods"] >= 150
    assert g["r2_by_lag_ms"]["0"] == g["r2_at_0"] and len(g["r2_by_lag_ms"]) == len(cl.LAGS_MS)
    assert bare["counter_lag"] is None  # no tarball beside it
    line = rec.newest_line([lagged])
    assert f"1024/32 {g['best_lag_ms']:+d} ms (R² {g['r2_best']:.3f} against {g['r2_at_0']:.3f} at 0 ms)" in line
    assert "counter_lag.py" not in rec.newest_line([bare])


@pytest.mark.parametrize("damage", ["cut", "not-a-tar", "bad-deflate"])
def test_a_damaged_servers_tarball_leaves_the_record_whole_with_one_note(tmp_path, capsys, damage):
    """A tarball copied only in part (a lease ending mid-copy) loses its lag fit, not the record."""
    run = _reqe_run(1024, 32, 10.0, [1.0] * 10, idle_j=5.0, tail_j=1.0, counter_j=16.0)
    (tmp_path / "defaults-gpu0-1.json").write_text(json.dumps(raw([server("defaults", 80, [], reqenergy_runs=[run])], name="x")))
    good = gzip.compress(b"x" * 4000)
    if damage == "bad-deflate":  # a whole tarball whose trace member's deflate data is corrupt (zlib.error)
        import io
        import tarfile

        inner = gzip.compress(b'{"t": 1.0}\n' * 2000)
        inner = inner[:12] + b"\x00\xff" * 10 + inner[32:]
        with tarfile.open(tmp_path / "servers-gpu0-1.tar.gz", "w:gz") as tar:
            info = tarfile.TarInfo("defaults-trace-rank0.jsonl.gz")
            info.size = len(inner)
            tar.addfile(info, io.BytesIO(inner))
    else:
        (tmp_path / "servers-gpu0-1.tar.gz").write_bytes(good[: len(good) // 2] if damage == "cut" else b"plain text")
    assert rec.main([str(tmp_path / "defaults-gpu0-1.json"), "--out-dir", str(tmp_path / "o"), "--reqe-only"]) == 0
    seg = json.loads((tmp_path / "o" / "h200-request-energy.json").read_text())["segments"][0]
    assert seg["counter_lag"] is None
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "servers-gpu0-1.tar.gz: unreadable" in notes[0]


def test_a_raw_file_of_another_name_looks_for_no_tarball(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(raw([])))
    (tmp_path / "run.tar.gz").write_bytes(b"unrelated")
    (tmp_path / "defaults-a.json.gz").write_bytes(gzip.compress(json.dumps(raw([])).encode()))
    (tmp_path / "servers-a.tar.gz").write_bytes(b"beside")
    assert rec.load(str(tmp_path / "run.json"))["_servers_tar"] is None
    assert rec.load(str(tmp_path / "defaults-a.json.gz"))["_servers_tar"] == str(tmp_path / "servers-a.tar.gz")
