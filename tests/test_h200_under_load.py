"""benchmarks/h200_under_load*.py: the dry-run guard, the server command, what a server's log says
about its front end, and the record's per-load figures in the shape docs/results expects."""

import json
import statistics

import pytest

from benchmarks import h200_under_load as job
from benchmarks import h200_under_load_record as rec


def _rows(r: dict) -> list[dict]:
    """The record's loads and probes together (a probe is a load with fewer pairs than a claim needs)."""
    return r["loads"] + r.get("probes", [])


def test_the_job_refuses_to_start_without_the_dry_run_guard(monkeypatch, capsys):
    monkeypatch.delenv("POWERSAVE_FORCE_DRY_RUN", raising=False)
    with pytest.raises(SystemExit) as exc:
        job.main(["--points", "c64"])
    assert exc.value.code == 2 and "POWERSAVE_FORCE_DRY_RUN=1" in capsys.readouterr().err


def test_servers_start_through_vllm_serve_and_only_the_defaults_arm_names_the_plugin(tmp_path):
    cmd = job.serve_cmd(tmp_path, 8300, job.ARMS["defaults"], "--max-model-len 2048")
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path)]
    assert cmd[-2:] == ["--plugin", "powersave"] and "--api-server-count" not in cmd
    assert "--plugin" not in job.serve_cmd(tmp_path, 8301, job.ARMS["stock"], "")


def test_the_log_tells_how_many_api_servers_ran_and_what_the_plugin_chose(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "INFO powersave: savings: perf-boost auto (x); front end 4 API servers (auto: 16 usable cores, 1 engine; y)\n"
        + "".join(f"INFO:     Started server process [{100 + i}]\n" for i in range(4))
    )
    arm = job.Arm("defaults", 1, log)
    assert arm.api_servers() == 4 and arm.front_end_line() == "front end 4 API servers"
    assert job.Arm("stock", 1, tmp_path / "missing.log").api_servers() is None


def test_a_window_is_stamped_when_it_starts_not_when_it_ends(monkeypatch, tmp_path):
    # Pairing a window with the guard's log lines needs its start; stamped after, it read 22-44 s late.
    now = ["2026-12-07T16:44:00Z"]

    def window(*args, **kwargs):
        now[0] = "2026-12-07T16:44:44Z"  # the window took 44 s
        return {"res": {}}

    monkeypatch.setattr(job, "utc_now", lambda: now[0])
    monkeypatch.setattr(job.load, "run_window", window)
    monkeypatch.setattr(job.load, "summary", lambda res: {})
    arm = job.Arm("defaults", 8300, tmp_path / "server.log")
    assert job.run_one(job.argparse.Namespace(), arm, "c16", seed=1)["started_utc"] == "2026-12-07T16:44:00Z"


def _run(tps, jpt, tpot, ttft, servers, starved=None):
    return {"output_throughput": tps, "gpu_energy_per_output_token_j": jpt, "p99_tpot_ms": tpot, "median_ttft_ms": ttft,
            "api_servers": servers, "idle_while_busy_j": starved, "started_utc": "2026-12-04T19:30:00Z"}  # fmt: skip


def _raw(pairs):
    return {"tag": "t", "device": {"name": "NVIDIA H200"}, "shape": "qwen2.5-7b", "serve_args": "x", "pairs": pairs}


