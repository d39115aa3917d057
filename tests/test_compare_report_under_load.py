"""`vllm-powersave compare` under load: starvation of both arms with the advice and its basis, the
CPU's saving taken from identical engine steps, and steady-state rows only with a usable window."""

import json
import math
import statistics

import pytest

from loadtests.report import compare_table
from vllm_powersave.compare_report import API_SERVER_ADVICE, mean_ci95, savings_section, steady_state_section
from vllm_powersave.intervals import t975

INF = math.inf


def _stock(**kw):
    return {"gpu_energy_per_output_token_j": 0.100, "gpu_energy_j": 12000.0, **kw}


def _defaults(**kw):
    # The c64 one-API-server run: ~820 J idle while requests waited, ~7 % of the energy.
    base = {"gpu_energy_per_output_token_j": 0.102, "gpu_energy_j": 11800.0, "gpu_idle_while_busy_energy_j": 820.0}
    return {**base, "idle_while_busy_share": 0.074, **kw}


def _section(lines: str, title: str) -> list[str]:
    body = lines.split(f"### {title}\n", 1)[1]
    return body.split("\n### ", 1)[0].splitlines()


def test_every_gpu_section_shows_both_arms_starvation_and_the_advice_with_its_measured_basis():
    runs = [(arm, rate, f()) for rate in (0.5, INF) for arm, f in (("off", _stock), ("on", _defaults), ("on", _defaults), ("off", _stock))]
    md = savings_section(runs, gpu=True)
    for title in ("0.5 req/s", "saturation"):
        sec = _section(md, title)
        assert "- front-end starvation, stock: n/a (stock publishes no starvation counter)" in sec
        assert (
            "- front-end starvation, defaults: 820 J idle while requests were in flight, 7.4 % of busy time, 6.9 % of the energy (measured, mean of 2 runs)"
            in sec
        )
        assert f"- advice: {API_SERVER_ADVICE}" in sec
    assert "--api-server-count 4" in API_SERVER_ADVICE and "docs/results/h200-under-load.md" in API_SERVER_ADVICE
    assert "x1.54 throughput and p99 TPOT x0.68 at c256" in API_SERVER_ADVICE


def test_stock_starvation_is_shown_where_its_result_carries_it():
    stock = _stock(gpu_idle_while_busy_energy_j=300.0, idle_while_busy_share=0.03)
    md = savings_section([("off", INF, stock), ("on", INF, _defaults())], gpu=True)
    assert (
        "- front-end starvation, stock: 300 J idle while requests were in flight, 3.0 % of busy time, 2.5 % of the energy (measured, mean of 1 run)"
        in md
    )
    assert "stock publishes no starvation counter" not in md


@pytest.mark.parametrize(
    "share,j,advice",
    [
        (0.074, 820.0, True),  # share above 5 % of busy time
        (0.03, 300.0, True),  # under 5 %, but 2.5 % of the energy
        (0.01, 60.0, False),  # neither
        (None, 60.0, False),
    ],
)
def test_the_advice_appears_only_where_starvation_is_material(share, j, advice):
    on = _defaults(gpu_idle_while_busy_energy_j=j, idle_while_busy_share=share)
    md = savings_section([("off", INF, _stock()), ("on", INF, on)], gpu=True)
    assert ("- advice: run more API servers" in md) is advice


def test_no_api_server_advice_on_the_cpu_where_the_servers_would_share_the_engine_cores():
    md = savings_section([("off", INF, _stock()), ("on", INF, _defaults())], gpu=False)
    assert "front-end starvation, presets: 820 J" in md and "advice:" not in md


def test_each_arm_names_the_api_server_count_its_runs_used_where_the_results_carry_it():
    runs = [
        ("off", INF, _stock(api_server_count=1)),
        ("on", INF, _defaults(api_server_count=4)),
        ("on", INF, _defaults(api_server_count=4)),
    ]
    assert "- API servers: stock 1, defaults 4" in savings_section(runs, gpu=True)
    mixed = [("off", INF, _stock()), ("on", INF, _defaults(api_server_count=4)), ("on", INF, _defaults(api_server_count=2))]
    assert "- API servers: stock n/a, defaults 2/4" in savings_section(mixed, gpu=True)
    assert "API servers:" not in savings_section([("off", INF, _stock()), ("on", INF, _defaults())], gpu=True)


def test_the_cpu_saving_is_the_identical_steps_figure_and_the_run_to_run_one_is_named_noise():
    # The report that contradicted itself: -18.2 % on identical steps, -28.8 % run to run.
    off = {"gpu_energy_per_output_token_j": 1.0}
    on = {"gpu_energy_per_output_token_j": 0.712}
    runs = [("off", INF, {**off, "run_index": 1}), ("on", INF, {**on, "run_index": 2}), ("on", INF, {**on, "run_index": 3})]
    runs.append(("off", INF, {**off, "run_index": 4}))
    cf = {"on (run 2)": {"saving_pct": 18.0}, "on (run 3)": {"saving_pct": 18.4}, "off (run 1)": {"saving_pct": 0.0}}
    lines = savings_section(runs, gpu=False, counterfactual=cf).splitlines()
    (head,) = [x for x in lines if x.startswith("- J / output token, clock presets vs stock clocks")]
    assert "-18.2 %" in head and "identical engine steps" in head
    noisy = [x for x in lines if "-28.8" in x]
    assert len(noisy) == 1 and noisy[0].startswith("- run-to-run (includes the CPU's batching noise, not the presets' effect)")


