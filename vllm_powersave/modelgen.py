"""Generate offline Hugging Face model directories with random weights.

The project never downloads anything from a model hub.  Tests, load tests and
GPU benchmarks instead run against model directories produced here:

* ``config.json`` with a real architecture (Qwen2 or Llama), copied field for
  field from the reference configs of the real checkpoints for the big shapes;
* ``generation_config.json``;
* random weights (``model.safetensors``, or sharded ``model-0000i-of-0000n``
  files plus ``model.safetensors.index.json`` when the total exceeds 2 GB),
  named exactly as in transformers' ``Qwen2ForCausalLM`` / ``LlamaForCausalLM``
  state dicts -- or no weights at all, in which case the directory is meant to be
  served by vLLM with ``--load-format dummy``;
* an offline byte-level BPE tokenizer trained with the ``tokenizers`` library on
  the Python standard library's own source files (``tokenizer.json``,
  ``tokenizer_config.json`` with a chat template, ``special_tokens_map.json``).

Everything is deterministic for a given ``(shape, seed, dtype)`` on a given
Python installation: the tokenizer's training text is the stdlib source of the
running interpreter, read in sorted order, so two machines with different
Python versions may get different (but equally valid) tokenizers.

Only ``torch``, ``safetensors`` and ``tokenizers`` are imported, lazily;
``transformers`` and ``vllm`` are not needed to *make* a model.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

# The shapes live under sim/ because the simulator and the runtime's cost model price them too, and
# neither may import this module (docs/design.md, "Layering"); re-exported here for make-model's users.
from .sim.shapes import DTYPE_BYTES, SHAPES, check_dtype, param_count, shape_config, tensor_shapes, weight_bytes

__all__ = [
    "SHAPES",
    "DTYPE_BYTES",
    "WEIGHTS_DEFAULT_LIMIT_BYTES",
    "SHARD_LIMIT_BYTES",
    "make_model",
    "param_count",
    "weight_bytes",
    "tensor_shapes",
]

#: Weights larger than this (in bytes, at the requested dtype) are not written
#: unless ``weights=True`` is passed explicitly; such shapes are meant for
#: ``--load-format dummy``.
WEIGHTS_DEFAULT_LIMIT_BYTES = 2 * 1000**3
#: Maximum size of one safetensors shard, in bytes (2 GB, as in transformers'
#: ``max_shard_size="2GB"``).
SHARD_LIMIT_BYTES = 2 * 1000**3

_INIT_STD = 0.02  # normal(0, 0.02) like transformers' initializer_range


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    return float(cfg["rope_parameters"]["rope_theta"])


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# ChatML as in Qwen2/Qwen2.5 (without Qwen's default system prompt).
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Llama-3-Instruct style (without the tool-calling / date preamble of 3.1).
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Pre-tokenizer split patterns of the real Qwen2 and Llama-3 tokenizers.
_QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA3_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Bytes of stdlib source used to train the BPE (deterministic prefix of the
#: sorted file list).  ~3 MB trains an 8k vocab in about a second on 2 cores.
_TRAIN_BYTES = 3_000_000


def _training_files() -> list[Path]:
    """Stdlib ``*.py`` files of the running interpreter, in sorted order.

    Only the top level of the stdlib plus a few pure-Python packages are used,
    so the result does not depend on what is installed in site-packages.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():  # pragma: no cover - exotic embedded interpreters
        import inspect

        stdlib = Path(inspect.getfile(os)).parent
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    for pkg in ("email", "json", "http", "asyncio", "unittest", "logging", "xml"):
        d = stdlib / pkg
        if d.is_dir():
            files.extend(sorted(p for p in d.rglob("*.py") if p.is_file()))
    if not files:
        raise RuntimeError(f"no Python source files found under stdlib path {stdlib}")
    return files


def _training_text(limit: int = _TRAIN_BYTES) -> list[str]:
    chunks: list[str] = []
    total = 0
    for p in _training_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # Split into paragraphs so the trainer sees many moderate sequences.
        for para in text.split("\n\n"):
            if para.strip():
                chunks.append(para + "\n\n")
                total += len(para) + 2
        if total >= limit:
            break
    # Some natural-language-ish text so prompts in English tokenize sensibly.
    chunks.append("The quick brown fox jumps over the lazy dog. Hello, world! You are a helpful assistant. What is the capital of France? ")
    return chunks


