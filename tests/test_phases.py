from types import SimpleNamespace

from vllm_powersave.phases import ReqSched, classify
from vllm_powersave.vllm_compat import step_requests


def test_idle_and_pure_phases():
    assert classify([]).phase == "idle"
    p = classify([ReqSched(512, context_phase=True), ReqSched(100, context_phase=True)])
    assert (p.phase, p.prefill_tokens, p.decode_tokens, p.lm_head_rows) == ("prefill", 612, 0, 2)
    d = classify([ReqSched(1, computed=300), ReqSched(1, computed=40)])
    assert (d.phase, d.decode_tokens, d.lm_head_rows, d.decode_ctx_tokens) == ("decode", 2, 2, 340)


def test_mixed_and_spec_and_recompute():
    m = classify([ReqSched(256, context_phase=True), ReqSched(1, computed=10)])
    assert (m.phase, m.prefill_tokens, m.decode_tokens) == ("mixed", 256, 1)
    s = classify([ReqSched(4, spec=3, computed=50), ReqSched(4, spec=3, computed=50)])
    assert (s.phase, s.decode_tokens, s.spec_tokens, s.lm_head_rows) == ("decode", 8, 6, 8)
    # A resumed request recomputing 40 tokens while decoding: its extra tokens are prefill work.
    r = classify([ReqSched(41, computed=0)])
    assert (r.phase, r.prefill_tokens, r.decode_tokens) == ("mixed", 40, 1)


def test_from_scheduler_output_shape():
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["b", "c"], num_computed_tokens=[70, 9], num_output_tokens=[5, 0]),
        num_scheduled_tokens={"a": 128, "b": 1, "c": 32},
        scheduled_spec_decode_tokens={},
    )
    reqs = step_requests(so)
    assert reqs == [ReqSched(128, 0, True, 0), ReqSched(1, 0, False, 70), ReqSched(32, 0, True, 9)]
    info = classify(reqs)
    assert (info.phase, info.prefill_tokens, info.decode_tokens, info.prefill_reqs, info.decode_reqs) == ("mixed", 160, 1, 2, 1)


def test_fast_aggregate_classification_equals_per_request_classification():
    import random

    from vllm_powersave.vllm_compat import step_info

    rng = random.Random(0)
    for _ in range(500):
        new = [f"n{i}" for i in range(rng.randint(0, 3))]
        cached = [f"c{i}" for i in range(rng.randint(0, 40))]
        nst, spec = {}, {}
        n_out, computed = [], []
        for r in new:
            nst[r] = rng.randint(1, 2048)
        for r in cached:
            ctx = rng.random() < 0.1
            n_out.append(0 if ctx else rng.randint(1, 500))
            computed.append(rng.randint(0, 4000))
            k = 0 if ctx or rng.random() < 0.5 else rng.randint(1, 4)
            if k:
                spec[r] = [0] * k
            resumed = (not ctx) and rng.random() < 0.05
            nst[r] = rng.randint(1, 512) if ctx else (1 + k + (rng.randint(1, 300) if resumed else 0))
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=0) for r in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached, num_computed_tokens=computed, num_output_tokens=n_out),
            num_scheduled_tokens=nst,
            scheduled_spec_decode_tokens=spec,
            total_num_scheduled_tokens=sum(nst.values()),
        )
        slow = classify(step_requests(so))
        fast = step_info(so)
        assert (fast.phase, fast.prefill_tokens, fast.decode_tokens, fast.lm_head_rows, fast.num_reqs, fast.spec_tokens) == (
            slow.phase,
            slow.prefill_tokens,
            slow.decode_tokens,
            slow.lm_head_rows,
            slow.num_reqs,
            slow.spec_tokens,
        )


def test_small_mixed_steps_take_the_decode_clock():
    from vllm_powersave.runtime import clock_phase

    small = classify([ReqSched(40, context_phase=True)] + [ReqSched(1, computed=100)] * 60)
    big = classify([ReqSched(512, context_phase=True)] + [ReqSched(1, computed=100)] * 60)
    assert small.phase == big.phase == "mixed"
    assert clock_phase(small, 150) == "decode"
    assert clock_phase(big, 150) == "mixed"
    assert clock_phase(small, 0) == "mixed"
    assert clock_phase(classify([ReqSched(64, context_phase=True)]), 150) == "prefill"
    # Decode batches beyond the ridge are compute-bound: no decode clock for them.
    assert clock_phase(classify([ReqSched(1, computed=100)] * 100), 150) == "decode"
    assert clock_phase(classify([ReqSched(1, computed=100)] * 256), 150) == "mixed"
    assert clock_phase(classify([ReqSched(1, computed=100)] * 256), 0) == "decode"


