"""Arrival schedules (open loop): gamma/Poisson, constant, linear/exponential ramp-up, trace replay.

All schedules are lists of send times in seconds relative to the first request. Random schedules
are deterministic for a given seed and use their own random stream (``seed + 7919``) so that
changing the rate never changes which prompts are sent.

Ramps are built by time rescaling: draw the arrivals of a unit-rate process (gamma gaps with mean 1,
or gaps of exactly 1 for ``constant``) in "operational time" and map each through the inverse of the
cumulative rate ``Lambda(t) = integral of rate(u) du``. A Poisson process with a time-varying rate is
obtained exactly this way (Cinlar, *Introduction to Stochastic Processes*, 1975, time-change theorem);
the same map applied to gamma gaps keeps the burstiness shape while following the ramp.
"""

from __future__ import annotations

import math
import random
from typing import Literal

#: Offset between the prompt seed and the arrival seed (any prime; kept for reproducibility).
ARRIVAL_SEED_OFFSET = 7919

Arrival = Literal["gamma", "constant"]
RampStrategy = Literal["linear", "exponential"]


def _unit_gaps(n: int, arrival: Arrival, burstiness: float, rng: random.Random) -> list[float]:
    """``n`` gaps of a unit-rate process (mean 1): gamma(shape=b, scale=1/b) or exactly 1."""
    if arrival == "constant":
        return [1.0] * n
    return [rng.gammavariate(burstiness, 1.0 / burstiness) for _ in range(n)]


def _operational_times(n: int, arrival: Arrival, burstiness: float, seed: int) -> list[float]:
    """Cumulative unit-rate arrival times, first at 0."""
    rng = random.Random(seed + ARRIVAL_SEED_OFFSET)
    gaps = _unit_gaps(max(n - 1, 0), arrival, burstiness, rng)
    out, s = [0.0], 0.0
    for g in gaps:
        s += g
        out.append(s)
    return out[:n]


def arrival_offsets(
    n: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    arrival: Arrival = "gamma",
    normalize: bool = True,
) -> list[float]:
    """Send times (s, relative to the first request) for ``n`` requests at ``request_rate`` req/s.

    ``inf`` sends all at once. ``gamma`` gaps have mean 1/rate and shape ``burstiness`` (1 =
    Poisson, < 1 burstier, > 1 more regular, as ``vllm bench serve``); ``constant`` gaps are exactly
    1/rate.

    ``normalize`` (default; ``vllm bench serve`` normalizes its fixed-rate draws too): the drawn
    gamma gaps are scaled together so that the last request goes out at exactly (n - 1) / rate.
    vllm bench's schedule also starts with one gap before its first request and ends at n / rate
    from its start, which its reported duration includes (~1/rate longer than ours, measured).
    Without it a run's length is a random sum whose spread is 1/sqrt(n - 1) for Poisson (3.6 % at
    768 requests), and so is its throughput from one seed to the next; two tools at the same rate
    would then differ by their draws. The shape of the gaps is kept; ``False`` gives the raw draw.
    """
    if math.isinf(request_rate):
        return [0.0] * n
    times = _operational_times(n, arrival, burstiness, seed)
    if normalize and arrival == "gamma" and n > 1 and times[-1] > 0:
        scale = (n - 1) / times[-1]
        if math.isfinite(scale):  # a sum of subnormal gaps (burstiness near 0) keeps its raw draw
            times = [t * scale for t in times]
    return [u / request_rate for u in times]


def _ramp_inverse(lam: float, r0: float, r1: float, dur: float, strategy: RampStrategy) -> float:
    """Time t with Lambda(t) = lam for a ramp r0 -> r1 over ``dur`` s, then r1 held."""
    if strategy == "linear":
        lam_end = (r0 + r1) / 2.0 * dur
        if lam >= lam_end:
            return dur + (lam - lam_end) / r1
        a = (r1 - r0) / (2.0 * dur)  # Lambda(t) = r0 t + a t^2
        if abs(a) < 1e-15:
            return lam / r0
        # The root that is continuous at a -> 0 (stable for both signs of a).
        return 2.0 * lam / (r0 + math.sqrt(r0 * r0 + 4.0 * a * lam))
    k = r1 / r0
    if abs(k - 1.0) < 1e-12:
        return lam / r0
    ln_k = math.log(k)
    lam_end = r0 * dur * (k - 1.0) / ln_k
    if lam >= lam_end:
        return dur + (lam - lam_end) / r1
    return dur / ln_k * math.log1p(lam * ln_k / (r0 * dur))


def ramp_offsets(
    n: int,
    start_rps: float,
    end_rps: float,
    *,
    duration_s: float | None = None,
    strategy: RampStrategy = "linear",
    burstiness: float = 1.0,
    seed: int = 0,
    arrival: Arrival = "gamma",
) -> list[float]:
    """Send times for a rate that ramps from ``start_rps`` to ``end_rps`` (req/s).

    The ramp lasts ``duration_s`` seconds and ``end_rps`` is held afterwards. Without
    ``duration_s`` the ramp spans the whole run (its expected length for ``n`` requests), which is
    what ``vllm bench serve --ramp-up-strategy`` does per request index.

    Raises ``ValueError`` for non-positive rates or duration.
    """
    if not (start_rps > 0 and end_rps > 0 and math.isfinite(start_rps) and math.isfinite(end_rps)):
        raise ValueError(f"ramp-up rates must be positive and finite (got {start_rps}, {end_rps})")
    if duration_s is None:
        if strategy == "linear":
            duration_s = 2.0 * n / (start_rps + end_rps)
        else:
            k = end_rps / start_rps
            duration_s = n / start_rps if abs(k - 1) < 1e-12 else n * math.log(k) / (start_rps * (k - 1.0))
    if not duration_s > 0:
        raise ValueError(f"ramp-up duration must be > 0 s (got {duration_s})")
    return [_ramp_inverse(u, start_rps, end_rps, duration_s, strategy) for u in _operational_times(n, arrival, burstiness, seed)]
