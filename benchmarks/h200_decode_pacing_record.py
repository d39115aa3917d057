"""Decode pacing against vLLM's defaults, from a ``tune-serving`` state file (measured windows).

Reads the ``state.jsonl`` of an ``h200_tune_serving --load rate4`` run whose space is decode pacing
off and on, and writes ``docs/results/h200-decode-pacing.{json,md}``: every finished window of the
same-request search round and of the ABBA pairs, with the tokens each served (tokens per joule x
joules), its energy, duration and latency, and the paced/stock ratio per pair of the same requests.
Energy is the NVML counter on the GPU (measured). Fewer than 6 pairs settle no claim (the house
rule); the record says how many there are.

Usage: ``python -m benchmarks.h200_decode_pacing_record STATE_DIR --device "NVIDIA H200" --lease "..." [--out-dir docs/results]
[--name h100-decode-pacing]`` (``--name``: the record's file name, one per GPU kind: runs on different
GPUs do not pool).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.lib.cli import one_line_errors
from benchmarks.lib.device import utc_now, write_record
from vllm_powersave.intervals import mean_ci95

NAME = "h200-decode-pacing"


def windows(state: Path) -> list[dict[str, Any]]:
    """The finished measurements of ``state.jsonl``, each with its served tokens."""
    out = []
    for line in state.read_text().splitlines():
        m = json.loads(line) if line.strip() else {}
        if m.get("kind") != "measurement":
            continue
        f = m["figures"]
        tokens = round(f["output_tokens_per_joule"] * f["gpu_energy_j"]) if f.get("output_tokens_per_joule") else None
        out.append(
            {
                "step": m["step"],
                "config": m["key"],
                "paced": m["key"] != "defaults" and not m["key"].endswith("=off"),
                "seed": m["seed"],
                "started_utc": m.get("started_utc"),
                "requests": f["completed"],
                "output_tokens": tokens,
                "gpu_energy_j": round(f["gpu_energy_j"], 1),
                "tok_per_j": round(f["output_tokens_per_joule"], 4),
                "duration_s": round(f["duration_s"], 2),
                "p99_ttft_ms": round(f["p99_ttft_ms"], 1),
                "p99_tpot_ms": round(f["p99_tpot_ms"], 2),
                "slo_attainment": round(f["good"] / f["sent"], 4) if f["sent"] else None,
                "energy_source": f["energy_source"],
            }
        )
    return out


def same_request_ratios(ws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Paced over stock per seed (the same requests), where both arms of a seed finished."""
    by_seed: dict[int, dict[bool, dict[str, Any]]] = {}
    for w in ws:
        by_seed.setdefault(w["seed"], {})[w["paced"]] = w
    out = []
    for seed, arms in sorted(by_seed.items()):
        if True in arms and False in arms:
            p, s = arms[True], arms[False]
            out.append(
                {
                    "seed": seed,
                    "kind": "search" if p["step"].startswith("search") else "pair",
                    "tok_per_j_ratio": round(p["tok_per_j"] / s["tok_per_j"], 3),
                    "tok_per_j_ratio_raw": round(p["tok_per_j"] / s["tok_per_j"], 6),
                    "energy_ratio": round(p["gpu_energy_j"] / s["gpu_energy_j"], 3),
                    "same_tokens": p["output_tokens"] == s["output_tokens"],
                    "duration_s": [p["duration_s"], s["duration_s"]],
                }
            )
    return out


