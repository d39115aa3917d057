"""Decode pacing: hold decode-only steps apart to a TPOT target while nothing waits.

Why it saves energy: a small-batch decode step is bound by reading the weights, so its time and
energy hardly depend on the batch (Llama-3.1-8B on an H100: 0.455 J per token at batch 8 against
0.070 at batch 512, ML.ENERGY leaderboard v3; ``docs/decode-pacing.md``). Under open-loop
arrivals (Poisson traffic below saturation) the batch is the arrival rate times the time a
request stays (Little's law), so spacing the steps to a period ``T`` makes each request stay
longer, the batch grow in proportion and the steps per second fall, while the tokens per second
stay the arrival rate's. Between steps the GPU draws its loaded-idle power (~122 W on the H200
with the boost held, docs/h200-facts.md) instead of a decode step's.

When it does not pay: where the batch cannot grow with the period (closed-loop clients at a fixed
concurrency, a batch at ``max_num_seqs``) the gaps only add idle energy and cost throughput; the
pacer therefore never holds a step while a request waits in the scheduler's queue or the batch is
full, pauses itself while arrivals follow finished requests (:class:`ClosedLoopGuard`), and
``tune-serving`` measures it against the user's own traffic before recommending it.

The pacer never delays a prefill: a request that arrives during a gap wakes the engine at once
(the input queue is polled every :data:`POLL_S`), and no step is held while a running request is
still owed its prefill or its first token (:class:`PaceFacts`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

#: How often a held engine looks at its input queue (s): the most a new request's TTFT can grow.
POLL_S = 0.0005


@dataclass(frozen=True)
class PaceFacts:
    """What the engine's scheduler holds before the next step."""

    running: int  # requests in the running batch
    waiting: int  # requests in the scheduler's waiting queue
    max_running: int  # the batch limit (vLLM's max_num_seqs)
    # A running request still has tokens to compute before it decodes (a chunked prefill, or a
    # preempted request's recompute), or has no output yet: under async scheduling its first
    # token is collected by the next loop iteration, which a hold would delay.
    prefill_pending: bool


