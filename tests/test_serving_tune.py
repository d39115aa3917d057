"""`vllm-powersave tune-serving` without a server: the space, traces, SLO judging, the search, the
state file, and the driver end to end against a fake measurer (resume, refusals, an unmeetable SLO)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_powersave.serving_tune import run as ts_run
from vllm_powersave.serving_tune.measure import ServePlan
from vllm_powersave.serving_tune.search import Budget, CostModel, Round, Scored, next_round, rank
from vllm_powersave.serving_tune.slo import Slo, SloError, Verdict, attainment_of, judge, wilson_ci95
from vllm_powersave.serving_tune.space import (
    Config,
    MachineFacts,
    SpaceError,
    SpaceSpec,
    applicable,
    configurations,
    default_space,
    override,
    parse_space,
)
from vllm_powersave.serving_tune.state import Figures, Measurement, StateError, StateFile
from vllm_powersave.serving_tune.traffic import LengthRange, Traffic, TrafficError, parse_length_range, parse_trace, poisson_rows

# --- space -----------------------------------------------------------------------------------------


def test_a_grid_is_capped_by_a_seeded_sample_that_keeps_the_first_configuration():
    values = {"max_num_seqs": [256, 128, 512], "async_scheduling": [False, True], "api_server_count": [1, 4]}
    full = configurations(values, 100)
    assert len(full) == 12 and full[0].key == "max_num_seqs=256,api_server_count=1,async_scheduling=false"
    capped = configurations(values, 5, seed=3)
    assert len(capped) == 5 and capped[0] == full[0] and len({c.key for c in capped}) == 5
    assert capped == configurations(values, 5, seed=3)  # deterministic: a resumed search plans the same


def test_a_configuration_becomes_serve_flags_and_plugin_settings():
    c = Config((("max_num_seqs", 8), ("async_scheduling", True), ("cudagraph_capture_sizes", [1, 2, 4]), ("cuda_perf_boost", "auto")))
    assert c.serve_flags() == ["--max-num-seqs", "8", "--async-scheduling", "--cudagraph-capture-sizes", "1", "2", "4"]
    # The plugin alone would size the front end: a configuration that does not set it keeps vLLM's count.
    assert c.plugin_settings() == {"cuda_perf_boost": "auto", "api_server_count": "vllm"}
    loop = Config((("closed_loop_budget_pct", 1.0), ("api_server_count", 2)))
    assert loop.plugin_settings() == {"clocks": {"mode": "closed_loop", "closed_loop": {"slowdown_budget_pct": 1.0}}}
    assert Config((("closed_loop_budget_pct", None),)).key == "closed_loop_budget_pct=off"
    assert Config().key == "defaults" and Config().serve_flags() == [] and Config().plugin_settings() == {}


def test_decode_pacing_is_searched_on_any_machine_and_reaches_the_server_as_a_valid_setting(tmp_path):
    import json

    from vllm_powersave.serving_tune.measure import ServePlan
    from vllm_powersave.settings import load_settings

    paced, off = Config((("decode_pacing_tpot_ms", 35.0),)), Config((("decode_pacing_tpot_ms", None),))
    assert paced.key == "decode_pacing_tpot_ms=35" and off.key == "decode_pacing_tpot_ms=off"
    assert paced.plugin_settings() == {"decode_pacing": {"tpot_target_ms": 35.0}, "api_server_count": "vllm"}
    assert off.plugin_settings() == {}  # off: vLLM's defaults, the plugin not loaded on a GPU
    values, skipped = applicable(default_space(gpu=False, slo_tpot_ms=50.0), MachineFacts(False, False, "no GPU"))
    assert values["decode_pacing_tpot_ms"] == [None, 20.0, 35.0] and "decode_pacing_tpot_ms" not in skipped
    assert "decode_pacing_tpot_ms" not in default_space(gpu=True).searched()  # no TPOT SLO: no target to derive
    for gpu in (False, True):
        args = ServePlan(tmp_path, (), gpu, tmp_path).serve_args(paced)
        settings = load_settings(json.loads(args[args.index("--additional-config") + 1])["powersave"], env={})
        assert settings.decode_pacing.tpot_target_ms == 35.0
        assert settings.cuda_perf_boost == ("on" if not gpu else "auto")  # the CPU meter keeps stock values
    cpu_off = ServePlan(tmp_path, (), False, tmp_path).serve_args(off)
    assert load_settings(json.loads(cpu_off[cpu_off.index("--additional-config") + 1])["powersave"], env={}).savings == "off"


def test_stream_interval_is_a_searchable_serve_flag():
    c = Config((("api_server_count", 4), ("stream_interval", 8)))
    assert c.serve_flags() == ["--api-server-count", "4", "--stream-interval", "8"] and c.plugin_settings() == {}
    assert parse_space({"stream_interval": [1, 8]}, "s").searched() == {"stream_interval": [1, 8]}


def test_a_configuration_flag_replaces_the_base_arguments_value():
    base = ["--host", "127.0.0.1", "--max-num-seqs", "64", "--enforce-eager", "--async-scheduling"]
    assert override(base, ["--max-num-seqs", "8", "--no-async-scheduling"]) == [
        "--host",
        "127.0.0.1",
        "--enforce-eager",
        "--max-num-seqs",
        "8",
        "--no-async-scheduling",
    ]
    assert override(["--max-num-seqs=64", "--dtype", "bfloat16"], ["--max-num-seqs", "8"]) == ["--dtype", "bfloat16", "--max-num-seqs", "8"]
    assert override(["--max-model-len", "1024", "--host", "h"], ["--max-model-len=2048"]) == ["--host", "h", "--max-model-len=2048"]


def test_settings_that_cannot_act_here_are_skipped_with_a_reason():
    spec = default_space(gpu=True)
    keep, skipped = applicable(spec, MachineFacts(gpu=False, clocks_settable=False, clocks_reason="no GPU"))
    assert set(skipped) == {"cuda_perf_boost", "closed_loop_budget_pct"} and "no GPU" in skipped["cuda_perf_boost"]
    assert "max_num_seqs" in keep and "cuda_perf_boost" not in keep
    keep, skipped = applicable(spec, MachineFacts(gpu=True, clocks_settable=False, clocks_reason="POWERSAVE_FORCE_DRY_RUN=1"))
    assert list(skipped) == ["closed_loop_budget_pct"] and "POWERSAVE_FORCE_DRY_RUN=1" in skipped["closed_loop_budget_pct"]
    assert "predicted only" in skipped["closed_loop_budget_pct"] and keep["cuda_perf_boost"] == ["on", "auto", "off"]


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"max_num_seqs": [0]}, "field 'max_num_seqs' = 0: must be in [1, 65536]"),
        ({"max_num_seqs": "eight"}, "field 'max_num_seqs' = 'eight'"),
        ({"async_scheduling": [True, True]}, "a value is listed twice"),
        ({"turbo": [1]}, "field 'turbo' = [1]"),
        ({"cudagraph_capture_sizes": [[]]}, "non-empty list of batch sizes"),
        ({"cuda_perf_boost": ["max"]}, "field 'cuda_perf_boost'"),
        ({"stream_interval": [0]}, "field 'stream_interval' = 0: must be in [1, 4096]"),
        ({"async_scheduling": [1]}, "field 'async_scheduling' = [1]: Input should be a valid boolean"),
        ({"async_scheduling": ["yes"]}, "field 'async_scheduling' = ['yes']: Input should be a valid boolean"),
        ({"closed_loop_budget_pct": ["5"]}, "field 'closed_loop_budget_pct' = ['5']: Input should be a valid number"),
    ],
)
def test_a_bad_space_is_one_line_naming_the_field_and_value(data, needle):
    with pytest.raises(SpaceError) as err:
        parse_space(data, "--space s.yaml")
    assert needle in str(err.value) and str(err.value).startswith("--space s.yaml: ") and "\n" not in str(err.value)


def test_a_refusal_is_the_servers_own_error_line():
    from vllm_powersave.serving_tune.measure import refusal_reason

    log = (
        "INFO starting\nTraceback (most recent call last):\n  File x\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig\n"
        "  Value error, max_num_batched_tokens (16) must be greater than or equal to max_num_seqs (64). [type=value_error, input_value=1]\n"
        "    For further information visit https://errors.pydantic.dev\n"
    )
    assert refusal_reason(log) == (
        "ValidationError: 1 validation error for SchedulerConfig: max_num_batched_tokens (16) must be greater than or equal to max_num_seqs (64)."
    )
    assert refusal_reason("a\nerror: unrecognized arguments: --bogus\n") == "error: unrecognized arguments: --bogus"
    assert refusal_reason("just a line\n") == "just a line" and refusal_reason("") == "(empty log)"


# --- traffic ---------------------------------------------------------------------------------------


def test_traces_parse_from_json_lines_and_csv_sorted_from_zero(tmp_path):
    j = tmp_path / "t.jsonl"
    j.write_text('{"arrival_s": 10.5, "input_len": 64, "output_len": 16}\n\n{"arrival_s": 10.0, "input_len": 32, "output_len": 8}\n')
    rows = parse_trace(j)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in rows] == [(0.0, 32, 8), (0.5, 64, 16)]
    c = tmp_path / "t.csv"
    c.write_text("arrival_s,input_len,output_len\n0.0,100,20\n1.25,200,40\n")
    assert [(r.arrival_s, r.input_len) for r in parse_trace(c)] == [(0.0, 100), (1.25, 200)]
    t = Traffic("trace", trace=parse_trace(c), trace_path=str(c))
    assert len(t.rows(1.0, 0)) == 1 and len(t.rows(10.0, 0)) == 2 and len(t.rows(0.0, 0)) == 1  # at least one request


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            '{"arrival_s": 0, "input_len": 4, "output_len": 4}\n{"arrival_s": 1, "input_len": -4, "output_len": 4}\n',
            "line 2: field 'input_len' = -4",
        ),
        ('{"arrival_s": "soon", "input_len": 4, "output_len": 4}\n', "line 1: field 'arrival_s' = 'soon'"),
        ('{"arrival_s": 0, "input_len": 4}\n', "line 1: field 'output_len' is missing"),
        ('{"arrival_s": 0, "input_len": 4, "output_len": 4}\n{oops\n', "line 2: invalid JSON"),
        ("time,in,out\n0,1,1\n", "line 1: header = 'time,in,out'"),
        ("arrival_s,input_len,output_len\n0,12,x\n", "line 2: field 'output_len' = 'x'"),
        ("", "no requests"),
    ],
)
def test_a_trace_that_does_not_parse_is_one_line_naming_line_field_and_value(tmp_path, text, needle):
    p = tmp_path / "bad.trace"
    p.write_text(text)
    with pytest.raises(TrafficError) as err:
        parse_trace(p)
    assert needle in str(err.value) and str(err.value).startswith(f"--trace {p}") and "\n" not in str(err.value)


def test_poisson_windows_are_seeded_and_within_the_window():
    a = poisson_rows(4.0, 10.0, LengthRange(128, 1024), LengthRange(32, 512), seed=7)
    assert a == poisson_rows(4.0, 10.0, LengthRange(128, 1024), LengthRange(32, 512), seed=7)
    assert a != poisson_rows(4.0, 10.0, LengthRange(128, 1024), LengthRange(32, 512), seed=8)
    assert a[0].arrival_s == 0.0 and all(r.arrival_s < 10.0 for r in a)
    assert all(128 <= r.input_len <= 1024 and 32 <= r.output_len <= 512 for r in a)
    assert parse_length_range("256", "--input-len") == LengthRange(256, 256)
    for bad in ("0:10", "10:5", "a:b", "1:2:3"):
        with pytest.raises(TrafficError, match=f"--input-len = '{bad}'"):
            parse_length_range(bad, "--input-len")


# --- SLO -------------------------------------------------------------------------------------------


def test_attainment_counts_failed_and_late_requests_against_the_slo():
    slo = Slo(ttft_ms=100, tpot_ms=10, attainment=0.9)
    # 4 requests: on time; late first token; slow decode ((0.5 - 0.05) / 9 = 50 ms per token); failed.
    result = {
        "ttfts": [0.05, 0.2, 0.05, 0.0],
        "latencies": [0.1, 0.3, 0.5, 0.0],
        "output_lens": [10, 10, 10, 0],
        "errors": ["", "", "", "timeout"],
    }
    assert attainment_of(result, slo) == (1, 4)
    v = judge(1, 4, {"ttft": 150.0, "tpot": 40.0, "itl": 5.0}, slo)
    assert not v.met and v.shortfall_pts == pytest.approx(65.0)
    assert v.misses[0] == "attainment 25.0 % vs 90 % (65.0 points short)"
    assert "p99 TPOT 40.0 ms vs 10 ms (+300 %)" in v.misses and v.worst_over == pytest.approx(3.0)
    assert judge(99, 100, {"ttft": 1.0, "tpot": 1.0, "itl": 1.0}, Slo(ttft_ms=100, attainment=0.99)).met
    # ITL is judged on the window's p99.
    assert not judge(10, 10, {"itl": 30.0}, Slo(itl_ms=20)).met and judge(10, 10, {"itl": 19.0}, Slo(itl_ms=20)).met
    assert not judge(0, 0, {}, Slo()).met


def test_slo_targets_out_of_range_are_refused_naming_the_flag():
    with pytest.raises(SloError, match=r"--slo-tpot-ms = -1: must be a positive number of ms"):
        Slo(tpot_ms=-1)
    with pytest.raises(SloError, match=r"--slo-attainment = 1.5"):
        Slo(attainment=1.5)


def test_wilson_interval_of_a_share():
    lo, hi = wilson_ci95(30, 30)
    assert hi == 1.0 and 0.88 < lo < 0.89
    assert wilson_ci95(0, 0) is None


# --- search ----------------------------------------------------------------------------------------


def _scored(key, tpj, met, shortfall=0.0, over=0.0):
    return Scored(key, 0, tpj, Verdict(met, 1.0 if met else 0.5, shortfall, over))


def test_ranking_puts_slo_met_by_tokens_per_joule_first_then_the_closest():
    ranked = rank([_scored("a", 5.0, False, 1.0), _scored("b", 2.0, True), _scored("c", 3.0, True), _scored("d", 9.0, False, 0.5)])
    assert [s.key for s in ranked] == ["c", "b", "d", "a"]


def test_successive_halving_keeps_the_best_half_with_a_longer_window():
    r0 = Round(0, ("a", "b", "c", "d", "e"), 10.0, 0)
    scored = [_scored(k, v, True) for k, v in zip(r0.keys, [1.0, 5.0, 3.0, 4.0, 2.0])]
    r1 = next_round(r0, scored, eta=2)
    assert r1 == Round(1, ("b", "d", "c"), 20.0, 1)
    r2 = next_round(r1, scored[1:4], eta=2)
    assert r2 == Round(2, ("b", "d"), 40.0, 2)
    assert next_round(r2, scored[1:2] + scored[3:4], eta=2) is None  # one left: the winner
    assert ts_run.planned_steps(5, 2, 3) == 5 + 3 + 2 + 6


def test_the_budget_leaves_room_for_the_final_pairs():
    cost = CostModel(start_s=60.0, overhead_s=10.0)
    assert cost.measurement_s(30.0, restart=True) == 100.0 and cost.measurement_s(30.0, restart=False) == 40.0
    assert cost.pairs_s(3, 30.0) == 6 * 40.0 + 4 * 60.0
    b = Budget(total_s=450.0, spent_before_s=100.0)  # 100 s went to an earlier run of the search
    assert b.allows(100.0, cost.pairs_s(3, 30.0)) is False and b.allows(10.0, 300.0) is True
    assert b.pairs_that_fit(3, 30.0, cost) == 2 and Budget(1.0).pairs_that_fit(3, 30.0, cost) == 1
    # a resumed search prices only the pairs it still has to measure (2 done: the third costs 140 s)
    assert b.pairs_that_fit(3, 30.0, cost, done=2) == 3 and Budget(1.0).pairs_that_fit(3, 30.0, cost, done=2) == 2


# --- state -----------------------------------------------------------------------------------------


def _figs(tpj=1.0, good=10, sent=10, tpot=5.0):
    return Figures(tpj, "simulated", 100.0, 50.0, 20.0, tpot, 6.0, good, sent, sent, 0, 3.0)


def test_the_state_file_refuses_another_search_and_drops_a_cut_last_line(tmp_path, capsys):
    path = tmp_path / "state.jsonl"
    st = StateFile(path, {"window_s": 3.0, "configs": ["a"]})
    assert st.open() == 0
    m = Measurement("search/r0/a", "search", "a", 3.0, 0, _figs(), 12.0, True, "now", round=0)
    st.add(m)
    with open(path, "a") as f:
        f.write('{"kind": "measurement", "step": "search/r0/b", "fig')  # killed mid-write
    again = StateFile(path, {"window_s": 3.0, "configs": ["a"]})
    assert again.open() == 1 and again.measurements["search/r0/a"] == m and again.spent_s() == 12.0
    assert "line 3 is incomplete" in capsys.readouterr().err
    assert path.read_text().count("\n") == 2  # the cut line is gone, the finished one kept
    with pytest.raises(StateError, match=r"holds another search: 'window_s' = 3.0 there, 5.0 now"):
        StateFile(path, {"window_s": 5.0, "configs": ["a"]}).open()


@pytest.mark.parametrize("line", ["[1]", '{"kind": "measurement", "step": "x"}', '{"kind": "rejection"}', '"text"'])
def test_a_state_line_that_is_json_but_no_record_stops_with_one_line_and_keeps_the_file(tmp_path, line):
    path = tmp_path / "state.jsonl"
    st = StateFile(path, {"window_s": 3.0})
    st.open()
    st.add(Measurement("search/r0/a", "search", "a", 3.0, 0, _figs(), 12.0, True, "now", round=0))
    with open(path, "a") as f:
        f.write(line + "\n" + '{"kind": "note"}\n')  # an edited line, then another: not the cut last write
    before = path.read_text()
    with pytest.raises(StateError) as err:
        StateFile(path, {"window_s": 3.0}).open()
    assert "line 3 is not a tune-serving record" in str(err.value) and "\n" not in str(err.value)
    assert path.read_text() == before  # nothing measured is lost


# --- the driver, against a fake measurer -------------------------------------------------------------


class FakeMeasurer:
    """Stands in for the server: each configuration's figures from a table; counts every window."""

    table: dict = {}
    refuse: set = set()
    calls: list = []

    def __init__(self, plan, traffic, slo):
        self.serving = None

    def needs_restart(self, config):
        return self.serving != config.key

    def measure(self, config, window_s, seed, label):
        from vllm_powersave.serving_tune.measure import Refused

        if config.key in self.refuse:
            raise Refused("ValueError: max_num_batched_tokens (16) is smaller than max_model_len (1024)")
        FakeMeasurer.calls.append((config.key, window_s, seed))
        restarted = self.needs_restart(config)
        self.serving = config.key
        return FakeMeasurer.table[config.key], restarted

    def close(self):
        self.serving = None


