"""Per-request energy under hostile or broken input: ids that look like paths, absurd wait_ms,
many concurrent requests and waiters, request files truncated, replaced or cut mid-line, garbage
figures, header injection through a corrupted file, stale rank snapshots, a missing stats dir."""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vllm_powersave import request_energy
from vllm_powersave.request_energy import (
    MAX_ROUTE_WAITERS,
    RequestEnergyIndex,
    RequestEnergyMiddleware,
)


def line(rid: str, j, rank: int = 0, **kw) -> str:
    return (
        json.dumps({"request_id": rid, "energy_j": j, "source": "simulated", "method": "model", "gpu": f"sim{rank}", "rank": rank, **kw})
        + "\n"
    )


def append(d: Path, text: str, rank: int = 0) -> None:
    with open(d / f"requests-rank{rank}.jsonl", "a") as f:
        f.write(text)


def strict(text: str):
    """JSON as a strict client parses it (NaN and Infinity are not JSON)."""

    def no(c):
        raise ValueError(f"non-JSON constant {c}")

    return json.loads(text, parse_constant=no)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_truncated_or_replaced_request_files_are_read_again_from_the_start(tmp_path):
    (tmp_path / "rank0.json").write_text("{}")
    idx = RequestEnergyIndex(tmp_path)
    append(tmp_path, "".join(line(f"cmpl-old{i}-0-0000000{i}", 1.0) for i in range(5)))
    idx.refresh()
    assert idx.lookup("cmpl-old4")["energy_j"] == 1.0
    (tmp_path / "requests-rank0.jsonl").write_text(line("cmpl-new-0-00000000", 2.5))  # truncated, shorter
    idx.refresh()
    assert idx.lookup("cmpl-new")["energy_j"] == 2.5
    # Replaced by a new file (another inode) already longer than what was read of the old one.
    os.unlink(tmp_path / "requests-rank0.jsonl")
    (tmp_path / "requests-rank0.jsonl").write_text("".join(line(f"cmpl-r{i}-0-0000000{i}", 0.5) for i in range(8)))
    idx.refresh()
    assert [idx.lookup(f"cmpl-r{i}")["energy_j"] for i in range(8)] == [0.5] * 8


def test_a_line_cut_by_a_dying_writer_does_not_swallow_the_next_record(tmp_path):
    (tmp_path / "rank0.json").write_text("{}")
    idx = RequestEnergyIndex(tmp_path)
    append(tmp_path, line("cmpl-a-0-00000000", 1.0)[:30])  # the worker died mid-write
    idx.refresh()
    append(tmp_path, line("cmpl-b-0-11111111", 3.0) + line("cmpl-c-0-22222222", 4.0))  # the next worker appends
    idx.refresh()
    assert idx.lookup("cmpl-a") is None
    assert idx.lookup("cmpl-b")["energy_j"] == 3.0 and idx.lookup("cmpl-c")["energy_j"] == 4.0


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "-1.5", '"abc"', '"1.5"', "true", "[1]", "{}", "1e999"])
def test_garbage_figures_count_as_unavailable_and_never_reach_the_client_as_nan(tmp_path, bad):
    (tmp_path / "rank0.json").write_text("{}")
    append(
        tmp_path,
        f'{{"request_id": "cmpl-g-0-00000000", "energy_j": {bad}, "rank": 0, "gpu": "sim0", "source": "simulated", "method": "model"}}\n',
    )
    idx = RequestEnergyIndex(tmp_path)
    idx.refresh()
    res = idx.lookup("cmpl-g")
    assert res["status"] == "unavailable" and res["energy_j"] is None
    strict(json.dumps(res))
    assert request_energy.energy_headers(res)[0] == (b"x-powersave-energy-status", b"unavailable")


def test_lines_that_are_not_records_are_skipped(tmp_path):
    (tmp_path / "rank0.json").write_text("{}")
    append(
        tmp_path,
        '[1, 2]\n5\n"x"\nnull\n{"rank": 0}\n{"request_id": "cmpl-x-0-00000000", "rank": "zero"}\n\xff\xfe\n'
        '{"request_id": "cmpl-x-0-00000000", "rank": 1e999, "energy_j": 1}\n' + line("cmpl-ok-0-00000000", 0.25),
    )
    idx = RequestEnergyIndex(tmp_path)
    idx.refresh()
    assert idx.lookup("cmpl-ok")["energy_j"] == 0.25 and idx.lookup("cmpl-x") is None


