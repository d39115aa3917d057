"""Choosing the chunk table from measurements (used by ``vllm-powersave tune`` and the benchmarks).

Seed 004 (Schultheis et al., OpenReview QSv1lTk06x) leaves chunk-size selection open; seed 000
(Spaan et al., arXiv 2601.08539) warns that searches over noisy measurements select outliers. The
rule is therefore conservative. Per row count, against unchunked (1 chunk):

* a chunk count is admissible if its mean energy is not above unchunked (not worse in energy) and
  it is not slower beyond the measured noise;
* it counts only if it gains more than the noise, in time or in energy;
* among those, the fastest wins; with none, 1 chunk.

The noise is the largest relative spread ``(max - min) / mean`` of any candidate's repeats at that
row count, at least ``noise_floor``. Only ``statistics`` is imported (runs on a bare GPU machine).
"""

from __future__ import annotations

import statistics as st
from collections import defaultdict
from collections.abc import Iterable


def _rel_spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / st.mean(xs) if len(xs) > 1 and st.mean(xs) > 0 else 0.0


def choose_chunks(measurements: Iterable[dict], noise_floor: float = 0.03) -> dict[int, dict]:
    """Per row count: the chosen chunk count, why, and every candidate's statistics.

    Args:
        measurements: dicts with ``rows``, ``chunks``, ``ms`` (time per call, ms) and ``j`` (energy
            per call, J); several dicts per (rows, chunks) are repeats.
        noise_floor: minimum relative noise assumed (fraction).

    Returns:
        ``{rows: {"chunks": c, "noise": n, "time_ratio": t, "energy_ratio": e, "gain": g,
        "candidates": {c: {"ms", "ms_min", "ms_max", "j", "j_min", "j_max", "n"}}}}``; ratios are
        the chosen count's mean vs 1 chunk. Row counts without a 1-chunk measurement are skipped.
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

        def gain(c: int) -> float:
            return max(1 - means[c][0] / t1, 1 - means[c][1] / e1)

        good = [c for c, (t, e) in means.items() if c != 1 and e <= e1 and t <= t1 * (1 + noise) and gain(c) > noise]
        best = min(good, key=lambda c: (means[c][0], c)) if good else 1
        cands = {
            c: {"ms": means[c][0], "ms_min": min(ts), "ms_max": max(ts), "j": means[c][1], "j_min": min(js), "j_max": max(js), "n": len(ts)}
            for c, (ts, js) in sorted(by_c.items())
        }
        out[rows] = {
            "chunks": best,
            "noise": noise,
            "time_ratio": means[best][0] / t1,
            "energy_ratio": means[best][1] / e1,
            "gain": gain(best) if best != 1 else 0.0,
            "candidates": cands,
        }
    return out


def combine_modes(choices: Iterable[dict[int, dict]]) -> dict[int, dict]:
    """Merge per-mode choices (e.g. logits-only and prompt-logprob measurements) row by row.

    The chunk policy is keyed on rows only, so where several modes measured the same row count the
    smallest chosen chunk count wins (a gain in one mode must not cost another).
    """
    out: dict[int, dict] = {}
    for choice in choices:
        for rows, c in choice.items():
            if rows not in out or c["chunks"] < out[rows]["chunks"]:
                out[rows] = c
    return dict(sorted(out.items()))


def to_table(choice: dict[int, dict]) -> list[dict[str, int]]:
    """Compress per-row-count choices into settings rules (``min_rows`` -> ``chunks``).

    Each measured row count starts a bucket that extends up to the next measured one.
    """
    table: list[dict[str, int]] = []
    current = 1
    for rows in sorted(choice):
        c = choice[rows]["chunks"]
        if c != current:
            table.append({"min_rows": rows, "chunks": c})
            current = c
    return table