# Steady state


def _steady(dur_s: float, samples: int, j_per_tok: float, tput: float = 4000.0, src: str = "measured") -> dict:
    """A result whose steady window [10, 10 + dur_s] holds ``samples`` timeline samples."""
    inside = [10.0 + dur_s * k / max(1, samples - 1) for k in range(samples)] if samples else []
    return {
        "steady_state_duration_s": dur_s,
        "steady_state_start_s": 10.0,
        "steady_state_end_s": 10.0 + dur_s,
        "steady_state_output_throughput": tput,
        "steady_state_gpu_energy_per_output_token_j": j_per_tok,
        "steady_state_output_tokens_per_joule": 1.0 / j_per_tok,
        "steady_state_energy_source": src,
        "timeline": {"series": [{"t_s": [0.0, 5.0, *inside, 10.0 + dur_s + 5.0]}]},
    }


@pytest.mark.parametrize("dur_s,samples,shown", [(12.0, 3, True), (8.0, 5, False), (12.0, 2, False), (30.0, 0, False)])
def test_compare_table_shows_steady_rows_only_for_a_long_enough_window_with_three_samples(dur_s, samples, shown):
    table = compare_table({"off": _steady(dur_s, samples, 0.1), "on": _steady(dur_s, samples, 0.09)})
    assert ("Steady state J / output token" in table) is shown


def test_a_run_whose_window_is_too_short_says_why_beside_a_usable_one():
    table = compare_table({"off": _steady(12.0, 4, 0.1), "on": _steady(6.0, 4, 0.09)})
    row = next(x for x in table.splitlines() if x.startswith("| Steady state J / output token"))
    assert "0.1000 (measured)" in row and "n/a (window 6.0 s, 4 energy samples; needs >= 10 s and >= 3 samples)" in row
    # A result that counts its own window samples is taken at its word.
    assert "Steady state" not in compare_table({"a": {**_steady(12.0, 9, 0.1), "steady_state_energy_samples": 2}})
    assert "Steady state" not in compare_table({"a": _steady(12.0, 4, 0.1)}, steady_state=False)


def test_t_quantiles_and_the_interval():
    assert t975(1) == pytest.approx(12.706, abs=1e-3) and t975(10) == pytest.approx(2.228, abs=1e-3)
    assert t975(30) == pytest.approx(2.042, abs=1e-3) and t975(200) == pytest.approx(1.960, abs=1e-3)
    assert all(t975(d) > t975(d + 1) for d in range(1, 31)) and t975(31) == t975(500)
    m, lo, hi = mean_ci95([0.10, 0.12])
    half = 12.706 * statistics.stdev([0.10, 0.12]) / math.sqrt(2)  # t(1), the table in intervals.py
    assert m == pytest.approx(0.11) and lo == pytest.approx(0.11 - half) and hi == pytest.approx(0.11 + half)
    assert mean_ci95([0.1]) is None


def test_steady_state_section_gives_each_arm_its_mean_and_interval_or_says_one_run():
    runs = [
        ("off", INF, _steady(20.0, 30, 0.10)),
        ("on", INF, _steady(20.0, 30, 0.09)),
        ("on", INF, _steady(4.0, 6, 0.05)),  # too short: left out of the mean
        ("off", INF, _steady(20.0, 30, 0.12)),
    ]
    md = steady_state_section(runs, gpu=True)
    assert "stock 2 of 2 runs, defaults 1 of 2 runs" in md
    row = next(x for x in md.splitlines() if x.startswith("| J / output token"))
    lo, hi = 0.11 - 12.7062 * statistics.stdev([0.10, 0.12]) / math.sqrt(2), 0.11 + 12.7062 * statistics.stdev([0.10, 0.12]) / math.sqrt(2)
    assert f"| 0.1100 (95 % CI {lo:.4f}–{hi:.4f}, 2 runs; measured) | 0.0900 (one run: no interval; measured) |" in row
    assert "0.0500" not in md


def test_steady_state_section_shows_no_figure_when_no_window_is_usable():
    md = steady_state_section(
        [("off", 1.0, _steady(8.0, 3, 0.1)), ("on", 1.0, {"steady_state_duration_s": None, "steady_state_note": "x"})], gpu=True
    )
    assert "- no steady-state figures: no run's window is >= 10 s with >= 3 energy samples (e.g. window 8.0 s" in md
    assert "| J / output token" not in md


# The command itself: the CPU report's Savings line comes from the identical-steps figures


