"""Several nodes through vLLM's Ray executor, on one machine.

A two-node Ray cluster is started here with Ray's own CLI (``ray start --head`` and
``ray start --address``, one logical GPU each), and ``vllm serve --distributed-executor-backend
ray --tensor-parallel-size 2`` puts one tensor-parallel rank on each node. The CPU build needs a
test-only shim for that (``tests/ray_cpu_shim/sitecustomize.py`` explains the exact refusal);
everything else is stock vLLM and stock Ray.

Checked: the plugin is active on both ranks although the nodes' environments lack every
``POWERSAVE_*`` variable (vLLM carries them), both ranks take the same decisions step by step,
each rank reports its (simulated) energy through the stats relay actor rather than the shared file
system, and the API server's ``/metrics`` sums the ranks under per-rank labels.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from fakes import energy_series, rank_decisions

pytest.importorskip("vllm")

from vllm_powersave import ray_relay, vllm_compat  # noqa: E402
from vllm_powersave.serving import VllmServer, default_serve_args, free_port  # noqa: E402

try:
    import ray  # noqa: F401

    RAY = None
except ImportError as exc:  # optional: scripts/setup.sh installs it, `pip install 'vllm-powersave[ray]'`
    RAY = f"ray is not importable ({exc}); install the optional extra: pip install 'vllm-powersave[ray]'"

needs_ray = pytest.mark.skipif(RAY is not None, reason=RAY or "")
SHIM = Path(__file__).resolve().parent / "ray_cpu_shim"
RAY_BIN = Path(sys.executable).parent / "ray"


# -- without a cluster ---------------------------------------------------------------------------
def test_legacy_ray_executor_copies_our_settings_to_workers(monkeypatch):
    """``RayDistributedExecutor`` (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) copies only the driver
    variables that vLLM's ``get_env_vars_to_copy`` names; without ``ray_copy_env`` the plugin would
    be off on its workers. Uses vLLM's own function (no Ray needed)."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    for k in list(os.environ):
        if k.startswith("POWERSAVE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv(vllm_compat.RAY_EXTRA_PREFIXES_ENV, "")  # restored (or removed) afterwards
    monkeypatch.setenv(vllm_compat.RAY_EXTRA_VARS_ENV, "")
    monkeypatch.setenv("POWERSAVE_SETTINGS_JSON", "{}")
    monkeypatch.setenv("POWERSAVE_ENABLED", "1")
    monkeypatch.setenv("CUDA_DISABLE_PERF_BOOST", "1")
    before = get_env_vars_to_copy()
    assert not {"POWERSAVE_SETTINGS_JSON", "POWERSAVE_ENABLED", "CUDA_DISABLE_PERF_BOOST"} & before
    monkeypatch.setenv(vllm_compat.RAY_EXTRA_PREFIXES_ENV, "MYLIB_")  # a user's own list is kept
    vllm_compat.ray_copy_env(("POWERSAVE_",), ("CUDA_DISABLE_PERF_BOOST",))
    vllm_compat.ray_copy_env(("POWERSAVE_",), ("CUDA_DISABLE_PERF_BOOST",))  # idempotent
    assert os.environ[vllm_compat.RAY_EXTRA_PREFIXES_ENV] == "MYLIB_,POWERSAVE_"
    assert os.environ[vllm_compat.RAY_EXTRA_VARS_ENV] == "CUDA_DISABLE_PERF_BOOST"
    after = get_env_vars_to_copy()
    assert {"POWERSAVE_SETTINGS_JSON", "POWERSAVE_ENABLED", "CUDA_DISABLE_PERF_BOOST"} <= after


def test_relay_refuses_files_other_than_its_own(tmp_path):
    relay = ray_relay.StatsRelay(str(tmp_path))
    relay.append("../evil.jsonl", ["x\n"])
    relay.append("trace-rank0.jsonl", ['{"a": 1}\n', '{"a": 2}\n'])
    relay.snapshot(3, '{"rank": 3}')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank3.json", "trace-rank0.jsonl"]
    assert (tmp_path / "trace-rank0.jsonl").read_text() == '{"a": 1}\n{"a": 2}\n'
    assert json.loads((tmp_path / "rank3.json").read_text()) == {"rank": 3}
    assert relay.stats()["failures"] == 1 and relay.stats()["lines"] == 2 and relay.stats()["snapshots"] == 1
    assert ray_relay.relay_name("/a/b/") == ray_relay.relay_name("/a/b") != ray_relay.relay_name("/a/c")


# -- a two-node Ray cluster on this machine --------------------------------------------------------
def _clean_env() -> dict[str, str]:
    """This machine's environment as a fresh node would have it: none of our variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("POWERSAVE_", "RAY_")) and k not in ("VLLM_PLUGINS", "CUDA_DISABLE_PERF_BOOST")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), *filter(None, [env.get("PYTHONPATH")])])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray >= 2.52 turns token authentication on wherever ~/.ray/auth_token exists, but never for a
    # client given an explicit address: a machine-wide token must not split this cluster.
    env["RAY_AUTH_MODE"] = "disabled"
    return env


def _wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise RuntimeError(f"ray start did not report {text!r} (exit {proc.poll()}): {path.read_text(errors='replace')[-2000:]}")


@pytest.fixture(scope="module")
def ray_cluster():
    if RAY is not None:
        pytest.skip(RAY)
    import psutil

    # Short: Ray's Unix socket paths live under it (107-byte limit).
    tmp = Path(tempfile.mkdtemp(prefix="rps-", dir="/tmp"))
    port = free_port()
    env = _clean_env()
    common = ["--block", "--num-cpus", "1", "--num-gpus", "1", "--object-store-memory", str(100 * 1024 * 1024)]
    procs = []
    try:
        # Free ports where Ray would otherwise take fixed defaults (client server 10001, agent 52365).
        for i, extra in enumerate(
            (
                [
                    "--head",
                    "--port",
                    str(port),
                    "--ray-client-server-port",
                    str(free_port()),
                    "--include-dashboard=false",
                    "--disable-usage-stats",
                    "--temp-dir",
                    str(tmp),
                    "--dashboard-agent-listen-port",
                    str(free_port()),
                ],
                ["--address", f"127.0.0.1:{port}", "--dashboard-agent-listen-port", str(free_port())],
            )
        ):
            log = tmp / f"node{i}.log"
            with open(log, "wb") as f:
                p = subprocess.Popen(
                    [str(RAY_BIN), "start", *extra, *common], stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            procs.append(p)
            _wait_for_line(log, "Ray runtime started", p, 180)
        yield {"address": f"127.0.0.1:{port}", "env": env, "dir": tmp}
    finally:
        # Every process of this cluster, by id: the two `ray start` processes and all they spawned
        # (GCS, raylets, agents, worker processes).
        tree = []
        for p in reversed(procs):
            try:
                pp = psutil.Process(p.pid)
                tree += [pp, *pp.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        for pp in tree:
            try:
                pp.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _alive_nodes() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


@needs_ray
def test_relay_carries_a_remote_workers_figures_to_the_driver_node(ray_cluster, tmp_path, monkeypatch):
    """The reporting path alone: an actor on the other node sends what a worker publishes; the
    relay pinned to the driver's node writes it into the API server's stats_dir, in order."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    stats = tmp_path / "stats"
    stats.mkdir()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address=ray_cluster["address"], logging_level="ERROR")
    try:
        here = ray.get_runtime_context().get_node_id()
        other = [n for n in _alive_nodes() if n != here]
        assert len(other) == 1
        assert ray_relay.connect(str(stats)) is None  # a driver is no executor worker: local files
        assert ray_relay.ensure_relay(str(stats)) is True
        assert ray_relay.ensure_relay(str(stats)) is True  # get_if_exists: still one relay

        @ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(other[0], soft=False))
        class FakeWorker:
            def publish(self, stats_dir: str, n: int) -> str | None:
                from vllm_powersave import ray_relay as rr

                client = rr.connect(stats_dir)
                if client is None:
                    return None
                for i in range(n):
                    client.append("trace-rank1.jsonl", [json.dumps({"i": i}) + "\n"])
                    client.snapshot(1, json.dumps({"rank": 1, "steps": i}))
                return client.node_id

        sender_node = ray.get(FakeWorker.remote().publish.remote(str(stats), 50), timeout=120)
        assert sender_node == other[0]
        relay = ray.get_actor(ray_relay.relay_name(str(stats)))
        deadline = time.monotonic() + 60
        while (info := ray.get(relay.stats.remote(), timeout=60))["lines"] < 50 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert info["node_id"] == here and info["failures"] == 0 and info["snapshots"] == 50
        lines = [json.loads(x) for x in (stats / "trace-rank1.jsonl").read_text().splitlines()]
        assert lines == [{"i": i} for i in range(50)]  # every line, in the order sent
        assert json.loads((stats / "rank1.json").read_text()) == {"rank": 1, "steps": 49}  # the last snapshot wins
    finally:
        ray_relay._OWNED.clear()  # handles of this session's relay: meaningless after shutdown
        ray.shutdown()


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), r.headers


