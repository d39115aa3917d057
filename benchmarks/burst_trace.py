"""Where each prefill burst's joules went, from a server's step trace: its steps, the energy ticks
around it and the counter steps those ticks' reads saw.

    python -m benchmarks.burst_trace OUT/servers-gpu0-*.tar.gz [--server defaults0] [--min-prefill 1000] \
        [--raw OUT/defaults-gpu0-*.json]

The bursts segment of ``benchmarks/h200_defaults.py`` judges each burst's booking against the
counter (docs/request-energy.md, short bursts); where one misses, this prints what the account saw:
per burst, the step lines (phase, prefill tokens, host start and end), then each tick from just
before the burst to ``--after-s`` past its last step (joules, step / gap / idle seconds, joules
booked as idle and back over earlier periods, requests made final, instant and rest power) with the
counter steps its reads saw. Tick lines before the counter-step fields existed print without them.
With ``--raw`` (the run's JSON) each burst of the segment's size is headed with its pair's figures
(phase booking over the truth, both in J), matched in order. It reads files only; nothing is written.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from .h200_defaults import judge_bursts
from .lib.cli import one_line_errors

TRACE_SUFFIX = "-trace-rank0.jsonl.gz"


@dataclass
class Burst:
    """Consecutive prefill steps of at least ``--min-prefill`` tokens less than ``gap_s`` apart."""

    steps: list[dict] = field(default_factory=list)

    @property
    def t0_s(self) -> float:
        return self.steps[0]["t"]

    @property
    def t1_s(self) -> float:
        return max(s.get("t_end") or s["t"] for s in self.steps)


def trace_lines(path: Path, server: str | None) -> list[dict]:
    """The step-trace lines of ``server`` (the first in the tarball where None) from a servers
    tarball of h200_defaults.py, or from a ``trace-rank0.jsonl[.gz]`` file itself."""
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return [json.loads(x) for x in raw.splitlines() if x.strip()]
    with tarfile.open(path) as tar:
        names = [n for n in tar.getnames() if n.endswith(TRACE_SUFFIX) and (server is None or Path(n).name == f"{server}{TRACE_SUFFIX}")]
        if not names:
            raise ValueError(f"no step trace{f' of server {server!r}' if server else ''} in {path}")
        member = tar.extractfile(names[0])
        if member is None:
            raise ValueError(f"{names[0]} in {path} is not a file")
        with gzip.open(io.BytesIO(member.read())) as f:
            return [json.loads(x) for x in f.read().splitlines() if x.strip()]


def find_bursts(lines: list[dict], min_prefill: int, gap_s: float = 1.0) -> list[Burst]:
    """The bursts among the step lines (those with a phase), in order."""
    out: list[Burst] = []
    for s in (x for x in lines if "phase" in x and (x.get("prefill") or 0) >= min_prefill):
        if not out or s["t"] - out[-1].t1_s > gap_s:
            out.append(Burst())
        out[-1].steps.append(s)
    return out


def tick_row(t: dict) -> str:
    """One tick as a line (its counter steps on the lines after it)."""
    row = (
        f"  tick {t['t0_s']:.3f}-{t['t1_s']:.3f}  E {t['energy_j']:7.1f} J  busy {t['busy_s']:.3f}  gap {t['gap_s']:.3f}  "
        f"idle {t['idle_s']:.3f} s  idle {t['idle_j']:6.1f} J  back {t.get('booked_back_j', 0.0):6.1f} J  final {len(t['finished'])}"
    )
    if t.get("power_w") is not None or t.get("rest_power_w") is not None:
        row += f"  power {t.get('power_w')} W  rest {t.get('rest_power_w')} W"
    steps = [
        f"    counter step at {c['t_s']:.3f}: jump {c['jump_j']:+.1f} J"
        + (f", {c['span_j']:.1f} J since {c['span_t0_s']:.3f}" if c.get("span_j") is not None and c.get("span_t0_s") is not None else "")
        for c in t.get("counter_steps") or []
    ]
    return "\n".join([row, *steps])


@dataclass(frozen=True)
class PairFigures:
    """The bursts segment of a run's JSON: each pair's judged figures in order, and the prefill
    tokens of one burst (``conc`` x ``input_len``)."""

    pairs: list[dict]
    tokens: int

    @classmethod
    def load(cls, path: Path, server: str | None) -> PairFigures:
        raw = json.loads(path.read_text())
        found = [s for s in raw.get("servers", []) if s.get("bursts") and (server is None or s.get("label") == server)]
        if not found:
            raise ValueError(f"--raw {path}: no bursts segment{f' of server {server!r}' if server else ''}")
        b = found[0]["bursts"]
        runs = [x for x in b["runs"] if "burst" in x and "null" in x]
        return cls(judge_bursts(runs, b.get("idle_w")), int(b["conc"]) * int(b["input_len"]))

    def line(self, k: int) -> str:
        """The ``k``-th pair's figures, for its burst's header."""
        if k >= len(self.pairs):
            return "; no pair in --raw"
        p = self.pairs[k]
        if p.get("phase_over_truth") is None:
            return f"; pair {k}: not judged ({p.get('note') or (p.get('cut') or {}).get('note')})"
        return f"; pair {k}: phase / truth {p['phase_over_truth']:.3f} ({p['plugin_phase_j']:.1f} J / {p['true_phase_j']:.1f} J)"


def report(lines: list[dict], min_prefill: int, after_s: float, figures: PairFigures | None = None) -> str:
    """Each burst's steps and the ticks from the one before it to ``after_s`` past its end, with
    its pair's ``figures`` where given (the bursts within 10 % of their size, in order)."""
    ticks = [x["tick"] for x in lines if "tick" in x]
    out, k = [], 0
    for i, b in enumerate(find_bursts(lines, min_prefill)):
        tokens = sum(s.get("prefill") or 0 for s in b.steps)
        head = ""
        if figures is not None and abs(tokens - figures.tokens) <= 0.1 * figures.tokens:
            head, k = figures.line(k), k + 1
        out.append(f"burst {i}: {len(b.steps)} step(s), {tokens} prefill tokens, host {b.t0_s:.3f}-{b.t1_s:.3f} s{head}")
        out += [
            f"  step {s['phase']} {s.get('prefill')} tokens, {s.get('reqs')} request(s), {s['t']:.3f}-{s.get('t_end') or s['t']:.3f}"
            for s in b.steps
        ]
        before = [t for t in ticks if t["t1_s"] <= b.t0_s][-1:]
        out += [tick_row(t) for t in before + [t for t in ticks if t["t1_s"] > b.t0_s and t["t0_s"] < b.t1_s + after_s]]
    return "\n".join(out) if out else f"no prefill step of at least {min_prefill} tokens in the trace"


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a servers tarball of h200_defaults.py, or a trace-rank0.jsonl[.gz]")
    ap.add_argument("--server", help="the server's label in the tarball (default: the first with a trace)")
    ap.add_argument("--min-prefill", type=int, default=1000, help="prefill tokens that make a step a burst's")
    ap.add_argument("--after-s", type=float, default=1.0, help="ticks shown past a burst's last step (s)")
    ap.add_argument("--raw", type=Path, help="the run's JSON (defaults-gpu*.json): each burst's pair figures in its header")
    a = ap.parse_args(argv)
    figures = PairFigures.load(a.raw, a.server) if a.raw is not None else None
    print(report(trace_lines(a.trace, a.server), a.min_prefill, a.after_s, figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
