"""Tests of vllm_powersave.modelgen: offline model directories (no vLLM start)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vllm_powersave import modelgen
from vllm_powersave.modelgen import SHAPES, make_model

REPO = Path(__file__).resolve().parents[1]
# shared/ sits beside the repository checkout (here and in CI).
# Copies of the H200 bundle's configs live in tests/data/shapes, so a clean checkout runs these tests.
REF_DIRS = [REPO / "tests" / "data" / "shapes", REPO.parent / "shared" / "gpu" / "shapes"]

BIG = ["qwen2.5-0.5b", "qwen2.5-7b", "llama3-8b"]

# The architecture numbers of the real checkpoints, independent of shared/.
EXPECTED = {
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
ROPE = {"qwen2.5-0.5b": 1e6, "qwen2.5-7b": 1e6, "llama3-8b": 5e5}


def _ref_json(shape: str) -> dict | None:
    for d in REF_DIRS:
        p = d / f"{shape}.json"
        if p.is_file():
            return json.loads(p.read_text())
    return None


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "tiny", "qwen2-tiny", seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "llama", "llama3-8b", weights=False)


# --------------------------------------------------------------------- shapes


@pytest.mark.parametrize("shape", BIG)
def test_big_shapes_match_real_models(shape):
    cfg = SHAPES[shape]
    for k, v in EXPECTED[shape].items():
        assert cfg[k] == v, (shape, k)
    assert modelgen._rope_theta(cfg) == ROPE[shape]


@pytest.mark.parametrize("shape", BIG)
def test_big_shapes_match_reference_json(shape):
    ref = _ref_json(shape)
    if ref is None:
        pytest.skip("shared/gpu/shapes not present")
    cfg = {k: v for k, v in SHAPES[shape].items() if not k.startswith("_")}
    assert cfg == ref  # field for field, token ids included (before make_model)


def test_tiny_shape_fits_vllm_cpu_backend():
    cfg = SHAPES["qwen2-tiny"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # vLLM CPU attention supports head sizes 32, 64, 80, ... (multiples of 16 >= 32)
    assert head_dim >= 32 and head_dim % 16 == 0
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["_tokenizer_vocab"] == cfg["vocab_size"]


def test_weight_sizes():
    assert modelgen.weight_bytes("qwen2-tiny") < 5_000_000
    # Qwen2.5-0.5B has 494M parameters (tied embeddings).
    assert modelgen.param_count("qwen2.5-0.5b") == 494_032_768
    assert 7.0e9 < modelgen.param_count("qwen2.5-7b") < 7.8e9
    assert 7.9e9 < modelgen.param_count("llama3-8b") < 8.1e9
    assert modelgen.weight_bytes("qwen2-tiny", "float32") == 2 * modelgen.weight_bytes("qwen2-tiny")


# ------------------------------------------------------------------- errors


def test_unknown_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no-such-shape") as ei:
        make_model(tmp_path / "x", "no-such-shape")
    assert "shape" in str(ei.value) and "\n" not in str(ei.value)
    assert not (tmp_path / "x").exists()


def test_bad_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dtype.*int8|int8.*dtype"):
        make_model(tmp_path / "x", "qwen2-tiny", dtype="int8")


def test_non_empty_dir_is_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="out_dir") as ei:
        make_model(d, "qwen2-tiny")
    assert str(d) in str(ei.value) and "\n" not in str(ei.value)
    assert sorted(p.name for p in d.iterdir()) == ["keep.txt"]


def test_empty_existing_dir_is_fine_and_overwrite_replaces(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    make_model(d, "qwen2-tiny", seed=1)
    first = (d / "model.safetensors").read_bytes()
    (d / "keep.txt").write_text("x")
    make_model(d, "qwen2-tiny", seed=2, overwrite=True)
    assert (d / "model.safetensors").read_bytes() != first
    assert (d / "keep.txt").read_text() == "x"


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match="out_dir"):
        make_model(f, "qwen2-tiny")


# ------------------------------------------------------------------ files


def test_files_and_config(tiny):
    names = {p.name for p in tiny.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert not any(k.startswith("_") for k in cfg)
    tc = json.loads((tiny / "tokenizer_config.json").read_text())
    specials = {v["content"] for v in tc["added_tokens_decoder"].values() if v["special"]}
    assert specials == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert "<|im_start|>" in tc["chat_template"] and "add_generation_prompt" in tc["chat_template"]
    assert tc["model_max_length"] == cfg["max_position_embeddings"]


def test_weights_are_deterministic(tmp_path, tiny):
    again = make_model(tmp_path / "again", "qwen2-tiny", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_weight_names_and_init(tiny):
    from safetensors.torch import load_file

    sd = load_file(str(tiny / "model.safetensors"))
    assert set(sd) == set(modelgen.tensor_shapes("qwen2-tiny"))
    assert "lm_head.weight" not in sd  # tied
    emb = sd["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 0.002
    assert (sd["model.norm.weight"].float() == 1).all()
    assert (sd["model.layers.0.self_attn.q_proj.bias"].float() == 0).all()
    import torch

    assert all(t.dtype == torch.bfloat16 for t in sd.values())


def test_big_shape_defaults_to_no_weights(llama_dir):
    names = {p.name for p in llama_dir.iterdir()}
    assert not any(n.endswith(".safetensors") for n in names)
    cfg = json.loads((llama_dir / "config.json").read_text())
    for k, v in EXPECTED["llama3-8b"].items():
        assert cfg[k] == v
    assert cfg["rope_theta"] == 500000.0


def test_big_shape_note_printed(tmp_path, capsys):
    make_model(tmp_path / "q7", "qwen2.5-7b")
    err = capsys.readouterr().err
    assert "qwen2.5-7b" in err and "dummy" in err
    assert not list((tmp_path / "q7").glob("*.safetensors"))


def test_sharded_weights_load(tmp_path, monkeypatch):
    """Force tiny sharding (limit 400 kB) and load the result with transformers."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(modelgen, "SHARD_LIMIT_BYTES", 400_000)
    d = make_model(tmp_path / "sharded", "qwen2-tiny", dtype="float32")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((d / f).is_file() for f in files)
    assert files[0].startswith("model-00001-of-")
    assert index["metadata"]["total_size"] == modelgen.weight_bytes("qwen2-tiny", "float32")
    assert not (d / "model.safetensors").exists()
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


