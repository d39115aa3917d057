"""Row-chunked application of the LM head (torch only, so it can run without the plugin's settings)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def apply_chunked(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    chunks: int,
    gemm: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """``head(hidden_states)``, computed over ``chunks`` row blocks where that costs no memory.

    Args:
        head: maps ``[rows, hidden]`` to ``[rows, vocab_shard]`` (vLLM's LM-head GEMM, any dtype).
        hidden_states: ``[rows, hidden]``.
        chunks: number of row blocks (>= 1); 1 calls ``head`` once on the whole input.
        gemm: ``(weight, bias)`` when ``head`` is the plain GEMM ``hidden_states @ weight.T
            (+ bias)`` (``weight``: ``[vocab_shard, hidden]``, same dtype and device), else ``None``.

    Returns:
        ``[rows, vocab_shard]``. With ``gemm`` each block's product is written straight into its
        rows of the one output tensor (``torch.mm``/``torch.addmm`` with ``out=``): no block result
        is held beside the output, so the peak is never above the unchunked head's (the output
        alone). Without ``gemm`` (a quantised head, say) the head runs once, unchunked: splitting
        it would hold each block's result beside the output. Equal to ``head(hidden_states)``
        within the dtype's rounding (the GEMM library may choose another reduction order for
        another row count or kernel); argmax identical in the differential tests.

    No host synchronisation: the split is by shape only, so it is safe inside graph capture.
    """
    if gemm is None or chunks <= 1 or hidden_states.dim() != 2 or hidden_states.shape[0] <= 1:
        return head(hidden_states)
    weight, bias = gemm
    rows = int(hidden_states.shape[0])
    out = hidden_states.new_empty((rows, weight.shape[0]))
    wt = weight.t()
    n = 0
    for h in torch.tensor_split(hidden_states, min(chunks, rows), dim=0):
        k = h.shape[0]
        if bias is None:
            torch.mm(h, wt, out=out[n : n + k])
        else:
            torch.addmm(bias, h, wt, out=out[n : n + k])
        n += k
    return out
