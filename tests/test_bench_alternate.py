"""Fast alternation (benchmarks/h200_alternate.py), its record (analyze_h200 --alt), the cold-cache
hook benchmark and the NVML interference record: the arithmetic that turns calls into ratios."""

from __future__ import annotations

import gzip
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import analyze_h200  # noqa: E402
import h200_alternate as alt  # noqa: E402
import h200_nvml_interference as nx  # noqa: E402


def calls_for(cycles: int, speed: dict[str, float], energy_per_token: dict[str, float], drift=lambda c: 1.0) -> list[dict]:
    """Each cycle: every arm once; an arm's tokens/s = its speed x the cycle's drift."""
    out = []
    for c in range(cycles):
        for arm, v in speed.items():
            tokens = 4096
            s = tokens / (v * drift(c))
            out.append({"cycle": c, "load": 8, "arm": arm, "s": s, "tokens": tokens, "energy_j": tokens * energy_per_token[arm]})
    return out


def test_ratios_are_per_cycle_so_drift_between_cycles_cancels() -> None:
    # The host's speed swings by 2x between cycles; the plugin is 3 % slower within every cycle.
    calls = calls_for(6, {"stock": 1000.0, "twin": 1000.0, "full": 970.0}, {"stock": 0.05, "twin": 0.05, "full": 0.0515},
                      drift=lambda c: 1.0 if c % 2 else 2.0)
    s = alt.summarize(calls, ["stock", "twin", "full"], [8])
    assert s["8:full"]["cycles"] == 6
    assert s["8:full"]["throughput_ratio"]["median"] == pytest.approx(0.97)
    assert s["8:full"]["throughput_ratio"]["sd"] == pytest.approx(0.0, abs=1e-12)
    assert s["8:full"]["j_per_token_ratio"]["median"] == pytest.approx(1.03)
    assert s["8:twin"]["throughput_ratio"]["median"] == pytest.approx(1.0)
    assert "8:stock" not in s


def test_a_cycle_without_its_stock_call_or_tokens_is_left_out() -> None:
    calls = calls_for(3, {"stock": 1000.0, "full": 900.0}, {"stock": 0.05, "full": 0.05})
    calls = [c for c in calls if not (c["cycle"] == 1 and c["arm"] == "stock")]
    for c in calls:
        if c["cycle"] == 2 and c["arm"] == "full":
            c["tokens"] = 0  # a call that returned nothing
    s = alt.summarize(calls, ["stock", "full"], [8])
    assert s["8:full"]["cycles"] == 1  # cycle 0 only: cycle 1 lacks its stock call, cycle 2's full call has no tokens
    assert s["8:full"]["throughput_ratio"]["median"] == pytest.approx(0.9)


def test_stats_interval_and_geomean() -> None:
    r = alt.stats([0.9, 1.0, 1.1])
    assert r["median"] == pytest.approx(1.0) and r["mean"] == pytest.approx(1.0)
    assert r["sd"] == pytest.approx(0.1)
    half = 4.303 * 0.1 / 3 ** 0.5  # t(0.975, 2 df)
    assert r["ci95"] == pytest.approx([1 - half, 1 + half])
    assert r["geomean"] == pytest.approx((0.9 * 1.0 * 1.1) ** (1 / 3))
    assert alt.stats([]) == {"n": 0}
    # The exact t quantile for the sample size (n = 11: 10 degrees of freedom, 2.228), as loadtests.ab.
    r11 = alt.stats([1.0 + 0.01 * (i % 3) for i in range(11)])
    assert (r11["ci95"][1] - r11["mean"]) == pytest.approx(2.228 * r11["sd"] / 11 ** 0.5)


def test_prompts_are_the_same_for_every_arm_and_new_every_cycle() -> None:
    a, b = alt.prompts_for(3, 8, 16, 1000), alt.prompts_for(3, 8, 16, 1000)
    assert a == b and len(a) == 8 and all(len(p) == 16 for p in a)
    assert all(100 <= t < 1000 for p in a for t in p)
    assert alt.prompts_for(4, 8, 16, 1000) != a


def test_arm_configs() -> None:
    assert alt.arm_config("stock", "/s") is None and alt.arm_config("twin", "/s") is None and alt.arm_config("inert", "/s") is None
    bare = alt.arm_config("bare", "/s")["powersave"]
    assert bare["energy"]["meter"] == "off" and bare["chunking"]["table"] == []
    full = alt.arm_config("full", "/s")["powersave"]
    assert full["energy"]["meter"] == "nvml" and full["chunking"]["table"] == alt.NEVER_CHUNK and full["stats_dir"] == "/s"


def test_hook_summary_per_step_and_share() -> None:
    calls = [{"cycle": 0, "load": 8, "arm": "full", "s": 0.2, "tokens": 800,
              "hooks": {"on_step_start": [100, 2_000_000], "on_step_end": [100, 500_000], "publisher.publish": [2, 2_000_000]}},
             {"cycle": 1, "load": 8, "arm": "full", "s": 0.2, "tokens": 800,
              "hooks": {"on_step_start": [100, 2_000_000], "on_step_end": [100, 500_000]}}]
    h = alt.hook_summary(calls)["8:full"]
    assert h["steps"] == 200 and h["wall_ms_per_step"] == pytest.approx(2.0)
    assert h["us_per_step"]["on_step_start"] == pytest.approx(20.0) and h["us_per_step"]["on_step_end"] == pytest.approx(5.0)
    assert h["engine_thread_us_per_step"] == pytest.approx(25.0)  # the publisher's work is not on the step's path
    assert h["engine_thread_share"] == pytest.approx(25.0 / 2000.0)


