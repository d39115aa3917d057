"""Steady-state window and timelines from the per-request timestamps and the periodic energy samples.

Steady state follows the ML.ENERGY benchmark (``RequestTracker`` in ml-energy/benchmark,
``mlenergy/llm/benchmark.py``): with a target batch (concurrency) ``B`` and ``N`` requests, the window
opens when ``B`` requests have received their first token (the prefill burst is over and the batch is
full) and closes when ``N - B - 1`` requests have finished (from then on fewer than ``B`` requests are
left: the ramp-down; the ``- 1`` closes it slightly early). The harness computes these two instants
after the run and snaps them *inward* to the nearest energy samples (every ``sample_interval_s``), so
the window energy is an exact counter difference rather than an interpolation; tokens are counted
over the same snapped window from their arrival times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .client import RequestOutput
from .energy import EnergyMeter, EnergyReading, Sample, energy_between, energy_over, join_info

RULE = (
    "ML.ENERGY steady state: opens when B requests have their first token, closes when N - B - 1 "
    "requests have finished; snapped inward to energy samples"
)
#: ML.ENERGY's data toolkit marks runs with a steady state shorter than this unstable (PITFALLS.md).
MIN_STABLE_S = 20.0
#: ... or with an average batch below this share of the target.
MIN_BATCH_UTILIZATION = 0.85


def token_times(o: RequestOutput) -> list[tuple[float, float]]:
    """``(time, tokens)`` per received chunk, times relative to the run start (s).

    When ``usage`` reports more tokens than chunks, each chunk carries an equal share.
    """
    if not o.success:
        return []
    times = [o.start_time + o.ttft]
    for gap in o.itl:
        times.append(times[-1] + gap)
    w = o.output_tokens / len(times) if times else 0.0
    return [(t, w) for t in times]


def steady_state_bounds(outputs: Sequence[RequestOutput], batch: int) -> tuple[float, float] | str:
    """``(open, close)`` times (s, relative to the run start) of the ML.ENERGY window, or a reason."""
    n = len(outputs)
    first = sorted(o.start_time + o.ttft for o in outputs if o.success)
    done = sorted(o.start_time + o.latency for o in outputs if o.latency > 0)
    k_end = n - batch - 1
    if k_end < 1:
        return f"needs at least B + 2 requests (N = {n}, B = {batch})"
    if len(first) < batch:
        return f"only {len(first)} requests got a first token; the batch of {batch} never filled"
    if len(done) < k_end:
        return f"only {len(done)} requests finished; the window needs {k_end}"
    t_open, t_close = first[batch - 1], done[k_end - 1]
    if t_close <= t_open:
        return (
            f"{batch} requests in flight (the concurrency cap) were never reached before the ramp-down "
            f"({batch} requests had a first token only at {t_open:.3f} s, {k_end} had already finished at {t_close:.3f} s); "
            "at a low request rate the batch stays below the cap"
        )
    return t_open, t_close


def _tick_times(meters: Sequence[EnergyMeter], t0: float) -> list[tuple[float, float] | None]:
    """Per tick: (earliest, latest) reading time across meters relative to ``t0``; None if a read failed."""
    n = min((len(m.samples) for m in meters), default=0)
    out: list[tuple[float, float] | None] = []
    for k in range(n):
        ss = [m.samples[k] for m in meters]
        if any(s.counters is None and s.gpu_j is None for s in ss):
            out.append(None)
        else:
            ts = [s.t - t0 for s in ss]
            out.append((min(ts), max(ts)))
    return out


def sum_readings(readings: Sequence[EnergyReading | None]) -> EnergyReading | None:
    """Sum of several sources' readings over (nearly) the same window; None if any is missing."""
    if not readings or any(r is None or r.energy_j is None for r in readings):
        return None
    rs = [r for r in readings if r is not None]
    srcs = {r.source for r in rs}
    by_phase: dict[str, float] = {}
    for r in rs:
        for k, v in r.by_phase_j.items():
            by_phase[k] = by_phase.get(k, 0.0) + v
    return EnergyReading(
        energy_j=sum(r.energy_j or 0.0 for r in rs),
        window_s=sum(r.window_s for r in rs) / len(rs),
        window_edge_s=max(r.window_edge_s for r in rs),  # the mean of the windows is off by no more
        source="measured" if srcs == {"measured"} else "simulated",
        provider=rs[0].provider,
        by_phase_j=by_phase,
        by_gpu_j={(f"{i}/{g}" if len(rs) > 1 else g): v for i, r in enumerate(rs) for g, v in r.by_gpu_j.items()},
        # Front-end starvation: a sum only where every source has it (a server without the plugin
        # publishes none: no figure, rather than a partial one that reads as the fleet's).
        idle_while_busy_j=_sum_or_none([r.idle_while_busy_j for r in rs]),
        idle_while_busy_s=_sum_or_none([r.idle_while_busy_s for r in rs]),
        frontend_busy_s=_sum_or_none([r.frontend_busy_s for r in rs]),
        energy_crosscheck_ratio={
            (f"{i}/{g}" if len(rs) > 1 else g): v for i, r in enumerate(rs) for g, v in (r.energy_crosscheck_ratio or {}).items()
        }
        or None,
        # One server without the plugin's labels makes the fleet's modes unknown, not a partial list.
        powersave_info=None if any(r.powersave_info is None for r in rs) else join_info([r.powersave_info for r in rs]),
    )