def _opts(tmp_path, keys_values, slo=None, **kw):
    configs = tuple(Config((("max_num_seqs", v),)) for v in keys_values)
    plan = ServePlan(model=tmp_path / "m", base_args=("--max-num-seqs", "64"), gpu=False, out_dir=tmp_path / "out")
    return ts_run.TuneServingOptions(
        plan=plan,
        traffic=Traffic("saturation", concurrency=4),
        slo=slo or Slo(tpot_ms=10.0),
        configs=configs,
        space={"max_num_seqs": list(keys_values)},
        skipped={"cuda_perf_boost": "no GPU: there is no CUDA context to boost"},
        window_s=2.0,
        pairs=2,
        progress=False,
        **kw,
    )


@pytest.fixture
def fake(monkeypatch):
    FakeMeasurer.calls = []
    FakeMeasurer.refuse = set()
    FakeMeasurer.table = {
        "max_num_seqs=2": _figs(tpj=1.0),
        "max_num_seqs=8": _figs(tpj=3.0),
        "max_num_seqs=32": _figs(tpj=5.0, good=5, tpot=30.0),  # most tokens per joule, misses the SLO
        "max_num_seqs=16": _figs(tpj=2.0),
        "defaults": _figs(tpj=2.5),
    }
    monkeypatch.setattr(ts_run, "Measurer", FakeMeasurer)
    return FakeMeasurer


