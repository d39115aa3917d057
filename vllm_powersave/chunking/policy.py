"""Adaptive LM-head chunking: how many token-dimension chunks for a given number of rows.

The LM-head GEMM is ``[rows, hidden] x [hidden, vocab]``. Seed 004 (chunked LM head on power- and
thermally-throttled GPUs) reports -14 % energy and -20 % time on a DGX Spark and 1-2 % on an L40S;
on the H200 we measured no gain (``docs/h200-facts.md``), and every extra chunk re-reads the
whole weight, which is pure cost for decode-sized row counts. Hence the policy is a table tuned per
GPU and the default is "no chunking".

Memory is the other reason to chunk. The LM head's output (the logits) is needed whole by its
consumer, so chunking the head never lowers its peak (each block is written into the one output,
:func:`apply_chunked`). Prompt logprobs need only ``k + 1`` figures per row, so their log-softmax
can run block by block (:func:`~vllm_powersave.chunking.apply.chunked_logprobs`): then the peak is
one block's temporaries. :meth:`ChunkPolicy.logprob_chunk_rows` sizes that block: from the table
where a rule applies, else from free device memory (GPU only).
"""

from __future__ import annotations

import sys
from collections import Counter

from ..settings import ChunkingSettings
from .apply import apply_chunked, chunked_logprobs

__all__ = ["ChunkPolicy", "apply_chunked", "chunked_logprobs", "free_device_bytes", "logprob_row_bytes"]

#: Bytes per row and vocabulary entry that one prompt-logprob block holds at once, besides the
#: logits' own dtype: vLLM's float32 log-softmax (4), the float32 upcast of bf16/fp16 logits that
#: the log-softmax takes first (4), and the rank count's comparison with its reduction (up to 4)
#: (``Sampler.compute_logprobs`` and ``gather_logprobs``, vLLM 0.25-0.32).
LOGPROB_EXTRA_BYTES_PER_ENTRY = 12
#: Fewest rows per prompt-logprob block the free-memory rule picks (each block re-reads the head's
#: weight, so tiny blocks cost time; where 16 rows do not fit, vLLM's own unchunked path would not
#: fit either).
MIN_LOGPROB_CHUNK_ROWS = 16


def logprob_row_bytes(vocab: int, elt_bytes: int) -> int:
    """Bytes one row of a prompt-logprob block holds at its peak (see :data:`LOGPROB_EXTRA_BYTES_PER_ENTRY`)."""
    return int(vocab) * (int(elt_bytes) + LOGPROB_EXTRA_BYTES_PER_ENTRY)


def free_device_bytes(device: object) -> int | None:
    """Free memory of a CUDA ``device`` for new tensors: the driver's free memory plus what torch's
    caching allocator holds reserved but unused; ``None`` off CUDA (CPU: no rule from memory)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free) + int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device))


class ChunkPolicy:
    """Chunk count as a function of the rows reaching the LM head.

    ``chunks(rows)`` returns the ``chunks`` of the rule with the largest ``min_rows <= rows``
    (1 when no rule applies), capped at ``rows`` so that no chunk is empty.
    """

    def __init__(self, settings: ChunkingSettings) -> None:
        self.enabled = settings.enabled
        self.free_memory_share = float(getattr(settings, "free_memory_share", 0.5))
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

    def has_rule(self, rows: int) -> bool:
        """Whether a table rule covers ``rows`` (a tuned "1 chunk" included)."""
        return self.enabled and bool(self.rules) and rows >= self.rules[0][0]

    def logprob_chunk_rows(self, rows: int, vocab: int, elt_bytes: int, free_bytes: int | None) -> int:
        """Rows per block for the prompt logprobs of ``rows`` rows (``>= rows``: one block, vLLM's
        own path).

        Chunking off: ``rows``. A table rule for ``rows``: ``ceil(rows / chunks(rows))``. No rule
        and ``free_bytes`` known (a GPU, :func:`free_device_bytes`): as many rows as fit
        ``free_memory_share x free_bytes`` at :func:`logprob_row_bytes` each, at least
        :data:`MIN_LOGPROB_CHUNK_ROWS`. No rule and no figure (CPU): ``rows``.
        """
        rows = int(rows)
        if not self.enabled or rows <= 1:
            return max(rows, 1)
        if self.has_rule(rows):
            n = self.chunks(rows)
            return -(-rows // n)
        if free_bytes is None:
            return rows
        fit = int(self.free_memory_share * max(0, free_bytes)) // max(1, logprob_row_bytes(vocab, elt_bytes))
        return min(rows, max(MIN_LOGPROB_CHUNK_ROWS, fit))

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
