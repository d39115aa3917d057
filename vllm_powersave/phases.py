"""Engine-step classification: prefill, decode, mixed or idle, with token counts.

The input is a plain description of the step (built from vLLM's ``SchedulerOutput`` by
:mod:`vllm_powersave.vllm_compat`), so this logic is testable without vLLM and identical on every
TP/PP rank: all ranks receive the same scheduler output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ReqSched:
    """One request's part of a step.

    ``scheduled``: tokens scheduled this step; ``spec``: speculative (draft) tokens among them;
    ``context_phase``: the request has produced no output yet (its prompt is being processed);
    ``computed``: tokens already in its KV cache before this step.
    """

    scheduled: int
    spec: int = 0
    context_phase: bool = False
    computed: int = 0


class _StepFields(NamedTuple):
    phase: str
    num_reqs: int
    prefill_reqs: int
    decode_reqs: int
    prefill_tokens: int
    decode_tokens: int
    spec_tokens: int
    lm_head_rows: int
    decode_ctx_tokens: int


class StepInfo(_StepFields):
    """Composition of one engine step (immutable).

    ``prefill_tokens``: prompt (or recomputed) tokens; ``decode_tokens``: generated-token positions
    (1 + spec per decoding request); ``lm_head_rows``: rows that reach the LM head (one per request
    plus its spec tokens); ``decode_ctx_tokens``: KV-cache tokens read by decoding requests.

    Built once per engine step, so it is a tuple (one allocation, no per-field ``__setattr__`` as a
    frozen dataclass pays); equality and hashing are still by type and fields, as a dataclass's.
    """

    __slots__ = ()

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return tuple.__eq__(self, other)
        return False if isinstance(other, tuple) else NotImplemented

    def __ne__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return tuple.__ne__(self, other)
        return True if isinstance(other, tuple) else NotImplemented

    __hash__ = tuple.__hash__


#: ``_new(StepInfo, (fields...))``: a StepInfo without the Python-level ``__new__`` frame.
_new = tuple.__new__

IDLE = StepInfo("idle", 0, 0, 0, 0, 0, 0, 0, 0)


def classify(reqs: list[ReqSched]) -> StepInfo:
    """Classify a step from its requests.

    A request in its context phase counts all its scheduled tokens as prefill (chunked-prefill
    continuations included). A decoding request counts ``1 + spec`` decode tokens; anything beyond
    that (a preempted request recomputing its prompt and outputs) counts as prefill, which vLLM's own
    ``compute_iteration_details`` would call generation.
    """
    if not reqs:
        return IDLE
    pre_r = dec_r = pre_t = dec_t = spec_t = rows = ctx = 0
    for r in reqs:
        if r.scheduled <= 0:
            continue
        rows += 1 + r.spec
        spec_t += r.spec
        if r.context_phase:
            pre_r += 1
            pre_t += r.scheduled
            continue
        d = min(r.scheduled, 1 + r.spec)
        extra = r.scheduled - d
        dec_r += 1
        dec_t += d
        ctx += r.computed
        if extra > 0:
            pre_t += extra
    if pre_r + dec_r == 0:
        return IDLE
    if dec_r == 0:
        phase = "prefill"
    elif pre_r == 0 and pre_t == 0:
        phase = "decode"
    else:
        phase = "mixed"
    return StepInfo(phase, pre_r + dec_r, pre_r, dec_r, pre_t, dec_t, spec_t, rows, ctx)


def classify_counts(
    new_reqs: int,
    cached_ctx_reqs: int,
    cached_decode_reqs: int,
    total_tokens: int,
    spec_tokens: int = 0,
    decode_ctx_tokens: int = 0,
) -> StepInfo:
    """:func:`classify` from aggregate counts: O(1) Python work for the per-step hot path.

    Equal to ``classify`` whenever speculative tokens belong to decoding requests (the only case
    vLLM schedules): decode tokens are ``1 + spec`` per decoding request and every other scheduled
    token is prefill work (context-phase prompts, or a resumed request's recomputation).
    """
    prefill_reqs = new_reqs + cached_ctx_reqs
    num_reqs = prefill_reqs + cached_decode_reqs
    if num_reqs == 0 or total_tokens <= 0:
        return IDLE
    decode_tokens = cached_decode_reqs + spec_tokens
    if decode_tokens > total_tokens:  # noqa: PLR1730 - min() without the call (per step)
        decode_tokens = total_tokens
    prefill_tokens = total_tokens - decode_tokens
    if cached_decode_reqs == 0:
        phase = "prefill"
    elif prefill_tokens == 0:
        phase = "decode"
    else:
        phase = "mixed"
    return _new(
        StepInfo,
        (
            phase,
            num_reqs,
            prefill_reqs,
            cached_decode_reqs,
            prefill_tokens,
            decode_tokens,
            spec_tokens,
            num_reqs + spec_tokens,
            decode_ctx_tokens,
        ),
    )
