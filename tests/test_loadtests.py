"""Tests for the ``loadtests`` harness against an in-process fake OpenAI-compatible server.

The fake server (``loadtests.fake_server``) runs in its own thread/event loop so both the async
API and the CLI's ``asyncio.run`` can talk to it. Energy is deterministic: each request adds
PREFILL_J to the prefill series and DECODE_J per generated token to the decode series, so the
expected energy delta is known exactly (values are dyadic, so float sums are exact).
"""

from __future__ import annotations

import json
import math
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtests import BenchConfig, ConfigError, compare_table, format_markdown, run
from loadtests import energy as energy_mod
from loadtests.__main__ import main
from loadtests.client import RequestOutput
from loadtests.datasets import RequestInput, random_requests
from loadtests.energy import diff_counters, parse_energy_counters
from loadtests.fake_server import DECODE_J, PREFILL_J
from loadtests.metrics import calculate_metrics, percentile, summarize_ms
from loadtests.runner import arrival_offsets

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep tests independent of whether the test host has GPUs."""
    monkeypatch.setattr(energy_mod.NvmlEnergy, "open", classmethod(lambda cls, gpus: (None, "disabled in test")))


def write_jsonl(tmp_path: Path, prompts: list[str], output_len: int | None = None) -> str:
    p = tmp_path / "data.jsonl"
    rows = [{"prompt": x} | ({"output_len": output_len} if output_len else {}) for x in prompts]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f"jsonl:{p}"


# ---------------------------------------------------------------------------------
# End-to-end against the fake server
# ---------------------------------------------------------------------------------


def test_streaming_energy_tokens_per_joule_exact(server_factory) -> None:
    srv = server_factory(first_delay=0.1, itl_delay=0.005, sources={"prefill": "measured", "decode": "measured", "idle": "measured"})
    n, out_len = 6, 4
    res = run(
        BenchConfig(
            base_url=srv.url + "/v1",
            num_prompts=n,
            output_len=out_len,
            input_len=16,
            max_concurrency=3,
            num_warmups=2,
            label="base",
            seed=1,
        )
    )
    assert res["model_id"] == "fake-model"  # auto-detected from /v1/models
    assert res["completed"] == n and res["failed"] == 0
    assert len(srv.payloads) == n + 2  # warm-ups were sent but are not in the stats
    assert res["total_output_tokens"] == n * out_len
    assert res["output_lens"] == [out_len] * n
    # prompt_tokens come from usage (fake server reports words + 1 BOS)
    assert res["total_input_tokens"] == n * (16 + 1)
    # TTFT: never below the server's first-token delay, and it ends at the first token: the gaps
    # after it add up to the last token, which the server's sleeps bound from below and the request's
    # end from above. (No wall-clock upper bound: a stalled CI host can delay any chunk.)
    assert all(t >= 0.1 for t in res["ttfts"])
    assert all(len(itl) == out_len - 1 for itl in res["itls"])
    assert all(x >= 0 for itl in res["itls"] for x in itl)  # gaps can bunch on the client; no lower bound
    for t, itl, e in zip(res["ttfts"], res["itls"], res["e2els"]):
        assert 0.1 + (out_len - 1) * 0.005 - 1e-3 <= t + sum(itl) <= e + 1e-9
    assert res["median_ttft_ms"] == pytest.approx(1000.0 * statistics.median(res["ttfts"]))
    # Energy: only the measured window (warm-ups happened before the first scrape)
    expected = n * PREFILL_J + n * out_len * DECODE_J
    assert res["gpu_energy_j"] == expected
    assert res["energy_by_phase_j"] == {"prefill": n * PREFILL_J, "decode": n * out_len * DECODE_J, "idle": 0.0}
    assert res["output_tokens_per_joule"] == res["total_output_tokens"] / expected
    assert res["total_tokens_per_joule"] == (res["total_input_tokens"] + res["total_output_tokens"]) / expected
    assert res["gpu_energy_per_output_token_j"] == expected / res["total_output_tokens"]
    assert res["energy_source"] == "measured"
    assert res["energy_provider"] == "server-metrics"
    assert res["gpu_avg_power_w"] == pytest.approx(expected / res["energy_window_s"])
    assert res["gpu_idle_energy_j"] == 0.0
    assert res["gpu_active_energy_per_output_token_j"] == pytest.approx(expected / res["total_output_tokens"])
    # payload fields sent to the server
    p = srv.payloads[-1]
    assert p["ignore_eos"] is True and p["temperature"] == 0 and p["max_tokens"] == out_len
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    assert "prompt_logprobs" not in p
    assert srv.max_inflight <= 3


def test_simulated_and_mixed_source_labels(server_factory) -> None:
    srv = server_factory(typed_total=True)  # "# TYPE ..._total counter" spelling
    res = run(BenchConfig(base_url=srv.url, num_prompts=2, output_len=2, input_len=4))
    assert res["energy_source"] == "simulated"
    assert res["gpu_energy_j"] == 2 * PREFILL_J + 4 * DECODE_J

    srv2 = server_factory(sources={"prefill": "measured", "decode": "simulated", "idle": "measured"})
    res2 = run(BenchConfig(base_url=srv2.url, num_prompts=2, output_len=2, input_len=4))
    assert res2["energy_source"] == "simulated"  # mixed never claims "measured"


def test_chat_endpoint_skips_role_chunk(server_factory) -> None:
    srv = server_factory(first_delay=0.08)
    res = run(BenchConfig(base_url=srv.url, endpoint="chat", num_prompts=3, output_len=3, input_len=8, model="my-model"))
    assert res["completed"] == 3
    assert all(t >= 0.08 for t in res["ttfts"])  # the immediate role-only chunk is not a token
    assert srv.payloads[0]["messages"][0]["role"] == "user"
    assert srv.payloads[0]["model"] == "my-model"
    assert "prompt_logprobs" not in srv.payloads[0]
    assert res["endpoint_type"] == "openai-chat"


def test_chat_endpoint_passes_prompt_logprobs_without_streaming(server_factory) -> None:
    srv = server_factory(first_delay=0.05)
    res = run(
        BenchConfig(
            base_url=srv.url, endpoint="chat", num_prompts=3, output_len=3, input_len=8, model="my-model", prompt_logprobs=2, stream=False
        )
    )
    assert res["completed"] == 3
    assert srv.payloads[0]["prompt_logprobs"] == 2 and srv.payloads[0]["stream"] is False


@pytest.mark.parametrize("n", [1, 5])
def test_prompt_logprobs_with_streaming_is_refused_before_any_request(n) -> None:
    # vLLM answers 400 to each such request; a whole run of failures would look like a measurement.
    with pytest.raises(ConfigError, match=rf"^invalid config: prompt_logprobs = {n} needs stream = false: .*--no-stream"):
        BenchConfig(prompt_logprobs=n)
    assert BenchConfig(prompt_logprobs=0).prompt_logprobs == 0  # 0 streams fine in vLLM
    assert BenchConfig(prompt_logprobs=n, stream=False).prompt_logprobs == n


def test_output_tokens_from_usage_else_chunk_count(server_factory) -> None:
    # 2 tokens per chunk: usage says 6 tokens, but only 3 chunks arrive
    with_usage = server_factory(tokens_per_chunk=2, usage=True)
    res = run(BenchConfig(base_url=with_usage.url, num_prompts=2, output_len=6, input_len=4))
    assert res["output_lens"] == [6, 6]
    assert all(len(i) == 2 for i in res["itls"])  # ITL is per text chunk
    no_usage = server_factory(tokens_per_chunk=2, usage=False)
    res2 = run(BenchConfig(base_url=no_usage.url, num_prompts=2, output_len=6, input_len=4))
    assert res2["output_lens"] == [3, 3]


def test_non_streaming(server_factory) -> None:
    srv = server_factory()
    res = run(BenchConfig(base_url=srv.url, stream=False, num_prompts=2, output_len=5, input_len=4))
    assert res["completed"] == 2 and res["total_output_tokens"] == 10
    assert res["ttfts"] == res["e2els"]
    assert "stream_options" not in srv.payloads[0]


def test_malformed_chunk_and_http_error_are_counted_failures(server_factory, tmp_path) -> None:
    srv = server_factory()
    ds = write_jsonl(tmp_path, ["hello world", "MALFORMED please", "HTTP500 now"], output_len=3)
    res = run(BenchConfig(base_url=srv.url, num_prompts=3, dataset=ds))
    assert res["completed"] == 1 and res["failed"] == 2
    assert res["errors"][0] == ""
    assert res["errors"][1].startswith("malformed stream chunk")
    assert res["errors"][2].startswith("HTTP 500")
    assert res["total_output_tokens"] == 3  # failed requests contribute no tokens


def test_goodput_counts_requests_meeting_slo(server_factory, tmp_path) -> None:
    srv = server_factory(first_delay=0.01, slow_delay=0.4)
    ds = write_jsonl(tmp_path, ["a b", "SLOW c", "d e", "SLOW f", "g h"], output_len=2)
    res = run(BenchConfig(base_url=srv.url, num_prompts=5, dataset=ds, goodput={"ttft": 200.0}))
    # SLOW requests get their first token after 0.4 s: never good. The others are good when their
    # measured TTFT meets the SLO (all three on an idle host; a stalled one can delay one past it).
    ttft_ms = [t * 1000.0 for t in res["ttfts"]]
    assert ttft_ms[1] >= 400.0 and ttft_ms[3] >= 400.0
    assert res["good_requests"] == sum(t <= 200.0 for t in ttft_ms) <= 3
    assert res["request_goodput"] == pytest.approx(3 / res["duration"])


def test_global_timeout_never_hangs(server_factory, tmp_path) -> None:
    srv = server_factory()
    ds = write_jsonl(tmp_path, ["quick one", "HANG forever"], output_len=2)
    t0 = time.monotonic()
    # 2 s leave the quick request time on a stalled CI host; HANG answers after 30 s, so a run that
    # waited for it would take that long: the bound below only catches a hang.
    res = run(BenchConfig(base_url=srv.url, num_prompts=2, dataset=ds, timeout_s=2.0))
    assert time.monotonic() - t0 < 2.0 + 10
    assert res["timed_out"] is True
    assert res["completed"] == 1 and res["failed"] == 1
    assert "--timeout" in res["errors"][1]


def test_poisson_open_loop_respects_schedule(server_factory) -> None:
    srv = server_factory()
    cfg = BenchConfig(base_url=srv.url, num_prompts=5, output_len=2, input_len=4, request_rate=40.0, seed=3)
    res = run(cfg)
    offsets = arrival_offsets(5, 40.0, 1.0, 3)
    assert res["completed"] == 5
    assert all(st >= off - 1e-3 for st, off in zip(res["start_times"], offsets))
    assert res["request_rate"] == 40.0


def test_no_energy_source(server_factory, no_nvml) -> None:
    srv = server_factory(metrics=False)
    res = run(BenchConfig(base_url=srv.url, num_prompts=1, output_len=2, input_len=4))
    assert res["gpu_energy_j"] is None and res["output_tokens_per_joule"] is None
    assert res["energy_source"] is None
    assert "no energy source" in format_markdown(res)


def test_nvml_fallback_aligns_window_to_counter_updates(server_factory, monkeypatch) -> None:
    t0 = time.perf_counter()

    class FakeNvml:
        """Counter like NVML's: advances every 100 ms; GPU i draws (i + 1) * 10 W."""

        @staticmethod
        def nvmlInit() -> None: ...
        @staticmethod
        def nvmlDeviceGetCount() -> int:
            return 4

        @staticmethod
        def nvmlDeviceGetHandleByIndex(i: int) -> int:
            return i

        @staticmethod
        def nvmlDeviceGetTotalEnergyConsumption(h: int) -> int:
            steps = int((time.perf_counter() - t0) / 0.1)
            return steps * (h + 1) * 1000  # mJ per 100 ms step = (h + 1) * 10 W

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml)
    srv = server_factory(metrics=False)
    res = run(BenchConfig(base_url=srv.url, num_prompts=3, output_len=2, input_len=4, gpus=[1, 3]))
    assert res["energy_provider"] == "nvml" and res["energy_source"] == "measured"
    assert set(res["energy_by_gpu_j"]) == {"1", "3"}
    w, edge = res["energy_window_s"], res["energy_window_edge_s"]
    # Edges on counter updates: energy = power x window with no +-100 ms quantisation per edge, to
    # within the edges' stated span (a few ms of polling; a stalled poller widens it, and says so).
    assert 0.0 < edge < w
    assert res["energy_by_gpu_j"]["1"] == pytest.approx(20.0 * w, abs=20.0 * edge + 1e-6)
    assert res["energy_by_gpu_j"]["3"] == pytest.approx(40.0 * w, abs=40.0 * edge + 1e-6)
    assert res["gpu_energy_j"] == pytest.approx(res["energy_by_gpu_j"]["1"] + res["energy_by_gpu_j"]["3"])
    assert round(res["energy_by_gpu_j"]["1"] / 2.0, 6) == round(res["energy_by_gpu_j"]["1"] / 2.0)  # whole steps


