"""The traffic a configuration is measured under: Poisson arrivals, saturation, or a trace file.

* **Poisson** (``--rate R``): exponential gaps of mean 1/R s over the measurement window, each
  request's input and output length drawn independently and uniformly from integer ranges
  (``--input-len 128:1024 --output-len 32:512``; one number is a fixed length). The draw is seeded,
  so every configuration of a round, and both arms of a final pair, get the same requests.
* **Saturation** (``--concurrency C``): a closed loop of C streams, lengths drawn as above, for the
  window.
* **Trace** (``--trace FILE``): the requests of a file, replayed at their arrival times. JSON lines,
  one request each, ``{"arrival_s": 0.25, "input_len": 512, "output_len": 128}``, or CSV with the
  header ``arrival_s,input_len,output_len``. ``arrival_s`` is seconds from any origin (the first
  request is sent at once, the rest at their offsets; the file need not be sorted); lengths are
  tokens, integers >= 1. A window replays the requests arriving within its first ``window_s``
  seconds (at least one).

Every request is streamed (TTFT and TPOT need it). The file written for ``loadtests`` holds
random-word prompts of the drawn lengths (about one token per word, see ``loadtests.datasets``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loadtests.datasets import WORDS, jsonl_objects

TRACE_FIELDS = ("arrival_s", "input_len", "output_len")


class TrafficError(ValueError):
    """Traffic that cannot be sent; the message is one line naming the file, line, field and value."""


@dataclass(frozen=True)
class LengthRange:
    """Token lengths drawn uniformly from the integers ``lo..hi`` (inclusive)."""

    lo: int
    hi: int

    def describe(self) -> str:
        return f"{self.lo}" if self.lo == self.hi else f"uniform {self.lo}-{self.hi}"


def parse_length_range(text: str, flag: str) -> LengthRange:
    """``"128:1024"`` (uniform) or ``"256"`` (fixed); :class:`TrafficError` otherwise."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise TrafficError(f"{flag} = {text!r}: expected LO:HI or N, integer token lengths with 1 <= LO <= HI")
    return LengthRange(lo, hi)


@dataclass(frozen=True)
class TraceRow:
    """One request of the traffic: when it arrives (s from the first), its input and output tokens."""

    arrival_s: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Traffic:
    """What a measurement sends: ``poisson`` at ``rate_rps``, ``saturation`` at ``concurrency``, or a ``trace``."""

    kind: Literal["poisson", "saturation", "trace"]
    input_len: LengthRange = LengthRange(128, 128)
    output_len: LengthRange = LengthRange(128, 128)
    rate_rps: float | None = None
    concurrency: int | None = None
    trace: tuple[TraceRow, ...] = ()
    trace_path: str | None = None

    def longest_request_tokens(self) -> int:
        """The most tokens one request may need (prompt + output): the trace's largest, or the
        length ranges' upper ends."""
        if self.kind == "trace" and self.trace:
            return max(r.input_len + r.output_len for r in self.trace)
        return self.input_len.hi + self.output_len.hi

    def describe(self) -> str:
        lengths = f"input {self.input_len.describe()} tokens, output {self.output_len.describe()} tokens (independent draws)"
        if self.kind == "poisson":
            return f"Poisson arrivals at {self.rate_rps:g} req/s, {lengths}, streamed"
        if self.kind == "saturation":
            return f"saturation: {self.concurrency} concurrent streams (closed loop), {lengths}"
        span = self.trace[-1].arrival_s if self.trace else 0.0
        return f"trace {self.trace_path}: {len(self.trace)} requests over {span:g} s, streamed"

    def identity(self) -> dict[str, Any]:
        """What makes two searches the same traffic (the state file's header)."""
        return {
            "kind": self.kind,
            "rate_rps": self.rate_rps,
            "concurrency": self.concurrency,
            "input_len": [self.input_len.lo, self.input_len.hi],
            "output_len": [self.output_len.lo, self.output_len.hi],
            "trace_rows": len(self.trace),
            "trace_path": self.trace_path,
            "trace_sha256": trace_digest(self.trace) if self.kind == "trace" else None,
        }

    def rows(self, window_s: float, seed: int) -> list[TraceRow]:
        """The open-loop requests of one window (Poisson, trace); [] for saturation."""
        if self.kind == "trace":
            within = [r for r in self.trace if r.arrival_s < window_s]
            return within or list(self.trace[:1])
        if self.kind == "poisson":
            return poisson_rows(float(self.rate_rps or 1.0), window_s, self.input_len, self.output_len, seed)
        return []


