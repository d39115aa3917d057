"""End to end: a real `vllm serve` (vLLM CPU build) with the plugin on the tiny model.

One server for the whole module (start-up costs ~1 min on 2 cores); bad-input cases start no
engine at all, so they are cheap.
"""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from loadtests import BenchConfig, run  # noqa: E402
from vllm_powersave.serving import ServerError, VllmServer, default_serve_args, vllm_command  # noqa: E402

PRESET = Path(__file__).resolve().parents[1] / "vllm_powersave" / "presets" / "h200-simulated.yaml"

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from vllm_powersave.modelgen import make_model

    return make_model(tmp_path_factory.mktemp("models") / "qwen2-tiny", "qwen2-tiny")


STATS = {}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    STATS["dir"] = tmp_path_factory.mktemp("stats")
    cfg = {
        "powersave": {
            "config_file": str(PRESET),
            "clocks": {"min_dwell_ms": 50},
            "cuda_perf_boost": "off",
            "per_request_energy": True,
            "stats_dir": str(STATS["dir"]),
            "trace_steps": True,
            # a loaded 2-core CI machine may need more than the default 200 ms
            "energy": {"response_wait_ms": 3000},
            "chunking": {"table": [{"min_rows": 4, "chunks": 2}]},
        }
    }
    srv = VllmServer(default_serve_args(str(tiny_model)) + ["--plugin", "powersave", "--additional-config", json.dumps(cfg)], log_path=log)
    srv.start()
    yield srv
    srv.stop()


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("powersave_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metrics_when(url, ready, timeout_s=30.0):
    """The plugin's /metrics once ``ready(metrics)`` holds, or the last one read after ``timeout_s``.

    The worker publishes every 0.5 s, but a loaded CI host (2 cores, a CPU engine) can hold a
    publish back well past that: a fixed sleep of one period reads a stale page."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(url)
        if ready(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def _trace_steps_when(ready, timeout_s=30.0):
    """The step lines of rank 0's trace once ``ready(steps)`` holds, or the last read after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        path = STATS["dir"] / "trace-rank0.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        steps = [x for x in lines if "t" in x]  # step lines (the trace also holds energy ticks)
        if ready(steps) or time.monotonic() > deadline:
            return steps
        time.sleep(0.2)


def test_answers_completions_and_chat(server):
    c = _post(
        server.base_url + "/v1/completions",
        {"model": "model", "prompt": "def main():", "max_tokens": 12, "ignore_eos": True, "temperature": 0},
    )
    assert c["usage"]["completion_tokens"] == 12 and c["choices"][0]["text"]
    chat = _post(
        server.base_url + "/v1/chat/completions",
        {"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True},
    )
    assert chat["usage"]["completion_tokens"] == 8 and chat["choices"][0]["message"]["role"] == "assistant"
    # Greedy decoding is deterministic: chunking (table: 2 chunks from 4 rows) must not change results.
    again = _post(
        server.base_url + "/v1/completions",
        {"model": "model", "prompt": "def main():", "max_tokens": 12, "ignore_eos": True, "temperature": 0},
    )
    assert again["choices"][0]["text"] == c["choices"][0]["text"]


def test_metrics_and_load_test(server):
    before = _metrics(server.base_url)
    res = run(
        BenchConfig(base_url=server.base_url, num_prompts=24, max_concurrency=8, input_len=32, output_len=16, num_warmups=1, label="e2e")
    )
    # The publish after the run: every token counted, and the idle preset applied once idle.
    after = _metrics_when(
        server.base_url,
        lambda m: (
            m.get('powersave_tokens_total{gpu="sim0",kind="decode"}', 0.0) >= 24 * 15
            and m.get('powersave_clock_target_mhz{backend="simulated",gpu="sim0"}') == 345
        ),
    )
    assert res["completed"] == 24 and res["failed"] == 0
    assert res["total_output_tokens"] == 24 * 16
    assert res["energy_source"] == "simulated"
    assert res["gpu_energy_j"] > 0 and res["output_tokens_per_joule"] == pytest.approx(res["total_output_tokens"] / res["gpu_energy_j"])
    # Sampled during the run: a simulated-energy timeline ending at the run's total, and the ML.ENERGY
    # steady-state window of the closed loop (B = 8, N = 24) with its tokens.
    (series,) = res["timeline"]["series"]
    assert series["energy_source"] == "simulated" and series["energy_j"][-1] == pytest.approx(res["gpu_energy_j"])
    assert res["steady_state_batch"] == 8 and res["steady_state_output_tokens"] > 0
    key = 'powersave_gpu_energy_joules_total{gpu="sim0",method="model",phase="decode",source="simulated"}'
    assert after[key] > before.get(key, 0.0)
    dec = 'powersave_steps_total{gpu="sim0",phase="decode"}'
    assert after[dec] - before.get(dec, 0) >= 15  # 16 tokens per request, batched
    assert after['powersave_tokens_total{gpu="sim0",kind="decode"}'] >= 24 * 15
    assert after['powersave_energy_simulated{gpu="sim0"}'] == 1.0
    # Per-request energy: finished requests are logged, and requests + idle add up to the total.
    snap = json.loads((STATS["dir"] / "rank0.json").read_text())
    total = sum(snap["energy_j"].values())
    parts = snap["request_energy_j_finished"] + snap["request_energy_j_in_flight"] + snap["energy_j"]["idle"]
    assert parts == pytest.approx(total, rel=0.01)
    # vLLM reports a request as finished with the next step, and the worker writes the file at its
    # next publish: one more request flushes the last batch, then poll the file.
    _post(server.base_url + "/v1/completions", {"model": "model", "prompt": "x", "max_tokens": 2, "ignore_eos": True})
    deadline = time.monotonic() + 20
    while True:
        path = STATS["dir"] / "requests-rank0.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if len(lines) >= 24 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(lines) >= 24 and all(x["energy_j"] > 0 and x["source"] == "simulated" for x in lines)
    assert after['powersave_requests_finished_total{gpu="sim0"}'] >= 1
    # cuda_perf_boost: off reached the worker process's environment before its device init.
    assert any(k.startswith("powersave_info{") and 'cuda_perf_boost="off"' in k for k in after)
    # Batches of >= 4 rows reached the LM head in 2 chunks, single rows in 1.
    assert after['powersave_lm_head_calls_total{chunks="2",gpu="sim0"}'] > 0
    assert after['powersave_lm_head_calls_total{chunks="1",gpu="sim0"}'] > 0
    # Idle for longer than idle_after_s: the simulated controller applied the idle preset.
    assert after['powersave_clock_target_mhz{backend="simulated",gpu="sim0"}'] == 345
    assert after['powersave_sm_clock_mhz{gpu="sim0",source="simulated"}'] == 345


def test_per_request_energy_returned_to_the_client(server):
    """Non-streaming responses carry x-powersave-energy-* headers (OpenAI clients ignore them);
    GET /powersave/requests/{response id} serves the same figure."""
    for path, body in (
        ("/v1/completions", {"model": "model", "prompt": "def f():", "max_tokens": 6, "ignore_eos": True}),
        ("/v1/chat/completions", {"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True}),
    ):
        req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            resp, headers = json.loads(r.read()), r.headers
        assert resp["usage"]["completion_tokens"] == body["max_tokens"]  # the OpenAI body is unchanged
        assert headers["x-powersave-energy-status"] == "complete", dict(headers)
        assert headers["x-powersave-energy-source"] == "simulated" and headers["x-powersave-energy-method"] == "model"
        joules = float(headers["x-powersave-energy-j"])
        assert joules > 0
        with urllib.request.urlopen(f"{server.base_url}/powersave/requests/{resp['id']}", timeout=30) as r:
            got = json.loads(r.read())
        assert got["status"] == "complete" and got["energy_j"] == pytest.approx(joules, abs=1e-6)
        assert got["gpus"] == {"sim0": pytest.approx(joules, abs=1e-6)} and got["parts"] == 1
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.base_url + "/powersave/requests/cmpl-nonexistent", timeout=30)
    assert err.value.code == 404


def test_prompt_logprobs_through_the_chunked_lm_head_match_a_reference(server, tiny_model):
    """The LM-head chunking case through the real server: prompt logprobs of a long prompt (every
    prompt row reaches the LM head, split in 2 chunks by this server's table) equal the unchunked
    model's, computed by transformers in float32 (the server runs bfloat16: 0.05 tolerance)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = 'powersave_lm_head_calls_total{chunks="2",gpu="sim0"}'
    before = _metrics(server.base_url).get(key, 0.0)
    prompt = "def area(r):\n    return 3.14159 * r * r\n\nprint(area(2.0))\n"
    resp = _post(server.base_url + "/v1/completions", {"model": "model", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0})
    got = resp["choices"][0]["prompt_logprobs"]
    ids = AutoTokenizer.from_pretrained(tiny_model)(prompt)["input_ids"]
    assert len(got) == len(ids) >= 8 and got[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        assert got[i][str(ids[i])]["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=0.05), i
    # the prompt rows went through the 2-chunk path (once the worker has published)
    assert _metrics_when(server.base_url, lambda m: m.get(key, 0.0) > before)[key] > before
    # The step trace counts those rows (1 sampling row + len(ids) - 1 prompt positions), read from the
    # real SchedulerOutput; one more request pushes the step out of the trace's in-memory tail.
    _post(server.base_url + "/v1/completions", {"model": "model", "prompt": "x", "max_tokens": 2, "ignore_eos": True})
    steps = _trace_steps_when(lambda steps: any(s["rows"] == len(ids) and s["prefill"] == len(ids) for s in steps))
    assert any(s["rows"] == len(ids) and s["prefill"] == len(ids) for s in steps), [s for s in steps if s["prefill"]][-3:]


def test_clock_follows_phases_of_one_long_request(server):
    key = 'powersave_clock_changes_total{backend="simulated",gpu="sim0"}'
    target = 'powersave_clock_target_mhz{backend="simulated",gpu="sim0"}'
    tokens = 'powersave_tokens_total{gpu="sim0",kind="decode"}'
    tokens_before = _metrics(server.base_url).get(tokens, 0.0)
    _post(server.base_url + "/v1/completions", {"model": "model", "prompt": "x", "max_tokens": 4, "ignore_eos": True})
    # A page published after that request, once idle again (345): the changes it caused are in.
    before = _metrics_when(server.base_url, lambda m: m.get(tokens, 0.0) > tokens_before and m.get(target) == 345)[key]
    # idle (345) -> prefill: default at once -> decode lasting > 50 ms: the decode preset -> idle again: 345
    _post(server.base_url + "/v1/completions", {"model": "model", "prompt": "def main():", "max_tokens": 200, "ignore_eos": True})
    m = _metrics_when(server.base_url, lambda m: m[key] - before >= 3 and m.get(target) == 345)
    # Exactly 3 on an idle machine; a loaded CI machine can stall a step past idle_after_s, which
    # adds idle/prefill round trips, never removes any.
    assert m[key] - before >= 3
    assert m['powersave_clock_target_mhz{backend="simulated",gpu="sim0"}'] == 345


def test_invalid_setting_stops_startup_with_one_line(tiny_model, tmp_path):
    cmd = [
        *vllm_command(),
        "serve",
        str(tiny_model),
        "--plugin",
        "powersave",
        "--additional-config",
        json.dumps({"powersave": {"clocks": {"backend": "turbo"}}}),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: powersave setting 'clocks.backend' = 'turbo': Input should be 'auto', 'dry-run', 'nvml', 'zeusd' or 'simulated'"
    ]
    assert "EngineCore" not in p.stderr + p.stdout  # nothing was started


def test_preset_tuned_for_another_vllm_is_refused_at_startup(tiny_model):
    cfg = {"powersave": {"tuned_for": {"vllm_version": "0.25"}}}
    p = subprocess.run(
        [*vllm_command(), "serve", str(tiny_model), "--plugin", "powersave", "--additional-config", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "'tuned_for.vllm_version' = '0.25': this server has '0.32" in errors[0]
    assert "EngineCore" not in p.stderr + p.stdout


def test_unknown_plugin_name_is_refused(tiny_model):
    p = subprocess.run([*vllm_command(), "serve", str(tiny_model), "--plugin", "turbo"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "unknown plugin 'turbo'" in p.stderr


def test_missing_model_dir_is_one_clear_error(tmp_path):
    with pytest.raises(ServerError, match="model directory not found: '/nonexistent/model'"):
        VllmServer(["/nonexistent/model"], log_path=tmp_path / "x.log").start()


def test_compare_cli_missing_model(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "vllm_powersave.cli", "compare", "--model", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: model directory not found")


DRIFT_SITE = """
# Simulated vLLM drift for one test: PluggableLayer.register_oot (the LM-head hook's registration)
# is gone from vllm.model_executor.custom_op in every process of the server (fork or spawn).
import importlib.abc, importlib.util, sys

class _Drift(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.model_executor.custom_op":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            del module.PluggableLayer.register_oot

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Drift())
"""


def test_drift_server_serves_without_the_hook_it_lost(tiny_model, tmp_path):
    """`vllm serve --plugin powersave` under a vLLM whose LM-head registration hook is gone: the
    server starts and answers (prompt logprobs included), one warning names the attribute and the
    feature, the step hook still meters, and no LM-head call goes through the plugin."""
    import os

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DRIFT_SITE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    cfg = {"powersave": {"config_file": str(PRESET), "cuda_perf_boost": "off", "chunking": {"table": [{"min_rows": 4, "chunks": 2}]}}}
    log = tmp_path / "server.log"
    with VllmServer(
        default_serve_args(str(tiny_model)) + ["--plugin", "powersave", "--additional-config", json.dumps(cfg)], env=env, log_path=log
    ) as srv:
        c = _post(
            srv.base_url + "/v1/completions",
            {"model": "model", "prompt": "def main():", "max_tokens": 8, "ignore_eos": True, "prompt_logprobs": 0},
        )
        assert c["usage"]["completion_tokens"] == 8 and len(c["choices"][0]["prompt_logprobs"]) >= 2
        m = _metrics_when(srv.base_url, lambda m: sum(v for k, v in m.items() if k.startswith("powersave_steps_total{")) > 0)
        # The log while serving: at shutdown vLLM 0.32's API server may log its own output-handler
        # traceback when the engine core exits first, which says nothing about the plugin.
        text = log.read_text()
    drift = [ln for ln in text.splitlines() if "drifted" in ln]
    assert drift and all("register_oot" in ln and "LM-head chunking" in ln for ln in drift), drift
    # One warning per process that installs the worker hooks (API server, engine core), never two in one.
    pids = [ln.split("pid=")[1].split(")")[0] for ln in drift if "pid=" in ln]
    assert len(pids) == len(set(pids)), drift
    assert "Traceback" not in text
    assert sum(v for k, v in m.items() if k.startswith("powersave_steps_total{")) > 0  # the step hook meters
    assert sum(v for k, v in m.items() if k.startswith("powersave_lm_head_calls_total{")) == 0  # chunking is off
