"""End to end: `vllm-powersave tune-serving` on the tiny model through real `vllm serve` processes
(vLLM CPU build, energy simulated), a 2-configuration space, stopped after one measurement and
resumed: the second run measures nothing twice, and writes the report, the plot and the command.

Kept short for a 2-core CI machine: 3 s windows at concurrency 4 with short requests, 2 final
pairs; 4 server starts in all (~25 s each here)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from vllm_powersave.modelgen import make_model

    return make_model(tmp_path_factory.mktemp("models") / "qwen2-tiny", "qwen2-tiny")


def _tune(model, out, *extra):
    cmd = [sys.executable, "-m", "vllm_powersave.cli", "tune-serving", "--model", str(model), "--out", str(out)]
    cmd += ["--concurrency", "4", "--input-len", "16:48", "--output-len", "8:24", "--slo-ttft-ms", "20000", "--slo-tpot-ms", "2000"]
    cmd += ["--max-num-seqs", "2,8", "--cuda-perf-boost", "auto,off", "--window-s", "3", "--pairs", "2", "--warmups", "1", "--no-progress"]
    return subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=900)


def _state(out):
    return [json.loads(x) for x in (out / "state.jsonl").read_text().splitlines()]


def test_tune_serving_runs_end_to_end_and_resumes_without_measuring_twice(tiny_model, tmp_path):
    out = tmp_path / "tune"
    first = _tune(tiny_model, out, "--stop-after", "1")
    assert first.returncode == 3, first.stderr[-2000:]
    assert "[tune-serving] skipped cuda_perf_boost: no GPU: there is no CUDA context to boost" in first.stdout
    assert "rerun the same command to resume" in first.stdout
    state1 = _state(out)
    assert state1[0]["kind"] == "header" and [s["step"] for s in state1[1:]] == ["search/r0/max_num_seqs=2"]
    assert state1[1]["figures"]["energy_source"] == "simulated" and state1[1]["figures"]["sent"] > 0
    kept_line = (out / "state.jsonl").read_text().splitlines()[1]

    second = _tune(tiny_model, out)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming: 1 finished step(s)" in second.stdout
    lines = (out / "state.jsonl").read_text().splitlines()
    assert lines[1] == kept_line  # the finished measurement is kept as it was
    steps = [s["step"] for s in _state(out)[1:]]
    assert len(steps) == len(set(steps)) == 6  # 2 search windows + 2 ABBA pairs, none measured twice
    assert "search r0 max_num_seqs=2" not in second.stdout  # the reused window was not measured again
    assert steps[1:] == ["search/r0/max_num_seqs=8"] + [
        f"final/p{p}/{a}" for p, a in ((1, "winner"), (1, "defaults"), (2, "defaults"), (2, "winner"))
    ]

    rec = json.loads((out / "tune-serving.json").read_text())
    assert rec["status"] == "done" and rec["energy_label"] == "simulated" and "SIMULATED" in rec["energy_note"]
    assert rec["skipped_settings"] == {"cuda_perf_boost": "no GPU: there is no CUDA context to boost"}
    assert [c["key"] for c in rec["configurations"]] == ["max_num_seqs=2", "max_num_seqs=8"]
    assert all(w["energy_label"] == "simulated" and w["output_tokens_per_joule"] > 0 for c in rec["configurations"] for w in c["windows"])
    final = rec["final"]
    assert final["pairs"] == 2 and final["order"] == ["winner,defaults", "defaults,winner"]
    assert final["tok_per_j_ratio"]["mean"] > 0 and len(final["tok_per_j_ratio"]["ci95"]) == 2
    for arm in ("winner", "defaults"):
        assert 0 <= final["slo_attainment"][arm]["mean"] <= 1 and final["slo_attainment"][arm]["windows"] == 2
    winner = rec["winner"]
    assert winner["key"] in ("max_num_seqs=2", "max_num_seqs=8") and winner["slo_met"]
    command = (out / "winner-command.txt").read_text().strip()
    assert command == winner["command"] and command.startswith(f"vllm serve {tiny_model} ")
    assert command.count("--max-num-seqs") == 1 and command.endswith("--max-num-seqs " + winner["key"].split("=")[1])
    assert command in second.stdout
    md = (out / "tune-serving.md").read_text()
    assert "Energy SIMULATED" in md and "(simulated)" in md and "## Winner vs vLLM's defaults: 2 pair(s) in ABBA order" in md
    png = (out / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