def _sum_or_none(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def steady_state(outputs: Sequence[RequestOutput], batch: float | None, meters: Sequence[EnergyMeter], t0: float) -> dict[str, Any]:
    """``steady_state_*`` result fields (throughput, energy, J/token over the steady-state window).

    ``batch`` may be fractional (one server's share of a fleet's B): the window then counts
    ``ceil(batch)`` first tokens and requests, and the batch utilization is measured against ``batch``.

    All values are None with a ``steady_state_note`` when there is no target batch or the window
    does not exist; energy values are None when no source was sampled inside the window.
    """
    keys = (
        "batch",
        "start_s",
        "end_s",
        "duration_s",
        "output_tokens",
        "output_throughput",
        "avg_concurrency",
        "batch_utilization",
        "gpu_energy_j",
        "gpu_avg_power_w",
        "gpu_energy_per_output_token_j",
        "output_tokens_per_joule",
        "energy_source",
    )
    out: dict[str, Any] = {f"steady_state_{k}": None for k in keys}
    out["steady_state_batch"] = batch
    out["steady_state_rule"] = RULE
    if batch is None:
        out["steady_state_note"] = "no target batch: set max_concurrency or steady_state_batch (the server's max_num_seqs)"
        return out
    bounds = steady_state_bounds(outputs, math.ceil(batch))
    if isinstance(bounds, str):
        out["steady_state_note"] = f"no steady state: {bounds}"
        return out
    t_open, t_close = bounds
    notes: list[str] = []
    a, b = t_open, t_close
    reading: EnergyReading | None = None
    if meters:
        ticks = _tick_times(meters, t0)
        inside = [k for k, tt in enumerate(ticks) if tt is not None and tt[0] >= t_open and tt[1] <= t_close]
        if len(inside) >= 2:
            i, j = inside[0], inside[-1]
            reading = sum_readings([energy_over(m.samples[i : j + 1]) for m in meters])
            a = sum(m.samples[i].t for m in meters) / len(meters) - t0
            b = sum(m.samples[j].t for m in meters) / len(meters) - t0
        else:
            notes.append("window shorter than two energy samples: no window energy (lower sample_interval_s)")
    dur = b - a
    tokens = sum(w for o in outputs for t, w in token_times(o) if a < t <= b)
    busy = sum(max(0.0, min(b, o.start_time + o.latency) - max(a, o.start_time)) for o in outputs if o.latency > 0)
    conc = busy / dur if dur > 0 else None
    out.update(
        {
            "steady_state_start_s": a,
            "steady_state_end_s": b,
            "steady_state_duration_s": dur,
            "steady_state_output_tokens": tokens,
            "steady_state_output_throughput": tokens / dur if dur > 0 else None,
            "steady_state_avg_concurrency": conc,
            "steady_state_batch_utilization": conc / batch if conc is not None else None,
        }
    )
    if reading is not None and reading.energy_j is not None:
        e = reading.energy_j
        out.update(
            {
                "steady_state_gpu_energy_j": e,
                "steady_state_gpu_avg_power_w": e / reading.window_s if reading.window_s > 0 and reading.source == "measured" else None,
                "steady_state_gpu_energy_per_output_token_j": e / tokens if tokens else None,
                "steady_state_output_tokens_per_joule": tokens / e if e > 0 else None,
                "steady_state_energy_source": reading.source,
            }
        )
    if dur < MIN_STABLE_S:
        notes.append(f"shorter than {MIN_STABLE_S:g} s (ML.ENERGY treats such runs as unstable)")
    if conc is not None and conc / batch < MIN_BATCH_UTILIZATION:
        notes.append(f"average concurrency {conc:.2f} is below {MIN_BATCH_UTILIZATION:g} x B (batch not full)")
    out["steady_state_note"] = "; ".join(notes)
    return out


def _phase(a: Sample, b: Sample) -> str | None:
    r = energy_between(a, b)
    if r is None or not r.by_phase_j:
        return None
    phase, j = max(r.by_phase_j.items(), key=lambda kv: kv[1])
    return phase if j > 0 else None


def timeline(meters: Sequence[EnergyMeter], names: Sequence[str], t0: float, interval_s: float) -> dict[str, Any]:
    """Per source: times (s from run start), cumulative energy (J), average power over each sample
    interval (W, from the counter), power and SM-clock gauges, running requests and the dominant
    phase of each interval (by energy; needs the server's per-phase counters)."""
    series = []
    for m, name in zip(meters, names):
        ss = m.samples
        if not ss:
            continue
        energy: list[float | None] = []
        avg_power: list[float | None] = []
        phases: list[str | None] = []
        sources: set[str] = set()
        # Cumulative energy summed over consecutive readable readings (a counter reset loses one
        # interval, never the whole run before it); None where a read failed.
        cum: float | None = 0.0 if ss[0].counters is not None or ss[0].gpu_j is not None else None
        last = ss[0] if cum is not None else None
        for k, s in enumerate(ss):
            if k > 0 and last is not None:
                r = energy_between(last, s)
                if r is not None and r.energy_j is not None and cum is not None:
                    cum += r.energy_j
                    last = s
                    if r.source:
                        sources.add(r.source)
                energy.append(cum if r is not None else None)
            else:
                energy.append(cum if k == 0 else None)
            if k == 0:
                avg_power.append(None)
                phases.append(None)
                continue
            d = energy_between(ss[k - 1], s)
            avg_power.append(d.energy_j / d.window_s if d is not None and d.energy_j is not None and d.window_s > 0 else None)
            phases.append(_phase(ss[k - 1], s))
        gauge_src = {s.gauge_source for s in ss if s.gauge_source}
        series.append(
            {
                "name": name,
                "energy_source": ("measured" if sources == {"measured"} else "simulated") if sources else None,
                "gauge_source": ("measured" if gauge_src == {"measured"} else "simulated") if gauge_src else None,
                "t_s": [s.t - t0 for s in ss],
                "energy_j": energy,
                "avg_power_w": avg_power,
                "power_w": [s.power_w for s in ss],
                "sm_clock_mhz": [s.sm_clock_mhz for s in ss],
                "running": [s.running for s in ss],
                "phase": phases,
            }
        )
    return {"sample_interval_s": interval_s, "series": series}
