"""How late the NVML energy counter's periods are against the work the step trace shows.

    python -m benchmarks.counter_lag OUT/servers-gpu0-*.tar.gz [--server defaults0]

The account books each counter step's jump over the ~100 ms period it closes, ending at the time
the meter placed the step (docs/request-energy.md). If the counter's value covers the GPU's energy
only up to some time before the step is seen (a firmware's sampling and publishing delay; A100 and
H100 sample power part of the time only, arXiv 2312.02741), the period's joules belong to an
earlier window, and work near a period's end is booked to the next period's requests.

For each stretch of serving in the trace (steps closer than 2 s), this fits each counter period's
joules to the work in a window of the same length shifted back by a lag: the steps' overlap there
(s), their prefill tokens and decode rows (each step's spread evenly over its span), by least
squares, and prints R² and the error per lag from -30 to +100 ms. The lag with the best fit is how
late the periods are, as far as the steps' host-side times show it. It reads the files only.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .burst_trace import trace_lines
from .lib.cli import one_line_errors

#: Lags tried (ms): a period is compared with the work in [start - lag, end - lag].
LAGS_MS = tuple(range(-30, 101, 5))
#: Steps further apart than this start a new stretch of serving (s).
STRETCH_GAP_S = 2.0
#: Stretches with fewer counter periods than this are not fitted.
MIN_PERIODS = 30
#: Lags whose R² is within this of the best are ties; the one nearest 0 ms is reported, so a fit
#: that no lag improves reads 0 ms, not the first lag tried.
R2_TIE = 0.001


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step as the trace has it: host-side start and end, and its work."""

    t0_s: float
    t1_s: float
    prefill: int
    decode: int


@dataclass(frozen=True, slots=True)
class Period:
    """One counter period: the span the meter booked it over and the joules it read."""

    t0_s: float
    t1_s: float
    energy_j: float


class Stretch(NamedTuple):
    """A span of serving: steps closer than ``STRETCH_GAP_S`` (s)."""

    t0_s: float
    t1_s: float


class WindowWork(NamedTuple):
    """The work within a window: seconds of steps, prefill tokens and decode rows (a fit's row)."""

    busy_s: float
    prefill_tokens: float
    decode_rows: float


@dataclass(frozen=True, slots=True)
class LagFit:
    """The fit of the periods' joules to the work in windows shifted back by ``lag_ms``."""

    lag_ms: int
    r2: float
    rmse_j: float


def steps_and_periods(lines: list[dict]) -> tuple[list[Step], list[Period]]:
    """The trace's steps (those with an end time) and its counter periods."""
    steps = sorted(
        (Step(x["t"], x["t_end"], x.get("prefill") or 0, x.get("decode") or 0) for x in lines if "phase" in x and x.get("t_end")),
        key=lambda s: s.t0_s,
    )
    seen: dict[float, Period] = {}
    for t in (x["tick"] for x in lines if "tick" in x):
        for c in t.get("counter_steps") or ():
            if c.get("span_t0_s") is not None and c.get("span_j") is not None:  # a step without its span says nothing here
                seen[round(c["t_s"], 6)] = Period(c["span_t0_s"], c["t_s"], c["span_j"])
    return steps, sorted(seen.values(), key=lambda p: p.t1_s)


def typical(periods: list[Period]) -> list[Period]:
    """The periods of the typical length among ``periods`` (within 5 %): taken per span, since the
    H100's counter steps every 0.1 s under work but every 0.2-0.3 s at idle (the 2026-12-07 trace of
    docs/results/h200-request-energy.md), so a whole run's median can miss serving's periods."""
    if not periods:
        return []
    typical_s = statistics.median(p.t1_s - p.t0_s for p in periods)
    return [p for p in periods if abs((p.t1_s - p.t0_s) - typical_s) <= 0.05 * typical_s]


def stretches(steps: list[Step]) -> list[Stretch]:
    """The spans of serving: runs of steps closer than ``STRETCH_GAP_S``."""
    out: list[Stretch] = []
    for s in steps:
        if out and s.t0_s - out[-1].t1_s <= STRETCH_GAP_S:
            out[-1] = Stretch(out[-1].t0_s, max(out[-1].t1_s, s.t1_s))
        else:
            out.append(Stretch(s.t0_s, s.t1_s))
    return out


def work_in(steps: list[Step], starts: list[float], a: float, b: float) -> WindowWork:
    """Seconds of steps, prefill tokens and decode rows within [a, b], each step's spread over its span."""
    i = max(0, bisect.bisect_left(starts, a) - 1)
    busy_s = prefill = decode = 0.0
    while i < len(steps) and steps[i].t0_s < b:
        s = steps[i]
        overlap_s = max(0.0, min(s.t1_s, b) - max(s.t0_s, a))
        share = overlap_s / max(s.t1_s - s.t0_s, 1e-6)
        busy_s, prefill, decode = busy_s + overlap_s, prefill + s.prefill * share, decode + s.decode * share
        i += 1
    return WindowWork(busy_s, prefill, decode)