def _build_tokenizer(family: str, vocab_size: int):
    """Train a byte-level BPE of exactly ``vocab_size`` tokens (specials included)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    specials = _QWEN_SPECIALS if family == "qwen2" else _LLAMA_SPECIALS
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Same normalizer / pre-tokenizer as the real tokenizers: transformers 5
    # rebuilds a Qwen2Tokenizer's pipeline from these (NFC + Qwen regex) whatever
    # tokenizer.json says, so anything else would tokenize differently under
    # AutoTokenizer than under tokenizers.Tokenizer.from_file.
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()
        regex = _QWEN_PRETOKENIZE_REGEX
    else:
        regex = _LLAMA3_PRETOKENIZE_REGEX
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"trained tokenizer has {got} tokens, wanted vocab_size={vocab_size} (training text too small?)")
    if family == "llama":
        bos = "<|begin_of_text|>"
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _write_tokenizer(out: Path, family: str, vocab_size: int, model_max_length: int) -> dict[str, int]:
    """Write tokenizer files; return the special token ids by name."""
    tok = _build_tokenizer(family, vocab_size)
    tok.save(str(out / "tokenizer.json"))
    if family == "qwen2":
        specials = _QWEN_SPECIALS
        bos, eos, pad = "<|endoftext|>", "<|endoftext|>", "<|endoftext|>"
        template = QWEN_CHAT_TEMPLATE
        add_bos = False
    else:
        specials = _LLAMA_SPECIALS
        bos, eos, pad = "<|begin_of_text|>", "<|end_of_text|>", "<|end_of_text|>"
        template = LLAMA3_CHAT_TEMPLATE
        add_bos = True
    ids = {s: tok.token_to_id(s) for s in specials}
    added = {
        str(ids[s]): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s in specials
    }
    tok_cfg = {
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [s for s in specials if s not in (bos, eos, pad)],
        "bos_token": bos,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "pad_token": pad,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _dump(out / "tokenizer_config.json", tok_cfg)
    _dump(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": tok_cfg["additional_special_tokens"],
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": pad,
        },
    )
    return {"bos": ids[bos], "eos": ids[eos], "pad": ids[pad], **ids}


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


def _init_tensor(name: str, shp: tuple[int, ...], gen, torch_dtype):
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shp, dtype=torch_dtype)
    if name.endswith(".bias"):
        return torch.zeros(shp, dtype=torch_dtype)
    t = torch.empty(shp, dtype=torch.float32)
    t.normal_(mean=0.0, std=_INIT_STD, generator=gen)
    return t.to(torch_dtype)


def _save(sd, path: Path, meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(sd, str(path), metadata=meta)
    # safetensors creates files 0600; give them the usual umask-based mode
    # so a server running as another user (e.g. in a container) can read them.
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _write_weights(out: Path, shape: str, seed: int, dtype: str) -> list[str]:
    """Write random weights; return the file names written.

    Tensors are drawn in state-dict order from one ``torch.Generator`` seeded
    with ``seed`` (float32 normal(0, 0.02), then cast), so a tensor's values do
    not depend on ``dtype`` beyond rounding.  At most one shard is held in memory.
    """
    import torch

    torch_dtype = getattr(torch, dtype)
    elem = DTYPE_BYTES[dtype]
    shapes = tensor_shapes(shape)
    total = weight_bytes(shape, dtype)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    meta = {"format": "pt"}

    if total <= SHARD_LIMIT_BYTES:
        sd = {n: _init_tensor(n, s, gen, torch_dtype).contiguous() for n, s in shapes.items()}
        _save(sd, out / "model.safetensors", meta)
        return ["model.safetensors"]

    # Plan shards greedily by size, like transformers' max_shard_size="2GB".
    groups: list[list[str]] = [[]]
    cur = 0
    for n, s in shapes.items():
        nbytes = elem
        for d in s:
            nbytes *= d
        if groups[-1] and cur + nbytes > SHARD_LIMIT_BYTES:
            groups.append([])
            cur = 0
        groups[-1].append(n)
        cur += nbytes
    nshards = len(groups)
    weight_map: dict[str, str] = {}
    files = []
    for i, names in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{nshards:05d}.safetensors"
        sd = {n: _init_tensor(n, shapes[n], gen, torch_dtype).contiguous() for n in names}
        _save(sd, out / fname, meta)
        del sd
        for n in names:
            weight_map[n] = fname
        files.append(fname)
    _dump(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    files.append("model.safetensors.index.json")
    return files


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------

_OWN_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors",
    "model.safetensors.index.json",
)


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    """Create ``out``; a non-empty one only with ``overwrite``, and then only our own files go."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"out_dir {str(out)!r} exists and is not empty (pass overwrite=True, or --overwrite on the command line)")
        for p in out.iterdir():
            if p.is_file() and (p.name in _OWN_FILES or (p.name.startswith("model-") and p.name.endswith(".safetensors"))):
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _weights_by_default(shape: str, dtype: str, out: Path) -> bool:
    """Write weights only up to :data:`WEIGHTS_DEFAULT_LIMIT_BYTES`; say so on stderr otherwise."""
    wbytes = weight_bytes(shape, dtype)
    weights = wbytes <= WEIGHTS_DEFAULT_LIMIT_BYTES
    if not weights:
        print(
            f"note: {shape} weights would be {wbytes / 1e9:.1f} GB at {dtype}; "
            f"not writing them (serve {out} with vLLM --load-format dummy, "
            "or pass weights=True, or --weights on the command line, to write them)",
            file=sys.stderr,
        )
    return weights


