"""Decode pacing: hold decode-only steps apart to a TPOT target while nothing waits.

Why it saves energy: a small-batch decode step is bound by reading the weights, so its time and
energy hardly depend on the batch (Llama-3.1-8B on an H100: 0.455 J per token at batch 8 against
0.070 at batch 512, ML.ENERGY leaderboard v3; ``docs/decode-pacing.md``). Under open-loop
arrivals (Poisson traffic below saturation) the batch is the arrival rate times the time a
request stays (Little's law), so spacing the steps to a period ``T`` makes each request stay
longer, the batch grow in proportion and the steps per second fall, while the tokens per second
stay the arrival rate's. Between steps the GPU draws its loaded-idle power (~122 W on the H200
with the boost held, docs/h200-facts.md) instead of a decode step's.

When it does not pay: where the batch cannot grow with the period (closed-loop clients at a fixed
concurrency, a batch at ``max_num_seqs``) the gaps only add idle energy and cost throughput; the
pacer therefore never holds a step while a request waits in the scheduler's queue or the batch is
full, and ``tune-serving`` measures it against the user's own traffic before recommending it.

The pacer never delays a prefill: a request that arrives during a gap wakes the engine at once
(the input queue is polled every :data:`POLL_S`), and no step is held while a running request is
still owed its prefill or its first token (:class:`PaceFacts`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

#: How often a held engine looks at its input queue (s): the most a new request's TTFT can grow.
POLL_S = 0.0005


@dataclass(frozen=True)
class PaceFacts:
    """What the engine's scheduler holds before the next step."""

    running: int  # requests in the running batch
    waiting: int  # requests in the scheduler's waiting queue
    max_running: int  # the batch limit (vLLM's max_num_seqs)
    # A running request still has tokens to compute before it decodes (a chunked prefill, or a
    # preempted request's recompute), or has no output yet: under async scheduling its first
    # token is collected by the next loop iteration, which a hold would delay.
    prefill_pending: bool


@dataclass
class PaceStats:
    """What the pacer did (exported on /metrics as ``powersave_decode_pacing_*``)."""

    held_steps: int = 0
    held_s: float = 0.0
    woken_early: int = 0  # holds cut short by an arriving request


class DecodePacer:
    """Spaces decode-only steps to ``tpot_target_ms`` (one pacer per engine-core process).

    :meth:`hold` runs in the engine's busy loop before it takes new requests and steps: it returns
    at once unless a gap is due, and a due gap ends early when ``queue_empty()`` turns false.
    """

    def __init__(
        self,
        tpot_target_ms: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not tpot_target_ms > 0:
            raise ValueError(f"tpot_target_ms must be > 0, got {tpot_target_ms!r}")
        self.period_s = tpot_target_ms / 1000.0
        self.stats = PaceStats()
        self._clock = clock
        self._sleep = sleep
        self._last_step_t: float | None = None  # when the previous step was let go
        self.off_reason: str | None = None  # set once by turn_off: the pacer holds nothing after

    def turn_off(self, reason: str) -> None:
        """Stop holding for good (a fault, or vLLM's scheduler drifted), keeping the figures."""
        self.off_reason = reason

    def gap_s(self, now: float, facts: PaceFacts) -> float:
        """Seconds to hold the next step (0: let it go now)."""
        if self._last_step_t is None or facts.running <= 0:
            return 0.0
        if facts.waiting > 0 or facts.prefill_pending or facts.running >= facts.max_running:
            return 0.0
        return max(0.0, self._last_step_t + self.period_s - now)

    def hold(self, facts: PaceFacts, queue_empty: Callable[[], bool]) -> float:
        """Hold the engine until the period since the last step has passed, an input arrives or
        nothing is left to pace; returns the seconds held."""
        if self.off_reason is not None:
            return 0.0
        start = self._clock()
        gap = self.gap_s(start, facts) if queue_empty() else 0.0
        if gap > 0.0:
            deadline = start + gap
            now = start
            while now < deadline:
                if not queue_empty():
                    self.stats.woken_early += 1
                    break
                self._sleep(min(POLL_S, deadline - now))
                now = self._clock()
            self.stats.held_steps += 1
            self.stats.held_s += now - start
        else:
            now = start
        # Only steps with a batch start a period: after an idle spell the first step goes at once.
        self._last_step_t = now if facts.running > 0 else None
        return now - start

    def figures(self) -> "PaceFigures":
        """What it did so far, stamped on each step's ``SchedulerOutput`` for the workers to publish."""
        return PaceFigures(self.period_s * 1000.0, self.stats.held_steps, self.stats.held_s, self.stats.woken_early, self.off_reason)


class PaceFigures(NamedTuple):
    """A pacer's figures as they travel to the workers (a tuple: it rides on every step)."""

    tpot_target_ms: float
    held_steps: int
    held_s: float
    woken_early: int
    off_reason: str | None = None  # the pacer turned itself off, and why