def fit_lags(steps: list[Step], periods: list[Period]) -> list[LagFit]:
    """R² and RMSE of the least-squares fit of each period's joules to its shifted window's work;
    none where the periods' joules do not vary (nothing to explain)."""
    import numpy as np

    starts = [s.t0_s for s in steps]
    y = np.array([p.energy_j for p in periods])
    if len(y) < 2 or float(y.var()) <= 1e-12:
        return []
    out = []
    for lag_ms in LAGS_MS:
        shift_s = lag_ms / 1000.0
        x = np.array([work_in(steps, starts, p.t0_s - shift_s, p.t1_s - shift_s) for p in periods])
        x1 = np.c_[np.ones(len(x)), x]
        coef, *_ = np.linalg.lstsq(x1, y, rcond=None)
        resid = y - x1 @ coef
        out.append(LagFit(lag_ms, 1.0 - float(resid.var()) / float(y.var()), float(np.sqrt((resid**2).mean()))))
    return out


def best_fit(fits: list[LagFit]) -> LagFit:
    """The best-fitting lag; among lags within ``R2_TIE`` of it, the one nearest 0 ms."""
    top = max(f.r2 for f in fits)
    return min((f for f in fits if f.r2 >= top - R2_TIE), key=lambda f: abs(f.lag_ms))


class Trace(NamedTuple):
    """A step trace read once: its steps, its counter periods and its tick records."""

    steps: list[Step]
    periods: list[Period]
    ticks: list[dict]


def read_trace(lines: list[dict]) -> Trace:
    steps, periods = steps_and_periods(lines)
    return Trace(steps, periods, [x["tick"] for x in lines if "tick" in x])


@dataclass(frozen=True, slots=True)
class SpanLag:
    """The lag fits over the counter periods of one span: the best lag, beside the fit at 0 ms."""

    periods: int
    fits: tuple[LagFit, ...]

    @property
    def best(self) -> LagFit:
        return best_fit(list(self.fits))

    @property
    def at_0(self) -> LagFit:
        return next(f for f in self.fits if f.lag_ms == 0)

    def as_dict(self) -> dict[str, object]:
        return {
            "periods": self.periods,
            "best_lag_ms": self.best.lag_ms,
            "r2_best": round(self.best.r2, 3),
            "r2_at_0": round(self.at_0.r2, 3),
            "r2_by_lag_ms": {str(f.lag_ms): round(f.r2, 3) for f in self.fits},
        }


def span_lag(trace: Trace, t0_s: float, t1_s: float) -> SpanLag | None:
    """The fits over the periods within [t0_s, t1_s]; None where they are fewer than
    ``MIN_PERIODS`` or their joules do not vary."""
    inside = typical([p for p in trace.periods if t0_s <= p.t0_s and p.t1_s <= t1_s])
    fits = fit_lags(trace.steps, inside) if len(inside) >= MIN_PERIODS else []
    return SpanLag(len(inside), tuple(fits)) if fits else None


def segment_lag(trace: Trace, request_ids: set[str]) -> SpanLag | None:
    """The fits over the span of the ticks that gave ``request_ids`` joules or made them final."""
    mine = [t for t in trace.ticks if request_ids & (set(t.get("request_j") or ()) | set(t.get("finished") or ()))]
    if not mine or not trace.steps:
        return None
    return span_lag(trace, min(t["t0_s"] for t in mine), max(t["t1_s"] for t in mine))


def report(lines: list[dict]) -> str:
    trace = read_trace(lines)
    if not trace.steps:
        raise ValueError("the trace has no step with an end time (t_end): nothing to fit")
    if not trace.periods:
        raise ValueError("the trace has no counter steps with their spans: nothing to fit")
    out = []
    for t0, t1 in stretches(trace.steps):
        lag = span_lag(trace, t0, t1)
        if lag is None:
            continue
        best, at0 = lag.best, lag.at_0
        out.append(
            f"stretch {t0:.1f}-{t1:.1f} s, {lag.periods} periods: best lag {best.lag_ms:+d} ms "
            f"(R² {best.r2:.3f}, RMSE {best.rmse_j:.2f} J) against 0 ms (R² {at0.r2:.3f}, RMSE {at0.rmse_j:.2f} J)"
        )
        out += [f"    lag {f.lag_ms:+4d} ms: R² {f.r2:.3f}  RMSE {f.rmse_j:5.2f} J" for f in lag.fits]
    if not out:
        raise ValueError(f"no stretch of serving in the trace holds {MIN_PERIODS} counter periods whose joules vary")
    return "\n".join(out)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a servers tarball of h200_defaults.py, or a trace-rank0.jsonl[.gz]")
    ap.add_argument("--server", help="the server's label in the tarball (default: the first with a trace)")
    ns = ap.parse_args(argv)
    print(report(trace_lines(Path(ns.trace), ns.server)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