#: Closed-loop detection (:class:`ClosedLoopGuard`): holds judged together, after a finished request
#: and after none (the control), the share of the first that an arrival must cut short, and the
#: most the control's share may be, to pause pacing.
FINISHED_HOLDS = 32
CONTROL_HOLDS = 32
WOKEN_SHARE = 0.5
CONTROL_MAX = 0.1
#: Cases after a finish enough for a verdict when every one saw an arrival (and the control is
#: quiet): a closed loop of a few clients finishes a request every few seconds when paced, and 32
#: cases took 76 s at 4 clients on the simulated H200 (8 cases: 11-19 s; 4: 7-13 s, and 4 clients
#: keep x0.90 of their throughput at 35 ms over 300 s instead of x0.80,
#: docs/results/sim-decode-pacing.md). Poisson arrivals quiet enough for the control do all 4 with
#: a chance under 0.1 ** 4, and a pause's probe withdraws what it mistook within 3 s.
EARLY_HOLDS = 4
#: The first pause (s); each pause that ends in another doubles it, up to the last value.
PAUSE_S = (30.0, 600.0)
#: Loops after a finish in which a client's next request may reach the intake: a round trip as long
#: as the gap lands in the next loop's intake, not in the hold after the finish.
LAGS = (1, 2)
#: A pause's probe (:class:`PauseProbe`): the arrival rate while paused must rise by this factor
#: over the rate while paced for the loop to be confirmed. Closed-loop clients speed up with the
#: engine (x2.2 at 35 ms with 128 clients on the simulated H200, docs/results/sim-decode-pacing.md);
#: open-loop arrivals keep their rate, however their finishes line up with them.
RISE_MIN = 1.10
#: The paced rate is read over at most this window (s) before the pause, at least a third of
#: :data:`PROBE_S`; the probe decides after at least :data:`PROBE_S` of the pause and
#: :data:`PROBE_ARRIVALS` arrivals in each window. A pause with no such window stands untested.
#: After a pause ran out the window starts :data:`PACED_WINDOW_S` after pacing resumed: a closed
#: loop's rate takes about one request's life to settle, and its rise would read low before.
PACED_WINDOW_S = 5.0
PROBE_S = 3.0
PROBE_ARRIVALS = 8
#: Arrivals in rounds: clients with equal lengths that start together come back together, a round
#: of 512 / 256 tokens at 35 ms every 10 s with 128 clients (each round's requests spread over 1.5 s
#: by chunked prefill) on the simulated H200, 3 s unpaced. A window shorter than a round holds part
#: of one, whose rate is that of its spread, not of the loop: the probe withdrew 12 of 14 pauses
#: there (docs/results/sim-decode-pacing.md). A silence longer than :data:`ROUND_GAP_S` between
#: arrivals starts a round. Where the last :data:`ROUNDS_READ` rounds up to now (the one under way
#: included, since the last idle spell, within :data:`ROUNDS_WINDOW_S`) lasted :data:`ROUND_MIN_S` or
#: more on average (shorter ones a 5 s window reads well), held more than one request each and
#: silences for at least :data:`ROUNDS_SHARE` of their time, rates are read from round start to
#: round start: the paced one over the fewest last whole rounds of the paced window that hold
#: :data:`PROBE_ARRIVALS` (none: the pause stands untested), the paused one once whole rounds have
#: passed, or as any other traffic's if none have within a paced round (a closed loop's unpaced
#: rounds are shorter).
ROUND_GAP_S = 0.5
ROUNDS_SHARE = 0.5
ROUNDS_READ = 3
ROUND_MIN_S = 1.0
ROUNDS_WINDOW_S = 60.0
#: After a pause withdrawn by its probe the guard judges no holds for this long (s), doubling while
#: pauses keep being withdrawn, up to the last value. An idle engine ends it, and so does an arrival
#: rate over the last :data:`PACED_WINDOW_S` that moved by more than :data:`HOLDOFF_SHIFT` either way
#: from the open loop's (checked once a second): new traffic is judged.
HOLDOFF_S = (30.0, 120.0)
HOLDOFF_SHIFT = 1.25
#: Open-loop rates whose pauses were withdrawn, kept so that traffic switching between them does not
#: end each hold-off (and pay a probe) at every switch.
OPEN_RATES_KEPT = 4
#: An idle spell longer than this (s) ends a probe and a hold-off (new traffic is judged afresh);
#: shorter ones are the gaps between a light load's requests.
IDLE_RESET_S = 1.0
ARRIVALS_KEPT = 4096
#: Scheduled checks: clients that think 0.3-2 s before their next request leave no signature in the
#: holds (their arrivals come seconds after a finish, not in the next loop), yet pacing cost them
#: x0.26-0.44 throughput and x0.70-0.83 tokens per joule at 35 ms on the simulated H200
#: (docs/results/sim-decode-pacing.md). So after :data:`CHECK_AFTER_S` of pacing (doubling after
#: each check that finds an open loop, up to the last value) pacing is lifted as a check: the
#: arrivals over the last :data:`CHECK_PACED_S` paced (the first span that holds
#: :data:`CHECK_ARRIVALS` of them, else the widest: 4 clients paced at 35 ms send ~0.37 a second; at
#: least :data:`CHECK_MIN_PACED_S` and :data:`PROBE_ARRIVALS` of them) are set against those since.
#: From :data:`CHECK_CONFIRM_S` in, a rise of :data:`CHECK_RISE` or more that arrivals of one rate
#: give with a chance under :data:`CHECK_P` (and :data:`PROBE_ARRIVALS` arrivals) starts a recheck
#: (:data:`RECHECK_S`); from :data:`CHECK_S` in, with :data:`CHECK_ARRIVALS` arrivals in both
#: windows and a rate under :data:`CHECK_OPEN_BELOW` times the paced one, pacing resumes, as it does
#: after :data:`CHECK_MAX_S` without a verdict or an idle spell past :data:`IDLE_RESET_S` once
#: :data:`CHECK_S` in with no rise so far (a light open load; few thinking clients idle the engine
#: too, but come back faster). A closed loop's next check comes :data:`CHECK_SOON_S` after its pause
#: ends. What a check costs open-loop traffic (a few seconds unpaced, then the batch regrowing):
#: x2.284 against x2.351 tokens per joule at 4 req/s and 35 ms over 1800 s, simulated (same record);
#: a light load of long outputs pays more, its checks running to CHECK_MAX_S (x2.17-2.25 against
#: x2.41-2.45 at 0.2 req/s of 1,500-3,000 tokens, simulated), a price docs/decode-pacing.md weighs
#: against 2 thinking clients'.
CHECK_AFTER_S = (60.0, 600.0)
CHECK_SOON_S = 15.0
CHECK_PACED_S = (20.0, 40.0, 60.0)
CHECK_MIN_PACED_S = 10.0
CHECK_CONFIRM_S = 4.0
CHECK_S = 6.0
CHECK_MAX_S = 30.0
CHECK_RISE = 1.25
CHECK_OPEN_BELOW = 1.2
CHECK_P = 0.001
CHECK_ARRIVALS = 24
#: A check reads its arrivals at most this often (s): each read scans them, on the engine's thread.
CHECK_READ_S = 0.25
#: A rise alone does not tell a closed loop from open-loop traffic whose rate stepped up during the
#: check, or whose requests come in loose groups (an adversarial review's simulations: Poisson
#: alternating 2 and 6 req/s every 60 s fell from x2.31 to x1.69-1.89 tokens per joule). So a check
#: that saw arrivals rise paces again as a recheck, and only arrivals that fall back (read from
#: :data:`RECHECK_SETTLE_S` after it began, from :data:`RECHECK_S` on, by :data:`CHECK_RISE` with a
#: chance under :data:`RECHECK_P` for arrivals of one rate: the rise was already under :data:`CHECK_P`,
#: and the check's few seconds of arrivals limit the power) make it a pause; arrivals that hold their
#: rise (under :data:`CHECK_OPEN_BELOW` of it), or :data:`RECHECK_MAX_S` without a verdict, resume
#: pacing as an open loop's check does.
RECHECK_SETTLE_S = 2.0
RECHECK_S = 10.0
RECHECK_MAX_S = 20.0
RECHECK_P = 0.01
#: An idle spell this long (s) ends the traffic the checks backed off from: the next check comes
#: :data:`CHECK_AFTER_S` after pacing starts again. Shorter spells are a light load's gaps, and
#: resetting at each of them cost Poisson at 1 req/s x2.027 against x2.115 tokens per joule over
#: 1800 s (simulated).
CHECK_RESET_IDLE_S = 10.0


@dataclass
class HoldTally:
    """Holds of one kind (after a finished request, or after none) and how many an arrival cut short."""

    holds: int = 0
    woken: int = 0


@dataclass(frozen=True)
class LoopTrace:
    """What an earlier loop of the engine saw, for arrivals that come loops after a finish."""

    held: bool  # the pacer held that loop's step
    after_finish: bool  # a request had left the engine since the loop before


@dataclass(frozen=True)
class HeldStep:
    """A hold of this loop, judged by the guard once the loop's intake is known."""

    after_finish: bool  # a request left the engine since the last loop took its inputs
    woken: bool  # something arrived on the input queue before the hold ran out
    at_s: float  # when the hold ended (the pacer's clock)


