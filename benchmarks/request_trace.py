"""Which ticks made a request's energy figure, from a server's step trace and its request lines.

    python -m benchmarks.request_trace OUT/servers-gpu0-*.tar.gz OUT/defaults-gpu0-*.json --segment 1

For one request-energy segment of ``benchmarks/h200_defaults.py`` (``--segment``: its index among the
server's ``reqenergy_runs``), this prints: the steady requests (the middle 60 % by when the tick that
made them final ended) over their median; that spread by where each request finished within the
counter's period (reads in step with the counter show as a slope across the bins, docs/
request-energy.md, placing a step); and for the ``--top`` lowest and highest requests each tick
that gave them joules: its span, joules, what the request gained there, and the counter steps its
reads saw; and how late the ticks' counter reads came (``read_lag_s``). The per-tick gains need
tick lines with ``request_j`` (written since the account reports them); without them the ticks are
not listed. It reads the files only.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from .burst_trace import trace_lines
from .lib.cli import one_line_errors

#: Width of a bin of the finish time within the counter's period (s).
BIN_S = 0.02


@dataclass(frozen=True, slots=True)
class Finished:
    """A steady request: its figure over the segment's median, and when its figure was made final."""

    request_id: str
    ratio: float
    t_s: float


def segment_lines(raw: dict, segment: int) -> dict[str, float]:
    """``request id -> J`` of one request-energy segment of an h200_defaults raw file."""
    servers = raw.get("servers") or []
    if not servers:
        raise ValueError("the run file has no server: pass the defaults-*.json of an h200_defaults run")
    runs = servers[0].get("reqenergy_runs") or []
    if not 0 <= segment < len(runs):
        raise ValueError(f"--segment {segment}: the file has {len(runs)} request-energy segment(s)")
    return {x["request_id"]: x["energy_j"] for x in runs[segment]["lines"] if x.get("energy_j") is not None}


def steady(energy_j: dict[str, float], ticks: list[dict], drop: float = 0.2) -> list[Finished]:
    """The middle of the segment's requests by finish time, each over their median."""
    final = {rid: t["t1_s"] for t in ticks for rid in t.get("finished") or ()}
    rows = sorted((final[r], r) for r in energy_j if r in final)
    mid = rows[int(len(rows) * drop) : int(len(rows) * (1 - drop))]
    if not mid:
        raise ValueError("no request of the segment is made final by a tick of this trace")
    med = statistics.median(energy_j[r] for _, r in mid)
    return [Finished(r, energy_j[r] / med, t) for t, r in mid]


def by_period_phase(rows: list[Finished], step_times: list[float]) -> list[str]:
    """One line per ``BIN_S`` of time since the counter's last step before each finish."""
    bins: dict[int, list[float]] = {}
    for f in rows:
        k = bisect.bisect_right(step_times, f.t_s) - 1
        if k >= 0:
            bins.setdefault(min(int((f.t_s - step_times[k]) / BIN_S), 5), []).append(f.ratio)
    out = []
    for b, v in sorted(bins.items()):
        v.sort()
        top = f"{b * BIN_S * 1000:.0f}+ ms" if b == 5 else f"{b * BIN_S * 1000:.0f}-{(b + 1) * BIN_S * 1000:.0f} ms"
        out.append(f"  {top:>9} after a step: n {len(v):3d}  min {v[0]:.3f}  median {statistics.median(v):.3f}  max {v[-1]:.3f}")
    return out


def read_lags(rows: list[Finished], ticks: list[dict]) -> list[str]:
    """How late the ticks' counter reads came over the steady requests' span (``read_lag_s``,
    written since a tick ends at its read: docs/request-energy.md); none for older traces."""
    t0, t1 = min(f.t_s for f in rows), max(f.t_s for f in rows)
    lags = sorted(1000.0 * t["read_lag_s"] for t in ticks if "read_lag_s" in t and t0 <= t["t1_s"] <= t1)
    if not lags:
        return []
    n = len(lags)
    return [
        f"counter reads after their tick began ({n} ticks): p50 {lags[n // 2]:.1f} ms  p95 {lags[max(0, int(0.95 * n) - 1)]:.1f} ms  max {lags[-1]:.1f} ms"
    ]


def request_ticks(request_id: str, ticks: list[dict]) -> list[str]:
    """The ticks that gave ``request_id`` joules, with the counter steps their reads saw."""
    out = []
    for t in ticks:
        gain = (t.get("request_j") or {}).get(request_id)
        if gain is None:
            continue
        steps = ", ".join(f"{c['t_s']:.3f} {c['jump_j']:+.1f} J" for c in t.get("counter_steps") or ())
        out.append(
            f"    tick {t['t0_s']:.3f}-{t['t1_s']:.3f}  E {t['energy_j']:6.1f} J  busy {t['busy_s']:.3f} s  "
            f"gain {gain:+.3f} J  back {t.get('booked_back_j', 0.0):+.1f} J" + (f"  steps {steps}" if steps else "")
        )
    return out


def report(lines: list[dict], energy_j: dict[str, float], top: int) -> str:
    ticks = [x["tick"] for x in lines if "tick" in x]
    rows = steady(energy_j, ticks)
    ratios = sorted(f.ratio for f in rows)
    n = len(ratios)
    out = [
        f"{n} steady requests over their median: p5 {ratios[int(0.05 * n)]:.3f}  p95 {ratios[max(0, int(0.95 * n) - 1)]:.3f}  "
        f"min {ratios[0]:.3f}  max {ratios[-1]:.3f}",
        "by the time since the counter's last step when the request was made final:",
        *by_period_phase(rows, sorted(c["t_s"] for t in ticks for c in t.get("counter_steps") or ())),
        *read_lags(rows, ticks),
    ]
    has_gains = any(t.get("request_j") for t in ticks)
    ranked = sorted(rows, key=lambda f: f.ratio)
    for f in ranked[:top] + ranked[-top:]:
        out.append(f"  {f.request_id}: {f.ratio:.3f} of the median, final at {f.t_s:.3f} s")
        out += request_ticks(f.request_id, ticks) if has_gains else []
    if not has_gains:
        out.append("(the trace's tick lines carry no request_j: per-tick gains not shown)")
    return "\n".join(out)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a servers tarball of h200_defaults.py, or a trace-rank0.jsonl[.gz]")
    ap.add_argument("raw", type=Path, help="the defaults-*.json of the same run")
    ap.add_argument("--segment", type=int, required=True, help="index of the request-energy segment (0 first)")
    ap.add_argument("--server", help="the server's label in the tarball (default: the first with a trace)")
    ap.add_argument("--top", type=int, default=3, help="lowest and highest requests shown tick by tick")
    a = ap.parse_args(argv)
    lines = trace_lines(a.trace, a.server)  # the trace first: its path is the first argument
    energy_j = segment_lines(json.loads(a.raw.read_text()), a.segment)
    print(report(lines, energy_j, a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
