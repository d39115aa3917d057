"""Simulated kernel groups, predict(), and the clock-preset benchmark's replay mechanics (all simulated)."""

import pytest

from vllm_powersave.modelgen import SHAPES, param_count
from vllm_powersave.sim.gpu import H200, KernelGroupCost, ModelCost, StepWork, predict, simulate_kernel


def _bench():
    from benchmarks import sim_clock_presets

    return sim_clock_presets


def test_kernel_group_weights_add_up_to_the_model():
    g = KernelGroupCost.for_shape("qwen2.5-7b")
    attn, mlp = g.layer(tokens=1, decode_ctx=0, prefill_attend=0)
    lm, _ = g.head(rows=1)
    # One token: the weights dominate the bytes; all but the embedding table are read.
    streamed = g.layers * (attn.bytes + mlp.bytes) + lm.bytes
    embed = SHAPES["qwen2.5-7b"]["vocab_size"] * SHAPES["qwen2.5-7b"]["hidden_size"]
    assert streamed == pytest.approx(2 * (param_count("qwen2.5-7b") - embed), rel=0.01)
    # FLOPs agree with the whole-step model (2 per parameter per token), which also charges the
    # embedding table as a GEMM; the group model treats it as the lookup it is.
    whole = ModelCost.for_shape("qwen2.5-7b").step_work(64, 64, 0, ModelCost.for_shape("qwen2.5-7b").vocab_params)
    parts = g.groups(64, 64, 0, 0)
    assert sum(w.flops for name, w in parts if name != "sampling") == pytest.approx(whole.flops - 2 * 64 * embed, rel=0.005)
    assert [n for n, _ in parts[:4]] == ["attention", "mlp", "attention", "mlp"] and [n for n, _ in parts[-2:]] == ["lm_head", "sampling"]


def test_predict_prices_groups_each_at_the_clock_with_the_cap():
    mem = StepWork(flops=1e9, bytes=4e9)  # HBM-bound
    gemm = StepWork(flops=5e13, bytes=1e9)  # compute-bound
    t_hi, p_hi, e_hi = predict([mem, gemm], 1980)
    assert t_hi == pytest.approx(H200.t_fixed_s + simulate_kernel(H200, mem, 1980).time_s + simulate_kernel(H200, gemm, 1980).time_s)
    assert e_hi == pytest.approx(p_hi * t_hi)
    assert simulate_kernel(H200, gemm, 1980).sm_clock_mhz < 1980  # the power cap bites on big GEMMs
    m_lo, m_hi = simulate_kernel(H200, mem, 900), simulate_kernel(H200, mem, 1980)
    assert m_lo.time_s == pytest.approx(m_hi.time_s) and m_lo.energy_j < 0.75 * m_hi.energy_j
    assert simulate_kernel(H200, gemm, 900).time_s > 1.4 * simulate_kernel(H200, gemm, 1980).time_s
    whole = predict(StepWork(mem.flops + gemm.flops, mem.bytes + gemm.bytes), 1980)
    assert whole[0] < t_hi  # one roofline for the whole step overlaps what per-group pricing cannot


@pytest.mark.bench
def test_replay_per_phase_presets_save_decode_energy_without_losing_throughput():
    b = _bench()
    trace = b.synthetic_trace(20.0, seed=5, host_gap_s=0.001)
    base = b.replay(trace, b.Strategy("none", b.BASE_CLOCKS))
    clocks = {"min_dwell_ms": 20, "compute_share_max": 0.0, "presets": {"decode": {"sm_clock_mhz": 900}, "idle": {"sm_clock_mhz": 345}}}
    r = b.ratios(base, b.replay(trace, b.Strategy("per_phase", clocks)))
    assert r["decode_energy_ratio"] < 0.8 and r["throughput_ratio"] > 0.99 and r["switches_per_s"] > 0
    slow = b.ratios(base, b.replay(trace, b.Strategy("slow", clocks, latency_s=0.05)))
    assert slow["throughput_ratio"] < r["throughput_ratio"]  # a slower switch lands on more compute-bound work
    # Same steps, same tokens: only time and energy differ.
    assert base["out_tokens"] == b.replay(trace, b.Strategy("per_phase", clocks))["out_tokens"]


@pytest.mark.bench
def test_h200_replay_reads_every_step_of_the_recorded_trace():
    b = _bench()
    trace, meta = b.h200_trace()
    steps = [e for kind, e in trace.events if kind == "step"]
    import gzip
    import json

    recorded = json.load(gzip.open(b.STEP_TRACE))["columns"]
    assert len(steps) + meta["warmup_steps_skipped"] == len(recorded["dur_us"])
    assert {s.phase for s in steps} <= set(b.PHASES) and all(s.host_gap_s >= 0 for s in steps)
    assert meta["measured_energy_by_phase_j"]["decode"] > 0 and meta["vllm_version"] == "0.25.0"