def test_the_search_picks_the_most_tokens_per_joule_that_meets_the_slo_and_pairs_it_abba(tmp_path, fake, capsys):
    rc = ts_run.execute(_opts(tmp_path, [2, 8, 32, 16]))
    assert rc == 0
    search = [c for c in fake.calls if c[1] == 2.0][:4]
    assert [c[0] for c in search] == ["max_num_seqs=2", "max_num_seqs=8", "max_num_seqs=32", "max_num_seqs=16"]
    assert ("max_num_seqs=8", 4.0, 1) in fake.calls and ("max_num_seqs=16", 4.0, 1) in fake.calls  # round 1: the best 2, twice as long
    finals = [c[0] for c in fake.calls if c[2] >= 1000]
    assert finals == ["max_num_seqs=8", "defaults", "defaults", "max_num_seqs=8"]  # ABBA
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["status"] == "done" and rec["winner"]["key"] == "max_num_seqs=8" and rec["energy_label"] == "simulated"
    assert rec["final"]["tok_per_j_ratio"] == {"mean": 1.2, "ci95": [1.2, 1.2]}
    assert rec["final"]["slo_attainment"]["defaults"]["windows_meeting_slo"] == 2
    assert rec["winner"]["command"] == "vllm serve " + str(tmp_path / "m") + " --max-num-seqs 8"
    assert (tmp_path / "out" / "winner-command.txt").read_text().strip() == rec["winner"]["command"]
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0
    md = (tmp_path / "out" / "tune-serving.md").read_text()
    assert "Energy SIMULATED" in md and "Skipped `cuda_perf_boost`: no GPU" in md and "| `max_num_seqs=32` | r0 |" in md
    out = capsys.readouterr().out
    assert "tok/J (simulated)" in out and rec["winner"]["command"] in out


