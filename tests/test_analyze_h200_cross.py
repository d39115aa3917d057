"""``benchmarks/analyze_h200.py``: the cross-GPU A/B and the concurrent bisect (session-6 raw files)."""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import analyze_h200 as ah  # noqa: E402

RAW = ROOT / "docs" / "results" / "raw"


def _w(server: str, arm: str, gpu: int, pair: int, rnd: str, tput: float, tok_j: float) -> dict:
    return {"server": server, "arm": arm, "gpu": gpu, "load": 8, "pair": pair, "round": rnd, "first_send_s": 0.01,
            "output_throughput": tput, "output_tokens_per_joule": tok_j, "gpu_avg_power_w": tput / tok_j, "median_itl_ms": 1000 / tput}


def test_cross_case_takes_the_median_of_the_pairs_and_only_the_arms_own_rounds() -> None:
    # Arm "full" costs 4 % and 3 %; arm "bare" nothing. GPU 1 is 10 % faster for everyone.
    ws, pairs = [], []
    for pair, cost in ((0, 0.96), (1, 0.97), (2, 0.95)):
        ws += [_w("stock@0", "stock", 0, pair, "X", 100, 10), _w("full@1", "full", 1, pair, "X", 110 * cost, 10 * cost),
               _w("stock@1", "stock", 1, pair, "Y", 110, 10), _w("full@0", "full", 0, pair, "Y", 100 * cost, 10 * cost),
               _w("stock@0", "stock", 0, pair, "X", 50, 5), _w("bare@1", "bare", 1, pair, "X", 55, 5),
               _w("stock@1", "stock", 1, pair, "Y", 55, 5), _w("bare@0", "bare", 0, pair, "Y", 50, 5)]
        pairs += [{"arm": "full", "load": 8, "pair": pair, "throughput_ratio": math.sqrt(1.1 * cost * cost / 1.1),
                   "j_per_token_ratio": 1 / cost, "itl_p50_ratio": 1 / cost},
                  {"arm": "bare", "load": 8, "pair": pair, "throughput_ratio": 1.0, "j_per_token_ratio": 1.0, "itl_p50_ratio": 1.0}]
    raw = {"shape": "qwen2.5-0.5b", "date_utc": "2026-11-30T17:00:00Z", "method": {"arms": ["full", "bare"]},
           "windows": ws, "pairs": pairs, "notes": []}
    r = ah.analyze_cross(raw, "t")
    by = {c["arm"]: c for c in r["cases"]}
    assert by["full"]["throughput_ratio"] == pytest.approx(0.96) and by["full"]["pairs"] == 3
    assert by["full"]["j_per_token_ratio"] == pytest.approx(1 / 0.96)
    assert by["full"]["verdict"] == "difference beyond noise" and by["bare"]["verdict"] == "no difference beyond noise"
    # The stock figures of the bare arm's rounds do not leak into the full arm's case.
    assert by["full"]["stock_out_tok_per_s"] == pytest.approx(105.0) and by["bare"]["stock_out_tok_per_s"] == pytest.approx(52.5)
    assert r["first_send_spread_s"] == 0.0


def test_session6_records_read_back() -> None:
    raw = json.loads(gzip.open(RAW / "h200-cross-0.5b-cross.json.gz", "rt").read())
    r = ah.analyze_cross(raw, "0.5b-cross")  # one arm, called "plugin" in that run's windows
    assert [(c["arm"], c["load"], c["pairs"]) for c in r["cases"]] == [("full", 8, 3), ("full", 64, 3), ("full", 256, 3)]
    assert all(max(c["throughput_ratio_per_pair"]) < 0.95 for c in r["cases"])
    assert r["cases"][0]["throughput_ratio"] == pytest.approx(0.9027, abs=1e-4)
    doc = json.loads((ROOT / "docs" / "results" / "h200-vllm.json").read_text())
    cross = [c for c in doc["cases"] if c.get("design", "").startswith("cross-GPU")]
    need = {"shape", "load", "throughput_ratio", "j_per_token_ratio", "stock_out_tok_per_j", "plugin_out_tok_per_j", "pairs"}
    # Sessions 6 (3 + 2 cases) and 7 (full and bare; its A/A twin arm is no overhead case).
    assert len(cross) == 7 and all(need <= set(c) for c in cross)
    assert {c["arm"] for c in cross} == {"full", "bare"}
    alt_runs = {r["run"]: r for r in doc["alternation"]}
    # Later sessions append runs; the session-7 ones stay as they were recorded.
    assert {"offline-s7a", "offline-s7b", "serve-s7", "hooks-s7"} <= set(alt_runs)
    assert alt_runs["serve-s7"]["summary"]["8:twin"]["cycles"] == 43
    assert alt_runs["hooks-s7"]["hooks"]["8:full"]["steps"] == 2827
    b = next(b for b in doc["bisects"] if b["tag"] == "c")
    assert b["concurrent"] and b["rounds"] == 34
    assert sorted(b["per_round_ratio"]) == ["S0-stock", "S1-plugin-full", "S7-stock-twin"]


def test_session8_hook_runs_read_back() -> None:
    doc = json.loads((ROOT / "docs" / "results" / "h200-vllm.json").read_text())
    alt_runs = {r["run"]: r for r in doc["alternation"]}
    assert {"hooks-s8a", "hooks-s8b", "hooks-s8c", "parts-s8", "offline-s8a", "offline-s8b", "offline-s8c"} <= set(alt_runs)
    b = alt_runs["hooks-s8b"]["hooks"]
    # Same call, same steps: the base commit's hooks against the decode fast path.
    assert b["8:full"]["steps"] == b["8:full-base"]["steps"] == 2313
    assert b["8:full"]["engine_thread_us_per_step"] == pytest.approx(21.86, abs=0.01)
    assert b["8:full-base"]["engine_thread_us_per_step"] == pytest.approx(41.50, abs=0.01)
    c = alt_runs["hooks-s8c"]["hooks"]
    assert c["256:full"]["engine_thread_share"] == pytest.approx(0.0035, abs=1e-4)
    a = alt_runs["hooks-s8a"]["hooks"]
    assert a["8:bare"]["engine_thread_us_per_step"] < a["8:bare-base"]["engine_thread_us_per_step"] / 4
