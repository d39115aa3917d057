"""A/B runs in ABBA order: pair 0 runs A then B, pair 1 B then A, and so on.

Going first or second has a cost of its own (a neighbour's leftovers, drift within a pair); the
alternating order puts it on both arms equally over the pairs, so the mean ratio cancels it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .stats import ratio_ci95


def abba(arms: Sequence[str], pairs: int) -> Iterator[tuple[int, str]]:
    """``(pair, arm)`` in run order: ``arms`` forward in even pairs, reversed in odd ones."""
    for pair in range(pairs):
        for arm in arms if pair % 2 == 0 else list(reversed(arms)):
            yield pair, arm


def run_abba(arms: Sequence[str], pairs: int, window: Callable[[int, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Call ``window(pair, arm)`` in ABBA order; returns its results, each tagged with pair and arm."""
    return [{"pair": pair, "arm": arm, **window(pair, arm)} for pair, arm in abba(arms, pairs)]


def paired(windows: Sequence[dict[str, Any]], key: str, a: str = "A", b: str = "B") -> tuple[list[float], list[float]]:
    """A's and B's ``key`` over the pairs that have both (a window cut short leaves its pair out)."""
    by = {(w["pair"], w["arm"]): w.get(key) for w in windows}
    both = sorted(p for p, arm in by if arm == a and by.get((p, b)) is not None and by[(p, a)] is not None)
    return [float(by[(p, a)]) for p in both], [float(by[(p, b)]) for p in both]


def ratio_summary(windows: Sequence[dict[str, Any]], key: str, a: str = "A", b: str = "B") -> dict[str, Any]:
    """B/A of ``key``: per pair, the mean and its 95 % interval (None with fewer than 2 pairs)."""
    xa, xb = paired(windows, key, a, b)
    out: dict[str, Any] = {"pairs": len(xa), "per_pair": [y / x for x, y in zip(xa, xb) if x]}
    if len(xa) >= 2 and all(xa):
        out["mean"], out["ci95_lo"], out["ci95_hi"] = ratio_ci95(xa, xb)
    return out
