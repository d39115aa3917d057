"""Per-request energy for HTTP clients (API-server process).

Workers write one JSON line per finished request to ``<stats_dir>/requests-rank<N>.jsonl``
(``docs/request-energy.md`` says what a figure means). This module reads those files in the
API server and returns the figures two ways that OpenAI clients ignore safely:

* **Response headers** on non-streaming ``/v1/completions`` and ``/v1/chat/completions``
  responses (status 200, ``application/json``)::

      x-powersave-energy-status: complete | pending | unavailable
      x-powersave-energy-j: 0.731542          (only when complete: joules, sum over the engine's GPUs)
      x-powersave-energy-source: measured | simulated
      x-powersave-energy-method: energy-counter | power-sampling | model

  Attribution is tick-based: a request's energy is final once a worker has seen vLLM report it
  finished (with the next engine step, or the empty step vLLM runs when a batch drains) and has
  ticked; the step hook wakes the publisher at once for that, so the lag is a few ms plus one
  file write. The middleware holds the finished response for at most ``response_wait_ms``
  (settings, default 200 ms) waiting for every rank's line; past that the response goes out with
  ``status: pending`` and no figure (never a partial sum over some ranks). Streaming responses
  send their headers before the request finishes and get no headers.

* **In-band, inside ``usage``** (``energy_j``: joules or null, ``energy_status``: the header's
  status, ``energy_source``, ``energy_method``; null where the header is left out): in the body of
  a non-streaming completion (same wait as the headers), and in the final usage chunk of a stream
  (``stream_options: {"include_usage": true}``: the chunk with ``"choices": []``). Chunks before
  it pass through at once and untouched; only the usage chunk waits, at most
  ``response_wait_ms``, then goes out with ``pending`` and null. OpenAI's ``CompletionUsage``
  keeps unknown keys, and clients that read ``completion_tokens`` ignore them.

* **A read-only route** ``GET /powersave/requests/{id}[?wait_ms=N]``, ``id`` being the ``id`` of
  the OpenAI response (``cmpl-...``, ``chatcmpl-...``). 200 with JSON (``energy_j``,
  ``status``, ``gpus``: joules per GPU, ``ranks_expected``/``ranks_reported``, ``source``,
  ``method``, ``parts``: vLLM's internal requests summed, e.g. one per prompt or per ``n``
  sample); 404 while nothing is recorded. ``wait_ms`` (at most 10000) waits for completion.
  Like ``/metrics`` and ``/health`` it is outside vLLM's ``--api-key`` guard (which covers
  ``/v1`` paths); response ids are random, and the route reveals joules only.

Id matching: vLLM runs a response as one or more internal requests named
``[<k>_]<response id>[-<prompt index>|_<prompt index>]-<8 hex>`` (``<k>_``: sample ``k`` of ``n``;
the 8 hex characters are vLLM's uniqueness suffix). A line is filed under every prefix form of
its id, so the route and the header find all parts of a response. Two client-chosen
``X-Request-Id`` values that differ only by such a suffix (``a`` and ``a-1``) would share figures.
Completeness counts the ranks that publish a snapshot in ``stats_dir``; with data parallelism,
only the ranks of the engine that served the request (snapshot ``engine``); snapshots left by dead
writers (a reused ``stats_dir``) are not counted (``metrics.snapshot_is_stale``).

Robustness: the route only looks ids up in memory (an id is never a path; nothing outside
``stats_dir`` is read, nothing is written); a ``requests-rank<N>.jsonl`` that is truncated or
replaced is read again from its start; a line cut off by a dying writer does not swallow the next
writer's first line; a figure that is not a finite, non-negative number counts as unavailable;
text fields reach headers only as ``[A-Za-z0-9,._:-]``; waits poll with back-off (5 ms up to
100 ms) and at most ``MAX_ROUTE_WAITERS`` route calls wait at once (others answer at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from .stats_contract import REQUESTS_GLOB, SNAPSHOT_GLOB, snapshot_from_json

log = logging.getLogger("vllm.powersave")

_SUFFIX = re.compile(r"^(.*)-[0-9a-f]{8}$")
_INDEX = re.compile(r"^(.*)[-_]\d+$")
_CHILD = re.compile(r"^\d+_(.+)$")
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
ROUTE = "/powersave/requests/"
MAX_ROUTE_WAIT_S = 10.0
#: Route calls that may wait at once (the route is outside --api-key: bound what it can cost).
MAX_ROUTE_WAITERS = 64
#: How often the set of live ranks is re-read (s); lines are re-read at every poll.
RANKS_EVERY_S = 0.5
_RECORD_START = b'{"request_id"'
_UNSAFE = re.compile(r"[^A-Za-z0-9,._:-]")


def candidate_keys(internal_id: str) -> set[str]:
    """Every response id an internal vLLM request id can belong to (see the module docstring)."""
    out: set[str] = set()
    bases = [internal_id]
    m = _CHILD.match(internal_id)
    if m:
        bases.append(m.group(1))
    for b in bases:
        forms = [b]
        s = _SUFFIX.match(b)
        if s:
            forms.append(s.group(1))
        for f in list(forms):
            i = _INDEX.match(f)
            if i:
                forms.append(i.group(1))
        out.update(forms)
    return out


class RequestEnergyIndex:
    """In-memory index over the workers' ``requests-rank<N>.jsonl`` files, read incrementally.

    Keeps the newest ``max_requests`` internal requests. Not thread-safe; used from the API
    server's event loop.
    """

    def __init__(self, stats_dir: str | Path, max_requests: int = 100_000) -> None:
        self.stats_dir = Path(stats_dir)
        self.max_requests = max_requests
        self._offsets: dict[Path, int] = {}
        self._inodes: dict[Path, int] = {}
        self._heads: dict[Path, bytes] = {}  # first bytes read of each file: a changed head = a new file
        self._partial: dict[Path, bytes] = {}
        self._ranks_at = -1.0
        # internal id -> {rank: record}
        self._records: OrderedDict[str, dict[int, dict[str, Any]]] = OrderedDict()
        self._keys: dict[str, set[str]] = {}
        self._ranks = 0
        # Data parallelism: live ranks per DP engine, and each rank's engine (from the snapshots).
        self._engine_ranks: dict[int, int] = {}
        self._rank_engine: dict[int, int] = {}
        self._unknown_ranks = 0
        self._last_refresh = -1.0

    def refresh(self, min_interval_s: float = 0.0) -> None:
        """Read lines appended since the last call (at most once per ``min_interval_s``)."""
        now = time.monotonic()
        if now - self._last_refresh < min_interval_s:
            return
        self._last_refresh = now
        if not self.stats_dir.is_dir():
            return
        if now - self._ranks_at >= RANKS_EVERY_S:
            self._ranks_at = now
            self._ranks = self._live_ranks()
        for path in sorted(self.stats_dir.glob(REQUESTS_GLOB)):
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    head = self._heads.get(path, b"")
                    if (
                        st.st_ino != self._inodes.get(path, st.st_ino)
                        or st.st_size < self._offsets.get(path, 0)
                        or os.pread(f.fileno(), len(head), 0) != head
                    ):
                        # Replaced or truncated (a new server in the same stats_dir, log rotation;
                        # a new file may get the old inode number back): read it from the start.
                        self._offsets[path] = 0
                        self._partial.pop(path, None)
                    self._inodes[path] = st.st_ino
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
                    if len(head) < 64 and data:
                        self._heads[path] = os.pread(f.fileno(), 64, 0)
            except OSError:
                continue
            if not data:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            data = self._partial.pop(path, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                self._partial[path] = lines[-1]  # a line still being written
            for raw in lines[:-1]:
                self._add_line(raw)

    def _live_ranks(self) -> int:
        """Rank snapshots in ``stats_dir`` not left behind by a dead writer (also per DP engine)."""
        from .metrics import snapshot_is_stale

        n, unknown = 0, 0
        per_engine: dict[int, int] = {}
        rank_engine: dict[int, int] = {}
        now = time.time()
        for p in self.stats_dir.glob(SNAPSHOT_GLOB):
            try:
                fresh = now - p.stat().st_mtime <= 1.0
                snap = snapshot_from_json(p.read_text())
                live = fresh or not snapshot_is_stale(p, snap, now)
            except (OSError, ValueError):
                n += 1  # unreadable: a rank all the same, its lines may be missing
                unknown += 1
                continue
            if not live:
                continue
            n += 1
            engine, rank = snap.get("engine", 0) if isinstance(snap, dict) else 0, snap.get("rank") if isinstance(snap, dict) else None
            if isinstance(engine, int) and isinstance(rank, int):
                per_engine[engine] = per_engine.get(engine, 0) + 1
                rank_engine[rank] = engine
            else:
                unknown += 1
        self._engine_ranks, self._rank_engine, self._unknown_ranks = per_engine, rank_engine, unknown
        return n

    def _add_line(self, raw: bytes) -> None:
        for attempt in (raw, raw[raw.rfind(_RECORD_START) :] if raw.rfind(_RECORD_START) > 0 else None):
            # The second attempt: a writer died mid-line and the next one appended after it; the
            # cut-off head is lost, the complete record behind it is not.
            if attempt is None:
                return
            try:
                self._add(json.loads(attempt))
                return
            except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
                continue

    @staticmethod
    def _clean(rec: dict[str, Any]) -> dict[str, Any]:
        j = rec.get("energy_j")
        ok = isinstance(j, (int, float)) and not isinstance(j, bool) and math.isfinite(j) and j >= 0
        return {
            **rec,
            "energy_j": float(j) if ok else None,
            **{k: _UNSAFE.sub("?", str(rec.get(k, "?")))[:128] for k in ("source", "method", "gpu")},
        }

    def _add(self, rec: dict[str, Any]) -> None:
        rid = str(rec["request_id"])
        rank = int(rec.get("rank", 0))
        if rid not in self._records:
            self._records[rid] = {}
            for k in candidate_keys(rid):
                self._keys.setdefault(k, set()).add(rid)
            while len(self._records) > self.max_requests:
                old, _ = self._records.popitem(last=False)
                for k in candidate_keys(old):
                    ids = self._keys.get(k)
                    if ids is not None:
                        ids.discard(old)
                        if not ids:
                            del self._keys[k]
        self._records[rid][rank] = self._clean(rec)

    def lookup(self, response_id: str, parts: int = 0) -> dict[str, Any] | None:
        """Energy of one OpenAI response id, or ``None`` if no line names it yet.

        ``parts``: internal requests the response is known to have run (its choices, one per
        prompt and ``n`` sample); fewer recorded ones leave the status ``partial``, as the parts
        of an ``n > 1`` response finish and are recorded one at a time.

        ``status``: ``complete`` (every part reported by every rank), ``partial`` (some lines
        missing: ``energy_j`` is then ``None``), ``unavailable`` (a rank's meter was unavailable).
        """
        ids = self._keys.get(response_id)
        if not ids:
            return None
        gpus: dict[str, float] = {}
        sources, methods = set(), set()
        unavailable = False
        reported = []
        total = 0.0
        expect_each = []
        for rid in sorted(ids):
            ranks = self._records.get(rid, {})
            reported.append(len(ranks))
            # A request runs on one data-parallel engine: only that engine's ranks report it.
            engines = {self._rank_engine[r] for r in ranks if r in self._rank_engine}
            expect_each.append(
                sum(self._engine_ranks.get(e, 0) for e in engines) + self._unknown_ranks
                if engines and len(self._engine_ranks) > 1
                else None
            )
            for rec in ranks.values():
                sources.add(str(rec.get("source", "?")))
                methods.add(str(rec.get("method", "?")))
                j = rec.get("energy_j")
                if j is None:
                    unavailable = True
                    continue
                gpu = str(rec.get("gpu", "?"))
                gpus[gpu] = gpus.get(gpu, 0.0) + float(j)
                total += float(j)
        expected = max(self._ranks, max(reported, default=0), 1)
        complete = len(ids) >= parts and all(n >= (max(e, 1) if e is not None else expected) for n, e in zip(reported, expect_each))
        status = "unavailable" if unavailable else ("complete" if complete else "partial")
        return {
            "id": response_id,
            "status": status,
            "energy_j": round(total, 6) if status == "complete" else None,
            "gpus": {g: round(j, 6) for g, j in sorted(gpus.items())},
            "source": ",".join(sorted(sources)),
            "method": ",".join(sorted(methods)),
            "parts": len(ids),
            "ranks_expected": expected,
            "ranks_reported": min(reported, default=0),
        }

    async def wait(
        self, response_id: str, timeout_s: float, poll_s: float = 0.005, max_poll_s: float = 0.1, parts: int = 0
    ) -> dict[str, Any] | None:
        """:meth:`lookup` until the status is final (complete/unavailable) or ``timeout_s`` passed.

        Polls every ``poll_s``, doubling up to ``max_poll_s``: figures normally arrive within a few
        ms, and a thousand long waits must not keep the API server's event loop busy.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        delay = poll_s
        first = True
        while True:
            # Every call reads what was appended before it (a line written just before this call
            # must be found); repeated polls of concurrent waiters share reads.
            self.refresh(min_interval_s=0.0 if first else poll_s / 2)
            first = False
            res = self.lookup(response_id, parts)
            left = deadline - time.monotonic()
            if (res is not None and res["status"] != "partial") or left <= 0:
                return res
            await asyncio.sleep(min(delay, left))
            delay = min(max_poll_s, delay * 2)


def energy_headers(res: dict[str, Any] | None) -> list[tuple[bytes, bytes]]:
    """The ``x-powersave-energy-*`` headers for a lookup result (see the module docstring)."""
    if res is None or res["status"] == "partial":
        return [(b"x-powersave-energy-status", b"pending")]
    out = [(b"x-powersave-energy-status", res["status"].encode())]
    if res["status"] == "complete":
        out.append((b"x-powersave-energy-j", f"{res['energy_j']:.6f}".encode()))
    out.append((b"x-powersave-energy-source", res["source"].encode()))
    out.append((b"x-powersave-energy-method", res["method"].encode()))
    return out


def energy_usage_fields(res: dict[str, Any] | None) -> dict[str, Any]:
    """The ``energy_*`` keys added inside ``usage`` (the headers' vocabulary; null where a header is left out)."""
    if res is None or res["status"] == "partial":
        return {"energy_j": None, "energy_status": "pending", "energy_source": None, "energy_method": None}
    return {
        "energy_j": res["energy_j"] if res["status"] == "complete" else None,
        "energy_status": res["status"],
        "energy_source": res["source"] or None,
        "energy_method": res["method"] or None,
    }


#: A JSON document's ``"usage": {`` key. Inside a JSON string a quote is escaped (``\"``), so
#: generated text cannot fake it; a nested ``usage`` key is caught by comparing with the parsed body.
_USAGE_KEY = re.compile(r'"usage"\s*:\s*\{')
#: The final usage chunk of a stream carries no choice (``"choices":[]``, vLLM's compact pydantic
#: JSON; spaces allowed). With ``continuous_usage_stats`` every token chunk also has a ``usage``,
#: but never empty choices.
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def add_to_usage(doc: str, obj: dict[str, Any], fields: dict[str, Any]) -> str | None:
    """``doc`` (the JSON text of ``obj``) with ``fields`` added inside its top-level ``usage``;
    None when it has no ``usage`` object.

    The keys are spliced in before ``usage``'s closing brace, so the rest of the body keeps its
    bytes (a body with prompt logprobs can be megabytes); where the text cannot be matched to the
    parsed ``usage`` (a nested key of that name, or the keys already there) the body is
    serialised again.
    """
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    m = None
    for m in _USAGE_KEY.finditer(doc):
        pass
    if m is not None and not any(k in usage for k in fields):
        found, end = json.JSONDecoder().raw_decode(doc, m.end() - 1)
        if found == usage:
            extra = json.dumps(fields, separators=(",", ":"))[1:-1]
            return doc[: end - 1] + ("," if usage else "") + extra + doc[end - 1 :]
    return json.dumps({**obj, "usage": {**usage, **fields}}, separators=(",", ":"), ensure_ascii=False)


def find_usage_event(body: bytes) -> tuple[list[bytes], int, str, dict[str, Any]] | None:
    """The final usage chunk in one ASGI body message of an SSE stream, or None.

    Returns the message split into events, the event's index, its JSON text and the parsed chunk.
    Every token chunk passes through this, so the test is two byte searches; only a message that
    holds ``"usage"`` next to empty ``choices`` is parsed (not each chunk: a chunk's JSON parse
    costs more than the search, on the API server's event loop, for every token).
    """
    if b'"usage"' not in body or not _EMPTY_CHOICES.search(body):
        return None
    events = body.split(b"\n\n")
    for i, ev in enumerate(events):
        if not ev.startswith(b"data:") or b'"usage"' not in ev or b"\n" in ev:
            continue
        doc = ev[len(b"data:") :].decode("utf-8")
        obj = json.loads(doc)
        if isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict) and isinstance(obj.get("id"), str):
            return events, i, doc, obj
    return None