@pytest.mark.parametrize("stall_s, last_old, done", [(0.0, 10.019, 10.025), (0.05, 10.007, 10.063), (0.3, 10.007, 10.313)])
def test_nvml_alignment_stamps_the_update_between_the_polls_that_bracket_it(monkeypatch, stall_s, last_old, done) -> None:
    # A fake clock: a counter read takes 1 ms, a poll's sleep 2 ms, and the third sleep overruns by
    # stall_s (a descheduled client; 0.3 s runs past the 0.25 s wait). The counter steps at 10.0205 s.
    # It was last seen unchanged by the poll that began at ``last_old``; both GPUs are read by ``done``.
    # The reading is stamped at that span's midpoint and states the span: a stall widens it instead
    # of moving the edge.
    import asyncio
    import types

    now = [10.0]
    sleeps: list[float] = []

    class Gpu:
        def total_energy_mj(self) -> int:
            now[0] += 0.001
            return 7000 if now[0] >= 10.0205 else 5000

    async def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s + (stall_s if len(sleeps) == 3 else 0.0)

    monkeypatch.setattr(energy_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(energy_mod, "asyncio", types.SimpleNamespace(sleep=sleep))
    t, span, per_gpu = asyncio.run(energy_mod.NvmlEnergy([Gpu(), Gpu()], [0, 2]).aligned_per_gpu_j(poll_s=0.002))
    assert per_gpu == {"0": 7.0, "2": 7.0} and now[0] == pytest.approx(done, abs=1e-9)
    assert span == pytest.approx(done - last_old, abs=1e-9) and t == pytest.approx((last_old + done) / 2, abs=1e-9)
    assert t - span / 2 <= 10.0205 <= t + span / 2  # the update is inside the stated span


# ---------------------------------------------------------------------------------
# CLI and bad input
# ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_cli_one_line_exit_2() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    p = subprocess.run(
        [sys.executable, "-m", "loadtests", "--base-url", url, "--num-prompts", "1"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: cannot reach server at {url}: ")
    assert p.stdout == ""


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"prompt": "ok"}\n{not json\n', "line 2: invalid JSON"),
        ('{"prompt": ""}\n', "line 1: 'prompt' must be a non-empty string"),
        ('{"prompt": "x", "output_len": 0}\n', "line 1: 'output_len'"),
        (None, "No such file"),
    ],
)
def test_bad_dataset_one_line_error(tmp_path, capsys, content, needle) -> None:
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    # The dataset is checked before contacting the server, so the URL need not exist.
    rc = main(["--base-url", f"http://127.0.0.1:{_free_port()}", "--dataset", f"jsonl:{path}", "--num-prompts", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: bad dataset file ") and needle in err[0], err


def test_config_validation_is_one_line(capsys) -> None:
    with pytest.raises(ConfigError) as ei:
        BenchConfig(num_prompts=0)
    msg = str(ei.value)
    assert "\n" not in msg and "num_prompts" in msg and "= 0" in msg
    with pytest.raises(ConfigError, match="goodput"):
        BenchConfig(goodput={"latency": 5.0})
    with pytest.raises(ConfigError, match=r"^invalid config: field 'endpoint' = 'x': [^\n]*$"):
        BenchConfig.model_validate({"endpoint": "x"})
    cfg = BenchConfig(base_url="http://h:1/v1/")
    assert cfg.base_url == "http://h:1"
    with pytest.raises(ConfigError, match="max_concurrency"):
        cfg.max_concurrency = 0
    rc = main(["--request-rate", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "request_rate" in err[0] and "-1" in err[0]
    rc = main(["--num-prompts", "many"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--num-prompts" in err[0]


def test_cli_writes_json_and_compare(server_factory, tmp_path, capsys) -> None:
    srv = server_factory()
    out_a, out_b = tmp_path / "a.json", tmp_path / "b.json"
    rc = main(
        [
            "--base-url",
            srv.url,
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-concurrency",
            "2",
            "--goodput",
            "ttft:5000",
            "--label",
            "A",
            "--result-json",
            str(out_a),
            "--markdown",
            str(tmp_path / "a.md"),
        ]
    )
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    a = json.loads(out_a.read_text())
    for key in (
        "date",
        "base_url",
        "endpoint_type",
        "model_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "label",
        "input_len",
        "output_len",
        "ttfts",
        "itls",
        "input_lens",
        "output_lens",
        "errors",
        "p99_tpot_ms",
        "std_e2el_ms",
        "request_goodput",
        "energy_by_phase_j",
    ):
        assert key in a, key
    assert a["request_rate"] == "inf" and a["good_requests"] == 3
    b = dict(a, label="B", energy_source="measured")
    out_b.write_text(json.dumps(b))
    rc = main(["--compare", str(out_a), str(out_b)])
    table = capsys.readouterr().out
    assert rc == 0 and "| Metric | A | B |" in table
    assert "(simulated)" in table and "(measured)" in table
    assert (tmp_path / "a.md").read_text().startswith("## Load test: A")


# ---------------------------------------------------------------------------------
# Pure units
# ---------------------------------------------------------------------------------


def test_percentiles_on_known_list() -> None:
    xs = [float(i) for i in range(1, 11)]
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile([], 50) == 0.0
    s = summarize_ms("ttft", [0.001, 0.002, 0.003, 0.004], [50, 99.9])
    assert s["mean_ttft_ms"] == pytest.approx(2.5)
    assert s["median_ttft_ms"] == pytest.approx(2.5)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(1.25))
    assert s["p99.9_ttft_ms"] == pytest.approx(3.997)
    try:
        import numpy as np
    except ImportError:
        return
    for p in (1, 25, 50, 75, 90, 99):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_tpot_and_goodput_unit() -> None:
    inputs = [RequestInput("a", 1, 10)] * 3
    outs = [
        RequestOutput(success=True, ttft=0.1, latency=1.0, output_tokens=10, prompt_tokens=5),  # tpot 100 ms
        RequestOutput(success=True, ttft=0.3, latency=0.5, output_tokens=5, prompt_tokens=5),  # tpot 50 ms
        RequestOutput(success=False, error="x"),
    ]
    m = calculate_metrics(inputs, outs, duration_s=2.0, goodput={"ttft": 200.0, "tpot": 120.0})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["mean_tpot_ms"] == pytest.approx(75.0)
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)
    assert m["total_input_tokens"] == 10 and m["total_output_tokens"] == 15
    assert m["output_throughput"] == pytest.approx(7.5)


def test_arrival_offsets_seeded_poisson() -> None:
    a = arrival_offsets(2000, 10.0, 1.0, seed=5)
    assert a == arrival_offsets(2000, 10.0, 1.0, seed=5)
    assert a != arrival_offsets(2000, 10.0, 1.0, seed=6)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=1e-12)  # normalized: exactly 1/rate on average
    # Still Poisson-shaped: exponential gaps have a coefficient of variation of 1.
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.1)
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]


def test_normalized_arrivals_fix_the_runs_length_as_vllm_bench_does() -> None:
    # vllm bench serve scales its gamma draw so a fixed-rate run lasts n / rate whatever the seed;
    # ours (first request at 0) ends its sends at (n - 1) / rate, so throughput no longer depends on the draw.
    ends = [arrival_offsets(256, 12.0, 1.0, seed=s)[-1] for s in range(5)]
    assert ends == pytest.approx([255 / 12.0] * 5, rel=1e-12)
    raw = [arrival_offsets(256, 12.0, 1.0, seed=s, normalize=False)[-1] for s in range(5)]
    assert max(raw) - min(raw) > 0.5  # the raw draws end seconds apart (sd ~ sqrt(255) / 12 = 1.3 s)
    a, b = arrival_offsets(50, 5.0, 2.0, seed=1), arrival_offsets(50, 5.0, 2.0, seed=1, normalize=False)
    assert [x / a[-1] for x in a] == pytest.approx([x / b[-1] for x in b])  # the same shape, only rescaled
    assert arrival_offsets(5, 4.0, arrival="constant", normalize=True) == [0.0, 0.25, 0.5, 0.75, 1.0]
    # Extreme burstiness: gaps so small their sum is subnormal; never NaN or infinite send times.
    assert all(math.isfinite(x) for s in range(3000) for x in arrival_offsets(2, 1.0, 0.0005, seed=s))


def test_random_prompts_lengths_and_determinism() -> None:
    r = random_requests(50, 100, 20, range_ratio=0.5, seed=2)
    assert r == random_requests(50, 100, 20, range_ratio=0.5, seed=2)
    assert all(50 <= x.prompt_len <= 150 and len(x.prompt.split()) == x.prompt_len for x in r)
    assert all(10 <= x.output_len <= 30 for x in r)


def test_parse_and_diff_energy_counters() -> None:
    before_txt = (
        "# TYPE powersave_gpu_energy_joules counter\n"
        'powersave_gpu_energy_joules_total{gpu="0",phase="decode",source="measured"} 10.0\n'
        'powersave_gpu_energy_joules_created{gpu="0",phase="decode",source="measured"} 1.0\n'
    )
    after_txt = (
        "# TYPE powersave_gpu_energy_joules counter\n"
        'powersave_gpu_energy_joules_total{gpu="0",phase="decode",source="measured"} 12.5\n'
        'powersave_gpu_energy_joules_total{gpu="1",phase="prefill",source="measured"} 1.5\n'
    )
    b, a = parse_energy_counters(before_txt), parse_energy_counters(after_txt)
    assert b is not None and a is not None and len(b) == 1
    r = diff_counters(b, a)
    assert r.energy_j == 4.0 and r.source == "measured"
    assert r.by_phase_j == {"decode": 2.5, "prefill": 1.5} and r.by_gpu_j == {"0": 2.5, "1": 1.5}
    assert parse_energy_counters("other_metric 1\n") is None
    assert parse_energy_counters("garbage {{{\n") is None


def test_compare_table_marks_every_energy_number() -> None:
    base = {
        "model_id": "m",
        "completed": 1,
        "failed": 0,
        "output_throughput": 10.0,
        "median_ttft_ms": 5.0,
        "p99_ttft_ms": 9.0,
        "gpu_energy_per_output_token_j": 0.5,
        "output_tokens_per_joule": 2.0,
        "total_tokens_per_joule": 4.0,
        "gpu_avg_power_w": 100.0,
    }
    t = compare_table(
        {"sim": base | {"energy_source": "simulated"}, "real": base | {"energy_source": "measured"}, "none": base | {"energy_source": None}}
    )
    rows = {line.split("|")[1].strip(): line for line in t.splitlines()}
    for row in ("J / output token", "Output tokens / J", "Total tokens / J"):
        cells = [c.strip() for c in rows[row].split("|")[2:-1]]
        assert cells[0].endswith("(simulated)") and cells[1].endswith("(measured)")
        assert cells[2] == "n/a (no energy source)"
    assert "| TTFT p50 (ms) | 5.00 | 5.00 | 5.00 |" in t


def test_duration_bounded_window(server_factory) -> None:
    # Each request takes >= 0.2 s; 2 at a time for a 1 s window: each slot starts at most 6 (at 0,
    # 0.2, ..., 1.0 s), the first two start at once (a 1 s window leaves room for a stalled CI host),
    # and none is cut.
    srv = server_factory(first_delay=0.2)
    res = run(BenchConfig(base_url=srv.url, num_prompts=500, max_concurrency=2, output_len=2, input_len=4, duration_s=1.0))
    assert 2 <= res["completed"] <= 12
    assert res["failed"] == 0
    assert res["num_prompts"] == res["completed"] and len(res["ttfts"]) == res["completed"]
    assert res["duration_limit_s"] == 1.0


def test_closed_loop_holds_at_most_concurrency_request_tasks(server_factory, monkeypatch) -> None:
    # A closed-loop window over many prompts must not create a task per prompt up front: with 100k
    # prompts that took the client's loop a second per window before the first request went out.
    import asyncio

    from loadtests import runner as runner_mod

    srv = server_factory(first_delay=0.05)
    real, seen = runner_mod.send_request, []

    async def counting(*a, **kw):
        seen.append(sum(1 for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "").endswith("run_load.<locals>.one")))
        return await real(*a, **kw)

    monkeypatch.setattr(runner_mod, "send_request", counting)
    # A 1 s window of >= 0.05 s requests: many refills of the 3 slots, even on a stalled CI host.
    res = run(BenchConfig(base_url=srv.url, num_prompts=3000, max_concurrency=3, output_len=2, input_len=4, duration_s=1.0))
    assert res["completed"] == len(seen) >= 6
    # Request tasks alive while a request is sent: the in-flight ones only, never the 3000 prompts.
    assert max(seen) == 3
    # Arrival order is kept: requests go out in prompt order.
    assert res["start_times"] == sorted(res["start_times"])