def pair_interval(ratios: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The pairs' tokens-per-joule ratio: mean and 95 % t interval (``None`` below 2 pairs)."""
    xs = [r.get("tok_per_j_ratio_raw", r["tok_per_j_ratio"]) for r in ratios if r["kind"] == "pair"]
    if len(xs) < 2:
        return None
    mean, lo, hi = mean_ci95(xs)
    return {"mean": round(mean, 3), "ci95": [round(lo, 3), round(hi, 3)], "n": len(xs)}


def status(ratios: list[dict[str, Any]]) -> str:
    """What the record settles: at least 6 adjacent pairs with a 95 % interval (the house rule)."""
    pairs = sum(r["kind"] == "pair" for r in ratios)
    head = f"{pairs} ABBA pair(s) and {len(ratios) - pairs} same-request search window(s)"
    ci = pair_interval(ratios)
    ci_text = f"; pairs x{ci['mean']} (95 % CI {ci['ci95'][0]}-{ci['ci95'][1]})" if ci else ""
    if pairs >= 6:
        return head + ci_text + "."
    return head + ci_text + ": fewer than 6 adjacent pairs, so no claim is settled."


def markdown(rec: dict[str, Any]) -> str:
    head = (
        f"# {rec['name']}: decode pacing (35 ms) against vLLM's defaults at Poisson 4 req/s (measured)\n\n"
        f"{rec['what']} Device: {rec['device']}; lease {rec['lease']}. Energy: NVML counter (measured). "
        f"Recorded {rec['recorded_utc'][:10]}.\n\n"
        "| window | config | requests | output tokens | GPU J | tok/J | duration s | p99 TTFT ms | p99 TPOT ms | SLO attainment |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = "".join(
        f"| {w['step']} | {w['config']} | {w['requests']} | {w['output_tokens']} | {w['gpu_energy_j']} | {w['tok_per_j']} | "
        f"{w['duration_s']} | {w['p99_ttft_ms']} | {w['p99_tpot_ms']} | {w['slo_attainment']} |\n"
        for w in rec["windows"]
    )
    ratios = "\n| same requests (seed) | kind | tok/J paced / stock | energy paced / stock | same tokens | duration s paced / stock |\n|---|---|---|---|---|---|\n"
    ratios += "".join(
        f"| {r['seed']} | {r['kind']} | x{r['tok_per_j_ratio']} | x{r['energy_ratio']} | {r['same_tokens']} | "
        f"{r['duration_s'][0]} / {r['duration_s'][1]} |\n"
        for r in rec["ratios"]
    )
    reading = (
        "\nDuration: each window's arrivals span 20 s and the window ends with its last request. A paced "
        "window ends later because its last requests decode at the target; both arms served the same "
        "requests and the same tokens, so the tokens per second at the offered rate are the same, while the "
        "window's own output throughput reads lower. Each arm's energy is counted over its own duration: a "
        "stock window held as long would add its idle energy, so the ratios here are conservative for pacing.\n"
    )
    return head + rows + ratios + reading + f"\n{rec['status']}\n"


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("state_dir", type=Path)
    ap.add_argument("--device", required=True)
    ap.add_argument("--lease", required=True)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/results"))
    ap.add_argument("--name", default=NAME, help="the record's file name (default %(default)s)")
    ns = ap.parse_args(argv)
    if not ns.name or ns.name != Path(ns.name).name or ns.name.startswith("."):
        raise ValueError(f"--name = {ns.name!r}: a file name, not empty and without a folder")
    ws = windows(ns.state_dir / "state.jsonl")
    ratios = same_request_ratios(ws)
    pairs = sum(r["kind"] == "pair" for r in ratios)
    rec = {
        "name": ns.name,
        "what": (
            "`vllm-powersave tune-serving` (benchmarks/h200_tune_serving.py --load rate4): qwen2.5-7b shape (dummy "
            "weights), vLLM 0.25, Poisson 4 req/s, input uniform 128-1024 and output uniform 32-512 tokens, streamed, "
            "20 s of arrivals per window run to its last request; SLO 99 % with TTFT <= 2000 ms and TPOT <= 50 ms. "
            "Stock: vLLM's defaults (no plugin); paced: the plugin's defaults plus decode_pacing.tpot_target_ms 35."
        ),
        "measured": True,
        "simulated": False,
        "device": ns.device,
        "lease": ns.lease,
        "recorded_utc": utc_now(),
        "windows": ws,
        "ratios": ratios,
        "pairs": pairs,
        "pair_tok_per_j_ratio": pair_interval(ratios),
        "status": status(ratios),
        "scripts": ["benchmarks/h200_tune_serving.py", "benchmarks/h200_decode_pacing_record.py"],
    }
    if not ws:
        raise ValueError(f"{ns.state_dir / 'state.jsonl'} holds no finished window")
    write_record(ns.out_dir, ns.name, rec, markdown(rec))
    print(markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