def test_header_values_from_a_corrupted_file_cannot_inject_headers(tmp_path):
    (tmp_path / "rank0.json").write_text("{}")
    append(tmp_path, line("cmpl-late-0-00000000", 0.5, source="simulated\r\nx-evil: 1", method="model\n"))

    async def completions(request):
        return JSONResponse({"id": "cmpl-late", "choices": [{"text": "hi"}]})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.add_middleware(RequestEnergyMiddleware, index=RequestEnergyIndex(tmp_path), wait_s=1.0)
    r = TestClient(app).post("/v1/completions", json={})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
    assert "x-evil" not in r.headers
    assert r.headers["x-powersave-energy-source"] == "simulated??x-evil:?1" and r.headers["x-powersave-energy-method"] == "model?"
    for value in r.headers.values():
        assert "\r" not in value and "\n" not in value


def test_stale_rank_snapshots_of_dead_writers_do_not_hold_requests_pending(tmp_path):
    """A reused stats_dir still holds rank1.json of an earlier TP=2 server: it must not make every
    request of this TP=1 server wait for a rank that will never report."""
    (tmp_path / "rank0.json").write_text(json.dumps({"pid": os.getpid()}))
    old = tmp_path / "rank1.json"
    old.write_text(json.dumps({"pid": dead_pid()}))
    past = time.time() - 3600
    os.utime(old, (past, past))
    append(tmp_path, line("cmpl-s-0-00000000", 1.0))
    idx = RequestEnergyIndex(tmp_path)
    idx.refresh()
    res = idx.lookup("cmpl-s")
    assert res["status"] == "complete" and res["ranks_expected"] == 1
    # A fresh snapshot of a PID not known here (a Ray relay writes those for other nodes) counts.
    old.write_text(json.dumps({"pid": dead_pid()}))
    idx._ranks_at = -1e9
    idx.refresh()
    assert idx.lookup("cmpl-s")["status"] == "partial"


def app(tmp_path, wait_s=0.0):
    async def completions(request: Request):
        body = await request.json()
        return JSONResponse({"id": body["id"], "choices": [{"text": "hi"}]})

    async def anything(request: Request):
        return JSONResponse({"app": True}, status_code=405)

    a = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/powersave/requests/{rest:path}", anything, methods=["POST", "PUT", "DELETE", "PATCH"]),
        ]
    )
    a.add_middleware(RequestEnergyMiddleware, index=RequestEnergyIndex(tmp_path), wait_s=wait_s)
    return a


async def asgi_get(asgi, path: str):
    msgs = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m):
        msgs.append(m)

    await asgi(
        {
            "type": "http",
            "method": "GET",
            "path": path,
            "raw_path": path.encode("utf-8", "surrogateescape"),
            "query_string": b"",
            "root_path": "",
            "headers": [],
            "http_version": "1.1",
            "scheme": "http",
            "server": ("t", 80),
            "client": ("c", 1),
        },
        receive,
        send,
    )
    return msgs[0]["status"], msgs[0]["headers"], b"".join(m.get("body", b"") for m in msgs[1:]).decode()