@pytest.mark.e2e
@needs_ray
def test_tp2_across_two_ray_nodes_ranks_agree_and_energy_reaches_the_api_server(ray_cluster, tmp_path):
    from vllm_powersave.modelgen import make_model

    model = make_model(tmp_path / "tiny", "qwen2-tiny")
    stats = tmp_path / "stats"
    cfg = {
        "powersave": {
            "trace_steps": True,
            "per_request_energy": True,
            "stats_dir": str(stats),
            "clocks": {
                "backend": "simulated",
                "min_dwell_ms": 30,
                "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}},
            },
            "energy": {"meter": "simulated", "response_wait_ms": 5000},
        }
    }
    args = default_serve_args(str(model)) + [
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--plugin",
        "powersave",
        "--additional-config",
        json.dumps(cfg),
    ]
    env = {**ray_cluster["env"], "RAY_ADDRESS": ray_cluster["address"]}
    srv = VllmServer(args, env=env, log_path=tmp_path / "server.log", startup_timeout_s=900)
    headers = []
    with srv:
        for i in range(6):
            resp, h = _post(
                srv.base_url + "/v1/completions", {"model": "model", "prompt": f"def f{i}():", "max_tokens": 48, "ignore_eos": True}
            )
            assert resp["usage"]["completion_tokens"] == 48
            headers.append((resp["id"], h))
        # Wait until both ranks' published energy shows every phase, idle included (each publisher
        # writes every 0.5 s, later on a loaded CI host), rather than sleep a few periods.
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(srv.base_url + "/metrics", timeout=30) as r:
                text = r.read().decode()
            per_gpu, _ = energy_series(text)
            seen = {(k.split('gpu="')[1].split('"')[0], k.split('phase="')[1].split('"')[0]) for k, v in per_gpu.items() if v > 0}
            if seen >= {(g, p) for g in ("sim0", "sim1") for p in ("prefill", "decode", "idle")} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        snaps = {r: json.loads((stats / f"rank{r}.json").read_text()) for r in (0, 1)}
        log = srv.log_tail(400)
    # Both ranks ran the plugin and reported through the relay, from two different Ray nodes.
    assert {r: (s["transport"], s["gpu"]) for r, s in snaps.items()} == {0: ("ray-relay", "sim0"), 1: ("ray-relay", "sim1")}, log
    assert snaps[0]["ray_node_id"] and snaps[1]["ray_node_id"] and snaps[0]["ray_node_id"] != snaps[1]["ray_node_id"]
    # Same steps, same phases, same clock decisions, in the same order.
    traces = rank_decisions(stats)
    # Each rank's newest lines may still sit in its buffer when Ray stops the workers (their last
    # relay flush is not waited for; about 1 run in 3-4 lost a few steps of one rank): both ranks
    # must hold every request's steps and agree over what both wrote.
    n = min(len(traces[0]), len(traces[1]))
    assert n > 6 * 40 and traces[0][:n] == traces[1][:n]
    assert any(t[3] == 1200 for t in traces[0])
    # /metrics: per-rank labels; the engine's energy is the sum of the ranks', phase by phase.
    per_gpu, engine = energy_series(text)
    assert {k.split('gpu="')[1].split('"')[0] for k in per_gpu} == {"sim0", "sim1"}
    assert all('source="simulated"' in k for k in per_gpu)
    for phase in ("prefill", "decode", "idle"):
        ranks = sum(v for k, v in per_gpu.items() if f'phase="{phase}"' in k)
        assert ranks > 0
        assert engine[f'powersave_engine_energy_joules_total{{phase="{phase}",source="simulated"}}'] == pytest.approx(ranks)
    # Per-request energy: both ranks' lines reached the API server; the header sums them.
    lines = [json.loads(x) for r in (0, 1) for x in (stats / f"requests-rank{r}.jsonl").read_text().splitlines()]
    for rid, h in headers:
        assert h["x-powersave-energy-status"] == "complete" and h["x-powersave-energy-source"] == "simulated"
        mine = [x for x in lines if x["request_id"].startswith(rid)]
        assert sorted(x["gpu"] for x in mine) == ["sim0", "sim1"]
        assert float(h["x-powersave-energy-j"]) == pytest.approx(sum(x["energy_j"] for x in mine), abs=1e-5)
