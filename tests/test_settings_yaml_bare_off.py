"""``savings: off`` written bare in a ``POWERSAVE_CONFIG`` YAML file means the string "off" (YAML 1.2
booleans are true/false only); under YAML 1.1 it was boolean false and the server stopped with
``'savings' = False``."""

from __future__ import annotations

import pytest

from vllm_powersave.settings import SettingsError, load_settings


@pytest.mark.parametrize("text", ["savings: off\n", "clocks: {mode: off}\n", "cuda_perf_boost: off\n"])
def test_bare_off_in_a_yaml_file_means_off(tmp_path, text):
    path = tmp_path / "ps.yaml"
    path.write_text(text)
    s = load_settings({}, env={"POWERSAVE_CONFIG": str(path)})
    assert "off" in (s.savings, s.clocks.mode, s.cuda_perf_boost)


def test_true_and_false_are_still_booleans_in_a_yaml_file(tmp_path):
    path = tmp_path / "ps.yaml"
    path.write_text("per_request_energy: true\nchunking: {enabled: false}\n")
    s = load_settings({}, env={"POWERSAVE_CONFIG": str(path)})
    assert s.per_request_energy is True and s.chunking.enabled is False


def test_numbers_in_a_yaml_file_follow_yaml_12(tmp_path):
    # YAML 1.1 read 5e-3 as text, 010 as octal 8 and 1:30 as 90 (base 60).
    path = tmp_path / "ps.yaml"
    path.write_text("clocks: {closed_loop: {sprt_alpha: 5e-3}, zeusd_gpu_index: 010}\n")
    s = load_settings({}, env={"POWERSAVE_CONFIG": str(path)})
    assert s.clocks.closed_loop.sprt_alpha == 0.005 and s.clocks.zeusd_gpu_index == 10
    path.write_text("energy: {window_s: 1:30}\n")
    with pytest.raises(SettingsError, match=r"^powersave setting 'energy.window_s' = '1:30': Input should be a valid number$"):
        load_settings({}, env={"POWERSAVE_CONFIG": str(path)})
