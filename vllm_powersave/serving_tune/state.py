"""The resumable state: one JSON line per finished step, appended and flushed to disk at once.

Line 1 is the header (``{"kind": "header", "search": {...}}``): what makes a rerun the same
search (model, serve arguments, traffic, SLO, configurations, windows, seed). A rerun with the same
``--out`` reads the file, reuses every finished measurement and continues where it stopped; a rerun
of a different search is refused with one line naming the first field that differs. Each later line
is a :class:`Measurement` (``"kind": "measurement"``) or a :class:`Rejection` (vLLM refused a
configuration). A last line cut short by an interruption is ignored with one warning; nothing else
is ever lost: each line is written with ``fsync`` before the next step starts.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATE_NAME = "state.jsonl"


class StateError(ValueError):
    """A state file that belongs to another search or cannot be read; one line."""


@dataclass(frozen=True)
class Figures:
    """One measured window. Energy figures carry ``energy_source``: ``measured`` (NVML) or
    ``simulated`` (the plugin's simulated H200, on a machine without a GPU)."""

    output_tokens_per_joule: float | None
    energy_source: str | None
    gpu_energy_j: float | None
    output_throughput: float | None
    p99_ttft_ms: float | None
    p99_tpot_ms: float | None
    p99_itl_ms: float | None
    good: int  # requests that attained the SLO
    sent: int
    completed: int
    failed: int
    duration_s: float | None
    #: Why the window has no energy figure (the harness's note), when it has none.
    energy_note: str | None = None


@dataclass(frozen=True)
class Measurement:
    """One finished step: a search window (``phase`` search, ``round``) or a final-pair window
    (``phase`` final, ``pair``, ``arm`` winner|defaults) of configuration ``key``."""

    step: str  # the step's id, unique in a search
    phase: str
    key: str
    window_s: float
    seed: int
    figures: Figures
    wall_s: float  # this step's wall time, server start included
    restarted: bool  # whether the step started a server
    started_utc: str
    round: int | None = None
    pair: int | None = None
    arm: str | None = None
    runs: int = 1  # windows measured for it: 2 where the first came back without an energy figure

    def to_json(self) -> dict[str, Any]:
        return {"kind": "measurement", **asdict(self)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Measurement:
        d = {k: v for k, v in obj.items() if k != "kind"}
        return cls(**{**d, "figures": Figures(**d["figures"])})


@dataclass(frozen=True)
class Rejection:
    """A configuration vLLM refused to start with (``reason``: one line of its log)."""

    key: str
    reason: str
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "rejection", **asdict(self)}


class StateFile:
    """The state of one search in ``path``: what it holds, and appending to it."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self.measurements: dict[str, Measurement] = {}
        self.rejections: dict[str, Rejection] = {}
        self._lock: Any = None

    def lock(self) -> None:
        """Hold ``state.lock`` next to the state until :meth:`unlock`: a second run on the same
        ``--out`` is refused (it would interleave lines and stop the first run's server)."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path.with_name("state.lock"), "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise StateError(
                f"{self.path.parent}: another tune-serving is running with this --out: wait for it, or use another --out"
            ) from None
        self._lock = f

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def open(self) -> int:
        """Read what an earlier run left (refusing another search's file), or start the file; the
        number of finished steps found."""
        if not self.path.exists() or not self.path.read_text(encoding="utf-8").strip():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"kind": "header", "search": self.header})
            return 0
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        try:
            first = json.loads(lines[0])
        except json.JSONDecodeError:
            if len(lines) == 1 and not text.endswith("\n"):  # the header's own write was cut short: nothing was measured
                self.path.write_text("", encoding="utf-8")
                return self.open()
            raise StateError(f"{self.path}: line 1 is not a tune-serving header: use another --out") from None
        if not isinstance(first, dict) or first.get("kind") != "header":
            raise StateError(f"{self.path}: line 1 is not a tune-serving header: use another --out")
        self._check_same_search(first.get("search") or {})
        for i, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines):  # the write an interruption cut short
                    print(f"warning: {self.path}: line {i} is incomplete (interrupted write): ignored", file=sys.stderr)
                    self._truncate_last(lines[: i - 1])
                    break
                raise StateError(f"{self.path}: line {i} is not JSON: the file was edited; use another --out") from None
            self._read_record(i, obj)
        else:
            if not text.endswith("\n"):  # a whole last line whose newline was cut: the next line must not join it
                self._append_raw("\n")
        return len(self.measurements) + len(self.rejections)

    def _read_record(self, i: int, obj: Any) -> None:
        """Line ``i`` of the state, parsed: a measurement or a rejection (other kinds are skipped)."""
        try:
            if obj.get("kind") == "measurement":
                m = Measurement.from_json(obj)
                self.measurements[m.step] = m
            elif obj.get("kind") == "rejection":
                self.rejections[obj["key"]] = Rejection(obj["key"], obj["reason"], obj.get("wall_s", 0.0))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise StateError(
                f"{self.path}: line {i} is not a tune-serving record ({type(exc).__name__}): the file was edited; use another --out"
            ) from None

    def _check_same_search(self, old: dict[str, Any]) -> None:
        for k in sorted(set(old) | set(self.header)):
            was, now = old.get(k), self.header.get(k)
            if was != now:
                if isinstance(was, dict) and isinstance(now, dict):  # name the sub-field, e.g. 'traffic.trace_sha256'
                    sub = next(j for j in sorted(set(was) | set(now)) if was.get(j) != now.get(j))
                    k, was, now = f"{k}.{sub}", was.get(sub), now.get(sub)
                raise StateError(
                    f"{self.path} holds another search: {k!r} = {json.dumps(was)[:120]} there, "
                    f"{json.dumps(now)[:120]} now: rerun with the same arguments, or use another --out"
                )

    def _truncate_last(self, kept: list[str]) -> None:
        self.path.write_text("\n".join(kept) + "\n", encoding="utf-8")

    def _append(self, obj: dict[str, Any]) -> None:
        self._append_raw(json.dumps(obj) + "\n")

    def _append_raw(self, text: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def add(self, item: Measurement | Rejection) -> None:
        """Record a finished step (on disk before this returns)."""
        self._append(item.to_json())
        if isinstance(item, Measurement):
            self.measurements[item.step] = item
        else:
            self.rejections[item.key] = item

    def spent_s(self) -> float:
        """Wall time of the steps already recorded (counted against the budget on a resume)."""
        return sum(m.wall_s for m in self.measurements.values()) + sum(r.wall_s for r in self.rejections.values())
