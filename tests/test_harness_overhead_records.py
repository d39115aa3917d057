"""Rebuilding the harness-overhead record from a device run whose JSON was lost (only its log came back), and its 2 % verdict."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness_overhead as ho  # noqa: E402

LOG = """[ab + 123.6s] server stock healthy
[gpu] warm-up ours: 10361.1 tok/s, TTFT p50 144.4 ms
[gpu] pair 0 ours: 10000.0 tok/s, TTFT p50 110.0 ms, TPOT p50 4.00 ms, in/out tokens 99933/128000
[gpu] pair 0 vllm: 12500.0 tok/s, TTFT p50 100.0 ms, TPOT p50 3.20 ms, in/out tokens 99933/128000
[gpu] pair 1 ours: 11000.0 tok/s, TTFT p50 120.0 ms, TPOT p50 3.90 ms, in/out tokens 99933/128000
[gpu] pair 1 vllm: 10000.0 tok/s, TTFT p50 150.0 ms, TPOT p50 3.00 ms, in/out tokens 99000/128000
[gpu] pair 2 ours: 11100.0 tok/s, TTFT p50 114.0 ms, TPOT p50 3.94 ms, in/out tokens 99933/128000
rc=124
"""
CONFIG = {"n": 2000, "conc": 64, "output_len": 64, "server": "stock", "order": "A B", "warmups": "1",
          "date_utc": "2026-11-30T11:05Z", "device": "H200", "vllm_version": "0.25.0"}


def test_complete_pairs_come_back_from_the_log_and_a_half_pair_is_dropped() -> None:
    runs = ho.runs_from_log(LOG)
    assert len(runs) == 2  # pair 2 has no vllm line: the run was killed inside it
    assert runs[0]["output_throughput_ratio"] == pytest.approx(0.8)
    assert runs[0]["median_ttft_ratio"] == pytest.approx(1.1)
    assert runs[1]["median_tpot_ratio"] == pytest.approx(1.3)
    assert runs[1]["vllm"]["total_input_tokens"] == 99000


def test_a_log_without_a_complete_pair_is_refused() -> None:
    with pytest.raises(ValueError, match="no complete pair"):
        ho.runs_from_log(LOG.split("[gpu] pair 0 vllm")[0])


def test_merge_from_a_gzipped_log_records_the_source_and_renders(tmp_path) -> None:
    src = tmp_path / "bench.log.gz"
    with gzip.open(src, "wt") as f:
        f.write(LOG)
    doc: dict = {}
    with pytest.raises(ValueError, match="--gpu-config"):
        ho.merge_gpu(doc, src, None, [])
    ho.merge_gpu(doc, src, dict(CONFIG), ["host shared"])
    g = doc["vs_vllm_bench_gpu"]
    assert g["output_throughput"]["per_pair"] == pytest.approx([0.8, 1.1])
    assert g["output_throughput_ratio"] == pytest.approx(0.95)
    assert g["same_input_tokens_every_pair"] is False  # pair 1's token totals differ
    assert g["vllm_version"] == "0.25.0" and "vllm_version" not in g["config"]
    assert "pair lines of the run's log" in g["source"] and g["notes"] == ["host shared"]
    md = "\n".join(ho._b3_lines(g))
    assert "| 2 | n/a | 11000.0 | 10000.0 | 1.100 |" in md
    assert "NOT met" in md


def test_merge_from_the_runs_json_keeps_its_own_fields(tmp_path) -> None:
    runs = ho.runs_from_log(LOG)
    src = tmp_path / "raw.json"
    src.write_text(json.dumps({"date_utc": "d", "device": "H200", "vllm_version": "0.25.0", "complete": False,
                               **ho.summarize_pairs(runs, {k: CONFIG[k] for k in ("n", "conc", "output_len", "server", "order", "warmups")})}))
    doc: dict = {}
    ho.merge_gpu(doc, src, None, [])
    assert doc["vs_vllm_bench_gpu"]["complete"] is False
    assert doc["vs_vllm_bench_gpu"]["source"] == "the run's JSON (`raw.json`)"


def _pairs(tput: list[float], ttft: list[float]) -> dict:
    runs = [{"ours": {"output_throughput": t, "median_ttft_ms": f, "median_tpot_ms": 1.0, "total_input_tokens": 1},
             "vllm": {"output_throughput": 1.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0, "total_input_tokens": 1},
             "output_throughput_ratio": t, "median_ttft_ratio": f, "median_tpot_ratio": 1.0} for t, f in zip(tput, ttft)]
    return ho.summarize_pairs(runs, {})


def test_same_within_2pct_by_every_pair_or_by_equivalence_and_never_by_a_lucky_mean() -> None:
    every = _pairs([1.01, 0.99, 1.005], [0.995, 1.01, 1.0])
    assert "met: every pair" in ho._target_lines(every, True)[0]
    # Pairs spread +-4 % (the server's noise) but 40 of them pin the mean to +-1 %: equivalence.
    spread = [1.04, 0.96] * 20
    eq = _pairs(spread, spread)
    assert eq["output_throughput"]["equivalent_within_2pct"] is True
    assert "met as equivalence over 40 pairs" in ho._target_lines(eq, False)[0]
    # The same mean from 4 pairs: the interval is wider than 2 %, so not met although the mean is 1.00.
    few = _pairs(spread[:4], spread[:4])
    assert few["output_throughput"]["within_2pct"] is True and few["output_throughput"]["equivalent_within_2pct"] is False
    assert "NOT met" in ho._target_lines(few, False)[0]
    # Throughput equivalent but TTFT not: not met.
    mixed = _pairs(spread, [1.2, 0.9] * 20)
    assert "NOT met" in ho._target_lines(mixed, False)[0]


def test_two_gpu_runs_keep_their_own_sections_and_an_unknown_key_is_refused(tmp_path) -> None:
    src = tmp_path / "bench.log"
    src.write_text(LOG)
    runs = ho.runs_from_log(LOG)
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"date_utc": "d2", "device": {"name": "NVIDIA H200", "driver": "580.159.04", "power_limit_w": 700.0},
                               "vllm_version": "0.25.0", "complete": True,
                               **ho.summarize_pairs([{**r, "first": f} for r, f in zip(runs, ("ours", "vllm"))],
                                                    {k: CONFIG[k] for k in ("n", "conc", "output_len", "server", "order", "warmups")})}))
    doc: dict = {}
    ho.merge_gpu(doc, src, dict(CONFIG), [], key="vs_vllm_bench_gpu_earlier")
    ho.merge_gpu(doc, raw, None, ["alternating order"])
    with pytest.raises(ValueError, match="--gpu-key 'vs_vllm_bench_gpu2'"):
        ho.merge_gpu(doc, raw, None, [], key="vs_vllm_bench_gpu2")
    assert doc["vs_vllm_bench_gpu_earlier"]["date_utc"] == "2026-11-30T11:05Z"
    assert doc["vs_vllm_bench_gpu"]["date_utc"] == "d2"
    new = "\n".join(ho._b3_lines(doc["vs_vllm_bench_gpu"]))
    assert "on NVIDIA H200 (driver 580.159.04, power limit 700 W)" in new
    assert "- Position: with ours first (1 pairs) the mean throughput ratio is 0.800" in new
    assert "(H200, measured, earlier run)" in "\n".join(ho._b3_lines(doc["vs_vllm_bench_gpu_earlier"], ", earlier run"))


def test_the_summary_lists_every_design_and_names_only_those_that_show_equivalence() -> None:
    doc = {"vs_vllm_bench": _pairs([1.10, 0.95, 1.02], [1.0, 0.9, 1.1]),
           "vs_vllm_bench_concurrent": _pairs([1.001, 1.002, 1.003, 1.002], [0.80, 1.2, 1.0, 0.97]),
           "vs_vllm_bench_concurrent_poisson": _pairs([1.0, 1.0, 1.001], [1.004, 0.998, 1.001])}
    sm = ho.comparison_summary(doc)
    assert [r["key"] for r in sm["designs"]] == ["vs_vllm_bench", "vs_vllm_bench_concurrent", "vs_vllm_bench_concurrent_poisson"]
    assert sm["throughput_shown_within_2pct_by"] == ["vs_vllm_bench_concurrent", "vs_vllm_bench_concurrent_poisson"]
    assert sm["median_ttft_shown_within_2pct_by"] == ["vs_vllm_bench_concurrent_poisson"]
    md = "\n".join(ho._summary_lines(doc))
    assert "| (b2) CPU server, one tool after the other | 3 | 1.023 (" in md
    assert "throughput by (b2c), (b2p); median TTFT by (b2p)." in md


def test_the_summary_states_the_ttft_gap_in_ms_beside_the_fake_servers_truth() -> None:
    p = _pairs([1.0, 1.0, 1.0], [0.95, 0.96, 1.01])
    for x, (o, v) in zip(p["pairs"], ((9.5, 10.0), (9.6, 10.0), (10.1, 10.0))):
        x["ours"]["median_ttft_ms"], x["vllm"]["median_ttft_ms"] = o, v
    fake = {"ours_median_ttft_ms_minus_true": 2.57, "vllm_median_ttft_ms_minus_true": 4.65, "config": {"fake_ttft_ms": 50.0, "conc": 8}}
    doc = {"vs_vllm_bench_concurrent_poisson": p, "vs_vllm_bench_fake_server": fake}
    md = "\n".join(ho._summary_lines(doc))
    assert "ours' median TTFT minus vllm bench's is -0.27 ms on average (per pair from -0.50 to +0.10 ms) at a median TTFT " \
           "of 10.0 ms; ours lower in 2 of 3 pairs" in md
    assert "vllm bench reads +4.7 ms and ours +2.6 ms from the truth." in md
    assert "client-side time" not in md  # one pair went the other way: no claim about the cause
    p["pairs"][2]["ours"]["median_ttft_ms"] = 9.9
    assert "so the gap is client-side time one tool adds" in "\n".join(ho._summary_lines(doc))