def _response_mode(start: dict) -> str:
    """``json`` (a non-streaming body to hold), ``stream`` (SSE to watch) or ``pass`` (untouched)."""
    headers = dict(start.get("headers") or [])
    if start.get("status") != 200 or b"content-encoding" in headers:
        return "pass"  # errors, and bodies we could not read, go out untouched
    ctype = headers.get(b"content-type", b"")
    if ctype.startswith(b"application/json"):
        return "json"
    if ctype.startswith(b"text/event-stream") and b"content-length" not in headers:
        return "stream"
    return "pass"


class RequestEnergyMiddleware:
    """Pure ASGI middleware: energy headers and ``usage`` keys on finished non-streaming
    completions, ``usage`` keys in a stream's final usage chunk, and the route.

    Fails open: any error inside it sends the response unchanged.
    """

    def __init__(self, app: Any, index: RequestEnergyIndex, wait_s: float = 0.2) -> None:
        self.app = app
        self.index = index
        self.wait_s = wait_s
        self.route_waiters = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        method = scope.get("method", "")
        if path.startswith(ROUTE) and method in ("GET", "HEAD"):
            await self._route(scope, path[len(ROUTE) :], send)
            return
        if method != "POST" or path not in COMPLETION_PATHS:
            await self.app(scope, receive, send)
            return
        await self._with_energy(scope, receive, send)

    async def _with_energy(self, scope: dict, receive: Any, send: Any) -> None:
        start: dict | None = None
        body: list[bytes] = []
        mode = "pass"
        finished = [0]  # choices of a stream that reported a finish reason: its parts

        async def capture(message: dict) -> None:
            nonlocal start, mode
            kind = message["type"]
            if kind == "http.response.start":
                mode = _response_mode(message)
                if mode == "json":
                    start = message
                    return
            elif kind == "http.response.body" and mode == "stream":
                message = await self._stream_body(message, finished)
            elif kind == "http.response.body" and mode == "json" and start is not None:
                body.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self._finish(start, b"".join(body), send)
                return
            await send(message)

        await self.app(scope, receive, capture)

    async def _stream_body(self, message: dict, finished: list[int]) -> dict:
        """One body message of a stream: untouched, unless it holds the final usage chunk, which
        gets the figure (waiting at most ``wait_s`` for it). ``finished`` counts the choices that
        ended so far (a byte count of non-null finish reasons): the parts the figure must cover."""
        try:
            raw = message.get("body", b"")
            finished[0] += raw.count(b'"finish_reason":"')
            found = find_usage_event(raw)
            if found is None:
                return message
            events, i, doc, obj = found
            res = await self.index.wait(obj["id"], self.wait_s, parts=finished[0])
            new = add_to_usage(doc, obj, energy_usage_fields(res))
            if new is None:
                return message
            events[i] = b"data:" + new.encode("utf-8")
            return {**message, "body": b"\n\n".join(events)}
        except Exception as exc:  # fail open: the chunk goes out as the app wrote it
            log.debug("powersave: energy in the usage chunk skipped: %s", exc)
            return message

    async def _finish(self, start: dict, payload: bytes, send: Any) -> None:
        headers = list(start.get("headers") or [])
        out = payload
        try:
            obj = json.loads(payload)
            rid = obj.get("id")
            if isinstance(rid, str) and rid:
                choices = obj.get("choices")
                res = await self.index.wait(rid, self.wait_s, parts=len(choices) if isinstance(choices, list) else 0)
                more = energy_headers(res)
                doc = add_to_usage(payload.decode("utf-8"), obj, energy_usage_fields(res))
                body = doc.encode("utf-8") if doc is not None else payload
                if len(body) != len(payload):
                    headers = [(k, str(len(body)).encode() if k.lower() == b"content-length" else v) for k, v in headers]
                headers, out = headers + more, body
        except Exception as exc:  # fail open: the client gets its response either way
            log.debug("powersave: energy header skipped: %s", exc)
            headers, out = list(start.get("headers") or []), payload
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": out, "more_body": False})

    async def _route(self, scope: dict, rest: str, send: Any) -> None:
        rid = unquote(rest.strip("/"))
        qs = parse_qs((scope.get("query_string") or b"").decode(errors="replace"))
        try:
            wait_s = min(MAX_ROUTE_WAIT_S, max(0.0, float(qs.get("wait_ms", ["0"])[0]) / 1000.0))
        except ValueError:
            await _json(send, 400, {"error": f"query parameter 'wait_ms' = {qs.get('wait_ms', [''])[0]!r}: not a number"})
            return
        if not rid or "/" in rid:
            await _json(send, 404, {"error": "use GET /powersave/requests/{response id}"})
            return
        if self.route_waiters >= MAX_ROUTE_WAITERS:
            wait_s = 0.0  # too many callers waiting: answer with what is known now
        self.route_waiters += 1
        try:
            res = await self.index.wait(rid, wait_s)
        finally:
            self.route_waiters -= 1
        if res is None:
            await _json(
                send,
                404,
                {
                    "id": rid,
                    "status": "unknown",
                    "error": f"no energy recorded for request {rid!r} (yet: it is written once the request finished)",
                },
            )
            return
        await _json(send, 200, res)


async def _json(send: Any, status: int, obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


#: Set by :func:`configure` in the API-server process; read by :class:`PowersaveEnergyMiddleware`.
_CONFIG: dict[str, Any] = {}
#: Import path handed to vLLM's ``--middleware`` list (see ``vllm_compat.install_app_hook``).
MIDDLEWARE_PATH = "vllm_powersave.request_energy.PowersaveEnergyMiddleware"


def configure(stats_dir: str | Path, wait_s: float) -> str:
    """Configure the middleware vLLM will construct with ``cls(app)``; returns its import path."""
    _CONFIG.update(stats_dir=str(stats_dir), wait_s=float(wait_s))
    return MIDDLEWARE_PATH


class PowersaveEnergyMiddleware(RequestEnergyMiddleware):
    """:class:`RequestEnergyMiddleware` constructible as ``cls(app)`` (vLLM's ``--middleware``)."""

    def __init__(self, app: Any) -> None:
        if not _CONFIG:
            raise RuntimeError("vllm_powersave.request_energy.configure() was not called in this process")
        super().__init__(app, RequestEnergyIndex(_CONFIG["stats_dir"]), _CONFIG["wait_s"])
