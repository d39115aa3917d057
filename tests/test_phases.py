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
