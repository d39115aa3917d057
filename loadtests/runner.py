"""Orchestration: reachability check, warm-ups, load shapes over one server or a fleet, energy sampling."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any, NamedTuple

import aiohttp

from .client import RequestOutput, send_request
from .config import BenchConfig
from .datasets import RequestInput, load_trace, random_requests, sample_requests
from .energy import METRIC, EnergyMeter, EnergyReading
from .errors import LoadTestError, ServerUnreachableError
from .looplag import LoopLagProbe, loop_lag_metrics, runqueue_wait_s
from .metrics import calculate_metrics, energy_metrics, method_metrics, peak_metrics, percentile_key
from .shapes import arrival_offsets, ramp_offsets
from .window import steady_state, sum_readings, timeline


def schedule(cfg: BenchConfig, n: int) -> list[float]:
    """Send offsets (s) for ``n`` measured requests from the config's load shape (not for traces)."""
    if cfg.ramp_up_strategy is not None:
        assert cfg.ramp_up_start_rps is not None and cfg.ramp_up_end_rps is not None
        return ramp_offsets(
            n,
            cfg.ramp_up_start_rps,
            cfg.ramp_up_end_rps,
            duration_s=cfg.ramp_up_duration_s,
            strategy=cfg.ramp_up_strategy,
            burstiness=cfg.burstiness,
            seed=cfg.seed,
            arrival=cfg.arrival,
        )
    return arrival_offsets(n, cfg.request_rate, cfg.burstiness, cfg.seed, cfg.arrival, cfg.normalize_arrivals)


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


