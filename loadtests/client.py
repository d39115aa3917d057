"""HTTP client for OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``.

Never raises for a failed request: HTTP errors, broken streams and malformed chunks
are returned as ``RequestOutput(success=False, error=...)`` so a run keeps going.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .datasets import RequestInput

# Keep error strings short: they end up in the JSON result once per failed request.
_MAX_ERR_CHARS = 300


@dataclass
class RequestOutput:
    """Timing and token counts of one request.

    Times are seconds (``time.perf_counter`` based); ``start_time`` is relative to
    the start of the measured window (set by the runner).
    """

    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False
    generated_text: str = ""
    error: str = ""
    #: Index of the fleet endpoint that served it (0 for a single server).
    endpoint: int = 0
    #: Seconds between the request's scheduled arrival and its start (waiting for a concurrency slot).
    queue_time: float = 0.0


def _short(s: str) -> str:
    s = " ".join(s.split())
    return s if len(s) <= _MAX_ERR_CHARS else s[: _MAX_ERR_CHARS - 3] + "..."


def build_payload(
    endpoint: str,
    model: str,
    req: RequestInput,
    *,
    stream: bool,
    prompt_logprobs: int | None = None,
) -> dict[str, Any]:
    """Request body; ``ignore_eos`` and ``prompt_logprobs`` are vLLM extensions others ignore."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def _choice_text(choice: dict[str, Any], endpoint: str) -> str:
    """Text carried by one streamed/non-streamed choice (empty if none)."""
    if endpoint == "chat":
        part = choice.get("delta") or choice.get("message") or {}
        if not isinstance(part, dict):
            return ""
        # Reasoning models stream thinking tokens separately; they still cost decode energy.
        text = part.get("content") or part.get("reasoning_content") or part.get("reasoning") or ""
    else:
        text = choice.get("text") or ""
    return text if isinstance(text, str) else ""


def _role_only(choice: dict[str, Any], endpoint: str) -> bool:
    """A chat chunk that only announces the role (``{"role": ..., "content": ""}``): not a token.

    vLLM sends it together with the first token, but other servers send it before any work is done,
    so counting it would make TTFT meaningless there.
    """
    if endpoint != "chat":
        return False
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" in delta and not delta.get("content") and not delta.get("reasoning_content") \
        and not delta.get("reasoning") and not delta.get("tool_calls")


def _apply_usage(out: RequestOutput, usage: Any) -> None:
    if isinstance(usage, dict):
        ct, pt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if isinstance(ct, int):
            out.output_tokens = ct
            out.usage_reported = True
        if isinstance(pt, int):
            out.prompt_tokens = pt


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    endpoint: str,
    model: str,
    req: RequestInput,
    *,
    stream: bool = True,
    prompt_logprobs: int | None = None,
    timeout_s: float | None = None,
) -> RequestOutput:
    """Send one request and measure TTFT, ITL and E2E latency (seconds).

    TTFT is the time to the first chunk carrying a choice, as in ``vllm bench serve`` (its text may
    be empty: a token that does not decode to text alone); a chat stream's role-only announcement
    does not count. Output tokens come from ``usage`` when
    the server reports it, else the number of text chunks (streaming) or the word
    count (non-streaming, a rough fallback).
    """
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    payload = build_payload(endpoint, model, req, stream=stream, prompt_logprobs=prompt_logprobs)
    out = RequestOutput()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    st = time.perf_counter()
    try:
        # No redirects: only the user-given server may be contacted.
        async with session.post(
            base_url + path, json=payload, timeout=timeout, allow_redirects=False
        ) as resp:
            if resp.status != 200:
                body = await resp.text(errors="replace")
                out.error = _short(f"HTTP {resp.status}: {body}")
                return out
            if stream:
                await _read_stream(resp, endpoint, out, st)
            else:
                await _read_json(resp, endpoint, out, st)
    except TimeoutError:
        out.error = f"request timeout after {timeout_s:g} s (--request-timeout)" if timeout_s else "timeout"
    except aiohttp.ClientError as e:
        out.error = _short(f"{type(e).__name__}: {e}")
    except (ValueError, UnicodeDecodeError) as e:
        # aiohttp raises ValueError for over-long lines; treat like any broken stream.
        out.error = _short(f"{type(e).__name__}: {e}")
    if out.error:
        out.success = False
        if not out.latency:
            out.latency = time.perf_counter() - st  # when it ended, for the steady-state rule
    return out


async def _read_stream(resp: aiohttp.ClientResponse, endpoint: str, out: RequestOutput, st: float) -> None:
    """Parse SSE ``data:`` lines until ``[DONE]``; fills ``out`` (sets ``error`` on failure)."""
    last = st
    chunks = 0
    texts: list[str] = []
    ignored: list[str] = []
    done = False
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line or line.startswith(":"):
            continue
        if not line.startswith("data:"):
            # Other SSE fields (event:, id:) are legal; keep a sample for the error text.
            if len(ignored) < 3:
                ignored.append(line)
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            out.error = _short(f"malformed stream chunk: {data}")
            return
        if not isinstance(chunk, dict):
            out.error = _short(f"malformed stream chunk: {data}")
            return
        if "error" in chunk:
            out.error = _short(f"server error in stream: {json.dumps(chunk['error'])}")
            return
        _apply_usage(out, chunk.get("usage"))
        choices = chunk.get("choices") or []
        if isinstance(choices, list) and choices and isinstance(choices[0], dict) and not _role_only(choices[0], endpoint):
            # Every chunk carrying a choice is a token event, even with empty text (a token that does
            # not decode to text on its own, e.g. part of a UTF-8 character): as `vllm bench serve`.
            text = _choice_text(choices[0], endpoint)
            now = time.perf_counter()
            if chunks == 0:
                out.ttft = now - st
            else:
                out.itl.append(now - last)
            last = now
            chunks += 1
            texts.append(text)
    out.latency = time.perf_counter() - st
    out.generated_text = "".join(texts)
    if not done:
        out.error = _short("stream ended before [DONE]" + (f" (ignored lines: {ignored})" if ignored else ""))
        return
    if not out.usage_reported:
        out.output_tokens = chunks
    if chunks == 0:
        out.error = "no text generated"
        return
    out.success = True


async def _read_json(resp: aiohttp.ClientResponse, endpoint: str, out: RequestOutput, st: float) -> None:
    """Parse a non-streaming response; TTFT equals E2E latency (as in ``vllm bench``)."""
    raw = await resp.text(errors="replace")
    out.latency = time.perf_counter() - st
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        out.error = _short(f"malformed response body: {raw}")
        return
    if not isinstance(body, dict) or "error" in body:
        out.error = _short(f"server error: {raw}")
        return
    choices = body.get("choices") or []
    text = _choice_text(choices[0], endpoint) if isinstance(choices, list) and choices and isinstance(choices[0], dict) else ""
    out.generated_text = text
    out.ttft = out.latency
    _apply_usage(out, body.get("usage"))
    if not out.usage_reported:
        out.output_tokens = len(text.split())
    if out.output_tokens == 0 and not text:
        out.error = "no text generated"
        return
    out.success = True