def trace_digest(rows: tuple[TraceRow, ...]) -> str:
    """A digest of a trace's requests: a rerun against an edited trace file is another search."""
    import hashlib

    return hashlib.sha256(json.dumps([[r.arrival_s, r.input_len, r.output_len] for r in rows]).encode()).hexdigest()[:16]


def poisson_rows(rate_rps: float, window_s: float, input_len: LengthRange, output_len: LengthRange, seed: int) -> list[TraceRow]:
    """Poisson arrivals at ``rate_rps`` over ``window_s`` (at least one request), seeded lengths."""
    rng = random.Random(seed)
    rows, t = [], 0.0
    while t < window_s or not rows:
        rows.append(TraceRow(round(t, 6), rng.randint(input_len.lo, input_len.hi), rng.randint(output_len.lo, output_len.hi)))
        t += rng.expovariate(rate_rps)
    return rows


def closed_loop_lengths(n: int, input_len: LengthRange, output_len: LengthRange, seed: int) -> list[tuple[int, int]]:
    """``n`` seeded ``(input, output)`` lengths for a saturation window."""
    rng = random.Random(seed)
    return [(rng.randint(input_len.lo, input_len.hi), rng.randint(output_len.lo, output_len.hi)) for _ in range(n)]


def prompt_of(n_tokens: int, rng: random.Random) -> str:
    """A random-word prompt of about ``n_tokens`` tokens."""
    return " ".join(rng.choice(WORDS) for _ in range(n_tokens))


def _row(obj: dict[str, Any], where: str) -> TraceRow:
    for name in TRACE_FIELDS:
        if name not in obj:
            raise TrafficError(f"{where}: field {name!r} is missing (need {', '.join(TRACE_FIELDS)})")
    t = obj["arrival_s"]
    if isinstance(t, str):
        try:
            t = float(t)
        except ValueError:
            pass
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise TrafficError(f"{where}: field 'arrival_s' = {obj['arrival_s']!r}: must be a number of seconds >= 0")
    lens = []
    for name in ("input_len", "output_len"):
        v = obj[name]
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TrafficError(f"{where}: field {name!r} = {obj[name]!r}: must be an integer number of tokens >= 1")
        lens.append(v)
    return TraceRow(float(t), lens[0], lens[1])


def parse_trace(path: str | Path) -> tuple[TraceRow, ...]:
    """The requests of a trace file (JSON lines or CSV, see the module docstring), sorted by arrival
    and shifted so the first arrives at 0; :class:`TrafficError` (one line) for anything else."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark (spreadsheet CSV export) is not a field
    except (OSError, UnicodeDecodeError) as e:
        raise TrafficError(f"--trace {p}: cannot read: {type(e).__name__}: {' '.join(str(e).split())}") from None
    rows: list[TraceRow] = []
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if not first:
        raise TrafficError(f"--trace {p}: no requests in the file")
    if first.lstrip().startswith("{"):
        for i, obj in jsonl_objects(text, f"--trace {p}", TrafficError):
            rows.append(_row(obj, f"--trace {p}: line {i}"))
    else:
        reader = csv.DictReader(io.StringIO(text))
        if [h.strip() for h in reader.fieldnames or []] != list(TRACE_FIELDS):
            raise TrafficError(f"--trace {p}: line 1: header = {first.strip()[:80]!r}: expected {','.join(TRACE_FIELDS)} (or JSON lines)")
        for i, rec in enumerate(reader, start=2):
            if None in rec:  # DictReader files the fields past the header's under None
                raise TrafficError(f"--trace {p}: line {i}: {len(TRACE_FIELDS) + len(rec[None])} fields, expected {len(TRACE_FIELDS)}")
            rows.append(_row({k.strip(): (v or "").strip() for k, v in rec.items() if k}, f"--trace {p}: line {i}"))
    if not rows:
        raise TrafficError(f"--trace {p}: no requests in the file")
    rows.sort(key=lambda r: r.arrival_s)
    t0 = rows[0].arrival_s
    return tuple(TraceRow(r.arrival_s - t0, r.input_len, r.output_len) for r in rows)


def write_loadtests_trace(rows: list[TraceRow], path: Path, seed: int) -> Path:
    """``rows`` as a ``loadtests`` trace (``timestamp``, ``prompt``, ``output_len`` per line)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"timestamp": r.arrival_s, "prompt": prompt_of(r.input_len, rng), "output_len": r.output_len}) for r in rows)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_loadtests_dataset(lengths: list[tuple[int, int]], path: Path, seed: int) -> Path:
    """Closed-loop requests as a ``loadtests`` JSONL dataset (``prompt``, ``output_len`` per line)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps({"prompt": prompt_of(i, rng), "output_len": o}) for i, o in lengths) + "\n")
    return path
