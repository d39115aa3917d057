"""Row-chunked application of the LM head (torch only, so it can run without the plugin's settings)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def chunked_logprobs(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    scores_fn: Callable[[torch.Tensor], torch.Tensor],
    gather_fn: Callable[[torch.Tensor, int, torch.Tensor], Any],
    hidden_states: torch.Tensor,
    num_logprobs: int,
    token_ids: torch.Tensor,
    rows_per_chunk: int,
) -> Any:
    """``gather_fn(scores_fn(logits_fn(hidden_states)), num_logprobs, token_ids)``, computed over
    row blocks of at most ``rows_per_chunk`` rows, so that no ``[rows, vocab]`` tensor exists.

    Args:
        logits_fn: ``[n, hidden]`` -> ``[n, vocab]`` logits (vLLM's ``compute_logits``).
        scores_fn: logits -> float32 scores of the same shape (vLLM's ``compute_logprobs``, a
            log-softmax; or ``.to(float32)`` for raw-logit modes).
        gather_fn: ``(scores, k, token_ids)`` -> a tuple (vLLM's ``LogprobsTensors``) whose tensors
            have one row per scored row (vLLM's ``gather_logprobs``: top-k ids and logprobs, the
            token's rank); ``None`` fields are passed through.
        hidden_states: ``[rows, hidden]``; ``token_ids``: ``[rows]`` (the token scored per row).
        rows_per_chunk: rows per block; ``>= rows`` makes one call on the whole input.

    Returns:
        What ``gather_fn`` returns for the whole input (same type), each block's rows written into
        one preallocated output per field: the peak is one block's logits and scores plus the
        small ``[rows, k + 1]`` results. Every op here is row-wise (log-softmax over the vocabulary,
        top-k, gather, rank count), so each row's result is the unchunked one's up to the GEMM's
        rounding for another row count.
    """
    rows = int(hidden_states.shape[0])
    step = max(1, int(rows_per_chunk))
    if step >= rows:
        return gather_fn(scores_fn(logits_fn(hidden_states)), num_logprobs, token_ids)
    out: list[Any] | None = None
    part: Any = None
    for s in range(0, rows, step):
        e = min(rows, s + step)
        part = gather_fn(scores_fn(logits_fn(hidden_states[s:e])), num_logprobs, token_ids[s:e])
        if out is None:
            out = [t.new_empty((rows, *t.shape[1:])) if isinstance(t, torch.Tensor) else t for t in part]
        for dst, src in zip(out, part):
            if isinstance(dst, torch.Tensor):
                dst[s:e].copy_(src)
    return part._make(out) if hasattr(part, "_make") else type(part)(out)