def _restore_hooks(monkeypatch) -> None:
    """time_hooks / time_parts replace module and class attributes: restored after the test."""
    import vllm_powersave.runtime as rt
    from vllm_powersave import vllm_compat
    from vllm_powersave.chunking.policy import ChunkPolicy
    from vllm_powersave.clocks.controller import ClockController

    for name in ("on_step_start", "on_step_end", "on_arrival", "chunked_head", "head_chunks"):
        monkeypatch.setattr(rt, name, getattr(rt, name))
    for name in ("publish", "_flush_trace", "_flush_requests", "drain_steps"):
        monkeypatch.setattr(rt.WorkerRuntime, name, getattr(rt.WorkerRuntime, name))
    for owner, name in ((vllm_compat, "step_info"), (vllm_compat, "decode_step_tokens"), (rt.RegimeFilter, "phase"), (ClockController, "on_phase"), (ChunkPolicy, "take")):
        monkeypatch.setattr(owner, name, getattr(owner, name))


def test_time_parts_times_the_pieces_inside_the_hooks_without_counting_them_twice(monkeypatch, tmp_path) -> None:
    torch = pytest.importorskip("torch")
    import vllm_powersave.runtime as rt
    from vllm_powersave import vllm_compat
    from vllm_powersave.chunking.policy import ChunkPolicy
    from vllm_powersave.settings import PowersaveSettings

    _restore_hooks(monkeypatch)
    acc = alt.time_hooks(parts=True)
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cpu", "device_index": None})
    s = PowersaveSettings.model_validate({"stats_dir": str(tmp_path), "energy": {"meter": "off"},
                                          "chunking": {"table": [{"min_rows": 1000, "chunks": 2}]},
                                          "clocks": {"min_dwell_ms": 0, "presets": {"decode": {"sm_clock_mhz": 1200}}}})
    monkeypatch.setattr(rt, "_POLICY", ChunkPolicy(s.chunking))
    runtime = rt.WorkerRuntime(object(), s)
    monkeypatch.setattr(rt, "_RUNTIME", runtime)
    try:
        so = SimpleNamespace(scheduled_new_reqs=[], scheduled_spec_decode_tokens={}, total_num_scheduled_tokens=2, finished_req_ids=set(),
                             scheduled_cached_reqs=SimpleNamespace(req_ids=["a", "b"], num_computed_tokens=[5, 5], num_output_tokens=[1, 1]),
                             num_scheduled_tokens={"a": 1, "b": 1})
        for _ in range(3):
            rt.on_step_start(None, so)
            assert rt.head_chunks(torch.ones(2, 4)) == 0
            rt.on_step_end(None)
    finally:
        runtime.close()
    for name in ("part.decode_step_tokens", "part.torch_dim", "part.torch_shape"):
        assert acc[name][0] == 3, name
    # Decode-only steps and one-chunk LM-head calls: the fast paths call none of these, and the
    # controller only for the first step's switch to the decode preset.
    assert not {"part.step_info", "part.regime", "part.policy_take"} & set(acc) and acc["part.on_phase"][0] == 1
    calls = [{"cycle": 0, "load": 2, "arm": "full", "s": 0.01, "tokens": 6, "hooks": {k: list(v) for k, v in acc.items()}}]
    h = alt.hook_summary(calls)["2:full"]
    direct = sum(acc[k][1] for k in ("on_step_start", "on_step_end", "head_chunks")) / 1e3 / 3
    assert h["engine_thread_us_per_step"] == pytest.approx(direct)  # the parts are inside these, not added again


def test_time_hooks_wraps_the_entry_points_and_excludes_the_heads_own_time(monkeypatch) -> None:
    import vllm_powersave.runtime as rt

    _restore_hooks(monkeypatch)

    def slow_head(h):
        time.sleep(0.02)
        return h

    monkeypatch.setattr(rt, "chunked_head", lambda head, h: head(h))
    acc = alt.time_hooks()
    assert rt.chunked_head(slow_head, 5) == 5
    n, ns = acc["chunked_head"]
    assert n == 1 and ns < 5_000_000  # the 20 ms inside vLLM's head is not the hook's