def test_a_load_entry_has_the_issues_fields_with_pair_means_and_intervals():
    pairs = [
        {"point": "c64", "pair": i + 1, "order": ["stock", "defaults"] if i % 2 == 0 else ["defaults", "stock"],
         "stock": _run(4000.0, 0.20, 12.0, 100.0, 1), "defaults": _run(4000.0 * (1.2 + 0.01 * i), 0.19, 11.0, 90.0 + i, 4, 50.0)}
        for i in range(6)
    ]  # fmt: skip
    r = rec.build([{**_raw(pairs), "lease": "L1"}])
    (e,) = _rows(r)
    assert (e["name"], e["kind"], e["concurrency"], e["pairs"]) == ("c64-streamed-512-256", "saturation", 64, 6)
    assert (e["api_server_count_stock"], e["api_server_count_defaults"]) == (1, 4)
    assert e["throughput_ratio"]["mean"] == pytest.approx(1.225, abs=1e-4)
    lo, hi = e["throughput_ratio"]["ci95"]
    xs = [1.2 + 0.01 * i for i in range(6)]
    assert hi - lo == pytest.approx(2 * 2.571 * statistics.stdev(xs) / 6**0.5, abs=2e-4)  # t(5) = 2.571
    assert e["j_per_out_token_ratio"]["mean"] == pytest.approx(0.95) and e["j_per_out_token_ratio"]["ci95"] == [0.95, 0.95]
    assert e["p50_ttft_delta_ms"]["mean"] == pytest.approx(-7.5)
    assert e["starvation_j"] == {"stock": None, "defaults": 50.0}
    assert [p["lease"] for p in e["pair_list"]] == ["L1"] * 6
    json.dumps(r)  # the record is plain JSON


def test_a_half_pair_cut_by_the_time_limit_is_left_out():
    pairs = [{"point": "c256", "pair": 1, "order": ["stock", "defaults"], "stock": _run(1.0, 1.0, 1.0, 1.0, 1)}]
    assert _rows(rec.build([_raw(pairs)])) == []


def test_the_markdown_twin_says_measured_names_leases_and_what_is_not_yet_measured(tmp_path):
    pairs = [
        {
            "point": "c64",
            "pair": 1,
            "order": ["stock", "defaults"],
            "stock": _run(1.0, 1.0, 1.0, 1.0, 1),
            "defaults": _run(1.2, 0.9, 1.0, 1.0, 4),
        }
    ]
    r = rec.build([{**_raw(pairs), "lease": "lease-A"}])
    md = rec.markdown(r, None)
    assert "(measured)" in md and "lease-A" in md and "1.200 (one pair)" in md and "rate 0.5 req/s" in md


def test_every_ablation_arm_is_a_valid_settings_file_run_with_the_plugin(tmp_path):
    from vllm_powersave.settings import load_settings

    ns = job.parse_args(["--workdir", str(tmp_path)])
    for label, settings in job.ABLATIONS.items():
        env = job.arm_env(ns, label)
        assert job.ARMS[label] == ["--plugin", "powersave"] and env["PYTHONPATH"].startswith(ns.plugin_site)
        loaded = load_settings({}, env={"POWERSAVE_CONFIG": env["POWERSAVE_CONFIG"]})
        assert loaded.model_dump(include=set(settings)) == load_settings(settings, env={}).model_dump(include=set(settings))
    assert "POWERSAVE_CONFIG" not in job.arm_env(ns, "stock") and job.arm_env(ns, "stock")["PYTHONPATH"] == ns.stock_site
    assert "POWERSAVE_CONFIG" not in job.arm_env(ns, "defaults")


def test_each_variant_pairs_with_the_reference_in_abba_order():
    sched = job.pair_schedule(["stock", "meter-only", "no-watch-1api"], 2)
    assert sched == [
        (1, "meter-only", ("stock", "meter-only")),
        (1, "no-watch-1api", ("stock", "no-watch-1api")),
        (2, "meter-only", ("meter-only", "stock")),
        (2, "no-watch-1api", ("no-watch-1api", "stock")),
    ]


def test_more_servers_side_by_side_split_the_gpu_memory():
    assert job.gpu_share(job.parse_args([])) == 0.42
    assert job.gpu_share(job.parse_args(["--arms", "stock,defaults-1api,meter-only,no-watch-1api"])) == 0.22
    assert job.gpu_share(job.parse_args(["--arms", "stock,meter-only", "--gpu-share", "0.3"])) == 0.3


