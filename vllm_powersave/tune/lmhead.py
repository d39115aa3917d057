"""LM-head time and energy per chunk count over a grid of row counts (the chunking tuner's data).

The LM head is ``logits = X[rows, hidden] @ W[vocab, hidden]^T`` (bf16). Rows reaching it in vLLM:
one per decoding request (decode batches), ``batch * (k + 1)`` with k speculative tokens, and every
prompt position when prompt logprobs are asked for (then vLLM also takes an fp32 log-softmax and a
gather). Each grid row names its kind; ``decode`` and ``spec`` rows measure the logits GEMM alone
(mode ``mm``, through :func:`vllm_powersave.chunking.apply.apply_chunked`, the plugin's own code),
``logprobs`` rows add the fp32 log-softmax and gather per chunk (mode ``mm+lsm``).

On a GPU: time from CUDA events, energy from NVML windows aligned to counter updates
(:func:`.energy.busy_window`), measured. On a CPU: time measured on the CPU, energy *simulated* for
an H200 from the FLOPs and bytes of each kernel (:func:`.energy.simulated_kernels`); every point
carries ``energy_source``.

Only torch, the standard library and (on a GPU) nvidia-ml-py are imported.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..chunking.apply import apply_chunked
from ..device import GpuError, driver_version
from .energy import busy_window, open_nvml, simulated_kernels, timed_window

KIND_MODE = {"decode": "mm", "spec": "mm", "logprobs": "mm+lsm"}

#: GPU default grid: decode batches 64 and 256, speculative rows 1024 (256 requests x 4), prompt
#: logprobs over 4096 and 16384 positions. Sized so that two model shapes x 4 chunk counts x 2
#: repeats of >= 1 s windows fit in about 110 s on the H200.
DEFAULT_GRID = "64:decode,256:decode,1024:spec,4096:logprobs,16384:logprobs"
DEFAULT_CHUNKS = "1,2,4,8"
#: Model shapes (hidden x vocab) for the H200 record: qwen2.5-0.5b (0.5B class), llama3-8b (8B class).
DEFAULT_SHAPES = "896x151936,4096x128256"


@dataclass(frozen=True)
class GridRow:
    """One row count of the grid: ``rows`` reaching the LM head, of ``kind`` decode/spec/logprobs."""

    rows: int
    kind: str

    @property
    def mode(self) -> str:
        return KIND_MODE[self.kind]


def parse_grid(text: str) -> list[GridRow]:
    """``"64:decode,1024:spec,4096:logprobs"`` -> grid rows.

    Raises:
        ValueError: one line naming the bad entry.
    """
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        rows, _, kind = item.partition(":")
        kind = kind or "decode"
        if kind not in KIND_MODE:
            raise ValueError(f"grid entry {item!r}: kind must be one of {', '.join(KIND_MODE)}")
        try:
            r = int(rows)
        except ValueError:
            raise ValueError(f"grid entry {item!r}: rows must be an integer") from None
        if r < 1:
            raise ValueError(f"grid entry {item!r}: rows must be >= 1")
        out.append(GridRow(r, kind))
    if not out:
        raise ValueError(f"grid {text!r}: no rows given")
    return out


def parse_ints(text: str, field: str, minimum: int = 1) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; ValueError (one line naming ``field``) on bad input."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{field} = {text!r}: must be comma-separated integers") from None
    if not vals or min(vals) < minimum:
        raise ValueError(f"{field} = {text!r}: needs integers >= {minimum}")
    return vals


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"896x151936,4096x128256"`` -> ``[(896, 151936), (4096, 128256)]`` (hidden, vocab)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            h, v = (int(p) for p in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {item!r}: expected HIDDENxVOCAB, e.g. 896x151936") from None
        if h < 1 or v < 1:
            raise ValueError(f"shape {item!r}: hidden and vocab must be >= 1")
        out.append((h, v))
    if not out:
        raise ValueError(f"shapes {text!r}: none given")
    return out


def call_kernels(rows: int, hidden: int, vocab: int, chunks: int, mode: str, dtype_bytes: int = 2) -> list[tuple[float, float]]:
    """``(FLOPs, HBM bytes)`` of each kernel one chunked LM-head call launches (for the simulator).

    Every chunk re-reads the whole ``[vocab, hidden]`` weight: the reason chunking costs energy at
    decode-sized row counts. ``mm``: each chunk's GEMM writes straight into its rows of the result
    (``apply_chunked``), no copy. ``mm+lsm`` per chunk: fp32 cast (read 2 B, write 4 B
    per logit), log-softmax (two reads and a write of 4 B), gather (negligible).
    """
    c = max(1, min(chunks, rows))
    out = []
    base, extra = divmod(rows, c)
    for i in range(c):
        r = base + (1 if i < extra else 0)
        gemm = (2.0 * r * hidden * vocab, float(dtype_bytes * (vocab * hidden + r * hidden + r * vocab)))
        out.append(gemm)
        if mode == "mm+lsm":
            out.append((float(r * vocab), float(r * vocab * (dtype_bytes + 4))))
            out.append((5.0 * r * vocab, 12.0 * r * vocab))
    return out


def _make_call(torch: Any, w: Any, x: Any, idx: Any, mode: str, chunks: int) -> Callable[[], Any]:
    def head(hs: Any) -> Any:
        return hs @ w.t()

    if mode == "mm":
        return lambda: apply_chunked(head, x, chunks, (w, None))

    out = torch.empty((x.shape[0], 1), device=x.device, dtype=torch.float32)

    def lsm() -> Any:
        # Per chunk: logits, fp32 log-softmax, gather of the prompt token's logprob; only [rows]
        # values survive, so the [rows, vocab] fp32 peak shrinks by the chunk count. (A model of a
        # per-chunk log-softmax: vLLM's own prompt-logprob path takes it over the full logits.)
        n = 0
        for xs, ids in zip(torch.tensor_split(x, chunks), torch.tensor_split(idx, chunks)):
            r = xs.shape[0]
            out[n : n + r] = torch.log_softmax(head(xs).float(), dim=-1).gather(-1, ids)
            n += r
        return out

    return lsm


def measure(
    shapes: list[tuple[int, int]],
    grid: list[GridRow],
    chunks: list[int],
    *,
    window_s: float = 1.0,
    repeats: int = 2,
    warmup_s: float = 2.0,
    device: str | None = None,
    progress: Callable[[dict], None] | None = None,
    seed: int = 0,
) -> Iterator[dict]:
    """Yield one point per (shape, grid row, repeat, chunk count); chunk order alternates per repeat.

    Args:
        shapes: ``(hidden, vocab)`` pairs.
        grid: row counts to measure (:func:`parse_grid`).
        chunks: candidate chunk counts (1 is always included; counts above ``rows`` are skipped).
        window_s: energy window per point on a GPU (s; between two counter updates). On a CPU the
            timing loop lasts this long (energy is simulated there).
        repeats: repeats per point; the spread across repeats is the noise the choice rule uses.
        warmup_s: per shape, the heaviest call runs this long first (clocks and temperature settle).
        device: "cuda" or "cpu" (default: cuda if available).
        progress: called with each point.

    Yields:
        dicts: ``hidden, vocab, mode, kind, rows, chunks, repeat, ms, j_per_call, window_s,
        peak_mib, sm_clock_mhz, power_w, calls, energy_source, sim_ms`` (ms per call, J per call, MiB,
        W; ``sim_ms``: on a CPU, the simulated H200's time per call, else None).

    Raises:
        RuntimeError: on a GPU, NVML is unavailable (energy could not be measured).
    """
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    nv = open_nvml(dev.index or 0) if gpu else None
    if gpu and nv is None:
        raise RuntimeError("no NVML: GPU energy cannot be measured (install nvidia-ml-py)")
    cands = sorted(set([1, *chunks]))
    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for hidden, vocab in shapes:
        w = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dev, dtype)
        if warmup_s > 0:
            _warm_up(torch, w, grid, gen, dev, dtype, warmup_s, sync)
        for g in grid:
            x = torch.randn(g.rows, hidden, generator=gen).to(dev, dtype)
            idx = torch.randint(0, vocab, (g.rows, 1), generator=gen).to(dev)
            cs = [c for c in cands if c <= g.rows]
            for rep in range(repeats):
                for c in cs if rep % 2 == 0 else list(reversed(cs)):
                    call = _make_call(torch, w, x, idx, g.mode, c)
                    pt = {
                        "hidden": hidden,
                        "vocab": vocab,
                        "mode": g.mode,
                        "kind": g.kind,
                        "rows": g.rows,
                        "chunks": c,
                        "repeat": rep,
                        **_measure_call(torch, dev, nv, call, window_s, (g.rows, hidden, vocab, c, g.mode)),
                    }
                    if progress:
                        progress(pt)
                    yield pt
            del x, idx
        del w
        if gpu:
            torch.cuda.empty_cache()


def _warm_up(torch: Any, w: Any, grid: list[GridRow], gen: Any, dev: Any, dtype: Any, warmup_s: float, sync: Callable[[], None]) -> None:
    """Run the grid's heaviest call for ``warmup_s`` so that clocks and temperature settle."""
    vocab, hidden = w.shape
    big = max(grid, key=lambda g: (g.rows, g.mode == "mm+lsm"))
    xw = torch.randn(big.rows, hidden, generator=gen).to(dev, dtype)
    iw = torch.randint(0, vocab, (big.rows, 1), generator=gen).to(dev)
    timed_window(_make_call(torch, w, xw, iw, big.mode, 1), warmup_s, sync)
    del xw, iw


def _measure_call(
    torch: Any, dev: Any, nv: Any, call: Callable[[], Any], window_s: float, point: tuple[int, int, int, int, str]
) -> dict[str, Any]:
    """One point's figures: on a GPU (``nv`` given) its peak memory and a counter-aligned energy
    window (measured); on a CPU its time per call and the simulated H200's energy and time for
    the kernels of ``point`` (:func:`call_kernels`' arguments; simulated)."""
    if nv is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        call()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
        win = busy_window(call, window_s, nv)
        ms, j, ws, n, pw, clk, src = win.ms_per_call, win.j_per_call, win.window_s, win.calls, win.power_w, win.sm_clock_mhz, win.source
        sim_ms = None
    else:
        peak = None
        ms, n = timed_window(call, window_s)
        t_sim, j = simulated_kernels(call_kernels(*point))
        ws, pw, clk, src = ms * n / 1000.0, j / t_sim, None, "simulated"
        sim_ms = t_sim * 1000.0
    return {
        "ms": ms,
        "j_per_call": j,
        "window_s": ws,
        "peak_mib": peak,
        "sm_clock_mhz": clk,
        "power_w": pw,
        "calls": n,
        "energy_source": src,
        "sim_ms": sim_ms,
    }


def planned_points(shapes: list[tuple[int, int]], grid: list[GridRow], chunks: list[int], repeats: int) -> int:
    """Number of points :func:`measure` will yield."""
    cands = sorted(set([1, *chunks]))
    return len(shapes) * repeats * sum(len([c for c in cands if c <= g.rows]) for g in grid)


def run_benchmark(
    shapes: str = DEFAULT_SHAPES,
    grid: str = DEFAULT_GRID,
    chunks: str = DEFAULT_CHUNKS,
    *,
    window_s: float = 1.0,
    repeats: int = 2,
    warmup_s: float = 2.0,
    device: str | None = None,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """The raw document of one LM-head grid run (the format of the raw files behind
    ``docs/results/h200-lmhead-chunking*.md``; the script that wrote them and their record converter
    are ``benchmarks/lm_head_chunking.py`` and ``benchmarks/lmhead_chunking_record.py`` at tag
    ``investigations-archive-2``). ``vllm-powersave tune MODEL --only chunking`` measures the same
    grid through :func:`measure` and writes a preset instead."""
    import torch

    sh, gr, ch = parse_shapes(shapes), parse_grid(grid), parse_ints(chunks, "chunks")
    t0 = time.monotonic()
    results = list(measure(sh, gr, ch, window_s=window_s, repeats=repeats, warmup_s=warmup_s, device=device, progress=progress))
    gpu = bool(results) and results[0]["energy_source"] == "measured"
    driver = None
    nv = open_nvml() if gpu else None
    if nv is not None:
        try:
            driver = driver_version(nv.nvml)
        except GpuError:
            driver = None
    return {
        "what": "LM-head time and energy per chunk count and row count",
        "device": torch.cuda.get_device_name(0) if gpu else "cpu (energy simulated for an H200)",
        "torch": torch.__version__,
        "driver": driver,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "method": (
            "energy: NVML total-energy counter between two counter updates while the GPU runs the call back to back; time: CUDA events"
            if gpu
            else "time: wall clock on the CPU (measured); energy: H200 model from the kernels' FLOPs and bytes (simulated)"
        ),
        "window_s": window_s,
        "repeats": repeats,
        "warmup_s": warmup_s,
        "shapes": shapes,
        "grid": grid,
        "chunks": chunks,
        "elapsed_s": time.monotonic() - t0,
        "results": results,
    }
