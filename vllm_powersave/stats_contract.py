"""What workers write into ``stats_dir`` and what the API server, the CLI and tests read back.

One module for the on-disk contract between the writer (``runtime/publisher.py``, or the Ray relay
that writes for workers on other nodes) and every reader (``metrics.py``, ``request_energy.py``,
``cli.py``):

* file names: :func:`snapshot_name` (``rank<N>.json``), :func:`requests_name`
  (``requests-rank<N>.jsonl``), :func:`trace_name` (``trace-rank<N>.jsonl``) and their globs;
* :class:`WorkerSnapshot`: the per-rank JSON object, rewritten atomically every publish;
* :class:`RequestLine`: one line per finished request (per-request energy);
* :class:`TraceLine`: one line per engine step (``trace_steps``).

The JSON keys are the field names. Adding a field is one line in the class (and its writer);
readers of older files see the field missing and use their default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, TypedDict

# -- file names ------------------------------------------------------------------------------
SNAPSHOT_GLOB = "rank*.json"
REQUESTS_GLOB = "requests-rank*.jsonl"
TRACE_GLOB = "trace-rank*.jsonl"


def snapshot_name(rank: int) -> str:
    return f"rank{int(rank)}.json"


def requests_name(rank: int) -> str:
    return f"requests-rank{int(rank)}.jsonl"


def trace_name(rank: int) -> str:
    return f"trace-rank{int(rank)}.jsonl"


# -- worker snapshot (rank<N>.json) ----------------------------------------------------------
class Window(TypedDict, total=False):
    """The sliding tokens-per-joule window (``energy.window_s``), computed in the worker."""

    window_s: float
    seconds: float
    energy_j: float
    prefill_tokens: int
    decode_tokens: int


class Steady(TypedDict, total=False):
    """Steps at the batch limit (ML.ENERGY's steady state, ``energy/account.py``)."""

    batch: int | None
    energy_j: float
    seconds: float
    tokens: dict[str, int]


class CudaBoost(TypedDict, total=False):
    """``cuda_perf_boost: auto``: the side CUDA context's state (``clocks/boost.py``)."""

    held: bool
    switches: int
    last_switch_ms: float | None
    disabled: str | None


class WorkerSnapshot(TypedDict, total=False):
    """One rank's ``rank<N>.json``. Every key is optional to a reader: an unavailable meter leaves
    its figures out (never frozen), and older or foreign files may lack newer keys."""

    # identity
    pid: int
    rank: int
    engine: int  # data-parallel engine
    gpu: str  # NVML UUID, "cudaN-rankR" or "simN"
    t: float  # wall-clock time of the write (s)
    source: str  # "measured", "simulated" or "none"
    clock_backend: str
    # energy (energy_snapshot(); the figures only while energy_available)
    energy_method: str  # "energy-counter", "power-sampling", "model"
    energy_available: bool
    energy_unavailable_reason: str | None
    counter_resets: int
    counter_wraps: int
    counter_period_s: float  # the counter's step period as learnt (0 for meters without steps)
    counter_phase_losses: int  # reads that contradicted the learnt phase (energy/meters.py)
    meter_faults: int
    # the counter over the integral of instant power, last completed window (energy/crosscheck.py)
    energy_crosscheck_ratio: float
    energy_crosscheck_window_s: float
    energy_j: dict[str, float]  # by phase
    time_s: dict[str, float]  # by phase
    steps: dict[str, int]  # by phase
    tokens: dict[str, int]  # prefill / decode
    requests_finished: int
    request_energy_j_finished: float
    request_energy_j_in_flight: float
    request_energy_j_tail: float  # non-idle energy charged to no request (docs/request-energy.md)
    request_energy_j_pending: float  # the open gap after the last step, not yet settled
    window: Window
    steady: Steady
    # gauges (re-read at most every energy.gauge_period_s) and the meter's extras
    power_w: float | None
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None
    temperature_c: float | None
    clock_event_reasons: int | None
    # memory, clocks, LM head
    cuda_peak_allocated_bytes: int | None
    cuda_peak_scope: str | None
    target_sm_clock_mhz: int | None
    clock_changes: int
    clock_disabled: str | None
    lm_head_calls: dict[str, int]  # chunk count -> calls
    lm_head_rows: int
    # simulator (labelled simulated wherever shown)
    sim_energy_j: float | None
    sim_stock_clocks_energy_j: float | None
    sim_busy_s: float | None
    sim_stock_clocks_busy_s: float | None
    # process settings and transport
    cuda_perf_boost: str  # "on", "off", "auto"
    cuda_boost: CudaBoost | None
    transport: str
    # savings on, off or failed and why (savings.py); clocks.mode's controller (clocks/mode.py)
    clock_mode: str
    closed_loop: dict[str, Any] | None  # clocks/closed_loop.py DecodeClockTuner.snapshot()
    decode_pacing: dict[str, Any] | None  # pacing/pacer.py DecodePacer.snapshot(), where it runs in this process
    savings: dict[str, dict[str, str]]
    # front-end starvation (starvation.py); absent where no API server's busy file is readable
    idle_while_busy_j: float
    idle_while_busy_s: float
    frontend_busy_s: float
    frontends: int
    ray_node_id: str | None


#: Keys whose values are counters or non-negative gauges (the metrics reader's sanity check).
NONNEG_KEYS: tuple[str, ...] = (
    "counter_resets",
    "counter_wraps",
    "counter_period_s",
    "counter_phase_losses",
    "meter_faults",
    "power_w",
    "sm_clock_mhz",
    "target_sm_clock_mhz",
    "clock_changes",
    "mem_clock_mhz",
    "clock_event_reasons",
    "requests_finished",
    "request_energy_j_finished",
    "idle_while_busy_j",
    "idle_while_busy_s",
    "frontend_busy_s",
    "request_energy_j_tail",
    "energy_crosscheck_ratio",
)
#: Keys whose values are ``{label: count or J}`` dicts of counters.
COUNTER_DICT_KEYS: tuple[str, ...] = ("energy_j", "time_s", "steps", "tokens", "lm_head_calls")


def snapshot_to_json(snap: WorkerSnapshot) -> str:
    return json.dumps(snap)


def snapshot_from_json(text: str | bytes) -> WorkerSnapshot:
    """The parsed snapshot. Raises ValueError for text that is not JSON; a JSON value that is not
    an object is returned as parsed (the reader's check names it)."""
    return json.loads(text)


# -- per-request energy (requests-rank<N>.jsonl) ----------------------------------------------
@dataclass(frozen=True)
class RequestLine:
    """Energy of one finished request on one rank (``None``: the meter was unavailable)."""

    request_id: str
    energy_j: float | None
    source: str
    method: str
    gpu: str
    rank: int

    def to_json(self) -> str:
        """One line, newline included; ``energy_j`` rounded to the µJ."""
        d = asdict(self)
        if self.energy_j is not None:
            d["energy_j"] = round(self.energy_j, 6)
        return json.dumps(d) + "\n"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestLine:
        """From a parsed line. Raises KeyError without ``request_id``, ValueError/TypeError for a bad ``rank``."""
        return cls(
            str(d["request_id"]),
            d.get("energy_j"),
            str(d.get("source", "?")),
            str(d.get("method", "?")),
            str(d.get("gpu", "?")),
            int(d.get("rank", 0)),
        )


# -- step trace (trace-rank<N>.jsonl) ---------------------------------------------------------
class TraceLine(NamedTuple):
    """One engine step: start and end (s, monotonic), phase, tokens, LM-head rows, decode context
    tokens, requests and the SM clock target (MHz; ``None``: driver default or not decided)."""

    t: float
    phase: str
    prefill: int
    decode: int
    rows: int
    ctx: int
    reqs: int
    sm_target: int | None
    t_end: float | None

    def to_json(self) -> str:
        return trace_line(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TraceLine:
        return cls(*(d.get(k) for k in TRACE_KEYS))


TRACE_KEYS: tuple[str, ...] = TraceLine._fields
_TRACE_TYPES = (float, str, int, int, int, int, int)
_TRACE_PHASES = frozenset(("prefill", "decode", "mixed", "idle"))
_INF = float("inf")


def trace_line(r: Any) -> str:
    """``json.dumps(dict(zip(TRACE_KEYS, r))) + "\\n"`` for one trace record (any sequence in
    :data:`TRACE_KEYS` order), formatted directly where the fields have the types the step hook
    stores (finite floats, ints, a known phase), for which json.dumps writes float repr, int repr
    and null; anything else goes through json.dumps. One line per engine step, on the publisher
    thread (which holds the GIL)."""
    t, phase, pre, dec, rows, ctx, reqs, sm, t_end = r
    if (
        (type(t), type(phase), type(pre), type(dec), type(rows), type(ctx), type(reqs)) == _TRACE_TYPES
        and -_INF < t < _INF
        and phase in _TRACE_PHASES
        and (sm is None or type(sm) is int)
        and (t_end is None or type(t_end) is float and -_INF < t_end < _INF)
    ):
        return (
            f'{{"t": {t!r}, "phase": "{phase}", "prefill": {pre!r}, "decode": {dec!r}, "rows": {rows!r}, '
            f'"ctx": {ctx!r}, "reqs": {reqs!r}, "sm_target": {"null" if sm is None else repr(sm)}, '
            f'"t_end": {"null" if t_end is None else repr(t_end)}}}\n'
        )
    return json.dumps(dict(zip(TRACE_KEYS, r))) + "\n"


#: Key of a closed-loop decision line in the step trace (beside the per-step lines).
CLOSED_LOOP_KEY = "closed_loop"


BOOST_KEY = "boost"
TICK_KEY = "tick"


def tick_line(tick: Any) -> str:
    """One energy tick (``energy.account.TickRecord``) as a trace line ``{"tick": {...}}``: its span
    (s, the steps' clock), the meter's joules, step / gap / idle seconds, idle joules and the ids
    of the requests it made final (their lines in ``requests-rank<N>.jsonl``), and the joules of
    counter steps it booked back over the periods they close (``booked_back_j``); the instant and
    learnt rest power (W) and the counter steps its reads saw (``counter_steps``: each step's time,
    jump and the span it closes, docs/request-energy.md), so that a trace shows where a burst's
    joules went; and what each request in flight gained in it (``request_j``: id -> J), so that a
    trace shows which ticks made a request's figure; and how long after the tick began its read's
    value was taken (``read_lag_s``; ``t1_s`` is that time)."""
    d = tick._asdict()
    for k in ("t0_s", "t1_s", "energy_j", "busy_s", "gap_s", "idle_s", "idle_j", "booked_back_j", "read_lag_s"):
        d[k] = round(d[k], 6)
    for k in ("power_w", "rest_power_w"):
        d[k] = None if d.get(k) is None else round(d[k], 1)
    d["counter_steps"] = [{f: v if v is None else round(v, 6) for f, v in c._asdict().items()} for c in d.get("counter_steps") or ()]
    d["request_j"] = {str(rid): round(j, 4) for rid, j in d.get("request_j") or ()}
    return json.dumps({TICK_KEY: d}) + "\n"


def boost_line(switch: Any) -> str:
    """One finished perf-boost hold or release (``clocks.boost.BoostSwitch``) as a trace line
    ``{"boost": {"t_s", "held", "ms"}}``; ``t_s`` is on the step lines' clock."""
    return json.dumps({BOOST_KEY: switch._asdict()}) + "\n"


def closed_loop_line(record: Any, step_time_source: str | None = None) -> str:
    """One closed-loop decision record (``clocks.closed_loop.ClosedLoopRecord``) as a trace line
    ``{"closed_loop": {...}}``: the decision and the step measurement behind it, with where its
    step times came from (``cuda_events``, ``simulated`` or ``engine_wall``: device/step_timer.py)."""
    d = record.as_dict()
    if step_time_source is not None:
        d["step_time_source"] = step_time_source
    return json.dumps({CLOSED_LOOP_KEY: d}) + "\n"