@dataclass(frozen=True)
class PauseProbe:
    """A pause under test: whether arrivals speed up while the engine runs unpaced."""

    started_s: float  # when the pause started (the pacer's clock)
    length_s: float  # the pause's length as announced
    paced_per_s: float  # the arrival rate over the window before it, while paced
    round_s: float | None = None  # paced arrivals came in rounds this long (s): rates read round start to round start
    #: A scheduled check's (:data:`CHECK_AFTER_S`) paced window; None: a pause the holds' signature started.
    paced: ArrivalCount | None = None

    @property
    def check(self) -> bool:
        return self.paced is not None


@dataclass(frozen=True)
class ArrivalCount:
    """Arrivals over a window, for a check's tests (:func:`_undispersed`)."""

    arrivals: int
    sq: int  # the sum of squares of the arrivals per loop that took any
    span_s: float  # the window's length (s)

    @property
    def per_s(self) -> float:
        return self.arrivals / self.span_s


@dataclass(frozen=True)
class Recheck:
    """A check whose arrivals rose while unpaced, paced again: a closed loop's arrivals fall back."""

    started_s: float  # when pacing resumed for it
    lifted: ArrivalCount  # the arrivals while the check lifted pacing
    paced_per_s: float  # the rate over the paced window before the check
    length_s: float  # the pause to announce if the loop is confirmed


@dataclass
class RoundScan:
    """Arrivals since a time, read as rounds: those that end a silence longer than
    :data:`ROUND_GAP_S` (oldest first), and per start what came with it."""

    starts_s: list[float] = field(default_factory=list)
    from_start: list[int] = field(default_factory=list)  # per start: the arrivals scanned from it to the last
    silence_s: list[float] = field(default_factory=list)  # per start: the silence it ended (0: unknown)


