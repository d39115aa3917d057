"""Chunking that bounds memory: prompt logprobs computed block by block hold one block's logits and
log-softmax, not ``[rows, vocab]`` (chunking/apply.py ``chunked_logprobs``, vllm_compat.py
``install_prompt_logprobs``), with the same results; blocks sized by the table or free memory
(chunking/policy.py). Peak bytes are counted op by op (``LiveTensorBytes``): a behaviour test."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_powersave.chunking.apply import chunked_logprobs
from vllm_powersave.chunking.measure import LiveTensorBytes
from vllm_powersave.chunking.policy import MIN_LOGPROB_CHUNK_ROWS, ChunkPolicy, logprob_row_bytes
from vllm_powersave.settings import load_settings


def _policy(table, enabled=True, share=None):
    c = {"enabled": enabled, "table": table, **({"free_memory_share": share} if share else {})}
    return ChunkPolicy(load_settings({"chunking": c}, env={}).chunking)


def _log_softmax(x):
    return x.log_softmax(dim=-1, dtype=torch.float32)


def _gather(scores, k, tgt):
    """vLLM's ``Sampler.gather_logprobs`` in plain torch (top-k, the token's logprob and rank)."""
    top, idx = torch.topk(scores, k, dim=-1)
    tok = scores.gather(-1, tgt.unsqueeze(-1))
    ranks = (scores >= tok).sum(-1)
    return (torch.cat((tgt.unsqueeze(-1), idx), 1).to(torch.int32), torch.cat((tok, top), 1), ranks)


def _case(rows=256, hidden=32, vocab=8192, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    return w, x, torch.randint(0, vocab, (rows,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,step", [(1, 1), (7, 3), (256, 32), (300, 64), (256, 256)])
def test_chunked_logprobs_equal_unchunked(dtype, rows, step):
    w, x, tgt = _case(rows=rows, dtype=dtype, seed=rows + step)
    head = lambda h: h @ w.t()  # noqa: E731
    ref = _gather(_log_softmax(head(x)), 4, tgt)
    out = chunked_logprobs(head, _log_softmax, _gather, x, 4, tgt, step)
    assert type(out) is type(ref)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[2], ref[2])  # top-k ids and ranks
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)


def test_chunked_head_gemm_writes_logits_exactly():
    from vllm_powersave.chunking.apply import apply_chunked

    w, x, _ = _case(rows=333)
    ref = x @ w.t()
    for chunks in (2, 3, 8):
        assert torch.equal(apply_chunked(lambda h: h @ w.t(), x, chunks, (w, None)), ref)


def _peak(fn):
    with LiveTensorBytes() as m:
        out = fn()
    del out
    return m.peak


def test_prompt_logprob_peak_scales_with_the_chunk_not_the_rows():
    w, x, tgt = _case(rows=512, vocab=8192)
    head = lambda h: h @ w.t()  # noqa: E731
    one = _peak(lambda: chunked_logprobs(head, _log_softmax, _gather, x, 5, tgt, 512))
    eight = _peak(lambda: chunked_logprobs(head, _log_softmax, _gather, x, 5, tgt, 64))
    assert one >= 512 * 8192 * 4 * 2  # the whole logits and log-softmax
    assert eight <= 0.3 * one, (eight, one)


def test_policy_sizes_logprob_blocks_from_the_table_else_free_memory():
    p = _policy([{"min_rows": 1024, "chunks": 8}])
    assert p.logprob_chunk_rows(2048, 151936, 2, free_bytes=None) == 256  # the table: ceil(2048 / 8)
    assert p.logprob_chunk_rows(2048, 151936, 2, free_bytes=1) == 256  # a rule wins over memory
    assert p.logprob_chunk_rows(512, 151936, 2, free_bytes=None) == 512  # no rule, CPU: one block
    per_row = logprob_row_bytes(151936, 2)
    assert per_row == 151936 * 14
    q = _policy([], share=0.5)
    assert q.logprob_chunk_rows(8192, 151936, 2, free_bytes=2 * 300 * per_row) == 300
    assert q.logprob_chunk_rows(100, 151936, 2, free_bytes=2 * 300 * per_row) == 100  # fits: one block
    assert q.logprob_chunk_rows(8192, 151936, 2, free_bytes=0) == MIN_LOGPROB_CHUNK_ROWS
    assert _policy([{"min_rows": 1, "chunks": 8}], enabled=False).logprob_chunk_rows(4096, 1000, 2, 0) == 4096


# ---------------------------------------------------------------------------------------------
# Through vLLM's own _get_prompt_logprobs_dict (CPU build), on a stand-in runner
# ---------------------------------------------------------------------------------------------
def _runner(vocab, prompts, k, mode="raw_logprobs"):
    from vllm.v1.sample.sampler import Sampler

    g = torch.Generator().manual_seed(1)
    w = torch.randn(vocab, 32, generator=g)
    calls = []

    def compute_logits(h):
        calls.append(int(h.shape[0]))
        return h @ w.t()

    starts = np.cumsum([0] + [len(p) for p in prompts])
    return SimpleNamespace(
        num_prompt_logprobs={f"r{i}": k for i in range(len(prompts))},
        requests={
            f"r{i}": SimpleNamespace(prompt_token_ids=p, in_progress_prompt_logprobs_cpu=None, num_computed_tokens=0)
            for i, p in enumerate(prompts)
        },
        device=torch.device("cpu"),
        input_batch=SimpleNamespace(req_id_to_index={f"r{i}": i for i in range(len(prompts))}),
        query_start_loc=SimpleNamespace(np=starts),
        model=SimpleNamespace(compute_logits=compute_logits),
        model_config=SimpleNamespace(logprobs_mode=mode, get_vocab_size=lambda: vocab),
        sampler=SimpleNamespace(compute_logprobs=Sampler.compute_logprobs, gather_logprobs=Sampler.gather_logprobs),
        _sync_device=lambda: None,
        calls=calls,
    ), int(starts[-1])


@pytest.fixture
def hooked(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_powersave import vllm_compat

    monkeypatch.setattr(vllm_compat, "_PATCHED", set())
    monkeypatch.setattr(vllm_compat, "_INSTALLED", set())
    monkeypatch.setattr(GPUModelRunner, "_get_prompt_logprobs_dict", vars(GPUModelRunner)["_get_prompt_logprobs_dict"])
    plan = {"rows": None}
    assert vllm_compat.install_prompt_logprobs(lambda rows, vocab, dtype, dev: plan["rows"] or rows, chunked_logprobs)
    assert "prompt_logprobs" in vllm_compat.installed_features()
    fn = GPUModelRunner._get_prompt_logprobs_dict
    return fn, fn.__powersave_original__, plan


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_vllm_prompt_logprobs_in_blocks_match_and_bound_memory(hooked, mode):
    """raw_logits: vLLM's ``logits.to(torch.float32)`` branch (0.32), kept lazy as well."""
    fn, orig, plan = hooked
    vocab, prompts = 8192, [list(range(3, 403)), list(range(50, 162))]

    def run(f, rows_per_block):
        plan["rows"] = rows_per_block
        runner, n = _runner(vocab, prompts, 3, mode)
        h = torch.randn(n, 32, generator=torch.Generator().manual_seed(2))
        with LiveTensorBytes() as m:
            out = f(runner, h, {"r0": len(prompts[0]), "r1": len(prompts[1])})
        return out, m.peak, runner.calls

    ref, stock_peak, stock_calls = run(orig, None)
    same, same_peak, _ = run(fn, None)  # one block: vLLM's own path
    out, peak, calls = run(fn, 50)
    assert stock_calls == [399, 111] and calls == [50] * 7 + [49] + [50, 50, 11]
    for a in (same, out):
        for rid in ("r0", "r1"):
            assert torch.equal(a[rid].logprob_token_ids, ref[rid].logprob_token_ids)
            assert torch.equal(a[rid].selected_token_ranks, ref[rid].selected_token_ranks)
            torch.testing.assert_close(a[rid].logprobs, ref[rid].logprobs, rtol=1e-5, atol=1e-5)
    assert peak <= 0.3 * stock_peak, (peak, stock_peak)


def test_steps_without_prompt_logprobs_call_vllm_directly(hooked):
    fn, _orig, _plan = hooked
    runner, _ = _runner(100, [[1, 2, 3]], 1)
    runner.num_prompt_logprobs = {}
    assert fn(runner, torch.zeros(3, 32), {}) == {}
    assert runner.calls == []