def test_open_loop_window_does_not_wait_for_an_arrival_after_it(server_factory) -> None:
    # Constant gaps of 10 s: the second request would arrive at 10 s, after a 0.3 s window. It is
    # neither sent nor waited for, so the run ends with the first request, not at 10 s.
    srv = server_factory(first_delay=0.01)
    res = run(BenchConfig(base_url=srv.url, num_prompts=5, request_rate=0.1, arrival="constant", output_len=2, input_len=4, duration_s=0.3))
    assert res["completed"] == 1 and res["duration"] < 5.0


def test_energy_mode_nvml_ignores_server_metrics(server_factory, no_nvml) -> None:
    srv = server_factory()
    res = run(BenchConfig(base_url=srv.url, num_prompts=1, output_len=2, input_len=4, energy="nvml"))
    assert res["energy_source"] is None and res["gpu_energy_j"] is None  # no NVML here: no energy, not the server's


def test_ab_ratio_ci_and_verdicts() -> None:
    from loadtests.ab import ratio_ci, summarize

    m, lo, hi = ratio_ci([1.0, 1.02, 0.98])
    assert m == pytest.approx(1.0) and lo < 1 < hi
    m, lo, hi = ratio_ci([0.80, 0.82, 0.81])
    assert hi < 1
    pairs = [
        (
            {"output_throughput": 100.0, "gpu_energy_per_output_token_j": 1.0},
            {"output_throughput": 101.0, "gpu_energy_per_output_token_j": 0.8},
        ),
        (
            {"output_throughput": 100.0, "gpu_energy_per_output_token_j": 1.0},
            {"output_throughput": 99.0, "gpu_energy_per_output_token_j": 0.81},
        ),
        (
            {"output_throughput": 100.0, "gpu_energy_per_output_token_j": 1.0},
            {"output_throughput": 100.5, "gpu_energy_per_output_token_j": 0.79},
        ),
    ]
    s = summarize(pairs)
    assert s["output_throughput"]["verdict"] == "inside noise"
    assert s["gpu_energy_per_output_token_j"]["verdict"] == "B lower"
    assert s["gpu_energy_per_output_token_j"]["ratios"] == pytest.approx([0.8, 0.81, 0.79])