@dataclass
class ClosedLoopGuard:
    """Pauses pacing while its clients form a closed loop.

    A closed-loop client sends its next request when its last one ends, so the batch stays at the
    number of clients whatever the period, and a gap only costs throughput (x0.67 and x0.45 at 20 and
    35 ms on the simulated H200 with 128 clients, docs/results/sim-decode-pacing.md). Such arrivals
    come one round trip after a request finishes, open-loop arrivals whenever: a Poisson arrival is as
    likely to cut short a hold that follows a finished request as one that follows none. So the guard
    counts, for the holds after a finish and (the control) the holds after none, how many an arriving
    request cut short, and (a round trip longer than the gap) in how many loops one and two
    (:data:`LAGS`) after a held one a request arrived in the intake; when, in any of these, at
    least :data:`WOKEN_SHARE` of :data:`FINISHED_HOLDS` cases after a finish saw an arrival and at
    most :data:`CONTROL_MAX` of :data:`CONTROL_HOLDS` cases after none (or, sooner, all of the first
    :data:`EARLY_HOLDS` cases after a finish), pacing pauses for :data:`PAUSE_S` (doubling while the
    loop persists), then looks again.

    Open-loop arrivals at a near-constant rate with fixed output lengths can put each finish at a fixed
    phase against the next arrival and mimic that signature (docs/decode-pacing.md). A pause therefore
    tests itself (:class:`PauseProbe`): a closed loop's arrivals speed up once the steps are no longer
    held, an open loop's do not; a pause whose arrivals have not risen by :data:`RISE_MIN` after
    :data:`PROBE_S` is withdrawn, and the guard judges nothing for :data:`HOLDOFF_S`.

    Clients that think before their next request leave no signature in the holds; a scheduled
    check (:data:`CHECK_AFTER_S`) lifts pacing and becomes a pause where arrivals rise, and fall
    back once paced again (:class:`Recheck`).
    """

    #: Per lag: (after a finished request, after none). Lag 0: holds, and how many an arrival cut
    #: short; lags :data:`LAGS`: loops that many after a held one, and in how many a request arrived.
    tallies: dict[int, tuple[HoldTally, HoldTally]] = field(default_factory=dict)
    #: Lags whose last verdict was open-loop since the last pause (0: the holds themselves); all of
    #: them: the pause starts again from the first length.
    open_verdicts: set[int] = field(default_factory=set)
    paused_until: float | None = None
    pause_s: float = PAUSE_S[0]
    pauses: int = 0
    #: A line for the log, set when a pause starts or is withdrawn (:meth:`take_notice` hands it over once).
    notice: str | None = None
    #: Arrival times (s), paced or paused, newest last: the probe compares the two rates.
    arrivals_s: deque[float] = field(default_factory=lambda: deque(maxlen=ARRIVALS_KEPT))
    paced_since_s: float | None = None  # the first hold of this spell of pacing
    resumed_s: float | None = None  # when the last pause ran out, if this spell began then
    #: Arrival rates (req/s) of open loops whose pauses were withdrawn, newest last.
    open_rates_per_s: deque[float] = field(default_factory=lambda: deque(maxlen=OPEN_RATES_KEPT))
    probe: PauseProbe | None = None  # the running pause's test, if the paced rate could be read
    holdoff_until_s: float | None = None  # no hold is judged before this
    holdoff_from_s: float = 0.0  # when the last hold-off began
    rate_checked_s: float = 0.0  # when a hold-off last compared the arrival rate with it
    holdoff_s: float = HOLDOFF_S[0]
    withdrawn: int = 0  # pauses the probe found open-loop arrivals in
    probe_read_s: float | None = None  # the last arrival the probe's rates were read at
    traffic_since_s: float = 0.0  # when the last idle spell past IDLE_RESET_S ended: what came before is other traffic
    check_after_s: float = CHECK_AFTER_S[0]  # pacing (s) before the next scheduled check
    #: The last pause came from a check: its loop leaves no signature, so the holds' open-loop
    #: verdicts do not shorten the next pause; a check that finds an open loop does.
    pause_from_check: bool = False
    checks: int = 0  # scheduled checks run
    checked_s: float | None = None  # when the last check ended or was put off: the next counts from here
    recheck: Recheck | None = None  # a check whose arrivals rose, paced again to see them fall back
    recheck_read_s: float = 0.0  # when the recheck last read its arrivals

    def paused(self, now: float) -> bool:
        """Whether pacing is paused now; a pause that has run out ends here."""
        if self.paused_until is None:
            return False
        if now < self.paused_until:
            return True
        # A check without a verdict within CHECK_MAX_S ends as an open loop's, whose rate needs no
        # settling after it (a closed loop's does, after its pause).
        resumed_s = now
        if self.probe is not None and self.probe.check:
            self._found_open_by_check(now)
            resumed_s = self.resumed_s
        self.paused_until, self.probe, self.paced_since_s, self.resumed_s = None, None, None, resumed_s
        self._clear()
        return False

    def _clear(self) -> None:
        self.tallies.clear()

    def tally(self, lag: int) -> tuple[HoldTally, HoldTally]:
        """The counts of ``lag`` so far: (after a finished request, after none)."""
        return self.tallies.setdefault(lag, (HoldTally(), HoldTally()))

    def observe_hold(self, after_finish: bool, woken: bool, now: float) -> None:
        """One hold that ran: whether a request left the engine since the last hold, and whether an
        arriving request cut it short; pauses pacing when the loop's signature is reached."""
        if self.paced_since_s is None:
            self.paced_since_s = now
        self._judge(0, after_finish, woken, now)
        since_s = self.paced_since_s if self.checked_s is None else max(self.paced_since_s, self.checked_s)
        if self.paused_until is None and self.recheck is None and now - since_s >= self.check_after_s:
            if self.holdoff_until_s is None or now >= self.holdoff_until_s:
                self._start_check(now)

    def observe_arrivals(self, count: int, now: float) -> None:
        """``count`` requests reached the engine's intake at ``now``; a pause under test is decided
        once its probe has seen enough of them."""
        if count > 0:  # most engine loops take no request: no list built for them
            self.arrivals_s.extend([now] * count)
        if self.holdoff_until_s is not None and now - self.rate_checked_s >= 1.0:
            self._end_holdoff_on_shift(now)
        if self.recheck is not None and now - self.recheck_read_s >= CHECK_READ_S:
            self.recheck_read_s = now
            self._decide_recheck(self.recheck, now)
        probe = self.probe
        if probe is None or self.paused_until is None or now - probe.started_s < PROBE_S:
            return
        if now >= self.paused_until:  # the pause ran out before enough arrivals came: untested
            if probe.check:
                self.paused(now)
            self.probe = None
            return
        last_s = self.arrivals_s[-1] if self.arrivals_s else None
        if last_s == self.probe_read_s:  # rates move only with arrivals: read once per arrival
            return
        if probe.check:
            if last_s is not None and self.probe_read_s is not None and 0.0 <= last_s - self.probe_read_s < CHECK_READ_S:
                return
            self.probe_read_s = last_s
            self._decide_check(probe, now)
            return
        self.probe_read_s = last_s
        if probe.round_s is None:
            seen, paused_per_s = self._rate_since(probe.started_s)
        else:  # round to round; as any traffic's if a paced round passed without a whole round
            seen, paused_per_s = self._rate_in_rounds(probe.started_s)
            if paused_per_s is None and now - probe.started_s >= max(PROBE_S, probe.round_s):
                seen, paused_per_s = self._rate_since(probe.started_s)
        if seen < PROBE_ARRIVALS or paused_per_s is None:
            return
        self.probe = None
        if paused_per_s >= RISE_MIN * probe.paced_per_s:
            self.holdoff_s = HOLDOFF_S[0]  # a closed loop: the pause stands
            return
        self.withdrawn += 1
        self.paused_until, self.paced_since_s, self.pause_s, self.resumed_s = None, None, probe.length_s, None
        self.open_rates_per_s.append(paused_per_s)
        self.holdoff_until_s, self.holdoff_from_s = now + self.holdoff_s, now
        self.notice = (
            f"powersave: decode pacing resumed {now - probe.started_s:.0f} s into its {probe.length_s:.0f} s pause: "
            f"arrivals did not speed up while paused ({paused_per_s:.2f} req/s against {probe.paced_per_s:.2f} paced; "
            f"a closed loop's would), so they are open-loop; not judged again for {self.holdoff_s:.0f} s"
        )
        self.holdoff_s = min(2.0 * self.holdoff_s, HOLDOFF_S[1])

    def _end_holdoff_on_shift(self, now: float) -> None:
        """End a hold-off whose traffic changed: the rate over the last window left the open loop's
        by more than :data:`HOLDOFF_SHIFT` (a closed loop that replaced it changes the rate as a rule)."""
        self.rate_checked_s = now
        if now >= self.holdoff_until_s or now - self.holdoff_from_s < PACED_WINDOW_S:
            return
        n, per_s = self._rate_since(now - PACED_WINDOW_S)
        if per_s is None or n < PROBE_ARRIVALS:
            return
        if not any(1 / HOLDOFF_SHIFT <= per_s / r <= HOLDOFF_SHIFT for r in self.open_rates_per_s):
            # New traffic: a probe's paced window starts here, not over the traffic before the shift.
            self.holdoff_until_s, self.paced_since_s = None, now

    def observe_idle(self, idle_s: float, now: float) -> None:
        """The engine sat idle ``idle_s`` before its next request. Past :data:`IDLE_RESET_S` a probe's
        rates would span the idle time and whatever load comes next, so the running pause stands
        untested, and a hold-off ends (new traffic is judged afresh)."""
        if idle_s <= IDLE_RESET_S:
            return
        self.traffic_since_s = now
        checking = (self.probe is not None and self.probe.check) or self.recheck is not None
        if checking and idle_s <= CHECK_RESET_IDLE_S and (self.recheck is not None or self._rising(self.probe, now)):
            # Few clients that think leave the engine idle between requests, as a light open load
            # does, but their arrivals rose once pacing was lifted: the check goes on (its counts
            # span the idle time either way). A light open load's unchanged rate ends it here.
            return
        if checking:  # new traffic: no verdict on the old
            self.paused_until, self.recheck = None, None
            self._found_open_by_check(now)
        if idle_s > CHECK_RESET_IDLE_S:  # new traffic: checked as soon as any
            self.check_after_s = CHECK_AFTER_S[0]
        self.probe, self.paced_since_s, self.resumed_s = None, None, None
        self.holdoff_until_s, self.holdoff_s = None, HOLDOFF_S[0]

    def observe_lagged(self, lag: int, after_finish: bool, arrived: bool, now: float) -> None:
        """A loop ``lag`` loops after a held one: whether that one followed a finish, and whether a
        request arrived in this loop's intake (a client whose round trip outlasts the gap)."""
        self._judge(lag, after_finish, arrived, now)

    def _double_check_after(self) -> None:
        self.check_after_s = min(max(2.0 * self.check_after_s, CHECK_AFTER_S[0]), CHECK_AFTER_S[1])

    def _found_open_by_check(self, now: float) -> None:
        """A check found no closed loop: the next check waits twice as long, and a later loop's
        pause starts from the first length."""
        self.checked_s = now
        self._double_check_after()
        if self.pause_from_check:
            self.pause_s, self.pause_from_check = PAUSE_S[0], False

    def _arrivals_since(self, start_s: float, now: float) -> ArrivalCount:
        """The arrivals at or after ``start_s``, over the window from it to ``now``."""
        n = sq = run = 0
        last = None
        for t in reversed(self.arrivals_s):
            if t < start_s:
                break
            if t != last:
                sq, run = sq + run * run, 0
            n, run, last = n + 1, run + 1, t
        return ArrivalCount(n, sq + run * run, now - start_s)

    def _start_check(self, now: float) -> None:
        """Lift pacing as a scheduled check, if the paced window can be read; else the next check
        comes later (a load this light has little to lose)."""
        earliest = max(now if self.paced_since_s is None else self.paced_since_s, self.traffic_since_s)
        if self.resumed_s is not None:
            earliest = max(earliest, self.resumed_s + PACED_WINDOW_S)
        if len(self.arrivals_s) == self.arrivals_s.maxlen:
            earliest = max(earliest, self.arrivals_s[0])
        if now - earliest < CHECK_MIN_PACED_S:
            return
        # A light load's window widens: the more paced arrivals, the smaller a rise the check can tell.
        for span_s in CHECK_PACED_S:
            paced = self._arrivals_since(max(now - span_s, earliest), now)
            if paced.arrivals >= CHECK_ARRIVALS:
                break
        if paced.arrivals < PROBE_ARRIVALS:
            self.checked_s = now
            self._double_check_after()
            return
        self.checks += 1
        self.paused_until = now + CHECK_MAX_S
        self.probe = PauseProbe(now, self.pause_s, paced.per_s, paced=paced)

    def _rising(self, probe: PauseProbe, now: float) -> bool:
        """Whether a check's arrivals so far come at :data:`CHECK_RISE` times the paced rate or more
        (taken as so in its first :data:`CHECK_S`)."""
        if now - probe.started_s < CHECK_S:  # unpaced, the requests in flight finish before their clients come back
            return True
        return self._arrivals_since(probe.started_s, now).per_s >= CHECK_RISE * probe.paced_per_s

    def _decide_check(self, probe: PauseProbe, now: float) -> None:
        """A check's verdict, once its arrivals tell (:data:`CHECK_RISE`, :data:`CHECK_P`)."""
        since_s = now - probe.started_s
        if since_s < CHECK_CONFIRM_S:
            return
        lifted, paced = self._arrivals_since(probe.started_s, now), probe.paced
        per_s = lifted.per_s
        if lifted.arrivals >= PROBE_ARRIVALS and per_s >= CHECK_RISE * probe.paced_per_s and _more_here_chance(lifted, paced) < CHECK_P:
            # Paced again: a closed loop's arrivals fall back, a rate that stepped up does not.
            self.probe, self.paused_until, self.recheck_read_s = None, None, now
            self.recheck = Recheck(now, lifted, probe.paced_per_s, probe.length_s)
        elif since_s >= CHECK_S and lifted.arrivals + paced.arrivals >= CHECK_ARRIVALS and per_s < CHECK_OPEN_BELOW * probe.paced_per_s:
            # Open-loop arrivals keep their rate through the check: no settling after it, or a pause the
            # holds start a few seconds later would stand untested (PACED_WINDOW_S).
            self.probe, self.paused_until, self.paced_since_s = None, None, None
            self._found_open_by_check(now)

    def _decide_recheck(self, rc: Recheck, now: float) -> None:
        """A recheck's verdict: arrivals that fell back make the check a pause (:data:`RECHECK_S`)."""
        since_s = now - rc.started_s
        if since_s < RECHECK_S:
            return
        paced = self._arrivals_since(rc.started_s + RECHECK_SETTLE_S, now)
        per_s = paced.per_s
        fell = per_s * CHECK_RISE <= rc.lifted.per_s and _fewer_here_chance(paced, rc.lifted) < RECHECK_P
        if fell:
            self.recheck = None
            self.check_after_s, self.holdoff_s, self.pause_from_check = CHECK_SOON_S, HOLDOFF_S[0], True
            self._begin_pause(
                now,
                rc.length_s,
                f"powersave: decode pacing paused for {rc.length_s:.0f} s: arrivals rose from {rc.paced_per_s:.2f} to "
                f"{rc.lifted.per_s:.2f} per s in a check without pacing and fell back to {per_s:.2f} paced again "
                "(closed-loop clients that think before their next request, where pacing cannot grow the batch much "
                "and costs throughput)",
            )
        elif since_s >= RECHECK_MAX_S or per_s >= CHECK_OPEN_BELOW**-1 * rc.lifted.per_s:
            self.recheck = None
            self._found_open_by_check(now)

    def _rate_since(self, start_s: float) -> tuple[int, float | None]:
        """Arrivals at or after ``start_s``, and their rate: those after the first instant over the
        span from it to the last (exact for a constant rate whatever the window's phase, and for
        requests that come in groups; None: no span)."""
        n, first_s, at_first = 0, None, 0
        for t in reversed(self.arrivals_s):
            if t < start_s:
                break
            n, at_first = n + 1, (at_first + 1 if t == first_s else 1)
            first_s = t
        if first_s is None or self.arrivals_s[-1] <= first_s:
            return n, None
        return n, (n - at_first) / (self.arrivals_s[-1] - first_s)

    def _scan_rounds(self, start_s: float) -> RoundScan:
        """The arrivals at or after ``start_s`` read as rounds (:data:`ROUND_GAP_S`)."""
        scan, later, arrivals = RoundScan(), None, 0
        for t in reversed(self.arrivals_s):  # newest first
            if later is not None and later - t > ROUND_GAP_S:
                scan.starts_s.append(later)
                scan.from_start.append(arrivals)
                scan.silence_s.append(later - t)
            if t < start_s:
                break
            later, arrivals = t, arrivals + 1
        else:  # the oldest kept arrival: a round start only if nothing was dropped before it
            if later is not None and len(self.arrivals_s) < self.arrivals_s.maxlen:
                scan.starts_s.append(later)
                scan.from_start.append(arrivals)
                scan.silence_s.append(0.0)
        for column in (scan.starts_s, scan.from_start, scan.silence_s):
            column.reverse()
        return scan

    def _rate_in_rounds(self, start_s: float) -> tuple[int, float | None]:
        """Arrivals from the first round start at or after ``start_s`` up to the last, and their rate
        (None: fewer than two round starts, so no whole round)."""
        scan = self._scan_rounds(start_s)
        starts = scan.starts_s
        if len(starts) < 2:
            return 0, None
        n = scan.from_start[0] - scan.from_start[-1]
        return n, n / (starts[-1] - starts[0])

    def _rounds(self, now: float) -> RoundScan | None:
        """The rounds since the last idle spell, within :data:`ROUNDS_WINDOW_S`, if the last
        :data:`ROUNDS_READ` of them up to ``now`` (the one under way included) came as rounds:
        :data:`ROUND_MIN_S` long or more on average, more than one request each, silences at least
        :data:`ROUNDS_SHARE` of the time; None otherwise."""
        scan = self._scan_rounds(max(now - ROUNDS_WINDOW_S, self.traffic_since_s))
        starts = scan.starts_s
        if len(starts) < ROUNDS_READ or (starts[-1] - starts[-ROUNDS_READ]) / (ROUNDS_READ - 1) < ROUND_MIN_S:
            return None
        under_way_s = now - self.arrivals_s[-1]  # a silence under way counts too
        # The silences since the first of them are those its later round starts ended.
        silent_s = sum(scan.silence_s[1 - ROUNDS_READ :]) + (under_way_s if under_way_s > ROUND_GAP_S else 0.0)
        if scan.from_start[-ROUNDS_READ] < 2 * ROUNDS_READ or silent_s < ROUNDS_SHARE * (now - starts[-ROUNDS_READ]):
            return None
        return scan

    @staticmethod
    def _paced_rate_in_rounds(scan: RoundScan, start_s: float) -> tuple[float | None, float | None]:
        """The rate over the fewest last whole rounds of ``scan`` from ``start_s`` on that hold
        :data:`PROBE_ARRIVALS`, and the rounds' mean length (s); (None, None): none do."""
        first = next((i for i, t in enumerate(scan.starts_s) if t >= start_s), len(scan.starts_s))
        starts, counts = scan.starts_s[first:], scan.from_start[first:]
        for i in range(len(starts) - 2, -1, -1):
            n, span_s = counts[i] - counts[-1], starts[-1] - starts[i]
            if n >= PROBE_ARRIVALS:
                return n / span_s, span_s / (len(starts) - 1 - i)
        return None, None

    def _paced_rate(self, now: float) -> tuple[float | None, float | None]:
        """Arrivals per second over the paced window before ``now`` (None: too short, too few
        arrivals, or arrivals beyond those kept), and the rounds' length if they came in rounds."""
        if self.paced_since_s is None:
            return None, None
        settled_s = self.paced_since_s if self.resumed_s is None else max(self.paced_since_s, self.resumed_s + PACED_WINDOW_S)
        rounds = self._rounds(now)
        if rounds is not None:
            return self._paced_rate_in_rounds(rounds, settled_s)
        start = max(now - PACED_WINDOW_S, settled_s)
        if now - start < PROBE_S / 3 or (len(self.arrivals_s) == self.arrivals_s.maxlen and self.arrivals_s[0] > start):
            return None, None
        n, per_s = self._rate_since(start)
        return (per_s if n >= PROBE_ARRIVALS else None), None

    def _judge(self, lag: int, after_finish: bool, woken: bool, now: float) -> None:
        if self.holdoff_until_s is not None and now < self.holdoff_until_s:
            return
        finished, control = self.tally(lag)
        tally = finished if after_finish else control
        tally.holds += 1
        tally.woken += woken
        if control.holds < CONTROL_HOLDS or finished.holds < EARLY_HOLDS:
            return
        early = finished.woken == finished.holds and control.woken <= CONTROL_MAX * control.holds
        if finished.holds < FINISHED_HOLDS and not early:
            return
        (nf, wf), (nc, wc) = (finished.holds, finished.woken), (control.holds, control.woken)
        finished.holds = finished.woken = control.holds = control.woken = 0
        if wf / nf < WOKEN_SHARE or wc / nc > CONTROL_MAX:
            self.open_verdicts.add(lag)
            # Open-loop arrivals: a later loop starts from the first pause.
            if self.open_verdicts >= {0, *LAGS} and not self.pause_from_check:
                self.pause_s = PAUSE_S[0]
            return
        length_s = self.pause_s
        paced_per_s, round_s = self._paced_rate(now)
        self.probe = None if paced_per_s is None else PauseProbe(now, length_s, paced_per_s, round_s)
        self.pause_from_check, self.recheck = False, None
        when = "in holds after a finished request" if lag == 0 else f"{lag} loop(s) after a held step that followed a finished request"
        self._begin_pause(
            now,
            length_s,
            f"powersave: decode pacing paused for {length_s:.0f} s: requests arrived {wf} of {nf} times {when} "
            f"but {wc} of {nc} times after none (closed-loop clients, where pacing cannot grow the batch and only "
            "costs throughput)",
        )

    def _begin_pause(self, now: float, length_s: float, notice: str) -> None:
        """Pause pacing for ``length_s`` and log ``notice``; the loop's next pause is twice as long,
        and the holds' counts start afresh."""
        self.pauses += 1
        self.paused_until = now + length_s
        self.pause_s = min(2.0 * self.pause_s, PAUSE_S[1])
        self.open_verdicts.clear()
        self._clear()
        self.notice = notice

    def take_notice(self) -> str | None:
        msg, self.notice = self.notice, None
        return msg


