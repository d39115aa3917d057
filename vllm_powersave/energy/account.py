"""Attribution of a meter's energy to engine phases (prefill, decode, mixed, idle).

The step hook runs on vLLM's critical path, and one NVML query costs from tens of microseconds to
milliseconds (measured on the H200 test machine: two queries per step made vLLM 3-4x slower at
small batches). So the hook only timestamps steps; a background ``tick()`` (every ~0.1-0.25 s)
reads the meter once and splits the energy of the interval since the previous tick over phases.

Method (per tick interval ``[t_prev, t_now]``, ``t_now`` when the meter's value was taken, which
under load is milliseconds after the tick began: :meth:`PhaseEnergyAccount._read_time`): each step
owns the time from its start to its end (busy); the gap from its end to the next step's start is
quiet time in the step's phase, except that a gap longer than ``idle_after_s`` is idle; intervals
with no step at all are idle. Under vLLM's async scheduling on a GPU (``gpu_runs_ahead``) the GPU
runs a step in the gap after its host end, so a gap the next step follows is busy time of the step,
and so is the open gap after the step launched last. The interval's
energy is split over these pieces: quiet time (idle and gaps) is priced at the idle power the
counter showed over recent intervals of idle only (a moving average; never more than the interval's
energy), and the steps share the rest in proportion to their time. (Gaps only where the meter's GPU
draws power between steps, ``EnergyMeter.powered_between_steps``: the simulated GPU prices steps by
their modelled work, and the host's gaps cost it nothing.) Before any idle-only interval,
everything is split by time. This costs the edges of a busy period (the first step after idle, the
time after the last step) from the counter instead of smearing idle power over the steps beside
them. Phase totals always sum to the meter's total; idle energy is kept as its own phase, never
dropped or subtracted. Resolution is the tick period, which is finer than NVML's 100 ms counter
update anyway, so the split is meaningful over many ticks, not for a single step.

Per-request energy (opt-in, ``per_request=True``; docs/request-energy.md): each step's energy is
split over the requests scheduled in it by what each costs in it (:mod:`.request_cost`: the
weights' bytes shared equally, its own FLOPs and KV bytes at the GPU's roofline ceilings), or by
scheduled tokens where no cost model or request contexts are given. The gap after a step goes to
that step's requests if the next step follows within ``idle_after_s`` (a host gap while serving);
while the gap is open its energy is *pending*; if the batch drains (vLLM's empty step) or idle is
detected, it goes to the *tail*, which belongs to no request (so does a step without request
ids). A request's energy is the sum over every step it took part in; idle energy belongs to no
request. At any moment ``sum(requests, finished and in flight) + idle + tail + pending == total``
up to rounding.

A meter that becomes unavailable (an NVML fault, see :mod:`.meters`) stops the attribution for good:
``available`` turns False, the cumulative figures freeze and must not be published as current, and
requests finishing afterwards are reported with ``None`` joules rather than a partial figure.

Tokens per joule over a sliding window (:meth:`window`): the account keeps one
``(t, joules, prefill tokens, decode tokens)`` sample per tick for ``window_s`` seconds; the window
is the oldest kept sample to now. Idle energy is in it: it is what the server spent.

Steady state (:meth:`on_step`'s ``steady``): the ML.ENERGY benchmark measures J/token in the window
that opens once ``max_num_seqs`` requests have their first token and closes when the batch starts
to drain (Chung et al., "The ML.ENERGY Benchmark", arXiv:2505.06371). Server-side this is "the
running batch is at its limit": the step hook flags steps with ``num_reqs >= max_num_seqs``, and
their time share of each tick's energy, their time and their tokens are summed in ``steady_*``.

Idle while busy (``busy``, optional): a function ``(t0, t1) -> seconds of [t0, t1] during which
the server had requests in flight`` (``starvation.FrontendBusyReader.overlap``). Every stretch
booked as idle is asked, and that part of the idle share of the tick's energy is also summed in
``idle_busy_j`` / ``idle_busy_s`` (a subset of idle, not a phase of its own: phases still sum to
the total); ``busy_s`` sums the busy time of every tick (the denominator of the share).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..settings import PHASES
from .meters import CounterStep, EnergyMeter, LoadHint
from .request_cost import RequestCostModel, step_weights

#: An interval of idle only this long or longer updates the idle power estimate (s).
_IDLE_POWER_MIN_S = 0.02
#: Weight of the newest idle interval in the idle power's moving average.
_IDLE_POWER_EMA = 0.3
#: Rest holds kept for the counter to settle (:class:`_RestHold`); a burst leaves one or two.
_REST_HOLDS_MAX = 8
#: Seconds after work that the meter's extension prices at the learnt rest power: inside the
#: 1.5-2.1 s the H100 held ~121 W after any request (docs/results/h200-request-energy.md), and
#: past the counter period and a late tick that can hold the work's last sliver.
REST_PRICE_S = 0.5
#: A meter's read returning later than this after the tick began, or an event stamped this far
#: after the read, is on another clock (a test's), not late: the tick's own time stands (s).
_READ_LAG_MAX_S = 1.0
#: Before a rest power is learnt, the instant reading prices the rest after the drain only where
#: the tick came this long after it (s): the reading lags the falling power by tens of ms
#: (docs/results/h200-energy-meter.md), so this late it reads near the rest power, and sooner it
#: still reads near the work's and would take the steps' joules.
_SETTLED_READ_S = 0.1


class TickRecord(NamedTuple):
    """One tick's attribution: its span (s, the steps' clock), the meter's joules over it, how the
    span split into step time, gaps after steps and idle, the joules booked as idle, and the
    requests whose figure the tick made final."""

    t0_s: float
    t1_s: float
    energy_j: float
    busy_s: float
    gap_s: float
    idle_s: float
    idle_j: float
    finished: list
    #: Joules of counter steps seen in this tick that went back to the periods they close (in
    #: ``energy_j``, not priced in this tick): see :meth:`PhaseEnergyAccount._book_back`.
    booked_back_j: float = 0.0
    #: The instant power read with the tick's energy read, and the rest power learnt so far (W):
    #: with ``counter_steps`` they let a step trace say where a burst's joules went.
    power_w: float | None = None
    rest_power_w: float | None = None
    #: The counter steps this tick's reads saw (``energy.meters.CounterStep``, oldest first).
    counter_steps: tuple = ()
    #: ``(request id, joules)`` each request in flight gained in this tick (its steps' pricing and
    #: the counter steps booked back over its periods; negative where a jump took some back): a
    #: request's figure is the sum over the ticks, so a trace shows which ticks made an outlier.
    request_j: tuple = ()
    #: How long after the tick began the meter's value was taken (s; ``t1_s`` is that time):
    #: :meth:`PhaseEnergyAccount._read_time`.
    read_lag_s: float = 0.0


class StepEvent(NamedTuple):
    """One event of the step hook's stream (appended per step, so a tuple): a step of
    ``phase`` starts at ``t_s``; ``phase`` ``None``: the current step's host work ended;
    ``phase`` ``""``: requests finished with no step (the batch drained)."""

    t_s: float
    phase: str | None
    req_tokens: dict | None
    finished: object
    steady: bool
    req_ctx: dict | None


class _Cursor(NamedTuple):
    """Where the attribution stands between ticks: the start of the time not yet attributed, the
    phase owning it, the end of the last step if it ended, that step's request tokens and
    contexts, whether it was steady, whether the batch drained after it, and which of that step's
    requests vLLM has not yet reported finished (``None``: the step named none)."""

    t_s: float
    phase: str
    end_t_s: float | None
    req_tokens: dict | None
    req_ctx: dict | None
    steady: bool
    drained: bool
    left: frozenset | None = None


class StepPiece(NamedTuple):
    """A step's own time (busy) inside a tick: ``seconds`` of ``phase``, with its requests."""

    seconds: float
    phase: str
    req_tokens: dict | None
    req_ctx: dict | None
    steady: bool


class StepRequests(NamedTuple):
    """A step's requests: scheduled tokens and computed context per request id."""

    req_tokens: dict | None
    req_ctx: dict | None


class GapPiece(NamedTuple):
    """The gap after a step's end inside a tick (quiet time in the step's phase); ``to``: whose
    joules they are, ``"req"`` (the step's requests), ``"tail"`` or ``"pending"`` (still open)."""

    seconds: float
    phase: str
    req_tokens: dict | None
    req_ctx: dict | None
    steady: bool
    to: str


@dataclass(frozen=True, slots=True)
class TickPieces:
    """A tick's interval cut into pieces (module docstring), what :meth:`PhaseEnergyAccount._price`
    splits the joules over. ``idle_busy_s``: of ``idle_s``, the seconds the API servers had
    requests in flight; ``resolved``: the requests of the step a gap left pending
    by an earlier tick turned out to belong to; ``tail_pending``: that gap turned out to be a
    tail; ``finished``: the requests reported finished; ``phase``: the phase owning the time at
    the tick's end."""

    busy: list[StepPiece]
    gaps: list[GapPiece]
    idle_s: float
    idle_busy_s: float
    busy_s: float
    quiet_s: float  # idle and gaps
    resolved: list[StepRequests]
    tail_pending: bool
    finished: list
    phase: str
    #: When the GPU had work: ``(start, end)`` of each busy piece and of each gap between two
    #: steps while serving (the steps' clock, s).
    busy_spans: tuple = ()
    #: The request tokens of the step that owns the time at the tick's end (it goes on in the
    #: next tick); ``None`` where the time is idle or the batch drained.
    open_req: dict | None = None


