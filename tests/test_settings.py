import json

import pytest

from vllm_powersave.settings import ENV_SETTINGS_JSON, PowersaveSettings, SettingsError, load_settings, settings_from_env


def test_defaults_turn_on_the_measured_savings_and_choose_clocks_by_permission():
    s = load_settings({}, env={})
    assert s.chunking.table == ()
    assert s.cuda_perf_boost == "auto" and s.savings == "auto"
    assert s.clocks.mode == "auto" and s.clocks.backend == "auto"
    assert s.clocks.presets == {}
    assert s.energy.meter == "auto"


def test_inline_values_and_sorting():
    s = load_settings(
        {
            "chunking": {"table": [{"min_rows": 4096, "chunks": 4}, {"min_rows": 512, "chunks": 2}]},
            "clocks": {"presets": {"decode": {"sm_clock_mhz": 1200}}, "min_dwell_ms": 50},
        },
        env={},
    )
    assert [(r.min_rows, r.chunks) for r in s.chunking.table] == [(512, 2), (4096, 4)]
    assert s.clocks.presets["decode"].sm_clock_mhz == 1200
    assert s.clocks.min_dwell_ms == 50


@pytest.mark.parametrize(
    "inline, field, value",
    [
        ({"clocks": {"backend": "turbo"}}, "clocks.backend", "'turbo'"),
        ({"clocks": {"presets": {"decode": {"sm_clock_mhz": 50}}}}, "clocks.presets.decode.sm_clock_mhz", "50"),
        ({"clocks": {"presets": {"warp": {}}}}, "clocks.presets.warp", ""),
        ({"chunking": {"table": [{"min_rows": 0, "chunks": 2}]}}, "chunking.table.0.min_rows", "0"),
        ({"chunk": {}}, "chunk", ""),
        ({"energy": {"idle_after_s": -1}}, "energy.idle_after_s", "-1"),
    ],
)
def test_invalid_setting_is_one_line_naming_field_and_value(inline, field, value):
    with pytest.raises(SettingsError) as ei:
        load_settings(inline, env={})
    msg = str(ei.value)
    assert "\n" not in msg
    assert f"'{field}'" in msg
    assert value in msg


def test_duplicate_chunk_rows_rejected():
    with pytest.raises(SettingsError, match="duplicate min_rows"):
        load_settings({"chunking": {"table": [{"min_rows": 8, "chunks": 2}, {"min_rows": 8, "chunks": 4}]}}, env={})


def test_file_sources_merge_inline_wins(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("powersave:\n  clocks:\n    backend: simulated\n    min_dwell_ms: 100\n  energy:\n    meter: simulated\n")
    env_file = tmp_path / "e.json"
    env_file.write_text(json.dumps({"clocks": {"min_dwell_ms": 7}, "energy": {"idle_after_s": 2}}))
    s = load_settings({"config_file": str(f), "clocks": {"min_dwell_ms": 300}}, env={"POWERSAVE_CONFIG": str(env_file)})
    assert s.clocks.backend == "simulated"  # from config_file
    assert s.clocks.min_dwell_ms == 300  # inline beats both files
    assert s.energy.idle_after_s == 2  # from the env file


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(SettingsError, match="'config_file' = '/nope.yaml': file not found"):
        load_settings({"config_file": "/nope.yaml"}, env={})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SettingsError, match="cannot parse"):
        load_settings({}, env={"POWERSAVE_CONFIG": str(bad)})


def test_simulated_clock_with_nvml_meter_refused():
    with pytest.raises(SettingsError, match="^powersave settings: clocks.backend .simulated. needs a simulated GPU"):
        load_settings({"clocks": {"backend": "simulated"}, "energy": {"meter": "nvml"}}, env={})


def test_exported_settings_round_trip():
    s = load_settings(
        {"clocks": {"backend": "simulated", "presets": {"idle": {"sm_clock_mhz": 345}}}, "energy": {"meter": "simulated"}}, env={}
    )
    back = settings_from_env({ENV_SETTINGS_JSON: s.model_dump_json()})
    assert back == s
    assert isinstance(back, PowersaveSettings)


def test_file_edge_cases_are_one_line(tmp_path):
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SettingsError, match="cannot read: UnicodeDecodeError"):
        load_settings({"config_file": str(binary)}, env={})
    with pytest.raises(SettingsError, match="is a directory"):
        load_settings({"config_file": str(tmp_path)}, env={})
    nested = tmp_path / "n.json"
    nested.write_text(json.dumps({"config_file": "/elsewhere.json"}))
    with pytest.raises(SettingsError, match="may not name another config_file"):
        load_settings({}, env={"POWERSAVE_CONFIG": str(nested)})


def test_long_values_are_shortened_and_nan_refused():
    with pytest.raises(SettingsError) as ei:
        load_settings({"clocks": {"backend": "x" * 5000}}, env={})
    assert len(str(ei.value)) < 300
    with pytest.raises(SettingsError, match="'clocks.min_dwell_ms' = nan"):
        load_settings({"clocks": {"min_dwell_ms": float("nan")}}, env={})
    with pytest.raises(SettingsError, match="'clocks.lease_dir' = ''"):
        load_settings({"clocks": {"lease_dir": ""}}, env={})


