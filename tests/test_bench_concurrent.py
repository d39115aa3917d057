"""The overhead bisect's concurrent design: servers driven at the same moment, CPU sets moved per round."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import h200_ab as ab  # noqa: E402
import h200_overhead_bisect as bisect  # noqa: E402


def _allowed(pid: int | str) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return ab.parse_cpulist(line.split(":", 1)[1].strip())
    raise AssertionError("no Cpus_allowed_list")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move a process between sets")
def test_every_thread_of_every_process_in_the_session_moves() -> None:
    # A stand-in server: a session leader with two extra threads and a child process (the EngineCore).
    prog = ("import subprocess,sys,threading,time\n"
            "c=subprocess.Popen([sys.executable,'-c','import time;time.sleep(60)'])\n"
            "[threading.Thread(target=time.sleep,args=(60,),daemon=True).start() for _ in range(2)]\n"
            "print('ready',flush=True);time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        target = {sorted(os.sched_getaffinity(0))[-1]}
        procs = ab.session_processes(p.pid)
        assert len(procs) == 2
        moved = bisect.set_tree_affinity(p.pid, target)
        tasks = [t for pid, _, d in procs for t in os.listdir(d / "task")]
        assert moved == len(tasks) >= 4  # leader's main + 2 threads, the child's main
        assert all(_allowed(f"{pid}/task/{t}") == target for pid, _, d in procs for t in os.listdir(d / "task"))
    finally:
        os.killpg(p.pid, 9)
        p.wait()


class _Proc:
    pid = os.getpid()  # only read when CPU sets or py-spy are given


def test_concurrent_rounds_drive_all_servers_in_one_window(server_factory) -> None:
    slow, fast = server_factory(itl_delay=0.03), server_factory(itl_delay=0.003)
    port = lambda s: int(s.url.rsplit(":", 1)[1])
    procs = {"S0-stock": (_Proc(), port(slow)), "S1-plugin-full": (_Proc(), port(fast))}
    ns = argparse.Namespace(window=1.5, rounds=2, budget_s=1e6, concurrency=2, output_len=16)
    result: dict = {"windows": [], "profiles": {}, "notes": []}
    saves = []
    bisect.concurrent_rounds(ns, procs, None, result, lambda: saves.append(len(result["windows"])))
    ws = result["windows"]
    assert [(w["server"], w["round"]) for w in ws] == [("S0-stock", 0), ("S1-plugin-full", 0), ("S0-stock", 1), ("S1-plugin-full", 1)]
    assert saves == [2, 4]
    assert all(w["concurrent"] and w["error"] is None and w["completed"] > 0 for w in ws)
    for r in (0, 1):
        w0, w1 = (w for w in ws if w["round"] == r)
        # Both clients sent their first request at the same moment (the barrier), after the round began.
        assert 0 <= w0["first_send_s"] < 5 and abs(w0["first_send_s"] - w1["first_send_s"]) < 0.2
        # Each server's own speed shows: the one with 10x the inter-token delay serves fewer tokens/s.
        assert w1["output_throughput"] > 2 * w0["output_throughput"]


def test_gil_profile_counts_the_plugins_own_frames_not_its_wrappers_calls_into_vllm() -> None:
    sched = "install_scheduler_hooks.<locals>.make_schedule.<locals>.schedule (vllm_powersave/vllm_compat.py:567)"
    raw = "\n".join([
        f"run_busy_loop (vllm/core.py:1);{sched};schedule (vllm/v1/core/sched/scheduler.py:300) 50",  # vLLM's
        f"run_busy_loop (vllm/core.py:1);{sched} 3",  # the wrapper's own lines
        "run_busy_loop (vllm/core.py:1);on_step_start (vllm_powersave/runtime.py:365) 7",
        "run_busy_loop (vllm/core.py:1);step (vllm/core.py:9) 40",
        "garbage line without a count",
    ])
    got = bisect.parse_gil_profile(raw)
    assert got["gil_samples"] == 100 and got["powersave_own_samples"] == 10
    assert got["share"] == 0.1 and dict(got["top"]) == {"on_step_start (vllm_powersave/runtime.py:365)": 7, sched: 3}


def test_run_together_reports_a_failed_client_and_still_returns_the_others(server_factory) -> None:
    srv = server_factory(itl_delay=0.001)
    good = {"base_url": srv.url, "model": "fake-model", "num_prompts": 4, "max_concurrency": 2, "input_len": 4,
            "output_len": 4, "energy": "none", "label": "good"}
    got = ab.run_together([good, {"label": "bad", "no_such_field": 1}], timeout_s=60)
    assert "no_such_field" in got["bad"]["error"] and got["bad"]["first_send_s"] is None
    assert got["good"]["completed"] == 4 and 0 <= got["good"]["first_send_s"] < 10


def test_profile_servers_profiles_each_process_and_reports_its_gil_busy_share(tmp_path) -> None:
    # A stand-in py-spy: writes 40 collapsed-stack samples (4 in the plugin's own code) to its -o path.
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = -o ] && out=$2; shift; done\n"
                    "printf 'main (vllm/x.py:1);step (vllm/x.py:2) 36\\nmain (vllm/x.py:1);on_step_start (vllm_powersave/runtime.py:9) 4\\n' > \"$out\"\n")
    fake.chmod(0o755)
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        boxes, ths = bisect.profile_servers(str(fake), {"S1": server.pid}, 2.0, str(tmp_path / "gil"))
        assert list(boxes) == ["S1"] and list(boxes["S1"]) == ["api"]  # no EngineCore process in this stand-in
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    finally:
        os.killpg(server.pid, 9)
        server.wait()
    got = boxes["S1"]["api"]
    assert got["gil_samples"] == 40 and got["powersave_own_samples"] == 4 and got["share"] == 0.1
    assert got["gil_busy_share"] == 40 / (100 * 2.0)
    assert (tmp_path / "gil-S1-api.txt").exists()