class _Rates(NamedTuple):
    """A tick's prices (W): of quiet time (idle), of the steps' own time and of the gaps after steps."""

    quiet_w: float
    busy_w: float
    gap_w: float


class _Booked(NamedTuple):
    """What a tick over ``[t0_s, t1_s]`` booked where (``_price``'s keys)."""

    t0_s: float
    t1_s: float
    book: dict
    busy_spans: tuple = ()


class _WindowSample(NamedTuple):
    """The account's cumulative joules and tokens at a tick, for :meth:`PhaseEnergyAccount.window`."""

    t_s: float
    energy_j: float
    prefill_tokens: int
    decode_tokens: int


class _PeriodStep(NamedTuple):
    """A counter step and the start of the counter period it closes (its jump is booked there);
    ``rest``: how the steps' part of it depends on the price of the rest after the work in it
    (:class:`_SpanSplit`, where the step is a span's)."""

    t0_s: float
    step: CounterStep
    rest: _SpanSplit | None = None


@dataclass(frozen=True, slots=True)
class _SpanSplit:
    """A span's counter joules ``d_j`` split at the previous read: quiet seconds ``q1_s`` /
    ``q2_s`` before / after it (of them ``r1_s`` / ``r2_s`` the GPU's rest after the work), the
    steps' seconds ``b1_s`` / ``b2_s``; ``end_s``: when the work ended (:meth:`PhaseEnergyAccount._span_step`)."""

    d_j: float
    idle_w: float
    q1_s: float
    q2_s: float
    r1_s: float
    r2_s: float
    b1_s: float
    b2_s: float
    end_s: float

    def part1_j(self, rest_w: float) -> float:
        """The joules of the part before the previous read, with the rest at ``rest_w``: quiet
        time at the idle power, rest at ``rest_w`` (both scaled down alike to at most ``d_j``), the
        steps the remainder by their time."""
        idle_w, r_s = self.idle_w, self.r1_s + self.r2_s
        quiet_j = idle_w * (self.q1_s + self.q2_s - r_s) + rest_w * r_s
        k = min(1.0, max(self.d_j, 0.0) / quiet_j) if quiet_j > 0 else 1.0
        part1_quiet_j = k * (idle_w * (self.q1_s - self.r1_s) + rest_w * self.r1_s)
        return part1_quiet_j + (self.d_j - k * quiet_j) / (self.b1_s + self.b2_s) * self.b1_s


@dataclass(frozen=True, slots=True)
class _RestExcess:
    """A single period's positive ``jump_j`` with ``rest_s`` seconds of the GPU's rest after the
    work that ended at ``end_s``: the rest's excess over ``idle_w`` is idle's, the remainder the
    steps' (:meth:`PhaseEnergyAccount._rest_excess`)."""

    jump_j: float
    idle_w: float
    rest_s: float
    end_s: float

    def rest_j(self, rest_w: float) -> float:
        return min(self.jump_j, max(0.0, rest_w - self.idle_w) * self.rest_s)


@dataclass(slots=True)
class _RestHold:
    """The steps' part of a counter step whose rest after the work was priced at ``rest_w`` (the
    instant reading, which lags the falling power: an upper bound, so the steps got at most
    theirs): ``held_j`` is what they hold, ``parts`` (of which ``booked_j`` in phases) the
    bookings of the period it was booked over. A later counter span of rest only measures the
    rest, and the steps get what the lower price leaves them (docs/request-energy.md, short
    bursts)."""

    split: _SpanSplit | _RestExcess
    rest_w: float
    held_j: float
    parts: dict
    booked_j: float


def _gains(before: dict | None, after: dict) -> tuple:
    """``(request id, joules)`` for each request in ``after`` whose figure moved since ``before``
    (``()`` where no snapshot was taken: no one reads the ticks)."""
    if before is None:
        return ()
    return tuple((rid, j - before.get(rid, 0.0)) for rid, j in after.items() if j != before.get(rid, 0.0))


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    """Seconds of ``[a, b]`` inside ``[lo, hi]``."""
    return max(0.0, min(b, hi) - max(a, lo))


def _moving_average(prev_w: float | None, w: float) -> float:
    """The idle and rest powers' moving average: ``w`` first, then ``_IDLE_POWER_EMA`` of each new reading."""
    return w if prev_w is None else prev_w + _IDLE_POWER_EMA * (w - prev_w)


def _add(book: dict, key: Any, joules: float) -> None:
    book[key] = book.get(key, 0.0) + joules


class _StepWeights:
    """A step's request weights (:func:`.request_cost.step_weights`), computed once per tick for
    the step's busy piece and its gap alike."""

    __slots__ = ("cost", "cache")

    def __init__(self, cost: RequestCostModel | None) -> None:
        self.cost = cost
        self.cache: dict[int, Any] = {}

    def __call__(self, req: dict | None, ctx: dict | None) -> Any:
        if not req:
            return None
        w = self.cache.get(id(req))
        if w is None:
            w = self.cache[id(req)] = step_weights(self.cost, req, ctx)
        return w


def _runs_on(gap: GapPiece, gpu_runs_ahead: bool) -> bool:
    """Whether ``gap`` is the open gap after the step launched last while the GPU runs ahead of
    the host (vLLM's async scheduling): the GPU still runs that step there, so it is priced as
    work. At the idle price, a tick that ended in it (a read returning milliseconds after the tick
    began lands there about a quarter of the time: host gaps of ~1.3 ms between ~3.5 ms host
    spans in the H100 step trace, docs/results/h200-request-energy.md) gave those milliseconds'
    energy to the other steps of the tick. Whose it is stays pending: the step's requests if
    another step follows, else the tail."""
    return gpu_runs_ahead and gap.to == "pending"


class StepWait(NamedTuple):
    """A step's wait in a tick (:class:`_HostWaits`): the share of its time there that was waiting,
    and its requests' cost-model weights (seconds)."""

    wait_share: float
    weights: dict


class _HostWaits:
    """A step's time beyond its work: the engine thread stalled while the GPU waited for it
    (docs/request-energy.md, "Host waits").

    A step's joules are its time's (host start to the next step's start) at the tick's price, split
    over its requests by their modelled work (:class:`.request_cost.RequestCostModel`). Where the
    engine thread stalls, the step's time grows while the GPU, done with the step, waits: on an H100
    the same 265-token prefill among 18 decodes took 9-24 ms of host time, and its request read
    0.99 of the median at 9-12 ms and 1.18 at 21-24 ms (256 in / 64 out, 16:11Z step trace,
    docs/results/h200-request-energy.md). The time beyond ``scale`` x the modelled step time is
    waiting, which every request of the step did alike: its joules are split equally. ``scale``
    is the median of complete steps' time over their modelled time (the device against the model's
    ceilings: 1.25 for the H100's decode steps there, ~1.03 for those prefills), trusted once
    :data:`MIN_STEPS` steps were seen. Only the split over requests changes: a step's joules, and
    so its phase's, stay its time's."""

    #: Complete steps seen before the scale is trusted, and the most kept.
    MIN_STEPS = 32
    MAX_STEPS = 256

    __slots__ = ("ratios", "open_req", "open_s")

    def __init__(self) -> None:
        self.ratios: deque[float] = deque(maxlen=self.MAX_STEPS)
        # The step still going on at the last tick's end, and its seconds up to then.
        self.open_req: dict | None = None
        self.open_s = 0.0

    def scale(self) -> float | None:
        if len(self.ratios) < self.MIN_STEPS:
            return None
        return statistics.median(self.ratios)

    def waits(self, pieces: TickPieces, weights: _StepWeights, runs_ahead: bool) -> dict[int, StepWait]:
        """``id(step's request tokens) -> StepWait`` for this tick's steps that waited; learns the
        scale from the complete ones. A step's time: its busy pieces and, under ``runs_ahead``,
        its open gap (the GPU runs the step there)."""
        steps: dict[int, list] = {}
        running = [g for g in pieces.gaps if _runs_on(g, runs_ahead)]
        for piece in (*pieces.busy, *running):
            if piece.req_tokens and piece.req_ctx is not None:
                entry = steps.setdefault(id(piece.req_tokens), [piece.req_tokens, piece.req_ctx, 0.0])
                entry[2] += piece.seconds
        k, out = self.scale(), {}
        open_req, open_s = None, 0.0
        for key, (req, ctx, seconds) in steps.items():
            w = weights(req, ctx)
            model_s = sum(w.values()) if w else 0.0
            prior_s = self.open_s if req is self.open_req else 0.0
            total_s = prior_s + seconds
            if req is pieces.open_req:
                open_req, open_s = req, total_s
            elif model_s > 0:
                self.ratios.append(total_s / model_s)
            if k is None or model_s <= 0 or seconds <= 0:
                continue
            work_s = k * model_s
            wait_s = max(0.0, total_s - work_s) - max(0.0, prior_s - work_s)
            if wait_s > 0:
                out[key] = StepWait(min(1.0, wait_s / seconds), w)
        self.open_req, self.open_s = open_req, open_s
        return out


