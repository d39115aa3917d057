"""Row-chunked application of the LM head (torch only, so it can run without the plugin's settings)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def apply_chunked(head: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor, chunks: int) -> torch.Tensor:
    """``head(hidden_states)`` computed over ``chunks`` row blocks and concatenated.

    Args:
        head: maps ``[rows, hidden]`` to ``[rows, vocab_shard]`` (the LM-head GEMM, any dtype).
        hidden_states: ``[rows, hidden]``.
        chunks: number of row blocks (>= 1); 1 calls ``head`` once on the whole input.

    Returns:
        ``[rows, vocab_shard]``, equal to ``head(hidden_states)`` up to the GEMM library's choice of
        reduction order for a given row count: bitwise through vLLM's CPU GEMM (oneDNN), within the
        dtype's rounding elsewhere (e.g. MKL switches to GEMV for a single row); argmax identical.

    Peak memory: the result plus one chunk's output (not twice the result, as with ``torch.cat``).
    No host synchronisation: the split is by shape only, so it is safe inside graph capture.
    """
    if chunks <= 1 or hidden_states.dim() < 2 or hidden_states.shape[0] <= 1:
        return head(hidden_states)
    chunks = min(chunks, int(hidden_states.shape[0]))
    blocks = torch.tensor_split(hidden_states, chunks, dim=0)
    first = head(blocks[0])
    # Preallocate and fill: torch.cat would hold every part and the result at once (2x the
    # [rows, vocab] peak, measured on the H200); filling in place peaks at result + one chunk.
    out = first.new_empty((hidden_states.shape[0], *first.shape[1:]))
    n = first.shape[0]
    out[:n].copy_(first)
    del first
    for h in blocks[1:]:
        out[n : n + h.shape[0]].copy_(head(h))
        n += h.shape[0]
    return out
