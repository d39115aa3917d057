"""Record of an LM-head chunking measurement: ``NAME.json`` + ``NAME.md`` from a raw benchmark file.

Input: the JSON written by ``python -m benchmarks.lm_head_chunking`` (any version: the first H200
run's raw file has no method/date fields; later runs do).
Output, per model shape (hidden x vocab), mode and row count: the chunk counts tried, ms and J per
call (mean, min, max, repeats), the energy windows, and the chunk count chosen by
``vllm_powersave.chunking.tune.choose_chunks``; per shape the resulting chunk table.

    python -m benchmarks.lmhead_chunking_record RAW.json [--out docs/results/h200-lmhead-chunking] [--date YYYY-MM-DD] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

from vllm_powersave.chunking.tune import choose_chunks, combine_modes, to_table

#: Shapes a record should cover: a 0.5B-class and an 8B-class model.
CLASSES = {(896, 151936): "qwen2.5-0.5b (0.5B class)", (3584, 152064): "qwen2.5-7b (7B class)", (4096, 128256): "llama3-8b (8B class)"}
REQUESTED = [(896, 151936), (4096, 128256)]


def build(raw: dict, raw_path: str, date: str | None = None, note: str | None = None) -> tuple[dict, str]:
    """``(record JSON, Markdown)`` from a raw benchmark document.

    Raises:
        ValueError: the raw file holds no points, or a point lacks a required field.
    """
    pts = raw.get("results") or []
    if not pts:
        raise ValueError(f"raw file {raw_path!r}: no 'results'")
    need = ("hidden", "vocab", "mode", "rows", "chunks", "ms", "j_per_call")
    for p in pts:
        missing = [k for k in need if k not in p]
        if missing:
            raise ValueError(f"raw file {raw_path!r}: point {p!r:.80} lacks {missing}")
    sources = {p.get("energy_source", "measured") for p in pts}
    measured = sources == {"measured"}
    aligned = "method" in raw  # the first H200 run read the counter at arbitrary loop edges
    windows = [float(p["window_s"]) for p in pts if p.get("window_s") is not None]
    date = date or raw.get("date") or "unknown (not in the raw file)"

    by_shape: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for p in pts:
        by_shape[(int(p["hidden"]), int(p["vocab"]))].append(p)
    shapes_out, md_tables = [], []
    for (hidden, vocab), sp in sorted(by_shape.items()):
        per_mode = []
        rows_out = []
        for mode in sorted({p["mode"] for p in sp}):
            mp = [p for p in sp if p["mode"] == mode]
            choice = choose_chunks([{"rows": p["rows"], "chunks": p["chunks"], "ms": p["ms"], "j": p["j_per_call"]} for p in mp])
            per_mode.append(choice)
            for rows, ch in choice.items():
                cell = [p for p in mp if p["rows"] == rows]
                ws = [float(p["window_s"]) for p in cell if p.get("window_s") is not None]
                cands = {}
                for c, s in ch["candidates"].items():
                    peaks = [p["peak_mib"] for p in cell if p["chunks"] == c and p.get("peak_mib") is not None]
                    cands[str(c)] = {**s, "peak_mib": max(peaks) if peaks else None}
                kinds = sorted({p.get("kind") for p in cell if p.get("kind")})
                rows_out.append(
                    {
                        "mode": mode,
                        "kind": kinds[0] if len(kinds) == 1 else None,
                        "rows": rows,
                        "chunks_tried": sorted(ch["candidates"]),
                        "candidates": cands,
                        "chosen_chunks": ch["chunks"],
                        "noise": ch["noise"],
                        "time_ratio": ch["time_ratio"],
                        "energy_ratio": ch["energy_ratio"],
                        "window_s_min": min(ws) if ws else None,
                        "window_s_median": st.median(ws) if ws else None,
                    }
                )
        table = to_table(combine_modes(per_mode))
        shapes_out.append({"hidden": hidden, "vocab": vocab, "model_class": CLASSES.get((hidden, vocab)), "rows": rows_out, "table": table})
        md = [
            f"## hidden {hidden}, vocab {vocab}" + (f" — {CLASSES[(hidden, vocab)]}" if (hidden, vocab) in CLASSES else ""),
            "",
            "| mode | rows | chunks | ms / call (min–max) | J / call (min–max) | n | time vs 1 | energy vs 1 | peak MiB | chosen |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows_out:
            c1 = r["candidates"]["1"]
            for c, s in r["candidates"].items():
                peak = "–" if s["peak_mib"] is None else f"{s['peak_mib']:.0f}"
                mark = "**yes**" if int(c) == r["chosen_chunks"] else ""
                md.append(
                    f"| {r['mode']} | {r['rows']} | {c} | {s['ms']:.3f} ({s['ms_min']:.3f}–{s['ms_max']:.3f}) | "
                    f"{s['j']:.4f} ({s['j_min']:.4f}–{s['j_max']:.4f}) | {s['n']} | {s['ms'] / c1['ms']:.3f} | {s['j'] / c1['j']:.3f} | {peak} | {mark} |"
                )
        md += ["", f"Chosen table (rows → chunks, all modes): `{table or '[] (no chunking)'}`", ""]
        md_tables += md

    present = sorted(by_shape)
    missing = [s for s in REQUESTED if s not in by_shape]
    below = sum(1 for w in windows if w < 1.0)
    doc = {
        "what": "LM-head chunking: time and energy per call per chunk count and row count, and the chosen chunk count",
        "measured": measured,
        "energy_source": "measured" if measured else "simulated",
        "device": raw.get("device"),
        "torch": raw.get("torch"),
        "driver": raw.get("driver"),
        "date": date,
        "raw": raw_path,
        "window_edges_aligned_to_counter_updates": aligned,
        "method": raw.get("method"),
        "note": note,
        "windows_s": {"min": min(windows), "median": st.median(windows), "max": max(windows), "below_1s": below, "points": len(windows)}
        if windows
        else None,
        "repeats": max(int(p.get("repeat", 0)) for p in pts) + 1,
        "shapes_present": [list(s) for s in present],
        "shapes_requested_missing": [list(s) for s in missing],
        "choice_rule": "vllm_powersave.chunking.tune.choose_chunks: admissible if mean energy <= unchunked and time <= unchunked x (1 + noise); "
        "counts only with a time or energy gain > noise (largest repeat spread at that row count, >= 3 %); fastest admissible wins",
        "shapes": shapes_out,
    }

    src = "measured" if measured else "SIMULATED energy (time measured on the device named)"
    wdesc = (
        f"{len(windows)} points; energy windows {min(windows):.2f}–{max(windows):.2f} s (median {st.median(windows):.2f} s); "
        f"{below} below 1 s"
        if windows
        else "window lengths not recorded"
    )
    if not measured:
        edge = "Energy is simulated (H200 model of the kernels' FLOPs and bytes); no energy counter was read."
    elif aligned:
        edge = (
            "Window edges were taken at NVML counter updates while the GPU ran the call back to back, so the counter's "
            "100 ms steps do not quantise the energy (`vllm_powersave.tune.energy.busy_window`)."
        )
    else:
        w_min = min(windows) if windows else 1.0
        edge = (
            "This run read the NVML counter at the timing loop's start and end, not at counter updates: the counter advances "
            "every 100 ms, so each point's energy window is off by up to ±0.1 s, i.e. up to ±10 % of a 1 s window and "
            f"±{10 / w_min:.0f} % of the shortest ({w_min:.2f} s); the min–max spread of the repeats below shows how much it mattered."
        )
    md_head = [
        f"# LM-head chunking on {raw.get('device')} ({'measured' if measured else 'energy simulated'})",
        "",
        f"- What ran: `benchmarks/lm_head_chunking.py` (the plugin's `apply_chunked`; bf16 weights), raw file `{raw_path}`; "
        f"record made by `benchmarks/lmhead_chunking_record.py`. Date of the run: {date}.",
        f"- Device: {raw.get('device')}, torch {raw.get('torch')}"
        + (f", driver {raw['driver']}" if raw.get("driver") else "")
        + f". Energy: {src}.",
        f"- Windows: {wdesc}; {doc['repeats']} repeats per point in alternating chunk order. {edge}",
        f"- Shapes in this raw file: {', '.join(f'{h}x{v}' + (f' ({CLASSES[(h, v)]})' if (h, v) in CLASSES else '') for h, v in present)}."
        + (f" **Not in it** (a requested shape): {', '.join(f'{h}x{v} ({CLASSES[(h, v)]})' for h, v in missing)}." if missing else ""),
        "- `mm`: logits only (decode batches, speculative rows). `mm+lsm`: logits, fp32 log-softmax and a gather per chunk "
        "(prompt logprobs).",
        "- Memory: `mm+lsm`'s peak is this benchmark's own per-chunk log-softmax. vLLM (0.25-0.32) takes the prompt-logprob "
        "fp32 log-softmax over the full logits in its own code, outside the LM head, so serving does not get that saving "
        "(`cpu-prompt-logprob-memory.md`); the plugin's chunked head only guarantees a peak no higher than unchunked.",
        f"- Choice rule: {doc['choice_rule']}. Spread = min–max over repeats.",
        *([f"- Note: {note}"] if note else []),
        "",
    ]
    chosen = {f"{s['hidden']}x{s['vocab']}": s["table"] for s in shapes_out}
    md_tail = [
        "## Result",
        "",
        *(f"- {k}: chunk table `{v or '[]'}` ({'no chunking' if not v else 'chunking where listed'})" for k, v in chosen.items()),
        "",
    ]
    return doc, "\n".join(md_head + md_tables + md_tail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="raw JSON from benchmarks/lm_head_chunking.py")
    ap.add_argument("--out", default="docs/results/h200-lmhead-chunking", help="output path without extension")
    ap.add_argument("--date", default=None, help="UTC date of the run, where the raw file has none")
    ap.add_argument("--note", default=None, help="one line for the Markdown (who ran it, where)")
    ns = ap.parse_args(argv)
    try:
        raw = json.loads(Path(ns.raw).read_text())
        doc, md = build(raw, ns.raw, ns.date, ns.note)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(md)
    print(f"wrote {out}.json and {out}.md: " + "; ".join(f"{s['hidden']}x{s['vocab']} table {s['table']}" for s in doc["shapes"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
