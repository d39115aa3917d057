"""Per-worker runtime: meter, phase accounting, clock controller, chunk policy and stats publishing.

One :class:`WorkerRuntime` per worker process (one GPU), created lazily on the first real engine
step, so that NVML is never touched by ``register()`` and CUDA is already set up by vLLM.

Layout:

* this module: the process-level hooks vLLM's wrappers call (``on_step_start``, ``on_step_end``,
  ``on_arrival``, the LM-head hooks ``head_chunks`` / ``chunked_head``) and the process's
  runtime and chunk policy;
* ``build.py``: construction (:class:`WorkerRuntime` from the settings and the runner);
* ``step.py``: the step path (engine thread, hot), the typed :class:`StepRecord` and the records
  both threads share (``StepHandoff``, ``StepTiming``, ``CudaPeak``);
* ``drain.py``: the step records into the energy account, the trace and the simulator;
* ``publisher.py``: the background thread writing the stats files (``stats_contract.py``).

:func:`install_runtime` and :func:`set_chunk_policy` are the seams that set (or clear) the
process's runtime and chunk policy without a vLLM runner (tests, ``benchmarks/hook_overhead.py``).
"""

from __future__ import annotations

import threading
from typing import Any

from .. import ray_relay, vllm_compat
from ..chunking.policy import ChunkPolicy, apply_chunked, free_device_bytes
from ..clocks.regime import RegimeFilter, clock_phase, own_phase
from ..envs import ENV_FORCE_DRY_RUN
from ..settings import settings_from_env
from .build import NVML, NvmlAccess, WorkerRuntime
from .step import StepRecord

__all__ = [
    "ENV_FORCE_DRY_RUN",
    "NVML",
    "NvmlAccess",
    "RegimeFilter",
    "StepRecord",
    "WorkerRuntime",
    "chunk_policy",
    "chunked_head",
    "clock_phase",
    "head_chunks",
    "logprob_chunk_rows",
    "install_runtime",
    "on_arrival",
    "on_step_end",
    "on_step_start",
    "own_phase",
    "process_runtime",
    "set_chunk_policy",
]

_POLICY: ChunkPolicy | None = None
_RUNTIME: "WorkerRuntime | None" = None
_RT_LOCK = threading.Lock()


def chunk_policy() -> ChunkPolicy:
    global _POLICY
    if _POLICY is None:
        _POLICY = ChunkPolicy(settings_from_env().chunking)
    return _POLICY


def set_chunk_policy(policy: ChunkPolicy | None) -> None:
    """Make ``policy`` the process's chunk policy (the LM-head hook's); ``None``: read it again
    from the settings (``$POWERSAVE_SETTINGS_JSON``) at its next use."""
    global _POLICY
    _POLICY = policy


def install_runtime(rt: WorkerRuntime | None) -> None:
    """Make ``rt`` the process's runtime, the one vLLM's hooks reach; ``None``: none, until the
    next step builds one from the runner. Closing a runtime stays its owner's job."""
    global _RUNTIME
    with _RT_LOCK:
        _RUNTIME = rt


def process_runtime() -> WorkerRuntime | None:
    """The process's runtime (``None`` until the first real step built it)."""
    return _RUNTIME


def _head_fault(where: str, exc: Exception) -> None:
    """The LM-head hook fails open: its own fault is logged once per kind and the step goes on."""
    vllm_compat.fault_once(f"lm_head.{where}", exc, f"LM-head hook {where}", "this call runs the head unchunked")


def head_chunks(hidden_states: Any) -> int:
    """LM-head hook, asked first on every LM-head call: the chunk count for ``hidden_states``
    (``[rows, hidden]``) from the policy, keyed on the rows reaching the head, and recorded.

    Returns 0 where vLLM's own call applies unchanged (one chunk and no ``lm_head`` kernel-group
    clock preset: every step but those the table chunks), so that the subclass calls vLLM's head
    GEMM directly. Fails open: a fault of the plugin's own is logged once and gives 0.
    """
    try:
        policy = _POLICY if _POLICY is not None else chunk_policy()
        shape = hidden_states.shape
        rows = shape[0] if len(shape) >= 2 else 1
        rt = _RUNTIME
        if rows < policy.min_rows and (rt is None or not rt.head_groups):
            # policy.take(rows) == 1, inlined: on the H200 host each Python call here costs
            # microseconds (time_parts, h200-vllm.md), and this runs on every LM-head call.
            policy.plain += 1
            policy.rows_total += rows
            return 0
        n = policy.take(rows)
        if n <= 1 and (rt is None or not rt.clocks.groups or not rt.clocks.has_group("lm_head")):
            return 0
        return n
    except Exception as exc:
        _head_fault("policy", exc)
        return 0