def test_tuned_for_mismatch_lines():
    from vllm_powersave.settings import check_tuned_for

    s = load_settings({"tuned_for": {"gpu_name": "NVIDIA H200", "vllm_version": "0.25", "model": "qwen2.5-7b"}}, env={})
    facts = {"gpu_name": "NVIDIA H200 (simulated)", "driver": None, "vllm_version": "0.25.0", "model": "/models/qwen2.5-7b"}
    assert check_tuned_for(s.tuned_for, facts) == []
    facts2 = dict(facts, gpu_name="NVIDIA A100-SXM4-80GB", vllm_version="0.32.0+cpu")
    lines = check_tuned_for(s.tuned_for, facts2)
    assert lines == [
        "powersave setting 'tuned_for.gpu_name' = 'NVIDIA H200': this server has 'NVIDIA A100-SXM4-80GB'",
        "powersave setting 'tuned_for.vllm_version' = '0.25': this server has '0.32.0+cpu'",
    ]
    assert check_tuned_for(None, facts2) == []


@pytest.mark.parametrize(
    "inline, line",
    [
        (
            {"boost_release_afterr_s": 1},
            "powersave setting 'boost_release_afterr_s' = 1: unknown setting, did you mean 'boost_release_after_s'?",
        ),
        (
            {"clocks": {"closed_loop": {"margin_pc": 1}}},
            "powersave setting 'clocks.closed_loop.margin_pc' = 1: unknown setting, did you mean 'margin_pct'?",
        ),
        ({"zzz": 1}, "powersave setting 'zzz' = 1: unknown setting"),
    ],
)
def test_an_unknown_setting_is_named_with_the_closest_real_one(inline, line):
    with pytest.raises(SettingsError) as exc:
        load_settings(inline, env={})
    assert str(exc.value) == line


@pytest.mark.parametrize(
    "inline, line",
    [
        (
            {"cuda_perf_boost\nsavings": "on"},
            "powersave setting 'cuda_perf_boost\\nsavings' = 'on': unknown setting, did you mean 'cuda_perf_boost'?",
        ),
        ({"": 1}, "powersave setting '' = 1: unknown setting"),
        (
            {"clocks.mode": "off"},
            "powersave setting 'clocks.mode' = 'off': unknown setting (nested settings are objects: {'clocks': {'mode': ...}}, not 'clocks.mode')",
        ),
    ],
)
def test_an_odd_unknown_key_still_makes_one_line_that_names_it(inline, line):
    with pytest.raises(SettingsError) as exc:
        load_settings(inline, env={})
    assert str(exc.value) == line and "\n" not in str(exc.value)
    with pytest.raises(SettingsError) as exc:
        load_settings({"x" * 5000: 1}, env={})
    assert len(str(exc.value)) < 200


@pytest.mark.parametrize(
    "inline, line",
    [
        (
            {"clocks": {"presets": {"decode": {"sm_clok_mhz": 700}}}},
            "powersave setting 'clocks.presets.decode.sm_clok_mhz' = 700: unknown setting, did you mean 'sm_clock_mhz'?",
        ),
        ({"tuned_for": {"gpu_nam": "x"}}, "powersave setting 'tuned_for.gpu_nam' = 'x': unknown setting, did you mean 'gpu_name'?"),
        (
            {"chunking": {"table": [{"min_row": 1, "chunks": 2}]}},
            "powersave setting 'chunking.table.0.min_row' = 1: unknown setting, did you mean 'min_rows'? (+1 more)",
        ),
    ],
)
def test_did_you_mean_reaches_settings_below_dicts_lists_and_optionals(inline, line):
    with pytest.raises(SettingsError) as exc:
        load_settings(inline, env={})
    assert str(exc.value) == line


@pytest.mark.parametrize(
    "inline, field, value",
    [
        ({"energy": {"idle_after_s": True}}, "energy.idle_after_s", "True"),
        ({"energy": {"tick_s": "fast"}}, "energy.tick_s", "'fast'"),
        ({"per_request_energy": "yes"}, "per_request_energy", "'yes'"),
        ({"per_request_energy": 1}, "per_request_energy", "1"),
        ({"energy": {"steady_batch": 2.5}}, "energy.steady_batch", "2.5"),
        ({"chunking": {"table": [{"min_rows": 8, "chunks": True}]}}, "chunking.table.0.chunks", "True"),
        ({"energy": {"steady_batch": 10**9}}, "energy.steady_batch", "1000000000"),
    ],
)
def test_a_value_of_the_wrong_type_or_past_its_bound_is_refused_not_coerced(inline, field, value):
    with pytest.raises(SettingsError) as ei:
        load_settings(inline, env={})
    msg = str(ei.value)
    assert "\n" not in msg and f"'{field}' = {value}:" in msg


def test_numbers_and_booleans_written_as_text_are_read_as_such(tmp_path):
    # vLLM's dotted form passes list items and a capital True as strings; YAML 1.1 reads 5e-3 as one.
    s = load_settings(
        {"per_request_energy": "True", "energy": {"tick_s": "0.5"}, "clocks": {"closed_loop": {"batch_buckets": ["1", "8", "32"]}}},
        env={},
    )
    assert s.per_request_energy is True and s.energy.tick_s == 0.5 and s.clocks.closed_loop.batch_buckets == (1, 8, 32)
    (f := tmp_path / "p.yaml").write_text("clocks:\n  closed_loop:\n    sprt_alpha: 5e-3\n")
    assert load_settings({}, env={"POWERSAVE_CONFIG": str(f)}).clocks.closed_loop.sprt_alpha == 0.005
    assert load_settings({"stats_dir": "123"}, env={}).stats_dir == "123"  # a text field keeps its text


def test_strict_types_still_take_an_int_for_a_float_and_a_list_for_a_sequence():
    s = load_settings({"energy": {"tick_s": 1}, "clocks": {"closed_loop": {"batch_buckets": [1, 16, 64]}}}, env={})
    assert s.energy.tick_s == 1.0 and s.clocks.closed_loop.batch_buckets == (1, 16, 64)
    assert settings_from_env({ENV_SETTINGS_JSON: s.model_dump_json()}) == s
