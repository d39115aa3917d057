"""Part (b2c) of the harness-overhead record: both tools at the same time on one server. The window/overlap
arithmetic, the summary with low-overlap pairs flagged, the Markdown section and the merge into the record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness_overhead as ho  # noqa: E402


def test_overlap_is_intersection_over_union_and_skews_are_ours_minus_vllm() -> None:
    o = ho.overlap((12.0, 52.0), (10.0, 50.0))
    assert o["overlap_fraction"] == pytest.approx(38 / 42)
    assert o["ours_overlapped"] == pytest.approx(38 / 40) and o["vllm_overlapped"] == pytest.approx(38 / 40)
    assert o["start_skew_s"] == pytest.approx(2.0) and o["end_skew_s"] == pytest.approx(2.0)
    # One window inside the other: the inner one is fully overlapped, the union is the outer one.
    inner = ho.overlap((0.0, 100.0), (5.0, 95.0))
    assert inner["overlap_fraction"] == pytest.approx(0.9) and inner["vllm_overlapped"] == pytest.approx(1.0)
    assert inner["start_skew_s"] == pytest.approx(-5.0) and inner["end_skew_s"] == pytest.approx(5.0)
    assert ho.overlap((0.0, 1.0), (2.0, 3.0))["overlap_fraction"] == 0.0


def test_run_window_from_per_request_times_relative_or_absolute() -> None:
    r = {"start_times": [0.5, 0.0, 1.0], "latencies": [3.0, 1.0, 1.5]}
    assert ho.run_window(r) == pytest.approx((0.0, 3.5))
    assert ho.run_window(r, t0=100.0) == pytest.approx((100.0, 103.5))
    with pytest.raises(ValueError, match="--save-detailed"):
        ho.run_window({"latencies": [1.0]})


def test_cpu_inside_a_window_is_interpolated_between_samples() -> None:
    samples = [(0.0, 0.0), (1.0, 2.0), (3.0, 2.5)]
    assert ho._cpu_between(samples, 0.5, 2.0) == pytest.approx(2.25 - 1.0)
    assert ho._cpu_between(samples, 0.5, 4.0) is None  # the last sample ends before the window does


def _pair(tput: float, ttft: float, win_ours: tuple[float, float], win_vllm: tuple[float, float]) -> dict:
    ov = ho.overlap(win_ours, win_vllm)

    def tool(t: float, f: float, w: tuple[float, float]) -> dict:
        return {"output_throughput": t, "median_ttft_ms": f, "mean_ttft_ms": 1.1 * f, "median_tpot_ms": 3.0, "total_input_tokens": 100,
                "client_cpu_s": 9.0, "window_s": list(w), "window_cpu_s": 0.1 * (w[1] - w[0]), "duration": w[1] - w[0] + 0.01}

    return {"first": "ours" if win_ours[0] <= win_vllm[0] else "vllm", **ov,
            "ours": tool(1000.0 * tput, 20.0 * ttft, win_ours), "vllm": tool(1000.0, 20.0, win_vllm),
            "output_throughput_ratio": tput, "median_ttft_ratio": ttft, "median_tpot_ratio": 1.0}


PAIRS = [
    _pair(1.01, 0.99, (10.0, 50.0), (10.5, 50.5)),  # overlap 39.5 / 40.5
    _pair(1.05, 0.90, (10.0, 50.0), (16.0, 56.0)),  # overlap 34 / 46 < 0.9: flagged
    _pair(0.99, 1.01, (10.2, 50.0), (10.0, 50.0)),
    _pair(1.00, 1.00, (10.0, 50.0), (10.0, 50.0)),
]


def test_summary_flags_low_overlap_and_gives_the_means_without_those_pairs() -> None:
    s = ho.summarize_concurrent(PAIRS, {})
    ov = s["overlap"]
    assert ov["per_pair"][1] == pytest.approx(34 / 46)
    assert ov["flagged_pairs"] == [2]
    assert ov["min"] == pytest.approx(34 / 46)
    assert ov["median_abs_start_skew_s"] == pytest.approx(0.35)  # |skews| 0.5, 6, 0.2, 0
    assert s["output_throughput"]["mean"] == pytest.approx((1.01 + 1.05 + 0.99 + 1.00) / 4)
    assert s["median_ttft"]["mean"] == pytest.approx((0.99 + 0.90 + 1.01 + 1.00) / 4)
    assert ov["without_flagged"]["pairs"] == 3
    assert ov["without_flagged"]["output_throughput_ratio"] == pytest.approx(1.0)
    assert s["server_output_throughput_per_pair"] == pytest.approx([2010.0, 2050.0, 1990.0, 2000.0])
    assert s["by_first"]["ours"]["pairs"] == 3 and s["by_first"]["vllm"]["pairs"] == 1
    # Every pair well overlapped: nothing flagged, no subset.
    good = ho.summarize_concurrent([PAIRS[0], PAIRS[3]], {})
    assert good["overlap"]["flagged_pairs"] == [] and good["overlap"]["without_flagged"] is None


CONFIG = {"n_per_tool": 768, "conc_per_tool": 4, "total_conc": 8, "output_len": 64, "vllm_version": "0.32.0",
          "server": "vllm serve M --no-enable-prefix-caching", "prefix_caching": False, "dataset": "synthetic",
          "launch": "vllm bench first", "planned_start_skew_s": "+-0", "overlap": "IoU", "warmups": "2 pairs",
          "server_cpus": [0], "client_cpus": [1], "server_env": {"OMP_NUM_THREADS": "1"}, "engine_core_nice": 10}


def _doc() -> dict:
    fake = {"config": {"harness_cpu": 0, "server_cpu": 1, "max_concurrency": 64, "num_prompts": 10}, "runs": [],
            "harness_cpu_utilization_median": 0.5, "harness_cpu_ms_per_request_median": 0.5,
            "server_cpu_utilization_median": 0.5, "req_per_s_median": 100.0}
    return {"date_utc": "d", "host": {"machine": "x86_64", "cpus": 2, "python": "3.11", "aiohttp": "3",
                                      "loadavg_1m_at_start": 0.1, "loadavg_1m_at_end": 0.2},
            "fake_server": fake, "fake_server_req_per_s_one_core": 2000.0, "fake_server_observed_req_per_s_median": 100.0}


def test_markdown_renders_the_concurrent_section_with_flags_and_verdict(tmp_path) -> None:
    doc = _doc()
    doc["vs_vllm_bench_concurrent"] = {**ho.summarize_concurrent(PAIRS, CONFIG), "date_utc": "2026-11-30T14:00:00Z",
                                       "loadavg_1m_at_start": 0.3, "loadavg_1m_at_end": 1.9, "pairs_planned": 4}
    path = tmp_path / "r.md"
    ho.write_md(doc, path)
    md = path.read_text()
    assert "## (b2c) loadtests vs `vllm bench serve` at the same time on the same CPU vLLM server (concurrent split)" in md
    assert "| 2 | ours | -6.00 | -6.00 | 0.739 (low) | 1050.0 | 1000.0 | 1.050 | 18.0 | 20.0 | 0.900 | 9.0 / 9.0 |" in md
    assert "pairs below 0.9: 2 (without them, 3 pairs: mean throughput ratio 1.000, TTFT ratio 1.000)." in md
    assert "4 of 4 planned pairs" in md and "--no-enable-prefix-caching" in md
    assert "ours 10 %, vllm bench 10 % of the shared client core" in md
    assert "median: ours +0.010 s, vllm bench +0.010 s; ours' duration minus vllm bench's for the same requests, median +0.000 s" in md
    assert "planned start skew none (aimed at both starting together)" in md
    assert "- Mean TTFT ratio (whole distribution, not the verdict's median): mean 0.975, range 0.900-1.010, 95 % CI" in md
    # Skews -0.5, -6, +0.2, 0 s against throughput ratios 1.01, 1.05, 0.99, 1.00: the pair where ours started
    # 6 s early has the highest ratio, so the fit is steeply negative.
    sk, tr = [-0.5, -6.0, 0.2, 0.0], [1.01, 1.05, 0.99, 1.00]
    slope = float(np.polyfit(sk, tr, 1)[0])
    assert f"throughput ratio r = {np.corrcoef(sk, tr)[0, 1]:+.2f}, slope {slope:+.4f} per s" in md
    assert slope < -0.005
    # Pairs 2 (1.050 / 0.900) are outside 2 %, and 4 pairs leave a wide interval: the target is not met.
    assert "1 of 4 pairs outside 2 % of 1: 2 (1.050)." in md
    assert "**Target (same within 2 %): NOT met" in md
    # No section in the record, none in the Markdown.
    ho.write_md(_doc(), path)
    assert "(b2c)" not in path.read_text()


@pytest.mark.parametrize("rate, trust_env", [(None, False), (12.0, False), (12.0, True)])
def test_only_b2_concurrent_replaces_its_section_and_keeps_the_rest(tmp_path, monkeypatch, rate, trust_env) -> None:
    out = tmp_path / "harness-overhead.json"
    key = ("vs_vllm_bench_concurrent" if rate is None else
           "vs_vllm_bench_concurrent_poisson_trust_env" if trust_env else "vs_vllm_bench_concurrent_poisson")
    doc = _doc()
    doc[key] = {"stale": True}
    doc["vs_vllm_bench_gpu_marker"] = 1
    out.write_text(json.dumps(doc))
    seen = {}
    config = CONFIG if rate is None else {**CONFIG, "rate_per_tool_req_s": rate, "arrivals": f"Poisson, {rate:g} requests/s per tool",
                                           "ours_trust_env": trust_env}

    def fake_part(pairs, n, conc, out_len, workdir, pin, warmup_pairs, stagger_s, on_summary, deadline, rate, ours_trust_env=False):
        seen.update(pairs=pairs, n=n, conc=conc, warmup_pairs=warmup_pairs, deadline=deadline, rate=rate)
        assert ours_trust_env is trust_env
        section = {**ho.summarize_concurrent(PAIRS[:1], config), "pairs_planned": pairs}
        on_summary(section)  # a partial save lands in the file too
        assert "stale" not in json.loads(out.read_text())[key]
        return {**ho.summarize_concurrent(PAIRS, config), "pairs_planned": pairs}

    monkeypatch.setattr(ho, "vllm_concurrent_part", fake_part)
    argv = ["harness_overhead.py", "--only-b2-concurrent", "--pairs", "4", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv + ([] if rate is None else ["--concurrent-rate", str(rate)])
                        + (["--concurrent-ours-trust-env"] if trust_env else []))
    assert ho.main() == 0
    assert seen == {"pairs": 4, "n": ho.CONCURRENT_REQUESTS, "conc": 4, "warmup_pairs": 2, "deadline": None, "rate": rate}
    rec = json.loads(out.read_text())
    assert rec["vs_vllm_bench_gpu_marker"] == 1
    assert rec[key]["overlap"]["flagged_pairs"] == [2]
    md = out.with_suffix(".md").read_text()
    if rate is None:
        assert "## (b2c)" in md and "## (b2p)" not in md
    elif trust_env:
        assert "## (b2e) (b2p) again, ours with `--trust-env`" in md and "## (b2p)" not in md
        assert "Poisson, 12 requests/s per tool" in md
    else:
        assert "## (b2p) the same concurrent split with Poisson arrivals" in md
        assert "Poisson, 12 requests/s per tool" in md


def test_tool_commands_carry_poisson_arrivals_and_a_per_pair_seed(tmp_path) -> None:
    ours, vllm, _ = ho._tool_cmds("http://x", tmp_path, tmp_path / "d.json", 8, 64, 16, tmp_path, rate=12.0)
    for cmd in (ours, vllm):
        i = cmd.index("--request-rate")
        assert cmd[i + 1:i + 4] == ["12", "--burstiness", "1"]
        assert ho._with_seed(cmd, 1003)[cmd.index("--seed") + 1] == "1003"
    closed, _, _ = ho._tool_cmds("http://x", tmp_path, tmp_path / "d.json", 8, 64, 16, tmp_path)
    assert "--request-rate" not in closed


def test_planned_skew_reads_the_pairs() -> None:
    assert ho._planned_skew([{"planned_start_skew_s": -0.0}, {"planned_start_skew_s": 0.0}]).startswith("none")
    assert ho._planned_skew([{"planned_start_skew_s": -0.5}, {"planned_start_skew_s": 0.5}]) == \
        "+-0.5 s (ours ahead in pairs 1, 3, ..., vllm bench in 2, 4, ...)"


def test_ours_can_run_with_vllm_bench_session_setting(tmp_path) -> None:
    ours, vllm, _ = ho._tool_cmds("http://x", tmp_path, tmp_path / "d.json", 8, 64, 16, tmp_path, rate=12.0, ours_trust_env=True)
    assert "--trust-env" in ours and "--trust-env" not in vllm
    assert "--trust-env" not in ho._tool_cmds("http://x", tmp_path, tmp_path / "d.json", 8, 64, 16, tmp_path)[0]
