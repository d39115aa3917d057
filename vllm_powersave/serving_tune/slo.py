"""Latency targets and how one measured window is judged against them.

A request **attains** the SLO when it completed with TTFT <= ``ttft_ms`` and TPOT <= ``tpot_ms``
(each where given); a failed request never does. A window **meets** the SLO when its attainment
(attaining requests / requests sent) is at least ``attainment`` and, where ``itl_ms`` is given, the
window's p99 inter-token latency is at most ``itl_ms``. With the default attainment 0.99 the TTFT
and TPOT targets are p99 targets counted per request. A window that misses says by how much: the
attainment's shortfall in points and each p99 figure over its target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class SloError(ValueError):
    """SLO targets that cannot be judged; one line naming the flag and value."""


@dataclass(frozen=True)
class Slo:
    """Targets in ms (``None``: no target) and the share of requests that must attain them."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None
    attainment: float = 0.99

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "itl_ms"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise SloError(f"--slo-{name.removesuffix('_ms').replace('_', '-')}-ms = {v!r}: must be a positive number of ms")
        if not (0 < self.attainment <= 1):
            raise SloError(f"--slo-attainment = {self.attainment!r}: must be in (0, 1], e.g. 0.99")

    def describe(self) -> str:
        parts = [f"TTFT <= {self.ttft_ms:g} ms"] if self.ttft_ms else []
        parts += [f"TPOT <= {self.tpot_ms:g} ms"] if self.tpot_ms else []
        goal = f"{100 * self.attainment:g} % of requests with " + " and ".join(parts) if parts else "every request completed"
        return goal + (f"; p99 ITL <= {self.itl_ms:g} ms" if self.itl_ms else "")

    def identity(self) -> dict[str, Any]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "itl_ms": self.itl_ms, "attainment": self.attainment}


@dataclass(frozen=True)
class Verdict:
    """How one window did against the SLO; ``misses`` in words, empty when met."""

    met: bool
    attainment: float
    shortfall_pts: float  # attainment target minus attainment, percentage points (0 when attained)
    worst_over: float  # largest p99 / target over 1 (0 when every p99 is within its target)
    misses: tuple[str, ...] = ()

    def closeness(self) -> tuple[float, float]:
        """Smaller is closer to meeting the SLO."""
        return (self.shortfall_pts, self.worst_over)


def request_attains(ttft_s: float | None, latency_s: float | None, output_tokens: int | None, error: str, slo: Slo) -> bool:
    """Whether one request completed within the TTFT and TPOT targets (times in s)."""
    if error or ttft_s is None or latency_s is None or not output_tokens:
        return False
    if slo.ttft_ms is not None and ttft_s * 1000.0 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None and output_tokens > 1 and (latency_s - ttft_s) / (output_tokens - 1) * 1000.0 > slo.tpot_ms:
        return False
    return True


def attainment_of(result: dict[str, Any], slo: Slo) -> tuple[int, int]:
    """``(attaining requests, requests sent)`` of a ``loadtests`` result's per-request arrays."""
    ttfts, lats = result.get("ttfts") or [], result.get("latencies") or []
    outs, errs = result.get("output_lens") or [], result.get("errors") or []
    n = len(ttfts)
    good = sum(
        request_attains(
            ttfts[i], lats[i] if i < len(lats) else None, outs[i] if i < len(outs) else None, errs[i] if i < len(errs) else "", slo
        )
        for i in range(n)
    )
    return good, n


def judge(good: int, sent: int, p99_ms: dict[str, float | None], slo: Slo) -> Verdict:
    """The verdict of a window: ``good`` of ``sent`` requests attained; ``p99_ms``: its p99
    ``ttft``, ``tpot`` and ``itl`` in ms."""
    att = good / sent if sent else 0.0
    shortfall = max(0.0, 100.0 * (slo.attainment - att))
    misses = [f"attainment {100 * att:.1f} % vs {100 * slo.attainment:g} % ({shortfall:.1f} points short)"] if shortfall > 1e-9 else []
    worst = 0.0
    for name in ("ttft", "tpot", "itl"):
        target, got = getattr(slo, f"{name}_ms"), p99_ms.get(name)
        if target is None or got is None:
            continue
        over = got / target - 1.0
        if over > 0:
            worst = max(worst, over)
            misses.append(f"p99 {name.upper()} {got:.1f} ms vs {target:g} ms (+{100 * over:.0f} %)")
    itl_ok = slo.itl_ms is None or (p99_ms.get("itl") is not None and p99_ms["itl"] <= slo.itl_ms)
    met = shortfall <= 1e-9 and itl_ok and sent > 0
    if not met and not misses:
        misses = ["no request completed"] if sent == 0 else ["p99 ITL unknown"]
    # Only the misses that decide the verdict count as misses: a p99 over its target with the
    # attainment reached (TTFT/TPOT at attainment < 0.99) is reported but does not fail the window.
    return Verdict(met, att, shortfall, worst if not met else 0.0, tuple(misses) if not met else ())


def wilson_ci95(good: int, n: int) -> tuple[float, float] | None:
    """Wilson score 95 % interval of a share ``good / n`` (``None`` without requests)."""
    if n <= 0:
        return None
    z, p = 1.959964, good / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
