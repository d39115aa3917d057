"""Choosing the chunk table from measurements (used by benchmarks/analyze_lm_head.py; the tuner will reuse it).

Seed 004 leaves chunk-size selection open; seed 000 warns that searches over noisy measurements
select outliers. The rule is therefore conservative: per row count, a chunk count other than 1 is
chosen only if its energy is lower than unchunked by more than the measured noise and it is not
slower beyond that noise; among those, the fastest wins. Everything else keeps 1 chunk.
"""

from __future__ import annotations

import statistics as st
from collections import defaultdict
from collections.abc import Iterable


def _rel_spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / st.mean(xs) if len(xs) > 1 and st.mean(xs) > 0 else 0.0


def choose_chunks(measurements: Iterable[dict], noise_floor: float = 0.03) -> dict[int, dict]:
    """Per row count: the chosen chunk count and why.

    Args:
        measurements: dicts with ``rows``, ``chunks``, ``ms`` (time per call) and ``j`` (energy per
            call, J); several dicts per (rows, chunks) are repeats.
        noise_floor: minimum relative noise assumed (NVML's counter quantisation at ~1 s windows).

    Returns:
        ``{rows: {"chunks": c, "noise": n, "time_ratio": t, "energy_ratio": e}}`` (ratios vs c=1).
    """
    groups: dict[int, dict[int, tuple[list[float], list[float]]]] = defaultdict(dict)
    for m in measurements:
        ms, js = groups[int(m["rows"])].setdefault(int(m["chunks"]), ([], []))
        ms.append(float(m["ms"]))
        js.append(float(m["j"]))
    out: dict[int, dict] = {}
    for rows, by_c in sorted(groups.items()):
        if 1 not in by_c:
            continue
        t1, e1 = st.mean(by_c[1][0]), st.mean(by_c[1][1])
        noise = max([noise_floor] + [max(_rel_spread(t), _rel_spread(j)) for t, j in by_c.values()])
        means = {c: (st.mean(ts), st.mean(js)) for c, (ts, js) in by_c.items()}
        good = [c for c, (t, e) in means.items() if c != 1 and e < e1 * (1 - noise) and t <= t1 * (1 + noise)]
        best = min(good, key=lambda c: means[c][0]) if good else 1
        out[rows] = {"chunks": best, "noise": noise, "time_ratio": st.mean(by_c[best][0]) / t1, "energy_ratio": st.mean(by_c[best][1]) / e1}
    return out


def to_table(choice: dict[int, dict]) -> list[dict[str, int]]:
    """Compress per-row-count choices into settings rules (``min_rows`` → ``chunks``)."""
    table: list[dict[str, int]] = []
    current = 1
    for rows in sorted(choice):
        c = choice[rows]["chunks"]
        if c != current:
            table.append({"min_rows": rows, "chunks": c})
            current = c
    return table
