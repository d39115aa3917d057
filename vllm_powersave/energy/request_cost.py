"""What each request costs in an engine step: the weights by which a step's energy is split.

A step's energy is measured for the step as a whole (the counter, see :mod:`.account`). Splitting it
by scheduled tokens charges a prompt that lands in a memory-bound decode step for most of the step,
although the step costs about the same with or without it: the weights are read once per step
whatever the batch holds (docs/request-energy.md). This module prices each request's part of a step
with a roofline cost model instead:

* **shared**: the weights are read once per step (``weight_bytes`` / bandwidth seconds), split
  equally among the requests scheduled in the step;
* **own**: a request's FLOPs (its scheduled tokens through the model body, its one LM-head row,
  attention over its context and its new tokens) over the peak FLOP/s, plus its bytes (the KV cache
  it reads, ``ctx`` tokens, and writes, its scheduled tokens) over the bandwidth.

A request's weight is ``shared / n + flops / peak + bytes / bandwidth`` (seconds of the GPU's
ceilings), and the step's energy is split in proportion to the weights. Equivalently: the step's
energy is split between compute and memory in proportion to their roofline times, then each part
by each request's use of it (the weights' bytes equally). Only the ratio of the ceilings (the ridge
point) matters for the split, and the ceilings are those of the simulated GPU in
``vllm_powersave.sim.ceilings`` (calibrated on the H200's measured 661 TFLOP/s and 4.28 TB/s, docs/h200-facts.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm_powersave")


@dataclass(frozen=True)
class RequestCostModel:
    """Roofline cost of a request's part of a step. Units: FLOP, B, FLOP/s, B/s.

    ``body_flops_per_token``: 2 x the parameters every token passes (LM head excluded);
    ``head_flops_per_row``: 2 x the LM head's parameters (one sampling row per request and step);
    ``attn_flops_per_pair``: FLOPs per (query, key) pair over all layers (QK^T and PV: 4 x layers x
    attention heads x head_dim); ``kv_bytes_per_token``: K+V bytes per token over all layers;
    ``weight_bytes``: bytes of all weights, read once per step.
    """

    body_flops_per_token: float
    head_flops_per_row: float
    attn_flops_per_pair: float
    kv_bytes_per_token: float
    weight_bytes: float
    peak_flops: float
    mem_bw: float

    @classmethod
    def from_model(cls, cost: Mapping[str, float], gpu: str = "h200") -> RequestCostModel | None:
        """From a model's figures (``vllm_compat.runner_model_cost``'s keys: ``n_params``,
        ``vocab_params``, ``kv_bytes_per_token``, ``weight_bytes``, ``attn_flops_per_pair``) and the
        ceilings of the simulated GPU ``gpu``; ``None`` if the figures are missing."""
        from ..sim.ceilings import simulated_ceilings
        from ..sim.gpu import H200, SPECS

        n, vocab = float(cost.get("n_params", 0.0)), float(cost.get("vocab_params", 0.0))
        wb, kv = float(cost.get("weight_bytes", 0.0)), float(cost.get("kv_bytes_per_token", 0.0))
        if n <= 0 or wb <= 0 or kv <= 0:
            return None
        ceil = simulated_ceilings(SPECS.get(gpu, H200))
        return cls(
            2.0 * max(0.0, n - vocab), 2.0 * vocab, float(cost.get("attn_flops_per_pair", 0.0)), kv, wb, ceil.peak_flops, ceil.mem_bw
        )

    @classmethod
    def for_shape(cls, shape: str, gpu: str = "h200") -> RequestCostModel | None:
        """From a named model shape (``vllm_powersave.sim.shapes.SHAPES``), bf16."""
        from ..sim.gpu import ModelCost
        from ..sim.shapes import SHAPES

        c = SHAPES[shape]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        mc = ModelCost.for_shape(shape)
        return cls.from_model(
            {
                "n_params": mc.n_params,
                "vocab_params": mc.vocab_params,
                "weight_bytes": mc.weight_bytes,
                "kv_bytes_per_token": mc.kv_bytes_per_token,
                "attn_flops_per_pair": 4.0 * c["num_hidden_layers"] * c["num_attention_heads"] * head_dim,
            },
            gpu,
        )

    def shared_s(self) -> float:
        """Seconds of the step's shared work (the weights read once) at the bandwidth ceiling."""
        return self.weight_bytes / self.mem_bw

    def own_flops_bytes(self, tokens: int, ctx: int) -> tuple[float, float]:
        """FLOPs and bytes of a request scheduling ``tokens`` tokens after ``ctx`` computed ones."""
        flops = (
            self.body_flops_per_token * tokens
            + self.head_flops_per_row
            + self.attn_flops_per_pair * (tokens * ctx + tokens * (tokens + 1) / 2.0)
        )
        return flops, self.kv_bytes_per_token * (ctx + tokens)

    def own_s(self, tokens: int, ctx: int) -> float:
        """Seconds of a request's own work in a step (its FLOPs at the peak plus its bytes at the bandwidth)."""
        flops, nbytes = self.own_flops_bytes(tokens, ctx)
        return flops / self.peak_flops + nbytes / self.mem_bw

    def weights(self, req_tokens: Mapping[str, int], req_ctx: Mapping[str, int]) -> dict[str, float]:
        """Each request's weight (seconds) in a step: the shared part split equally plus its own
        (:meth:`own_s`, expanded here: this runs for every request of every step, in the publisher)."""
        n = sum(1 for tok in req_tokens.values() if tok > 0)
        if n == 0:
            return {}
        peak, bw = self.peak_flops, self.mem_bw
        fixed = self.shared_s() / n + self.head_flops_per_row / peak
        per_tok = self.body_flops_per_token / peak
        per_pair = self.attn_flops_per_pair / peak
        per_kv = self.kv_bytes_per_token / bw
        get = req_ctx.get
        out = {}
        for rid, tok in req_tokens.items():
            if tok > 0:
                ctx = get(rid, 0) or 0
                out[rid] = fixed + per_tok * tok + per_pair * (tok * ctx + tok * (tok + 1) * 0.5) + per_kv * (ctx + tok)
        return out


def step_weights(cost: RequestCostModel | None, req_tokens: Mapping[str, int], req_ctx: Mapping[str, int] | None) -> Mapping[str, float]:
    """Weights by which a step's energy is split over its requests: the cost model's where the
    model and each request's context are known, else the scheduled tokens (token share)."""
    if cost is None or req_ctx is None:
        return req_tokens
    return cost.weights(req_tokens, req_ctx)


def for_worker(shape: str | None, runner_cost: Callable[[], Mapping[str, Any]], gpu: str) -> RequestCostModel | None:
    """The cost model of a worker's model (a named shape, else the runner's), or ``None`` with one
    warning (the split then falls back to token shares)."""
    try:
        model = RequestCostModel.for_shape(shape, gpu) if shape else RequestCostModel.from_model(runner_cost(), gpu)
    except Exception as exc:
        log.warning("powersave: per-request energy cost model unavailable (%s); steps are split by token share", exc)
        return None
    if model is None:
        log.warning("powersave: per-request energy cost model unavailable (model size unknown); steps are split by token share")
    return model
