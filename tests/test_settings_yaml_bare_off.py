"""``savings: off`` written bare in a ``POWERSAVE_CONFIG`` YAML file means the string "off" (YAML 1.2
booleans are true/false only); under YAML 1.1 it was boolean false and the server stopped with
``'savings' = False``."""

from __future__ import annotations

import pytest

from vllm_powersave.settings import load_settings


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
