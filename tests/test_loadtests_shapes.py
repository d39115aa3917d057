"""Load shapes, fleets, datasets, steady state, timelines, sweeps and bad input of ``loadtests``.

Every run goes against ``loadtests.fake_server.FakeServer`` (in-process thread), whose timing is
exact (it sleeps ``first_delay`` before the first chunk, ``itl_delay`` between chunks) and whose
energy counter is deterministic (``PREFILL_J`` per request, ``DECODE_J`` per token).

Timing tolerances: the fake server's sleeps are a hard lower bound (a client cannot see a chunk
before it is written), so lower bounds are tight (the event loop's clock resolution, < 1 ms). The
harness can only add time: ~1 ms on an idle machine, but a stalled CI host (2 cores) can add most
of a second to any single value. So nothing is bounded from above by a fixed wall-clock margin:
upper bounds come from what the harness itself measured (a request's end, the next request's
start, the queue time it reports) or are guards against hangs.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import random
import re
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loadtests import BenchConfig, ConfigError, DatasetError, run
from loadtests.__main__ import main
from loadtests.client import RequestOutput
from loadtests.datasets import (
    WORDS,
    load_sharegpt,
    load_trace,
    prefix_repetition_requests,
    sample_requests,
)
from loadtests.fake_server import DECODE_J, PREFILL_J
from loadtests.shapes import arrival_offsets, ramp_offsets
from loadtests.window import steady_state_bounds

MEASURED = {"prefill": "measured", "decode": "measured", "idle": "measured"}


@pytest.fixture
def fake(server_factory):
    return server_factory  # conftest.py: fake servers started by the test, stopped after it


@pytest.fixture(autouse=True)
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    from loadtests import energy

    monkeypatch.setattr(energy.NvmlEnergy, "open", classmethod(lambda cls, gpus: (None, "disabled in test")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------
# Exact timing against the fake server
# ---------------------------------------------------------------------------------


def test_ttft_tpot_itl_match_the_servers_delays(fake) -> None:
    srv = fake(first_delay=0.050, itl_delay=0.010)
    n_out = 6
    res = run(BenchConfig(base_url=srv.url, num_prompts=5, max_concurrency=1, output_len=n_out, input_len=4, sample_interval_s=0))
    assert res["completed"] == 5
    ttfts, itls, lats, starts = res["ttfts"], res["itls"], res["latencies"], res["start_times"]
    assert all(t >= 0.0499 for t in ttfts), ttfts
    assert all(len(itl) == n_out - 1 and min(itl) >= 0.0 for itl in itls)
    for t, itl, e in zip(ttfts, itls, lats):
        # TTFT ends at the first token and the gaps after it reach the last one: no earlier than the
        # server wrote it, no later than the request's end.
        assert 0.050 + (n_out - 1) * 0.010 - 1e-3 <= t + sum(itl) <= e + 1e-9
    # Times count from each request's own start: one at a time, each starts after the previous ended.
    assert all(s0 + e0 <= s1 + 1e-9 for s0, e0, s1 in zip(starts, lats, starts[1:]))
    # The summaries are those of the per-request values: TPOT = (E2E - TTFT) / (tokens - 1).
    assert res["median_ttft_ms"] == pytest.approx(1000.0 * statistics.median(ttfts))
    assert res["median_itl_ms"] == pytest.approx(1000.0 * statistics.median(x for itl in itls for x in itl))
    assert res["median_tpot_ms"] == pytest.approx(1000.0 * statistics.median((e - t) / (n_out - 1) for t, e in zip(ttfts, lats)))
    assert res["latencies"] == res["e2els"]
    # One at a time: the server never saw two requests together, and vLLM's peak counter agrees.
    assert srv.max_inflight == 1
    assert res["max_concurrent_requests"] >= 1


def test_queue_time_under_a_concurrency_cap(fake) -> None:
    # 4 requests at once, cap 2, each >= 0.1 s: the second pair waits for a slot.
    srv = fake(first_delay=0.1, itl_delay=0.0)
    res = run(BenchConfig(base_url=srv.url, num_prompts=4, max_concurrency=2, output_len=1, input_len=2, sample_interval_s=0))
    q, st, lat = res["queue_times"], res["start_times"], res["latencies"]
    # All four arrived at the run's start: the queue time counts from there, so it is the start time.
    assert q == pytest.approx(st, abs=1e-9)
    # The first two run together (the second starts before the first could end); the other two
    # start only once one of them ended, >= 0.1 s in.
    assert st[1] < st[0] + lat[0]
    first_end = min(st[0] + lat[0], st[1] + lat[1])
    assert all(st[k] >= max(first_end - 1e-9, 0.0999) for k in (2, 3))
    assert srv.max_inflight <= 2


# ---------------------------------------------------------------------------------
# Fleet
# ---------------------------------------------------------------------------------


def test_fleet_round_robin_per_endpoint_and_total_energy(fake) -> None:
    a = fake(first_delay=0.01, sources=MEASURED)
    b = fake(first_delay=0.08, sources=MEASURED)
    n, out_len = 8, 3
    res = run(BenchConfig(base_urls=[a.url, b.url], num_prompts=n, max_concurrency=4, output_len=out_len, input_len=5))
    assert len(a.payloads) == len(b.payloads) == n // 2  # round-robin, no router
    assert res["endpoint_ids"] == [0, 1] * (n // 2)
    assert res["base_urls"] == [a.url, b.url] and res["energy_scope"] == "server-metrics per endpoint"
    ea, eb = res["endpoints"]
    per = (n // 2) * (PREFILL_J + out_len * DECODE_J)
    assert ea["gpu_energy_j"] == per and eb["gpu_energy_j"] == per
    assert res["gpu_energy_j"] == 2 * per
    assert ea["output_tokens_per_joule"] == (n // 2) * out_len / per
    assert res["output_tokens_per_joule"] == n * out_len / (2 * per)
    assert ea["energy_source"] == eb["energy_source"] == res["energy_source"] == "measured"
    assert res["gpu_avg_power_w"] == pytest.approx(2 * per / res["energy_window_s"])
    # Each endpoint's latency is its own requests', and B's server never answers before 80 ms.
    for k, ep in enumerate((ea, eb)):
        mine = [t for t, e in zip(res["ttfts"], res["endpoint_ids"]) if e == k]
        assert ep["median_ttft_ms"] == pytest.approx(1000.0 * statistics.median(mine))
    assert all(t >= 0.08 for t, e in zip(res["ttfts"], res["endpoint_ids"]) if e == 1)
    assert ea["median_ttft_ms"] >= 10.0
    assert ea["completed"] == eb["completed"] == n // 2
    md = __import__("loadtests").format_markdown(res)
    assert "### Per endpoint" in md and "**fleet total**" in md


def test_fleet_steady_state_per_endpoint_from_each_servers_meter(fake) -> None:
    a = fake(first_delay=0.01, itl_delay=0.01, sources=MEASURED)
    b = fake(first_delay=0.01, itl_delay=0.02, sources=MEASURED)
    n, B, out_len = 32, 4, 8
    res = run(
        BenchConfig(
            base_urls=[a.url, b.url],
            num_prompts=n,
            max_concurrency=B,
            output_len=out_len,
            input_len=3,
            sample_interval_s=0.05,
            metrics_interval_s=0.05,
        )
    )
    ea, eb = res["endpoints"]
    for k, ep in enumerate((ea, eb)):
        assert ep["steady_state_batch"] == B // 2  # round-robin: each server holds half the target batch
        # The ML.ENERGY window of this server's own requests brackets its reported (tick-snapped) window.
        mine = [i for i, e in enumerate(res["endpoint_ids"]) if e == k]
        first = sorted(res["start_times"][i] + res["ttfts"][i] for i in mine)
        done = sorted(res["start_times"][i] + res["latencies"][i] for i in mine)
        lo, hi = ep["steady_state_start_s"], ep["steady_state_end_s"]
        assert first[B // 2 - 1] <= lo < hi <= done[len(mine) - B // 2 - 2]
        # Tokens: this server's own token arrivals inside its window (a mix-up of servers, the
        # slower one making fewer, would count others').
        tok = 0
        for i in mine:
            x = res["start_times"][i] + res["ttfts"][i]
            tok += lo < x <= hi
            for g in res["itls"][i]:
                x += g
                tok += lo < x <= hi
        assert ep["steady_state_output_tokens"] == tok
        assert ep["steady_state_output_throughput"] == pytest.approx(tok / (hi - lo))
        # Energy from this server's meter only: its tokens and prefills inside the window, edges aside.
        starts = sum(1 for i in mine if lo < res["start_times"][i] <= hi)
        assert abs(ep["steady_state_gpu_energy_j"] - (tok * DECODE_J + starts * PREFILL_J)) <= 2 * B * (DECODE_J + PREFILL_J)
        assert ep["steady_state_output_tokens_per_joule"] == tok / ep["steady_state_gpu_energy_j"]
        assert ep["steady_state_energy_source"] == "measured"
    md = __import__("loadtests").format_markdown(res)
    assert "Steady state: tokens / J" in md and f"{ea['steady_state_output_tokens_per_joule']:.4f} (measured)" in md


def test_fleet_steady_state_per_endpoint_has_no_energy_without_per_endpoint_meters(fake) -> None:
    a, b = fake(first_delay=0.0, itl_delay=0.005), fake(first_delay=0.0, itl_delay=0.005, metrics=False)
    res = run(
        BenchConfig(
            base_urls=[a.url, b.url],
            num_prompts=16,
            max_concurrency=4,
            output_len=4,
            input_len=3,
            sample_interval_s=0.05,
            metrics_interval_s=0.05,
        )
    )
    assert all(ep["steady_state_gpu_energy_j"] is None and ep["steady_state_duration_s"] for ep in res["endpoints"])


def test_fleet_steady_state_per_endpoint_batch_is_the_exact_share(fake) -> None:
    # B = 4 over 3 servers: each holds 4/3 on average. Rounding the share up to 2 (the window's count
    # of first tokens) must not become the yardstick: a saturated fleet would read 0.67 of B on
    # every server and be flagged "batch not full".
    srv = [fake(first_delay=0.0, itl_delay=0.005) for _ in range(3)]
    res = run(
        BenchConfig(
            base_urls=[s.url for s in srv],
            num_prompts=30,
            max_concurrency=4,
            output_len=4,
            input_len=3,
            sample_interval_s=0.05,
            metrics_interval_s=0.05,
        )
    )
    for ep in res["endpoints"]:
        assert ep["steady_state_batch"] == pytest.approx(4 / 3)
        assert ep["steady_state_duration_s"] is not None
        assert ep["steady_state_batch_utilization"] == pytest.approx(ep["steady_state_avg_concurrency"] / (4 / 3))
    assert "Per endpoint" in __import__("loadtests").format_markdown(res)


def test_steady_state_with_a_fractional_batch_share() -> None:
    from loadtests.window import steady_state

    # One server of a fleet whose share is 4/3: the window opens at its 2nd first token (ceil), and
    # 1.33 requests in flight on average is a full share, not a batch that never filled.
    outs = [_out(2.25 * k, 0.1, 3.0) for k in range(7)]  # 3 s requests every 2.25 s: 4/3 in flight
    ss = steady_state(outs, 4 / 3, [], 0.0)
    assert ss["steady_state_batch"] == pytest.approx(4 / 3)
    assert ss["steady_state_start_s"] == pytest.approx(2.35)  # 2nd first token
    assert ss["steady_state_end_s"] == pytest.approx(9.75)  # N - ceil(B) - 1 = 4th finish
    assert 1.3 < ss["steady_state_avg_concurrency"] < 1.45
    assert ss["steady_state_batch_utilization"] == pytest.approx(ss["steady_state_avg_concurrency"] * 3 / 4)
    assert "batch not full" not in ss["steady_state_note"]


def test_fleet_endpoint_energy_notes_say_why_there_is_none(fake) -> None:
    # Neither the fleet nor a server has energy (energy="none"): no endpoint may claim that the
    # fleet was measured, and its steady-state energy, None, says why.
    a, b = fake(first_delay=0.0, itl_delay=0.005), fake(first_delay=0.0, itl_delay=0.005)
    res = run(
        BenchConfig(
            base_urls=[a.url, b.url],
            num_prompts=16,
            max_concurrency=4,
            output_len=4,
            input_len=3,
            sample_interval_s=0.05,
            metrics_interval_s=0.05,
            energy="none",
        )
    )
    assert res["gpu_energy_j"] is None
    for ep in res["endpoints"]:
        assert ep["gpu_energy_j"] is None and "whole fleet" not in ep["energy_note"]
        assert "disabled by energy='none'" in ep["energy_note"]
        assert ep["steady_state_duration_s"] is not None and ep["steady_state_gpu_energy_j"] is None
        assert "disabled by energy='none'" in ep["steady_state_note"]


def test_model_row_names_the_served_model_and_its_directory(fake) -> None:
    srv = fake(model="model")
    res = run(BenchConfig(base_url=srv.url, num_prompts=2, output_len=1, input_len=2))
    assert res["model_id"] == "model" and res["model_root"] == "/models/model-weights"
    lib = __import__("loadtests")
    assert "| Model | model (model-weights) |" in lib.format_markdown(res)
    assert "| Model | model (model-weights) |" in lib.compare_table({"a": res})
    named = run(BenchConfig(base_url=srv.url, model="other", num_prompts=1, output_len=1, input_len=2))
    assert named["model_root"] is None  # the server lists no model of that name: nothing guessed


def test_fleet_without_metrics_on_one_endpoint_has_no_partial_energy(fake) -> None:
    a, b = fake(), fake(metrics=False)
    res = run(BenchConfig(base_urls=[a.url, b.url], num_prompts=4, output_len=2, input_len=3))
    assert res["completed"] == 4
    assert res["gpu_energy_j"] is None and res["energy_source"] is None
    assert b.url in res["energy_note"] and "no energy source" in res["energy_note"]
    assert all(ep["gpu_energy_j"] is None for ep in res["endpoints"])


def test_fleet_unreachable_member_is_one_line_exit_2(fake, capsys) -> None:
    a = fake()
    dead = f"http://127.0.0.1:{_free_port()}"
    rc = main(["--base-url", a.url, dead, "--num-prompts", "2", "--output-len", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: cannot reach server at {dead}: ")
    assert a.payloads == []  # nothing was sent to the reachable one either


# ---------------------------------------------------------------------------------
# Load shapes
# ---------------------------------------------------------------------------------


def test_constant_arrivals_are_exact() -> None:
    assert arrival_offsets(5, 4.0, arrival="constant") == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_ramp_maps_unit_arrivals_through_the_cumulative_rate(strategy: str) -> None:
    r0, r1, dur = 2.0, 10.0, 4.0

    def lam(t: float) -> float:  # cumulative rate, closed form
        if strategy == "linear":
            return r0 * min(t, dur) + (r1 - r0) * min(t, dur) ** 2 / (2 * dur) + r1 * max(0.0, t - dur)
        k = r1 / r0
        return r0 * dur / math.log(k) * (k ** (min(t, dur) / dur) - 1) + r1 * max(0.0, t - dur)

    offs = ramp_offsets(40, r0, r1, duration_s=dur, strategy=strategy, arrival="constant")
    assert [lam(t) for t in offs] == pytest.approx(list(range(40)), abs=1e-9)
    assert all(b > a for a, b in zip(offs, offs[1:]))
    # Constant start and end rates: plain constant arrivals.
    assert ramp_offsets(5, 3.0, 3.0, duration_s=1.0, strategy=strategy, arrival="constant") == pytest.approx([0, 1 / 3, 2 / 3, 1, 4 / 3])
    # Poisson ramp is seeded and follows the ramp: more arrivals per second at the end.
    p = ramp_offsets(2000, r0, r1, strategy=strategy, seed=3)
    assert p == ramp_offsets(2000, r0, r1, strategy=strategy, seed=3)
    half = p[-1] / 2
    assert sum(1 for t in p if t > half) > 1.5 * sum(1 for t in p if t <= half)


def test_ramp_run_respects_schedule_and_records_fields(fake) -> None:
    srv = fake(first_delay=0.0, itl_delay=0.0)
    cfg = BenchConfig(
        base_url=srv.url,
        num_prompts=6,
        output_len=1,
        input_len=2,
        arrival="constant",
        ramp_up_strategy="linear",
        ramp_up_start_rps=10.0,
        ramp_up_end_rps=30.0,
        sample_interval_s=0,
    )
    res = run(cfg)
    offs = ramp_offsets(6, 10.0, 30.0, strategy="linear", arrival="constant")
    # Never before its arrival; a late start is queue time the result reports (from the arrival).
    assert all(off - 1e-3 <= st <= off + q + 1e-9 for st, off, q in zip(res["start_times"], offs, res["queue_times"]))
    assert res["ramp_up_strategy"] == "linear" and res["ramp_up_end_rps"] == 30.0


def test_trace_replay_timing_prompts_and_scale(fake, tmp_path) -> None:
    srv = fake(first_delay=0.0, itl_delay=0.0)
    trace = _jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 100.5, "input_len": 7, "output_len": 2},
            {"timestamp": 100.0, "prompt": "first one here", "output_len": 3},
            {"timestamp": 100.2, "input_len": 5},
        ],
    )
    res = run(BenchConfig(base_url=srv.url, trace=str(trace), output_len=4, trace_time_scale=0.5, sample_interval_s=0))
    assert res["num_prompts"] == 3 and res["completed"] == 3 and res["arrival"] == "trace"
    for st, off, q in zip(res["start_times"], [0.0, 0.1, 0.25], res["queue_times"]):  # sorted by timestamp, x 0.5
        assert off - 1e-3 <= st <= off + q + 1e-9  # late only by the queue time the result reports
    prompts = [p["prompt"] for p in srv.payloads]
    assert prompts[0] == "first one here"
    assert [len(p.split()) for p in prompts[1:]] == [5, 7]
    assert [p["max_tokens"] for p in srv.payloads] == [3, 4, 2]
    assert res["output_lens"] == [3, 4, 2]
    # Same file, same seed: same synthetic prompts.
    assert load_trace(trace, 4, seed=0)[1] == load_trace(trace, 4, seed=0)[1]


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"timestamp": "soon", "prompt": "x"}', "'timestamp' must be a number"),
        ('{"timestamp": -1, "prompt": "x"}', "'timestamp' must be a number"),
        ('{"timestamp": 1}', "need 'prompt' (string) or 'input_len'"),
        ('{"timestamp": 1, "input_len": 3, "output_len": 0}', "'output_len' must be an integer >= 1"),
        ("[1, 2]", "expected a JSON object"),
        ("{oops", "invalid JSON"),
    ],
)
def test_bad_trace_file_one_line(tmp_path, capsys, line: str, needle: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "prompt": "ok"}\n' + line + "\n")
    rc = main(["--base-url", f"http://127.0.0.1:{_free_port()}", "--trace", str(p)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"error: bad trace file {p}: line 2: ") and needle in err[0], err


# ---------------------------------------------------------------------------------
# Sweeps
# ---------------------------------------------------------------------------------


def test_concurrency_sweep_cli_json_markdown_and_plots(fake, tmp_path, capsys) -> None:
    srv = fake(first_delay=0.02, itl_delay=0.002)
    out, md, plots = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "plots"
    rc = main(
        [
            "--base-url",
            srv.url,
            "--max-concurrency",
            "1,3",
            "--num-prompts",
            "6",
            "--output-len",
            "3",
            "--input-len",
            "4",
            "--label",
            "sw",
            "--result-json",
            str(out),
            "--markdown",
            str(md),
            "--plot-dir",
            str(plots),
            "--sample-interval",
            "0.05",
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["sweep"] == {"parameter": "max_concurrency", "levels": [1, 3]}
    assert [r["max_concurrency"] for r in doc["results"]] == [1, 3]
    assert [r["label"] for r in doc["results"]] == ["sw max_concurrency=1", "sw max_concurrency=3"]
    assert all(r["completed"] == 6 for r in doc["results"])
    assert len(srv.payloads) == 12
    # Same seed at every level: the same prompts (arrival order at the server may differ with concurrency).
    assert sorted(p["prompt"] for p in srv.payloads[:6]) == sorted(p["prompt"] for p in srv.payloads[6:])
    assert "| Metric | sw max_concurrency=1 | sw max_concurrency=3 |" in md.read_text()
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["sweep-latency-throughput.png", "sweep-tokens-per-joule.png", "timeline-0.png", "timeline-1.png"]
    assert all((plots / n).read_bytes()[:4] == b"\x89PNG" for n in names)


def test_rate_sweep_levels_and_invalid_level_runs_nothing(fake, capsys) -> None:
    from loadtests.sweep import run_sweep

    srv = fake(first_delay=0.0, itl_delay=0.0)
    cfg = BenchConfig(base_url=srv.url, num_prompts=3, output_len=1, input_len=2, sample_interval_s=0)
    sw = run_sweep(cfg, "request_rate", [50.0, math.inf])
    assert [r["request_rate"] for r in sw["results"]] == [50.0, "inf"]
    capsys.readouterr()  # the runs' own output (a zero-delay server can flag the client as the bottleneck)
    n = len(srv.payloads)
    rc = main(["--base-url", srv.url, "--request-rate", "5,-1", "--num-prompts", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "request_rate" in err[0] and "-1" in err[0]
    assert len(srv.payloads) == n  # the valid first level was not run either
    rc = main(["--base-url", srv.url, "--request-rate", "1,2", "--max-concurrency", "1,2"])
    assert rc == 2 and "one parameter at a time" in capsys.readouterr().err


# ---------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------


def _conv(human: str, gpt: str) -> dict[str, Any]:
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


def test_sharegpt_sampling_follows_vllm_rules(tmp_path) -> None:
    data = [
        _conv("one two three four five", "a b c d e f"),  # valid: 5 / 6
        _conv("too short", "a b c d e"),  # prompt < 4
        _conv("w " * 10, "x y"),  # output < 4 (unless fixed)
        {"conversations": [{"from": "human", "value": "only one turn here"}]},  # < 2 turns
        _conv("p " * 1100, "a b c d"),  # prompt > 1024
        _conv("q " * 1000, "o " * 1100),  # total > 2048
        _conv("alpha beta gamma delta", "r " * 9),  # valid: 4 / 9
        {"no": "conversations"},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = load_sharegpt(path, 5, seed=7)
    # Order: the entries with >= 2 turns, shuffled like vLLM's random.seed(seed); random.shuffle.
    kept = [e for e in data if isinstance(e.get("conversations"), list) and len(e["conversations"]) >= 2]
    random.Random(7).shuffle(kept)
    expect = [
        e["conversations"][0]["value"]
        for e in kept
        if e["conversations"][0]["value"] in ("one two three four five", "alpha beta gamma delta")
    ]
    assert [r.prompt for r in reqs] == [expect[i % 2] for i in range(5)]  # cycled to n
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(5, 6), (4, 9)}
    # A fixed output length skips the output check: the short-reply and the 1000-word entries are kept.
    fixed = load_sharegpt(path, 4, seed=7, output_len=2)
    assert {r.output_len for r in fixed} == {2}
    assert {r.prompt_len for r in fixed} == {5, 10, 1000, 4}
    assert sample_requests(f"sharegpt:{path}", 3, input_len=1, output_len=1, seed=7) == reqs[:3]


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{not json", "invalid JSON"),
        ('{"conversations": []}', "expected a JSON list"),
        (json.dumps([_conv("hi", "there")]), "no usable conversation"),
    ],
)
def test_sharegpt_bad_file_one_line(tmp_path, capsys, content: str, needle: str) -> None:
    p = tmp_path / "sg.json"
    p.write_text(content)
    rc = main(["--base-url", f"http://127.0.0.1:{_free_port()}", "--dataset", f"sharegpt:{p}", "--num-prompts", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: bad dataset file {p}: ") and needle in err[0], err


def test_prefix_repetition_groups_share_exact_prefixes() -> None:
    reqs = prefix_repetition_requests(11, prefix_len=6, suffix_len=3, num_prefixes=3, output_len=5, seed=4)
    assert len(reqs) == 11 and all(r.output_len == 5 and r.prompt_len == 9 for r in reqs)
    words = [r.prompt.split() for r in reqs]
    assert all(len(w) == 9 and set(w) <= set(WORDS) for w in words)
    prefixes = [tuple(w[:6]) for w in words]
    assert prefixes[:9] == [prefixes[0]] * 3 + [prefixes[3]] * 3 + [prefixes[6]] * 3  # 11 // 3 per group
    assert len({prefixes[0], prefixes[3], prefixes[6]}) == 3
    assert prefixes[9:] == prefixes[:2]  # remainder cycles
    assert len({tuple(w[6:]) for w in words[:9]}) == 9  # suffixes differ
    assert reqs == prefix_repetition_requests(11, 6, 3, 3, 5, seed=4)
    assert reqs != prefix_repetition_requests(11, 6, 3, 3, 5, seed=5)
    with pytest.raises(DatasetError, match=r"num_prompts \(2\) must be >= num_prefixes \(3\)"):
        prefix_repetition_requests(2, 6, 3, 3, 5)


def test_prompt_logprobs_reach_the_server_with_prefix_repetition(fake) -> None:
    srv = fake(first_delay=0.0, itl_delay=0.0)
    res = run(
        BenchConfig(
            base_url=srv.url,
            dataset="prefix-repetition",
            num_prompts=4,
            num_prefixes=2,
            prefix_len=8,
            input_len=2,
            output_len=1,
            prompt_logprobs=1,
            stream=False,
            sample_interval_s=0,
        )
    )
    assert res["completed"] == 4 and all(p["prompt_logprobs"] == 1 for p in srv.payloads)
    assert srv.payloads[0]["prompt"].split()[:8] == srv.payloads[1]["prompt"].split()[:8]


# ---------------------------------------------------------------------------------
# Steady state
# ---------------------------------------------------------------------------------


def _out(start: float, ttft: float, latency: float, ok: bool = True) -> RequestOutput:
    return RequestOutput(
        success=ok, start_time=start, ttft=ttft, latency=latency, output_tokens=2 if ok else 0, itl=[latency - ttft] if ok else []
    )


def test_steady_state_bounds_ml_energy_rule() -> None:
    # N = 8, B = 2: opens at the 2nd first token (t = 1.2), closes at the 5th finish (N - B - 1 = 5).
    outs = [
        _out(0.0, 1.0, 3.0),
        _out(0.0, 1.2, 4.0),
        _out(3.0, 0.5, 2.0),
        _out(4.0, 0.5, 2.0),
        _out(5.0, 0.5, 2.0),
        _out(6.0, 0.5, 2.0),
        _out(7.0, 0.5, 2.0),
        _out(8.0, 0.1, 0.2, ok=False),
    ]
    finishes = sorted(o.start_time + o.latency for o in outs)
    assert steady_state_bounds(outs, 2) == (1.2, finishes[4])
    assert steady_state_bounds(outs, 4) == (4.5, finishes[2])  # 4th first token; N - B - 1 = 3rd finish
    assert steady_state_bounds(outs, 7) == "needs at least B + 2 requests (N = 8, B = 7)"
    assert "never filled" in steady_state_bounds(outs[:5] + [_out(0, 0, 1, ok=False)] * 5, 6)
    # B = 5: the 5th first token (5.5 s) comes after the 2nd finish (N - B - 1 = 2): the batch never
    # reached the cap, which the reason says in those words.
    why = steady_state_bounds(outs, 5)
    assert why.startswith("5 requests in flight (the concurrency cap) were never reached")  # the caller adds "no steady state: "
    assert "(5 requests had a first token only at 5.500 s, 2 had already finished at 4.000 s)" in why


def test_steady_state_window_energy_and_throughput(fake) -> None:
    srv = fake(first_delay=0.01, itl_delay=0.01, sources=MEASURED)
    B, n, out_len = 3, 24, 10
    res = run(
        BenchConfig(
            base_url=srv.url,
            num_prompts=n,
            max_concurrency=B,
            output_len=out_len,
            input_len=3,
            sample_interval_s=0.05,
            metrics_interval_s=0.05,
        )
    )
    assert res["steady_state_batch"] == B
    # The raw ML.ENERGY instants, recomputed from the per-request arrays, bracket the snapped window.
    first = sorted(s + t for s, t in zip(res["start_times"], res["ttfts"]))
    done = sorted(s + e for s, e in zip(res["start_times"], res["latencies"]))
    a, b = res["steady_state_start_s"], res["steady_state_end_s"]
    assert first[B - 1] <= a < b <= done[n - B - 2]
    assert res["steady_state_duration_s"] == pytest.approx(b - a)
    # Tokens: counted from chunk arrival times over the same window.
    tok = 0
    for s, t, itl in zip(res["start_times"], res["ttfts"], res["itls"]):
        x = s + t
        tok += a < x <= b
        for g in itl:
            x += g
            tok += a < x <= b
    assert res["steady_state_output_tokens"] == tok
    assert res["steady_state_output_throughput"] == pytest.approx(tok / (b - a))
    # Energy: the server booked DECODE_J per token and PREFILL_J per request it received inside the
    # window. Client and server see a token at slightly different times, so at each edge up to B
    # in-flight requests may have one token (and one prefill) on the other side: 2 B of each.
    starts = sum(1 for s in res["start_times"] if a < s <= b)
    expected = tok * DECODE_J + starts * PREFILL_J
    assert abs(res["steady_state_gpu_energy_j"] - expected) <= 2 * B * (DECODE_J + PREFILL_J)
    assert res["steady_state_gpu_energy_per_output_token_j"] == res["steady_state_gpu_energy_j"] / tok
    assert res["steady_state_output_tokens_per_joule"] == tok / res["steady_state_gpu_energy_j"]
    assert res["steady_state_gpu_avg_power_w"] == pytest.approx(res["steady_state_gpu_energy_j"] / (b - a), rel=0.05)
    assert res["steady_state_energy_source"] == "measured"
    # A closed loop keeps B requests in flight in between (client-side gaps between requests are tiny).
    assert 0.8 * B <= res["steady_state_avg_concurrency"] <= B + 1e-9
    assert "shorter than 20 s" in res["steady_state_note"]
    # The whole run's energy is exact and includes the window's.
    assert res["gpu_energy_j"] == n * (PREFILL_J + out_len * DECODE_J) >= res["steady_state_gpu_energy_j"]


def test_counter_reset_mid_run_loses_one_interval_not_the_run(fake) -> None:
    # A server restart mid-run resets its energy counters; the whole-run energy must keep what was
    # booked before the reset (summed over readings) and say that a reset happened.
    import threading

    srv = fake(first_delay=0.01, itl_delay=0.01, sources=MEASURED)
    n, out_len = 24, 10
    per_request = PREFILL_J + out_len * DECODE_J

    def restart() -> None:
        while sum(srv.steps.values()) < n * out_len // 2:  # about half the work done
            time.sleep(0.005)
        srv.energy = dict.fromkeys(srv.energy, 0.0)

    t = threading.Thread(target=restart, daemon=True)
    t.start()
    res = run(
        BenchConfig(
            base_url=srv.url,
            num_prompts=n,
            max_concurrency=3,
            output_len=out_len,
            input_len=3,
            sample_interval_s=0.02,
            metrics_interval_s=0.02,
        )
    )
    t.join(5)
    booked = n * per_request
    # Lost: only the work between the last reading before the reset and the reset (one sample
    # interval of 3 streams; 6 requests' worth leaves room for a loaded CI host), never the first
    # half of the run (12 requests' worth).
    assert booked - 6 * per_request <= res["gpu_energy_j"] <= booked + 3.0 + 1e-9  # 3 J: the fake's idle counter
    assert "counter reset" in res["energy_note"]
    # The timeline's cumulative energy never goes down across the reset.
    e = [x for x in res["timeline"]["series"][0]["energy_j"] if x is not None]
    assert all(b >= a for a, b in zip(e, e[1:])) and e[-1] == pytest.approx(res["gpu_energy_j"])


def test_steady_state_absent_without_target_or_enough_requests(fake) -> None:
    srv = fake(first_delay=0.0, itl_delay=0.0)
    open_loop = run(BenchConfig(base_url=srv.url, num_prompts=4, request_rate=200.0, output_len=1, input_len=2))
    assert open_loop["steady_state_duration_s"] is None and "no target batch" in open_loop["steady_state_note"]
    few = run(BenchConfig(base_url=srv.url, num_prompts=3, max_concurrency=2, output_len=1, input_len=2))
    assert few["steady_state_gpu_energy_j"] is None and "at least B + 2" in few["steady_state_note"]
    # A window shorter than the sample period has throughput but no energy, and says so.
    short = run(BenchConfig(base_url=srv.url, num_prompts=6, max_concurrency=2, output_len=1, input_len=2, sample_interval_s=5))
    assert short["steady_state_output_tokens"] > 0 and short["steady_state_gpu_energy_j"] is None
    assert "shorter than two energy samples" in short["steady_state_note"]


# ---------------------------------------------------------------------------------
# Timeline and plots
# ---------------------------------------------------------------------------------


def test_timeline_phases_power_and_clock(fake, tmp_path, capsys) -> None:
    srv = fake(first_delay=0.02, itl_delay=0.01, idle_power_w=64.0)
    rc = main(
        [
            "--base-url",
            srv.url,
            "--num-prompts",
            "6",
            "--max-concurrency",
            "2",
            "--output-len",
            "12",
            "--input-len",
            "3",
            "--sample-interval",
            "0.05",
            "--metrics-interval",
            "0.05",
            "--plot-dir",
            str(tmp_path),
            "--result-json",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "r.json").read_text())
    (s,) = res["timeline"]["series"]
    assert s["name"] == srv.url and s["energy_source"] == "simulated" and s["gauge_source"] == "simulated"
    assert len(s["t_s"]) >= 4 and s["t_s"] == sorted(s["t_s"])
    assert s["energy_j"][0] == 0.0 and s["energy_j"][-1] == res["gpu_energy_j"]
    assert "decode" in s["phase"]  # busy intervals are dominated by decode energy
    assert set(s["sm_clock_mhz"]) <= {345.0, 1980.0, 1200.0} and 1200.0 in s["sm_clock_mhz"]
    # Interval power x interval length adds up to the counter.
    total = sum(p * (t1 - t0) for p, t0, t1 in zip(s["avg_power_w"][1:], s["t_s"], s["t_s"][1:]))
    assert total == pytest.approx(res["gpu_energy_j"], rel=1e-9)
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert srv.metrics_scrapes >= len(s["t_s"])


def test_sampling_can_be_turned_off(fake) -> None:
    srv = fake()
    res = run(BenchConfig(base_url=srv.url, num_prompts=2, output_len=2, input_len=2, sample_interval_s=0))
    assert len(res["timeline"]["series"][0]["t_s"]) == 2  # start and stop readings only
    assert srv.metrics_scrapes == 2


# ---------------------------------------------------------------------------------
# Error injection, timeouts, progress
# ---------------------------------------------------------------------------------


def test_stream_faults_are_counted_failures(fake, tmp_path) -> None:
    srv = fake(first_delay=0.0, itl_delay=0.0)
    ds = _jsonl(tmp_path / "d.jsonl", [{"prompt": p, "output_len": 3} for p in ("fine", "NODONE x", "BADUTF8 x", "ERRCHUNK x", "STALL x")])
    t0 = time.monotonic()
    # 2 s per request: the four that answer at once finish in that time even on a stalled CI host;
    # STALL goes silent for 30 s, so the bounds below catch a request timeout that never fires.
    res = run(BenchConfig(base_url=srv.url, num_prompts=5, dataset=f"jsonl:{ds}", request_timeout_s=2.0, sample_interval_s=0))
    assert time.monotonic() - t0 < 20
    assert res["completed"] == 1 and res["failed"] == 4 and res["timed_out"] is False
    e = res["errors"]
    assert e[0] == ""
    assert e[1].startswith("stream ended before [DONE]")
    assert e[2].startswith("UnicodeDecodeError")
    assert e[3].startswith("server error in stream") and "engine died" in e[3]
    assert e[4] == "request timeout after 2 s (--request-timeout)"
    assert 2.0 <= res["latencies"][4] < 12.0


def test_progress_bar_only_on_a_terminal(fake, monkeypatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    srv = fake(first_delay=0.0, itl_delay=0.0)
    for tty, progress, shown in ((True, True, True), (True, False, False), (False, True, False)):
        buf = Tty() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", buf)
        run(BenchConfig(base_url=srv.url, num_prompts=3, output_len=1, input_len=2, progress=progress, sample_interval_s=0))
        monkeypatch.undo()
        assert ("3/3" in buf.getvalue()) is shown, buf.getvalue()
        monkeypatch.setattr(
            __import__("loadtests.energy", fromlist=["x"]).NvmlEnergy, "open", classmethod(lambda cls, gpus: (None, "disabled in test"))
        )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--goodput", "ttft:100", "ttft:200"], "'ttft' given twice"),
        (["--goodput", "ttft:0"], "SLO ttft must be a positive number"),
        (["--goodput", "ttft:inf"], "SLO ttft must be a positive number"),
        (["--goodput", "latency:5"], "unknown SLO 'latency'"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"], "must be given together"),
        (
            ["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "2", "--request-rate", "3"],
            "conflicts with ramp_up_strategy",
        ),
        (["--trace", "t.jsonl", "--request-rate", "3"], "trace replay sets the arrival times"),
        (["--dataset", "sharegpt:"], "field 'dataset'"),
        (["--max-concurrency", "2,x"], "invalid --max-concurrency"),
        (["--base-url", "http://127.0.0.1:1", "http://127.0.0.1:1/v1"], "duplicate endpoint"),
        (["--sample-interval", "-1"], "sample_interval_s"),
        (["--no-stream", "--goodput", "tpot:50"], "tpot cannot be judged without streaming"),
        (["--dataset", "sharegpt:/nonexistent.json", "--tokenizer", "/nonexistent-tokenizer"], "cannot load tokenizer"),
    ],
)
def test_bad_options_one_line_exit_2(capsys, argv: list[str], needle: str) -> None:
    rc = main(["--num-prompts", "1", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert "\n" not in err[0]


def test_config_cross_field_errors_name_fields() -> None:
    with pytest.raises(ConfigError, match=r"^invalid config: ramp_up_duration_s needs ramp_up_strategy$"):
        BenchConfig(ramp_up_duration_s=3.0)
    with pytest.raises(ConfigError, match="trace replay carries its own prompts"):
        BenchConfig(trace="t.jsonl", dataset="prefix-repetition")


# ---------------------------------------------------------------------------------
# Output fields
# ---------------------------------------------------------------------------------


def _vllm_serve_result_keys() -> set[str]:
    """Keys of the generation result dict in vllm/benchmarks/serve.py (read as text, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM not installed")
    src = (Path(next(iter(spec.submodule_search_locations))) / "benchmarks" / "serve.py").read_text()
    block = src[src.index("result: dict[str, Any]\n") :]
    block = block[: block.index("else:")]
    return set(re.findall(r'"([a-z_0-9]+)":', block))


def test_result_fields_match_vllm_bench_serve(fake) -> None:
    srv = fake(first_delay=0.0, itl_delay=0.0)
    res = run(
        BenchConfig(base_url=srv.url, num_prompts=3, max_concurrency=2, output_len=2, input_len=2, label="x", goodput={"ttft": 1000.0})
    )
    vllm_keys = _vllm_serve_result_keys()
    assert {"duration", "completed", "ttfts", "latencies", "max_concurrent_requests"} <= vllm_keys  # parser sanity
    # Left out on purpose: generated text (size) and rtfx (speech models only).
    assert vllm_keys - set(res) == {"generated_texts", "rtfx"}
    for k in (
        "date",
        "endpoint_type",
        "backend",
        "label",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "std_e2el_ms",
        "gpu_energy_j",
        "gpu_avg_power_w",
        "gpu_energy_per_output_token_j",
        "gpu_energy_duration_s",
    ):
        assert k in res, k
    assert res["gpu_energy_duration_s"] == res["energy_window_s"]
    json.dumps(res, allow_nan=False)
    assert statistics.fmean(res["latencies"]) * 1000 == pytest.approx(res["mean_e2el_ms"])


def test_sharegpt_selection_equals_vllm_bench_serve(tmp_path) -> None:
    """Same file, seed and tokenizer: the same prompts, lengths and order as vLLM's ShareGPTDataset."""
    pytest.importorskip("vllm")
    import types

    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    rng = random.Random(1)
    data = [
        {
            "id": i,
            "conversations": [
                {
                    "from": "human" if k % 2 == 0 else "gpt",
                    "value": " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 3, 5, 50, 900, 1100]))),
                }
                for k in range(rng.choice([1, 2, 3]))
            ],
        }
        for i in range(300)
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))

    class WordTokenizer:  # the same length function on both sides
        def __call__(self, text: str) -> Any:
            return types.SimpleNamespace(input_ids=text.split())

    for seed, out_len in ((0, None), (5, 16)):
        theirs = datasets.ShareGPTDataset(dataset_path=str(path), random_seed=seed).sample(
            WordTokenizer(), 60, output_len=out_len, no_oversample=True
        )
        ours = load_sharegpt(path, len(theirs), seed=seed, output_len=out_len)
        assert len(theirs) == 60
        assert [(s.prompt, s.prompt_len, s.expected_output_len) for s in theirs] == [(r.prompt, r.prompt_len, r.output_len) for r in ours]
