"""The cross-GPU A/B (benchmarks/h200_ab_cross.py): placements swapped, GPU factors cancel."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import h200_ab as ab  # noqa: E402
import h200_ab_cross as cross  # noqa: E402


def test_pair_ratio_cancels_a_gpus_own_factor() -> None:
    # GPU b is 20 % faster for either arm; the plugin costs 3 %: round X = (stock on a, plugin on b),
    # round Y = (stock on b, plugin on a).
    s, gpu_b, cost = 1000.0, 1.2, 0.97
    x = (s, s * gpu_b * cost)
    y = (s * gpu_b, s * cost)
    assert cross.pair_ratio(x, y) == pytest.approx(cost)
    # One placement alone would read 1.164 or 0.808.
    assert x[1] / x[0] == pytest.approx(1.164) and y[1] / y[0] == pytest.approx(0.8083, abs=1e-4)
    assert cross.pair_ratio((s, None), y) is None and cross.pair_ratio((0.0, s), y) is None
    assert cross.pair_ratio((s, math.nan), y) is None


def test_the_script_runs_both_placements_at_once_and_pairs_them(monkeypatch, tmp_path) -> None:
    procs: list[subprocess.Popen] = []

    def start(label, model, port, extra, pythonpath, out, gpu_mem, env_extra=None, cpus=None):
        # Stand-ins: the plugin arms stream at twice the inter-token delay; GPU 1 is the same as GPU 0.
        itl = 3 if label.startswith("stock") else 6
        assert env_extra == {"CUDA_VISIBLE_DEVICES": label.rsplit("-g", 1)[1]}
        assert ("--plugin" in extra) != label.startswith("stock") and "--kv-cache-memory-bytes" in extra
        p = subprocess.Popen([sys.executable, "-m", "loadtests.fake_server", "--port", str(port), "--itl-ms", str(itl),
                              "--ttft-ms", "5"], stdout=subprocess.DEVNULL, start_new_session=True)
        procs.append(p)
        return p

    def healthy(pr, timeout_s):
        for _, port in pr.values():
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)

    monkeypatch.setattr(ab, "device_prologue", lambda ns, gpus: tmp_path)
    monkeypatch.setattr(ab, "device_facts", lambda i=0: {"name": "test"})
    cpus = sorted(os.sched_getaffinity(0))[:2]
    two = len(cpus) == 2
    # Three CPU sets per GPU (stock, full, bare): rotated every pair, so the arms change sets.
    monkeypatch.setattr(ab, "server_cpu_sets", lambda g, n: [{cpus[0]}, {cpus[-1]}, {cpus[0]}] if two else None)
    monkeypatch.setattr(ab, "start_server", start)
    monkeypatch.setattr(ab, "wait_healthy", healthy)
    monkeypatch.setattr(ab, "job_port", lambda g, slot: 18000 + os.getpid() % 1000 * 10 + 5 * g + slot - 30)
    out = tmp_path / "raw.json"
    monkeypatch.setattr(sys, "argv", ["h200_ab_cross.py", "--loads", "2", "--pairs", "2", "--window", "1", "--arms", "full,bare",
                                      "--output-len", "8", "--no-profile", "--out", str(out)])
    try:
        assert cross.main() == 0
    finally:
        for p in procs:
            if p.poll() is None:  # the script stops its servers itself (ab.stop)
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    doc = json.loads(out.read_text())
    assert doc["notes"] == []
    ws = doc["windows"]
    # Each pair and arm: rounds X and Y (order alternating by pair), stock and the arm on different GPUs.
    got = [(w["pair"], w["round"], w["server"]) for w in ws]
    assert got == [
        (0, "X", "stock@0"), (0, "X", "full@1"), (0, "Y", "stock@1"), (0, "Y", "full@0"),
        (0, "X", "stock@0"), (0, "X", "bare@1"), (0, "Y", "stock@1"), (0, "Y", "bare@0"),
        (1, "Y", "stock@1"), (1, "Y", "full@0"), (1, "X", "stock@0"), (1, "X", "full@1"),
        (1, "Y", "stock@1"), (1, "Y", "bare@0"), (1, "X", "stock@0"), (1, "X", "bare@1")]
    for i in range(0, len(ws), 2):
        assert abs(ws[i]["first_send_s"] - ws[i + 1]["first_send_s"]) < 0.3  # one shared window
    assert [(p["pair"], p["arm"]) for p in doc["pairs"]] == [(0, "full"), (0, "bare"), (1, "full"), (1, "bare")]
    for p in doc["pairs"]:
        # Twice the inter-token delay: the plugin stand-in serves clearly fewer tokens/s.
        assert 0.4 < p["throughput_ratio"] < 0.85 and p["itl_p50_ratio"] > 1.5
        assert p["j_per_token_ratio"] is None  # no NVML on this machine: no energy, no made-up ratio
    assert doc["method"]["servers"]["bare@0"]["config"]["powersave"]["energy"] == {"meter": "off"}
    if two:
        assert doc["method"]["rotate_cpus"] is True
        stock0 = [w["cpus"] for w in ws if w["server"] == "stock@0"]
        full1 = [w["cpus"] for w in ws if w["server"] == "full@1"]
        assert stock0 == [[cpus[0]], [cpus[0]], [cpus[1]], [cpus[1]]] and full1 == [[cpus[1]], [cpus[0]]]


def test_unknown_arm_is_one_line_and_starts_nothing(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(ab, "start_server", lambda *a, **k: pytest.fail("a server was started"))
    monkeypatch.setattr(sys, "argv", ["h200_ab_cross.py", "--arms", "full,fast", "--out", str(tmp_path / "x.json")])
    assert cross.main() == 2
    assert capsys.readouterr().err.strip() == "error: --arms 'full,fast': unknown ['fast']; choose from ['bare', 'full', 'twin']"
