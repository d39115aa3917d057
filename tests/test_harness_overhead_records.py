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
