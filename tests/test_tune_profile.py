"""Profile of a model's steps (shapes, FLOPs, bytes, bound labels) and the LM-head measurement on the CPU."""

import json

import pytest
import torch

from vllm_powersave.modelgen import SHAPES, param_count
from vllm_powersave.tune import lmhead
from vllm_powersave.tune.profile import (
    Ceilings,
    ModelShape,
    StepSpec,
    bound_label,
    build_ops,
    group_table,
    profile_step,
    simulated_ceilings,
)


def _config_dir(tmp_path, shape):
    d = tmp_path / shape
    d.mkdir()
    (d / "config.json").write_text(json.dumps({k: v for k, v in SHAPES[shape].items() if not k.startswith("_")}))
    return d


def test_gemm_flops_equal_two_flops_per_parameter_per_token(tmp_path):
    shape = ModelShape.from_dir(_config_dir(tmp_path, "qwen2.5-7b"))
    step = StepSpec("prefill", prompts=2, prompt_len=1000)
    ops = build_ops(shape, step)
    layer_params = sum(o.flops for o in ops if o.kind == "gemm") / (2 * step.tokens)
    # qkv (with bias excluded), o, gate_up, down of one layer; x layers + LM head = the model's parameters (embedding apart).
    lm = next(o for o in ops if o.name == "lm_head")
    total = layer_params * shape.layers + lm.flops / (2 * step.lm_rows)
    cfg = SHAPES["qwen2.5-7b"]
    norms = (2 * cfg["num_hidden_layers"] + 1) * cfg["hidden_size"]
    qkv_bias = cfg["num_hidden_layers"] * (cfg["hidden_size"] + 2 * 4 * 128)
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    assert total == param_count("qwen2.5-7b") - norms - qkv_bias - embed


def test_bound_labels_follow_the_h200_ridge(tmp_path):
    shape = ModelShape.from_dir(_config_dir(tmp_path, "llama3-8b"))
    ce = simulated_ceilings()
    assert 140 < ce.ridge < 180  # 661-700 TFLOP/s over 4.28 TB/s
    prefill = {o.name: o for o in build_ops(shape, StepSpec("prefill", prompts=4, prompt_len=512))}
    decode = {o.name: o for o in build_ops(shape, StepSpec("decode", decodes=64, ctx=1024))}
    assert bound_label(prefill["gate_up_proj"].flops / prefill["gate_up_proj"].nbytes, ce) == "compute-bound"
    assert bound_label(decode["gate_up_proj"].flops / decode["gate_up_proj"].nbytes, ce) == "memory-bound"
    assert bound_label(decode["lm_head"].flops / decode["lm_head"].nbytes, ce) == "memory-bound"
    # Decode attention reads the KV cache: ~1 FLOP/B per query head group, far below the ridge.
    assert decode["attn"].flops / decode["attn"].nbytes < 10


def test_profile_runs_and_groups_every_op(tmp_path):
    shape = ModelShape.from_dir(_config_dir(tmp_path, "qwen2-tiny"))
    ce = Ceilings(1e12, 1e11, "test")
    sp = profile_step(
        shape,
        StepSpec("mixed", prompts=1, prompt_len=32, decodes=4, ctx=64),
        torch=torch,
        device="cpu",
        dtype=torch.float32,
        ceilings=ce,
        warmup=1,
        repeats=1,
    )
    kinds = {r["group"]: r for r in group_table(sp, ce)}
    assert set(kinds) == {"gemm", "attention", "elementwise", "lm_head", "sampling"}
    assert sum(r["share"] for r in kinds.values()) == pytest.approx(1.0)
    assert all(r["time_s"] > 0 for r in kinds.values())
    regions = {r["group"] for r in group_table(sp, ce, "regions")}
    assert regions == {"attention", "mlp", "lm_head", "sampling"}
    # Per-layer ops count x layers: the step's GEMM FLOPs equal 2 x tokens x per-layer GEMM parameters x layers.
    H, I, hd = 128, 256, 32
    per_layer = H * (4 + 2 * 2) * hd + 4 * hd * H + H * 2 * I + I * H
    assert kinds["gemm"]["flops"] == 2 * 36 * per_layer * shape.layers