class _IntervalWalk:
    """Cuts a tick's interval into :class:`TickPieces` by walking the step events from the
    account's cursor: each step owns the time from its start to its end (busy), the gap after its
    end goes to its requests (or, under ``gpu_runs_ahead``, is its own time), to the tail once the
    batch drained, or stays pending at the tick; a gap of ``idle_after_s`` or more is idle.
    ``pending``: the account holds joules of a gap left open by an earlier tick; ``fe_busy``: the
    API servers' in-flight seconds inside ``[a, b]`` (starvation.py)."""

    __slots__ = (
        "t", "phase", "end_t", "req", "ctx", "steady", "drained", "left",
        "idle_after_s", "gpu_runs_ahead", "pending", "fe_busy",
        "busy", "gaps", "idle_s", "idle_busy_s", "resolved", "tail_pending", "finished", "spans", "drain_gaps",
    )  # fmt: skip

    def __init__(
        self, start: _Cursor, idle_after_s: float, gpu_runs_ahead: bool, pending: bool, fe_busy: Callable[[float, float], float] | None
    ) -> None:
        self.t, self.phase, self.end_t, self.req, self.ctx, self.steady, self.drained, self.left = start
        self.idle_after_s, self.gpu_runs_ahead, self.pending, self.fe_busy = idle_after_s, gpu_runs_ahead, pending, fe_busy
        self.busy: list[StepPiece] = []
        self.gaps: list[GapPiece] = []
        self.idle_s = 0.0
        self.idle_busy_s = 0.0  # of idle_s, seconds the API servers had requests in flight
        self.resolved: list[StepRequests] = []  # pending gaps that went to their step
        self.tail_pending = False  # the pending gap turned out to be a tail
        self.finished: list = []
        self.spans: list[tuple[float, float]] = []  # TickPieces.busy_spans
        self.drain_gaps: list[tuple[float, float]] = []  # of spans, the gaps vLLM's drain closed

    def walk(self, events: deque[StepEvent], t_now: float) -> TickPieces:
        """Consume ``events`` up to ``t_now`` and close the interval there."""
        pop = events.popleft
        while events:
            if t_now < events[0].t_s < t_now + _READ_LAG_MAX_S:
                break  # the engine went on while the meter was read: the next tick's
            te, ev, ev_req, ev_fin, ev_steady, ev_ctx = pop()
            if not te >= self.t or te == math.inf:  # earlier than the cursor, or not a time
                te = self.t
            if ev is None:
                self.end_t = te
                if self.drained and self.left is not None and not self.left and self.phase != "idle":
                    self._to_rest(te)  # every request was reported before the step's end came
                continue
            if ev == "":  # finished ids only: no new step
                self.finished.extend(ev_fin)  # type: ignore[arg-type]
                if self.phase != "idle" and self._drains(ev_fin):
                    if self.end_t is None:
                        self.drained = True  # the work ends with the step's end, still to come
                    else:
                        self._to_rest(te)
                continue
            self._to_step(te, ev_fin)
            self.t, self.phase, self.end_t, self.req, self.ctx, self.steady, self.drained = te, ev, None, ev_req, ev_ctx, ev_steady, False
            self.left = frozenset(ev_req) if ev_req else None
            if ev_fin:
                self.finished.extend(ev_fin)  # type: ignore[arg-type]
        self._close(t_now)
        # The open gap after a step still running on the GPU is work (_price), not quiet time.
        running_s = sum(g.seconds for g in self.gaps if _runs_on(g, self.gpu_runs_ahead))
        busy_s = sum(b[0] for b in self.busy) + running_s
        quiet_s = self.idle_s + sum(g[0] for g in self.gaps) - running_s
        return TickPieces(
            self.busy,
            self.gaps,
            self.idle_s,
            self.idle_busy_s,
            busy_s,
            quiet_s,
            self.resolved,
            self.tail_pending,
            self.finished,
            self.phase,
            tuple(self.spans),
            self.req if self.phase != "idle" and not self.drained else None,
        )

    def cursor(self, t_now: float) -> _Cursor:
        """The account's cursor after the walk closed the interval at ``t_now``."""
        return _Cursor(t_now, self.phase, self.end_t, self.req, self.ctx, self.steady, self.drained, self.left)

    def _drains(self, ev_fin: object) -> bool:
        """Whether a step that schedules no work, reporting ``ev_fin`` finished, means the batch
        drained: every request of the last step is now reported finished. Under async scheduling
        the schedule after a prefill can find one request done and the rest waiting on the GPU
        (their token not yet back), and its empty step comes while the GPU still runs them: on the
        H100, bursts whose rest began there booked 0.33-0.78 of their energy
        (docs/results/h200-request-energy.md)."""
        if self.left is None:
            return True
        self.left = self.left - set(ev_fin)  # type: ignore[call-overload]
        return not self.left

    def _idle(self, a: float, b: float) -> None:
        if b > a:
            self.idle_s += b - a
            if self.fe_busy is not None:
                self.idle_busy_s += self.fe_busy(a, b)

    def _busy(self, seconds: float, end: float) -> None:
        self.spans.append((end - seconds, end))
        self.busy.append(StepPiece(seconds, self.phase, self.req, self.ctx, self.steady))

    def _to_rest(self, te: float) -> None:
        """vLLM reported the batch drained at ``te`` (its empty step): the work ended there. Under
        ``gpu_runs_ahead`` the gap from the last step's host end to ``te`` is that step's GPU
        time (work for the meter's hint); either way its joules are the tail's, no request's, as
        before. From ``te`` on the GPU rests: idle, however much it still draws (perf boost held, clocks falling back:
        docs/request-energy.md, "The gap after a step, and the tail")."""
        self.drained = True
        self.tail_pending = self.tail_pending or self.pending
        n = len(self.gaps)
        self._to_step(te, None)
        if self.gpu_runs_ahead and len(self.gaps) > n:  # the GPU worked there, up to some time before te
            self.spans.append((te - self.gaps[-1].seconds, te))
            self.drain_gaps.append(self.spans[-1])
        self.t, self.phase, self.end_t, self.req, self.ctx, self.steady, self.drained = te, "idle", None, None, None, False, False
        self.left = None

    def _to_step(self, te: float, ev_fin: object) -> None:
        """Cut the time from the cursor to the start of the next step at ``te``, which reports
        ``ev_fin`` finished."""
        t, end_t, req = self.t, self.end_t, self.req
        if self.phase == "idle":
            self._idle(t, te)
        elif end_t is None:
            if te > t:
                self._busy(te - t, te)
        else:
            g0 = end_t if end_t > t else t
            if g0 > t:
                self._busy(g0 - t, g0)
            if te - end_t >= self.idle_after_s:
                self._idle(g0, te)
                self.tail_pending = self.tail_pending or self.pending
                return
            left = self.left
            if not self.drained and left is not None and not left - set(ev_fin or ()):  # type: ignore[call-overload]
                # Every request of the step before the gap has finished (vLLM reports them with
                # the next step, some perhaps with an empty step before): the gap is no one's.
                self.drained = True
            to = "tail" if self.drained else "req"
            if te > g0:
                if to == "req" and self.gpu_runs_ahead:
                    self._busy(te - g0, te)
                else:
                    self.gaps.append(GapPiece(te - g0, self.phase, req, self.ctx, self.steady, to))
                    if to == "req":  # a host gap between steps while serving: the GPU's load goes on
                        self.spans.append((g0, te))
            if self.pending and not self.resolved and not self.tail_pending:
                if self.drained:
                    self.tail_pending = True
                else:
                    self.resolved.append(StepRequests(req, self.ctx))

    def _close(self, t_now: float) -> None:
        """Cut the time from the cursor to the tick at ``t_now``."""
        t, end_t = self.t, self.end_t
        if self.phase == "idle":
            self._idle(t, t_now)
        elif end_t is None:
            if t_now > t:
                self._busy(t_now - t, t_now)
        else:
            g0 = end_t if end_t > t else t
            if g0 > t:
                self._busy(g0 - t, g0)
            if t_now - end_t >= self.idle_after_s:
                self._idle(g0, t_now)  # time after a long-finished step is idle from here on
                self.tail_pending = self.tail_pending or self.pending
                self.phase, self.end_t, self.req, self.ctx, self.steady, self.drained = "idle", None, None, None, False, False
                self.left = None
            elif t_now > g0:
                gap = GapPiece(t_now - g0, self.phase, self.req, self.ctx, self.steady, "tail" if self.drained else "pending")
                self.gaps.append(gap)
                if _runs_on(gap, self.gpu_runs_ahead):  # the GPU may still run the step launched last
                    self.spans.append((g0, t_now))


