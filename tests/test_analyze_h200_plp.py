"""``benchmarks/analyze_h200.py``: the prompt-logprob run (both arms plugin) and repeated bisects."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import analyze_h200 as ah  # noqa: E402

RAW = ROOT / "docs" / "results" / "raw"


def _window(server: str, load: int, pair: int, tput: float, jpt: float) -> dict:
    return {"server": server, "load": load, "pair": pair, "output_throughput": tput, "gpu_energy_per_output_token_j": jpt,
            "request_throughput": tput / 4, "median_e2el_ms": 1000.0 / tput, "gpu_avg_power_w": tput * jpt,
            "total_tokens_per_joule": 1000.0 / jpt}


def _plp_raw(calls_b: dict) -> dict:
    windows = [_window("A", 4, 0, 20.0, 20.0), _window("B", 4, 0, 19.0, 21.0),
               _window("B", 4, 1, 22.0, 20.0), _window("A", 4, 1, 20.0, 20.0),
               _window("A", 16, 0, 30.0, 18.0)]  # a pair the budget cut: no B window, not counted
    return {"shape": "qwen2.5-7b", "date_utc": "2026-11-30T13:33:18Z", "serve_args": ["--max-model-len", "8192"],
            "method": {"input_len": 4000, "output_len": 4, "prompt_logprobs": 1, "order": "A B, B A (A = x)",
                       "arms": {"A": "plugin, table []", "B": "plugin, table [1024 rows: 8]"}},
            "windows": windows, "notes": ["budget reached"],
            "plugin_snapshot": {"lm_head_calls": calls_b, "lm_head_rows": 9000, "cuda_peak_allocated_bytes": 3 << 30,
                                "cuda_peak_scope": "since the first served step"},
            "plugin_a_snapshots_by_rank": {"0": {"lm_head_calls": {}, "cuda_peak_allocated_bytes": 5 << 30}}}


def test_plp_ratios_are_chunked_over_unchunked_per_pair_and_cut_pairs_are_left_out() -> None:
    r = ah.analyze_plp(_plp_raw({"1": 8, "8": 2}), "t")
    assert [c["load"] for c in r["cases"]] == [4]
    c = r["cases"][0]
    assert c["pairs"] == 2
    assert c["throughput_ratio_per_pair"] == [0.95, 1.1]
    assert c["j_per_token_ratio_per_pair"] == [1.05, 1.0]
    assert abs(c["throughput_ratio"] - 1.025) < 1e-12
    assert r["policy_engaged"] is True
    assert r["lm_head_rows_per_call_mean_b"] == 900.0
    assert r["cuda_peak_allocated_bytes"] == {"A": 5 << 30, "B": 3 << 30}
    md = "\n".join(ah.plp_lines(r))
    assert "chose more than one chunk in this run" in md
    assert "A 5.00 GiB, B 3.00 GiB; scope of the peak: since the first served step" in md


def test_a_run_whose_rule_never_fired_says_it_measured_the_hook() -> None:
    r = ah.analyze_plp(_plp_raw({"1": 10}), "t")
    assert r["policy_engaged"] is False
    assert "never chose more than one chunk" in "\n".join(ah.plp_lines(r))


def test_the_session5_run_is_recorded_as_not_having_chunked() -> None:
    with gzip.open(RAW / "h200-plp-7b-s5.json.gz", "rt") as f:
        r = ah.analyze_plp(json.load(f), "7b-s5")
    assert r["policy_engaged"] is False
    assert r["lm_head_calls_by_chunks"]["B"] == {"1": 2733}
    assert [c["pairs"] for c in r["cases"]] == [3, 2]


def test_bisects_are_kept_apart_and_old_single_process_profiles_still_render(monkeypatch, tmp_path) -> None:
    out = tmp_path / "res"
    monkeypatch.setattr(sys, "argv", ["analyze_h200.py", f"7b={RAW / 'h200-ab-7b.json.gz'}", "--out", str(out),
                                      "--bisect", str(RAW / "h200-overhead-bisect.json.gz"),
                                      "--bisect", f"2={RAW / 'h200-overhead-bisect-2.json.gz'}"])
    monkeypatch.setattr(ah, "plots", lambda runs, raws, out: [])
    ah.main()
    doc = json.loads((out / "h200-vllm.json").read_text())
    assert [b["tag"] for b in doc["bisects"]] == ["1", "2"]
    assert doc["bisects"][1]["rounds"] == 4
    assert set(doc["bisects"][1]["by_server"]) == {"S0-stock", "S1-plugin-full", "S3-no-lmhead-hook", "S4-no-trace",
                                                   "S5-no-meter", "S6-no-presets"}
    md = (out / "h200-vllm.md").read_text()
    assert "| S1-plugin-full (EngineCore) | 112 | 8 | 7.1 % |" in md
    assert "No GIL profile in this run" in md
    assert (out / "raw" / "h200-overhead-bisect-2.json.gz").exists()
