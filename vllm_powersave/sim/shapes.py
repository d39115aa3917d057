"""Model shapes the simulator prices and ``vllm-powersave make-model`` writes: architecture configs and sizes.

The simulated GPU (``sim/gpu.py``), the request cost model (``energy/request_cost.py``) and the model
generator (``modelgen.py``) read the same shapes, so they live here, below all three (docs/design.md,
"Layering"). Pure data and arithmetic: nothing here imports torch or the rest of the package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPE_BYTES", "SHAPES", "check_dtype", "head_dim", "param_count", "shape_config", "tensor_shapes", "weight_bytes"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _qwen2(
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tie: bool,
    max_pos: int = 32768,
    max_window_layers: int | None = None,
) -> dict[str, Any]:
    """A Qwen2 config with the same fields (and order) as the reference JSONs."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": max_pos,
        "max_window_layers": layers if max_window_layers is None else max_window_layers,
        "model_type": "qwen2",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": tie,
        "transformers_version": "5.17.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


#: Architecture configs by shape name.  Each value is a complete ``config.json``
#: body (before the token ids are set from the generated tokenizer), plus two
#: private keys consumed by ``modelgen.make_model``: ``_family`` ("qwen2" or
#: "llama": selects special tokens and chat template) and ``_tokenizer_vocab``
#: (size of the trained BPE tokenizer, always <= ``vocab_size``; any rows past
#: it are padding, as in the real checkpoints).
#:
#: ``qwen2-tiny`` is made to serve fast on 2 CPU cores under vLLM's CPU
#: backend: head_dim = 128 / 4 = 32, the smallest head size vLLM's CPU
#: attention supports (``CPUAttentionBackend.get_supported_head_sizes()`` is
#: [32, 64, 80, ...]; block size must be a multiple of 32); vocab 4096 so the
#: LM head and sampler stay cheap and BPE training takes about a second.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-tiny": {
        **_qwen2(
            hidden=128,
            layers=2,
            heads=4,
            kv_heads=2,
            intermediate=256,
            vocab=4096,
            tie=True,
            max_pos=4096,
        ),
        "_family": "qwen2",
        "_tokenizer_vocab": 4096,
    },
    # Copied from /work/shared/gpu/shapes/qwen2.5-0.5b.json
    "qwen2.5-0.5b": {
        **_qwen2(
            hidden=896,
            layers=24,
            heads=14,
            kv_heads=2,
            intermediate=4864,
            vocab=151936,
            tie=True,
        ),
        "_family": "qwen2",
        "_tokenizer_vocab": 8192,
    },
    # Copied from /work/shared/gpu/shapes/qwen2.5-7b.json
    "qwen2.5-7b": {
        **_qwen2(
            hidden=3584,
            layers=28,
            heads=28,
            kv_heads=4,
            intermediate=18944,
            vocab=152064,
            tie=False,
        ),
        "_family": "qwen2",
        "_tokenizer_vocab": 8192,
    },
    # Copied from /work/shared/gpu/shapes/llama3-8b.json
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "dtype": "bfloat16",
        "head_dim": 128,
        "_family": "llama",
        "_tokenizer_vocab": 8192,
    },
}


def shape_config(shape: str) -> dict[str, Any]:
    """The config of a named shape; ``ValueError`` naming the known shapes otherwise."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: shape must be one of {', '.join(sorted(SHAPES))}")
    return SHAPES[shape]


def check_dtype(dtype: str) -> None:
    """``ValueError`` unless ``dtype`` is one of :data:`DTYPE_BYTES`."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}: dtype must be one of {', '.join(DTYPE_BYTES)}")


def head_dim(cfg: dict[str, Any]) -> int:
    """Per-head dimension: the config's ``head_dim``, else hidden size over attention heads."""
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def tensor_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the shape's transformers state dict.

    Names are exactly those of ``Qwen2ForCausalLM`` / ``LlamaForCausalLM``
    (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
    ...).  Qwen2 has biases on q/k/v; Llama has none.  ``lm_head.weight`` is
    omitted for tied embeddings, as ``save_pretrained`` does.  Insertion order is
    the module order.  Raises ``ValueError`` for an unknown shape.
    """
    cfg = shape_config(shape)
    h = cfg["hidden_size"]
    inter = cfg["intermediate_size"]
    v = cfg["vocab_size"]
    hd = head_dim(cfg)
    q_out = cfg["num_attention_heads"] * hd
    kv_out = cfg["num_key_value_heads"] * hd
    qkv_bias = cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias"))
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (q_out, h)
        if qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q_out,)
        out[p + "self_attn.k_proj.weight"] = (kv_out, h)
        if qkv_bias:
            out[p + "self_attn.k_proj.bias"] = (kv_out,)
        out[p + "self_attn.v_proj.weight"] = (kv_out, h)
        if qkv_bias:
            out[p + "self_attn.v_proj.bias"] = (kv_out,)
        out[p + "self_attn.o_proj.weight"] = (h, q_out)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    return out


def param_count(shape: str) -> int:
    """Number of stored parameters (tied embeddings counted once)."""
    n = 0
    for s in tensor_shapes(shape).values():
        k = 1
        for d in s:
            k *= d
        n += k
    return n


def weight_bytes(shape: str, dtype: str = "bfloat16") -> int:
    """Size in bytes of the shape's weights at ``dtype`` (excluding file headers)."""
    check_dtype(dtype)
    return param_count(shape) * DTYPE_BYTES[dtype]
