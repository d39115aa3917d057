"""``savings: off`` written bare in a ``POWERSAVE_CONFIG`` YAML file (as docs/under-load.md spells
it) is YAML 1.1's boolean false, and the server stops with ``'savings' = False``."""

from __future__ import annotations

import pytest

from vllm_powersave.settings import load_settings


@pytest.mark.xfail(strict=True, reason="yaml.safe_load turns bare off/on/yes/no into booleans; the fields want strings")
@pytest.mark.parametrize("text", ["savings: off\n", "clocks: {mode: off}\n", "cuda_perf_boost: off\n"])
def test_bare_off_in_a_yaml_file_means_off(tmp_path, text):
    path = tmp_path / "ps.yaml"
    path.write_text(text)
    s = load_settings({}, env={"POWERSAVE_CONFIG": str(path)})
    assert "off" in (s.savings, s.clocks.mode, s.cuda_perf_boost)
