"""Peak extra memory of the LM head and prompt logprobs: vLLM's own path (stock) vs the plugin's
row blocks (``chunking/apply.py``), for one shape and several chunk counts.

Stock is what vLLM (0.25-0.32) runs for a request's prompt logprobs: the whole logits, then
``Sampler.compute_logprobs`` (float32 log-softmax) and ``Sampler.gather_logprobs``; the plugin runs
the same three functions per block (``chunked_logprobs``). ``logits`` mode is the head alone
(``apply_chunked``): its consumer needs the whole output, so the plugin's peak equals stock's there.

Peak extra memory: on CUDA ``torch.cuda.max_memory_allocated`` above what was allocated before the
call; on CPU the peak of live tensor bytes counted op by op (``chunking/measure.py``: torch keeps
no CPU allocator statistics). Prints one Markdown row per (mode, chunks); ``--out`` writes JSON.

    python benchmarks/lmhead_memory.py --rows 2048 --vocab 151936 --hidden 896 --chunks 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.device import require_dry_run, utc_now  # noqa: E402
from vllm_powersave.chunking.apply import apply_chunked, chunked_logprobs  # noqa: E402
from vllm_powersave.chunking.measure import LiveTensorBytes  # noqa: E402

MIB = 2**20


def sampler_functions() -> tuple[Any, Any, str]:
    """vLLM's ``compute_logprobs`` and ``gather_logprobs`` where vLLM imports, else the same in torch."""
    try:
        from vllm.v1.sample.sampler import Sampler

        return Sampler.compute_logprobs, Sampler.gather_logprobs, "vllm.v1.sample.sampler.Sampler"
    except Exception:

        def gather(scores: torch.Tensor, k: int, tgt: torch.Tensor) -> tuple[torch.Tensor, ...]:
            top, idx = torch.topk(scores, k, dim=-1)
            tok = scores.gather(-1, tgt.unsqueeze(-1))
            return torch.cat((tgt.unsqueeze(-1), idx), 1).to(torch.int32), torch.cat((tok, top), 1), (scores >= tok).sum(-1)

        return (lambda x: x.log_softmax(dim=-1, dtype=torch.float32)), gather, "torch (vLLM not importable)"


def peak_extra_bytes(fn: Any, device: torch.device) -> int:
    """Peak bytes ``fn()`` allocates beyond what was live before it (its result included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return int(peak)
    with LiveTensorBytes() as m:
        out = fn()
    del out
    return int(m.peak)


def measure(rows: int, vocab: int, hidden: int, chunks: list[int], dtype: torch.dtype, device: torch.device, k: int) -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype).to(device)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    tgt = torch.randint(0, vocab, (rows,), generator=g).to(device)
    scores, gather, _src = sampler_functions()
    head = lambda h: h @ w.t()  # noqa: E731
    stock = {
        "logits": peak_extra_bytes(lambda: head(x), device),
        "prompt_logprobs": peak_extra_bytes(lambda: gather(scores(head(x)), k, tgt), device),
    }
    out = []
    for c in chunks:
        step = -(-rows // c)
        plugin = {
            "logits": peak_extra_bytes(lambda: apply_chunked(head, x, c, (w, None)), device),
            "prompt_logprobs": peak_extra_bytes(lambda: chunked_logprobs(head, scores, gather, x, k, tgt, step), device),
        }
        for mode in ("logits", "prompt_logprobs"):
            s, p = stock[mode], plugin[mode]
            out.append({"mode": mode, "rows": rows, "vocab": vocab, "hidden": hidden, "chunks": c, "rows_per_chunk": step,
                        "stock_peak_mib": s / MIB, "plugin_peak_mib": p / MIB, "ratio": p / s if s else None})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--logprobs", type=int, default=1, help="prompt_logprobs k (top-k per position)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, help="write the rows and the run's facts as JSON")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda":
        require_dry_run()  # on a lent GPU, as every device script: nothing the plugin imports may set a clock
    rows = measure(a.rows, a.vocab, a.hidden, a.chunks, getattr(torch, a.dtype), device, a.logprobs)
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "live tensor bytes (chunking/measure.py LiveTensorBytes)"
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}), "
          f"{a.dtype}, peak extra memory by {how}; scores by {sampler_functions()[2]}\n")  # fmt: skip
    print("| mode | rows | vocab | chunks | stock peak MiB | plugin peak MiB | plugin / stock |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['rows']} | {r['vocab']} | {r['chunks']} | {r['stock_peak_mib']:.1f} | {r['plugin_peak_mib']:.1f} | {r['ratio']:.3f} |"
        )
    if a.out:
        facts = {
            "when": utc_now(),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "dtype": a.dtype,
            "prompt_logprobs_k": a.logprobs,
            "measured_by": how,
            "scores_by": sampler_functions()[2],
            "command": "python benchmarks/lmhead_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rows": rows,
        }
        a.out.write_text(json.dumps(facts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