@pytest.mark.parametrize("arms", ["stock,nope", "stock", "stock,stock"])
def test_bad_arms_stop_the_job_with_one_line_naming_the_value(monkeypatch, capsys, arms):
    monkeypatch.setenv("POWERSAVE_FORCE_DRY_RUN", "1")
    assert job.main(["--arms", arms]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --arms:")


def test_ablation_pairs_go_to_their_own_entries_not_to_the_loads():
    pairs = [
        {"point": "c256", "pair": i + 1, "arms": ["stock", "meter-only"], "order": ["stock", "meter-only"][:: 1 if i % 2 == 0 else -1],
         "stock": _run(4000.0, 0.20, 12.0, 100.0, 1), "meter-only": _run(3960.0, 0.20, 12.0, 100.0, 1)}
        for i in range(3)
    ]  # fmt: skip
    r = rec.build([{**_raw(pairs), "arms": {"stock": None, "meter-only": {"savings": "off"}}, "lease": "L"}])
    assert _rows(r) == []
    (a,) = r["ablations"]
    assert (a["name"], a["variant"], a["reference"], a["pairs"]) == ("c256-streamed-128-128-meter-only", "meter-only", "stock", 3)
    assert a["settings"] == {"savings": "off"} and a["throughput_ratio"]["mean"] == pytest.approx(0.99)
    assert "meter-only / stock" in rec.markdown(r, None)


def _window(rate, tps, tokj, ttft, tpot):
    return {"request_rate": rate, "completed": 10, "output_throughput": tps, "median_ttft_ms": ttft, "p99_tpot_ms": tpot,
            "span": {"energy_j": 100.0, "out_tok_per_j": tokj, "avg_power_w": 100.0, "gpu_idle_share": 0.5, "seconds": 15.0}}  # fmt: skip


def _server(arm, pos, tokj, sat_tokj=None):
    windows = [_window("0.5", 64.0, tokj, 30.0, 8.0)] + ([_window("sat", 6000.0, sat_tokj, 90.0, 11.0)] if sat_tokj else [])
    return {"arm": arm, "pos": pos, "label": f"{arm}{pos}", "api_servers": 4 if arm == "defaults" else 1,
            "idle": {"avg_power_w": 80.0 if arm == "defaults" else 130.0}, "windows": windows}  # fmt: skip


def test_poisson_rates_from_the_one_server_job_become_rate_loads_with_the_issues_fields():
    h100, method = {"name": "NVIDIA H100 80GB HBM3"}, {"serve_args": "--max-num-seqs 256", "defaults_observe": "trace,reqenergy"}
    raws = [
        {"_file": "defaults-A.json", "gpu": 0, "lease": "L2", "device": h100, "method": method, "date_utc": "2026-12-05T21:25:47Z",
         "servers": [_server("stock", 0, 1.0), _server("defaults", 1, 1.25)]},
        {"_file": "defaults-B.json", "gpu": 0, "lease": "L3", "device": h100, "method": method,
         "servers": [_server("defaults", 0, 1.25), _server("stock", 1, 1.0)]},
    ]  # fmt: skip
    r = rec.build([], raws)
    (e,) = _rows(r)
    assert e["device"] == "NVIDIA H100 80GB HBM3" and [p["device"] for p in e["pair_list"]] == [h100["name"]] * 2
    assert e["defaults_observe"] == ["trace,reqenergy"] and e["serve_args"] == "--max-num-seqs 256"
    assert [(x["lease"], x["device"], x["started_utc"]) for x in r["runs"]][0] == ("L2", h100["name"], "2026-12-05T21:25:47Z")
    assert "H100" in rec.markdown(r, None) and "trace,reqenergy" in rec.markdown(r, None)
    assert (e["name"], e["kind"], e["rate"], e["pairs"]) == ("rate-0.5", "rate", 0.5, 2)
    assert (e["api_server_count_stock"], e["api_server_count_defaults"]) == (1, 4)
    assert e["j_per_out_token_ratio"]["mean"] == pytest.approx(0.8) and e["throughput_ratio"]["mean"] == pytest.approx(1.0)
    assert e["p50_ttft_delta_ms"]["mean"] == 0.0 and e["starvation_j"] == {"stock": None, "defaults": None}
    assert [p["lease"] for p in e["pair_list"]] == ["L2", "L3"]
    assert "rate 0.5 req/s" not in r["not_yet_measured"] and "rate 2 req/s" in r["not_yet_measured"]


def test_a_rate_loads_starvation_is_the_defaults_windows_counter_and_null_for_stock():
    from benchmarks.lib import load

    assert "gpu_idle_while_busy_energy_j" in load.summary({"gpu_idle_while_busy_energy_j": 3.5})
    stock, defaults = _server("stock", 0, 1.0, sat_tokj=10.0), _server("defaults", 1, 1.25, sat_tokj=11.0)
    for w, j in zip(defaults["windows"], (2.0, 40.0)):  # 0.5 req/s, then the closed loop
        w["gpu_idle_while_busy_energy_j"] = j
    defaults2 = {**_server("defaults", 2, 1.25, sat_tokj=11.0), "pos": 2}
    defaults2["windows"][0]["gpu_idle_while_busy_energy_j"] = 4.0
    raws = [{"_file": "defaults-A.json", "gpu": 0, "lease": "L", "device": {"name": "H"}, "method": {},
             "servers": [stock, defaults, defaults2, _server("stock", 3, 1.0, sat_tokj=10.0)]}]  # fmt: skip
    by_name = {e["name"]: e for e in _rows(rec.build([], raws)) + rec.build([], raws).get("probes", [])}
    assert by_name["rate-0.5"]["starvation_j"] == {"stock": None, "defaults": 3.0}
    assert by_name["c64-one-server-512-256"]["starvation_j"] == {"stock": None, "defaults": 40.0}


def test_a_later_lease_adds_its_loads_to_the_committed_record_without_the_old_raw_files():
    c64 = [
        {"point": "c64", "pair": 1, "order": ["stock", "defaults"], "stock": _run(7000.0, 0.09, 8.0, 50.0, 1), "defaults": _run(7150.0, 0.088, 8.0, 40.0, 4)}
    ]  # fmt: skip
    old = rec.build([{**_raw(c64), "lease": "lease-1"}])
    raws = [
        {"_file": "defaults-A.json", "gpu": 0, "lease": "lease-2", "servers": [_server("stock", 0, 1.0), _server("defaults", 1, 1.25)]}
    ]  # fmt: skip
    old["device"] = {"name": "NVIDIA H200"}
    merged = rec.merge(old, rec.build([], raws))
    assert [e["name"] for e in _rows(merged)] == ["c64-streamed-512-256", "rate-0.5"]
    assert _rows(merged)[0]["device"] == "NVIDIA H200"  # an older load keeps the device it ran on
    assert [r["lease"] for r in merged["runs"]] == ["lease-1", "lease-2"] and merged["shape"] == "qwen2.5-7b"
    assert "rate 0.5 req/s" not in merged["not_yet_measured"]
    again = rec.merge(merged, rec.build([{**_raw(c64), "lease": "lease-1"}]))  # a rebuilt load replaces its old entry
    assert [e["name"] for e in _rows(again)] == ["rate-0.5", "c64-streamed-512-256"]


def test_a_pair_across_two_gpus_is_refused_and_a_rates_only_record_merges_and_prints():
    h100, h200 = {"name": "NVIDIA H100 80GB HBM3"}, {"name": "NVIDIA H200"}
    raws = [
        {"_file": "defaults-A.json", "gpu": 0, "lease": "L1", "device": h100, "servers": [_server("stock", 0, 1.0)]},
        {"_file": "defaults-B.json", "gpu": 0, "lease": "L2", "device": h200, "servers": [_server("defaults", 0, 1.25)]},
    ]
    assert _rows(rec.build([], raws)) == []  # stock on the H100, defaults on the H200: no pair
    nameless = [{"_file": "defaults-C.json", "gpu": 0, "lease": "L3", "servers": [_server("stock", 0, 1.0), _server("defaults", 1, 1.25)]}]
    r = rec.build([], nameless)
    assert _rows(r)[0]["device"] is None and "None" not in rec.markdown(r, None)
    merged = rec.merge(r, rec.build([], nameless))
    assert "rate-0.5" in rec.markdown(merged, None)


def test_a_rate_run_with_defaults_settings_is_an_ablation_not_averaged_into_the_rate_load():
    plain, boost_on = {"defaults_observe": "none"}, {"defaults_observe": "none", "defaults_settings": {"cuda_perf_boost": "on"}}
    raws = [
        {"_file": "defaults-A.json", "gpu": 0, "lease": "L1", "method": plain, "servers": [_server("stock", 0, 1.0), _server("defaults", 1, 1.25)]},
        {"_file": "defaults-B.json", "gpu": 0, "lease": "L1", "method": boost_on, "servers": [_server("stock", 0, 1.0), _server("defaults", 1, 0.5)]},
    ]  # fmt: skip
    r = rec.build([], raws)
    (load,) = [e for e in _rows(r) if e["name"] == "rate-0.5"]
    assert load["pairs"] == 1 and load["j_per_out_token_ratio"]["mean"] == pytest.approx(0.8)
    (abl,) = r["ablations"]
    assert abl["name"] == "rate-0.5-cuda_perf_boost=on" and abl["settings"] == {"cuda_perf_boost": "on"}
    assert abl["pairs"] == 1 and abl["j_per_out_token_ratio"]["mean"] == pytest.approx(2.0)
    assert "rate-0.5-cuda_perf_boost=on" in rec.markdown(r, None) and '{"cuda_perf_boost": "on"}' in rec.markdown(r, None)


def test_an_ablation_arm_in_one_order_splits_into_the_rate_load_and_its_ablation():
    method = {"defaults_observe": "none", "defaults_settings": {"cuda_perf_boost": "on"}}
    servers = [
        _server("stock", 0, 1.0),
        _server("defaults", 1, 1.25),
        {**_server("defaults", 2, 0.5), "arm": "ablation"},
        _server("stock", 3, 1.0),
    ]
    r = rec.build([], [{"_file": "defaults-A.json", "gpu": 0, "lease": "L1", "method": method, "servers": servers}])
    (load,) = _rows(r)
    assert load["pairs"] == 1 and load["j_per_out_token_ratio"]["mean"] == pytest.approx(0.8)
    (abl,) = r["ablations"]
    assert abl["name"] == "rate-0.5-cuda_perf_boost=on" and abl["j_per_out_token_ratio"]["mean"] == pytest.approx(2.0)
    assert abl["pair_list"][0]["order"] == ["defaults", "stock"] and [x["lease"] for x in r["runs"]] == ["L1"]


@pytest.mark.parametrize("order", [("stock", "ablation", "defaults"), ("defaults", "ablation", "stock")])
def test_a_cut_abba_order_pairs_both_arms_with_the_one_stock_server(order):
    """S A D (the trailing stock cut by the call's limit) and D A S: the defaults server has no
    stock beside it, and takes the one two places away, which also pairs with the ablation."""
    tokj = {"stock": 1.0, "defaults": 1.25, "ablation": 0.5}
    servers = [{**_server("stock" if a == "stock" else "defaults", i, tokj[a]), "arm": a} for i, a in enumerate(order)]
    method = {"defaults_observe": "none", "defaults_settings": {"cuda_perf_boost": "off"}}
    r = rec.build([], [{"_file": "defaults-A.json", "gpu": 0, "lease": "L1", "method": method, "servers": servers}])
    (load,) = _rows(r)
    assert load["pairs"] == 1 and load["j_per_out_token_ratio"]["mean"] == pytest.approx(0.8)
    (abl,) = r["ablations"]
    assert abl["pairs"] == 1 and abl["j_per_out_token_ratio"]["mean"] == pytest.approx(2.0)


def test_a_server_left_unpaired_at_a_leases_end_does_not_take_the_next_leases_stock():
    h100, h200 = {"name": "NVIDIA H100 80GB HBM3"}, {"name": "NVIDIA H200"}
    raws = [
        {"_file": "defaults-A.json", "gpu": 0, "lease": "L1", "device": h100, "servers": [_server("stock", 0, 1.0), _server("defaults", 1, 1.25)]},
        {"_file": "defaults-B.json", "gpu": 0, "lease": "L1", "device": h100, "servers": [_server("defaults", 0, 1.25)]},
        {"_file": "defaults-C.json", "gpu": 0, "lease": "L2", "device": h200, "servers": [_server("stock", 0, 1.0), _server("defaults", 1, 1.25)]},
    ]  # fmt: skip
    (e,) = _rows(rec.build([], raws))
    assert [(p["lease"], p["device"]) for p in e["pair_list"]] == [("L1", h100["name"]), ("L2", h200["name"])]
    assert e["device"] == "NVIDIA H100 80GB HBM3 + NVIDIA H200"


def test_closed_loop_windows_of_the_one_server_job_become_their_own_saturation_entries():
    """h200_defaults.py's ``sat`` windows (one server on the GPU at a time, so perf boost's
    behaviour shows) are saturation entries of their own, never averaged with the side-by-side
    rows, and their ablations likewise."""
    method = {"sat_concurrency": 64, "input_len": 512, "output_len": 256, "defaults_settings": {"cuda_perf_boost": "off"}}
    servers = [
        _server("stock", 0, 1.0, sat_tokj=9.0),
        {**_server("defaults", 1, 1.0, sat_tokj=10.0), "arm": "ablation"},
        _server("defaults", 2, 1.0, sat_tokj=9.0),
        _server("stock", 3, 1.0, sat_tokj=9.0),
    ]
    r = rec.build([], [{"_file": "defaults-A.json", "gpu": 0, "lease": "L1", "method": method, "servers": servers}])
    sat = {e["name"]: e for e in _rows(r) if e["kind"] == "saturation"}
    assert list(sat) == ["c64-one-server-512-256"] and sat["c64-one-server-512-256"]["concurrency"] == 64
    assert sat["c64-one-server-512-256"]["j_per_out_token_ratio"]["mean"] == pytest.approx(1.0)
    abl = {e["name"]: e for e in r["ablations"]}
    assert abl["c64-one-server-512-256-cuda_perf_boost=off"]["j_per_out_token_ratio"]["mean"] == pytest.approx(0.9)
    assert "c64-one-server-512-256" in rec.markdown(r, None)


def test_a_load_with_fewer_pairs_than_a_claim_needs_is_a_probe_not_a_load():
    """Every ``loads`` entry carries a 95 % interval over the pairs the record's contract asks (6 at
    a saturation point, 3 at a rate); two S D S sets at one-server saturation are shown as a probe."""
    method = {"sat_concurrency": 64, "input_len": 512, "output_len": 256}
    servers = [_server("stock", 0, 1.0, sat_tokj=9.0), _server("defaults", 1, 1.0, sat_tokj=9.0), _server("stock", 2, 1.0, sat_tokj=9.0)]
    raws = [{"_file": f"defaults-{x}.json", "gpu": 0, "lease": f"L{x}", "method": method, "servers": servers} for x in "AB"]
    r = rec.build([], raws)
    probes = {e["name"]: e for e in r["probes"]}
    assert probes["c64-one-server-512-256"]["pairs"] == 2 and "c64-one-server-512-256" not in {e["name"] for e in r["loads"]}
    assert all(e["pairs"] >= rec.MIN_PAIRS[e["kind"]] and e["throughput_ratio"]["ci95"] for e in r["loads"])
    assert "Probes:" in rec.markdown(r, None)
    more = rec.merge(r, rec.build([], [{**raws[0], "_file": "defaults-C.json", "lease": "LC"}]))
    assert [e["name"] for e in more["probes"]].count("c64-one-server-512-256") == 1  # a rebuilt probe replaces the old one


def test_merging_a_one_pair_probe_keeps_the_committed_load_of_that_name():
    """A later lease with one pair at 0.5 req/s adds a probe; the committed 6-pair load stays."""

    def raw(name, lease, n):
        servers = [s for i in range(n) for s in (_server("stock", 2 * i, 1.0), _server("defaults", 2 * i + 1, 1.1))]
        return {"_file": name, "gpu": 0, "lease": lease, "method": {"defaults_observe": "none"}, "servers": servers}

    committed = rec.build([], [raw("defaults-A.json", "L1", 6)])
    assert [(e["name"], e["pairs"]) for e in committed["loads"]] == [("rate-0.5", 6)]
    merged = rec.merge(committed, rec.build([], [raw("defaults-B.json", "L2", 1)]))
    assert [(e["name"], e["pairs"]) for e in merged["loads"]] == [("rate-0.5", 6)]
    assert [(e["name"], e["pairs"]) for e in merged["probes"]] == [("rate-0.5", 1)]
