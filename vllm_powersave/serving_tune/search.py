"""Successive halving under a time budget.

Round 0 measures every configuration for ``window_s``; each later round keeps the best
``ceil(n / eta)`` of the round before and measures them for ``eta`` times longer, until one is
left. Ranking (:func:`rank`): configurations that meet the SLO first, by tokens per joule (higher
first); then the others by how close they come (attainment shortfall, then the worst p99 over its
target). A round's configurations share one seed, so they see the same requests.

The budget (:class:`Budget`) covers the whole command, search and final pairs: before each
measurement its cost is estimated (server start where one is needed, the window, the measured
overhead around it) and the search stops where the measurement would leave too little for the
final pairs. A round cut short after round 0 ranks its configurations by the round before's
windows, the same requests for all, except that one whose window in the cut round missed the SLO
ranks as missing it (``run.final_ranking``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .slo import Verdict


@dataclass(frozen=True)
class Scored:
    """One configuration's window, as the search ranks it: its tokens per joule and SLO verdict."""

    key: str
    round: int
    tok_per_j: float | None
    verdict: Verdict


def rank(entries: list[Scored]) -> list[Scored]:
    """Best first: SLO met by tokens per joule, then the rest by closeness to the SLO."""

    def order(s: Scored) -> tuple:
        tpj = s.tok_per_j if s.tok_per_j is not None else -math.inf
        if s.verdict.met:
            return (0, -tpj, 0.0, 0.0)
        return (1, *s.verdict.closeness(), -tpj)

    return sorted(entries, key=order)


def survivors(n: int, eta: int) -> int:
    """How many of ``n`` configurations go on to the next round."""
    return max(1, math.ceil(n / eta))


@dataclass(frozen=True)
class Round:
    """One round: which configurations, how long each window, which seed."""

    index: int
    keys: tuple[str, ...]
    window_s: float
    seed: int


def first_round(keys: list[str], window_s: float, seed: int) -> Round:
    return Round(0, tuple(keys), window_s, seed)


def next_round(prev: Round, scored: list[Scored], eta: int) -> Round | None:
    """The round after ``prev`` given its windows (``scored``), or ``None`` when the search is over."""
    if len(prev.keys) <= 1:
        return None
    kept = [s.key for s in rank(scored)[: survivors(len(prev.keys), eta)]]
    if len(kept) <= 1:
        return None
    return Round(prev.index + 1, tuple(kept), prev.window_s * eta, prev.seed + 1)


@dataclass(frozen=True)
class CostModel:
    """Estimated seconds: a server start, and the overhead around a window (warm-ups, drain)."""

    start_s: float
    overhead_s: float

    def measurement_s(self, window_s: float, restart: bool) -> float:
        return (self.start_s if restart else 0.0) + window_s + self.overhead_s

    def pairs_s(self, pairs: int, window_s: float) -> float:
        """ABBA pairs: 2 windows each, a start for every change of arm (pairs + 1 at most)."""
        return 2 * pairs * (window_s + self.overhead_s) + (pairs + 1) * self.start_s


class Budget:
    """The command's time budget: ``total_s``, of which ``spent_before_s`` went to earlier runs of the
    same search (resume)."""

    def __init__(self, total_s: float, spent_before_s: float = 0.0) -> None:
        self.total_s = total_s
        self.spent_before_s = spent_before_s
        self._t0 = time.monotonic()

    def spent_s(self) -> float:
        return self.spent_before_s + time.monotonic() - self._t0

    def left_s(self) -> float:
        return self.total_s - self.spent_s()

    def allows(self, cost_s: float, reserve_s: float) -> bool:
        """Whether a step of ``cost_s`` still leaves ``reserve_s`` (the final pairs) in the budget."""
        return cost_s + reserve_s <= self.left_s()

    def pairs_that_fit(self, wanted: int, window_s: float, cost: CostModel, done: int = 0) -> int:
        """The most final pairs (at least 1 and ``done``, at most ``wanted``) whose pairs still to
        measure, beyond the ``done`` ones a resumed search has, fit in what is left."""
        n = max(wanted, done)
        while n > max(1, done) and cost.pairs_s(n - done, window_s) > self.left_s():
            n -= 1
        return n