def _write_configs(out: Path, cfg0: dict[str, Any], ids: dict[str, int], dtype: str) -> None:
    """``config.json`` (the shape's, with this tokenizer's token ids) and ``generation_config.json``."""
    cfg = {k: copy.deepcopy(v) for k, v in cfg0.items() if not k.startswith("_")}
    cfg["bos_token_id"] = ids["bos"]
    cfg["eos_token_id"] = ids["eos"]
    cfg["dtype"] = dtype
    # transformers < 5 and older vLLM read these spellings instead.
    cfg["torch_dtype"] = dtype
    cfg.setdefault("rope_theta", _rope_theta(cfg))
    _dump(out / "config.json", cfg)

    if cfg0["_family"] == "qwen2":
        gen_eos: int | list[int] = [ids["<|endoftext|>"], ids["<|im_end|>"]]
    else:
        gen_eos = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
    _dump(
        out / "generation_config.json",
        {
            "bos_token_id": ids["bos"],
            "eos_token_id": gen_eos,
            "pad_token_id": ids["pad"],
            "transformers_version": cfg.get("transformers_version", "5.17.0"),
        },
    )


def make_model(
    out_dir: Path | str,
    shape: str,
    seed: int = 0,
    dtype: str = "bfloat16",
    weights: bool | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory for ``shape`` and return its path.

    Args:
        out_dir: directory to create.  It may exist only if empty, unless
            ``overwrite`` is true; then the files this function writes (and any
            ``model*.safetensors`` shards) are replaced, other files are left.
        shape: a key of :data:`SHAPES` (``qwen2-tiny``, ``qwen2.5-0.5b``,
            ``qwen2.5-7b``, ``llama3-8b``).
        seed: seed of the ``torch.Generator`` drawing the weights (normal,
            mean 0, std 0.02; RMSNorm weights 1, biases 0).  The tokenizer does
            not depend on it.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: the stored weight
            dtype and ``config.json``'s ``dtype``/``torch_dtype``.
        weights: write weight files.  ``None`` (default) means: yes when the
            weights are at most 2 GB at ``dtype`` (``qwen2-tiny`` ~1.6 MB,
            ``qwen2.5-0.5b`` ~1 GB in bf16), otherwise no, with a note on
            stderr (``qwen2.5-7b`` ~15 GB, ``llama3-8b`` ~16 GB).  A directory
            without weights is meant for vLLM's ``--load-format dummy``.
            Weights over 2 GB are written as 2 GB shards plus
            ``model.safetensors.index.json``.
        overwrite: allow a non-empty ``out_dir``.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: unknown ``shape``, unsupported ``dtype``, ``out_dir`` that is
            a file, or an existing non-empty ``out_dir`` without ``overwrite``.

    The tokenizer is a byte-level BPE trained (about a second) on the Python
    standard library sources.  Its size is ``vocab_size`` for ``qwen2-tiny`` and
    8192 for the big shapes, where ``config.json``'s ``vocab_size`` stays that of
    the real model (the extra embedding rows are padding, which is legal).
    Because the token ids differ from the real tokenizers, ``bos_token_id`` /
    ``eos_token_id`` in ``config.json`` are set to this tokenizer's ids; every
    other field equals the reference config.
    """
    cfg0 = shape_config(shape)
    check_dtype(dtype)
    out = Path(out_dir)
    _prepare_out_dir(out, overwrite)
    if weights is None:
        weights = _weights_by_default(shape, dtype, out)

    family = cfg0["_family"]
    tok_vocab = cfg0["_tokenizer_vocab"]
    assert tok_vocab <= cfg0["vocab_size"]
    ids = _write_tokenizer(out, family, tok_vocab, int(cfg0["max_position_embeddings"]))
    _write_configs(out, cfg0, ids, dtype)

    if weights:
        _write_weights(out, shape, seed, dtype)
    return out
