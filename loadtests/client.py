"""HTTP client for OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``.

Never raises for a failed request: HTTP errors, broken streams and malformed chunks
are returned as ``RequestOutput(success=False, error=...)`` so a run keeps going.
"""

from __future__ import annotations

import json
import math
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
    #: True when every token chunk carried per-chunk usage (``continuous_usage_stats``): ``itl`` then
    #: holds per-token intervals; False: ``itl`` holds gaps between token chunks.
    itl_per_token: bool = False
    generated_text: str = ""
    error: str = ""
    #: Index of the fleet endpoint that served it (0 for a single server).
    endpoint: int = 0
    #: Seconds between the request's scheduled arrival and its start (waiting for a concurrency slot).
    queue_time: float = 0.0
    #: The request's joules as vllm-powersave reports them inside ``usage`` (``energy_j``, with
    #: ``per_request_energy`` on; ``docs/request-energy.md``): None when absent or not yet known.
    energy_j: float | None = None
    #: ``usage.energy_status`` (``complete`` | ``pending`` | ``unavailable``); None when the server sent none.
    energy_status: str | None = None
    #: ``usage.energy_source`` (``measured`` | ``simulated``).
    energy_source: str | None = None

    @property
    def output_tokens_source(self) -> str:
        """``usage`` (the server's count) or ``estimated`` (token chunks, or words when not streamed)."""
        return "usage" if self.usage_reported else "estimated"


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
    continuous_usage_stats: bool = False,
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
        if continuous_usage_stats:
            # vLLM's per-chunk usage: completion_tokens so far on every chunk, so a chunk's token count
            # is known (several tokens per chunk with --stream-interval or speculative decoding).
            body["stream_options"]["continuous_usage_stats"] = True
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
    return (
        isinstance(delta, dict)
        and "role" in delta
        and not delta.get("content")
        and not delta.get("reasoning_content")
        and not delta.get("reasoning")
        and not delta.get("tool_calls")
    )


def _apply_usage(out: RequestOutput, usage: Any) -> None:
    if isinstance(usage, dict):
        ct, pt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if isinstance(ct, int):
            out.output_tokens = ct
            out.usage_reported = True
        if isinstance(pt, int):
            out.prompt_tokens = pt
        _apply_energy(out, usage)


