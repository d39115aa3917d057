"""Which clock phase a step gets: the memory-bound rule and the regime filter (one home for both).

The step hook's decode-only fast path and the general path both go through
:meth:`RegimeFilter.step`; ``tests/test_hot_path.py`` checks it against the earlier formula.
"""

from __future__ import annotations

import math
from typing import Any


def own_phase(phase: str, num_tokens: int, memory_bound_max_tokens: int) -> str:
    """The phase whose clock preset a step of ``phase`` and ``num_tokens`` gets on its own.

    A step's FLOPs per weight byte equal its token count, so a step of at most
    ``memory_bound_max_tokens`` tokens is memory-bound whatever vLLM calls it: small mixed steps
    get the decode clock, and decode batches above it (e.g. 256 requests, or speculative tokens)
    are compute-bound and get the mixed (compute) clock. 0 disables both.
    """
    if memory_bound_max_tokens and (phase == "decode" or phase == "mixed"):
        if num_tokens <= memory_bound_max_tokens:
            return "decode"
        if phase == "decode":
            return "mixed"
    return phase


def clock_phase(info: Any, memory_bound_max_tokens: int) -> str:
    """:func:`own_phase` of a ``StepInfo``."""
    return own_phase(info.phase, info.num_tokens, memory_bound_max_tokens)


class RegimeFilter:
    """Time-weighted share of compute-bound steps; decides the clock phase under continuous batching.

    Deterministic given the step sequence and the step times, which every TP rank shares up to
    host jitter (ranks start each step within microseconds of each other).
    """

    def __init__(self, window_s: float, share_max: float, burst_tokens: int, memory_bound_max_tokens: int) -> None:
        self.window_s, self.share_max, self.burst_tokens = window_s, share_max, burst_tokens
        self.mb_tokens = memory_bound_max_tokens
        self.share = 1.0  # start compute-bound: never lower before the regime is known
        self._t: float | None = None

    def phase(self, info: Any, now: float, waiting_tokens: int = 0) -> str:
        """The clock phase of this step. ``now``: the scheduler's timestamp (s) where vLLM's
        scheduler was hooked (identical on all ranks); ``waiting_tokens``: prompt tokens waiting in
        the scheduler's queue (look-ahead: at least ``burst_tokens`` of them raise the clock before
        the burst's first step)."""
        return self.step(info.phase, info.num_tokens, now, waiting_tokens)

    def step(self, phase: str, num_tokens: int, now: float, waiting_tokens: int = 0) -> str:
        """:meth:`phase` from the step's phase and token count (the step hook calls this directly
        for decode-only steps, which it classifies without a ``StepInfo``)."""
        own = own_phase(phase, num_tokens, self.mb_tokens)
        x = 0.0 if own == "decode" else 1.0
        t = self._t
        if t is None:
            self.share = x
        else:
            dt = now - t
            a = math.exp(-(dt if dt > 0.0 else 0.0) / self.window_s)  # noqa: FURB136 - max(0.0, dt) without the call
            self.share = a * self.share + (1 - a) * x
        self._t = now
        if waiting_tokens >= self.burst_tokens or phase == "prefill" and num_tokens >= self.burst_tokens:
            return "prefill"
        return "decode" if self.share < self.share_max else own
