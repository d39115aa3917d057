"""`vllm-powersave compare`: runs spoiled by a busy machine are flagged in the report."""

import math

from vllm_powersave.cli import _keyed_runs, _suspect_runs


def test_runs_below_half_the_median_throughput_are_flagged():
    runs = {
        "off (run 1)": {"output_throughput": 59.0},
        "on (run 2)": {"output_throughput": 47.0},
        "on (run 3)": {"output_throughput": 52.0},
        "off (run 4)": {"output_throughput": 13.7},
    }
    flagged = _suspect_runs(runs)
    assert list(flagged) == ["off (run 4)"] and abs(flagged["off (run 4)"] - 13.7 / 49.5) < 1e-9
    assert _suspect_runs({k: v for k, v in runs.items() if k != "off (run 4)"}) == {}
    assert _suspect_runs({"a": {"output_throughput": 1.0}, "b": {"output_throughput": 100.0}}) == {}  # two runs: no median to trust


def test_a_rate_capped_run_is_compared_only_with_runs_at_its_rate():
    runs = {
        f"{arm} (run {i})": {"output_throughput": t}
        for i, (arm, t) in enumerate(
            [("off", 61.0), ("on", 60.0), ("on", 62.0), ("off", 59.0), ("off", 700.0), ("on", 690.0), ("on", 710.0), ("off", 240.0)]
        )
    }
    rate_of = {k: (1.0 if i < 4 else float("inf")) for i, k in enumerate(runs)}
    assert _suspect_runs(runs, rate_of) == {"off (run 7)": 240.0 / 695.0}  # only the slow saturated run
    assert len(_suspect_runs(runs)) == 4  # one median over both rates flags every 1 req/s run


def test_gpu_main_job_compares_stock_with_the_plugin_defaults():
    import json

    from vllm_powersave.cli import _configs

    (off, _, off_args), (on, desc, on_args) = _configs(gpu=True, clock_backend=None)
    assert off_args == [] and on_args[:2] == ["--plugin", "powersave"]
    assert json.loads(on_args[3]) == {"powersave": {}}  # no setting: the defaults (stats_dir is added per run)
    assert "defaults" in desc


def test_cpu_main_job_baseline_is_a_meter_with_no_clock_decision_at_all():
    import json

    from vllm_powersave.cli import _configs
    from vllm_powersave.settings import PowersaveSettings

    (off, desc, off_args), (on, _, on_args) = _configs(gpu=False, clock_backend=None)
    base = PowersaveSettings.model_validate(json.loads(off_args[off_args.index("--additional-config") + 1])["powersave"])
    # Stock clocks means no decision of any kind: neither presets nor the closed loop, which
    # clocks.mode "auto" would run on the simulated backend.
    assert base.clocks.mode == "off" and not base.chunking.enabled and base.energy.meter == "simulated"
    assert "stock clocks" in desc and "--plugin" in on_args


def test_rates_parse_and_bad_rates_are_one_line():
    import math

    import pytest

    from vllm_powersave.compare_report import parse_rates

    assert parse_rates("0.2, 1,inf") == [0.2, 1.0, math.inf]
    for bad, why in (("0", "'0' must be > 0"), ("fast", "'fast' is not a request rate"), ("-1", "'-1' must be > 0")):
        with pytest.raises(ValueError) as err:
            parse_rates(bad)
        assert str(err.value).startswith(f"--rates = {bad!r}: {why}")


