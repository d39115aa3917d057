"""Interleaved A/B of two live servers (or two presets) with per-pair ratios and a t-interval.

Drift (GPU temperature, other tenants, page cache) is slower than one run, so runs are paired and
alternate A B, B A, A B, ... (ABBA): each pair's ratio B/A cancels drift to first order, and the
spread of the pair ratios is the noise a verdict must beat.
"""

from __future__ import annotations

import math
import statistics as st
from typing import Any

from .config import BenchConfig
from .runner import run

# Two-sided 95 % Student t quantiles by degrees of freedom.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t95(df: int) -> float:
    """Two-sided 95 % quantile of Student's t with ``df`` degrees of freedom (``df`` >= 1).

    Exact table up to 10; above, the Cornish-Fisher expansion around the normal quantile
    (Abramowitz & Stegun 26.7.5), within 1e-3 of the exact value from df = 11 on.
    """
    if df < 1:
        raise ValueError(f"df = {df}: need at least 1 degree of freedom")
    if df in _T95:
        return _T95[df]
    z, v = 1.959963985, float(df)
    return (
        z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2) + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
    )


#: (result field, label, "higher is better")
RATIOS = (
    ("output_throughput", "output throughput", True),
    ("gpu_energy_per_output_token_j", "J / output token", False),
    ("output_tokens_per_joule", "output tokens / J", True),
    ("median_ttft_ms", "TTFT p50", False),
    ("p99_tpot_ms", "TPOT p99", False),
)


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Mean of the pair ratios and its 95 % t-interval (nan bounds with fewer than 2 pairs)."""
    m = st.mean(ratios)
    if len(ratios) < 2:
        return m, math.nan, math.nan
    h = t95(len(ratios) - 1) * st.stdev(ratios) / math.sqrt(len(ratios))
    return m, m - h, m + h


def summarize(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Per metric: pair ratios B/A, mean, 95 % CI and a verdict ("inside noise" if the CI holds 1)."""
    out: dict[str, Any] = {}
    for key, label, _ in RATIOS:
        rs = [b[key] / a[key] for a, b in pairs if a.get(key) and b.get(key) is not None]
        if not rs:
            continue
        m, lo, hi = ratio_ci(rs)
        if math.isnan(lo):
            out[key] = {"label": label, "ratios": rs, "mean": m, "ci95": [None, None], "verdict": "one pair: no interval"}
            continue
        verdict = "inside noise" if not (lo > 1 or hi < 1) else ("B higher" if lo > 1 else "B lower")
        out[key] = {"label": label, "ratios": rs, "mean": m, "ci95": [lo, hi], "verdict": verdict}
    return out


def run_ab(a: BenchConfig, b: BenchConfig, pairs: int = 3) -> dict[str, Any]:
    """Run ``pairs`` A/B pairs in ABBA order; returns runs and :func:`summarize` of the ratios."""
    runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for i in range(pairs):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        r1 = run(first.model_copy(update={"seed": first.seed + i}))
        r2 = run(second.model_copy(update={"seed": second.seed + i}))
        ra, rb = (r1, r2) if i % 2 == 0 else (r2, r1)
        runs.append((ra, rb))
    sources = {r.get("energy_source") for pair in runs for r in pair}
    return {
        "pairs": pairs,
        "order": "ABBA",
        "a": a.base_url,
        "b": b.base_url,
        "energy_source": "simulated" if "simulated" in sources else ("measured" if sources == {"measured"} else None),
        "summary": summarize(runs),
        "runs": [{"a": _scalars(ra), "b": _scalars(rb)} for ra, rb in runs],
    }


def _scalars(r: dict[str, Any]) -> dict[str, Any]:
    """A run's summary without per-request arrays and the sample timeline (kept small)."""
    return {k: v for k, v in r.items() if not isinstance(v, list) and k != "timeline"}


def format_ab(result: dict[str, Any]) -> str:
    """Markdown table of the A/B summary; energy rows carry their source."""
    src = result.get("energy_source") or "no energy source"
    lines = [
        f"A/B: A = {result['a']}, B = {result['b']}, {result['pairs']} pairs, {result['order']} order; energy {src}",
        "",
        "| metric | B/A per pair | mean B/A | 95 % CI | verdict |",
        "|---|---|---|---|---|",
    ]
    for key, s in result["summary"].items():
        tag = f" ({src})" if "joule" in key or "energy" in key else ""
        lo, hi = s["ci95"]
        ci = f"{lo:.3f}–{hi:.3f}" if lo is not None else "n/a"
        lines.append(f"| {s['label']}{tag} | {', '.join(f'{r:.3f}' for r in s['ratios'])} | {s['mean']:.3f} | {ci} | {s['verdict']} |")
    return "\n".join(lines) + "\n"