def test_tensor_parallel_shards_shapes_and_models_communication(tmp_path):
    shape = ModelShape.from_dir(_config_dir(tmp_path, "llama3-8b"))
    step = StepSpec("decode", decodes=8, ctx=128)
    one = {o.name: o for o in build_ops(shape, step)}
    two = {o.name: o for o in build_ops(shape, step, tp=2)}
    assert two["gate_up_proj"].flops == one["gate_up_proj"].flops / 2
    assert two["all_reduce_mlp"].kind == "communication" and two["all_reduce_mlp"].model_time_s > 0
    with pytest.raises(ValueError, match="tp = 3"):
        build_ops(shape, step, tp=3)


def test_bad_model_is_one_clear_line(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelShape.from_dir(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="'num_attention_heads' = None"):
        ModelShape.from_dir(tmp_path)


def test_lm_head_on_cpu_labels_energy_simulated_and_charges_weight_rereads():
    pts = list(
        lmhead.measure([(64, 2048)], lmhead.parse_grid("8:decode,64:logprobs"), [1, 4], window_s=0.01, repeats=1, warmup_s=0, device="cpu")
    )
    assert {p["energy_source"] for p in pts} == {"simulated"}
    assert {(p["rows"], p["mode"], p["chunks"]) for p in pts} == {(8, "mm", 1), (8, "mm", 4), (64, "mm+lsm", 1), (64, "mm+lsm", 4)}
    by = {(p["rows"], p["chunks"]): p for p in pts}
    # Decode-sized rows: every chunk re-reads the [vocab, hidden] weight, so 4 chunks cost more simulated energy.
    assert by[(8, 4)]["j_per_call"] > 1.5 * by[(8, 1)]["j_per_call"]
    assert all(p["ms"] > 0 and p["sim_ms"] > 0 for p in pts)


def test_lm_head_chunked_call_equals_unchunked():
    w = torch.randn(512, 32)
    x = torch.randn(48, 32)
    idx = torch.randint(0, 512, (48, 1))
    ref = lmhead._make_call(torch, w, x, idx, "mm+lsm", 1)().clone()
    got = lmhead._make_call(torch, w, x, idx, "mm+lsm", 4)()
    assert torch.allclose(ref, got, atol=1e-5)


def test_grid_and_shape_parsing_errors_name_the_entry():
    with pytest.raises(ValueError, match="grid entry '64:prefill'"):
        lmhead.parse_grid("64:prefill")
    with pytest.raises(ValueError, match="shape '896'"):
        lmhead.parse_shapes("896")
    assert lmhead.planned_points([(8, 16)], lmhead.parse_grid("2,64:spec"), [1, 2, 4], 2) == 2 * (2 + 3)


def test_counter_poller_records_each_update_with_its_time(monkeypatch):
    import types

    from vllm_powersave.tune import energy

    # A fake clock (ms) that only a read advances: each read takes 1 ms, so a stalled test host
    # cannot move an edge. The counter advances every 20 ms by 2000 mJ (100 W), like NVML's.
    now_ms = [0]

    def read():
        now_ms[0] += 1
        if now_ms[0] == 250:
            p.stop_evt.set()  # the last read
        return now_ms[0] // 20 * 2000

    monkeypatch.setattr(energy, "time", types.SimpleNamespace(perf_counter=lambda: now_ms[0] / 1000))
    p = energy._CounterPoller(read, 0.0)
    p.start()
    p.join(timeout=30)
    assert not p.is_alive() and p.error is None
    # Every update once, stamped right after the read that saw it.
    assert p.changes == [(k * 20 / 1000, k * 2000) for k in range(1, 13)]
    (ta, ea), (tb, eb) = p.changes[1], p.changes[-1]
    assert (eb - ea) / 1000 / (tb - ta) == pytest.approx(100.0, rel=1e-9)
