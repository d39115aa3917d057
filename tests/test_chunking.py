import pytest
import torch

from vllm_powersave.chunking.measure import LiveTensorBytes
from vllm_powersave.chunking.policy import ChunkPolicy, apply_chunked
from vllm_powersave.settings import load_settings


def _policy(table, enabled=True):
    return ChunkPolicy(load_settings({"chunking": {"enabled": enabled, "table": table}}, env={}).chunking)


def test_policy_default_is_no_chunking():
    p = _policy([])
    assert [p.chunks(r) for r in (1, 64, 8192)] == [1, 1, 1]


def test_policy_table_lookup_and_caps():
    p = _policy([{"min_rows": 1024, "chunks": 2}, {"min_rows": 8192, "chunks": 8}])
    assert [p.chunks(r) for r in (1, 1023, 1024, 8191, 8192, 50000)] == [1, 1, 2, 2, 8, 8]
    q = _policy([{"min_rows": 1, "chunks": 16}])
    assert q.chunks(3) == 3  # never more chunks than rows
    assert _policy([{"min_rows": 1, "chunks": 4}], enabled=False).chunks(100) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 333])
@pytest.mark.parametrize("chunks", [2, 3, 8])
def test_apply_chunked_equals_unchunked(dtype, rows, chunks):
    g = torch.Generator().manual_seed(rows * chunks)
    w = torch.randn(3000, 96, generator=g).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    b = torch.randn(3000, generator=g).to(dtype)
    for bias in (None, b):
        head = lambda h: torch.nn.functional.linear(h, w, bias)  # noqa: E731
        seen = []
        out = apply_chunked(lambda h: (seen.append(h.shape[0]), head(h))[1], x, chunks, (w, bias))
        ref = head(x)
        # Plain torch (MKL) may pick another kernel for a different row count: equal within rounding.
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert seen == ([1] if rows == 1 else [])  # split rows are written by the plugin's GEMM, never via head()


def test_apply_chunked_runs_a_head_it_cannot_write_into_once():
    """A head that is not a plain GEMM (quantised, say): splitting it would hold each block's
    result beside the output, so it runs unchunked."""
    x = torch.randn(64, 8)
    seen = []
    out = apply_chunked(lambda h: (seen.append(h.shape[0]), h * 2)[1], x, 4)
    assert torch.equal(out, x * 2) and seen == [64]


def test_vllm_logits_processor_replacement_matches_unchunked():
    """The out-of-tree LogitsProcessor in real vLLM: the same logits (within rounding) and argmax,
    any chunk count."""
    vllm = pytest.importorskip("vllm")  # noqa: F841
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_powersave import vllm_compat

    n = {"chunks": 1, "calls": 0, "asked": 0}

    def chunks(h):
        n["asked"] += 1
        return 0 if n["chunks"] == 1 else n["chunks"]  # 0: vLLM's own call, directly

    def chunked(head, h, c, gemm):
        n["calls"] += 1
        assert c == n["chunks"]
        assert gemm is not None  # an unquantised head: the plugin writes the blocks itself
        return apply_chunked(head, h, c, gemm)

    vllm_compat.register_logits_processor(chunks, chunked)
    assert vllm_compat.register_logits_processor(chunks, chunked) is False  # idempotent
    with set_current_vllm_config(VllmConfig()):
        lp = LogitsProcessor(vocab_size=1000)
    assert type(lp).__name__ == "PowersaveLogitsProcessor"
    for dtype in (torch.float32, torch.bfloat16):
        lm = torch.nn.Module()
        lm.weight = torch.nn.Parameter(torch.randn(1000, 64).to(dtype), requires_grad=False)
        lm.quant_method = UnquantizedEmbeddingMethod()
        lm.tp_size = 1
        dispatch_cpu_unquantized_gemm(lm, remove_weight=False)
        for rows in (5, 300):
            x = torch.randn(rows, 64).to(dtype)
            n["chunks"] = 1
            ref = lp(lm, x)
            for c in (2, 4, 16):
                n["chunks"] = c
                out = lp(lm, x)
                # torch.mm per block vs vLLM's CPU GEMM (oneDNN) for the whole: equal within rounding
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
                assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # 2 dtypes x 2 row counts x (1 + 3 chunk counts) calls asked; only the split ones reach chunked()
    assert n["asked"] == 16 and n["calls"] == 12


def test_live_tensor_bytes_sees_a_block_result_held_beside_the_output():
    """The measurement itself: preallocate-and-copy (the former chunked head) peaks above one GEMM."""
    w, x = torch.randn(1000, 32), torch.randn(256, 32)
    with LiveTensorBytes() as plain:
        out = x @ w.t()
        del out
    with LiveTensorBytes() as copied:
        out = x.new_empty((256, 1000))
        for i, h in enumerate(torch.tensor_split(x, 4)):
            out[i * 64 : (i + 1) * 64].copy_(h @ w.t())
        del out
    assert plain.peak == 256 * 1000 * 4
    assert copied.peak == plain.peak + 64 * 1000 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_lm_head_never_raises_peak_memory(dtype, monkeypatch):
    """Differential, through vLLM's own LogitsProcessor (CPU build): the chunked head's peak of
    live tensor bytes is at most the unchunked head's, and its logits equal the unchunked ones
    within the dtype's rounding (argmax identical)."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor import custom_op
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_powersave import vllm_compat

    # A registration of this test's own (another test may have registered one in this process).
    monkeypatch.setattr(vllm_compat, "_PATCHED", set())
    monkeypatch.setattr(custom_op, "op_registry_oot", {})
    want = {"chunks": 0}
    assert vllm_compat.register_logits_processor(lambda h: want["chunks"], lambda head, h, c, gemm: apply_chunked(head, h, c, gemm))
    with set_current_vllm_config(VllmConfig()):
        lp = LogitsProcessor(vocab_size=4096)
    assert type(lp).__name__ == "PowersaveLogitsProcessor"
    g = torch.Generator().manual_seed(7)
    lm = torch.nn.Module()
    lm.weight = torch.nn.Parameter(torch.randn(4096, 64, generator=g).to(dtype), requires_grad=False)
    lm.quant_method = UnquantizedEmbeddingMethod()
    lm.tp_size = 1
    dispatch_cpu_unquantized_gemm(lm, remove_weight=False)
    x = torch.randn(1024, 64, generator=g).to(dtype)
    with LiveTensorBytes() as unchunked:
        ref = lp(lm, x)
    assert unchunked.peak >= ref.numel() * ref.element_size()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for chunks in (2, 3, 8):
        want["chunks"] = chunks
        with LiveTensorBytes() as chunked:
            out = lp(lm, x)
        assert chunked.peak <= unchunked.peak, (chunks, chunked.peak, unchunked.peak)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