def test_ab_against_two_fake_servers_abba(server_factory) -> None:
    from loadtests.ab import format_ab, run_ab

    fast, slow = server_factory(first_delay=0.01), server_factory(first_delay=0.08)
    a = BenchConfig(base_url=fast.url, num_prompts=4, output_len=2, input_len=4, max_concurrency=2)
    res = run_ab(a, a.model_copy(update={"base_url": slow.url}), pairs=2)
    runs = res["runs"]
    # ABBA: the second pair ran B first, and each run is booked to its side whatever the order.
    assert [(r["a"]["base_url"], r["b"]["base_url"]) for r in runs] == [(fast.url, slow.url)] * 2
    assert runs[0]["a"]["t0_perf_counter"] < runs[0]["b"]["t0_perf_counter"] < runs[1]["b"]["t0_perf_counter"]
    assert runs[1]["b"]["t0_perf_counter"] < runs[1]["a"]["t0_perf_counter"]
    # Each pair's ratio is B/A of that pair's own medians; B's are never below its 80 ms first-token delay.
    ttft = res["summary"]["median_ttft_ms"]
    assert ttft["ratios"] == pytest.approx([r["b"]["median_ttft_ms"] / r["a"]["median_ttft_ms"] for r in runs], rel=1e-12)
    assert all(r["b"]["median_ttft_ms"] >= 80.0 for r in runs)
    assert len(fast.payloads) == len(slow.payloads) == 8
    assert "B/A per pair" in format_ab(res)


