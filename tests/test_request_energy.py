"""Per-request energy in the API server (headers, route), vLLM's app hook and /metrics with
several API servers, without starting a server."""

import asyncio
import json
import os
import threading
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vllm_powersave.request_energy import (
    RequestEnergyIndex,
    RequestEnergyMiddleware,
    candidate_keys,
)


def write_lines(d, rank, recs):
    with open(d / f"requests-rank{rank}.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps({"source": "simulated", "method": "model", "gpu": f"sim{rank}", "rank": rank, **r}) + "\n")


def ranks(d, n):
    for r in range(n):
        (d / f"rank{r}.json").write_text("{}")


def test_internal_ids_map_to_the_openai_response_id():
    # completions: one internal request per prompt; chat: one; n > 1: children "<k>_<parent>"
    assert "cmpl-abc" in candidate_keys("cmpl-abc-1-1a2b3c4d")
    assert "chatcmpl-xyz" in candidate_keys("chatcmpl-xyz-deadbeef")
    assert "chatcmpl-q" in candidate_keys("1_chatcmpl-q-12345678")
    assert "chatcmpl-m" in candidate_keys("chatcmpl-m_2-0badf00d")
    assert "cmpl-abc" not in candidate_keys("cmpl-abcd-0-1a2b3c4d")


def test_index_sums_parts_and_ranks_and_reads_incrementally(tmp_path):
    ranks(tmp_path, 2)
    idx = RequestEnergyIndex(tmp_path)
    write_lines(
        tmp_path, 0, [{"request_id": "cmpl-abc-0-1a2b3c4d", "energy_j": 1.0}, {"request_id": "cmpl-abc-1-5e6f7a8b", "energy_j": 2.0}]
    )
    idx.refresh()
    partial = idx.lookup("cmpl-abc")
    assert partial["status"] == "partial" and partial["energy_j"] is None and partial["parts"] == 2  # rank 1 missing
    assert idx.lookup("cmpl-zzz") is None
    write_lines(tmp_path, 1, [{"request_id": "cmpl-abc-0-1a2b3c4d", "energy_j": 0.5}])
    with open(tmp_path / "requests-rank1.jsonl", "a") as f:
        f.write(
            '{"request_id": "cmpl-abc-1-5e6f7a8b", "energy_j": 0.25, "gpu": "sim1", "rank": 1, "source": "simulated", "met'
        )  # half a line
    idx.refresh()
    assert idx.lookup("cmpl-abc")["status"] == "partial"
    with open(tmp_path / "requests-rank1.jsonl", "a") as f:
        f.write('hod": "model"}\n')
    idx.refresh()
    res = idx.lookup("cmpl-abc")
    assert res["status"] == "complete" and res["energy_j"] == pytest.approx(3.75)
    assert res["gpus"] == {"sim0": 3.0, "sim1": 0.75} and res["source"] == "simulated" and res["ranks_reported"] == 2
    write_lines(tmp_path, 0, [{"request_id": "chatcmpl-u-00000000", "energy_j": None}])
    write_lines(tmp_path, 1, [{"request_id": "chatcmpl-u-00000000", "energy_j": 1.0}])
    idx.refresh()
    assert idx.lookup("chatcmpl-u")["status"] == "unavailable" and idx.lookup("chatcmpl-u")["energy_j"] is None


def test_index_keeps_a_bounded_number_of_requests(tmp_path):
    idx = RequestEnergyIndex(tmp_path, max_requests=3)
    write_lines(tmp_path, 0, [{"request_id": f"cmpl-{i}-0-0000000{i}", "energy_j": float(i)} for i in range(5)])
    idx.refresh()
    assert idx.lookup("cmpl-0") is None and idx.lookup("cmpl-4")["energy_j"] == 4.0 and len(idx._keys) <= 3 * 8


def app_with_middleware(tmp_path, wait_s):
    async def completions(request):
        return JSONResponse({"id": "cmpl-late", "object": "text_completion", "choices": [{"text": "hi"}]})

    async def chat(request):
        async def gen():
            yield b'data: {"id": "chatcmpl-s"}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/chat/completions", chat, methods=["POST"])])
    app.add_middleware(RequestEnergyMiddleware, index=RequestEnergyIndex(tmp_path), wait_s=wait_s)
    return app


def test_header_waits_a_bounded_time_for_the_workers_line(tmp_path):
    ranks(tmp_path, 1)
    client = TestClient(app_with_middleware(tmp_path, wait_s=2.0))
    # The worker writes the line 0.2 s after the response is ready: the middleware holds it.
    t = threading.Timer(0.2, write_lines, (tmp_path, 0, [{"request_id": "cmpl-late-0-abcdef01", "energy_j": 0.125}]))
    t.start()
    r = client.post("/v1/completions", json={"prompt": "x"})
    t.join()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"  # body untouched
    assert r.headers["x-powersave-energy-status"] == "complete"
    assert float(r.headers["x-powersave-energy-j"]) == 0.125
    assert r.headers["x-powersave-energy-source"] == "simulated" and r.headers["x-powersave-energy-method"] == "model"
    assert int(r.headers["content-length"]) == len(r.content)


def test_pending_after_the_wait_then_the_route_serves_it(tmp_path):
    ranks(tmp_path, 1)
    client = TestClient(app_with_middleware(tmp_path, wait_s=0.05))
    t0 = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert time.monotonic() - t0 < 5  # bounded (generous bound for a loaded CI machine)
    assert r.headers["x-powersave-energy-status"] == "pending" and "x-powersave-energy-j" not in r.headers
    assert client.get("/powersave/requests/cmpl-late").status_code == 404
    write_lines(tmp_path, 0, [{"request_id": "cmpl-late-0-abcdef01", "energy_j": 0.5}])
    got = client.get("/powersave/requests/cmpl-late").json()
    assert got["energy_j"] == 0.5 and got["status"] == "complete" and got["id"] == "cmpl-late"
    assert client.get("/powersave/requests/cmpl-late?wait_ms=abc").status_code == 400


def test_route_waits_when_asked(tmp_path):
    ranks(tmp_path, 1)
    client = TestClient(app_with_middleware(tmp_path, wait_s=0.0))
    t = threading.Timer(0.2, write_lines, (tmp_path, 0, [{"request_id": "chatcmpl-w-abcdef01", "energy_j": 2.0}]))
    t.start()
    got = client.get("/powersave/requests/chatcmpl-w?wait_ms=5000").json()
    t.join()
    assert got["energy_j"] == 2.0


def test_streaming_responses_pass_through_untouched(tmp_path):
    client = TestClient(app_with_middleware(tmp_path, wait_s=1.0))
    r = client.post("/v1/chat/completions", json={"stream": True})
    assert r.text.startswith('data: {"id": "chatcmpl-s"}') and "x-powersave-energy-status" not in r.headers


# ---------------------------------------------------------------------------------------------
# vLLM hooks (0.32 in .venv): the app builder, and /metrics with --api-server-count > 1
# ---------------------------------------------------------------------------------------------
def test_app_hook_adds_the_middleware_to_vllms_app(tmp_path):
    pytest.importorskip("vllm")
    import importlib

    from vllm_powersave import request_energy, vllm_compat

    mod = importlib.import_module(vllm_compat.APP_BUILDERS[0])  # vllm serve imported it before create_engine_config
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["/tmp/model"])
    path = request_energy.configure(tmp_path, 0.0)
    assert vllm_compat.install_app_hook(path) == vllm_compat.APP_BUILDERS[0]
    try:
        app = mod.build_app(args, ("generate",))
        assert args.middleware == [path]
        ranks(tmp_path, 1)
        write_lines(tmp_path, 0, [{"request_id": "cmpl-v-0-abcdef01", "energy_j": 1.5}])
        got = TestClient(app).get("/powersave/requests/cmpl-v").json()
        assert got["energy_j"] == 1.5
    finally:  # undo the patch for other tests in this process
        orig = mod.build_app.__powersave_original__
        mod.build_app = orig
        vllm_compat._PATCHED.discard("app_hook")