async def check_server(session: aiohttp.ClientSession, base_url: str, model: str | None, timeout_s: float) -> tuple[str, str | None]:
    """``GET /v1/models`` with a short timeout; returns the model id to use and the served model's
    ``root`` (vLLM lists the model's path there; None where the server does not say).

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
    try:
        listed = [d for d in body["data"] if isinstance(d, dict)]
    except (TypeError, KeyError):
        listed = []
    entry = next((d for d in listed if d.get("id") == model), None) if model else (listed[0] if listed else None)
    root = entry.get("root") if entry is not None and isinstance(entry.get("root"), str) else None
    if model:
        return model, root
    try:
        return str(body["data"][0]["id"]), root
    except (TypeError, KeyError, IndexError):
        raise ServerUnreachableError(f"cannot determine model from {url} (HTTP {status}); pass --model") from None


class _Progress:
    """Completed-request counter on stderr (tqdm); silent when disabled or stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self._bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # optional: no bar rather than no run
                return
            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_load(
    session: aiohttp.ClientSession,
    cfg: BenchConfig,
    models: list[str],
    reqs: list[RequestInput],
    *,
    offsets: list[float],
    max_concurrency: int | None,
    deadline: float,
    duration_s: float | None = None,
    t0: float | None = None,
    progress: _Progress | None = None,
) -> tuple[list[RequestOutput], float, bool, list[int]]:
    """Send ``reqs[i]`` at ``t0 + offsets[i]`` to endpoint ``i % len(endpoints)`` (round-robin).

    Returns ``(outputs, duration_s, timed_out, sent)``. Requests still running at ``deadline``
    (``time.monotonic`` seconds) are cancelled and reported as failed, so this never hangs. With
    ``duration_s``, no request starts after that many seconds (those already running finish);
    ``sent`` lists the indices of requests that were started, and only they are returned.
    ``max_concurrency`` caps in-flight requests over the whole fleet (closed loop).
    """
    endpoints = cfg.endpoints
    outputs: list[RequestOutput | None] = [None] * len(reqs)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks: list[asyncio.Task[None]] = []
    running: set[int] = set()
    t0 = time.perf_counter() if t0 is None else t0

    async def one(i: int, arrived: float) -> None:
        try:
            start = time.perf_counter()
            running.add(i)
            e = i % len(endpoints)
            o = await send_request(
                session,
                endpoints[e],
                cfg.endpoint,
                models[e],
                reqs[i],
                stream=cfg.stream,
                prompt_logprobs=cfg.prompt_logprobs,
                timeout_s=cfg.request_timeout_s,
                continuous_usage_stats=cfg.continuous_usage_stats,
            )
            o.start_time = start - t0
            o.queue_time = start - arrived
            o.endpoint = e
            outputs[i] = o
            if progress is not None:
                progress.update()
        finally:
            if sem is not None:
                sem.release()

    timed_out = False
    try:
        issuing = _issue(offsets, t0=t0, duration_s=duration_s, sem=sem, tasks=tasks, one=one)
        await asyncio.wait_for(issuing, timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        timed_out = True
    finally:
        # Tasks created before a cancelled sleep are not owned by gather: cancel explicitly.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.perf_counter() - t0
    final, started = _started_outputs(
        outputs, running, windowed=duration_s is not None, timeout_s=cfg.timeout_s, n_endpoints=len(endpoints)
    )
    return final, duration, timed_out, started


def _started_outputs(
    outputs: list[RequestOutput | None], running: set[int], *, windowed: bool, timeout_s: float, n_endpoints: int
) -> tuple[list[RequestOutput], list[int]]:
    """The outputs of the requests that were started (all of them without a window) and their
    indices; one still unfinished is a failure of the run's ``--timeout``."""
    started = {i for i, o in enumerate(outputs) if o is not None} if windowed else set(range(len(outputs)))
    if windowed:
        started |= {i for i in range(len(outputs)) if i in running}
    final = []
    for i, o in enumerate(outputs):
        if i not in started:
            continue
        if o is None:
            o = RequestOutput(error=f"not finished within --timeout {timeout_s:g} s", endpoint=i % n_endpoints)
        final.append(o)
    return final, sorted(started)


async def _issue(
    offsets: list[float],
    *,
    t0: float,
    duration_s: float | None,
    sem: asyncio.Semaphore | None,
    tasks: list[asyncio.Task[None]],
    one: Callable[[int, float], Coroutine[Any, Any, None]],
) -> None:
    """Start ``one(i, arrived)`` for each request at ``t0 + offsets[i]`` (see :func:`run_load`) and
    wait for them all."""
    # The issuer takes the concurrency slot before it creates a request's task, so at most
    # max_concurrency tasks exist. (A task per request waiting on the semaphore, as vllm bench
    # does, made a closed-loop window over 100k prompts spend its first second creating tasks
    # and serve a third of the tokens: the client, not the server, set the rate.)
    for i, off in enumerate(offsets):
        if duration_s is not None and off > duration_s:
            break  # arrives after the window: not sent (and not waited for, which would lengthen the run)
        # Sleep to absolute targets so scheduling jitter does not accumulate.
        delay = t0 + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        # The request arrived at its scheduled time even when the issuer reaches it later (it
        # waited for a slot for an earlier request): queue time counts from the arrival.
        arrived = min(time.perf_counter(), t0 + off)
        if sem is not None:
            await sem.acquire()
        if duration_s is not None and time.perf_counter() - t0 > duration_s:
            if sem is not None:
                sem.release()
            break  # window closed: this and later arrivals are not sent, not counted
        tasks.append(asyncio.create_task(one(i, arrived)))
    await asyncio.gather(*tasks)


async def _sampler(meters: list[EnergyMeter], interval_s: float, stop: asyncio.Event) -> None:
    """Read every meter each ``interval_s`` until ``stop`` is set (one tick = all meters together)."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
            return
        except TimeoutError:
            pass
        await asyncio.gather(*(m.sample() for m in meters))


async def _open_meters(session: aiohttp.ClientSession, cfg: BenchConfig) -> tuple[list[EnergyMeter], list[str], str]:
    """Energy meters for the run: one per endpoint (server metrics), or one NVML meter for the host.

    Returns ``(meters, names, scope)``; ``meters`` is empty when there is no energy source. Per-endpoint
    server metrics are used only when every endpoint publishes them; otherwise (``auto``) local NVML
    covers the whole fleet once, so no GPU is counted twice.
    """
    tmo, every = cfg.connect_timeout_s, cfg.metrics_interval_s
    notes: list[str] = []
    if cfg.energy in ("auto", "server"):
        meters = [EnergyMeter(session, url, cfg.gpus, timeout_s=tmo, mode="server", metrics_interval_s=every) for url in cfg.endpoints]
        await asyncio.gather(*(m.start() for m in meters))
        if all(m.provider == "server-metrics" for m in meters):
            return meters, list(cfg.endpoints), "server-metrics per endpoint"
        missing = [u for u, m in zip(cfg.endpoints, meters) if m.provider is None]
        notes.append(f"no {METRIC}_total at {', '.join(missing)}")
        if cfg.energy == "server":
            return [], [], "no energy source (" + "; ".join(notes) + ")"
    if cfg.energy == "zeusd":
        m = EnergyMeter(session, cfg.base_url, cfg.gpus, timeout_s=tmo, mode="zeusd", zeusd=cfg.zeusd, metrics_interval_s=every)
        await m.start()
        if m.provider == "zeusd":
            return [m], ["zeusd"], f"zeusd at {cfg.zeusd} (whole fleet)"
        return [], [], m.note
    if cfg.energy in ("auto", "nvml"):
        m = EnergyMeter(session, cfg.base_url, cfg.gpus, timeout_s=tmo, mode="nvml", metrics_interval_s=every)
        await m.start()
        if m.provider == "nvml":
            return [m], ["nvml"], "local NVML (whole fleet)"
        notes.append(m.note.removeprefix("no energy source (").removesuffix(")"))
    else:
        notes.append("disabled by energy='none'")
    return [], [], "no energy source (" + "; ".join(notes) + ")"


def _endpoint_summary(
    url: str,
    model: str,
    inputs: list[RequestInput],
    outputs: list[RequestOutput],
    duration: float,
    cfg: BenchConfig,
    reading: EnergyReading | None,
    no_reading_note: str = "energy measured for the whole fleet only",
) -> dict[str, Any]:
    m = calculate_metrics(inputs, outputs, duration, cfg.percentiles, cfg.goodput or None)
    keep = (
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "mean_itl_ms",
        "median_e2el_ms",
    )
    out: dict[str, Any] = {"base_url": url, "model_id": model, "num_prompts": len(outputs)}
    out |= {k: m.get(k) for k in keep}
    for p in cfg.percentiles:
        out[f"{percentile_key(p)}_ttft_ms"] = m[f"{percentile_key(p)}_ttft_ms"]
    e = energy_metrics(reading or EnergyReading(note=no_reading_note), m["total_input_tokens"], m["total_output_tokens"])
    out |= {
        k: e[k]
        for k in (
            "gpu_energy_j",
            "gpu_avg_power_w",
            "gpu_energy_per_output_token_j",
            "gpu_energy_per_total_token_j",
            "output_tokens_per_joule",
            "total_tokens_per_joule",
            "energy_source",
            "energy_note",
        )
    }
    return out


class _Workload(NamedTuple):
    """What one benchmark sends: the measured requests at their offsets (s from the start), and the
    warm-ups sent before."""

    offsets: list[float]
    reqs: list[RequestInput]
    warm: list[RequestInput]


class _Measured(NamedTuple):
    """What the timed load gave, as the client saw it."""

    models: list[str]  # per endpoint
    roots: list[str | None]  # per endpoint
    warm_failed: int
    meters: list[EnergyMeter]
    names: list[str]  # the meters' names
    scope: str  # what the energy figures cover
    t0: float  # time.perf_counter() when the timed load began
    outputs: list[RequestOutput]
    duration_s: float
    timed_out: bool
    reqs: list[RequestInput]  # the requests that were sent, in the order of ``outputs``
    readings: list[EnergyReading]  # per meter
    loop_lags_s: list[float]  # the client loop's lag probe samples
    lag_probe_period_s: float
    client_cpu_s: float  # the loop thread's CPU time over the timed load
    client_wait_s: float | None  # the loop thread's time waiting for a CPU over it (Linux schedstat)


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run one benchmark and return the result dict (see ``loadtests/README.md`` for fields).

    Raises :class:`~loadtests.errors.LoadTestError` subclasses (one-line messages) for a
    bad dataset or an unreachable server; failed requests never raise.
    """
    deadline = time.monotonic() + cfg.timeout_s
    measured = await _measure(cfg, _workload(cfg), deadline)
    reading = _total_reading(measured)
    outputs = measured.outputs
    m = calculate_metrics(measured.reqs, outputs, measured.duration_s, cfg.percentiles, cfg.goodput or None)
    e = energy_metrics(reading, m["total_input_tokens"], m["total_output_tokens"])
    how = method_metrics(outputs, cfg.stream)
    dur = measured.duration_s
    cpu_share = measured.client_cpu_s / dur if dur > 0 else None
    wait_share = measured.client_wait_s / dur if dur > 0 and measured.client_wait_s is not None else None
    itl = m["median_itl_ms"] if cfg.stream else None
    lag = loop_lag_metrics(measured.loop_lags_s, measured.lag_probe_period_s, itl, m["median_ttft_ms"], cpu_share, wait_share)
    how["methods"]["client_loop_lag"] = (
        f"a probe thread posts a callback into the client's event loop every {measured.lag_probe_period_s * 1000:g} ms; lag = its "
        f"wait; client is the bottleneck when p99 lag > {lag['client_bottleneck_threshold_ms']:.2f} ms "
        "(10 % of the median ITL, or TTFT without one; within 0.5-5 ms)"
    )
    if lag["client_bottleneck"]:
        print(f"warning: {lag['client_bottleneck_note']}", file=sys.stderr)
    elif lag["client_cpu_contended"]:  # over the threshold too, for another cause: said as loudly
        print(f"note: {lag['client_bottleneck_note']}", file=sys.stderr)
    batch = cfg.steady_state_batch or cfg.max_concurrency
    ss = steady_state(outputs, batch, measured.meters, measured.t0)
    ep_rows = _endpoint_rows(cfg, measured, reading, batch)
    return {
        **_run_settings(cfg, measured),
        **m,
        **how,
        **lag,
        **peak_metrics(outputs),
        **e,
        "gpu_energy_duration_s": e["energy_window_s"] if e["gpu_energy_j"] is not None else None,
        "energy_scope": measured.scope,
        **ss,
        "endpoints": ep_rows,
        "timeline": timeline(measured.meters, measured.names, measured.t0, cfg.sample_interval_s),
        **_per_request_arrays(cfg, measured.reqs, outputs),
    }


def _workload(cfg: BenchConfig) -> _Workload:
    """The measured requests and their arrival offsets (a trace's, or the load shape's), and the warm-ups."""
    if cfg.trace is not None:
        offsets, reqs = load_trace(cfg.trace, cfg.output_len, seed=cfg.seed, time_scale=cfg.trace_time_scale)
        if "num_prompts" in cfg.model_fields_set:
            offsets, reqs = offsets[: cfg.num_prompts], reqs[: cfg.num_prompts]
        warm = random_requests(cfg.num_warmups, cfg.input_len, cfg.output_len, cfg.range_ratio, cfg.seed + 1)
        return _Workload(offsets, reqs, warm)
    # Warm-ups come after the measured prompts so they do not warm the prefix cache for them.
    all_reqs = sample_requests(
        cfg.dataset,
        cfg.num_prompts + cfg.num_warmups,
        input_len=cfg.input_len,
        output_len=cfg.output_len,
        range_ratio=cfg.range_ratio,
        seed=cfg.seed,
        prefix_len=cfg.prefix_len,
        num_prefixes=cfg.num_prefixes,
        sharegpt_output_len=cfg.sharegpt_output_len,
        tokenizer=cfg.tokenizer,
    )
    reqs, warm = all_reqs[: cfg.num_prompts], all_reqs[cfg.num_prompts :]
    try:
        offsets = schedule(cfg, len(reqs))
    except ValueError as e:
        raise LoadTestError(f"invalid load shape: {e}") from None
    return _Workload(offsets, reqs, warm)


async def _measure(cfg: BenchConfig, work: _Workload, deadline: float) -> _Measured:
    """Check the servers, send the warm-ups, then the timed load with the meters and the loop-lag probe running."""
    endpoints = cfg.endpoints
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    # trust_env=False (default): never route through proxies from the environment; only the given URLs
    # are contacted. --trust-env reproduces vllm bench's session for like-for-like TTFT comparisons.
    # Metrics scrapes get their own session: in the request pool (limited to max_concurrency) they would
    # wait for a request to finish, so every sample would land between requests.
    async with (
        aiohttp.ClientSession(connector=connector, trust_env=cfg.trust_env) as session,
        aiohttp.ClientSession(trust_env=False) as metrics_session,
    ):
        tmo = min(cfg.connect_timeout_s, cfg.timeout_s)
        checked = await asyncio.gather(*(check_server(session, url, cfg.model, tmo) for url in endpoints))
        models = [m for m, _ in checked]
        warm_failed = await _warm_up(session, cfg, models, work.warm, deadline)
        meters, names, scope = await _open_meters(metrics_session, cfg)
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sampler(meters, cfg.sample_interval_s, stop)) if meters and cfg.sample_interval_s > 0 else None
        progress = _Progress(len(work.reqs), cfg.progress, cfg.label or "requests")
        probe = LoopLagProbe()
        probe.start()
        t0, cpu0, wait0 = time.perf_counter(), time.thread_time(), runqueue_wait_s()
        try:
            outputs, duration, timed_out, sent = await run_load(
                session,
                cfg,
                models,
                work.reqs,
                offsets=work.offsets,
                max_concurrency=cfg.max_concurrency,
                deadline=deadline,
                duration_s=cfg.duration_s,
                t0=t0,
                progress=progress,
            )
        finally:
            lags, client_cpu_s, wait1 = probe.stop(), time.thread_time() - cpu0, runqueue_wait_s()
            progress.close()
            stop.set()
            if sampler is not None:
                await sampler
        readings = list(await asyncio.gather(*(m.stop() for m in meters)))
    return _Measured(
        models=models,
        roots=[r for _, r in checked],
        warm_failed=warm_failed,
        meters=meters,
        names=names,
        scope=scope,
        t0=t0,
        outputs=outputs,
        duration_s=duration,
        timed_out=timed_out,
        reqs=[work.reqs[i] for i in sent],
        readings=readings,
        loop_lags_s=lags,
        lag_probe_period_s=probe.period_s,
        client_cpu_s=client_cpu_s,
        client_wait_s=None if wait0 is None or wait1 is None else wait1 - wait0,
    )


