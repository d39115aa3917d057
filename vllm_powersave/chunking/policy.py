"""Adaptive LM-head chunking: how many token-dimension chunks for a given number of rows.

The LM-head GEMM is ``[rows, hidden] x [hidden, vocab]``. Seed 004 (chunked LM head on power- and
thermally-throttled GPUs) reports -14 % energy and -20 % time on a DGX Spark and 1-2 % on an L40S;
on the H200 we measured no gain (``docs/h200-facts.md``), and every extra chunk re-reads the
whole weight, which is pure cost for decode-sized row counts. Hence the policy is a table tuned per
GPU and the default is "no chunking".
"""

from __future__ import annotations

import sys
from collections import Counter

from ..settings import ChunkingSettings
from .apply import apply_chunked

__all__ = ["ChunkPolicy", "apply_chunked"]


class ChunkPolicy:
    """Chunk count as a function of the rows reaching the LM head.

    ``chunks(rows)`` returns the ``chunks`` of the rule with the largest ``min_rows <= rows``
    (1 when no rule applies), capped at ``rows`` so that no chunk is empty.
    """

    def __init__(self, settings: ChunkingSettings) -> None:
        self.enabled = settings.enabled
        self.rules = [(r.min_rows, r.chunks) for r in settings.table]
        self._calls: Counter[int] = Counter()
        #: Fewer rows than this never chunk (the LM-head hook answers those calls itself and counts
        #: them in ``plain``: one attribute compare per call instead of a method call).
        self.min_rows = self.rules[0][0] if self.enabled and self.rules else sys.maxsize
        self.plain = 0
        self.rows_total = 0

    @property
    def calls(self) -> Counter[int]:
        """LM-head calls per chunk count (a copy)."""
        c = Counter(self._calls)
        if self.plain:
            c[1] += self.plain
        return c

    def chunks(self, rows: int) -> int:
        n = 1
        if self.enabled:
            for min_rows, c in self.rules:
                if rows >= min_rows:
                    n = c
                else:
                    break
        return max(1, min(n, rows))

    def record(self, chunks: int, rows: int) -> None:
        # No lock: the LM head runs on one thread per worker; the publisher only reads.
        self._calls[chunks] += 1
        self.rows_total += rows

    def take(self, rows: int) -> int:
        """``chunks(rows)``, recorded: one call per LM-head call (the per-step path, so the common
        case, no rule reached, is answered here without the call)."""
        n = 1 if rows < self.min_rows else self.chunks(rows)
        self._calls[n] += 1
        self.rows_total += rows
        return n
