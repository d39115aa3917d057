"""Aggregate statistics with the field names of ``vllm bench serve``."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .client import RequestOutput
from .datasets import RequestInput
from .energy import EnergyReading


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile (same as ``numpy.percentile`` default); 0.0 if empty."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_key(p: float) -> str:
    """``99`` -> ``p99``, ``99.9`` -> ``p99.9`` (vLLM's spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """``mean/median/std/pXX_<name>_ms`` from values in seconds; std is population std (ddof=0)."""
    ms = [v * 1000.0 for v in values_s]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = percentile(ms, p)
    return out


def request_tpot(o: RequestOutput) -> float | None:
    """Time per output token after the first, seconds: (e2e - ttft) / (tokens - 1)."""
    if o.output_tokens > 1:
        return (o.latency - o.ttft) / (o.output_tokens - 1)
    return None


def is_good(o: RequestOutput, slo_ms: dict[str, float]) -> bool:
    """True if a successful request meets every SLO in ``slo_ms`` (keys ttft/tpot/e2el, ms)."""
    if not o.success:
        return False
    vals = {"ttft": o.ttft, "tpot": request_tpot(o) or 0.0, "e2el": o.latency}
    return all(vals[k] * 1000.0 <= ms for k, ms in slo_ms.items())


def calculate_metrics(
    inputs: Sequence[RequestInput],
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Throughput (per second) and latency stats (ms) over completed requests.

    Token totals count completed requests only (failed requests did no useful work);
    input tokens come from ``usage.prompt_tokens`` when reported, else the estimate.
    """
    ok = [(i, o) for i, o in zip(inputs, outputs) if o.success]
    in_tokens = [o.prompt_tokens if o.prompt_tokens is not None else i.prompt_len for i, o in ok]
    out_tokens = [o.output_tokens for _, o in ok]
    total_in, total_out = sum(in_tokens), sum(out_tokens)

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    m: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)),
        "request_goodput": None,
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    if goodput:
        good = sum(1 for _, o in ok if is_good(o, goodput))
        m["request_goodput"] = rate(good)
        m["good_requests"] = good
    tpots = [t for _, o in ok if (t := request_tpot(o)) is not None]
    m |= summarize_ms("ttft", [o.ttft for _, o in ok], percentiles)
    m |= summarize_ms("tpot", tpots, percentiles)
    m |= summarize_ms("itl", [x for _, o in ok for x in o.itl], percentiles)
    m |= summarize_ms("e2el", [o.latency for _, o in ok], percentiles)
    m |= request_energy_metrics(outputs)
    return m


def request_energy_metrics(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """Per-request joules the server reported inside ``usage`` (vllm-powersave with
    ``per_request_energy``); empty when no request carried them.

    ``request_energy_j`` and ``request_energy_statuses`` are per request, in the order of the other
    per-request arrays (None where absent). Mean and total cover completed requests with a figure;
    ``request_energy_reported`` counts them, so a pending figure shows as a shortfall, not a zero.
    """
    if not any(o.energy_status is not None for o in outputs):
        return {}
    figures = [o.energy_j for o in outputs if o.success and o.energy_j is not None]
    sources = sorted({o.energy_source for o in outputs if o.energy_j is not None and o.energy_source})
    return {
        "request_energy_j": [o.energy_j for o in outputs],
        "request_energy_statuses": [o.energy_status for o in outputs],
        "request_energy_reported": len(figures),
        "mean_request_energy_j": statistics.fmean(figures) if figures else None,
        "total_request_energy_j": sum(figures) if figures else None,
        "request_energy_source": ",".join(sources) or None,
    }


def method_metrics(outputs: Sequence[RequestOutput], stream: bool) -> dict[str, Any]:
    """Which method each latency and token figure used, over completed requests.

    ``ttft_rule``, ``itl_method`` (``per_token``: per-chunk usage gave each chunk's token count, so a
    chunk's gap is spread over its tokens; ``per_chunk``: gaps between token chunks, as vllm bench
    serve; ``mixed``; None without streaming), ``output_tokens_source`` (``usage`` | ``estimated`` |
    ``mixed``), the number of estimated requests and the estimate's method, and ``methods``: one
    sentence per figure for the report.
    """
    ok = [o for o in outputs if o.success]
    est = sum(1 for o in ok if not o.usage_reported)
    per_tok = sum(1 for o in ok if o.itl_per_token)

    def share(n: int, all_: str, none: str) -> str | None:
        return None if not ok else all_ if n == len(ok) else none if n == 0 else "mixed"

    itl_method = share(per_tok, "per_token", "per_chunk") if stream else None
    tokens_source = share(est, "estimated", "usage")
    est_method = ("token_chunks" if stream else "words") if est else None
    if not stream:
        ttft_rule, itl = "non_streaming_full_response", "none (not streamed)"
    elif itl_method == "per_token":
        ttft_rule = "first_chunk_with_token_per_usage"
        itl = "per-token intervals: each chunk's gap divided over the tokens its per-chunk usage reports"
    elif itl_method == "mixed":
        ttft_rule = "first_chunk_with_token_per_usage_else_text"
        itl = (
            f"per-token intervals for the {per_tok} requests with per-chunk usage, gaps between token chunks "
            f"for the other {len(ok) - per_tok}"
        )
    else:
        ttft_rule = "first_chunk_with_text"
        itl = "gaps between token chunks (no per-chunk usage: a chunk may carry several tokens)"
    ttft = {
        "non_streaming_full_response": "time to the whole response (not streamed: TTFT = E2E)",
        "first_chunk_with_token_per_usage": "time to the first chunk whose per-chunk usage reports a token",
        "first_chunk_with_token_per_usage_else_text": "time to the first chunk carrying a token (per-chunk usage "
        "where reported, else non-empty text)",
        "first_chunk_with_text": "time to the first chunk with non-empty text (empty deltas do not count)",
    }[ttft_rule]
    tokens = {
        None: "no completed requests",
        "usage": "server usage (completion_tokens)",
        "estimated": f"estimated from {'token chunks' if stream else 'words'} (no usage reported)",
        "mixed": f"server usage, estimated from {'token chunks' if stream else 'words'} for {est} of {len(ok)} requests without usage",
    }[tokens_source]
    return {
        "ttft_rule": ttft_rule,
        "itl_method": itl_method,
        "output_tokens_source": tokens_source,
        "output_tokens_estimated_requests": est,
        "output_tokens_estimate_method": est_method,
        "methods": {"ttft": ttft, "itl": itl, "tpot": "(E2E - TTFT) / (output tokens - 1)", "output_tokens": tokens},
    }


def energy_metrics(reading: EnergyReading, total_input_tokens: int, total_output_tokens: int) -> dict[str, Any]:
    """Energy-efficiency fields (J, W, tokens/J); all None when there is no energy source.

    Average power divides by the scrape-to-scrape window, the interval the energy covers. For
    simulated energy it is left out (None): a simulated GPU's joules over a CPU run's wall time is
    not a power anyone could measure.
    """
    e = reading.energy_j
    total = total_input_tokens + total_output_tokens
    has = e is not None and e > 0
    return {
        "gpu_energy_j": e,
        "gpu_avg_power_w": (e / reading.window_s) if e is not None and reading.window_s > 0 and reading.source == "measured" else None,
        "gpu_energy_per_output_token_j": (e / total_output_tokens) if e is not None and total_output_tokens else None,
        "gpu_energy_per_total_token_j": (e / total) if e is not None and total else None,
        "output_tokens_per_joule": (total_output_tokens / e) if has else None,
        "total_tokens_per_joule": (total / e) if has else None,
        # Idle energy (server up, no engine step) of the window, shown separately, and the output
        # tokens per joule of the active phases alone (needs the server's per-phase counters).
        "gpu_idle_energy_j": reading.by_phase_j.get("idle") if reading.by_phase_j else None,
        "gpu_active_energy_per_output_token_j": (
            (e - reading.by_phase_j.get("idle", 0.0)) / total_output_tokens
            if e is not None and reading.by_phase_j and total_output_tokens
            else None
        ),
        # Front-end starvation (the plugin's counters): idle GPU energy and time while requests were
        # in flight at the server, and their share of the server's busy time.
        "gpu_idle_while_busy_energy_j": reading.idle_while_busy_j,
        # The server's own check of its energy counter against the power integral, by GPU.
        "energy_crosscheck_ratio": reading.energy_crosscheck_ratio,
        # What the server ran with (the plugin's powersave_info labels; advise reads cuda_perf_boost).
        "powersave_info": reading.powersave_info,
        "gpu_idle_while_busy_s": reading.idle_while_busy_s,
        "frontend_busy_s": reading.frontend_busy_s,
        "idle_while_busy_share": (
            reading.idle_while_busy_s / reading.frontend_busy_s
            if reading.idle_while_busy_s is not None and reading.frontend_busy_s
            else None
        ),
        "energy_source": reading.source,
        "energy_provider": reading.provider,
        "energy_by_phase_j": dict(reading.by_phase_j),
        "energy_by_gpu_j": dict(reading.by_gpu_j),
        "energy_window_s": reading.window_s,
        "energy_window_edge_s": reading.window_edge_s,
        "energy_note": reading.note,
    }


def peak_metrics(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """``max_output_tokens_per_s`` and ``max_concurrent_requests`` over 1-s buckets, as ``vllm bench serve``.

    Buckets start at the first successful request's start; a token counts in the bucket of its
    chunk's arrival, a request in every bucket it overlaps.
    """
    ok = [o for o in outputs if o.success]
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t_min = min(o.start_time for o in ok)
    n_buckets = int(math.ceil(max(o.start_time + o.latency for o in ok) - t_min)) + 1
    tokens = [0.0] * n_buckets
    conc = [0] * n_buckets
    for o in ok:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for t in times:
            b = int(t - t_min)
            if 0 <= b < n_buckets:
                tokens[b] += 1
        for b in range(int(o.start_time - t_min), int(o.start_time + o.latency - t_min) + 1):
            conc[b] += 1
    return {"max_output_tokens_per_s": max(tokens), "max_concurrent_requests": max(conc)}