def test_analyze_alt_record_and_lines(tmp_path) -> None:
    calls = calls_for(4, {"stock": 1000.0, "twin": 1010.0, "full": 980.0}, {"stock": 0.05, "twin": 0.05, "full": 0.051})
    raw = {"mode": "offline", "shape": "qwen2.5-0.5b", "date_utc": "2026-11-30T00:00:00Z", "arms": ["stock", "twin", "full"], "loads": [8],
           "method": {"input_len": 128, "output_len": 512, "arm_cpus": list(range(12)), "client_cpus": [12, 13, 14, 15], "time_hooks": False},
           "calls": calls, "startup_s": 100.0}
    r = analyze_h200.analyze_alt(raw, "t")
    assert r["summary"]["8:full"]["throughput_ratio"]["median"] == pytest.approx(0.98)
    assert r["median_tok_per_s"]["8:twin"] == pytest.approx(1010.0)
    text = "\n".join(analyze_h200.alt_lines(r))
    assert "| 8 | full | 4 | 0.980 (0.980, 0.980–0.980) | 1.020" in text and "| 8 | twin | 4 | 1.010" in text
    # Against both stock processes: 980 / sqrt(1000 x 1010).
    assert r["throughput_vs_both_controls"]["8:full"]["median"] == pytest.approx(980 / (1000 * 1010) ** 0.5)


def test_alt_hook_table_counts_publish_once() -> None:
    """publish() contains the trace and request flushes, which are timed inside it as well."""
    calls = [{"cycle": 0, "load": 8, "arm": "full", "s": 0.2, "tokens": 800,
              "hooks": {"on_step_start": [100, 2_000_000], "on_step_end": [100, 500_000], "chunked_head": [100, 900_000],
                        "publisher.publish": [2, 2_000_000], "publisher._flush_trace": [2, 600_000], "publisher._flush_requests": [2, 100_000]}}]
    raw = {"mode": "offline", "shape": "s", "date_utc": "d", "arms": ["stock", "full"], "loads": [8],
           "method": {"input_len": 1, "output_len": 1, "time_hooks": True}, "calls": calls}
    text = "\n".join(analyze_h200.alt_lines(analyze_h200.analyze_alt(raw, "t")))
    # 20 + 5 + 9 us per step on the engine thread; publish 1.00 ms per call (not 1.35 with the flushes again).
    assert "| 8 | full | 100 | 2.000 | 20.0 | 5.0 | 9.0 | - | 34.0 (1.70 %) | 1.00 (0.20 %) |" in text


def test_nvml_reader_loop_rate_and_latencies() -> None:
    class N:
        def nvmlDeviceGetTotalEnergyConsumption(self, h):
            time.sleep(0.002)
            return 1

        def nvmlDeviceGetPowerUsage(self, h):
            return 100_000

    stop, lat = threading.Event(), {}
    t = threading.Thread(target=nx.reader_loop, args=(N(), None, ("energy", "power"), 100.0, stop, lat))
    t.start()
    time.sleep(0.5)
    stop.set()
    t.join()
    # ~100 Hz for 0.5 s less the 2 ms reads; wide bounds: a loaded CI machine delays the sleeps.
    assert 15 <= len(lat["energy"]) <= 55 and len(lat["power"]) == len(lat["energy"])
    assert nx.summary(lat["energy"])["p50"] >= 2.0 and nx.summary(lat["power"])["p50"] < 1.0


def test_nvml_record_ratios_per_round(tmp_path) -> None:
    rounds = [{"order": ["none", "tick20"], "results": {"none": {"steps_per_s": 100.0, "nvml_ms": {}},
                                                        "tick20": {"steps_per_s": 95.0, "nvml_ms": {"energy": {"p50": 3.0, "p99": 9.0}}}}},
              {"order": ["tick20", "none"], "results": {"none": {"steps_per_s": 200.0, "nvml_ms": {}},
                                                        "tick20": {"steps_per_s": 180.0, "nvml_ms": {"energy": {"p50": 3.0, "p99": 9.0}}}}}]
    raw = {"when": "2026-11-30T00:00:00Z", "device": "NVIDIA H200", "driver": "580", "torch": "2.11", "gpu": 0, "other_gpu": None,
           "host_ms": 1.0, "window_s": 6.0, "nvml_quiet_ms": {"energy": {"p50": 3.0, "p99": 14.0}}, "rounds": rounds}
    r = nx.ratios(raw)
    assert r["tick20"]["per_round"] == pytest.approx([0.95, 0.9]) and r["tick20"]["median"] == pytest.approx(0.925)
    p = tmp_path / "raw.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(raw, f)
    assert nx.report(p, tmp_path) == 0
    md = (tmp_path / "h200-nvml-interference.md").read_text()
    assert "| tick20 | 0.925 | 0.950, 0.900 | energy 3.000 / 9.000 |" in md and "(last round)" in md
    assert json.loads((tmp_path / "h200-nvml-interference.json").read_text())["ratios"]["tick20"]["median"] == pytest.approx(0.925)


def test_base_arms_run_the_earlier_build_with_the_same_settings() -> None:
    import argparse

    ns = argparse.Namespace(stock_site="/s", plugin_site="/p", base_site="/b")
    assert alt.arm_site("stock", ns) == "/s" and alt.arm_site("twin", ns) == "/s"
    assert alt.arm_site("full", ns) == "/p:/s" and alt.arm_site("full-base", ns) == "/b:/s"
    assert alt.arm_config("full-base", "/x") == alt.arm_config("full", "/x")
    assert alt.arm_config("bare-base", "/x") == alt.arm_config("bare", "/x")
