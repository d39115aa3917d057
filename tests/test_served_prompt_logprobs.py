"""benchmarks/served_prompt_logprobs.py: the guard, what each arm loads, the model process's peak
memory, and the record's reading of a stock failure beside a plugin success."""

import argparse
import json
import subprocess
import sys

import pytest

from benchmarks import served_prompt_logprobs as job


def test_the_job_refuses_to_start_without_the_dry_run_guard(monkeypatch, capsys):
    monkeypatch.delenv("POWERSAVE_FORCE_DRY_RUN", raising=False)
    with pytest.raises(SystemExit) as exc:
        job.main([])
    assert exc.value.code == 2 and "POWERSAVE_FORCE_DRY_RUN=1" in capsys.readouterr().err


def test_stock_loads_no_plugin_and_the_plugin_arm_gets_its_settings_file(tmp_path):
    ns = argparse.Namespace(stock_site="", plugin_site="", plugin_settings='{"chunking": {"table": [{"min_rows": 256, "chunks": 8}]}}')
    path, extra, env = job.arm_launch(ns, "stock", tmp_path)
    assert path is None and extra == [] and env["VLLM_PLUGINS"] == "" and "POWERSAVE_CONFIG" not in env
    path, extra, env = job.arm_launch(ns, "plugin", tmp_path)
    assert extra == ["--plugin", "powersave"] and "VLLM_PLUGINS" not in env
    from vllm_powersave.settings import load_settings

    assert load_settings({}, env={"POWERSAVE_CONFIG": env["POWERSAVE_CONFIG"]}).chunking.table[0].chunks == 8


def test_the_model_process_peak_is_read_below_the_server(tmp_path):
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'x = bytearray(64 << 20); import time; time.sleep(30)'])"
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(200):
            hwm = job.model_process_hwm_mib(p.pid)
            if hwm is not None and hwm >= 64:
                break
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.05)"])
        assert hwm is not None and hwm >= 64 and job.descendants(p.pid)
    finally:
        p.kill()
        for c in job.descendants(p.pid):
            subprocess.run(["kill", "-9", str(c)], check=False)
        p.wait()


def test_the_record_shows_which_arm_failed_and_each_peak(tmp_path):
    def run(arm, pos, status, err, base, peak, alive):
        req = {"status": status, "seconds": 1.0, "positions": 2000 if status == 200 else None, "error": err}
        return {"arm": arm, "pos": pos, "started_utc": "2026-12-04T22:00:00Z", "requests": [req], "alive_after": alive,
                "memory_source": "nvml used (GPU)", "base_mib": base, "peak_mib": peak, "notes": [], "extra_peak_mib": peak - base}  # fmt: skip

    raw = {"tag": "t", "memory": "GPU", "prompt_tokens": 8192, "k": 1, "serve_args": "x", "plugin_settings": "", "model": "m"}
    raw["runs"] = [
        run("stock", 0, 0, "RemoteDisconnected: engine died", 100.0, 5000.0, False),
        run("plugin", 1, 200, None, 100.0, 1500.0, True),
    ]
    rec, md = job.record([raw])
    assert rec["all_requests_ok"] == {"stock": [False], "plugin": [True]} and rec["measured"] is True
    assert "| t/0 | stock |" in md and "0/1" in md and "| 1400 |" in md and "engine died" in md
    json.dumps(rec)


def test_gpu_peak_memory_is_sampled_through_the_device_layer():
    from fakes import FakeNvmlDevices

    nvml = FakeNvmlDevices()
    gpu = job.GpuMemorySampler(0, nvml)
    assert gpu.available and gpu.used_b() == 600 << 20
    gpu.start()
    nvml.memory_used_b = 5000 << 20
    import time

    deadline = time.monotonic() + 5
    while gpu.peak_b < 5000 << 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gpu.stop() == 5000 << 20
    assert not job.GpuMemorySampler(0, object()).available  # no NVML: the CPU path
