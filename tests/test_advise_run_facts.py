"""`vllm-powersave advise`: the perf-boost mode and API-server count a result carries, and files
that are not run results refused in one line."""

import json

import pytest

from vllm_powersave.cli import main

RESULT = "tests/data/advise-result.json"


def _advise_json(tmp_path, capsys, **fields) -> list[dict]:
    p = tmp_path / "result.json"
    p.write_text(json.dumps({**json.load(open(RESULT)), **fields}))
    assert main(["advise", "--result", str(p), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["recommendations"]


@pytest.mark.parametrize(
    "fields",
    [
        {"cuda_perf_boost": "auto"},
        {"cuda_perf_boost": "off"},
        {"cuda_perf_boost": "auto,on"},  # some GPUs already auto: not a blanket "set auto"
        {"powersave_info": {"cuda_perf_boost": "auto", "clock_backend": "dry-run"}},
        {"server_info": {"cuda_perf_boost": "off"}},
    ],
)
def test_advise_never_recommends_perf_boost_auto_to_a_run_that_had_it_or_had_it_off(tmp_path, capsys, fields):
    assert "perf_boost" not in [r["key"] for r in _advise_json(tmp_path, capsys, **fields)]


def test_advise_recommends_perf_boost_auto_to_a_run_that_kept_the_boost(tmp_path, capsys):
    (boost,) = [r for r in _advise_json(tmp_path, capsys, cuda_perf_boost="on") if r["key"] == "perf_boost"]
    assert boost["action"].startswith('Set cuda_perf_boost: "auto"') and boost["saving_share"] > 0


def test_without_the_mode_the_perf_boost_advice_is_conditional_and_has_no_estimate(tmp_path, capsys):
    (boost,) = [r for r in _advise_json(tmp_path, capsys) if r["key"] == "perf_boost"]
    assert boost["action"].startswith('If this server ran with cuda_perf_boost: "on"') and boost["saving_share"] is None
    assert "perf-boost mode unknown" in boost["measurement"]


def test_the_result_mode_wins_over_an_older_metrics_scrape(tmp_path, capsys):
    p = tmp_path / "result.json"
    p.write_text(json.dumps({**json.load(open(RESULT)), "cuda_perf_boost": "auto"}))
    assert main(["advise", "--result", str(p), "--metrics", "tests/data/advise-metrics.txt", "--json"]) == 0
    assert "perf_boost" not in [r["key"] for r in json.loads(capsys.readouterr().out)["recommendations"]]


def test_the_api_server_count_of_the_result_sets_the_next_step_unless_given(tmp_path, capsys):
    (api,) = [r for r in _advise_json(tmp_path, capsys, api_server_count=4) if r["key"] == "api_servers"]
    assert "--api-server-count 8" in api["action"]
    p = tmp_path / "r4.json"
    p.write_text(json.dumps({**json.load(open(RESULT)), "api_server_count": 4}))
    assert main(["advise", "--result", str(p), "--api-servers", "2", "--json"]) == 0
    recs = json.loads(capsys.readouterr().out)["recommendations"]
    assert "--api-server-count 4" in next(r for r in recs if r["key"] == "api_servers")["action"]


@pytest.mark.parametrize(
    "doc",
    [
        {"model": "m", "gpu": True, "results": {"off": {"completed": 8}}, "rates": ["inf"]},  # a comparison.json
        {"powersave": {"cuda_perf_boost": "auto"}},  # a settings file
        {},
    ],
)
def test_advise_refuses_a_file_that_is_not_a_run_result_in_one_line(tmp_path, capsys, doc):
    p = tmp_path / "comparison.json"
    p.write_text(json.dumps(doc))
    assert main(["advise", "--result", str(p)]) == 2
    cap = capsys.readouterr()
    assert cap.err == f"error: --result = {str(p)!r}: not a loadtests result (no 'completed' or 'output_throughput' key)\n"
    assert cap.out == ""


@pytest.mark.parametrize(
    "field,value,line",
    [
        ("cuda_perf_boost", "fast", "cuda_perf_boost = 'fast': not on, off or auto"),
        ("powersave_info", {"cuda_perf_boost": 1}, "powersave_info.cuda_perf_boost = 1: not on, off or auto"),
        ("api_server_count", 0, "api_server_count = 0: not an integer >= 1"),
        ("api_server_count", "4", "api_server_count = '4': not an integer >= 1"),
    ],
)
def test_a_server_fact_of_the_wrong_kind_is_one_line(tmp_path, capsys, field, value, line):
    p = tmp_path / "result.json"
    p.write_text(json.dumps({**json.load(open(RESULT)), field: value}))
    assert main(["advise", "--result", str(p)]) == 2
    assert capsys.readouterr().err == f"error: --result = {str(p)!r}: {line}\n"


def _busy_run(**fields) -> dict:
    # A saturated run: of its 1,920 J idle, the fixture's 1,900 J were starvation (requests in
    # flight), so 20 J of 22,000 (0.09 %) were quiet idle, which is all auto saves.
    return {"energy_by_phase_j": {"prefill": 800.0, "decode": 18100.0, "mixed": 1180.0, "idle": 1920.0}, "gpu_energy_j": 22000.0, **fields}


def test_advise_recommends_perf_boost_on_to_an_auto_run_that_hardly_idled(tmp_path, capsys):
    (on,) = [r for r in _advise_json(tmp_path, capsys, **_busy_run(cuda_perf_boost="auto")) if r["key"] == "perf_boost_on"]
    assert 'cuda_perf_boost: "on"' in on["action"] and on["effect"] == "predicted" and 0 < on["saving_share"] < 0.02
    assert "h200-under-load.md" in on["measurement"] and "H100" in on["measurement"]


@pytest.mark.parametrize("mode", ["on", "off", "auto,on", None])
def test_perf_boost_on_is_advised_only_to_runs_that_ran_auto(tmp_path, capsys, mode):
    fields = _busy_run() if mode is None else _busy_run(cuda_perf_boost=mode)
    assert "perf_boost_on" not in [r["key"] for r in _advise_json(tmp_path, capsys, **fields)]


def test_a_paced_run_is_not_told_to_keep_cuda_boost_on_for_want_of_idle_time():
    from vllm_powersave.advise import advise

    # 20 J of 22,000 idle on a server that ran auto: without pacing, perf boost "on" is advised.
    busy = {"energy_j": 22000.0, "energy_by_phase_j": {"decode": 21000.0, "idle": 20.0}, "cuda_perf_boost": "auto"}
    assert "perf_boost_on" in [r.key for r in advise(busy)]
    assert "perf_boost_on" not in [r.key for r in advise({**busy, "savings": {"decode_pacing": "on"}})]


def test_an_auto_run_with_idle_time_keeps_auto(tmp_path, capsys):
    # The fixture idled 6,000 J of 22,159 (27 %): auto's idle saving is worth more there.
    assert "perf_boost_on" not in [r["key"] for r in _advise_json(tmp_path, capsys, cuda_perf_boost="auto")]


def test_a_gpu_still_pending_makes_the_mode_unknown_not_a_refusal(tmp_path, capsys):
    recs = _advise_json(tmp_path, capsys, powersave_info={"cuda_perf_boost": "auto,pending"})
    (boost,) = [r for r in recs if r["key"] == "perf_boost"]  # unknown on one GPU: the conditional advice
    assert boost["action"].startswith("If this server ran with") and boost["saving_share"] is None


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"gpu_energy_j": -22159.0}, "gpu_energy_j = -22159.0: not a number >= 0"),
        ({"gpu_idle_while_busy_s": -4.3}, "gpu_idle_while_busy_s = -4.3: not a number >= 0"),
        ({"energy_by_phase_j": {"idle": -5000.0}}, "energy_by_phase_j.idle = -5000.0: not a number >= 0"),
        ({"energy_by_phase_j": {"idle": 1e6}}, "idle energy = 1000000.0: more than gpu_energy_j = 22159.0"),
        ({"gpu_idle_while_busy_energy_j": 1e9}, "gpu_idle_while_busy_energy_j = 1000000000.0: more than gpu_energy_j = 22159.0"),
        ({"gpu_energy_j": "22159"}, "gpu_energy_j = '22159': not a number >= 0"),
    ],
)
def test_joules_and_seconds_that_cannot_be_are_refused_in_one_line(tmp_path, capsys, fields, why):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({**json.load(open(RESULT)), **fields}))
    assert main(["advise", "--result", str(p)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --result = {str(p)!r}: {why}"


def test_metrics_from_several_engines_join_their_modes_whatever_the_order(tmp_path, capsys):
    lines = ['powersave_info{cuda_perf_boost="on",version="1"} 1.0', 'powersave_info{cuda_perf_boost="auto",version="1"} 1.0']
    outs = []
    for order in (lines, lines[::-1]):
        p = tmp_path / "m.txt"
        p.write_text(open("tests/data/advise-metrics.txt").read().replace("powersave_info{", "powersave_infx{") + "\n".join(order) + "\n")
        assert main(["advise", "--metrics", str(p), "--json"]) == 0
        outs.append(sorted(r["key"] for r in json.loads(capsys.readouterr().out)["recommendations"]))
    assert outs[0] == outs[1] and "perf_boost" not in outs[0]  # mixed modes: no blanket "set auto"
    from vllm_powersave.advise import facts_from_metrics

    # The fixture's idle share is below the rule's threshold, so the keys alone cannot tell: the
    # mode the facts carry must not depend on the line order either.
    assert {facts_from_metrics("\n".join(o) + "\n")["cuda_perf_boost"] for o in (lines, lines[::-1])} == {"auto,on"}


def test_an_engine_without_the_mode_label_in_metrics_makes_the_mode_unknown():
    from vllm_powersave.advise import _modes, facts_from_metrics

    text = 'powersave_info{cuda_perf_boost="on",version="1"} 1.0\npowersave_info{version="1"} 1.0\n'
    assert facts_from_metrics(text)["cuda_perf_boost"] == ",on" and _modes(",on") is None
