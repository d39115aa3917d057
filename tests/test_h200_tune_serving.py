"""benchmarks/h200_tune_serving*.py: the dry-run guard, the command it runs per load (which the real
parser and space reader accept), resuming from an earlier call, and the record's per-load fields."""

import json

import pytest

from benchmarks import h200_tune_serving as job
from benchmarks import h200_tune_serving_record as rec

pytestmark = pytest.mark.bench


def test_the_job_refuses_to_start_without_the_dry_run_guard(monkeypatch, capsys):
    monkeypatch.delenv("POWERSAVE_FORCE_DRY_RUN", raising=False)
    with pytest.raises(SystemExit) as exc:
        job.main(["--load", "rate4"])
    assert exc.value.code == 2 and "POWERSAVE_FORCE_DRY_RUN=1" in capsys.readouterr().err


@pytest.mark.parametrize("load", sorted(job.LOADS))
def test_each_load_is_a_tune_serving_command_the_parser_and_space_reader_accept(load, tmp_path):
    from vllm_powersave.cli import build_parser
    from vllm_powersave.serving_tune.space import load_space_file

    ns = job.parse_args(["--load", load])
    space = job.write_space(load, tmp_path / "space.yaml")
    cmd = job.tune_cmd(ns, load, tmp_path / "model", tmp_path / "out", space)
    assert cmd[1:4] == ["-m", "vllm_powersave.cli", "tune-serving"]
    parsed = build_parser().parse_args(cmd[3:])
    assert parsed.budget_min == 20.0 and parsed.pairs == 3 and parsed.space == str(space)
    more = build_parser().parse_args(
        job.tune_cmd(job.parse_args(["--load", load, "--pairs", "6", "--budget-min", "30"]), load, tmp_path, tmp_path, space)[3:]
    )
    assert (more.pairs, more.budget_min) == (6, 30.0)
    assert parsed.serve_arg[:4] == ["--max-model-len", "2048", "--load-format", "dummy"]
    assert load_space_file(space).searched() == job.LOADS[load]["space"]
    if load == "rate4":
        assert (parsed.rate, parsed.input_len, parsed.output_len) == (4.0, "128:1024", "32:512")
    else:
        assert (parsed.concurrency, parsed.rate) == (128, None)


def test_a_later_call_resumes_from_the_earlier_calls_state(tmp_path):
    earlier = tmp_path / "call1"
    earlier.mkdir()
    (earlier / "state.jsonl").write_text('{"kind": "header"}\n{"kind": "measurement"}\n')
    (earlier / "calls.json").write_text("[]")
    assert job.resume(earlier, tmp_path / "call2", "NVIDIA H200") == 2
    assert (tmp_path / "call2" / "state.jsonl").read_text() == (earlier / "state.jsonl").read_text()
    assert job.resume(None, tmp_path / "x", "NVIDIA H200") == 0
    with pytest.raises(SystemExit, match="no state.jsonl"):
        job.resume(tmp_path / "nothing", tmp_path / "y", "NVIDIA H200")


def test_a_search_measured_on_another_kind_of_gpu_is_not_resumed(tmp_path):
    earlier = tmp_path / "call1"
    earlier.mkdir()
    (earlier / "state.jsonl").write_text('{"kind": "header"}\n')
    (earlier / "calls.json").write_text(json.dumps([{"load": "c128", "gpu": "NVIDIA H100 80GB HBM3"}]))
    with pytest.raises(SystemExit, match="ran on NVIDIA H100 80GB HBM3, this GPU is NVIDIA H200"):
        job.resume(earlier, tmp_path / "call2", "NVIDIA H200")
    assert not (tmp_path / "call2").exists()  # nothing copied
    assert job.resume(earlier, tmp_path / "call3", "NVIDIA H100 80GB HBM3") == 1


def _ts(ratio, att_w, att_d, wall_s, pairs=3):
    window = {"p99_tpot_ms": 30.0, "output_tokens_per_joule": 5.0, "slo_met": True}
    return {
        "status": "done",
        "energy_label": "measured",
        "traffic": {"description": "Poisson arrivals at 4 req/s"},
        "slo": {"description": "99 % of requests with TPOT <= 50 ms", "tpot_ms": 50.0},
        "search": {"wall_time_s": wall_s},
        "winner": {"key": "cuda_perf_boost=auto", "command": "vllm serve m --plugin powersave"},
        "configurations": [{"key": "cuda_perf_boost=auto", "windows": [window]}, {"key": "cuda_perf_boost=on", "windows": [window]}],
        "final": {
            "pairs": pairs,
            "tok_per_j_ratio": {"mean": ratio, "ci95": [ratio - 0.02, ratio + 0.02]},
            "slo_attainment": {"winner": {"mean": att_w, "ci95": None}, "defaults": {"mean": att_d, "ci95": None}},
            "pair_list": [{"winner": {"output_tokens_per_joule": 5.5}, "defaults": {"output_tokens_per_joule": 5.0}}],
        },
    }