def test_metrics_served_once_per_api_server_with_multiprocess_registry(tmp_path, monkeypatch):
    """--api-server-count > 1: vLLM sets PROMETHEUS_MULTIPROC_DIR and /metrics is answered from a
    registry holding only a MultiProcessCollector (the instrumentator's handler builds one per
    request; vLLM's get_prometheus_registry another). Ours must be in both, once, un-summed."""
    pytest.importorskip("vllm")
    from prometheus_client import (
        REGISTRY,
        CollectorRegistry,
        generate_latest,
        multiprocess,
    )
    from prometheus_fastapi_instrumentator import Instrumentator
    from starlette.applications import Starlette
    from vllm.v1.metrics import prometheus as vprom

    from vllm_powersave import metrics, vllm_compat

    stats = tmp_path / "stats"
    stats.mkdir()
    for r, j in ((0, 10.0), (1, 6.0)):
        (stats / f"rank{r}.json").write_text(
            json.dumps(
                {
                    "gpu": f"GPU-{r}",
                    "rank": r,
                    "source": "measured",
                    "energy_method": "energy-counter",
                    "energy_available": True,
                    "energy_j": {"prefill": 0.0, "decode": j, "mixed": 0.0, "idle": 1.0},
                    "tokens": {"prefill": 0, "decode": 40},
                    "window": {"window_s": 60.0, "seconds": 5.0, "energy_j": j, "prefill_tokens": 0, "decode_tokens": 32},
                }
            )
        )
    mp = tmp_path / "mp"
    mp.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp))  # what vLLM sets for --api-server-count > 1
    monkeypatch.setattr(metrics, "_REGISTERED", {})
    orig_init = multiprocess.MultiProcessCollector.__init__
    col = metrics.register_collector(stats, "t")
    try:
        texts = []
        # the route vLLM exposes first: the instrumentator's handler
        app = Starlette()
        Instrumentator(registry=CollectorRegistry()).expose(app)
        client = TestClient(app)
        texts += [client.get("/metrics").text for _ in range(2)]
        reg = vprom.get_prometheus_registry()  # vLLM's /metrics mount
        assert reg is not REGISTRY
        metrics.add_to_registry(reg)  # idempotent per registry
        texts.append(generate_latest(reg).decode())
    finally:
        REGISTRY.unregister(col)
        multiprocess.MultiProcessCollector.__init__ = orig_init
        vllm_compat._PATCHED.discard("metrics_registry")
    for text in texts:
        lines = [ln for ln in text.splitlines() if ln.startswith("powersave_engine_energy_joules_total{")]
        assert sorted(lines) == [
            'powersave_engine_energy_joules_total{phase="decode",source="measured"} 16.0',
            'powersave_engine_energy_joules_total{phase="idle",source="measured"} 2.0',
            'powersave_engine_energy_joules_total{phase="mixed",source="measured"} 0.0',
            'powersave_engine_energy_joules_total{phase="prefill",source="measured"} 0.0',
        ]
        # tokens once (same steps on both ranks), energy of both GPUs: 32 / 16
        assert 'powersave_tokens_per_joule{kind="decode",source="measured",window="60s"} 2.0' in text
    assert texts[0] == texts[1] == texts[2]  # any API server answers the same, un-summed figures