async def _warm_up(session: aiohttp.ClientSession, cfg: BenchConfig, models: list[str], warm: list[RequestInput], deadline: float) -> int:
    """Send the warm-ups all at once (capped at ``max_concurrency``); how many failed."""
    if not warm:
        return 0
    w_out, _, _, _ = await run_load(
        session,
        cfg,
        models,
        warm,
        offsets=[0.0] * len(warm),
        max_concurrency=cfg.max_concurrency or len(warm),
        deadline=deadline,
    )
    return sum(1 for o in w_out if not o.success)


def _total_reading(run: _Measured) -> EnergyReading:
    """The run's energy: the sum over the meters, or an empty reading that says why there is none."""
    reading = sum_readings(run.readings) if run.readings else None
    if reading is None:
        notes = [r.note for r in run.readings if r.energy_j is None and r.note]
        reading = EnergyReading(window_s=run.duration_s, note=(notes[0] if notes else run.scope))
    elif len(run.meters) > 1:
        reading.note = f"sum over {len(run.meters)} endpoints' server metrics"
    else:
        reading.note = run.readings[0].note
    return reading


def _endpoint_rows(cfg: BenchConfig, run: _Measured, reading: EnergyReading, batch: int | None) -> list[dict[str, Any]]:
    """One summary per server of the fleet, with its own steady state when there are several."""
    endpoints, outputs = cfg.endpoints, run.outputs
    per_endpoint_energy = len(run.meters) == len(endpoints) and run.names == list(endpoints)
    ep_rows = []
    # Why a server has no energy of its own: the fleet was measured as a whole, or not at all.
    ep_note = "energy measured for the whole fleet only" if reading.energy_j is not None else (reading.note or run.scope)
    for k, url in enumerate(endpoints):
        idx = [i for i, o in enumerate(outputs) if o.endpoint == k]
        r_k = run.readings[k] if per_endpoint_energy else None
        ep_rows.append(
            _endpoint_summary(url, run.models[k], [run.reqs[i] for i in idx], [outputs[i] for i in idx], run.duration_s, cfg, r_k, ep_note)
        )
        if len(endpoints) > 1:
            # Each server's own steady state: round-robin gives it 1/n of the target batch (exact, so
            # B = 4 over 3 servers is 4/3 each), and its energy is its own meter's (none where only the
            # fleet total is known).
            b_k = (batch // len(endpoints) if batch % len(endpoints) == 0 else batch / len(endpoints)) if batch else None
            ss_k = steady_state([outputs[i] for i in idx], b_k, [run.meters[k]] if per_endpoint_energy else [], run.t0)
            if not per_endpoint_energy and ss_k["steady_state_duration_s"] is not None:
                ss_k["steady_state_note"] = "; ".join(x for x in (ss_k["steady_state_note"], f"no energy: {ep_note}") if x)
            ep_rows[-1] |= {k2: v for k2, v in ss_k.items() if k2 != "steady_state_rule"}
    return ep_rows


def _run_settings(cfg: BenchConfig, run: _Measured) -> dict[str, Any]:
    """The result's first keys: when, against what, and the load's settings (vllm bench's names where they overlap)."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        # time.perf_counter() when the timed load began (start_times count from it); CLOCK_MONOTONIC
        # on Linux, so runs in different processes of one host can be lined up.
        "t0_perf_counter": run.t0,
        "label": cfg.label,
        "base_url": cfg.base_url,
        "base_urls": list(cfg.endpoints),
        "endpoint_type": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "backend": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "endpoint": "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions",
        "stream": cfg.stream,
        "model_id": run.models[0],
        "model_root": run.roots[0],
        "tokenizer_id": cfg.tokenizer,
        "dataset": f"trace:{cfg.trace}" if cfg.trace else cfg.dataset,
        "num_prompts": len(run.reqs),
        "duration_limit_s": cfg.duration_s,
        "num_warmups": cfg.num_warmups,
        "warmup_failed": run.warm_failed,
        # JSON has no Infinity; vllm bench writes the string "inf" too.
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness,
        "arrival": "trace" if cfg.trace else cfg.arrival,
        "trust_env": cfg.trust_env,
        "arrivals_normalized": bool(
            cfg.normalize_arrivals
            and not cfg.trace
            and cfg.ramp_up_strategy is None
            and cfg.arrival == "gamma"
            and math.isfinite(cfg.request_rate)
        ),
        "max_concurrency": cfg.max_concurrency,
        **(
            {
                "ramp_up_strategy": cfg.ramp_up_strategy,
                "ramp_up_start_rps": cfg.ramp_up_start_rps,
                "ramp_up_end_rps": cfg.ramp_up_end_rps,
                "ramp_up_duration_s": cfg.ramp_up_duration_s,
            }
            if cfg.ramp_up_strategy
            else {}
        ),
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "range_ratio": cfg.range_ratio,
        "seed": cfg.seed,
        "percentiles": list(cfg.percentiles),
        "goodput_slo_ms": dict(cfg.goodput),
        "timeout_s": cfg.timeout_s,
        "request_timeout_s": cfg.request_timeout_s,
        "timed_out": run.timed_out,
    }


def _per_request_arrays(cfg: BenchConfig, reqs: list[RequestInput], outputs: list[RequestOutput]) -> dict[str, list[Any]]:
    """The result's per-request arrays; times in seconds like vllm bench's ttfts/itls/latencies."""
    return {
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.queue_time for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "e2els": [o.latency for o in outputs],
        "input_lens": [o.prompt_tokens if o.prompt_tokens is not None else r.prompt_len for r, o in zip(reqs, outputs)],
        "output_lens": [o.output_tokens for o in outputs],
        "output_tokens_sources": [o.output_tokens_source for o in outputs],
        "itl_methods": [("per_token" if o.itl_per_token else "per_chunk") if cfg.stream else None for o in outputs],
        "endpoint_ids": [o.endpoint for o in outputs],
        "errors": [o.error for o in outputs],
    }


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Synchronous wrapper around :func:`run_benchmark` (must not be called from a running loop)."""
    return asyncio.run(run_benchmark(cfg))


__all__ = ["arrival_offsets", "ramp_offsets", "schedule", "check_server", "run_load", "run_benchmark", "run", "LoadTestError"]