def test_a_stopped_search_resumes_without_measuring_anything_again(tmp_path, fake, capsys):
    assert ts_run.execute(_opts(tmp_path, [2, 8], stop_after=1)) == ts_run.EXIT_STOPPED
    assert fake.calls == [("max_num_seqs=2", 2.0, 0)]
    assert "rerun the same command to resume" in capsys.readouterr().out
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["status"] == "stopped" and len(rec["configurations"][0]["windows"]) == 1  # the partial report keeps it
    fake.calls = []
    assert ts_run.execute(_opts(tmp_path, [2, 8])) == 0
    assert ("max_num_seqs=2", 2.0, 0) not in fake.calls and fake.calls[0] == ("max_num_seqs=8", 2.0, 0)
    assert "resuming: 1 finished step(s)" in capsys.readouterr().out
    steps = [json.loads(x)["step"] for x in (tmp_path / "out" / "state.jsonl").read_text().splitlines()[1:]]
    assert len(steps) == len(set(steps)) == 2 + 4
    fake.calls = []
    assert ts_run.execute(_opts(tmp_path, [2, 8])) == 0 and fake.calls == []  # all done: nothing measured again


def test_a_finished_search_resumed_with_more_pairs_measures_only_the_new_pairs(tmp_path, fake):
    import dataclasses

    assert ts_run.execute(_opts(tmp_path, [2, 8])) == 0
    done = [c for c in fake.calls if c[2] >= 1000]
    assert len(done) == 4  # 2 pairs
    fake.calls = []
    assert ts_run.execute(dataclasses.replace(_opts(tmp_path, [2, 8]), pairs=4)) == 0
    assert [c[2] for c in fake.calls] == [1003, 1003, 1004, 1004]  # pairs 3 and 4, nothing before them again
    assert [c[0] for c in fake.calls] == ["max_num_seqs=8", "defaults", "defaults", "max_num_seqs=8"]  # still ABBA
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert len(rec["final"]["pair_list"]) == 4


def _clocked(monkeypatch, fake, longer=None):
    """The fake measurer on a fake clock: each window costs its length, 10 s around it and 60 s per
    server start; ``longer``: figures of a configuration in windows of 4 s or more."""
    import types

    from vllm_powersave.serving_tune import search as ts_search

    clock = [0.0]
    t = types.SimpleNamespace(monotonic=lambda: clock[0])
    monkeypatch.setattr(ts_run, "time", t)
    monkeypatch.setattr(ts_search, "time", t)
    measure = fake.measure

    def timed(self, config, window_s, seed, label):
        clock[0] += window_s + 10 + (60 if self.needs_restart(config) else 0)
        figs, restarted = measure(self, config, window_s, seed, label)
        return ((longer or {}).get(config.key, figs) if window_s >= 4 else figs), restarted

    monkeypatch.setattr(fake, "measure", timed)


def test_a_resume_with_a_larger_budget_extends_the_pairs_of_the_winner_they_were_measured_for(tmp_path, fake, monkeypatch):
    # 560 s cuts round 1 after max_num_seqs=8: the pairs are of 8. A resume with 3x the budget would
    # finish round 1, where 16 reads best, and paired 16 with the windows measured for 8.
    _clocked(monkeypatch, fake, longer={"max_num_seqs=16": _figs(tpj=4.0)})
    assert ts_run.execute(dataclasses.replace(_opts(tmp_path, [2, 8, 32, 16]), budget_s=560.0)) == 0
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["search"]["budget_stopped"] and rec["winner"]["key"] == "max_num_seqs=8"
    fake.calls = []
    assert ts_run.execute(dataclasses.replace(_opts(tmp_path, [2, 8, 32, 16]), budget_s=3 * 560.0, pairs=4)) == 0
    assert {c[0] for c in fake.calls} == {"max_num_seqs=8", "defaults"} and all(c[2] >= 1003 for c in fake.calls)
    assert json.loads((tmp_path / "out" / "tune-serving.json").read_text())["winner"]["key"] == "max_num_seqs=8"


def test_pairs_the_budget_cannot_hold_are_said(tmp_path, fake, monkeypatch, capsys):
    _clocked(monkeypatch, fake)
    assert ts_run.execute(dataclasses.replace(_opts(tmp_path, [2, 8]), budget_s=400.0)) == 0
    capsys.readouterr()
    assert ts_run.execute(dataclasses.replace(_opts(tmp_path, [2, 8]), budget_s=400.0, pairs=6)) == 0
    assert "budget: 2 of 6 final pair(s) fit" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "tune-serving.json").read_text())["search"]["pairs_asked"] == 6


def test_a_resumed_search_prices_the_final_pairs_at_the_server_starts_it_measured(tmp_path, fake):
    # A resume that forgot the measured starts priced each at the 60 s (CPU) or 120 s (GPU) guess and
    # cut the final pairs from 3 to 2 in a budget that held 3 (docs/results/h200-tune-serving.md).
    assert ts_run.execute(_opts(tmp_path, [2, 8], stop_after=2)) == ts_run.EXIT_STOPPED
    s = ts_run.Session(_opts(tmp_path, [2, 8], budget_s=200.0))  # 3 pairs at the guessed 60 s starts: 312 s
    try:
        assert s.start(6) == 2
        assert s.cost.start_s < 5.0  # the fake's servers start at once
        assert s.budget.pairs_that_fit(3, 2.0, s.cost) == 3
    finally:
        s.close()


