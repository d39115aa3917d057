"""Load shapes and orchestration: reachability check, warm-ups, measured window, energy."""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from datetime import datetime
from typing import Any

import aiohttp

from .client import RequestOutput, send_request
from .config import BenchConfig
from .datasets import RequestInput, sample_requests
from .energy import EnergyMeter
from .errors import LoadTestError, ServerUnreachableError
from .metrics import calculate_metrics, energy_metrics

# Arrival times and prompts use different streams so changing --request-rate does not
# change which prompts are sent.
_ARRIVAL_SEED_OFFSET = 7919


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s, relative to the first request) for ``n`` requests.

    ``request_rate`` is requests/s; ``inf`` sends all at once. Inter-arrival gaps are
    gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate, burstiness 1 is
    Poisson, < 1 burstier, > 1 more regular (same as ``vllm bench serve``).
    """
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed + _ARRIVAL_SEED_OFFSET)
    scale = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


def _reason(e: BaseException) -> str:
    """Short cause, e.g. "Connection refused" rather than aiohttp's multi-part message."""
    os_err = getattr(e, "os_error", None)
    text = None
    if isinstance(os_err, OSError):
        # asyncio puts "Connect call failed (...)" in strerror; the errno text is clearer.
        # getaddrinfo errors use negative codes whose text only lives in strerror.
        text = os.strerror(os_err.errno) if isinstance(os_err.errno, int) and os_err.errno > 0 else os_err.strerror
    text = text or str(e) or type(e).__name__
    return " ".join(text.split())