def test_the_record_has_the_issues_fields_per_load_and_judges_the_goal(tmp_path):
    for load, ts in (("rate4", _ts(1.12, 1.0, 0.99, 1100.0)), ("c128", _ts(1.05, 0.98, 0.99, 1300.0, pairs=2))):
        (tmp_path / load).mkdir()
        (tmp_path / load / "tune-serving.json").write_text(json.dumps(ts))
        gpu = {} if load == "rate4" else {"gpu": "NVIDIA H100 80GB HBM3"}  # rate4's calls predate the field
        (tmp_path / load / "calls.json").write_text(json.dumps([{"wall_s": 500} | gpu, {"wall_s": 600} | gpu]))
    r, panels = rec.build({"rate4": tmp_path / "rate4", "c128": tmp_path / "c128"}, "NVIDIA H200")
    a, b = r["loads"]
    assert r["energy"] == "measured" and a["tok_per_j_ratio"]["mean"] == 1.12 and a["device_calls"] == 2
    assert (a["device"], b["device"], r["device"]) == ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "per load (see each load)")
    assert a["goal"] == {
        "tok_per_j_ratio_ge_1_10": True,
        "slo_attainment_not_worse": True,
        "tuning_within_20_min": True,
        "three_pairs": True,
        "on_the_h200": True,
    }
    assert b["goal"] == {
        "tok_per_j_ratio_ge_1_10": False,
        "slo_attainment_not_worse": False,
        "tuning_within_20_min": False,
        "three_pairs": False,
        "on_the_h200": False,
    }
    md = rec.markdown(r)
    assert "| 1.1200 (1.1000–1.1400) (measured) |" in md and md.count("| yes |") == 1
    assert ("| no: tok/J below x1.10, SLO attainment worse, tuning over 20 min, fewer than 3 pairs, not on the H200 |") in md
    assert "| NVIDIA H100 80GB HBM3 |" in md
    assert rec.plot(panels, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0
    assert a["slo_limits"] == {"tpot_ms": 50.0} and panels[0].slo_tpot_ms == 50.0
    assert a["pair_tok_per_j"] == [{"winner": 5.5, "defaults": 5.0}]  # each pair's arms, beside the ratio


def test_a_load_finished_in_an_earlier_session_is_kept_as_it_stands(tmp_path, capsys):
    """A load's state directory is raw data, gone with the session that measured it; rebuilding the
    record for the other load must keep its entry (and its plot panel) unchanged."""
    for load in ("rate4", "c128"):
        (tmp_path / load).mkdir()
        (tmp_path / load / "tune-serving.json").write_text(json.dumps(_ts(1.05 if load == "c128" else 0.99, 1.0, 1.0, 900.0)))
    out = tmp_path / "results"
    assert rec.main(["--load", f"rate4={tmp_path / 'rate4'}", "--load", f"c128={tmp_path / 'c128'}", "--out-dir", str(out)]) == 0
    before = json.loads((out / f"{rec.NAME}.json").read_text())
    (tmp_path / "rate4" / "tune-serving.json").write_text(json.dumps(_ts(1.01, 1.0, 1.0, 950.0)))
    assert rec.main(["--load", f"rate4={tmp_path / 'rate4'}", "--keep", "c128", "--out-dir", str(out)]) == 0
    after = json.loads((out / f"{rec.NAME}.json").read_text())
    assert [e["load"] for e in after["loads"]] == ["rate4", "c128"] and after["loads"][1] == before["loads"][1]
    assert after["loads"][0]["tok_per_j_ratio"]["mean"] == 1.01 and (out / f"{rec.NAME}.png").stat().st_size > 0
    panel = rec.panel_of_entry(after["loads"][1])
    assert panel.points == [("cuda_perf_boost=auto", 30.0, 5.0, True), ("cuda_perf_boost=on", 30.0, 5.0, True)]
    assert panel.slo_tpot_ms == 50.0 and panel.winner_key == "cuda_perf_boost=auto"
    capsys.readouterr()
    assert rec.main(["--keep", "rate8", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep rate8: " in err[0] and "has no such load (it has: rate4, c128)" in err[0]
    assert rec.main(["--keep", "c128", "--out-dir", str(tmp_path / "empty")]) == 2
    assert "no record at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rec.main(["--load", f"c128={tmp_path / 'c128'}", "--keep", "c128", "--out-dir", str(out)])
    assert "keep it or rebuild it, not both" in capsys.readouterr().err
    assert json.loads((out / f"{rec.NAME}.json").read_text()) == after  # refused: nothing rewritten
    (out / f"{rec.NAME}.json").write_text('{"loads": [')  # cut short
    assert rec.main(["--load", f"rate4={tmp_path / 'rate4'}", "--keep", "c128", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep c128: the record at" in err[0] and "cannot be read (JSONDecodeError" in err[0]
    assert rec.main(["--load", f"rate4={tmp_path / 'rate4'}", "--out-dir", str(out)]) == 0
    assert "rebuilt from --load alone" in capsys.readouterr().err
    assert [e["load"] for e in json.loads((out / f"{rec.NAME}.json").read_text())["loads"]] == ["rate4"]


def test_a_rebuild_keeps_the_loads_order_and_says_what_it_kept_short_or_dropped(tmp_path, capsys):
    for load in ("rate4", "c128"):
        (tmp_path / load).mkdir()
        (tmp_path / load / "tune-serving.json").write_text(json.dumps(_ts(1.0, 1.0, 1.0, 900.0)))
    out = tmp_path / "results"
    assert rec.main(["--load", f"rate4={tmp_path / 'rate4'}", "--load", f"c128={tmp_path / 'c128'}", "--out-dir", str(out)]) == 0
    assert rec.main(["--load", f"c128={tmp_path / 'c128'}", "--keep", "rate4", "--out-dir", str(out)]) == 0
    assert [e["load"] for e in json.loads((out / f"{rec.NAME}.json").read_text())["loads"]] == ["rate4", "c128"]
    capsys.readouterr()
    assert rec.main(["--load", f"c128={tmp_path / 'c128'}", "--out-dir", str(out)]) == 0
    assert "note: rate4: in the record before, neither --load nor --keep now: dropped" in capsys.readouterr().err
    assert rec.main(["--load", f"rate4={tmp_path / 'rate4'}", "--load", f"c128={tmp_path / 'c128'}", "--out-dir", str(out)]) == 0
    record = json.loads((out / f"{rec.NAME}.json").read_text())
    assert [e["load"] for e in record["loads"]] == ["c128", "rate4"]  # c128 was alone in the record before
    del record["loads"][0]["slo_limits"]  # an entry written before the field
    (out / f"{rec.NAME}.json").write_text(json.dumps(record))
    assert rec.main(["--load", f"rate4={tmp_path / 'rate4'}", "--keep", "c128", "--out-dir", str(out)]) == 0
    assert "note: c128: the kept entry has no slo_limits: its panel has no SLO line" in capsys.readouterr().err
    del record["loads"][0]["search_windows"]
    (out / f"{rec.NAME}.json").write_text(json.dumps(record))
    assert rec.main(["--load", f"rate4={tmp_path / 'rate4'}", "--keep", "c128", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep c128: its entry in" in err[0] and "lacks 'search_windows'" in err[0]


def test_a_stopped_search_is_recorded_as_pending_with_its_measured_windows(tmp_path):
    ts = {**_ts(1.0, 1.0, 1.0, 540.0, pairs=0), "status": "stopped", "final": None}
    ts["configurations"][0]["windows"][0] |= {"key": "x", "window_s": 20.0, "output_throughput": 1300.04, "energy_label": "measured"}
    (tmp_path / "rate4").mkdir()
    (tmp_path / "rate4" / "tune-serving.json").write_text(json.dumps(ts))
    r, _ = rec.build({"rate4": tmp_path / "rate4"}, "NVIDIA H200")
    (e,) = r["loads"]
    assert e["status"] == "stopped" and e["pairs"] == 0 and e["tok_per_j_ratio"]["mean"] is None
    assert [w["key"] for w in e["search_windows"]] == ["cuda_perf_boost=auto", "cuda_perf_boost=on"]
    md = rec.markdown(r)
    assert "pending (stopped: resume with --resume-from)" in md and "| no |" not in md and "| yes |" not in md
    assert "best so far: `cuda_perf_boost=auto`" in md and "| `cuda_perf_boost=auto` | 20 | 5 | 1300 | n/a | 30 | met |" in md


@pytest.mark.parametrize("status, winner, verdict, shown", [
    ("slo_unmet", "cuda_perf_boost=auto", "no (slo_unmet)", "| `cuda_perf_boost=auto` |"),
    ("stopped", None, "pending (stopped: resume with --resume-from)", "| none |"),
])  # fmt: skip
def test_only_a_stopped_search_is_pending_and_a_missing_winner_reads_none(tmp_path, status, winner, verdict, shown):
    ts = {**_ts(1.0, 1.0, 1.0, 540.0, pairs=0), "status": status, "final": None}
    ts["winner"] = None if winner is None else {"key": winner, "command": "vllm serve m"}
    (tmp_path / "rate4").mkdir()
    (tmp_path / "rate4" / "tune-serving.json").write_text(json.dumps(ts))
    md = rec.markdown(rec.build({"rate4": tmp_path / "rate4"}, "NVIDIA H200")[0])
    assert f"| {verdict} |" in md and shown in md and "`None`" not in md


def test_pairs_past_the_third_extend_a_run_and_do_not_count_as_tuning_time():
    from benchmarks.h200_tune_serving_record import tuning_wall_s

    ts = _ts(1.4, 1.0, 1.0, 1000.0, pairs=6)
    pair = {"winner": {"wall_s": 60.0}, "defaults": {"wall_s": 40.0}}
    ts["final"]["pair_list"] = [pair] * 6
    assert tuning_wall_s(ts) == 700.0  # 1,000 s less pairs 4-6 (3 x 100 s)
    ts["final"]["pair_list"] = [pair] * 3
    assert tuning_wall_s(ts) == 1000.0
    assert tuning_wall_s({"search": {}}) is None