def _apply_energy(out: RequestOutput, usage: dict[str, Any]) -> None:
    """vllm-powersave's per-request energy keys inside ``usage`` (``docs/request-energy.md``)."""
    status = usage.get("energy_status")
    if not isinstance(status, str):
        return
    j = usage.get("energy_j")
    ok = isinstance(j, (int, float)) and not isinstance(j, bool) and math.isfinite(j) and j >= 0
    src = usage.get("energy_source")
    out.energy_status = status[:32]
    out.energy_j = float(j) if ok and status == "complete" else None
    out.energy_source = src[:32] if isinstance(src, str) else None


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
    continuous_usage_stats: bool = False,
) -> RequestOutput:
    """Send one request and measure TTFT, ITL and E2E latency (seconds).

    A streamed chunk is a token chunk when it carries a generated token: with per-chunk usage
    (``continuous_usage_stats``), when its ``completion_tokens`` advanced; without, when its text is
    non-empty. TTFT is the time to the first token chunk; an empty delta (a chat role announcement,
    an empty first chunk some servers send before any work) does not start it. ITL: with per-chunk
    usage, per-token intervals (a chunk's gap divided over the tokens it carries); without, gaps
    between token chunks. Output tokens come from ``usage`` when the server reports it, else they are
    estimated (``output_tokens_source = "estimated"``): the number of token chunks (streaming) or
    the word count (non-streaming).
    """
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    payload = build_payload(
        endpoint, model, req, stream=stream, prompt_logprobs=prompt_logprobs, continuous_usage_stats=continuous_usage_stats
    )
    out = RequestOutput()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    st = time.perf_counter()
    try:
        # No redirects: only the user-given server may be contacted.
        async with session.post(base_url + path, json=payload, timeout=timeout, allow_redirects=False) as resp:
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
    """Parse SSE ``data:`` lines until ``[DONE]``; fills ``out`` (sets ``error`` on failure).

    vllm bench serve 0.32 (``vllm/benchmarks/lib/endpoint_request_func.py``,
    ``async_request_openai_completions``) starts TTFT at the first chunk with any ``choices``, "text
    could be empty here e.g. for special tokens", and takes one ITL per such chunk. That is right for
    vLLM, which sends a choice chunk only once a token exists (``serving.py``: "don't return empty
    chunks"), but not for servers that send an empty delta before any work. So an empty chunk counts
    here only when per-chunk usage says it carries a token; with it, TTFT agrees with vllm bench on
    vLLM whatever the text.
    """
    last = st
    token_chunks = 0  # chunks carrying at least one token
    reported = 0  # completion_tokens seen so far in per-chunk usage
    usage_chunks = 0  # choice chunks that carried per-chunk usage
    text_only_tokens = False  # a token chunk without per-chunk usage (counted from its text)
    first_choice: float | None = None  # first non-announcement choice chunk, any text
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
            chunk = None
        if not isinstance(chunk, dict):
            out.error = _short(f"malformed stream chunk: {data}")
            return
        if "error" in chunk:
            out.error = _short(f"server error in stream: {json.dumps(chunk['error'])}")
            return
        usage = chunk.get("usage")
        choices = chunk.get("choices") or []
        if isinstance(choices, list) and choices and isinstance(choices[0], dict) and not _role_only(choices[0], endpoint):
            now = time.perf_counter()
            text = _choice_text(choices[0], endpoint)
            texts.append(text)
            if first_choice is None:
                first_choice = now
            ct = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if isinstance(ct, int) and not isinstance(ct, bool):
                k = max(0, ct - reported)  # per-chunk usage: the tokens this chunk carries
                reported = max(reported, ct)
                usage_chunks += 1
            else:
                k = 1 if text else 0
                reported += k
                text_only_tokens = text_only_tokens or k > 0
            if k:
                if token_chunks == 0:
                    out.ttft = now - st
                    # Tokens that came with the first one arrived with it: the prefill is TTFT's.
                    out.itl.extend([0.0] * (k - 1))
                else:
                    # Per-token intervals: the chunk's gap spread over the tokens it carries (k = 1
                    # without per-chunk usage, so the gap between token chunks).
                    out.itl.extend([(now - last) / k] * k)
                last = now
                token_chunks += 1
        _apply_usage(out, usage)
    out.latency = time.perf_counter() - st
    out.generated_text = "".join(texts)
    if not done:
        out.error = _short("stream ended before [DONE]" + (f" (ignored lines: {ignored})" if ignored else ""))
        return
    _settle_stream_tokens(
        out, st, token_chunks=token_chunks, first_choice=first_choice, usage_chunks=usage_chunks, text_only_tokens=text_only_tokens
    )


def _settle_stream_tokens(
    out: RequestOutput, st: float, *, token_chunks: int, first_choice: float | None, usage_chunks: int, text_only_tokens: bool
) -> None:
    """Once per complete stream, after its last chunk: the empty-text TTFT rule, the token count,
    and success or the error (see :func:`_read_stream`)."""
    if token_chunks == 0 and first_choice is not None and out.usage_reported and out.output_tokens > 0:
        # Only empty-text chunks, yet usage reports tokens (e.g. special tokens that decode to ""):
        # the first choice chunk is the best TTFT there is (vllm bench's rule).
        out.ttft = first_choice - st
        token_chunks = 1
    out.itl_per_token = usage_chunks > 0 and not text_only_tokens and token_chunks > 0
    if not out.usage_reported:
        out.output_tokens = token_chunks
    if token_chunks == 0:
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