def logprob_chunk_rows(rows: int, vocab: int, dtype: Any, device: Any) -> int:
    """Prompt-logprob hook: rows per block for ``rows`` prompt positions over a ``vocab``-entry
    head (:meth:`~vllm_powersave.chunking.policy.ChunkPolicy.logprob_chunk_rows`, free memory read
    on a GPU only where no table rule applies). Fails open: ``rows`` (one block, vLLM's own)."""
    try:
        policy = _POLICY if _POLICY is not None else chunk_policy()
        free = None if policy.has_rule(rows) else free_device_bytes(device)
        elt = int(getattr(dtype, "itemsize", 2))
        return policy.logprob_chunk_rows(rows, vocab, elt, free)
    except Exception as exc:
        _head_fault("prompt logprobs", exc)
        return rows


def chunked_head(head: Any, hidden_states: Any, n: int | None = None, gemm: Any = None) -> Any:
    """``head(hidden_states)`` over ``n`` row chunks (``None``: asks :func:`head_chunks`), inside
    the ``lm_head`` kernel-group clock preset where one passed the switch-latency gate. ``gemm``:
    ``vllm_compat.head_gemm``'s ``(weight, bias)``; without it the head runs unchunked
    (:func:`~vllm_powersave.chunking.apply.apply_chunked`: chunking never raises peak memory).

    Fails open: a fault of the plugin's own (clock group) runs the head as vLLM would; the
    head's own errors (e.g. CUDA out of memory) propagate unchanged."""
    if n is None:
        n = head_chunks(hidden_states)
        if not n:
            return head(hidden_states)
    try:
        rt = _RUNTIME
        grouped = rt is not None and bool(rt.clocks.groups) and rt.clocks.has_group("lm_head")
    except Exception as exc:
        _head_fault("clock group", exc)
        grouped = False
    if not grouped:
        return apply_chunked(head, hidden_states, n, gemm)
    # A kernel-group preset for the LM head passed the switch-latency gate: switch when the GPU
    # (not the host, which runs ahead) reaches the LM head, and back when it leaves it.
    try:
        rt.clocks.on_group("lm_head", ready=_gpu_marker(hidden_states))
    except Exception as exc:
        _head_fault("clock group", exc)
    out = apply_chunked(head, hidden_states, n, gemm)
    try:
        rt.clocks.end_group(ready=_gpu_marker(hidden_states))
    except Exception as exc:
        _head_fault("clock group", exc)
    return out


def _gpu_marker(t: Any) -> Any:
    """``Event.synchronize`` of a CUDA event recorded now on ``t``'s stream (``None`` off CUDA)."""
    if getattr(getattr(t, "device", None), "type", None) != "cuda":
        return None
    import torch

    ev = torch.cuda.Event()
    ev.record()
    return ev.synchronize


def _runtime_for(runner: Any) -> WorkerRuntime:
    global _RUNTIME
    if _RUNTIME is None:
        with _RT_LOCK:
            if _RUNTIME is None:
                _RUNTIME = WorkerRuntime(runner, settings_from_env())
    return _RUNTIME


def on_step_start(runner: Any, scheduler_output: Any) -> None:
    rt = _RUNTIME
    (rt if rt is not None else _runtime_for(runner)).on_step_start(scheduler_output)


_ENGINE_RELAY = {"checked": False}


def _ensure_engine_relay() -> None:
    """EngineCore, first request: under vLLM's Ray executor (this process is the Ray driver) start
    the stats relay on this node, before the first step reaches any worker (ray_relay.py)."""
    _ENGINE_RELAY["checked"] = True
    stats_dir = settings_from_env().stats_dir
    if stats_dir:
        ray_relay.ensure_relay(stats_dir)


def on_arrival(prompt_tokens: int) -> None:
    """Scheduler ``add_request`` hook (EngineCore process). Only a worker living in the same
    process (single-GPU engines) reacts: an idle-clocked GPU ramps up before the first step."""
    if not _ENGINE_RELAY["checked"]:
        _ensure_engine_relay()
    if _RUNTIME is not None:
        _RUNTIME.clocks.on_arrival()
        if _RUNTIME.boost is not None:
            _RUNTIME.boost.on_busy()


def on_step_end(runner: Any) -> None:
    if _RUNTIME is not None:
        _RUNTIME.on_step_end()
