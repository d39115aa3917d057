"""`vllm-powersave advise`: ranked recommendations, each with its measurement and labels."""

import json

import pytest

from vllm_powersave.advise import advise, facts_from_result, run
from vllm_powersave.cli import main

RESULT = "tests/data/advise-result.json"
METRICS = "tests/data/advise-metrics.txt"


def test_advise_ranks_api_servers_over_perf_boost_over_unestimated_fixes_from_a_fixture_run():
    recs = json.loads(run([RESULT], [METRICS], as_json=True))["recommendations"]
    assert [r["key"] for r in recs] == ["api_servers", "perf_boost", "batch_limit", "clocks"]
    api, boost = recs[0], recs[1]
    assert "--api-server-count 4" in api["action"] and abs(api["saving_share"] - 1900 / 22159) < 1e-9
    assert "1900 J, 8.6 % of the run's energy; 9.3 % of busy time" in api["measurement"]
    assert api["evidence"] == "measured" and api["effect"] == "predicted"
    assert abs(boost["saving_share"] - (1 - 77.4 / 119.6) * 4100 / 22159) < 1e-9  # idle not spent waiting x -35 %
    assert recs[2]["saving_share"] is None and "3 request(s) waiting" in recs[2]["measurement"]
    assert "12 clock changes and 0 closed-loop decisions recorded in dry-run" in recs[3]["measurement"]


def test_advise_text_names_measured_and_predicted():
    text = run([RESULT], [METRICS])
    lines = text.splitlines()
    assert lines[1].startswith("1. Run more API servers: --api-server-count 4  [expected up to 8.6 % less energy (predicted)]")
    assert lines[2].startswith("   measured: GPU idle 4.3 s while requests were in flight")


def test_advise_does_not_recommend_perf_boost_where_it_already_runs():
    facts = {**facts_from_result(json.load(open(RESULT))), "cuda_perf_boost": "auto"}
    assert "perf_boost" not in [r.key for r in advise(facts)]


def test_advise_labels_simulated_evidence():
    facts = {**facts_from_result(json.load(open(RESULT))), "energy_source": "simulated"}
    assert advise(facts)[0].evidence == "simulated"


def test_a_lagging_client_is_named_first_and_the_api_server_fix_loses_its_estimate():
    r = {**json.load(open(RESULT)), "client_bottleneck": True, "client_loop_lag_p99_ms": 2.72, "client_loop_lag_max_ms": 334.7}
    recs = advise(facts_from_result(r))
    keys = [x.key for x in recs]
    assert keys[0] == "client" and "api_servers" in keys
    assert "more client processes" in recs[0].action and "lag p99 2.72 ms, max 335 ms" in recs[0].measurement
    api = recs[keys.index("api_servers")]
    assert api.saving_share is None and "unhurried client" in api.action
    # A client that kept up changes nothing.
    calm = advise(facts_from_result({**r, "client_bottleneck": False}))
    assert calm[0].key == "api_servers" and "client" not in [x.key for x in calm]
    # Lag from other processes taking the CPU: the API-server advice says the host is short of cores.
    shared = advise(facts_from_result({**r, "client_bottleneck": False, "client_cpu_contended": True}))
    assert shared[0].key == "api_servers" and "more cores first" in shared[0].action
    assert "more cores" not in calm[0].action


def test_no_starvation_no_api_server_advice():
    facts = {**facts_from_result(json.load(open(RESULT))), "idle_while_busy_j": 10.0}
    assert "api_servers" not in [r.key for r in advise(facts)]


@pytest.mark.parametrize(
    "argv,line",
    [
        (["advise"], "error: give --result FILE and/or --metrics URL|FILE"),
        (["advise", "--result", "nope.json"], "error: --result = 'nope.json': file not found"),
        (["advise", "--metrics", "nope.txt"], "error: --metrics = 'nope.txt': neither a http(s) URL nor a file"),
        (["advise", "--result", RESULT, "--api-servers", "0"], "error: --api-servers = 0: must be >= 1"),
    ],
)
def test_advise_bad_input_is_one_line(capsys, argv, line):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == line