async def check_server(session: aiohttp.ClientSession, base_url: str, model: str | None, timeout_s: float) -> str:
    """``GET /v1/models`` with a short timeout; returns the model id to use.

    Raises :class:`ServerUnreachableError` (one line) if the server does not answer, or
    if ``model`` is None and no model id can be read from the listing.
    """
    url = base_url + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False) as resp:
            status = resp.status
            body: Any = await resp.json(content_type=None) if status == 200 else None
    except TimeoutError:
        raise ServerUnreachableError(f"cannot reach server at {base_url}: no answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise ServerUnreachableError(f"cannot reach server at {base_url}: {_reason(e)}") from None
    except ValueError:
        body = None  # non-JSON listing: fine if the user named the model
    if model:
        return model
    try:
        return str(body["data"][0]["id"])
    except (TypeError, KeyError, IndexError):
        raise ServerUnreachableError(
            f"cannot determine model from {url} (HTTP {status}); pass --model"
        ) from None


async def run_load(
    session: aiohttp.ClientSession,
    cfg: BenchConfig,
    model: str,
    reqs: list[RequestInput],
    *,
    request_rate: float,
    max_concurrency: int | None,
    deadline: float,
    duration_s: float | None = None,
) -> tuple[list[RequestOutput], float, bool, list[int]]:
    """Send ``reqs`` with the given arrival shape and concurrency cap.

    Returns ``(outputs, duration_s, timed_out, sent)``. Requests still running at ``deadline``
    (``time.monotonic`` seconds) are cancelled and reported as failed, so this never hangs. With
    ``duration_s``, no request starts after that many seconds (those already running finish);
    ``sent`` lists the indices of requests that were started, and only they are returned.
    """
    outputs: list[RequestOutput | None] = [None] * len(reqs)
    offsets = arrival_offsets(len(reqs), request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks: list[asyncio.Task[None]] = []
    running: set[int] = set()
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        async def go() -> None:
            start = time.perf_counter()
            if duration_s is not None and start - t0 > duration_s:
                return  # window closed: not sent, not counted
            running.add(i)
            o = await send_request(
                session, cfg.base_url, cfg.endpoint, model, reqs[i],
                stream=cfg.stream, prompt_logprobs=cfg.prompt_logprobs,
            )
            o.start_time = start - t0
            outputs[i] = o

        if sem is None:
            await go()
        else:
            async with sem:
                await go()

    async def issue() -> None:
        for i, off in enumerate(offsets):
            # Sleep to absolute targets so scheduling jitter does not accumulate.
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)

    timed_out = False
    try:
        await asyncio.wait_for(issue(), timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        timed_out = True
    finally:
        # Tasks created before a cancelled sleep are not owned by gather: cancel explicitly.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.perf_counter() - t0
    started = {i for i, o in enumerate(outputs) if o is not None} if duration_s is not None else set(range(len(outputs)))
    if duration_s is not None:
        started |= {i for i in range(len(outputs)) if i in running}
    final = [
        o if o is not None else RequestOutput(error=f"not finished within --timeout {cfg.timeout_s:g} s")
        for i, o in enumerate(outputs)
        if i in started
    ]
    return final, duration, timed_out, sorted(started)


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run one benchmark and return the result dict (see ``loadtests`` docs for fields).

    Raises :class:`~loadtests.errors.LoadTestError` subclasses (one-line messages) for a
    bad dataset or an unreachable server; failed requests never raise.
    """
    deadline = time.monotonic() + cfg.timeout_s
    # Warm-ups come after the measured prompts so they do not warm the prefix cache for them.
    all_reqs = sample_requests(
        cfg.dataset, cfg.num_prompts + cfg.num_warmups,
        input_len=cfg.input_len, output_len=cfg.output_len, range_ratio=cfg.range_ratio, seed=cfg.seed,
    )
    reqs, warm = all_reqs[: cfg.num_prompts], all_reqs[cfg.num_prompts :]

    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    # trust_env=False: never route through proxies from the environment; only base_url is contacted.
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        model = await check_server(session, cfg.base_url, cfg.model, min(cfg.connect_timeout_s, cfg.timeout_s))
        warm_failed = 0
        if warm:
            w_out, _, _, _ = await run_load(
                session, cfg, model, warm, request_rate=math.inf,
                max_concurrency=cfg.max_concurrency or len(warm), deadline=deadline,
            )
            warm_failed = sum(1 for o in w_out if not o.success)
        meter = EnergyMeter(session, cfg.base_url, cfg.gpus, timeout_s=cfg.connect_timeout_s, mode=cfg.energy)
        await meter.start()
        outputs, duration, timed_out, sent = await run_load(
            session, cfg, model, reqs, request_rate=cfg.request_rate,
            max_concurrency=cfg.max_concurrency, deadline=deadline, duration_s=cfg.duration_s,
        )
        reading = await meter.stop()
        reqs = [reqs[i] for i in sent]

    m = calculate_metrics(reqs, outputs, duration, cfg.percentiles, cfg.goodput or None)
    e = energy_metrics(reading, m["total_input_tokens"], m["total_output_tokens"])
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": cfg.label,
        "base_url": cfg.base_url,
        "endpoint_type": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "endpoint": "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions",
        "stream": cfg.stream,
        "model_id": model,
        "dataset": cfg.dataset,
        "num_prompts": len(reqs),
        "duration_limit_s": cfg.duration_s,
        "num_warmups": cfg.num_warmups,
        "warmup_failed": warm_failed,
        # JSON has no Infinity; vllm bench writes the string "inf" too.
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "range_ratio": cfg.range_ratio,
        "seed": cfg.seed,
        "percentiles": list(cfg.percentiles),
        "goodput_slo_ms": dict(cfg.goodput),
        "timeout_s": cfg.timeout_s,
        "timed_out": timed_out,
        **m,
        **e,
        # Per-request arrays; times in seconds like vllm bench's ttfts/itls.
        "start_times": [o.start_time for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "e2els": [o.latency for o in outputs],
        "input_lens": [o.prompt_tokens if o.prompt_tokens is not None else r.prompt_len for r, o in zip(reqs, outputs)],
        "output_lens": [o.output_tokens for o in outputs],
        "errors": [o.error for o in outputs],
    }


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Synchronous wrapper around :func:`run_benchmark` (must not be called from a running loop)."""
    return asyncio.run(run_benchmark(cfg))


__all__ = ["arrival_offsets", "check_server", "run_load", "run_benchmark", "run", "LoadTestError"]