# ------------------------------------------------------------ transformers


def test_tiny_loads_in_transformers_and_gives_finite_logits(tiny):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny)
    assert cfg.model_type == "qwen2" and cfg.vocab_size == SHAPES["qwen2-tiny"]["vocab_size"]
    model, info = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    assert model.dtype == torch.bfloat16
    ids = torch.tensor([[1, 5, 9, 200, 3000], [7, 8, 9, 10, 11]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 5, cfg.vocab_size)
    assert torch.isfinite(logits.float()).all()


def test_tokenizer_round_trip_and_ids(tiny):
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = AutoConfig.from_pretrained(tiny)
    assert len(tok) == cfg.vocab_size
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == cfg.eos_token_id
    assert tok.bos_token_id == cfg.bos_token_id and tok.pad_token_id is not None
    text = "def f(x):\n    return {'a': x ** 2}  # héllo, 世界!\n\tThe quick brown fox 12345."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # AutoTokenizer and the raw tokenizers pipeline agree token for token.
    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids
    # Special tokens are atomic.
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|im_end|>")]
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]


def test_chat_template_renders(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert s == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    s2 = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert s2 == s[: -len("<|im_start|>assistant\n")]
    ids = tok(s, add_special_tokens=False).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_llama_tokenizer_and_template(llama_dir):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    cfg = AutoConfig.from_pretrained(llama_dir)
    assert len(tok) <= cfg.vocab_size
    assert tok.bos_token == "<|begin_of_text|>" and tok.bos_token_id == cfg.bos_token_id
    assert tok.eos_token == "<|end_of_text|>" and tok.eos_token_id == cfg.eos_token_id
    for s in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert tok.encode(s, add_special_tokens=False) == [tok.convert_tokens_to_ids(s)]
    text = "import os\nprint('hi')  # ok"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    s = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True)
    assert s == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_big_qwen_tokenizer_smaller_than_vocab(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    d = make_model(tmp_path / "q05", "qwen2.5-0.5b", weights=False)
    tok = AutoTokenizer.from_pretrained(d)
    cfg = AutoConfig.from_pretrained(d)
    assert len(tok) == SHAPES["qwen2.5-0.5b"]["_tokenizer_vocab"] <= cfg.vocab_size == 151936
    assert cfg.hidden_size == 896 and cfg.num_hidden_layers == 24
    assert math.isclose(cfg.rope_parameters["rope_theta"], 1e6)


def test_make_model_into_a_path_that_cannot_be_made_stops_with_one_line(tmp_path, capsys):
    from vllm_powersave.cli import main

    (tmp_path / "x.json").write_text("{}")
    assert main(["make-model", str(tmp_path / "x.json" / "sub"), "--shape", "qwen2-tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: make-model: cannot write ") and "x.json/sub" in err and err.count("\n") == 1
    assert (tmp_path / "x.json").read_text() == "{}"