class _FakeServer:
    def __init__(self, args, log_path=None, startup_timeout_s=None):
        self.label = "on" if "--plugin" in args else "off"

    base_url = "http://127.0.0.1:9"

    def start(self):
        return self

    def stop(self, timeout_s: float = 30.0):
        return 0

    def api_server_count(self):
        return 4 if self.label == "on" else 1

    def __getattr__(self, name):  # anything else the command reads from a server: not known here
        return None


def test_the_cpu_compare_report_takes_its_saving_from_identical_steps(tmp_path, monkeypatch):
    import loadtests
    import vllm_powersave.serving as serving
    from vllm_powersave import cli

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    jt = {"off": 1.0, "on": 0.712}  # -28.8 % run to run
    monkeypatch.setattr(serving, "VllmServer", _FakeServer)
    monkeypatch.setattr(serving, "cpu_only", lambda: True)
    monkeypatch.setattr(loadtests, "run", lambda cfg: {"label": cfg.label, "completed": 8, "gpu_energy_per_output_token_j": jt[cfg.label]})
    monkeypatch.setattr(
        cli,
        "_read_snapshot",
        lambda d: {"sim_energy_j": 81.8, "sim_stock_clocks_energy_j": 100.0} if d.name.startswith("stats-on") else {},
    )
    assert cli.main(["compare", "--model", str(model), "--out", str(tmp_path / "runs"), "--rates", "inf"]) == 0
    (out,) = (tmp_path / "runs").iterdir()
    lines = (out / "comparison.md").read_text().splitlines()
    (head,) = [x for x in lines if x.startswith("- J / output token, clock presets vs stock clocks")]
    assert "-18.2 %" in head
    assert all("not the presets' effect" in x for x in lines if "-28.8" in x)
    assert json.loads((out / "comparison.json").read_text())["simulated_same_steps"]["on (run 2)"]["saving_pct"] == pytest.approx(18.2)


def test_on_a_gpu_both_arms_take_energy_from_one_source_and_name_their_api_servers(tmp_path, monkeypatch):
    """Both arms of the main job are measured by the same client: the local NVML counter, not the
    plugin's /metrics for one arm and NVML for the other (docs/results/h200-under-load.md)."""
    import loadtests
    import vllm_powersave.serving as serving
    from vllm_powersave import cli

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    seen: dict[str, set] = {}

    def fake_run(cfg):
        seen.setdefault(cfg.label, set()).add((cfg.energy, cfg.metrics_interval_s))
        return {"label": cfg.label, "completed": 8, "output_throughput": 100.0, "gpu_energy_per_output_token_j": 0.1}

    monkeypatch.setattr(serving, "VllmServer", _FakeServer)
    monkeypatch.setattr(serving, "cpu_only", lambda: False)
    monkeypatch.setattr(loadtests, "run", fake_run)
    assert cli.main(["compare", "--model", str(model), "--out", str(tmp_path / "runs"), "--order", "off,on"]) == 0
    assert seen == {"off": {("nvml", 15.0)}, "on": {("nvml", 15.0)}}
    (out,) = (tmp_path / "runs").iterdir()
    results = json.loads((out / "comparison.json").read_text())["results"]
    assert {k: r["api_server_count"] for k, r in results.items()} == {"off": 1, "on": 4}


def test_the_advise_hint_names_one_result_file_a_shell_can_pass():
    runs = [("off", INF, _stock(run_index=1)), ("on", INF, _defaults(run_index=2)), ("on", INF, _defaults(run_index=3))]
    sec = _section(savings_section(runs, gpu=True), "saturation")
    hint = [ln for ln in sec if "vllm-powersave advise" in ln]
    assert hint == ["- `vllm-powersave advise --result result-on-2.json` (a file in this run's folder) says what to change"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--concurrency", "0"], "error: --concurrency = 0: must be >= 1"),
        (["--num-prompts", "-3"], "error: --num-prompts = -3: must be >= 1"),
        (["--output-len", "0"], "error: --output-len = 0: must be >= 1 token"),
        (["--order", "off,maybe"], "error: --order must name off and on, e.g. 'off,on' or 'on,off,off,on' (got 'off,maybe')"),
        (["--rate-window-s", "-5"], "error: --rate-window-s = -5: must be in (0, 3600] s"),
        (["--warmups", "-1"], "error: --warmups = -1: must be >= 0"),
        (["--startup-timeout", "nan"], "error: --startup-timeout = nan: must be a number of seconds > 0"),
    ],
)
def test_a_bad_compare_flag_is_one_line_before_any_model_folder_or_server(tmp_path, monkeypatch, capsys, flags, message):
    from vllm_powersave import cli

    monkeypatch.setattr(cli, "_compare_model", lambda ns: pytest.fail("a model was made before the flags were checked"))
    assert cli.main(["compare", "--out", str(tmp_path / "runs"), *flags]) == 2
    assert capsys.readouterr().err.strip() == message and not (tmp_path / "runs").exists()