def test_advise_result_that_is_not_json_is_one_line(tmp_path, capsys):
    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    assert main(["advise", "--result", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --result = {str(bad)!r}: not JSON") and "\n" not in err


def test_advise_names_the_metrics_file_that_is_not_prometheus_text_and_a_directory_given_as_result(tmp_path, capsys):
    junk = tmp_path / "junk.txt"
    junk.write_text("this is { not prometheus\n")
    assert main(["advise", "--metrics", str(junk)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --metrics = {str(junk)!r}: not Prometheus text (ValueError)"
    assert main(["advise", "--result", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --result = {str(tmp_path)!r}: a directory, not a file"


def test_advise_energy_by_phase_that_is_not_an_object_is_one_line(tmp_path, capsys):
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({**json.load(open(RESULT)), "energy_by_phase_j": [1, 2]}))
    assert main(["advise", "--result", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --result = {str(bad)!r}: energy_by_phase_j = '[1, 2]': not an object of joules by phase"


def test_the_client_advice_of_a_simulated_run_is_labelled_simulated():
    r = {**json.load(open(RESULT)), "energy_source": "simulated", "client_bottleneck": True, "client_loop_lag_p99_ms": 9.0}
    recs = advise(facts_from_result(r))
    assert [x.evidence for x in recs if x.key in ("client", "api_servers")] == ["simulated", "simulated"]  # the run's joules


def test_the_client_advice_without_lag_figures_says_so_instead_of_nan():
    r = {**json.load(open(RESULT)), "client_bottleneck": True}  # a result without the lag figures
    client = advise(facts_from_result(r))[0]
    assert client.key == "client" and "nan" not in client.measurement and "event-loop lag not recorded" in client.measurement


@pytest.mark.parametrize(
    "field,value,why",
    [
        ("client_bottleneck", "true", "not true/false"),
        ("client_bottleneck", 1, "not true/false"),
        ("client_loop_lag_p99_ms", "2.7", "not a number >= 0"),
        ("client_loop_lag_p99_ms", -1.0, "not a number >= 0"),
        ("client_loop_lag_max_ms", float("nan"), "not a number >= 0"),
    ],
)
def test_a_result_with_a_client_figure_of_the_wrong_type_is_one_line(tmp_path, capsys, field, value, why):
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({**json.load(open(RESULT)), "client_bottleneck": True, field: value}))
    assert main(["advise", "--result", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --result = {str(bad)!r}: {field} = {value!r}: {why}"


def test_each_result_is_its_own_run_and_does_not_inherit_another_runs_client_flag(tmp_path):
    base = json.load(open(RESULT))
    lagging, calm = tmp_path / "a.json", tmp_path / "b.json"
    lagging.write_text(json.dumps({**base, "client_bottleneck": True, "client_loop_lag_p99_ms": 9.0}))
    calm.write_text(json.dumps(base))  # an older loadtests result: no client check at all
    for order in ([lagging, calm], [calm, lagging]):
        recs = json.loads(run([str(p) for p in order], [], as_json=True))["recommendations"]
        by_run = {p: [r["key"] for r in recs if r["result"] == str(p)] for p in order}
        assert by_run[lagging][0] == "client" and "client" not in by_run[calm] and by_run[calm][0] == "api_servers"
    text = run([str(lagging), str(calm)], [])
    assert text.index(f"== {lagging}") < text.index(f"== {calm}") and text.count("recommendation(s)") == 2


def test_nothing_to_recommend_says_what_the_rules_saw_in_text_and_json(tmp_path):
    quiet = tmp_path / "q.json"
    quiet.write_text(
        json.dumps(
            {
                **json.load(open(RESULT)),
                "gpu_idle_while_busy_energy_j": 0.0,
                "cuda_perf_boost": "auto",
                "energy_by_phase_j": {"decode": 100.0},
            }
        )
    )
    text = run([str(quiet)], [])
    assert text.startswith("vllm-powersave advise: nothing to recommend from these figures (perf boost already auto")
    assert "front-end starvation 0.0 %" in text
    (run_,) = json.loads(run([str(quiet)], [], as_json=True))["runs"]  # the JSON says it per run
    assert run_["result"] == str(quiet) and run_["recommendations"] == 0 and "perf boost already auto" in run_["nothing_because"]


def test_a_result_given_twice_is_one_run():
    assert run([RESULT, RESULT], []) == run([RESULT], [])


def test_no_clock_privilege_advice_for_a_run_without_a_gpu():
    facts = {**facts_from_result(json.load(open(RESULT))), "clock_backend": "dry-run"}
    assert "clocks" in [r.key for r in advise({**facts, "energy_source": "measured"})]
    assert "clocks" not in [r.key for r in advise({**facts, "energy_source": "simulated"})]  # the CPU build


def _open_loop(**over):
    facts = {
        "energy_j": 10_000.0,
        "energy_source": "measured",
        "energy_by_phase_j": {"decode": 7_000.0, "prefill": 1_500.0, "idle": 1_500.0},
        "request_rate": 4.0,
        "p50_tpot_ms": 7.3,
    }
    return {**facts, **over}


def test_an_open_loop_decode_heavy_run_is_pointed_at_decode_pacing():
    (rec,) = [r for r in advise(_open_loop()) if r.key == "decode_pacing"]
    assert "decode_pacing.tpot_target_ms" in rec.action and "tune-serving" in rec.action
    assert "4 req/s, 70 % of the run's energy in decode, nothing waiting; TPOT p50 7.3 ms now" in rec.measurement
    assert rec.evidence == "measured" and rec.effect == "predicted" and rec.saving_share is None
    assert "h200-decode-pacing.md" in rec.measurement


@pytest.mark.parametrize(
    "over",
    [
        {"max_concurrency": 128},  # a closed loop: the batch cannot grow with the period
        {"request_rate": None},
        {"energy_by_phase_j": {"decode": 3_000.0, "prefill": 7_000.0}},
        {"waiting": 3.0},
        {"savings": {"decode_pacing": "on"}},
    ],
    ids=["closed-loop", "no-rate", "prefill-heavy", "a-queue", "already-on"],
)
def test_no_decode_pacing_advice_where_it_cannot_grow_the_batch_or_already_runs(over):
    assert "decode_pacing" not in [r.key for r in advise(_open_loop(**over))]


def test_nothing_to_recommend_says_which_idle_rule_it_checked():
    from vllm_powersave.advise import _nothing_because

    busy = {"energy_j": 1000.0, "idle_while_busy_j": 0.0, "energy_by_phase_j": {"idle": 426.0}, "cuda_perf_boost": "auto"}
    why = _nothing_because(busy)
    assert "idle 42.6 % of the energy (holding the boost on pays only below" in why and "advice below" not in why


def test_nothing_to_recommend_labels_shares_of_simulated_energy():
    from vllm_powersave.advise import RunAdvice

    facts = {"energy_j": 1000.0, "idle_while_busy_j": 2.0, "energy_by_phase_j": {"idle": 998.0}, "cuda_perf_boost": "auto"}
    measured = RunAdvice(None, [], {**facts, "energy_source": "measured"}).text()
    simulated = RunAdvice(None, [], {**facts, "energy_source": "simulated"}).text()
    assert "0.2 % of the energy" in measured and "simulated" not in measured
    assert "0.2 % of the simulated energy" in simulated and "idle 99.6 % of the simulated energy" in simulated