def test_savings_section_says_what_was_measured_and_what_predicted():
    from vllm_powersave.compare_report import savings_section

    off = {"gpu_energy_per_output_token_j": 0.10, "gpu_idle_energy_j": 400.0, "gpu_energy_j": 2000.0}
    on = {"gpu_energy_per_output_token_j": 0.09, "gpu_idle_while_busy_energy_j": 50.0, "idle_while_busy_share": 0.02}
    runs = [("off", 0.5, off), ("on", 0.5, on), ("on", 0.5, on), ("off", 0.5, off), ("off", float("inf"), off), ("on", float("inf"), on)]
    cpu = savings_section(runs, gpu=False)
    assert "### 0.5 req/s" in cpu and "### saturation" in cpu
    assert "## Savings: simulated and predicted" in cpu and "measured and predicted" not in cpu  # nothing measured here
    # No identical-steps figure: no saving is claimed; the run-to-run change is named as such.
    assert "- J / output token, clock presets vs stock clocks: n/a (no identical-steps figure in these runs)" in cpu
    assert "not the presets' effect): presets runs vs stock-clocks runs -10.0 % J / output token (simulated, mean of 2 and 2 runs)" in cpu
    assert "stock idled 400 J (20.0 % of its energy, simulated)" in cpu and "7.1 % of stock's energy (predicted)" in cpu
    assert "- front-end starvation, presets: 50 J idle while requests were in flight, 2.0 % of busy time (simulated, mean of 2 runs)" in cpu
    gpu = savings_section(runs, gpu=True)
    assert "- J / output token, defaults vs stock: -10.0 % (measured, mean of 2 and 2 runs)" in gpu and "simulated" not in gpu
    stock_gpu = savings_section([("off", 1.0, {"gpu_energy_per_output_token_j": 0.1}), ("on", 1.0, on)], gpu=True)
    assert "stock's idle energy unknown here" in stock_gpu


def test_the_report_keys_each_run_with_its_own_rate_so_no_rate_capped_run_is_flagged():
    # The main job's order at --rates 1,inf: off on on off at 1 req/s, then off on on off saturated
    # (throughputs of the demo on this machine, one saturated run spoiled).
    rates = [1.0] * 4 + [math.inf] * 4
    tputs = [61.4, 61.3, 61.1, 61.6, 696.0, 716.0, 730.0, 240.0]
    runs = [(arm, {"output_throughput": t}) for arm, t in zip(["off", "on", "on", "off"] * 2, tputs)]
    results, rate_of = _keyed_runs(runs, rates, n_configs=2)
    assert list(results)[0] == "off (run 1) @ 1 req/s" and list(results)[-1] == "off (run 8) @ saturation"
    assert _suspect_runs(results, rate_of) == {"off (run 8) @ saturation": 240.0 / 706.0}
    one, _ = _keyed_runs([("off", {}), ("on", {})], [math.inf, math.inf], n_configs=2)
    assert list(one) == ["off", "on"]  # one run per config: the config's label alone


def test_plugin_config_reaches_the_on_server_only_and_bad_ones_stop_with_one_line(tmp_path, capsys):
    import json

    from vllm_powersave.cli import _configs, main
    from vllm_powersave.settings import load_settings

    pacing = {"decode_pacing": {"tpot_target_ms": 35}}
    for gpu in (True, False):
        (_, _, off_args), (_, desc, on_args) = _configs(gpu=gpu, clock_backend=None, plugin_config=pacing)
        on = load_settings(json.loads(on_args[on_args.index("--additional-config") + 1])["powersave"], env={})
        assert on.decode_pacing.tpot_target_ms == 35.0 and '--plugin-config {"decode_pacing"' in desc
        assert "decode_pacing" not in " ".join(off_args)
    out = str(tmp_path / "runs")
    for value, line in (
        ("{not json", "error: --plugin-config = '{not json': not a JSON object of powersave settings"),
        ("[1]", "error: --plugin-config = '[1]': not a JSON object of powersave settings"),
        (
            '{"decode_pacing": {"tpot_target_ms": -1}}',
            "error: --plugin-config: powersave setting 'decode_pacing.tpot_target_ms' = -1: Input should be greater than or equal to 0.1",
        ),
        (
            '{"savings": "off", "decode_pacing": {"tpot_target_ms": 35}}',  # not the CPU arm's presets: the user's own field
            "error: --plugin-config: powersave settings: decode_pacing.tpot_target_ms 35 conflicts with savings 'off' "
            "(metering only): drop one of them",
        ),
    ):
        assert main(["compare", "--plugin-config", value, "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert err == line, err
    assert not (tmp_path / "runs").exists()  # nothing made, written or started