class PhaseEnergyAccount:
    """Cumulative joules, steps, seconds and tokens per phase for one GPU.

    Args:
        meter: the GPU's meter (read only from :meth:`tick`).
        idle_after_s: seconds without a step after which time counts as idle.
        clock: monotonic seconds (tests inject one).
        feed: called at the start of each :meth:`tick`, before the lock, to deliver pending step
            events (the worker runtime batches the step hook's records, ``runtime/drain.py``
            ``StepDrain.drain_steps``), and again after a read that returned later (its steps).
        cost: the model whose request costs split a step's energy (per-request energy; without it,
            or for a step without request contexts, the split is by scheduled tokens).
        on_tick: called with a :class:`TickRecord` after each attributed tick, on the ticking
            thread (the step trace keeps them, so that a request's figure can be lined up with the
            counter readings behind it).
    """

    def __init__(
        self,
        meter: EnergyMeter,
        idle_after_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        per_request: bool = False,
        on_request_done: Callable[[str, float | None], None] | None = None,
        on_tick: Callable[[TickRecord], None] | None = None,
        window_s: float = 60.0,
        feed: Callable[[], None] | None = None,
        busy: Callable[[float, float], float] | None = None,
        cost: RequestCostModel | None = None,
        gpu_runs_ahead: bool = False,
    ) -> None:
        self.meter = meter
        #: vLLM's async scheduling on a GPU: the engine thread returns from a step once it is
        #: launched and prepares the next while the GPU runs it, so the gap between a step's host
        #: end and the next step is that step's GPU time, not idle. On the H200 (7B decode) the host
        #: span was 2.7 ms of a 5.05 ms period, and the GPU-timed step 4.6-5.1 ms
        #: (docs/results/h200-step-timer.md): a gap the next step follows is then priced as the
        #: step's own time. Edges (the open gap after the last step, idle) keep the idle price.
        self.gpu_runs_ahead = gpu_runs_ahead
        self.busy = busy
        self.idle_busy_j = self.idle_busy_s = self.busy_s = 0.0
        self.feed = feed
        self.idle_after_s = idle_after_s
        self.clock = clock
        self.energy_j: dict[str, float] = {p: 0.0 for p in PHASES}
        self.time_s: dict[str, float] = {p: 0.0 for p in PHASES}
        self.steps: dict[str, int] = {p: 0 for p in PHASES}
        self.tokens: dict[str, int] = {"prefill": 0, "decode": 0}
        self._events: deque[StepEvent] = deque()  # appended by the hot path only
        self.steady_j = 0.0
        self.steady_s = 0.0
        self.steady_tokens: dict[str, int] = {"prefill": 0, "decode": 0}
        self.window_s = window_s
        self._window: deque[_WindowSample] = deque()
        self.available = True
        self._unknown: set[str] = set()  # requests in flight while the meter is unavailable
        self.per_request = per_request
        self.on_request_done = on_request_done
        self.on_tick = on_tick
        self.request_j: dict[str, float] = {}  # in flight
        self.finished_request_j = 0.0
        self.finished_requests = 0
        self.cost = cost
        self._host_waits = _HostWaits()  # a step's time beyond its work, split equally
        #: Energy of non-idle time charged to no request (module docstring: the tail).
        self.tail_j = 0.0
        #: Energy of the gap after the last step while it is open: to its step's requests if the
        #: next step follows within idle_after_s, else to the tail.
        self._pending_j = 0.0
        #: The counter's power (W) over intervals of idle only (moving average); until the first,
        #: what the meter knows (the simulated GPU's), else None (intervals then split by time).
        self.idle_power_w: float | None = meter.idle_power_w() if hasattr(meter, "idle_power_w") else None
        #: The counter's power (W) over spans of rest only right after work (the perf boost held,
        #: clocks falling back: ~127 W against 73 W idle on the H100, docs/results/
        #: h200-request-energy.md), as measured by :meth:`_settle_rest` (moving average); None
        #: until the first, then the idle power stands in.
        self.rest_power_w: float | None = None
        # The last LoadHint's end of work and rest price (None: the meter extends at the idle price).
        self._last_work_end_s: float | None = None
        self._hint_rest_w: float | None = None
        self._t = clock()
        self._state = _Cursor(self._t, "idle", None, None, None, False, False)
        e0 = meter.energy_j()
        self._e = e0 if e0 is not None else 0.0
        if e0 is None:
            self.available = False
        self._window.append(_WindowSample(self._t, 0.0, 0, 0))
        #: What recent ticks booked where, kept one counter period back so that a counter step's
        #: jump can be booked over the period it closes.
        self._recent: deque[_Booked] = deque()
        #: When the counter last stepped: a step closes the time since then, at most a period.
        self._last_step_t = -math.inf
        #: Steps whose rest after the work waits for the counter to measure it (_settle_rest).
        self._holds: deque[_RestHold] = deque(maxlen=_REST_HOLDS_MAX)
        #: Of the kept ticks' busy spans, the gaps vLLM's drain closed (_hint_load); pruned with them.
        self._drain_gaps: list[tuple[float, float]] = []
        self._lock = threading.Lock()  # serialises tick() callers, never taken by the hot path

    # -- hot path (no meter access, no lock) ---------------------------------------------------
    def on_step(
        self,
        phase: str,
        prefill_tokens: int = 0,
        decode_tokens: int = 0,
        req_tokens: dict[str, int] | None = None,
        finished: object = None,
        steady: bool = False,
        t: float | None = None,
        req_ctx: dict[str, int] | None = None,
    ) -> None:
        """A step of ``phase`` starts at ``t`` (the ``clock``'s seconds; now if ``None``).

        ``req_tokens``: scheduled tokens per request id (kept by reference, not copied);
        ``finished``: ids of requests that finished before this step (their energy is final);
        ``steady``: the running batch is at its limit (steady state, see the module docstring);
        ``req_ctx``: tokens each request had computed before this step (its KV context), for the
        cost model (:mod:`.request_cost`); kept by reference.
        Events must arrive in time order, and before the :meth:`tick` that passes their time
        (a later one is clamped to that tick's start).
        """
        if t is None:
            t = self.clock()
        # The request ids (references) tell the walk when a batch drained, with or without
        # per-request energy: without them, a short burst kept its GPU's rest up to idle_after_s
        # after the work (a 0.1 s burst booked up to 1.46x, simulated: tests/test_energy_bursts_h200.py).
        self._events.append(StepEvent(t, phase, req_tokens, finished, steady, req_ctx if self.per_request else None))
        self.steps[phase] += 1
        tokens = self.tokens
        tokens["prefill"] += prefill_tokens
        tokens["decode"] += decode_tokens
        if steady:
            tokens = self.steady_tokens
            tokens["prefill"] += prefill_tokens
            tokens["decode"] += decode_tokens

    def on_finished(self, finished: object, t: float | None = None) -> None:
        """Requests reported finished by a step that schedules no work (vLLM sends one as a batch
        drains), at ``t`` (now if ``None``): the walk's drain signal, with or without per-request
        energy."""
        if finished:
            self._events.append(StepEvent(self.clock() if t is None else t, "", None, finished, False, None))

    def on_step_end(self, t: float | None = None) -> None:
        """The current step's host work ended at ``t`` (now if ``None``; its GPU work may still run)."""
        self._events.append(StepEvent(self.clock() if t is None else t, None, None, None, False, None))

    # -- background ----------------------------------------------------------------------------
    def tick(self) -> None:
        """Read the meter once and attribute the energy since the previous tick to phases and
        requests, up to when the meter's value was taken (:meth:`_read_time`)."""
        if self.feed is not None:
            self.feed()
        with self._lock:
            t_call = self.clock()
            # What the meter is told before its read: the steps so far, walked on a copy (the
            # events stay for the walk up to the read's time).
            ahead = _IntervalWalk(self._state, self.idle_after_s, self.gpu_runs_ahead, self._pending_j > 0, None)
            ahead_idle_s = ahead.walk(deque(self._events), t_call).idle_s
            if ahead_idle_s > 0:
                self.meter.on_idle(ahead_idle_s)  # a simulated meter adds idle power for it
            self._hint_load(ahead, t_call)
            e_now = self.meter.energy_j() if self.available else None
            t_now = self._read_time(t_call)
            if t_now > t_call and self.feed is not None:
                # The steps the engine started while the meter was read: the span now runs to
                # the read's time, so they are in it (fed only later, a step's start would be
                # moved to the next tick's start and its time given to the step before).
                self.feed()
            walk = _IntervalWalk(self._state, self.idle_after_s, self.gpu_runs_ahead, self._pending_j > 0, self.busy)
            pieces = walk.walk(self._events, t_now)
            if e_now is None:
                self._stop_attribution(pieces, t_now, walk.cursor(t_now))
                return
            self._drain_gaps.extend(walk.drain_gaps)
            self._attribute(pieces, t_now, e_now, t_now - t_call)
            self._state = walk.cursor(t_now)
            self._window.append(_WindowSample(t_now, self.total_j(), self.tokens["prefill"], self.tokens["decode"]))
            while len(self._window) > 2 and t_now - self._window[1].t_s >= self.window_s:
                self._window.popleft()

    def _read_time(self, t_call: float) -> float:
        """Where the tick's span ends: when the meter's value was taken (``read_t_s``), which
        under load came 4-14 ms after the tick began at ``t_call``, the longest just after the
        counter's update. Priced over the span up to ``t_call``, a value read later gave that
        tick the milliseconds after it and the next tick too little: 0.96-1.06 of the median by
        where a prompt fell against the counter's step (H100 step trace, docs/results/
        h200-request-energy.md). A read time before ``t_call`` or more than
        :data:`_READ_LAG_MAX_S` after it is another clock's: ``t_call`` then."""
        t_read = getattr(self.meter, "read_t_s", None)
        if type(t_read) not in (float, int) or not t_call <= t_read <= t_call + _READ_LAG_MAX_S:
            return t_call  # not a time (a meter of another shape), or another clock's
        return float(t_read)

    def _hint_load(self, walk: _IntervalWalk, t_now: float) -> None:
        """Tell the meter when the steps ran over the last counter periods, and the idle power
        (where measured): a counter extended past its last step at the last step's power, or at
        an instant reading that lags the power by tens of ms (docs/results/h200-energy-meter.md
        (c)), books the idle beside a short burst as the burst's, and the correction comes with
        a later read, after the burst. The gaps between steps while serving count as work, and so
        does the open gap after the last step under ``gpu_runs_ahead`` (the GPU may still run it).
        Not a gap vLLM's drain closed: the GPU ended its work somewhere inside it (on an H100, ~4 ms
        after the counter's step where the drain came 26 ms after it, docs/results/
        h200-request-energy.md), and extended at the work's power to the drain, the counter's
        next step took the excess back from the idle after it, as a phase cannot give joules back
        (a burst booked 1.135). At the quiet price the counter's next step adds what the GPU
        still worked, over that gap (:meth:`_book_back`)."""
        hint = getattr(self.meter, "hint_load", None)
        if hint is None:
            return
        # A drain's gap is left to the counter's next step only where the meter reports its steps
        # (its phase known): else nothing books the GPU's last work there back, and bursts read
        # 0.49-1.28 of their work against 0.70-1.28 with the gap hinted as work (H100-shaped fake
        # without a phase, tests/test_energy_bursts_h200.py).
        phase_known = self._counter_phase_known()
        drain_gaps = (*self._drain_gaps, *walk.drain_gaps) if phase_known else ()
        spans = [s for s in self._recent_spans() if s not in drain_gaps]
        # A step still running at the tick runs on through the meter's read (end: inf); work that
        # vLLM reported drained at the tick has ended (the walk rests from there).
        running = walk.phase != "idle"
        spans.extend((a, math.inf if running and b >= t_now else b) for a, b in walk.spans if (a, b) not in drain_gaps)
        ends = [b for _, b in spans if math.isfinite(b)]
        if ends and (self._last_work_end_s is None or max(ends) > self._last_work_end_s):
            self._last_work_end_s = max(ends)
        if self.idle_power_w is None:
            self._hint_rest_w = None
            hint(None)
            return
        rest_w = self._learnt_rest_w(self.idle_power_w) if self.rest_power_w is not None else None
        self._hint_rest_w = rest_w
        hint(LoadHint(tuple(spans), self.idle_power_w, rest_w, REST_PRICE_S, self._last_work_end_s))

    def _stop_attribution(self, pieces: TickPieces, t_now: float, state: _Cursor) -> None:
        """The meter became unavailable (a fault): nothing more is attributed; requests that finish
        from now on get None, never a partial figure."""
        self.available = False
        self._unknown.update(self.request_j)
        self.request_j.clear()
        if not self.per_request:  # the events carry request ids for the drain rule only
            self._t, self._state = t_now, state
            return
        for piece in (*pieces.busy, *pieces.gaps):
            if piece.req_tokens:
                self._unknown.update(piece.req_tokens)
        for rid in pieces.finished:
            if rid in self._unknown:
                self._unknown.discard(rid)
                if self.on_request_done is not None:
                    self.on_request_done(rid, None)
        self._t = t_now
        self._state = state

    def _attribute(self, pieces: TickPieces, t_now: float, e_now: float, read_lag_s: float = 0.0) -> None:
        """Split the meter's joules since the last tick over ``pieces``, book the counter steps back
        over the periods they close, and report the requests the tick made final (``read_lag_s``:
        for the trace)."""
        d_e = e_now - self._e
        period_s = getattr(self.meter, "counter_period_s", 0.0)
        if not 0.0 < period_s < math.inf:  # no period to book over (and none to keep ticks for)
            period_s = 0.0
        drain = getattr(self.meter, "drain_counter_steps", None)  # meters without a stepping counter: none
        drained = drain() if drain else []
        before_j = dict(self.request_j) if self.on_tick is not None else None  # for the trace's request_j
        self._learn_idle_power(drained, pieces.busy_spans, period_s)
        steps = self._period_steps(t_now, d_e, period_s, pieces.busy_spans, drained)
        back_j = sum(p.step.jump_j for p in steps)
        book: dict = {}
        idle_j = self._price(pieces, energy_j=d_e - back_j, span_s=t_now - self._t, book=book)
        holds = list(self._holds)  # settled after the jumps, which take back from this tick first
        fe_busy = self.busy
        if fe_busy is not None:
            self.busy_s += fe_busy(self._t, t_now)
            if pieces.idle_busy_s > 0 and pieces.idle_s > 0:
                book["idle_busy"] = idle_j * pieces.idle_busy_s / pieces.idle_s
                self.idle_busy_j += book["idle_busy"]
                self.idle_busy_s += pieces.idle_busy_s
        self._recent.append(_Booked(self._t, t_now, book, pieces.busy_spans))
        for p in steps:
            rest = p.rest or self._rest_excess(p, pieces.busy_spans)
            rest_j = rest.rest_j(self._rest_power_w(rest.idle_w)) if isinstance(rest, _RestExcess) else 0.0
            if rest_j > 0:
                self.energy_j["idle"] += rest_j
                idle_j += rest_j
            idle_j += self._book_back(p.t0_s, p.step.t_s, p.step.jump_j - rest_j, pieces.phase, book)
            if rest is not None:
                self._hold_rest(p, rest)
        if holds:
            # After the jumps: a negative one takes back from this tick's idle, and an earlier
            # hold's rest settled out of that idle first left it short (the idle counter then
            # fell by up to 7.6 J in a fuzzed burst fake, tests/test_energy_bursts_h200.py).
            idle_j -= self._settle_rest(drained, pieces.busy_spans, book, holds)
        while len(self._recent) > 1 and self._recent[0].t1_s < t_now - 2 * period_s:
            self._recent.popleft()
        if self._drain_gaps:
            kept = set(self._recent_spans())
            self._drain_gaps = [g for g in self._drain_gaps if g in kept]
        gained = _gains(before_j, self.request_j)
        done = self._finish_requests(pieces.finished)
        if self.on_tick is not None:
            gap_s = pieces.quiet_s - pieces.idle_s
            self.on_tick(
                TickRecord(self._t, t_now, d_e, pieces.busy_s, gap_s, pieces.idle_s, idle_j, done, back_j,
                           self._instant_power_w(), self.rest_power_w, tuple(drained), gained, read_lag_s)
            )  # fmt: skip
        self._t, self._e = t_now, e_now

    def _counter_phase_known(self) -> bool:
        """Whether the meter knows when its counter steps and so reports the steps: then a drain's
        gap is left to them (:meth:`_hint_load`) and the idle power is learnt from the counter's
        own spans (:meth:`_learn_idle_power`) rather than from a tick's joules."""
        return getattr(self.meter, "counter_phase_known", False) is True

    def _quiet_span_w(self, c: CounterStep, work: list, min_span_s: float) -> float | None:
        """The counter's power (W) over the span a step closes (``c.span_t0_s`` to ``c.t_s``) where
        that span is at least ``min_span_s`` long and holds none of ``work``; else None. A shorter
        span is no period: a read called before the counter's update and returning after it, taken
        as having seen that step, leaves it to the next read as a span of milliseconds holding the
        period's joules (23,471 W on an H100, docs/results/h200-request-energy.md)."""
        a, t1, j = c.span_t0_s, c.t_s, c.span_j
        if a is None or j is None or not math.isfinite(j) or not t1 - a >= min_span_s or not t1 - a > 0:
            return None
        if any(_overlap(x, y, a, t1) > 0 for x, y in work):
            return None
        return j / (t1 - a)

    def _learn_idle_power(self, drained: list, spans: tuple, period_s: float) -> None:
        """The idle power from each counter span of quiet time only (no work in it) of at least half
        a period: the counter's joules, not the meter's extension. Learnt from a tick of idle only,
        a tick shorter than the counter's period is mostly the extension at the idle power it was
        hinted, so it learnt that price back: a GPU resting at 125 W after work and then idling at
        70 W stayed priced at 125 W with ticks 50 ms apart (H100-shaped fake,
        tests/test_energy_bursts_h200.py)."""
        if not self._counter_phase_known() or not 0.0 < period_s:
            return
        work = self._recent_spans() + list(spans)
        for c in drained:
            w = self._quiet_span_w(c, work, 0.5 * period_s)
            if w is not None:
                self.idle_power_w = _moving_average(self.idle_power_w, max(0.0, w))

    def _period_steps(self, t_now: float, d_e: float, period_s: float, spans: tuple, drained: list) -> list[_PeriodStep]:
        """The counter steps to book back: a counter step's jump belongs to the ~100 ms period it
        closes, not to this (often ~16 ms) tick, so it is set aside and booked over that period's
        ticks (:meth:`_book_back`). A read that saw several steps at once (ticks further apart
        than a period) corrects the earlier ticks' part of the span instead (:meth:`_span_step`);
        ``spans``: this tick's busy pieces; ``drained``: the meter's counter steps since the last tick."""
        steps = []
        for c in drained:
            # A step after the read that saw it, or not a number, is no step of this counter.
            if period_s and c.t_s <= t_now and math.isfinite(c.jump_j):
                span = self._span_step(c, period_s, spans)
                if span is not None:
                    if self._recent_overlap(span.t0_s, span.step.t_s) > 0:
                        steps.append(span)
                else:
                    t0 = max(c.t_s - period_s, self._last_step_t)
                    if self._recent_overlap(t0, c.t_s) > 0:
                        steps.append(_PeriodStep(t0, c))
                self._last_step_t = max(self._last_step_t, c.t_s)
        # The jumps a meter reports lie within what its reads returned (CounterStep): more than
        # the tick saw, and they are not the counter's; the tick keeps what it saw.
        if sum(p.step.jump_j for p in steps if p.step.jump_j > 0) > d_e:
            return []
        return steps

    def _span_step(self, c: CounterStep, period_s: float, spans: tuple) -> _PeriodStep | None:
        """A read that saw more than one counter step: the counter drew ``c.span_j`` over
        ``[c.span_t0_s, c.t_s]``, of which the earlier ticks (up to ``c.read_t0_s``) were given
        ``c.ext_j`` by the meter's extension. The span's joules are split like a tick's (quiet
        time at the idle power, the steps' time the rest), by when the steps ran, and the earlier
        part's difference is booked back over it. (The jump, which measures the whole read gap
        against the previous read's rate, would land in this tick: after a short burst, often a
        tick of idle only, which then took the burst's missing joules: docs/request-energy.md.)
        ``None`` where the step is a single period's (booked over that period) or not placed."""
        a, d_j, tp, ext_j = c.span_t0_s, c.span_j, c.read_t0_s, c.ext_j
        if a is None or d_j is None or tp is None or ext_j is None or not a <= tp <= c.t_s or c.t_s - a <= 1.5 * period_s:
            return None
        b1 = sum(_overlap(x, y, a, tp) for x, y in self._recent_spans())
        b2 = sum(_overlap(x, y, tp, c.t_s) for x, y in spans)
        q1, q2 = max(0.0, tp - a - b1), max(0.0, c.t_s - tp - b2)
        idle_w = self.idle_power_w
        if b1 + b2 <= 0 or idle_w is None:
            return _PeriodStep(a, CounterStep(tp, d_j * (tp - a) / (c.t_s - a) - ext_j))
        # The GPU's rest after the work (perf boost held, clocks falling back) draws more than the
        # idle power learnt before it: the instant reading prices it (an upper bound while it
        # lags the falling power; :class:`_RestHold` settles it once the counter measured the rest).
        end = self._work_end(a, c.t_s, spans)
        end = a if end is None else end
        r1, r2 = max(0.0, tp - max(a, end)), max(0.0, c.t_s - max(tp, end))
        split = _SpanSplit(d_j, idle_w, q1, q2, r1, r2, b1, b2, end)
        return _PeriodStep(a, CounterStep(tp, split.part1_j(self._rest_power_w(idle_w)) - ext_j), split if r1 + r2 > 0 else None)

    def _rest_excess(self, p: _PeriodStep, spans: tuple) -> _RestExcess | None:
        """Of a counter step's positive jump, what the GPU's rest after the work in its period
        drew above the price the meter extended it with (:meth:`_rest_power_w`) is idle's,
        not the steps'. ``None`` where the period holds no work, or no rest after it."""
        idle_w, jump_j = self.idle_power_w, p.step.jump_j
        if idle_w is None or jump_j <= 0:
            return None
        t0, t1 = p.t0_s, p.step.t_s
        end = self._work_end(t0, t1, spans)
        if end is None or end >= t1:
            return None
        # Where the meter extended the rest at the rest price it was hinted (LoadHint), only the
        # rest's excess over that price is in the jump: over the idle price, it was taken twice.
        base_w = idle_w if self._hint_rest_w is None else max(idle_w, self._hint_rest_w)
        return _RestExcess(jump_j, base_w, t1 - max(t0, end), end)

    def _recent_spans(self) -> list[tuple[float, float]]:
        """The busy spans of the kept ticks (the last counter periods), oldest first."""
        return [s for r in self._recent for s in r.busy_spans]

    def _work_end(self, t0: float, t1: float, spans: tuple) -> float | None:
        """When the last work overlapping ``(t0, t1)`` ended, among the kept ticks' spans and
        this tick's ``spans``; ``None`` where none overlaps."""
        return max((y for x, y in (*self._recent_spans(), *spans) if x < t1 and y > t0), default=None)

    def _instant_power_w(self) -> float | None:
        """The instant reading taken with the meter's last energy read (W); None where it has none."""
        p = getattr(self.meter, "last_power_w", None)
        return p if isinstance(p, float) and math.isfinite(p) else None

    def _rest_power_w(self, idle_w: float) -> float:
        """The GPU's power at rest after its work: the instant reading taken with the last energy
        read, never below the idle power (it lags the power by tens of ms,
        docs/results/h200-energy-meter.md (c): soon after the work it reads high)."""
        p = self._instant_power_w()
        return idle_w if p is None else max(idle_w, p)

    def _hold_rest(self, p: _PeriodStep, split: _SpanSplit | _RestExcess) -> None:
        """Keep what the steps of ``p`` hold, for :meth:`_settle_rest`."""
        rest_w = self._rest_power_w(split.idle_w)
        if rest_w <= split.idle_w:
            return
        if isinstance(split, _SpanSplit):  # a negative part is not taken from them: they hold the extension
            held_j = split.part1_j(rest_w) - min(p.step.jump_j, 0.0)
        else:
            held_j = split.jump_j - split.rest_j(rest_w)
        parts, _ = self._period_parts(p.t0_s, p.step.t_s)
        booked = sum(v for key, v in parts.items() if key in self.energy_j)
        if booked > 0:
            self._holds.append(_RestHold(split, rest_w, held_j, parts, booked))

    def _settle_rest(self, drained: list, spans: tuple, book: dict, holds: list[_RestHold]) -> float:
        """A counter span of rest only after a held step's work (:class:`_RestHold`) measures the
        rest's power; where it is below the price the steps were given, they get what it leaves
        them, out of this tick's idle (never more than it has left). Holds (of ``holds``, those kept
        before this tick's counter steps) end there, or when new work comes. Returns the joules moved."""
        moved = 0.0
        work = self._recent_spans() + list(spans)
        min_span_s = 0.5 * getattr(self.meter, "counter_period_s", 0.0)
        for h in holds:
            end = h.split.end_s
            rest_w = None
            for c in drained:
                w = self._quiet_span_w(c, work, min_span_s) if c.span_t0_s is not None and c.span_t0_s >= end else None
                if w is not None:  # a span of rest only after the held step's work
                    rest_w = w
            if rest_w is None:
                if any(y > end for _, y in spans):
                    self._drop_hold(h)
                continue
            if rest_w > h.rest_w:
                # Above the instant reading the rest was priced at, which lags the falling power
                # (an upper bound): the span held work. A read that returned after the counter's
                # update with the value from before left a full period of a burst's work to the
                # span after the drain: 650 W learnt for a GPU resting at 125 W (H100-shaped fake,
                # tests/test_energy_bursts_h200.py).
                self._drop_hold(h)
                continue
            self.rest_power_w = _moving_average(self.rest_power_w, rest_w)
            self._drop_hold(h)
            if rest_w >= h.rest_w:
                continue
            if isinstance(h.split, _SpanSplit):
                owed = h.split.part1_j(max(rest_w, h.split.idle_w)) - h.held_j
            else:
                owed = h.split.rest_j(h.rest_w) - h.split.rest_j(rest_w)
            owed = min(owed, book.get("idle", 0.0))
            if owed <= 0:
                continue
            for key, v in h.parts.items():
                self._credit(key, owed * v / h.booked_j, pending_open=False)
            self.energy_j["idle"] -= owed
            book["idle"] -= owed
            moved += owed
        return moved

    def _drop_hold(self, h: _RestHold) -> None:
        if h in self._holds:  # a hold kept before this tick may have made way for newer ones (maxlen)
            self._holds.remove(h)

    def _finish_requests(self, finished: list) -> list:
        """Report the requests in ``finished`` still in flight with their final joules; returns their ids."""
        done = []
        for rid in finished:
            j = self.request_j.pop(rid, None)
            if j is not None:
                done.append(rid)
                self.finished_request_j += j
                self.finished_requests += 1
                if self.on_request_done is not None:
                    self.on_request_done(rid, j)
        return done

    def _price(self, pieces: TickPieces, *, energy_j: float, span_s: float, book: dict) -> float:
        """Split ``energy_j`` joules over the interval's ``pieces`` (``span_s`` long; module
        docstring: quiet time at the idle power, steps the rest by time) and book phases, steady
        state, requests and the tail; ``book`` gets what went where (phases by name, requests by
        ``("r", id)``, ``"tail"``, ``"pending"``, ``"steady"``, ``"idle_busy"``). Returns the
        joules booked as idle."""
        if pieces.busy_s + pieces.quiet_s <= 0:
            return self._book_lump(energy_j, pieces.phase, book)
        rates = self._rates(pieces, energy_j, span_s)
        idle_s = pieces.idle_s
        if idle_s > 0:
            self.energy_j["idle"] += rates.quiet_w * idle_s
            self.time_s["idle"] += idle_s
            _add(book, "idle", rates.quiet_w * idle_s)
        weights = _StepWeights(self.cost)  # a step's busy piece and its gap share one weighting
        waits: dict[int, StepWait] = {}
        if self.per_request:
            self._settle_pending(pieces, weights)
            if self.cost is not None:
                waits = self._host_waits.waits(pieces, weights, self.gpu_runs_ahead)
        for seconds, ph, req, ctx, steady in pieces.busy:
            j = rates.busy_w * seconds
            self._book_phase(ph, seconds, j, steady, book)
            wait = waits.get(id(req))
            if wait is not None:  # the waiting share to all its requests alike
                self._share_wait(j * wait.wait_share, wait, book)
                j *= 1.0 - wait.wait_share
            if self.per_request and not self._share(self.request_j, j, weights(req, ctx), book):
                self._to_tail(j, book)
        for gap in pieces.gaps:
            seconds, ph, req, ctx, steady, to = gap
            j = (rates.busy_w if _runs_on(gap, self.gpu_runs_ahead) else rates.gap_w) * seconds
            self._book_phase(ph, seconds, j, steady, book)
            if not self.per_request:
                continue
            if to == "pending":
                self._pending_j += j
                _add(book, "pending", j)
            elif to == "tail" or not self._share(self.request_j, j, weights(req, ctx), book):
                self._to_tail(j, book)
        return rates.quiet_w * idle_s if idle_s > 0 else 0.0

    def _share_wait(self, joules: float, wait: StepWait, book: dict) -> None:
        """A step's wait to its requests, equally: each waited alike (:class:`_HostWaits`)."""
        if not self._share(self.request_j, joules, dict.fromkeys(wait.weights, 1.0), book):
            self._to_tail(joules, book)

    def _to_tail(self, joules: float, book: dict) -> None:
        """Non-idle ``joules`` no request owns: to the tail (module docstring), and to ``book``."""
        self.tail_j += joules
        _add(book, "tail", joules)

    def _quiet_price_w(self) -> float | None:
        """The idle power quiet time is priced at. A meter that books idle time itself (the
        simulated GPU, told by ``on_idle`` just before its read) prices it at its idle power now:
        a clock lock changes that power (the idle preset), the learnt average lags it, and the
        difference moved the tick's step joules to idle (a batch of 8 requests read 0 J in
        tests/test_e2e.py) or from it."""
        if not getattr(self.meter, "powered_between_steps", True) and hasattr(self.meter, "idle_power_w"):
            live = self.meter.idle_power_w()
            if live is not None:
                return live
        return self.idle_power_w

    def _rates(self, pieces: TickPieces, d_e: float, span_s: float) -> _Rates:
        """The tick's prices: quiet time at the idle power (never more than the tick's joules),
        the steps the rest by time; an interval of idle only updates the idle power."""
        idle_w = self._quiet_price_w()
        idle_s, busy_s, quiet_s = pieces.idle_s, pieces.busy_s, pieces.quiet_s
        gap_s = quiet_s - idle_s
        # Quiet time priced at the idle power: idle, and the gaps after steps where the meter's GPU
        # draws power there (a simulated GPU does not: its steps cost their modelled work only).
        priced_s = quiet_s if getattr(self.meter, "powered_between_steps", True) else idle_s
        if busy_s > 0 and priced_s > 0 and idle_w is not None:
            rest_s = self._rest_after_work_s(pieces, span_s) if d_e > 0 else 0.0
            rest_w = self._tick_rest_w(idle_w, rest_s, d_e / (busy_s + priced_s))
            if rest_s > 0 and rest_w > idle_w:
                return self._steps_then_rest_rates(pieces, d_e, priced_s, rest_s, rest_w, idle_w, priced_s == quiet_s)
            quiet_w = min(idle_w, d_e / priced_s) if d_e > 0 else d_e / (busy_s + priced_s)
            busy_w = (d_e - quiet_w * priced_s) / busy_s
        elif busy_s + priced_s > 0:
            quiet_w = busy_w = d_e / (busy_s + priced_s)
            if busy_s == 0 and gap_s <= 0 and idle_s >= _IDLE_POWER_MIN_S and span_s > 0 and not self._counter_phase_known():
                # An interval of idle only: the counter's idle power, for the edges of later intervals.
                w = d_e / idle_s
                self.idle_power_w = _moving_average(idle_w, w)
            elif busy_s == 0 and gap_s > 0 and idle_s > 0 and priced_s == quiet_s and idle_w is not None:
                return self._gap_then_rest_rates(d_e, gap_s, idle_s, idle_w)
        else:  # only gaps, on a meter that does not price them: whatever it reports is theirs
            quiet_w = busy_w = 0.0
        gap_w = quiet_w if priced_s == quiet_s else (d_e / gap_s if busy_s + priced_s <= 0 else 0.0)
        return _Rates(quiet_w, busy_w, gap_w)

    def _learnt_rest_w(self, idle_w: float) -> float:
        """The rest power the counter measured after work, never below ``idle_w``; ``idle_w``
        until one is measured (unlike :meth:`_rest_power_w`, the instant reading)."""
        return idle_w if self.rest_power_w is None else max(idle_w, self.rest_power_w)

    def _rest_after_work_s(self, pieces: TickPieces, span_s: float) -> float:
        """Seconds of the tick's idle after its last work (vLLM's drain); 0 where it has none."""
        ends = [b for _, b in pieces.busy_spans if math.isfinite(b)]
        if not ends or pieces.idle_s <= 0:
            return 0.0
        return min(pieces.idle_s, max(0.0, self._t + span_s - max(ends)))

    def _tick_rest_w(self, idle_w: float, rest_s: float, avg_w: float) -> float:
        """The price of a tick's ``rest_s`` seconds of rest after the drain: the learnt rest power;
        before one is learnt, the instant reading where the tick came :data:`_SETTLED_READ_S` or
        more after the drain (the first bursts of a server booked up to 1.125 at the idle price,
        H100-shaped fake, tests/test_energy_bursts_h200.py), never above the tick's average power
        ``avg_w`` (a rest draws less than work: a reading off the counter stays out), else the
        idle power."""
        if self.rest_power_w is not None or rest_s < _SETTLED_READ_S:
            return self._learnt_rest_w(idle_w)
        return max(idle_w, min(self._rest_power_w(idle_w), avg_w))

    def _steps_then_rest_rates(
        self, pieces: TickPieces, d_e: float, priced_s: float, rest_s: float, rest_w: float, idle_w: float, gaps_priced: bool
    ) -> _Rates:
        """A tick of steps whose idle follows vLLM's drain: that idle is the GPU's rest after the
        work, priced at ``rest_w`` (:meth:`_tick_rest_w`; ``rest_s`` of it; any idle before the work at the
        idle power), the gaps after steps at the idle power, the steps the remainder; the quiet
        time never more than the tick's joules. At the idle price a tick that came 0.125 s after
        the drain gave the steps the rest's excess: a prefill burst booked 1.07 (H100-shaped fake,
        tests/test_energy_bursts_h200.py)."""
        idle_s, busy_s = pieces.idle_s, pieces.busy_s
        idle_j = rest_w * rest_s + idle_w * (idle_s - rest_s)
        gap_j = idle_w * (priced_s - idle_s) if gaps_priced else 0.0
        f = min(1.0, d_e / (idle_j + gap_j)) if idle_j + gap_j > 0 else 1.0
        busy_w = (d_e - f * (idle_j + gap_j)) / busy_s
        return _Rates(f * idle_j / idle_s, busy_w, f * idle_w if gaps_priced else 0.0)

    def _gap_then_rest_rates(self, d_e: float, gap_s: float, idle_s: float, idle_w: float) -> _Rates:
        """A tick of the gap after the last step and the idle after vLLM's drain, no step: under
        async scheduling that gap is the GPU finishing the batch, and the idle is its rest. Where
        the tick drew more than rest would, the idle is priced at the rest power and the gap gets
        the remainder; at one average price the rest took up to 0.4 of a prefill burst's energy
        when the tick came 0.125 s after the drain (H100 step trace, docs/results/
        h200-request-energy.md)."""
        avg_w = d_e / (gap_s + idle_s)
        rest_w = self._tick_rest_w(idle_w, idle_s, avg_w)
        if avg_w <= rest_w:
            return _Rates(avg_w, avg_w, avg_w)
        return _Rates(rest_w, avg_w, (d_e - rest_w * idle_s) / gap_s)

    def _settle_pending(self, pieces: TickPieces, weights: _StepWeights) -> None:
        """A gap left pending by an earlier interval is settled by what followed it in this one
        (energy already booked, so not a booking of this tick); before this interval's own open
        gap joins the pending joules, which is not that gap's."""
        for req, ctx in pieces.resolved:
            j, self._pending_j = self._pending_j, 0.0
            if not self._share(self.request_j, j, weights(req, ctx)):
                self.tail_j += j
        if pieces.tail_pending:
            self.tail_j += self._pending_j
            self._pending_j = 0.0

    def _book_phase(self, phase: str, seconds: float, joules: float, steady: bool, book: dict) -> None:
        """A piece's ``joules`` and ``seconds`` to its ``phase`` (and to steady state)."""
        self.energy_j[phase] += joules
        self.time_s[phase] += seconds
        _add(book, phase, joules)
        if steady:
            self.steady_j += joules
            self.steady_s += seconds
            _add(book, "steady", joules)

    @staticmethod
    def _share(acc: dict[str, float], joules: float, weights: Any, book: dict | None = None) -> bool:
        """Add ``joules`` to the requests in proportion to ``weights`` (and to ``book`` under
        ``("r", id)``); False if there is none."""
        if not weights:
            return False
        n = sum(weights.values())
        if n <= 0:
            return False
        k = joules / n
        for rid, w in weights.items():
            acc[rid] = acc.get(rid, 0.0) + k * w
            if book is not None:
                key = ("r", rid)
                book[key] = book.get(key, 0.0) + k * w
        return True

    def _book_lump(self, joules: float, phase: str, book: dict) -> float:
        """Book ``joules`` with no time to split them by: to ``phase`` (and, off idle, to the
        tail). Returns the joules booked as idle."""
        self.energy_j[phase] += joules
        book[phase] = book.get(phase, 0.0) + joules
        if phase != "idle" and self.per_request:
            self._to_tail(joules, book)
        return joules if phase == "idle" else 0.0

    def _in_period(self, t0: float, t1: float):
        """``(share, bookings)`` of each kept tick that overlaps ``[t0, t1]``: the share of its
        span inside, by which its bookings count there (pro rata by time)."""
        for a, b, book, _ in self._recent:
            cut = min(b, t1) - max(a, t0)
            if cut > 0 and b > a:
                yield cut / (b - a), book

    def _recent_overlap(self, t0: float, t1: float) -> float:
        """Joules that ticks before the current one booked over ``[t0, t1]`` (pro rata by time)."""
        # The phases only: a tick books one key per request besides.
        return sum(k * sum(book.get(p, 0.0) for p in PHASES) for k, book in self._in_period(t0, t1))

    def _credit(self, key: Any, joules: float, pending_open: bool) -> None:
        """Add ``joules`` to the figure a booking ``key`` names (``_price``'s keys). A request
        already reported cannot change: its part goes to the tail; so does a pending gap's unless
        it is still open (``pending_open``: it may have been settled since)."""
        if key in self.energy_j:
            self.energy_j[key] += joules
        elif key == "steady":
            self.steady_j += joules
        elif key == "idle_busy":
            self.idle_busy_j += joules
        elif key == "pending" and pending_open:
            self._pending_j += joules
        elif type(key) is tuple and key[1] in self.request_j:
            self.request_j[key[1]] += joules
        else:
            self.tail_j += joules

    def _book_back(self, t0: float, t1: float, jump_j: float, phase: str, book: dict) -> float:
        """Book a counter step's ``jump_j`` over the counter period ``[t0, t1]`` it closes: every
        bucket of steps the ticks there booked (pro rata by time) grows by the same fraction, so a request
        that prefilled in a short tick takes its share of the period's error, not of the tick's.
        (Booking the jump in the tick that sees it gave a prefilling request most of a period's
        error on the H200: docs/results/h200-request-energy.md.) A request already reported
        cannot change: its part goes to the tail. A negative jump is :meth:`_take_back`'s.
        ``book``: this tick's bookings. Returns the joules booked as idle."""
        parts, own = self._period_parts(t0, t1, book)
        booked = sum(v for key, v in parts.items() if key in self.energy_j)
        if booked <= 0:
            return self._book_lump(jump_j, phase, {})
        if jump_j < 0:
            return self._take_back(jump_j, parts, booked, phase, book, own)
        f = jump_j / booked
        for key, v in parts.items():
            self._credit(key, f * v, pending_open=False)  # an earlier tick's gap may be settled since
        return f * parts.get("idle", 0.0)

    def _period_parts(self, t0: float, t1: float, book: dict | None = None) -> tuple[dict, float]:
        """What the kept ticks booked over ``[t0, t1]`` (pro rata by time), the steps' bookings
        only where there are any, and the share of ``book`` (this tick's) inside."""
        parts: dict = {}
        own = 0.0  # the share of this tick's bookings in the period
        for k, booked_there in self._in_period(t0, t1):
            if booked_there is book:
                own = k
            for key, v in booked_there.items():
                parts[key] = parts.get(key, 0.0) + k * v
        # Quiet time was priced at the measured idle power; what interpolation missed is the steps'
        # (at an idle -> busy edge, scaling idle up by the jump would book busy power as idle). A
        # period of idle only takes its jump as idle.
        busy = {k: v for k, v in parts.items() if k not in ("idle", "idle_busy")}
        if any(v > 0 for k, v in busy.items() if k in self.energy_j):
            parts = busy
        return parts, own

    def _take_back(self, jump_j: float, parts: dict, booked: float, phase: str, book: dict, own: float) -> float:
        """A negative jump: the period drew ``-jump_j`` joules less than its ``parts`` (``booked``
        of them in phases) say. Figures already out cannot give joules back: the phase, tail,
        steady-state and idle-while-busy counters (Prometheus reads a drop as a counter reset)
        and reported requests. So the requests still in flight give back their share of the
        period before this tick, and the rest comes out of this tick's bookings ``book`` (``own``
        of them lie in the period), its steps' first, then its idle: this tick priced the
        previous read's rate, which the jump corrects, so it holds at least ``-jump_j``
        (:class:`~.meters.CounterStep`). Returns the joules booked as idle."""
        acc, energy = self.request_j, self.energy_j
        f = max(-1.0, jump_j / booked)
        given = 0.0  # by the requests in flight, over the period before this tick
        for key, v in parts.items():
            if type(key) is tuple and key[1] in acc:
                d = f * (v - own * book.get(key, 0.0))
                acc[key[1]] += d
                given += d
        busy_j = max(0.0, sum(v for k, v in book.items() if k in energy and k != "idle"))
        idle_j = max(0.0, book.get("idle", 0.0))
        from_busy = max(jump_j, -busy_j)  # phases: this tick's steps, then its idle
        from_idle = max(jump_j - from_busy, -idle_j)
        g_busy = from_busy / busy_j if busy_j > 0 else 0.0
        g_idle = from_idle / idle_j if idle_j > 0 else 0.0
        # Requests, tail and pending: the steps' part less what the requests in flight gave back.
        g_req = (from_busy - given) / busy_j if busy_j > 0 else 0.0
        if busy_j <= 0:
            self.tail_j -= given
        for key, v in book.items():
            idle = key in ("idle", "idle_busy")
            # What this tick holds now, for a later step's period (its steps' and idle's parts
            # shrunk alike on both sides, so that it still balances).
            book[key] = v * (1.0 + (g_idle if idle else g_busy))
            # This tick's open gap is still pending: its part comes off the pending joules.
            self._credit(key, (g_idle if idle else g_busy if key in energy or key == "steady" else g_req) * v, pending_open=True)
        left = jump_j - from_busy - from_idle  # more than this tick holds: a meter off its contract
        return from_idle + (self._book_lump(left, phase, {}) if left else 0.0)

    @property
    def current_phase(self) -> str:
        return self._state.phase

    @property
    def pending_j(self) -> float:
        """Energy of the open gap after the last step, not yet settled (requests or tail)."""
        return self._pending_j

    def total_j(self) -> float:
        return sum(self.energy_j.values())

    @property
    def read_j(self) -> float:
        """The meter's joules as of the last tick's read: what :meth:`total_j` books, all of it once."""
        return self._e

    def window(self) -> dict[str, float]:
        """Energy (J), tokens and seconds over the sliding window (oldest kept tick to the last tick).

        ``seconds`` is 0 before the second tick. Figures are meaningless once ``available`` is False.
        """
        with self._lock:
            t0, e0, p0, d0 = self._window[0]
            t1, e1, p1, d1 = self._window[-1]
        return {"seconds": t1 - t0, "energy_j": e1 - e0, "prefill_tokens": p1 - p0, "decode_tokens": d1 - d0}
