"""The device benchmarks' CPU pinning: co-resident servers get disjoint, equal, GPU-local CPU sets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib import serve as ab

pytestmark = pytest.mark.bench


def test_cpulists_parse_ranges_and_singletons() -> None:
    assert ab.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert ab.parse_cpulist("") == set()


def test_split_is_contiguous_disjoint_and_equal(tmp_path) -> None:
    no_topology = tmp_path  # no sysfs topology: every CPU is a core of its own
    parts = ab.split_cpus(set(range(16, 32)) | {40}, 3, no_topology)
    assert parts == [{16, 17, 18, 19, 20}, {21, 22, 23, 24, 25}, {26, 27, 28, 29, 30}]
    with pytest.raises(ValueError, match=r"cannot split 2 cores \(2 CPUs\) between 3 servers"):
        ab.split_cpus({0, 1}, 3, no_topology)


def test_hyperthread_siblings_stay_in_one_slice(tmp_path) -> None:
    # A typical node: cores 0-3 with siblings 8-11 (cpulist 0-3,8-11). Cut by CPU number, server A
    # would get 0-3 and server B 8-11, the same four physical cores.
    for c in range(4):
        for sib in (c, c + 8):
            d = tmp_path / f"cpu{sib}" / "topology"
            d.mkdir(parents=True)
            (d / "thread_siblings_list").write_text(f"{c},{c + 8}\n")
    assert ab.split_cpus({0, 1, 2, 3, 8, 9, 10, 11}, 2, tmp_path) == [{0, 1, 8, 9}, {2, 3, 10, 11}]
    # Only allowed CPUs count: a sibling outside the set is not added.
    assert ab.core_groups({0, 1, 9}, tmp_path) == [{0}, {1, 9}]


def _sysfs(tmp_path: Path, lists: dict[str, str]) -> Path:
    for bus, cpus in lists.items():
        d = tmp_path / bus
        d.mkdir(parents=True)
        (d / "local_cpulist").write_text(cpus + "\n")
    return tmp_path


def test_gpus_sharing_a_node_split_it_and_a_gpu_alone_keeps_its_node(tmp_path) -> None:
    # nvidia-smi's 8-digit domain form; sysfs names use 4 digits and lower case.
    sysfs = _sysfs(tmp_path, {"0000:18:00.0": "0-15", "0000:2a:00.0": "0-15", "0000:9a:00.0": "16-31"})
    buses = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:9A:00.0"]
    assert ab.gpu_local_cpus(0, buses, sysfs) == set(range(0, 8))
    assert ab.gpu_local_cpus(1, buses, sysfs) == set(range(8, 16))
    assert ab.gpu_local_cpus(2, buses, sysfs) == set(range(16, 32))
    # Only CPUs this process may use count (a container's cpuset).
    assert ab.gpu_local_cpus(2, buses, sysfs, allowed=set(range(20, 64))) == set(range(20, 32))


def test_no_locality_means_no_pinning(tmp_path) -> None:
    assert ab.gpu_local_cpus(0, ["00000000:18:00.0"], _sysfs(tmp_path, {})) is None


def test_too_few_local_cpus_for_the_servers_skips_pinning(monkeypatch) -> None:
    monkeypatch.setattr(ab, "gpu_bus_ids", lambda: ["00000000:18:00.0"])
    monkeypatch.setattr(ab, "gpu_local_cpus", lambda gpu, buses, allowed=None: set(range(8)))
    monkeypatch.setattr(ab, "core_groups", lambda cpus, sysfs_cpu=None: [{c} for c in sorted(cpus)])
    assert ab.server_cpu_sets(0, 6) is None  # 8 CPUs cannot give 6 servers 2 each
    assert ab.server_cpu_sets(0, 2) == [set(range(4)), set(range(4, 8))]


def test_a_started_server_and_its_children_run_on_the_given_cpus(monkeypatch, tmp_path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpus = {allowed[-1]}
    # A stand-in for the server: a Python that starts a child and prints both processes' affinity.
    prog = (
        "import os,subprocess,sys;print(sorted(os.sched_getaffinity(0)));"
        "print(subprocess.run([sys.executable,'-c','import os;print(sorted(os.sched_getaffinity(0)))'],"
        "capture_output=True,text=True).stdout.strip())"
    )
    monkeypatch.setattr(ab, "check_port_free", lambda port: None)
    real_popen = subprocess.Popen
    monkeypatch.setattr(ab.subprocess, "Popen", lambda cmd, **kw: real_popen([sys.executable, "-c", prog], **kw))
    p = ab.start_server("pin", tmp_path, 1, [], "", tmp_path, 0.1, cpus=cpus)
    p.wait(timeout=30)
    lines = (tmp_path / "server-pin.log").read_text().splitlines()[1:]
    assert lines == [str(sorted(cpus))] * 2