def test_a_resumed_search_prices_a_window_measured_twice_per_window(tmp_path):
    """A window measured again (no energy figure the first time) records both runs' wall time; the
    live cost model learnt from it per window, and a resume must too (it learnt twice the overhead,
    and fewer final pairs fitted)."""
    opts = _opts(tmp_path, [2, 8])
    state = StateFile(opts.plan.out_dir / ts_run.STATE_NAME, opts.header())
    state.lock()
    state.open()
    once = Measurement("search/r0/max_num_seqs=2", "search", "max_num_seqs=2", 60.0, 0, _figs(), 130.0, True, "t", round=0)
    twice = dataclasses.replace(once, step="search/r0/max_num_seqs=8", key="max_num_seqs=8", wall_s=140.0, restarted=False, runs=2)
    state.add(once)
    state.add(twice)
    state.unlock()
    s = ts_run.Session(opts)
    try:
        s.start(6)
        assert s.cost.overhead_s == pytest.approx(10.0)  # 140 s / 2 windows - 60 s
    finally:
        s.close()


def test_an_unmeetable_slo_ends_with_the_closest_configuration_and_its_miss(tmp_path, fake, capsys):
    rc = ts_run.execute(_opts(tmp_path, [2, 8, 32], slo=Slo(tpot_ms=10.0, itl_ms=1.0)))  # every window's p99 ITL is 6 ms
    assert rc == ts_run.EXIT_SLO_UNMET
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "no configuration met the SLO" in err[0] and "the closest, max_num_seqs=8, misses by" in err[0]
    assert err[0].endswith("misses by p99 ITL 6.0 ms vs 1 ms (+500 %)")  # 32 has more tokens per joule but misses more
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["status"] == "slo_unmet" and rec["closest"]["key"] == "max_num_seqs=8" and "final" not in rec
    assert not [c for c in fake.calls if c[2] >= 1000]  # no pairs for a configuration that misses


def test_a_configuration_vllm_refuses_is_one_line_and_the_rest_is_measured(tmp_path, fake, capsys):
    fake.refuse = {"max_num_seqs=8"}
    assert ts_run.execute(_opts(tmp_path, [2, 8, 16])) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert err == [
        "error: vllm serve refused configuration max_num_seqs=8: ValueError: max_num_batched_tokens (16) is smaller than "
        "max_model_len (1024) (skipped; nothing measured is lost)"
    ]
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["winner"]["key"] == "max_num_seqs=16"  # 2 and 16 meet the SLO, 16 has the more tokens per joule
    assert rec["configurations"][1]["refused_by_vllm"].startswith("ValueError")


def test_an_interrupt_keeps_every_finished_measurement(tmp_path, fake, monkeypatch, capsys):
    real = FakeMeasurer.measure

    def measure(self, config, *a):
        if config.key == "max_num_seqs=8":
            raise KeyboardInterrupt
        return real(self, config, *a)

    monkeypatch.setattr(FakeMeasurer, "measure", measure)
    assert ts_run.execute(_opts(tmp_path, [2, 8])) == ts_run.EXIT_STOPPED
    assert "interrupted: every finished measurement is in" in capsys.readouterr().out
    lines = (tmp_path / "out" / "state.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["key"] == "max_num_seqs=2"


# --- the command's bad inputs ----------------------------------------------------------------------


def _cli(argv, capsys):
    from vllm_powersave.cli import main

    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--max-num-seqs", "0,8"], "error: space flags: field 'max_num_seqs' = 0: must be in [1, 65536]"),
        (["--slo-tpot-ms", "-5"], "error: --slo-tpot-ms = -5.0: must be a positive number of ms"),
        (["--window-s", "0"], "error: --window-s = 0.0: out of range"),
        (["--input-len", "9:3"], "error: --input-len = '9:3'"),
        (["--cuda-perf-boost", "auto,off"], "error: the space has no setting that can act on this machine: cuda_perf_boost: no GPU"),
    ],
)
def test_bad_command_input_is_one_line_before_anything_starts(tiny_config, tmp_path, capsys, extra, needle):
    base = ["tune-serving", "--model", str(tiny_config), "--concurrency", "4", "--out", str(tmp_path / "o")]
    rc, _, err = _cli(base + extra, capsys)
    assert rc == 2 and err.strip().splitlines() == [err.strip()] and err.startswith(needle)
    assert not (tmp_path / "o").exists()  # nothing started, nothing written