def _undispersed(here: ArrivalCount, other: ArrivalCount) -> tuple[int, int]:
    """``here``'s arrivals and both windows' together, divided by their dispersion (the sum of
    squares over the sum per loop: 1 for Poisson arrivals one per loop, a group's size for groups):
    requests that come together (a loop takes several, a client sends a group) are not independent
    draws."""
    total = here.arrivals + other.arrivals
    dispersion = max(1.0, (here.sq + other.sq) / total)
    return round(here.arrivals / dispersion), round(total / dispersion)


def _more_here_chance(here: ArrivalCount, other: ArrivalCount) -> float:
    """The chance that arrivals of one rate put as many as ``here``'s or more in its window: each
    of a Poisson process's falls there with the window's share of the time."""
    k, n = _undispersed(here, other)
    return _upper_tail(k, n, here.span_s / (here.span_s + other.span_s))


def _fewer_here_chance(here: ArrivalCount, other: ArrivalCount) -> float:
    """The chance that arrivals of one rate put as few as ``here``'s or fewer in its window: the
    upper tail of the rest, in ``other``'s."""
    k, n = _undispersed(here, other)
    return _upper_tail(n - k, n, 1.0 - here.span_s / (here.span_s + other.span_s))


def _upper_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), 0 < p < 1 (in logs: n reaches thousands at high rates)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    terms: list[float] = []
    top = -math.inf
    for i in range(k, n + 1):
        x = log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        terms.append(x)
        top = max(top, x)
        # Past the mode the terms only fall: stop once they are below e^-40 of the largest (the sum
        # of thousands of them took 0.4-2 ms on the engine's thread, an adversarial review).
        if i > n * p and x < top - 40.0:
            break
    return math.exp(top) * sum(math.exp(x - top) for x in terms)


