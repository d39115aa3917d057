"""register(): idempotent, cheap, inert unless enabled. Each case runs in a fresh interpreter."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

PROBE = r"""
import json, os, sys
import vllm_powersave
from vllm_powersave import vllm_compat
vllm_powersave.register(); vllm_powersave.register()
from vllm.model_executor.custom_op import op_registry_oot
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.engine.arg_utils import EngineArgs
import torch
print(json.dumps({
    "oot": sorted(op_registry_oot),
    "runner_patched": hasattr(GPUModelRunner.execute_model, "__powersave_original__"),
    "cli_patched": hasattr(EngineArgs.add_cli_args, "__powersave_original__"),
    "cuda_initialized": torch.cuda.is_initialized(),
    "runtime_imported": "vllm_powersave.runtime" in sys.modules,
    "active": vllm_powersave._STATE["active"],
    "patched": sorted(vllm_compat._PATCHED),
}))
"""


def _probe(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POWERSAVE_", "VLLM_PLUGINS"))}
    env.update(env_extra)
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_installed_but_not_enabled_is_inert():
    r = _probe({})
    assert r["oot"] == [] and not r["runner_patched"] and not r["active"]
    assert r["cli_patched"]  # only the --plugin flag and the (inert) settings check are installed
    assert not r["cuda_initialized"] and not r["runtime_imported"]


CHUNKING = {"POWERSAVE_SETTINGS_JSON": json.dumps({"chunking": {"table": [{"min_rows": 4096, "chunks": 4}]}})}


@pytest.mark.parametrize("env", [{"VLLM_PLUGINS": "powersave", **CHUNKING}, {"POWERSAVE_ENABLED": "1", **CHUNKING}])
def test_enabled_by_env_installs_worker_hooks_without_cuda(env):
    r = _probe(env)
    assert r["oot"] == ["LogitsProcessor"] and r["runner_patched"] and r["active"]
    assert "sched.schedule" in r["patched"], r["patched"]  # look-ahead stamps (EngineCore)
    assert not r["cuda_initialized"]


def test_enabled_without_chunking_leaves_vllm_lm_head_alone():
    r = _probe({"POWERSAVE_ENABLED": "1"})  # default settings: empty chunking table
    assert r["oot"] == [] and r["runner_patched"] and r["active"]


def test_version_guard():
    from vllm_powersave.vllm_compat import check_version

    assert check_version("0.25.0")[0] and check_version("0.32.0+cpu")[0]
    ok, why = check_version("0.24.9")
    assert not ok and "outside the tested range 0.25-0.32.x" in why
    assert not check_version("0.33.0")[0]
    assert not check_version("garbage")[0]


def test_perf_boost_off_sets_cuda_variable_for_this_process_and_children(monkeypatch):
    import vllm_powersave
    from vllm_powersave.settings import load_settings

    monkeypatch.delenv("CUDA_DISABLE_PERF_BOOST", raising=False)
    vllm_powersave.apply_process_env(load_settings({"cuda_perf_boost": "on"}, env={}))
    assert "CUDA_DISABLE_PERF_BOOST" not in os.environ
    vllm_powersave.apply_process_env(load_settings({"savings": "off"}, env={}))  # metering only: CUDA's default
    assert "CUDA_DISABLE_PERF_BOOST" not in os.environ
    vllm_powersave.apply_process_env(load_settings({"cuda_perf_boost": "off"}, env={}))
    assert os.environ["CUDA_DISABLE_PERF_BOOST"] == "1"
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('CUDA_DISABLE_PERF_BOOST'))"], capture_output=True, text=True
    )
    assert child.stdout.strip() == "1"


def test_lm_head_hook_only_where_settings_can_use_it():
    import json

    from vllm_powersave import lm_head_hook_needed
    from vllm_powersave.settings import ENV_SETTINGS_JSON, load_settings

    def env(cfg: dict) -> dict:
        return {ENV_SETTINGS_JSON: load_settings(cfg, env={}).model_dump_json()}

    assert lm_head_hook_needed(env({})) is False  # default: empty table, no groups
    assert lm_head_hook_needed(env({"chunking": {"table": [{"min_rows": 1_000_000, "chunks": 1}]}})) is False
    assert lm_head_hook_needed(env({"chunking": {"table": [{"min_rows": 4096, "chunks": 4}]}})) is True
    assert lm_head_hook_needed(env({"chunking": {"enabled": False, "table": [{"min_rows": 8, "chunks": 4}]}})) is False
    groups = {"clocks": {"presets": {"prefill": {"sm_clock_mhz": 1980, "groups": {"lm_head": {"sm_clock_mhz": 1200, "duration_ms": 500}}}}}}
    assert lm_head_hook_needed(env(groups)) is True
    assert lm_head_hook_needed({ENV_SETTINGS_JSON: json.dumps({"chunking": {"table": "bad"}})}) is True  # unreadable: keep
