"""A response that ran several internal requests (``n`` samples, several prompts) gets an in-band
figure only once every part is recorded: vLLM finishes and records the parts one at a time, and a
figure over the first part alone was reported ``complete`` at half the energy (found against a
real ``vllm serve``, ``n=2``)."""

from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vllm_powersave.request_energy import RequestEnergyIndex, RequestEnergyMiddleware

RID = "cmpl-n2"


def _chunk(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _app(index: RequestEnergyIndex) -> Starlette:
    async def serve(request: Request) -> Response:
        body = await request.json()
        usage = {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4}
        if not body.get("stream"):
            choices = [{"index": k, "text": "ab", "finish_reason": "length"} for k in range(2)]
            return JSONResponse({"id": RID, "object": "text_completion", "created": 1, "model": "m", "choices": choices, "usage": usage})

        async def gen():
            for k in range(2):
                for fin in (None, "length"):
                    yield _chunk(
                        {
                            "id": RID,
                            "object": "text_completion",
                            "created": 1,
                            "model": "m",
                            "choices": [{"index": k, "text": "a", "finish_reason": fin}],
                        }
                    )
            yield _chunk({"id": RID, "object": "text_completion", "created": 1, "model": "m", "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", serve, methods=["POST"])])
    app.add_middleware(RequestEnergyMiddleware, index=index, wait_s=0.05)
    return app


def _index(tmp_path, samples: list[int]) -> RequestEnergyIndex:
    (tmp_path / "rank0.json").write_text("{}")
    lines = [
        {"request_id": f"{k}_{RID}-0-1a2b3c4d", "energy_j": 0.5, "source": "simulated", "method": "model", "gpu": "sim0", "rank": 0}
        for k in samples
    ]
    (tmp_path / "requests-rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return RequestEnergyIndex(tmp_path)


def _usage(client: TestClient, stream: bool) -> dict:
    body = {"prompt": "x", "n": 2, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    r = client.post("/v1/completions", json=body)
    if not stream:
        return r.json()["usage"]
    data = [ln[len("data: ") :] for ln in r.text.split("\n") if ln.startswith("data: ") and ln != "data: [DONE]"]
    return json.loads(data[-1])["usage"]


def test_one_of_two_samples_recorded_is_pending_not_a_complete_half(tmp_path):
    client = TestClient(_app(_index(tmp_path, [0])))
    for stream in (False, True):
        u = _usage(client, stream)
        assert (u["energy_status"], u["energy_j"]) == ("pending", None), (stream, u)


def test_both_samples_recorded_sum_to_the_figure(tmp_path):
    client = TestClient(_app(_index(tmp_path, [0, 1])))
    for stream in (False, True):
        u = _usage(client, stream)
        assert (u["energy_status"], u["energy_j"]) == ("complete", 1.0), (stream, u)