def test_a_bad_trace_file_through_the_command(tiny_config, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_len": 8, "output_len": 0}\n')
    rc, _, err = _cli(["tune-serving", "--model", str(tiny_config), "--trace", str(trace), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and err.strip() == f"error: --trace {trace}: line 1: field 'output_len' = 0: must be an integer number of tokens >= 1"


def test_a_space_file_restricts_the_search(tiny_config, tmp_path):
    from vllm_powersave.cli import build_parser
    from vllm_powersave.serving_tune.command import options_from

    space = tmp_path / "space.yaml"
    space.write_text("max_num_seqs: [4, 16]\nasync_scheduling: [off]\n")
    ns = build_parser().parse_args(
        ["tune-serving", "--model", str(tiny_config), "--rate", "2", "--space", str(space), "--out", str(tmp_path)]
    )
    opts = options_from(ns)
    assert [c.key for c in opts.configs] == ["max_num_seqs=4,async_scheduling=false", "max_num_seqs=16,async_scheduling=false"]
    assert opts.traffic.kind == "poisson" and opts.traffic.rate_rps == 2.0
    ns = build_parser().parse_args(
        ["tune-serving", "--model", str(tiny_config), "--rate", "2", "--space", str(space), "--max-num-seqs", "2", "--out", str(tmp_path)]
    )
    assert [c.key for c in options_from(ns).configs] == ["max_num_seqs=2,async_scheduling=false"]  # a flag overrides the file's list
    assert isinstance(SpaceSpec().searched(), dict)


def test_an_interrupt_during_server_start_up_stops_that_server(tmp_path, monkeypatch):
    from vllm_powersave import serving
    from vllm_powersave.serving_tune.measure import Measurer

    stopped = []

    class StartInterrupted:
        def __init__(self, args, **kw):
            self.args = args

        def start(self):
            raise KeyboardInterrupt

        def stop(self):
            stopped.append(self.args)

    monkeypatch.setattr(serving, "VllmServer", StartInterrupted)
    plan = ServePlan(model=tmp_path / "m", base_args=(), gpu=True, out_dir=tmp_path / "out")
    m = Measurer(plan, Traffic("saturation", concurrency=1), Slo())
    with pytest.raises(KeyboardInterrupt):
        m.measure(Config((("max_num_seqs", 4),)), 1.0, 0, "w")
    assert stopped == [[str(tmp_path / "m"), "--max-num-seqs", "4"]] and m.needs_restart(Config((("max_num_seqs", 4),)))


def test_the_best_so_far_follows_the_ranking_and_says_simulated(tmp_path, fake):
    s = ts_run.Session(_opts(tmp_path, [2, 32, 8]))
    s.start(ts_run.planned_steps(3, 2, 2))
    seen = []
    s.note_best = lambda text: seen.append(text)  # what the progress bar's postfix shows
    ts_run.run_search(s)
    s.close()
    assert seen[:3] == [
        "max_num_seqs=2 1 tok/J (simulated)",
        "max_num_seqs=2 1 tok/J (simulated)",  # 32 has more tokens per joule but misses the SLO
        "max_num_seqs=8 3 tok/J (simulated)",
    ]


# --- attacks found in review: each fails without its fix ----------------------------------------------


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--window-s", "inf"], "error: --window-s = inf: out of range"),
        (["--budget-min", "inf"], "error: --budget-min = inf: out of range"),
        (["--startup-timeout", "-1"], "error: --startup-timeout = -1.0: out of range"),
        (["--max-num-seqs", "[,64"], "error: --max-num-seqs = '[,64': not a list of values"),
        (["--max-num-seqs", "true"], "error: space flags: field 'max_num_seqs' = [True]: Input should be a valid integer"),
    ],
)
def test_infinite_numbers_unparsable_flags_and_booleans_as_counts_are_one_line(tiny_config, tmp_path, capsys, extra, needle):
    base = ["tune-serving", "--model", str(tiny_config), "--concurrency", "4", "--out", str(tmp_path / "o")]
    rc, _, err = _cli(base + extra, capsys)
    assert rc == 2 and err.strip().splitlines() == [err.strip()] and err.startswith(needle)


def test_an_infinite_rate_and_an_out_that_is_a_file_are_one_line(tiny_config, tmp_path, capsys):
    rc, _, err = _cli(["tune-serving", "--model", str(tiny_config), "--rate", "inf", "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and err.strip() == "error: --rate = inf: out of range (see --help)"  # an infinite rate never ends a window
    (tmp_path / "f").write_text("")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        rc, _, err = _cli(["tune-serving", "--model", str(tiny_config), "--rate", "1", "--out", str(out)], capsys)
        assert rc == 2 and err.strip() == f"error: --out = {str(out)!r}: not a directory (it or a folder above it is a file)"


def test_a_trace_row_with_more_fields_than_the_header_is_refused(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_len,output_len\n0,5,4,9\n")
    with pytest.raises(TrafficError, match=r"line 2: 4 fields, expected 3"):
        parse_trace(trace)


def test_an_edited_trace_file_is_another_search(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_len": 5, "output_len": 4}\n')
    a = Traffic("trace", trace=parse_trace(trace), trace_path=str(trace)).identity()
    trace.write_text('{"arrival_s": 0, "input_len": 500, "output_len": 4}\n')  # same path, same row count
    b = Traffic("trace", trace=parse_trace(trace), trace_path=str(trace)).identity()
    assert a != b
    StateFile(tmp_path / "s.jsonl", {"traffic": a}).open()
    with pytest.raises(StateError, match=r"holds another search: 'traffic.trace_sha256' = "):
        StateFile(tmp_path / "s.jsonl", {"traffic": b}).open()


def test_a_last_state_line_whose_newline_was_cut_is_kept_and_the_next_line_starts_fresh(tmp_path):
    path = tmp_path / "state.jsonl"
    st = StateFile(path, {"configs": ["a"]})
    st.open()
    st.add(Measurement("search/r0/a", "search", "a", 3.0, 0, _figs(), 12.0, True, "now", round=0))
    path.write_text(path.read_text()[:-1])  # killed between the line and its newline
    again = StateFile(path, {"configs": ["a"]})
    assert again.open() == 1
    again.add(Measurement("search/r0/b", "search", "b", 3.0, 0, _figs(), 12.0, True, "now", round=0))
    third = StateFile(path, {"configs": ["a"]})
    assert third.open() == 2 and set(third.measurements) == {"search/r0/a", "search/r0/b"}


def test_a_second_run_on_the_same_out_is_refused_while_the_first_holds_it(tmp_path):
    first = StateFile(tmp_path / "state.jsonl", {})
    first.lock()
    with pytest.raises(StateError, match="another tune-serving is running with this --out"):
        StateFile(tmp_path / "state.jsonl", {}).lock()
    first.unlock()
    StateFile(tmp_path / "state.jsonl", {}).lock()


def test_a_server_that_does_not_answer_in_time_is_a_failure_not_a_recorded_refusal(tmp_path, monkeypatch):
    from vllm_powersave import serving
    from vllm_powersave.serving_tune.measure import MeasureError, Measurer

    class Slow:
        def __init__(self, args, **kw):
            pass

        def start(self):
            raise serving.ServerError("vllm serve did not become healthy within 60 s (log: x)")

        def stop(self):
            pass

    monkeypatch.setattr(serving, "VllmServer", Slow)
    plan = ServePlan(model=tmp_path / "m", base_args=(), gpu=True, out_dir=tmp_path / "out")
    with pytest.raises(MeasureError, match=r"did not become healthy within 60 s \(log: x\); nothing is recorded for max_num_seqs=4"):
        Measurer(plan, Traffic("saturation", concurrency=1), Slo()).measure(Config((("max_num_seqs", 4),)), 1.0, 0, "w")


def test_sigterm_stops_the_search_like_an_interrupt_and_keeps_every_measurement(tmp_path, fake, monkeypatch, capsys):
    import os
    import signal

    real = FakeMeasurer.measure

    def measure(self, config, *a):
        if config.key == "max_num_seqs=8":
            os.kill(os.getpid(), signal.SIGTERM)  # `timeout`, a scheduler, a closed terminal
        return real(self, config, *a)

    monkeypatch.setattr(FakeMeasurer, "measure", measure)
    before = signal.getsignal(signal.SIGTERM)  # an earlier test in this process may have set one (vLLM's engine does)
    assert ts_run.execute(_opts(tmp_path, [2, 8])) == ts_run.EXIT_STOPPED
    assert "interrupted: every finished measurement is in" in capsys.readouterr().out
    lines = (tmp_path / "out" / "state.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["key"] == "max_num_seqs=2"
    assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_a_server_left_running_by_a_killed_run_is_stopped_on_resume(tmp_path):
    import subprocess

    from vllm_powersave.serving_tune.measure import leftover_servers, stop_leftover_servers

    logs = tmp_path / "servers"
    logs.mkdir()
    with open(logs / "server-001-x.log", "wb") as log:  # what a `kill -9` of tune-serving leaves: its server, still logging
        proc = subprocess.Popen(["sleep", "60"], stdout=log, start_new_session=True)
    try:
        assert leftover_servers(logs) == [proc.pid]
        assert stop_leftover_servers(logs) == [proc.pid]
        assert proc.wait(5) is not None and leftover_servers(logs) == []
    finally:
        proc.kill()


def test_a_budget_too_small_for_one_window_names_budget_min(tmp_path, fake, capsys):
    rc = ts_run.execute(_opts(tmp_path, [2, 8], budget_s=6.0))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and fake.calls == []
    assert len(err) == 1 and err[0].startswith("error: --budget-min = 0.1: too small: one 2 s window and the final pairs need about")
    assert json.loads((tmp_path / "out" / "tune-serving.json").read_text())["status"] == "budget_too_small"


def _budget_clock(monkeypatch, when, seconds: float, **figures) -> None:
    """The budget's clock advances ``seconds`` in each window for which ``when(config, seed)`` holds,
    whose figures are replaced by ``figures``; the other windows take no time."""
    from vllm_powersave.serving_tune import search

    clock = {"s": 0.0}
    monkeypatch.setattr(search.time, "monotonic", lambda: clock["s"])
    real = FakeMeasurer.measure

    def measure(self, config, window_s, seed, label):
        figs, restarted = real(self, config, window_s, seed, label)
        if when(config, seed):
            clock["s"] += seconds
            figs = dataclasses.replace(figs, **figures)
        return figs, restarted

    monkeypatch.setattr(FakeMeasurer, "measure", measure)


def test_a_round_cut_short_ranks_its_configurations_by_the_round_before(tmp_path, fake, monkeypatch):
    """Round 1 measured max_num_seqs=8 (a window of other requests, read low) before the budget
    stopped it; set against max_num_seqs=16's round-0 window, that chose 16 from two windows of
    different requests. The round before measured both on the same requests: 8 stays ahead."""
    # round 1's first window leaves no room for its second, and reads low
    _budget_clock(monkeypatch, lambda config, seed: seed == 1, 300.0, output_tokens_per_joule=0.5)
    assert ts_run.execute(_opts(tmp_path, [2, 8, 32, 16], budget_s=420.0)) == 0
    assert [c[0] for c in fake.calls if c[2] == 1] == ["max_num_seqs=8"]
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["search"]["stopped_round"] == 1 and rec["search"]["not_measured"] == ["max_num_seqs=16"]
    assert rec["winner"]["key"] == "max_num_seqs=8"


def test_a_round_cut_short_does_not_undo_a_window_that_missed_the_slo(tmp_path, fake, monkeypatch):
    """max_num_seqs=8 met the SLO in round 0 and missed it in its round-1 window before the budget
    stopped the round: ranked by round 0 alone it would still win and go to the final pairs."""
    _budget_clock(monkeypatch, lambda config, seed: seed == 1, 300.0, good=0)  # no request met the SLO there
    assert ts_run.execute(_opts(tmp_path, [2, 8, 32, 16], budget_s=420.0)) == 0
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["search"]["stopped_round"] == 1 and rec["winner"]["key"] == "max_num_seqs=16"


def test_a_search_the_budget_stops_after_a_round_names_that_round_and_what_it_skipped(tmp_path, fake, monkeypatch):
    """A search stopped between rounds once reported "not measured: " with nothing after it, since
    every skipped configuration had a window from round 0 (docs/results/h200-tune-serving.md)."""
    # round 0's last window leaves no room for round 1 beside the pairs
    _budget_clock(monkeypatch, lambda config, seed: config.key == "max_num_seqs=16" and seed == 0, 310.0)
    assert ts_run.execute(_opts(tmp_path, [2, 8, 32, 16], budget_s=330.0)) == 0
    assert not [c for c in fake.calls if c[1] == 4.0 and c[2] < 1000]  # no round-1 window
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["search"]["stopped_round"] == 1 and rec["search"]["not_measured"] == ["max_num_seqs=8", "max_num_seqs=16"]
    md = (tmp_path / "out" / "tune-serving.md").read_text()
    assert "(stopped by the budget in round 1; not measured there: `max_num_seqs=8`, `max_num_seqs=16`)" in md


@pytest.mark.parametrize(
    ("ratio", "winner_met", "defaults_met", "starts"),
    [
        ({"mean": 1.12, "ci95": [1.05, 1.19]}, 3, 3, "winner saves"),
        ({"mean": 1.01, "ci95": [0.97, 1.05]}, 3, 3, "no difference shown"),
        ({"mean": 0.9, "ci95": [0.85, 0.95]}, 3, 3, "keep vLLM's defaults"),
        ({"mean": 1.12, "ci95": [1.05, 1.19]}, 2, 3, "keep vLLM's defaults: the winner met the SLO in fewer"),
        ({"mean": 1.12, "ci95": None}, 1, 1, "undecided"),
    ],
)
def test_the_final_pairs_call_a_saving_only_when_the_interval_clears_1_at_equal_slo(ratio, winner_met, defaults_met, starts):
    from vllm_powersave.serving_tune.report import pair_verdict

    assert pair_verdict(ratio, winner_met, defaults_met).startswith(starts)


def test_the_winner_command_leaves_out_the_harness_only_flags():
    from vllm_powersave.serving_tune.space import drop_flags

    args = [
        "--host",
        "127.0.0.1",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "model",
        "--port=8000",
        "--enforce-eager",
        "--max-num-seqs",
        "8",
    ]
    assert drop_flags(args, ("--host", "--port", "--served-model-name")) == [
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--max-num-seqs",
        "8",
    ]


def test_the_winner_command_carries_what_the_search_applied_on_this_machine(tmp_path):
    from vllm_powersave.serving_tune.report import winner_command

    paced = Config((("max_num_seqs", 8), ("cuda_perf_boost", "auto"), ("decode_pacing_tpot_ms", 35.0)))
    cpu = winner_command(ServePlan(tmp_path / "m", ("--host", "127.0.0.1"), False, tmp_path), paced)
    assert cpu.endswith(
        """--max-num-seqs 8 --plugin powersave --additional-config '{"powersave": {"decode_pacing": {"tpot_target_ms": 35.0}, "api_server_count": "vllm"}}'"""
    )
    gpu = winner_command(ServePlan(tmp_path / "m", ("--host", "127.0.0.1"), True, tmp_path), paced)
    assert '"cuda_perf_boost": "auto"' in gpu and '"decode_pacing": {"tpot_target_ms": 35.0}' in gpu
    boost_only = winner_command(ServePlan(tmp_path / "m", (), False, tmp_path), Config((("cuda_perf_boost", "auto"),)))
    assert "--plugin" not in boost_only  # not applied without a GPU: not advised either


def test_a_final_pair_line_names_the_arm_once_and_the_winner_its_configuration():
    from vllm_powersave.serving_tune.run import step_line

    fig = Figures(0.3, "simulated", 100.0, 10.0, 5.0, 2.0, 2.0, good=4, sent=4, completed=4, failed=0, duration_s=4.0)
    verdict = Verdict(met=True, attainment=1.0, shortfall_pts=0.0, worst_over=0.0)

    def m(key: str, arm: str) -> Measurement:
        return Measurement(f"final/p1/{arm}", "final", key, 4.0, 1, fig, 5.0, False, "2026-12-04T00:00:00Z", pair=1, arm=arm)

    assert "pair 1 defaults: " in step_line(m("defaults", "defaults"), verdict)
    assert "pair 1 winner (max_num_seqs=8): " in step_line(m("max_num_seqs=8", "winner"), verdict)


def test_the_summary_shows_attainment_in_per_cent_as_the_tables_do():
    from vllm_powersave.serving_tune.report_md import _pct

    assert _pct({"mean": 0.995, "ci95": [0.99, 1.0]}) == "99.5 % (95 % CI 99.0–100.0 %)"
    assert _pct({"mean": 1.0, "ci95": None}) == "100.0 %" and _pct(None) == "n/a"


def test_traffic_longer_than_the_servers_max_model_len_is_refused_before_anything_starts(tiny_config, tmp_path, capsys):
    args = ["tune-serving", "--model", str(tiny_config), "--rate", "2", "--max-num-seqs", "2,8", "--out", str(tmp_path / "o")]
    args += ["--serve-arg=--max-model-len", "--serve-arg=1024"]  # the user's own limit: kept, and checked
    rc, _, err = _cli([*args, "--input-len", "900:1000", "--output-len", "100"], capsys)
    assert rc == 2 and err.strip().splitlines() == [
        "error: --input-len/--output-len: the longest request needs 1100 tokens, over the servers' --max-model-len 1024 "
        "(raise it with --serve-arg)"
    ]
    assert not (tmp_path / "o" / "state.jsonl").exists()


def test_a_trace_longer_than_the_models_context_is_refused_before_anything_starts(tiny_config, tmp_path, capsys):
    import json

    ctx = json.loads((tiny_config / "config.json").read_text())["max_position_embeddings"]
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"arrival_s": 0.0, "input_len": ctx, "output_len": 5}) + "\n")
    args = ["tune-serving", "--model", str(tiny_config), "--trace", str(trace), "--max-num-seqs", "2,8", "--out", str(tmp_path / "o")]
    rc, _, err = _cli(args, capsys)
    assert rc == 2 and err.strip().splitlines() == [
        f"error: --trace: the longest request needs {ctx + 5} tokens, over the model's context of {ctx} "
        f"(max_position_embeddings in {tiny_config / 'config.json'})"
    ]
    assert not (tmp_path / "o" / "state.jsonl").exists()


def test_a_csv_trace_with_a_byte_order_mark_parses(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_bytes("\ufeffarrival_s,input_len,output_len\n0.5,16,8\n0.0,32,4\n".encode())
    rows = parse_trace(trace)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in rows] == [(0.0, 32, 4), (0.5, 16, 8)]


def test_without_a_user_limit_max_model_len_is_raised_to_fit_the_longest_request(tiny_config, tmp_path):
    from vllm_powersave.cli import build_parser
    from vllm_powersave.serving_tune.command import options_from

    ns = build_parser().parse_args(
        ["tune-serving", "--model", str(tiny_config), "--rate", "2", "--max-num-seqs", "2,8", "--out", str(tmp_path)]
    )
    args = list(options_from(ns).plan.base_args)  # default traffic: input up to 1024, output up to 512
    assert args.count("--max-model-len") == 1 and args[args.index("--max-model-len") + 1] == "1536"


def test_a_window_without_an_energy_figure_is_measured_again_so_no_pair_loses_its_ratio(tmp_path, fake, monkeypatch, capsys):
    real = FakeMeasurer.measure
    missed = []

    def measure(self, config, window_s, seed, label):
        figs, restarted = real(self, config, window_s, seed, label)
        if label.startswith("final-p1-defaults") and not missed:  # the meter's read at one window's edge failed
            missed.append(label)
            return dataclasses.replace(figs, output_tokens_per_joule=None, energy_note="scrape at the window's end timed out"), restarted
        return figs, restarted

    monkeypatch.setattr(FakeMeasurer, "measure", measure)
    assert ts_run.execute(_opts(tmp_path, [2, 8, 32, 16])) == 0
    out = capsys.readouterr().out
    assert f"[tune-serving] {missed[0]}: no energy figure (scrape at the window's end timed out); measuring the window again" in out
    rec = json.loads((tmp_path / "out" / "tune-serving.json").read_text())
    assert rec["final"]["tok_per_j_ratio"] == {"mean": 1.2, "ci95": [1.2, 1.2]}  # both pairs kept their ratio
    finals = [c[0] for c in fake.calls if c[2] >= 1000]
    assert finals == ["max_num_seqs=8", "defaults", "defaults", "defaults", "max_num_seqs=8"]  # the one window twice


def test_a_meter_that_never_gives_a_figure_is_not_measured_twice_per_window(tmp_path, fake, capsys):
    for k in list(fake.table):  # e.g. NVML on a GPU without an energy counter: no figure, ever
        fake.table[k] = dataclasses.replace(fake.table[k], output_tokens_per_joule=None, energy_note="no energy source")
    ts_run.execute(_opts(tmp_path, [2, 8]))
    assert len(fake.calls) == 6  # 2 search windows and 2 ABBA pairs, each once
    assert "measuring the window again" not in capsys.readouterr().out


def test_a_winner_not_shown_to_save_is_printed_as_the_best_configuration_not_as_advice(tmp_path, fake, capsys):
    fake.table["defaults"] = _figs(tpj=3.0)  # the winner (max_num_seqs=8, 3 tok/J) ties with vLLM's defaults
    assert ts_run.execute(_opts(tmp_path, [2, 8])) == 0
    out = capsys.readouterr().out
    assert "verdict: no difference shown" in out
    assert "the search's best configuration, not shown to save against vLLM's defaults:" in out


def test_every_configuration_of_the_default_gpu_space_gets_its_own_window_files():
    from vllm_powersave.serving_tune.space import configurations, default_space

    keys = [c.key for c in configurations(default_space(gpu=True).searched(), 10_000)]
    labels = {ts_run.window_label(f"search/r0/{k}") for k in keys}
    assert len(keys) == 216 and len(labels) == len(keys) and max(map(len, labels)) <= 120
    assert ts_run.window_label("final/p1/defaults") == "final-p1-defaults"  # short ones read as before


def test_a_saturation_window_prepares_requests_enough_to_last_its_length():
    from vllm_powersave.serving_tune.measure import MAX_WINDOW_REQUESTS, MIN_TPOT_S, saturation_requests

    # 4 streams of 16-token outputs for 5 s: the old count (48) ran out after ~0.6 s on 2 cores.
    n = saturation_requests(4, 5.0, 16, 16)
    assert n / 4 * 16 * MIN_TPOT_S >= 5.0
    assert saturation_requests(128, 20.0, 256, 256) >= 128 * (2 * 20 + 2) * 0.9  # a 7B at 128 streams: as before
    assert saturation_requests(10_000, 600.0, 1, 1) == MAX_WINDOW_REQUESTS


def test_a_ratio_interval_of_few_pairs_is_not_shown_below_zero():
    assert ts_run._ratio_text({"mean": 0.924, "ci95": [-1.869, 3.718]}) == "0.924 (95 % CI 0.000–3.718)"