@pytest.mark.parametrize(
    "rid",
    [
        "..%2F..%2F..%2Fetc%2Fpasswd",
        "../../etc/passwd",
        "%2E%2E",
        "..",
        "%00",
        "rank0.json",
        "requests-rank0.jsonl",
        "%2Fetc%2Fpasswd",
        "a" * 8000,
        "cmpl-x%0d%0ax-evil:%201",
        "~root",
    ],
)
def test_route_ids_are_never_paths(tmp_path, monkeypatch, rid):
    (tmp_path / "rank0.json").write_text("{}")
    append(tmp_path, line("cmpl-ok-0-00000000", 1.0))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    opened: list[str] = []
    real_open = builtins.open

    def spy(file, *a, **kw):
        opened.append(os.path.realpath(file) if isinstance(file, (str, bytes, os.PathLike)) else str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", spy)
    # As uvicorn hands it over: percent-decoded, not normalised (an HTTP client would fold "..").
    status, headers, body = asyncio.run(asgi_get(app(tmp_path), "/powersave/requests/" + unquote(rid)))
    monkeypatch.setattr(builtins, "open", real_open)
    assert status == 404 and strict(body)["error"]
    assert [k for k, _ in headers] == [b"content-type", b"content-length"]
    root = os.path.realpath(tmp_path)
    assert all(p.startswith(root + os.sep) for p in opened if not p.endswith(".py")), opened
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_route_is_read_only(tmp_path, method):
    (tmp_path / "rank0.json").write_text("{}")
    append(tmp_path, line("cmpl-ok-0-00000000", 1.0))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    r = TestClient(app(tmp_path)).request(method, "/powersave/requests/cmpl-ok", json={"energy_j": 0})
    assert r.json() == {"app": True}  # not ours: handed to the app untouched
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_missing_stats_dir_gives_404_and_pending_headers(tmp_path):
    gone = tmp_path / "never-created"
    c = TestClient(app(gone, wait_s=0.05))
    r = c.get("/powersave/requests/cmpl-x")
    assert r.status_code == 404 and r.json()["status"] == "unknown"
    r = c.post("/v1/completions", json={"id": "cmpl-x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
    assert r.headers["x-powersave-energy-status"] == "pending"
    assert not gone.exists()  # nothing created


class RecordingIndex:
    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.waits: list[float] = []
        self.gate = gate

    async def wait(self, rid, timeout_s, parts=0):
        self.waits.append(timeout_s)
        if self.gate is not None and timeout_s > 0:
            await self.gate.wait()


async def call(mw, path: str, query: bytes = b"") -> int:
    out = {}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]

    await mw({"type": "http", "method": "GET", "path": path, "query_string": query, "root_path": ""}, None, send)
    return out["status"]


@pytest.mark.parametrize(
    "q,expect",
    [
        (b"wait_ms=1e308", 10.0),
        (b"wait_ms=inf", 10.0),
        (b"wait_ms=nan", 0.0),
        (b"wait_ms=-5", 0.0),
        (b"wait_ms=99999999999999999999999", 10.0),
        (b"", 0.0),
        (b"wait_ms=100&wait_ms=1e9", 0.1),
    ],
)
def test_wait_ms_is_clamped(q, expect):
    idx = RecordingIndex()
    status = asyncio.run(call(RequestEnergyMiddleware(None, idx), "/powersave/requests/cmpl-x", q))
    assert status == 404 and idx.waits == [pytest.approx(expect)]


@pytest.mark.parametrize("q", [b"wait_ms=10ms", b"wait_ms=0x10", b"wait_ms=%ff"])
def test_bad_wait_ms_is_a_400_naming_it(q):
    out = {}

    async def send(msg):
        out.setdefault("msgs", []).append(msg)

    asyncio.run(
        RequestEnergyMiddleware(None, RecordingIndex())(
            {"type": "http", "method": "GET", "path": "/powersave/requests/cmpl-x", "query_string": q}, None, send
        )
    )
    assert out["msgs"][0]["status"] == 400 and "wait_ms" in json.loads(out["msgs"][1]["body"])["error"]


def test_at_most_max_route_waiters_wait_at_once():
    async def main():
        gate = asyncio.Event()
        idx = RecordingIndex(gate)
        mw = RequestEnergyMiddleware(None, idx)
        tasks = [asyncio.create_task(call(mw, f"/powersave/requests/cmpl-{i}", b"wait_ms=10000")) for i in range(MAX_ROUTE_WAITERS + 20)]
        for _ in range(100):
            await asyncio.sleep(0)
        waiting = sum(1 for w in idx.waits if w > 0)
        immediate = sum(1 for w in idx.waits if w == 0)
        done_early = sum(t.done() for t in tasks)
        gate.set()
        statuses = await asyncio.gather(*tasks)
        return waiting, immediate, done_early, statuses, mw.route_waiters

    waiting, immediate, done_early, statuses, left = asyncio.run(main())
    assert waiting == MAX_ROUTE_WAITERS and immediate == 20 and done_early == 20
    assert statuses == [404] * (MAX_ROUTE_WAITERS + 20) and left == 0


def test_concurrent_completions_each_get_their_own_figure(tmp_path):
    """50 non-streaming completions in flight while the worker writes their lines in another order:
    every response carries its own request's joules."""
    (tmp_path / "rank0.json").write_text("{}")
    ids = [f"cmpl-c{i}" for i in range(50)]
    a = app(tmp_path, wait_s=5.0)

    def writer():
        time.sleep(0.1)
        for i in reversed(range(50)):
            append(tmp_path, line(f"{ids[i]}-0-{i:08x}", i / 8))

    async def one(rid):
        msgs = []

        async def receive():
            return {"type": "http.request", "body": json.dumps({"id": rid}).encode(), "more_body": False}

        async def send(m):
            msgs.append(m)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "http_version": "1.1",
            "scheme": "http",
            "server": ("t", 80),
            "client": ("c", 1),
        }
        await a(scope, receive, send)
        return dict(msgs[0]["headers"])

    async def main():
        return await asyncio.gather(*[one(r) for r in ids])

    t = threading.Thread(target=writer)
    t.start()
    try:
        heads = asyncio.run(main())
    finally:
        t.join()
    assert [h[b"x-powersave-energy-status"] for h in heads] == [b"complete"] * 50
    assert [float(h[b"x-powersave-energy-j"]) for h in heads] == [i / 8 for i in range(50)]