@dataclass
class PaceStats:
    """What the pacer did (exported on /metrics as ``powersave_decode_pacing_*``)."""

    held_steps: int = 0
    held_s: float = 0.0
    woken_early: int = 0  # holds cut short by an arriving request


class DecodePacer:
    """Spaces decode-only steps to ``tpot_target_ms`` (one pacer per engine-core process).

    :meth:`hold` runs in the engine's busy loop before it takes new requests and steps: it returns
    at once unless a gap is due, and a due gap ends early when ``queue_empty()`` turns false.
    """

    def __init__(
        self,
        tpot_target_ms: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not tpot_target_ms > 0:
            raise ValueError(f"tpot_target_ms must be > 0, got {tpot_target_ms!r}")
        self.period_s = tpot_target_ms / 1000.0
        self.stats = PaceStats()
        self._clock = clock
        self._sleep = sleep
        self._last_step_t: float | None = None  # when the previous step was let go
        self._post_load: int | None = None  # running + waiting once the previous loop took its inputs
        self._hold_running = self._hold_waiting = 0  # running and waiting at this loop's hold
        self._hold_start_s = 0.0  # when this loop's hold began (an idle engine's: when it went idle)
        self._aborted = False  # the previous loop's inputs removed requests (aborts: stop strings, disconnects)
        self._held: HeldStep | None = None  # this loop's hold, judged once its inputs are known
        self._after_finish = False  # this loop's hold came after a finished request
        self._emptied_s: float | None = None  # when a finish left the engine empty, until a request came
        self._recent: deque[LoopTrace] = deque(maxlen=max(LAGS))  # the loops before this one, newest last
        self.guard = ClosedLoopGuard()
        self.off_reason: str | None = None  # set once by turn_off: the pacer holds nothing after

    def turn_off(self, reason: str) -> None:
        """Stop holding for good (a fault, or vLLM's scheduler drifted), keeping the figures."""
        self.off_reason = reason

    def gap_s(self, now: float, facts: PaceFacts) -> float:
        """Seconds to hold the next step (0: let it go now)."""
        if self._last_step_t is None or facts.running <= 0:
            return 0.0
        if facts.waiting > 0 or facts.prefill_pending or facts.running >= facts.max_running:
            return 0.0
        return max(0.0, self._last_step_t + self.period_s - now)

    def hold(self, facts: PaceFacts, queue_empty: Callable[[], bool]) -> float:
        """Hold the engine until the period since the last step has passed, an input arrives or
        nothing is left to pace; returns the seconds held."""
        if self.off_reason is not None:
            return 0.0
        start = self._clock()
        load = facts.running + facts.waiting
        # A request left in the step since the last loop took its inputs, or was aborted by them.
        finished = self._aborted or (self._post_load is not None and load < self._post_load)
        self._hold_running, self._hold_waiting, self._hold_start_s = facts.running, facts.waiting, start
        self._post_load, self._aborted, self._held = None, False, None
        self._after_finish = finished
        if load > 0:
            self._emptied_s = None
        elif finished and self._emptied_s is None:
            self._emptied_s = start
        gap = self.gap_s(start, facts) if queue_empty() and not self.guard.paused(start) else 0.0
        now = start
        if gap > 0.0:
            deadline = start + gap
            woken = False
            while now < deadline:
                if not queue_empty():
                    self.stats.woken_early += 1
                    woken = True
                    break
                self._sleep(min(POLL_S, deadline - now))
                now = self._clock()
            self.stats.held_steps += 1
            self.stats.held_s += now - start
            self._held = HeldStep(finished, woken, now)
        # Only steps with a batch start a period: after an idle spell the first step goes at once.
        self._last_step_t = now if facts.running > 0 else None
        return now - start

    def after_intake(self, running: int, waiting: int = 0) -> None:
        """The engine took its inputs after :meth:`hold`; ``running`` and ``waiting``: the scheduler's
        queues now. vLLM puts a new request in the waiting queue and an abort (a stop string, a
        disconnect) takes one out, of the running queue as a rule: counted apart, an arrival is not
        hidden by an abort taken in the same loop."""
        arrived = max(0, waiting - self._hold_waiting) + max(0, running - self._hold_running)
        aborted = running < self._hold_running or waiting < self._hold_waiting
        held, idle = self._held, self._hold_running + self._hold_waiting == 0
        self._post_load, self._aborted, self._held = running + waiting, aborted, None
        now = self._clock()
        if idle:
            self.guard.observe_idle(now - self._hold_start_s, now)
            self._judge_emptied(arrived, now)
        self.guard.observe_arrivals(arrived, now)
        # Cut short by something else than a request (an abort, a utility call): the hold tells nothing.
        if held is not None and not (held.woken and arrived == 0):
            self.guard.observe_hold(held.after_finish, held.woken, held.at_s)
        if idle:
            # Nothing ran: vLLM's intake blocked until the next request, however long the engine sat
            # idle, so this arrival is no loop "after" the held steps before it.
            self._recent.clear()
        elif any(past.held for past in self._recent):
            for lag, past in enumerate(reversed(self._recent), start=1):
                if past.held:
                    self.guard.observe_lagged(lag, past.after_finish, arrived > 0, now)
        self._recent.append(LoopTrace(held is not None, self._after_finish))

    def _judge_emptied(self, arrived: int, now: float) -> None:
        """A finish that left the engine empty is a case after a finish, woken when the next request
        came within a period: clients with a benchmark's equal lengths may finish together, and no
        hold follows their finish (without this case they never paused in the simulator,
        docs/decode-pacing.md). vLLM runs one empty step after the last finish before its intake
        blocks, so the spell is timed from the first empty loop; past :data:`IDLE_RESET_S` it is an
        idle engine, judged by nothing. While paused nothing is judged, as no hold runs then."""
        if not arrived or self._emptied_s is None:
            return
        waited_s, self._emptied_s = now - self._emptied_s, None
        if waited_s <= IDLE_RESET_S and not self.guard.paused(now):
            self.guard.observe_hold(True, waited_s <= self.period_s, now)

    def figures(self) -> "PaceFigures":
        """What it did so far, stamped on each step's ``SchedulerOutput`` for the workers to publish."""
        g = self.guard
        lifted = self.off_reason is None and g.paused_until is not None and self._clock() < g.paused_until
        checking = lifted and g.probe is not None and g.probe.check
        return PaceFigures(
            self.period_s * 1000.0,
            self.stats.held_steps,
            self.stats.held_s,
            self.stats.woken_early,
            self.off_reason,
            lifted and not checking,
            g.pauses,
            g.withdrawn,
            g.checks,
            checking,
        )


class PaceFigures(NamedTuple):
    """A pacer's figures as they travel to the workers (a tuple: it rides on every step)."""

    tpot_target_ms: float
    held_steps: int
    held_s: float
    woken_early: int
    off_reason: str | None = None  # the pacer turned itself off, and why
    paused: bool = False  # paused by the closed-loop guard right now
    closed_loop_pauses: int = 0
    pauses_withdrawn: int = 0  # pauses withdrawn: arrivals did not speed up (open-loop traffic)
    closed_loop_checks: int = 0  # scheduled checks run (pacing lifted to see whether arrivals speed up)
    checking: bool = False  # pacing lifted right now by a scheduled check (not a pause)