def test_regime_filter_keeps_decode_clock_through_occasional_prompts_but_not_bursts():
    from vllm_powersave.runtime import RegimeFilter

    f = RegimeFilter(window_s=0.5, share_max=0.3, burst_tokens=2048, memory_bound_max_tokens=150)
    dec = classify([ReqSched(1, computed=100)] * 16)
    new_prompt = classify([ReqSched(200, context_phase=True)] + [ReqSched(1, computed=100)] * 15)
    burst = classify([ReqSched(4096, context_phase=True)])
    t, phases = 0.0, []
    assert f.phase(new_prompt, t) == "mixed"  # unknown regime: no lowering
    for i in range(400):  # 4 ms steps; a new prompt every 5th step
        t += 0.004
        phases.append(f.phase(new_prompt if i % 5 == 0 else dec, t))
    assert phases[-50:].count("decode") == 50  # steady state: the prompts ride at the decode clock
    assert f.phase(burst, t + 0.004) == "prefill"  # a real prefill burst is raised at once
    g = RegimeFilter(0.5, 0.3, 2048, 150)
    busy = [g.phase(new_prompt, 0.004 * i) for i in range(300)]
    assert busy[-1] == "mixed"  # prefill-heavy regime keeps the default clock


def _new(rid, prompt_len, prompt_logprobs=None, computed=0):
    return SimpleNamespace(
        req_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        num_computed_tokens=computed,
        sampling_params=SimpleNamespace(prompt_logprobs=prompt_logprobs),
    )


def _so(new=(), nst=None, finished=()):
    return SimpleNamespace(scheduled_new_reqs=list(new), num_scheduled_tokens=dict(nst or {}), finished_req_ids=set(finished))


def test_prompt_logprob_rows_follow_chunked_prefill_and_stop_with_the_prompt():
    from vllm_powersave.vllm_compat import PromptLogprobRows

    plp = PromptLogprobRows()
    # A 5000-token prompt with prompt logprobs, prefilled in chunks of 2048: 4999 positions get logits.
    assert plp.rows(_so([_new("a", 5000, prompt_logprobs=1), _new("b", 300)], {"a": 2048, "b": 300})) == 2048
    assert plp.rows(_so((), {"a": 2048, "b": 1})) == 2048
    assert plp.rows(_so((), {"a": 904, "b": 1})) == 903  # the last chunk: 4999 - 4096 rows
    assert plp.pending == 0
    assert plp.rows(_so((), {"a": 1, "b": 1})) == 0  # decoding: no prompt rows any more


def test_prompt_logprob_rows_of_a_prefix_cache_hit_and_of_an_aborted_request():
    from vllm_powersave.vllm_compat import PromptLogprobRows

    plp = PromptLogprobRows()
    # 1000 of 1200 prompt tokens computed already (prefix cache): 199 positions left.
    assert plp.rows(_so([_new("a", 1200, prompt_logprobs=0, computed=1000)], {"a": 200})) == 199
    assert plp.rows(_so([_new("c", 4000, prompt_logprobs=5)], {"c": 100})) == 100
    assert plp.pending == 1
    assert plp.rows(_so((), {}, finished=("c",))) == 0
    assert plp.pending == 0  # an aborted request is forgotten, not kept for ever


def test_an_id_finished_and_resubmitted_between_two_steps_counts_as_new():
    from vllm_powersave.vllm_compat import PromptLogprobRows

    plp = PromptLogprobRows()
    assert plp.rows(_so([_new("r", 1000, prompt_logprobs=1)], {"r": 100})) == 100
    assert plp.rows(_so([_new("r", 101, prompt_logprobs=1)], {"r": 50}, finished=("r",))) == 50
    assert plp.pending == 1  # 100 - 50 positions of the new "r" still to come


def test_v2_runner_prices_the_whole_batch_while_a_prompt_logprob_prefill_runs():
    # V2's compute_prompt_logprobs runs the LM head over every scheduled token of such a step.
    from vllm_powersave.vllm_compat import PromptLogprobRows, runner_is_v2

    plp = PromptLogprobRows(whole_batch=True)
    so = _so([_new("a", 3000, prompt_logprobs=1)], {"a": 2048, "b": 1, "c": 1})
    so.total_num_scheduled_tokens = 2050
    assert plp.rows(so) == 2050
    assert plp.rows(_so((), {"b": 1, "c": 1})) == 0  # "a" not scheduled: no prompt-logprob pass
    assert runner_is_v2(type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})())
    assert not runner_is_v2(type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu_model_runner"})())


def test_warmup_steps_are_recognised_by_their_request_ids():
    from vllm_powersave.vllm_compat import is_warmup_step

    assert is_warmup_step(_so((), {"_warmup_0_": 16}))
    assert is_warmup_step(_so((), {"_v2_mixed_warmup_3": 1}))
    assert not is_warmup_step(_so((), {"cmpl-9f2": 1}))
    assert not is_warmup_step(_so((), {}))