def test_api_server_processes_share_the_parents_stats_dir(tmp_path, monkeypatch):
    from vllm_powersave import _inherited_stats_dir
    from vllm_powersave.settings import ENV_SETTINGS_JSON

    parent = tmp_path / f"{os.getppid()}-123-abc"
    parent.mkdir()
    monkeypatch.setenv(ENV_SETTINGS_JSON, json.dumps({"stats_dir": str(parent)}))
    assert _inherited_stats_dir() == str(parent)
    own = tmp_path / f"{os.getpid()}-123-abc"
    own.mkdir()
    monkeypatch.setenv(ENV_SETTINGS_JSON, json.dumps({"stats_dir": str(own)}))
    assert _inherited_stats_dir() is None  # this process made it: a new server in-process gets its own


def test_wait_is_cooperative(tmp_path):
    """Waiting for one response's energy does not block the event loop for others."""
    idx = RequestEnergyIndex(tmp_path)

    async def main():
        ticks = 0

        async def other():
            nonlocal ticks
            for _ in range(10):
                await asyncio.sleep(0.005)
                ticks += 1

        await asyncio.gather(idx.wait("cmpl-none", 0.1), other())
        return ticks

    assert asyncio.run(main()) == 10


def test_data_parallel_request_is_complete_when_its_engine_reported(tmp_path):
    """With two DP engines (TP=2 each) a request runs on one engine: its two ranks complete it."""
    for rank, engine in ((0, 0), (1, 0), (2, 1), (3, 1)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "engine": engine}))
    idx = RequestEnergyIndex(tmp_path)
    write_lines(tmp_path, 2, [{"request_id": "cmpl-dp-0-1a2b3c4d", "energy_j": 1.0}])
    idx.refresh()
    assert idx.lookup("cmpl-dp")["status"] == "partial"  # rank 3 of engine 1 missing
    write_lines(tmp_path, 3, [{"request_id": "cmpl-dp-0-1a2b3c4d", "energy_j": 0.5}])
    idx.refresh()
    res = idx.lookup("cmpl-dp")
    assert res["status"] == "complete" and res["energy_j"] == pytest.approx(1.5)  # engine 0's ranks not awaited
