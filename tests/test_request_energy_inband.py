"""Per-request energy in-band: inside ``usage`` of a non-streamed body and of a stream's final
usage chunk (``docs/request-energy.md``), and the clients that must parse it: the ``openai``
client, ``vllm bench serve``'s request functions and ``loadtests``."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from loadtests.client import RequestOutput, send_request
from loadtests.datasets import RequestInput
from loadtests.metrics import calculate_metrics
from loadtests.report import compare_table, format_markdown
from vllm_powersave.request_energy import RequestEnergyIndex, RequestEnergyMiddleware


# ---------------------------------------------------------------------------------------------
# A vLLM-shaped server: chunks as vLLM 0.32 writes them (pydantic's compact JSON, ``object`` set,
# the final usage chunk with ``"choices":[]`` serialised with exclude_none), recorded by hand.
# ---------------------------------------------------------------------------------------------
def token_chunk(rid: str, chat: bool, text: str, finish: str | None = None) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        obj = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = {"id": rid, "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage_chunk(rid: str, chat: bool, completion_tokens: int = 3) -> bytes:
    obj = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 4, "total_tokens": 4 + completion_tokens, "completion_tokens": completion_tokens},
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


WORDS = ["Hello", " there", ' "usage":{"energy_j":9}']  # the last token tries to look like a usage key


def vllm_like_app(index, wait_s: float, gap_s: float = 0.0) -> Starlette:
    async def serve(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        rid = body.get("request_id") or ("chatcmpl-t" if chat else "cmpl-t")
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "length"} | (
                {"message": {"role": "assistant", "content": "".join(WORDS)}} if chat else {"text": "".join(WORDS)}
            )
            usage = {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
            return JSONResponse(
                {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": 1, "model": "m"}
                | {"choices": [choice], "usage": usage}
            )
        include = (body.get("stream_options") or {}).get("include_usage")

        async def gen():
            for i, w in enumerate(WORDS):
                yield token_chunk(rid, chat, w, "length" if i == len(WORDS) - 1 else None)
                await asyncio.sleep(gap_s)
            if include:
                yield usage_chunk(rid, chat)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route(p, serve, methods=["POST"]) for p in ("/v1/completions", "/v1/chat/completions")])
    app.add_middleware(RequestEnergyMiddleware, index=index, wait_s=wait_s)
    return app


def sse_data(text: str) -> list[str]:
    return [ln[len("data: ") :] for ln in text.split("\n") if ln.startswith("data: ")]


def ready_index(tmp_path, rid: str, j: float = 0.75) -> RequestEnergyIndex:
    (tmp_path / "rank0.json").write_text("{}")
    rec = {"request_id": f"{rid}-0-1a2b3c4d", "energy_j": j, "source": "simulated", "method": "model", "gpu": "sim0", "rank": 0}
    (tmp_path / "requests-rank0.jsonl").write_text(json.dumps(rec) + "\n")
    return RequestEnergyIndex(tmp_path)


# ---------------------------------------------------------------------------------------------
# The middleware
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,chat", [("/v1/completions", False), ("/v1/chat/completions", True)])
def test_stream_with_include_usage_gets_energy_in_its_final_usage_chunk(tmp_path, path, chat):
    rid = "chatcmpl-t" if chat else "cmpl-t"
    client = TestClient(vllm_like_app(ready_index(tmp_path, rid), wait_s=1.0))
    r = client.post(path, json={"stream": True, "stream_options": {"include_usage": True}})
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    expected_tokens = [token_chunk(rid, chat, w, "length" if i == 2 else None) for i, w in enumerate(WORDS)]
    assert [("data: " + d + "\n\n").encode() for d in data[:3]] == expected_tokens  # token chunks byte-identical
    usage = json.loads(data[3])["usage"]
    assert usage == {
        "prompt_tokens": 4,
        "total_tokens": 7,
        "completion_tokens": 3,
        "energy_j": 0.75,
        "energy_status": "complete",
        "energy_source": "simulated",
        "energy_method": "model",
    }


def test_stream_without_include_usage_is_untouched(tmp_path):
    client = TestClient(vllm_like_app(ready_index(tmp_path, "cmpl-t"), wait_s=1.0))
    r = client.post("/v1/completions", json={"stream": True})
    assert r.content == b"".join(token_chunk("cmpl-t", False, w, "length" if i == 2 else None) for i, w in enumerate(WORDS)) + (
        b"data: [DONE]\n\n"
    )


def test_non_streamed_body_carries_energy_in_usage(tmp_path):
    client = TestClient(vllm_like_app(ready_index(tmp_path, "chatcmpl-t", 1.25), wait_s=1.0))
    r = client.post("/v1/chat/completions", json={})
    body = r.json()
    assert body["usage"]["energy_j"] == 1.25 and body["usage"]["energy_status"] == "complete"
    assert body["usage"]["energy_method"] == "model" and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["message"]["content"] == "".join(WORDS)  # the look-alike key in the text is left alone
    assert int(r.headers["content-length"]) == len(r.content) and r.headers["x-powersave-energy-j"] == "1.250000"


def test_a_figure_that_never_comes_leaves_the_usage_chunk_pending_after_the_wait(tmp_path):
    (tmp_path / "rank0.json").write_text("{}")
    client = TestClient(vllm_like_app(RequestEnergyIndex(tmp_path), wait_s=0.15))
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json={"stream": True, "stream_options": {"include_usage": True}})
    took_s = time.monotonic() - t0
    usage = json.loads(sse_data(r.text)[3])["usage"]
    assert usage["energy_status"] == "pending" and usage["energy_j"] is None and usage["energy_source"] is None
    assert usage["completion_tokens"] == 3
    assert 0.15 <= took_s < 5  # waited its response_wait_ms, and no longer than a loaded CI machine needs


class GatedIndex:
    """A figure that is ready only once the test says so; records what the stream had sent by then."""

    def __init__(self, sent: list[bytes]) -> None:
        self.ready = asyncio.Event()
        self.sent = sent
        self.sent_at_wait: list[bytes] | None = None

    async def wait(self, rid: str, timeout_s: float, parts: int = 0):
        self.sent_at_wait = list(self.sent)
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except TimeoutError:
            return None
        return {"status": "complete", "energy_j": 2.5, "source": "measured", "method": "energy-counter"}


def test_tokens_are_not_delayed_while_the_figure_is_awaited():
    """The figure becomes ready only after every token chunk has reached the client: had any token
    chunk waited for it, the usage chunk would come out pending."""
    sent: list[bytes] = []
    index = GatedIndex(sent)
    rid = "chatcmpl-g"

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for w in WORDS:
            await send({"type": "http.response.body", "body": token_chunk(rid, True, w), "more_body": True})
        await send({"type": "http.response.body", "body": usage_chunk(rid, True), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def send(message):
        if message["type"] == "http.response.body":
            sent.append(message["body"])
            if len(sent) == len(WORDS):
                # A worker publishes the figure only now, after the last token went out.
                asyncio.get_running_loop().call_later(0.02, index.ready.set)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    mw = RequestEnergyMiddleware(app, index, wait_s=2.0)
    asyncio.run(mw({"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": ""}, receive, send))
    assert index.sent_at_wait == [token_chunk(rid, True, w) for w in WORDS]  # all tokens out before the wait began
    usage = json.loads(sent[len(WORDS)][len(b"data: ") :])["usage"]
    assert usage["energy_j"] == 2.5 and usage["energy_source"] == "measured" and sent[-1] == b"data: [DONE]\n\n"


def test_continuous_usage_chunks_are_not_held():
    """With ``continuous_usage_stats`` every token chunk has a ``usage``: none of them waits."""
    index = GatedIndex([])
    rid = "cmpl-c"
    chunk = token_chunk(rid, False, "x").replace(b"}]}", b'}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}')
    out: list[bytes] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def send(message):
        out.append(message.get("body", b""))

    asyncio.run(RequestEnergyMiddleware(app, index, wait_s=2.0)({"type": "http", "method": "POST", "path": "/v1/completions"}, None, send))
    assert out[1] == chunk and index.sent_at_wait is None


# ---------------------------------------------------------------------------------------------
# The clients, against a real HTTP server
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def served(tmp_path):
    """The vLLM-shaped app with the middleware behind uvicorn on a free port; the figure is ready."""
    uvicorn = pytest.importorskip("uvicorn")
    (tmp_path / "rank0.json").write_text("{}")
    lines = [
        {"request_id": f"{rid}-0-1a2b3c4d", "energy_j": 0.5, "source": "simulated", "method": "model", "gpu": "sim0", "rank": 0}
        for rid in ("cmpl-t", "chatcmpl-t")
    ]
    (tmp_path / "requests-rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(vllm_like_app(RequestEnergyIndex(tmp_path), wait_s=1.0), log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    t.join(timeout=5)
    sock.close()


def test_openai_client_parses_streamed_and_non_streamed_energy(served):
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletionChunk
    from openai.types.completion import Completion

    client = openai.OpenAI(base_url=served + "/v1", api_key="x")
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == "".join(WORDS)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 3
    assert last.usage.model_extra == {"energy_j": 0.5, "energy_status": "complete", "energy_source": "simulated", "energy_method": "model"}
    ChatCompletionChunk.model_validate(last.model_dump())  # strict validation of the same chunk
    done = list(client.completions.create(model="m", prompt="hi", stream=True, stream_options={"include_usage": True}))
    assert Completion.model_validate(done[-1].model_dump()).usage.energy_j == 0.5
    whole = client.completions.create(model="m", prompt="hi")
    assert whole.usage.total_tokens == 7 and whole.usage.energy_j == 0.5 and whole.choices[0].text == "".join(WORDS)


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_bench_serve_request_functions_parse_the_stream(served, chat):
    pytest.importorskip("vllm")
    from vllm.benchmarks.lib import endpoint_request_func as erf

    fn = erf.async_request_openai_chat_completions if chat else erf.async_request_openai_completions
    url = served + ("/v1/chat/completions" if chat else "/v1/completions")

    async def main():
        async with aiohttp.ClientSession() as s:
            return await fn(erf.RequestFuncInput(prompt="hi", api_url=url, prompt_len=1, output_len=3, model="m"), s)

    out = asyncio.run(main())
    assert out.success, out.error
    assert out.output_tokens == 3 and out.prompt_len == 4 and out.generated_text == "".join(WORDS) and len(out.itl) == 2


@pytest.mark.parametrize("endpoint,stream", [("chat", True), ("completions", True), ("completions", False)])
def test_loadtests_client_collects_the_request_joules(served, endpoint, stream):
    async def main():
        async with aiohttp.ClientSession() as s:
            return await send_request(s, served, endpoint, "m", RequestInput(prompt="hi", prompt_len=1, output_len=3), stream=stream)

    out = asyncio.run(main())
    assert out.success, out.error
    assert out.output_tokens == 3 and out.energy_j == 0.5 and out.energy_status == "complete" and out.energy_source == "simulated"


def test_loadtests_reports_per_request_joules_only_when_present():
    req = RequestInput(prompt="hi", prompt_len=1, output_len=3)
    plain = RequestOutput(success=True, ttft=0.1, latency=0.2, output_tokens=3)
    with_j = [
        RequestOutput(success=True, ttft=0.1, latency=0.2, output_tokens=3, energy_j=j, energy_status=st, energy_source="measured")
        for j, st in ((0.5, "complete"), (1.5, "complete"), (None, "pending"))
    ]
    m = calculate_metrics([req] * 3, with_j, 1.0)
    assert m["request_energy_j"] == [0.5, 1.5, None] and m["request_energy_statuses"] == ["complete", "complete", "pending"]
    assert m["request_energy_reported"] == 2 and m["mean_request_energy_j"] == 1.0 and m["total_request_energy_j"] == 2.0
    none = calculate_metrics([req], [plain], 1.0)
    assert not any(k.startswith(("request_energy", "mean_request_energy")) for k in none)
    assert "Per-request energy, mean (J) | 1.0000 (measured; 2 of 3 requests)" in format_markdown(m)
    assert "Per-request energy" not in format_markdown(none)
    assert "| Per-request energy, mean (J) | 1.0000 (measured; 2 of 3 requests) | n/a |" in compare_table({"a": m, "b": none})
    assert "Per-request energy" not in compare_table({"b": none})