def test_ab_cli_writes_strict_json_even_with_one_pair(server_factory, tmp_path) -> None:
    from loadtests.__main__ import main

    a, b = server_factory(), server_factory()
    out = tmp_path / "ab.json"
    rc = main(
        [
            "--base-url",
            a.url,
            "--ab-base-url",
            b.url,
            "--pairs",
            "1",
            "--num-prompts",
            "2",
            "--output-len",
            "2",
            "--input-len",
            "4",
            "--result-json",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["pairs"] == 1 and doc["summary"]["output_throughput"]["ci95"] == [None, None]


@pytest.mark.parametrize(
    "df,exact", [(1, 12.706), (10, 2.228), (11, 2.201), (15, 2.131), (20, 2.086), (30, 2.042), (59, 2.001), (120, 1.980)]
)
def test_t_quantile_matches_the_table_beyond_ten_pairs(df, exact) -> None:
    # 1.96 for every df > 10 made a 12-31-pair interval 3-11 % too narrow, and the 2 % equivalence
    # verdict of the harness comparison rests on this interval.
    from loadtests.ab import ratio_ci, t95

    assert t95(df) == pytest.approx(exact, abs=1.5e-3)
    xs = [1.0, 1.1] * ((df + 1) // 2) + [1.05] * ((df + 1) % 2)
    m, lo, hi = ratio_ci(xs)
    assert hi - m == pytest.approx(t95(len(xs) - 1) * 0.05 * math.sqrt(len(xs) / (len(xs) - 1)) / math.sqrt(len(xs)), rel=0.05)
    with pytest.raises(ValueError, match="df = 0"):
        t95(0)


def test_trust_env_is_off_by_default_and_reaches_the_session_when_asked(server_factory, monkeypatch) -> None:
    # Off: a proxy in the environment is never used (only the given URL is contacted). On (as vllm bench's
    # session): aiohttp reads the environment; NO_PROXY for loopback keeps this test's requests local.
    import aiohttp

    seen = []
    real = aiohttp.ClientSession.__init__

    def spy(self, *a, **kw):
        seen.append(kw.get("trust_env", False))
        real(self, *a, **kw)

    monkeypatch.setattr(aiohttp.ClientSession, "__init__", spy)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    srv = server_factory()
    assert BenchConfig(base_url=srv.url).trust_env is False
    off = run(BenchConfig(base_url=srv.url, num_prompts=2, output_len=2, input_len=4))
    assert off["trust_env"] is False and seen[0] is False
    seen.clear()
    on = run(BenchConfig(base_url=srv.url, num_prompts=2, output_len=2, input_len=4, trust_env=True))
    assert on["trust_env"] is True and on["completed"] == 2
    assert seen[0] is True  # the request session; the metrics session stays off
    assert seen[1:] == [False] * (len(seen) - 1)
