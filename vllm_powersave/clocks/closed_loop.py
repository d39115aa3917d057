"""Closed-loop decode SM clock: the lowest clock that keeps a *measured* target, per batch bucket.

A static decode clock is a prediction; a wrong model then costs latency with nothing to catch it.
This tuner measures instead, while serving, the way VoltanaLLM (arXiv:2509.04827) and GreenLLM
(arXiv:2508.16449) close the loop on latency, and keeps measuring once it holds a clock:

1. **Baseline.** Per decode batch-size bucket, ``baseline_steps`` steps at the driver's default
   clock. Step time is fitted linearly in the decode context (KV tokens read), so that the
   comparison survives context growth; the residual spread (robust, relative) is the step noise.
2. **One test.** A window of steps at a clock passes if the median of ``step_ms / default(ctx)``
   plus the noise margin (``margin_pct`` + ``noise_z`` standard errors of the median, from the
   measured spread and both windows' lengths) is within the target; ``default(ctx)`` is the
   default clock measured in reference windows around it. Accepting a probe and keeping a held
   clock use this same test, so there is no gap between an accept and a back-off threshold: a
   clock whose true slowdown is at the target passes one test with probability at most
   ``Phi(-noise_z)`` (2.3 % at the default z = 2, normal noise; the median is robust to a few
   slow outlier steps).
3. **Probe.** Bisection over the supported clocks between ``min_sm_clock_mhz`` and the default;
   each probe is bracketed by default-clock reference windows. Wald's sequential test on every
   probe step (same target, same margin) stops a probe over the target as soon as the evidence
   says so, with stated error rates (:meth:`DecodeClockTuner._sprt_over`).
4. **Hold and track.** The lowest passing clock. Its last probe-length window is re-tested every
   4 steps against the default-clock fit, and Page's CUSUM of each held step's excess over the
   target catches a drift within tens of steps; after ``ref_every_steps`` held steps (doubling
   while re-checks pass) or ``rebaseline_s`` a reference window re-measures the default clock
   and the held clock is re-tested against it. A failed test, or all but one of the last ``backoff_steps`` steps each
   clearly over the target, requests the default clock at once; the reference window that
   follows decides: passes (the GPU, not the clock, changed: a co-tenant, thermals) -> the clock
   is held again; fails -> a search above it, starting one ``resolution_mhz`` higher (at the
   held clock itself where only a short window's margin failed). A second CUSUM, of held steps
   faster than the fit, finds the fit stale (the GPU sped up) and measures the default clock
   again at once (a refresh: nothing is tested, the first CUSUM then watches on the fresh fit).
   Reference windows that straddle a GPU change are measured again, and a fit takes its level
   from a fresh window whose level moved, so one fit never spans two GPU states
   (docs/closed-loop.md, "When the whole GPU changes speed").
5. **Retry.** A bucket holding the default clock (noise too high, nothing passed, SLO out of
   reach) searches again after ``retry_after_s``, and a bucket holding a lower clock tries one
   ``resolution_mhz`` below it then (the knee may have moved down); each retry that finds nothing
   doubles the wait, up to ``reprobe_after_s``. Slow switches (the latency the controller
   learns from read-back) stretch the waits and raise a probe's clock ahead of its verdict. A context far outside the fit re-probes;
   :meth:`DecodeClockTuner.reset` (model changed) starts over.
6. **Knee mode.** Where the step noise needs windows too long for the one test (over 512 steps),
   a probe with a large slowdown bounds the memory-bound knee from above under a stated model of
   its shape (below the knee the step time grows as 1/f), every bucket in knee mode holds
   ``knee_margin_pct`` above the bound, a model-free CUSUM guards the held clock, and the knee is
   located again on a schedule (docs/closed-loop.md, "Noisy steps: locate the knee").

Only memory-bound decode steps are tuned: compute-bound steps keep the default clock. Only steps
known to have run entirely at one clock count as measurements (the caller says which clock that
was, or ``UNKNOWN``: :meth:`ClockController.observe_decode_step` knows it from the clock read back
from the GPU, not from what it asked for), so dry-run (nothing set: every step ran at the default)
never reports a probe as measured: an unmeasured probe times out as a reject, and the decision
stream is still computed and recorded. :meth:`DecodeClockTuner.turn_off` (a switch never
confirmed) forgets every held clock: no saving is reported for a clock never read back.

Every decision comes with the measurement behind it as a :class:`ClosedLoopRecord`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

from ..settings import ClosedLoopSettings

#: ``ran_at`` value for a step during which a clock change may have landed (not a measurement).
UNKNOWN = -1
#: Standard error of a sample median relative to sigma/sqrt(n) for normal noise: sqrt(pi/2).
_MEDIAN_SE = math.sqrt(math.pi / 2)
#: A probe is cut short (:meth:`DecodeClockTuner._sprt_over`) no earlier than after this many steps.
_EARLY_STEPS = 3
#: Page's CUSUM on the held clock (:meth:`DecodeClockTuner._held_failed`): each step adds its
#: ratio's excess over the target in single-step spreads, clipped to ``+_HELD_CLIP`` and
#: ``-_CUSUM_CLIP`` (a 3x outlier step adds no more than 1.5: at 5 % outlier steps, 2.5 let
#: ~2 false alarms a minute through on the simulated H200, each a violation and a reference
#: window; docs/results/sim-closed-loop-adversarial.md), and the sum (floored at 0) raises a
#: suspicion above ``_CUSUM_H``.
#: A clock accepted by the one test sits at least its margin (~0.5 spread at 1 % noise) under the
#: target: false alarms every ~e^(2 x 0.5 x 10) / 0.5 ~ 44,000 steps (Siegmund's approximation),
#: each costing one reference window; a clock 1 spread over the target is caught in ~10 steps,
#: 0.3 spread over in ~33 (Page 1954, Biometrika 41:100).
_CUSUM_CLIP = 2.5
_HELD_CLIP = 1.5
_CUSUM_H = 10.0
#: A fresh reference window whose level differs from the steps before it by more than this many
#: standard errors (plus ``margin_pct``) is a changed GPU (:meth:`DecodeClockTuner._refit`): a
#: false call at 4 standard errors is ~6e-5 per window under normal noise.
_SHIFT_Z = 4.0
#: A reference window whose own spread is this many times the bucket's straddled a GPU change
#: (:meth:`DecodeClockTuner._straddled`): at 1 % noise and 50-step windows the robust spread of a
#: clean window exceeds 2x the true one with probability < 1e-6.
_MIXED_X = 3.0
_MAX_REDO = 4
#: A probe resumes where it was when its bucket comes back within this many seconds (a decode
#: batch that swings between sizes); after longer, its reference window is measured again.
_RESUME_S = 2.0
#: Knee mode (docs/closed-loop.md, "Noisy steps: locate the knee"): a re-locate probes this far
#: below the known bound (~12 % slowdown under the model: a short extrapolation), and a locate
#: tries at most this many clocks down a staircase before it takes the bound it has.
_KNEE_DEPTH = 0.12
_KNEE_STAIRS = 5
#: Knee mode where the one test's windows would be longer than this (and ``probe_steps_max``):
#: 2 % noise at the 1 % budget. A search by windows of 512+ steps spends most of its steps on
#: probes and default-clock references (3 % noise: ~90 % of decode steps, decode energy 0.90 on
#: the simulated H200, docs/results/sim-closed-loop-adversarial.md).
_KNEE_ABOVE_STEPS = 512
#: Page's CUSUM threshold of knee mode's guards (log-likelihood units): with the default-clock
#: fit's own error (~0.7 % from 192 steps at 8 % noise) a threshold of 10 fired every few
#: thousand steps on a clock with no slowdown.
_KNEE_GUARD_H = 20.0
#: Default-clock steps a bucket keeps for its fit (one search's baseline and reference windows).
_BASE_STEPS = 256
#: Default-clock steps a knee-mode bucket keeps for its fit's slope (several reference windows).
_KNEE_BASE_STEPS = 1024
#: A normal distribution's sigma over its median absolute deviation (robust spreads).
_MAD_TO_SIGMA = 1.4826
#: Confirmed alarms (one candidate step each) a knee-mode bucket takes between scheduled
#: re-locates before it gives the model up (:meth:`DecodeClockTuner._knee_refuted`).
_KNEE_MAX_OFF = 2
#: Knee mode's guard on a held clock (:meth:`DecodeClockTuner._knee_hold_sample`): Page's CUSUM
#: of the log-likelihood ratio of a slowdown of this many times the room to the target against
#: none. At 8 % noise a window cannot resolve the 1 % target itself, and a guard against it fired
#: on the default-clock fit's own error (~0.7 % from a 192-step window) every few thousand steps.
_KNEE_GUARD_X = 3.0
#: Knee mode measures the default clock again where the decode context has moved beyond the fit's
#: range by this share of the step time (the context part of the step, extrapolated).
_KNEE_CTX_SHARE = 0.03
#: A level shift between a bucket's default-clock windows by this factor or more (either way) is
#: taken as a change of GPU state, and the kept steps before it are scaled to the new state for
#: the slope (:meth:`DecodeClockTuner._to_fresh_state`). Smaller shifts are left as measured: a
#: batch mix that varies inside a bucket, or a level extrapolated over a far context, shifted
#: levels by 0.82-1.23 (bursty buckets, decode batches 224-256), and scaling those cost 0.004 of
#: decode energy (bursty) and 0.16 points of in-budget share (large batches, from 1.10 up)
#: (docs/results/sim-closed-loop-adversarial.md). A +30 % co-tenant shifts by 0.76-0.77 / 1.29-1.31.
_STATE_SHIFT = 1.25
#: Floor of a predicted default-clock step time (ms), far below any real decode step.
_MIN_PREDICTED_MS = 1e-6
#: Another process on the GPU (:meth:`DecodeClockTuner.observe_gpu_tenants`; docs/closed-loop.md,
#: "Another process on the GPU"). After the count of other compute processes changes, steps stay
#: out of the fits and tests ``_TENANT_SETTLE_S``: a step that straddles the change, and the
#: caller's polling lag (the runtime reads NVML's process list every ~0.5 s).
_TENANT_SETTLE_S = 0.5
#: While another process is there nothing is measured, so a held clock runs this many supported
#: clocks above the lowest one known to pass: room for a knee drifting up unseen meanwhile
#: (drifting knee with a co-tenant, simulated H200, held clocks of the bucket's own last 10 s:
#: 99.03 % in budget at 0 steps, 99.64 % at 1; docs/results/sim-closed-loop-adversarial.md).
_TENANT_GUARD_STEPS = 1
#: A held clock is trusted while another process is there only where it was measured in the
#: last ``_TENANT_FRESH_S`` before that process came, in its bucket or (the knee being the
#: memory's, one per GPU, as in knee mode) in any bucket's hold; else the default clock runs.
#: Trusted however old, a bucket back after ~50 s held a clock the drifting knee had passed
#: (99.32 % in budget), and at 20 s 99.36 % (same record).
_TENANT_FRESH_S = 10.0


@dataclass(frozen=True, slots=True)
class ClosedLoopRecord:
    """One decision of the closed loop and the measurement behind it.

    ``event``: ``baseline_done``, ``probe``, ``accept``, ``reject``, ``unmeasured`` (a probe that got
    no step at its clock: dry-run, or the clock never took), ``hold``, ``violation`` (the held
    clock failed a test: default clock now, re-check), ``recheck`` (the re-check passed: held
    again), ``backoff`` (the re-check failed: search above), ``retry``, ``rebaseline``,
    ``reprobe``, ``reset``, ``off``, ``slo_unattainable``, ``bucket`` (active bucket changed),
    ``locate`` (knee mode entered or left, or a knee bound measured),
    ``step`` (an ordinary measured step). Times in s (the caller's monotonic clock),
    step times in ms, clocks in MHz (``None``: driver default).
    """

    t_s: float
    event: str
    bucket: int | None
    batch: int
    sm_clock_mhz: int | None  # requested for the next decode steps
    ran_at_mhz: int | None  # clock the measured step ran at (UNKNOWN: a change landed in it)
    step_ms: float | None
    ratio: float | None  # step_ms / default-clock baseline at the step's context
    target_ratio: float | None
    margin: float | None  # noise margin, in ratio units
    baseline_ms: float | None  # default-clock step time predicted at the step's context
    spread_pct: float | None  # measured relative step noise (robust sigma), percent
    probes: int
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepSample(NamedTuple):
    """One measured decode step: its decode context (KV tokens read) and its time (ms)."""

    ctx_tokens: float
    step_ms: float


class MeasuredStep(NamedTuple):
    """The last measured step, kept per step (a tuple: the per-step path allocates nothing more).
    ``ratio``: to the default-clock fit at its context (``None`` while probing)."""

    t_s: float
    bucket: int
    ran_at_mhz: int | None
    step_ms: float
    ratio: float | None


@dataclass(frozen=True, slots=True)
class LineFit:
    """Default-clock step time as a line in the decode context, fitted robustly (:func:`_fit_line`):
    ``step_ms = a_ms + ms_per_ctx_token * ctx``, the relative residual spread ``sigma`` (robust
    sigma, a fraction), and the context range ``[ctx_lo, ctx_hi]`` of the ``n_steps`` steps it
    was fitted over."""

    a_ms: float
    ms_per_ctx_token: float
    sigma: float
    ctx_lo: float
    ctx_hi: float
    n_steps: int

    def ms_at(self, ctx_tokens: float) -> float:
        """Predicted default-clock step time (ms) at ``ctx_tokens`` of decode context, never below
        ``_MIN_PREDICTED_MS``: a line extrapolated far from its range (a slope fitted on a short
        window) can reach 0 or below, and a step measured against it must then look slow (a
        failed test, the safe side), never divide by zero or pass on a negative ratio."""
        return max(self.a_ms + self.ms_per_ctx_token * ctx_tokens, _MIN_PREDICTED_MS)

    def mid_ms(self) -> float:
        """Predicted step time (ms) at the middle of the context range the line was fitted over."""
        return self.a_ms + self.ms_per_ctx_token * (self.ctx_lo + self.ctx_hi) / 2


@dataclass(frozen=True, slots=True)
class Verdict:
    """The one test (module docstring, step 2) over a window of steps at one clock: the median
    ratio to the default clock, the noise margin, the window's length, and whether
    ``ratio + margin <= target`` (``passes``)."""

    ratio: float
    margin: float
    n_steps: int
    passes: bool


@dataclass(frozen=True, slots=True)
class Suspicion:
    """Why a held clock is re-checked (``why``, for the record) and, where a large violation
    fired it, the steps that did (``guard``: re-judged by the same rule against fresh
    default-clock steps)."""

    why: str
    guard: list[StepSample] | None
    last_n: int | None = None  # only the last n held steps are re-tested (after a change point)


@dataclass(frozen=True, slots=True)
class KneeBound:
    """An upper confidence bound on the memory-bound knee (docs/closed-loop.md, "Noisy steps:
    locate the knee"): ``mhz`` from ``slowdown`` (median, with standard error ``se``) measured at
    ``probe_mhz`` in bucket ``bucket`` at ``t_s``."""

    mhz: float
    probe_mhz: int
    slowdown: float
    se: float
    t_s: float
    bucket: int


@dataclass(frozen=True, slots=True)
class HeldSeen:
    """The last held clock measured on this GPU (any bucket): when, and its candidate index."""

    t_s: float
    index: int


class _Bucket:
    """State of one batch-size bucket (owned by the tuner)."""

    def __init__(self, edge: int, n_cands: int, baseline_n: int) -> None:
        self.edge = edge
        self.state = "baseline"  # baseline | probe | ref | hold | check
        self.need = baseline_n
        self.base: deque[StepSample] = deque(maxlen=_BASE_STEPS)  # at the default clock
        self.fit: LineFit | None = None
        self.target = 1.0
        self.floor = 0  # lowest candidate index allowed in the next search
        self.lo, self.hi = 0, n_cands  # search interval; hi == n_cands is the default clock
        self.held = n_cands
        self.probe: int | None = None  # candidate index being probed (or awaiting its closing ref window)
        self.decided = True  # the probe's verdict is in (early reject), only its ref window remains
        self.samples: list[StepSample] = []  # at the probe clock
        self.ref_prev: list[StepSample] = []
        self.ref_cur: list[StepSample] = []
        self.waited = 0  # steps since the probe was requested without a sample at its clock
        self.probes = 0
        self.window: deque[StepSample] = deque()  # steps at the held clock (a probe-length window)
        self.short_ms: deque[float] = deque()  # their step times (TPOT SLO check)
        self.cusum = 0.0  # Page's CUSUM of the held steps' excess over the target (in spreads)
        self.cusum_n = 0  # held steps since it was last 0 (the change point's estimate)
        self.fast = 0.0  # the same for held steps faster than the default clock's fit (a stale fit)
        self.fast_n = 0
        self.n_win = 0  # probe and reference window length for this bucket's noise
        self.n_held = 0  # measured steps at the held clock (paces the long-window check)
        self.since_check = 0  # measured held steps since the last reference window
        self.check_every = 0  # held steps between scheduled re-checks (0: ref_every_steps)
        self.check_due = 0  # held steps to a re-check after one too short to decide (0: none)
        self.check_scheduled = False  # the running re-check is a scheduled one
        self.check_suspect = False  # the running re-check was raised by a suspicion (a violation)
        self.check: list[StepSample] = []  # the held steps a running re-check tests
        self.after_baseline = "search"  # or "hold" (a refresh)
        self.t_baselined = -math.inf
        self.t_searched = -math.inf
        self.retry_wait_s = 0.0  # current wait of the retry schedule (0: not started)
        self.t_retry = math.inf  # when the next retry is due
        self.lowering_from: int | None = None  # held index a running retry tries to go below
        self.check_guard: list[StepSample] | None = None  # steps that fired a large-violation alarm
        self.next_prior: int | None = None  # where the search goes next if its current probe fails
        self.sprt = 0.0  # the running probe's log-likelihood ratio, over the target vs no slowdown
        self.sprt_fast = 0.0  # the same, faster than the default clock by as much vs no slowdown
        self.stale = 0  # references the running probe found stale and measured again
        self.redo = 0  # reference windows measured again in a row (they straddled a GPU change)
        self.noise: deque[float] = deque(maxlen=5)  # own spreads of the last clean reference windows
        self.early_reject = False  # the probe awaiting its closing reference was stopped early
        self.t_left = -math.inf  # when the batch last left this bucket
        self.t_measured = -math.inf  # its last step measured as the active bucket's
        self.from_prior = False  # the running probe is at a prior (a clock known to pass nearby)
        self.lo_before = 0  # the search interval's lower end before the last verdict
        self.voided: int | None = None  # the last clock whose early stop was voided (probed again)
        self.start_at: int | None = None  # where the next search starts (the clock held before a re-probe)
        self.sprt_line: LineFit | None = None  # the default clock it is measured against
        self.raising = False  # the default clock asked for ahead of the test (slow switches)
        # Knee mode (noise too high for the one test; docs/closed-loop.md, "Noisy steps"):
        self.knee_mode = False
        self.k_phase = ""  # what the running reference window is for: "locate" (then a probe) or "ref"
        self.k_off = 0  # candidate steps held above the knee's bound (one per alarm the steps confirmed)
        self.k_seen_t = -math.inf  # the located bound the held clock comes from (its time)
        self.k_alarm = False  # an alarm since the last scheduled re-locate
        self.k_tested: list[StepSample] = []  # held steps an alarm fired on, judged after the reference
        self.k_bound = math.inf  # lowest knee bound of the running locate (its staircase)
        self.k_stairs = 0  # probes of the running locate
        self.k_refuted = False  # the knee model failed here (:meth:`DecodeClockTuner._knee_refuted`)


def _page_step(total: float, n: int, x: float, up_clip: float) -> tuple[float, int]:
    """One step of Page's CUSUM: ``x`` (in single-step spreads) clipped to ``[-_CUSUM_CLIP,
    up_clip]`` added to ``total``, floored at 0; with ``n``, the steps since it last stood at 0."""
    total = max(0.0, total + min(up_clip, max(-_CUSUM_CLIP, x)))
    return total, n + 1 if total > 0 else 0


def _fit_line(pts: list[StepSample] | deque[StepSample], slope_hint: float = 0.0) -> LineFit:
    """Step ms = a + b * ctx (robust), the relative residual spread and the context range. The
    slope is fitted by least squares, then once more without the steps whose residual is beyond
    4 robust sigmas (a few slow outlier steps would otherwise tilt it)."""
    xs = [c for c, _ in pts]
    ys = [m for _, m in pts]
    a, slope, sigma = _fit_pass(xs, ys, slope_hint)
    if len(xs) >= 8 and sigma > 0:
        keep = [i for i, (x, y) in enumerate(zip(xs, ys)) if abs(y / (a + slope * x) - 1.0) <= 4 * sigma]
        if 4 <= len(keep) < len(xs):
            _, slope2, _ = _fit_pass([xs[i] for i in keep], [ys[i] for i in keep], slope_hint)
            a, slope, sigma = _fit_pass(xs, ys, slope2, fixed=True)
    return LineFit(a, slope, sigma, min(xs), max(xs), len(xs))


def _fit_pass(xs: list[float], ys: list[float], slope_hint: float, fixed: bool = False) -> tuple[float, float, float]:
    """One fit: the slope (least squares, or ``slope_hint`` where ``fixed`` or the context moved
    too little), the median offset, and the robust relative residual spread (1.4826 MAD)."""
    n = len(xs)
    mx = statistics.fmean(xs)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = slope_hint
    # A slope is only estimated where the context moved enough to tell it from noise.
    if not fixed and n >= 4 and mx > 0 and sxx > (0.01 * mx) ** 2 * n:
        my = statistics.fmean(ys)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)  # more context never makes a step faster
    a = statistics.median(y - slope * x for x, y in zip(xs, ys))
    if a + slope * mx <= 0:
        a, slope = statistics.median(ys), 0.0
    rel = [y / (a + slope * x) - 1.0 for x, y in zip(xs, ys)]
    med = statistics.median(rel)
    return a, slope, _MAD_TO_SIGMA * statistics.median(abs(r - med) for r in rel)


class DecodeClockTuner:
    """Chooses the decode SM clock per batch bucket from measured step times. Not thread-safe:
    call it from the thread that runs the steps.

    Args:
        settings: the ``clocks.closed_loop`` section.
        supported_mhz: the GPU's supported SM clocks (MHz); the highest is taken as the default.
    """

    def __init__(self, settings: ClosedLoopSettings, supported_mhz: tuple[int, ...] | list[int]) -> None:
        self.s = settings
        clocks = sorted(set(int(c) for c in supported_mhz))
        if not clocks:
            raise ValueError("supported_mhz is empty")
        self.default_mhz = clocks[-1]
        lo = settings.min_sm_clock_mhz or clocks[0]
        self.cands: tuple[int, ...] = tuple(c for c in clocks if lo <= c < self.default_mhz)
        self.buckets: dict[int, _Bucket] = {}
        self.active: int | None = None
        self._pending: int | None = None
        self._pending_n = 0
        self.records: deque[ClosedLoopRecord] = deque(maxlen=4096)
        self.last: ClosedLoopRecord | None = None  # the last event
        #: The last measured step.
        self.last_step: MeasuredStep | None = None
        self.n_probes = 0
        self.n_backoffs = 0
        self.n_checks = 0
        self.n_records = 0
        #: Why the loop was turned off for good (:meth:`turn_off`), ``None`` while it runs.
        self.off_reason: str | None = None
        #: The SM clock last read back from the GPU by the controller (MHz; ``None``: unread).
        self.read_back_mhz: int | None = None
        #: Set by the controller: nothing is ever applied (dry-run), so a probe that got no step at
        #: its clock is over after its wait; elsewhere it waits on (the clock was kept up by
        #: compute-bound steps and the dwell, not refused).
        self.dry_run = False
        #: The switch latency learned by the controller from read-back (s; ``None``: not yet).
        self.switch_latency_s: float | None = None
        self._budget = settings.slowdown_budget_pct / 100.0
        #: The knee's last located bound (knee mode), shared by every bucket in knee mode, and when
        #: it is located again (the schedule doubles while it stays put).
        self.knee: KneeBound | None = None
        self.knee_due_s = math.inf
        self._knee_every_s = 0.0
        self._margin0 = settings.margin_pct / 100.0
        #: Other compute processes on this GPU (:meth:`observe_gpu_tenants`; ``None``: unknown).
        self.tenants: int | None = None
        self._tenant_t = -math.inf  # when that count last changed (s)
        self._tenant_at = -math.inf  # the latest time it or a step was fed (s)
        self._tenant_came = -math.inf  # when the count last rose from 0 (s)
        self._gpu_held = HeldSeen(-math.inf, len(self.cands))
        self.n_tenant_steps = 0  # measured steps left out because another process shared the GPU

    # -- public ------------------------------------------------------------------------------
    def bucket_of(self, batch: int) -> int:
        """Lower edge of the bucket holding ``batch`` (the smallest edge for batches below it)."""
        edges = self.s.batch_buckets
        b = edges[0]
        for e in edges:
            if e <= batch:
                b = e
            else:
                break
        return b

    def clock_for(self, bucket: int | None) -> int | None:
        """The clock the tuner wants for decode steps of ``bucket`` now (``None``: default)."""
        if bucket is None:
            return None
        b = self.buckets.get(bucket)
        if b is None or b.state in ("baseline", "ref", "check") or self.off_reason is not None:
            return None
        if self._tenant_now() and b.state in ("probe", "hold"):
            return self._tenant_clock(b)
        if b.state == "probe" and b.probe is not None:
            return None if b.raising else self.cands[b.probe]
        return None if b.held >= len(self.cands) else self.cands[b.held]

    def phase_of(self, batch: int) -> str:
        """What the clock a decode step of ``batch`` gets now is for (diagnostics, e.g. the
        replay's out-of-budget causes): ``off``; ``other_bucket`` (the active bucket's clock: the
        batch left it fewer than ``bucket_dwell_steps`` steps ago); ``baseline`` or ``reference``
        (default-clock windows: a search's or a re-check's); ``probe``; ``step_down`` (a retry's
        probe below the held clock); ``tenant`` (another process shares the GPU: the held clock,
        unmeasured, :meth:`observe_gpu_tenants`); ``held`` (a clock below the default); ``default``."""
        if self.off_reason is not None or self.active is None:
            return "off"
        if self.bucket_of(batch) != self.active:
            return "other_bucket"
        b = self.buckets.get(self.active)
        if b is None or b.state == "baseline":
            return "baseline"
        if b.state in ("ref", "check"):
            return "reference"
        if b.state in ("probe", "hold") and self._tenant_now():
            return "tenant"
        if b.state == "probe":
            return "step_down" if b.lowering_from is not None else "probe"
        return "default" if b.held >= len(self.cands) else "held"

    def turn_off(self, now_s: float, reason: str) -> None:
        """Stop for good (a clock switch was never confirmed): every bucket holds the default
        clock, and no held clock (so no saving) is reported any more."""
        if self.off_reason is not None:
            return
        self.off_reason = reason
        for b in self.buckets.values():
            b.state, b.held, b.probe = "hold", len(self.cands), None
        self._emit(now_s, "off", None, 0, reason=reason)

    def observe_gpu_tenants(self, now_s: float, others: int | None) -> None:
        """Feed how many *other* compute processes share this GPU now (NVML's process list:
        :meth:`~vllm_powersave.device.nvml.NvmlGpu.other_compute_processes`); ``None``: unknown
        (no NVML, a driver without the call), and the loop behaves as without this signal.

        While the count is non-zero, and for ``_TENANT_SETTLE_S`` after it changes, a step-time
        shift is taken as the other process's doing: steps are not measured (no back-off, no probe
        verdict, no reference window raised by them, no fit), the held clock stays (one supported
        clock up, :meth:`_tenant_clock`), and a running probe pauses. The stated assumption (docs/closed-loop.md, "Another process on
        the GPU"): another process slows every clock alike, stock included, so a clock in budget
        without it stays in budget with it; one that slows some clocks more goes unchecked while
        it is there.
        """
        if others is not None and self.tenants is not None and others != self.tenants:
            self._tenant_t = now_s
        if others and not self.tenants:
            self._tenant_came = now_s
        self.tenants = others
        self._tenant_at = max(self._tenant_at, now_s)

    def _tenant_now(self, now_s: float | None = None) -> bool:
        """Another process shares the GPU, or the count changed under ``_TENANT_SETTLE_S`` ago."""
        if self.tenants is None:
            return False
        t = self._tenant_at if now_s is None else now_s
        return self.tenants > 0 or t - self._tenant_t < _TENANT_SETTLE_S

    def _tenant_clock(self, b: _Bucket) -> int | None:
        """The clock while another process shares the GPU (nothing is measured then): a running
        probe pauses, and the lowest clock known to pass (the held one, or the search's upper end
        after a back-off) runs ``_TENANT_GUARD_STEPS`` supported clocks higher, so that a knee
        drifting up meanwhile, unseen, has that much room (docs/closed-loop.md, "Another process
        on the GPU")."""
        i = max(b.held, b.hi) if b.state == "probe" else b.held
        if b.t_measured < self._tenant_came - _TENANT_FRESH_S:
            if self._gpu_held.t_s < self._tenant_came - _TENANT_FRESH_S:
                return None
            i = max(i, self._gpu_held.index)
        i = min(len(self.cands), i + _TENANT_GUARD_STEPS)
        return None if i >= len(self.cands) else self.cands[i]

    def reset(self, now_s: float, reason: str = "reset") -> None:
        """Forget every bucket (the model or the GPU changed): baselines and searches start over."""
        self.buckets.clear()
        self.knee, self.knee_due_s, self._knee_every_s = None, math.inf, 0.0
        self._gpu_held = HeldSeen(-math.inf, len(self.cands))
        self.active, self._pending, self._pending_n = None, None, 0
        self._emit(now_s, "reset", None, 0, reason=reason)

    def observe(
        self,
        now_s: float,
        batch: int,
        step_ms: float,
        ran_at_mhz: int | None,
        ctx_tokens: float = 0.0,
        memory_bound: bool = True,
        tokens: int | None = None,
    ) -> int | None:
        """Feed one finished engine step; returns the SM clock for the next decode steps.

        ``now_s``: the step's end (s, monotonic); ``batch``: decode requests in the step;
        ``step_ms``: its time (on the GPU where timed there: device/step_timer.py); ``ran_at_mhz``:
        the clock it ran at entirely (``None``: default, ``UNKNOWN``: a change landed in it); ``ctx_tokens``: decode context
        (KV tokens read); ``memory_bound``: False for compute-bound steps (they keep the default
        clock and are not measured); ``tokens``: tokens scheduled in the step (``None``: ``batch``,
        a pure decode step). A small mixed step (prompt tokens riding along) gets the bucket's clock
        but is not a measurement: its time depends on the prompt tokens, which the fit does not
        model. Returns ``None`` for the default clock.
        """
        if not memory_bound or batch <= 0 or not (step_ms > 0.0) or math.isinf(step_ms) or self.off_reason is not None:
            return None
        ctx = float(ctx_tokens)
        edge = self.bucket_of(batch)
        self._choose_bucket(now_s, edge, batch)
        if tokens is not None and tokens != batch:
            return self._clock_now()  # not a measurement, and no sign that a probe clock did not take
        self._tenant_at = max(self._tenant_at, now_s)
        if self._tenant_now(now_s):
            self.n_tenant_steps += 1
            return self._clock_now()  # another process's doing, not the clock's: nothing measured
        if ran_at_mhz == self.default_mhz:
            ran_at_mhz = None
        b = self._bucket(edge)
        if edge == self.active:
            b.t_measured = now_s
            if b.state == "hold":
                self._gpu_held = HeldSeen(now_s, b.held)
        if edge != self.active:
            # Free baseline data for a bucket that is not driving the clock.
            if ran_at_mhz is None and b.state == "baseline":
                self._baseline_sample(now_s, b, batch, step_ms, ctx)
            return self._clock_now()
        if b.state == "baseline":
            if ran_at_mhz is None:
                self._baseline_sample(now_s, b, batch, step_ms, ctx)
        elif b.state == "ref":
            if ran_at_mhz is None:
                self._ref_sample(now_s, b, batch, step_ms, ctx)
        elif b.state == "probe":
            if b.knee_mode:
                self._knee_probe_sample(now_s, b, batch, step_ms, ran_at_mhz, ctx)
            else:
                self._probe_sample(now_s, b, batch, step_ms, ran_at_mhz, ctx)
        elif b.state == "check":
            if ran_at_mhz is None:
                self._check_sample(now_s, b, batch, step_ms, ctx)
        else:
            self._hold_sample(now_s, b, batch, step_ms, ran_at_mhz, ctx)
        return self._clock_now()

    def _clock_now(self) -> int | None:
        """The clock for the next decode steps: the active bucket's, or at once the higher one of
        a bucket the batch has just moved into (raising is safe; lowering waits for
        ``bucket_dwell_steps``, so a brief visit neither restarts a search nor runs a large batch
        at a small batch's clock)."""
        f = self.clock_for(self.active)
        if self._pending is None or f is None:
            return f
        g = self.clock_for(self._pending) if self._pending in self.buckets else None
        return None if g is None else max(f, g)

    def snapshot(self) -> dict[str, Any]:
        """Figures for ``/metrics`` and reports: per bucket its state and clock; counters."""
        out: dict[str, Any] = {
            "active_bucket": self.active,
            "probes_total": self.n_probes,
            "backoffs_total": self.n_backoffs,
            "checks_total": self.n_checks,
            "gpu_tenants": self.tenants,
            "tenant_steps_total": self.n_tenant_steps,
            "decisions_total": self.n_records,
            "off_reason": self.off_reason,
            "read_back_mhz": self.read_back_mhz,
            "switch_latency_ms": None if self.switch_latency_s is None else round(1e3 * self.switch_latency_s, 3),
            "buckets": {},
        }
        for e, b in sorted(self.buckets.items()):
            fit = b.fit
            out["buckets"][e] = {
                "state": b.state,
                "sm_clock_mhz": self.clock_for(e),
                # Only a clock accepted on steps measured at it (read back) is ever held.
                "held_mhz": None if b.held >= len(self.cands) or self.off_reason is not None else self.cands[b.held],
                "baseline_ms": None if fit is None else round(fit.mid_ms(), 4),
                "spread_pct": None if fit is None else round(100 * fit.sigma, 3),
                "target_ratio": round(b.target, 5),
                "probes": b.probes,
            }
        return out

    # -- internals ---------------------------------------------------------------------------
    def _bucket(self, edge: int) -> _Bucket:
        b = self.buckets.get(edge)
        if b is None:
            b = self.buckets[edge] = _Bucket(edge, len(self.cands), self.s.baseline_steps)
        return b

    def _choose_bucket(self, now_s: float, edge: int, batch: int) -> None:
        if self.active is None:
            self.active = edge
            self._emit(now_s, "bucket", edge, batch, reason="first decode step")
            return
        if edge == self.active:
            self._pending, self._pending_n = None, 0
            return
        if edge != self._pending:
            self._pending, self._pending_n = edge, 0
        self._pending_n += 1
        if self._pending_n >= self.s.bucket_dwell_steps:
            old, self.active = self.active, edge
            self._pending, self._pending_n = None, 0
            if old is not None and old in self.buckets:
                self.buckets[old].t_left = now_s
            b = self._bucket(edge)
            if b.state == "probe" and now_s - b.t_left > _RESUME_S:
                # Away longer than _RESUME_S: its reference window may be stale (the GPU may have
                # changed meanwhile), so the default clock is measured again, then this probe.
                b.state, b.samples, b.ref_cur, b.decided, b.raising = "ref", [], [], False, False
                b.ref_prev = []
                b.k_phase = "locate"
            self._emit(
                now_s, "bucket", edge, batch, b=b, reason=f"batch stayed in bucket {edge} for {self.s.bucket_dwell_steps} steps (was {old})"
            )

    def _predict(self, b: _Bucket, ctx: float) -> float:
        assert b.fit is not None
        return b.fit.ms_at(ctx)

    def _margin(self, b: _Bucket, n: int, n_ref: int | None = None, extra_z: float = 0.0) -> float:
        sigma = b.fit.sigma if b.fit else 0.0
        n_base = n_ref if n_ref is not None else (b.fit.n_steps if b.fit else 1)
        z = self.s.noise_z + extra_z
        return self._margin0 + z * _MEDIAN_SE * sigma * math.sqrt(1.0 / max(1, n) + 1.0 / max(1, n_base))

    def _refit(self, b: _Bucket, fresh: list[StepSample] | None = None) -> None:
        """The default-clock fit from the most recent default-clock steps (older ones may predate a
        change of the GPU: thermals, another tenant). ``fresh``: the reference window just
        measured; where its level differs from the kept steps' beyond their noise (the GPU
        changed between them), the level comes from it alone, so that a fit never averages two
        GPU states (its spread would then be the gap between them, not the step noise)."""
        keep = max(self.s.baseline_steps, 4 * self._ref_n(b))
        pts = list(b.base)
        # The slope from every kept step (the widest context range), the level from the recent ones.
        slope = _fit_line(pts).ms_per_ctx_token if len(pts) > keep else 0.0
        fit = _fit_line(pts[-keep:], slope)
        if fresh and len(fresh) >= self.s.ref_steps and len(pts) > len(fresh):
            older = pts[-keep : -len(fresh)] or pts[: -len(fresh)]
            # The slope from the steps before the fresh window: one fit over both GPU states,
            # while the context only grows, tilts to absorb the change (ten-fold under a +30 %
            # co-tenant, docs/results/sim-closed-loop-adversarial.md), which then hides it.
            slope = _fit_line(pts[: -len(fresh)]).ms_per_ctx_token
            if self._shifted(older, fresh, slope):
                # The level and spread from the fresh window alone; the slope from the kept steps
                # before it (a shift moves the level, not the slope), and so the context range it
                # may be extrapolated over: the fresh window's own brought a re-check every 5 %
                # the context moved on (~150 in 600 s under a co-tenant, two thirds of its
                # reference windows: docs/results/sim-closed-loop-adversarial.md).
                fit = replace(_fit_line(fresh, slope), ctx_lo=fit.ctx_lo, ctx_hi=fit.ctx_hi)
                self._to_fresh_state(b, _fit_line(older, slope), _fit_line(fresh, slope), len(fresh))
        b.fit = fit
        if self.s.tpot_slo_ms is not None and b.t_baselined > -math.inf:
            # An absolute SLO is a ratio target that tightens as the context (step time) grows.
            b.target = self.s.tpot_slo_ms / b.fit.ms_at(b.fit.ctx_hi)

    def _to_fresh_state(self, b: _Bucket, old: LineFit, new: LineFit, n_fresh: int) -> None:
        """The kept default-clock steps before a fresh window that found the GPU changed by a
        factor of ``_STATE_SHIFT`` or more, scaled to the fresh window's state (by the ratio of
        the two levels at its context), so that the slope is fitted on steps of one GPU state: a
        fit over both, while the context only grows, tilts with every arrival and departure of
        another tenant (30-160 times the true slope under a +30 % co-tenant in the tests'
        ``SharedGpu`` driver)."""
        mid = (new.ctx_lo + new.ctx_hi) / 2
        k = new.ms_at(mid) / old.ms_at(mid)
        if abs(math.log(k)) < math.log(_STATE_SHIFT):
            return
        n_old = len(b.base) - n_fresh
        for i in range(n_old):
            c, ms = b.base[i]
            b.base[i] = StepSample(c, ms * k)

    def _noise(self, b: _Bucket) -> float:
        """The bucket's step noise (relative robust sigma): the median own spread of its last clean
        reference windows, so that a fit across a GPU change (two levels) never passes for noise."""
        if b.noise:
            return statistics.median(b.noise)
        return b.fit.sigma if b.fit else 0.0

    def _straddled(self, b: _Bucket, fresh: list[StepSample]) -> bool:
        """Whether a just-measured reference window straddled a change of the GPU (another tenant
        came or went in it): its own spread over ``_MIXED_X`` times the bucket's noise. Such a
        window is dropped and measured again (at most ``_MAX_REDO`` times in a row; then the
        noise is taken as real), so that one badly timed window neither parks the bucket as too
        noisy nor decides a test. Clean windows update the noise (:meth:`_noise`)."""
        if b.fit is None or len(fresh) < 8:
            return False
        own = _fit_line(fresh, b.fit.ms_per_ctx_token).sigma
        if own <= _MIXED_X * max(self._noise(b), 1e-3) or b.redo >= _MAX_REDO:
            b.redo = 0
            b.noise.append(own)
            return False
        b.redo += 1
        for _ in range(min(len(fresh), len(b.base))):
            b.base.pop()  # its steps were the last ones appended
        fresh.clear()
        return True

    def _shifted(self, older: list[StepSample], fresh: list[StepSample], slope: float) -> bool:
        """Whether the default clock changed between ``older`` and ``fresh`` steps (the GPU changed:
        another tenant, thermals): their levels differ beyond their noise (``margin_pct`` +
        ``_SHIFT_Z`` standard errors, where their contexts are near enough to compare levels), or
        one fit over both spreads ``_MIXED_X`` times as wide as ``fresh`` alone."""
        if len(older) < 2 or len(fresh) < 8:
            return False
        new, old = _fit_line(fresh, slope), _fit_line(older, slope)
        if _fit_line(older + fresh, slope).sigma > _MIXED_X * max(new.sigma, 1e-3):
            return True
        mid = (new.ctx_lo + new.ctx_hi) / 2
        sigma = max(min(new.sigma, old.sigma), 1e-3)
        tol = self._margin0 + _SHIFT_Z * _MEDIAN_SE * sigma * math.sqrt(1.0 / new.n_steps + 1.0 / old.n_steps)
        if 0.95 * old.ctx_lo <= mid <= 1.05 * old.ctx_hi:
            return abs(new.ms_at(mid) / old.ms_at(mid) - 1.0) > tol
        if slope <= 0:
            return False  # too far apart in context, and no slope measured to bridge them
        # Too far apart in context to trust the slope: a change only where no slope from 0 to
        # twice the fitted one explains the gap (more context never makes a step faster). A
        # re-check comes when the context has moved on, so it would otherwise miss every change.
        ends = (old.mid_ms(), old.mid_ms() + 2.0 * slope * (mid - (old.ctx_lo + old.ctx_hi) / 2))
        level = new.ms_at(mid)
        return level > max(ends) * (1.0 + tol) or level < min(ends) * (1.0 - tol)

    def _test(self, b: _Bucket, samples: list[StepSample], line: LineFit, n_ref: int, extra_z: float = 0.0) -> Verdict:
        """The one test (module docstring, step 2): ``samples`` at one clock against ``line``,
        the default clock fitted over ``n_ref`` steps (``extra_z``: only for early looks)."""
        med = statistics.median(ms / line.ms_at(c) for c, ms in samples)
        margin = self._margin(b, len(samples), n_ref, extra_z=extra_z)
        return Verdict(med, margin, len(samples), med + margin <= b.target)

    def _baseline_sample(self, now_s: float, b: _Bucket, batch: int, step_ms: float, ctx: float) -> None:
        sample = StepSample(ctx, step_ms)
        b.base.append(sample)
        b.ref_cur.append(sample)
        b.need -= 1
        if b.need > 0:
            return
        self._refit(b)
        b.t_baselined = now_s
        fit = b.fit
        assert fit is not None
        sigma, c_hi, n = fit.sigma, fit.ctx_hi, fit.n_steps
        base_hi = fit.ms_at(c_hi)
        b.target = self.s.tpot_slo_ms / base_hi if self.s.tpot_slo_ms is not None else 1.0 + self._budget
        reason = f"{n} default-clock steps: {base_hi:.3f} ms at ctx {c_hi:.0f}, spread {100 * sigma:.2f} %" + (
            f"; SLO {self.s.tpot_slo_ms:g} ms" if self.s.tpot_slo_ms is not None else f"; budget {100 * self._budget:g} %"
        )
        self._emit(now_s, "baseline_done", b.edge, batch, step_ms=step_ms, base=self._predict(b, ctx), b=b, reason=reason)
        b.n_win = self._window(b)
        b.ref_prev, b.ref_cur = b.ref_cur[-self._ref_n(b) :], []
        if b.after_baseline == "hold":
            b.state = "hold"
            self._clear_windows(b)
            return
        if (b.knee_mode or self._need(b) > self._knee_above()) and b.floor < len(self.cands) and self._knee_ok(b):
            self._knee_enter(now_s, b, batch)
            return
        if b.n_win <= 0 or b.floor >= len(self.cands):
            b.state, b.held, b.probe = "hold", len(self.cands), None
            b.t_searched = now_s
            self._schedule_retry(now_s, b, found=False)
            unattainable = self.s.tpot_slo_ms is not None and b.target < 1.0
            why = (
                "no clock left above the one that failed"
                if b.floor >= len(self.cands)
                else f"step noise {100 * sigma:.2f} % needs more than {self.s.probe_steps_max} steps per window to resolve the target"
            )
            self._emit(
                now_s,
                "slo_unattainable" if unattainable else "hold",
                b.edge,
                batch,
                b=b,
                reason=f"default clock kept: {why}; retry in {b.retry_wait_s:.0f} s",
            )
            return
        b.lo, b.hi, b.probes = b.floor, len(self.cands), 0
        prior, b.start_at = (b.start_at if b.start_at is not None else self._prior(b)), None
        self._next_probe(now_s, b, batch, prior=prior)

    def _clear_windows(self, b: _Bucket) -> None:
        k = self.s.backoff_steps
        b.window = deque(maxlen=max(b.n_win, k, self.s.knee_ref_steps if b.knee_mode else 0))
        b.short_ms = deque(maxlen=k)
        b.since_check = 0
        b.cusum, b.cusum_n = 0.0, 0
        b.fast, b.fast_n = 0.0, 0

    def _ref_n(self, b: _Bucket) -> int:
        """Default-clock steps after each probe: half a window (with the one before, a full one);
        ``knee_ref_steps`` in knee mode."""
        if b.knee_mode:
            return self.s.knee_ref_steps
        return max(self.s.ref_steps, b.n_win // 2)

    def _window(self, b: _Bucket) -> int:
        """Window length (steps) at which the noise margin takes at most 1/2.5 of the room to the
        target, at least ``probe_steps``; 0 if that needs more than ``probe_steps_max``."""
        need = self._need(b)
        if need > self.s.probe_steps_max:
            return 0
        return max(self.s.probe_steps, self.s.ref_steps, need)

    def _need(self, b: _Bucket, sigma: float | None = None) -> float:
        """Steps per window the one test needs (:meth:`_window`) at the bucket's noise (or
        ``sigma``); inf where there is no room below the target."""
        room = b.target - 1.0 - self._margin0
        if room <= 0:
            return math.inf
        if sigma is None:
            # A spread beyond _MIXED_X x the bucket's noise is two GPU states in one fit, not noise.
            sigma = min(b.fit.sigma, _MIXED_X * self._noise(b)) if b.fit else 0.0
        # Margin <= room / 2.5: a clock with no slowdown then fails the test only beyond 2.5 z
        # standard errors (0.6 % of tests at z = 2).
        return math.ceil(2.0 * (self.s.noise_z * _MEDIAN_SE * sigma / (room / 2.5)) ** 2)

    def _restart(self, now_s: float, b: _Bucket, batch: int, event: str, reason: str, search: bool) -> None:
        b.state = "baseline"
        b.k_tested = []  # knee mode stays: the noise is the host's, not the batch mix's
        b.need = self.s.baseline_steps
        if search and event == "reprobe":
            b.base.clear()
        b.after_baseline = "search" if search else "hold"
        b.probe, b.samples, b.waited, b.ref_cur = None, [], 0, []
        if search:
            # A re-probe (the batch mix changed) starts its search at the clock held so far: the
            # memory-bound knee is the GPU's, so it is likely near (then one step lower is tried).
            b.start_at = b.held if event == "reprobe" and b.held < len(self.cands) else None
            b.held = len(self.cands)
        self._emit(now_s, event, b.edge, batch, b=b, reason=reason)

    def _schedule_retry(self, now_s: float, b: _Bucket, found: bool) -> None:
        """The retry schedule (module docstring, step 5): from ``retry_after_s``, doubled after
        each retry that found nothing, up to ``reprobe_after_s``."""
        s = self.s
        if not s.reprobe_after_s:
            b.t_retry = math.inf
            return
        first = min(s.retry_after_s, s.reprobe_after_s)
        b.retry_wait_s = first if found or b.retry_wait_s <= 0 else min(2.0 * b.retry_wait_s, s.reprobe_after_s)
        b.t_retry = now_s + min(s.reprobe_after_s, b.retry_wait_s * self._lag_factor(b))

    def _lag_steps(self, b: _Bucket) -> float:
        """Decode steps of this bucket that still run at a clock after the raise away from it
        was asked for: the learned switch latency in step times, less the step in which its
        read-back came (the latency is measured to that step's end)."""
        if self.switch_latency_s is None or b.fit is None:
            return 0.0
        step_s = max(b.fit.mid_ms(), 1e-3) / 1e3
        return max(0.0, self.switch_latency_s / step_s - 1.0)

    def _lag_factor(self, b: _Bucket) -> float:
        """How much slower switches stretch the retry schedule (docs/closed-loop.md, step 5): a
        lowering that fails costs the steps the sequential test needs to stop it (at least
        ``_EARLY_STEPS``) plus :meth:`_lag_steps` at the failed clock; the schedule is set for a
        switch that lands within one step, so its waits grow by ``(_EARLY_STEPS + lag) /
        (_EARLY_STEPS + 1)`` (1 up to a lag of one step)."""
        return max(1.0, (_EARLY_STEPS + self._lag_steps(b)) / (_EARLY_STEPS + 1.0))

    def _prior(self, b: _Bucket) -> int | None:
        """Candidate index a neighbouring bucket holds (searched), nearest batch first."""
        near = sorted(
            (abs(math.log(e / b.edge)), o.held)
            for e, o in self.buckets.items()
            if o is not b and o.t_searched > -math.inf and o.held < len(self.cands)
        )
        return near[0][1] if near else None

    def _index_near(self, mhz: float) -> int:
        """Index of the lowest candidate at or above ``mhz`` (``len(cands)``: the default)."""
        for i, c in enumerate(self.cands):
            if c >= mhz:
                return i
        return len(self.cands)

    def _search_done(self, now_s: float, b: _Bucket, batch: int) -> None:
        b.state, b.held, b.probe, b.next_prior, b.voided = "hold", b.hi, None, None, None
        b.t_searched = now_s
        self._clear_windows(b)
        if b.lowering_from is not None:  # a retry below the held clock
            self._schedule_retry(now_s, b, found=b.hi < b.lowering_from)
            b.lowering_from = None
        else:
            # A search above a clock that failed (b.floor > 0) found no saving: the wait goes on
            # doubling, so a GPU drifting upward is not probed below its clock every retry_after_s.
            self._schedule_retry(now_s, b, found=b.hi < len(self.cands) and b.floor == 0)
        self._emit(now_s, "hold", b.edge, batch, b=b, reason=f"lowest clock meeting the target after {b.probes} probes")

    def _next_probe(self, now_s: float, b: _Bucket, batch: int, prior: int | None = None) -> None:
        c = self.cands
        hi_mhz = self.default_mhz if b.hi >= len(c) else c[b.hi]
        narrow = b.lo < b.hi and hi_mhz - c[b.lo] < self.s.resolution_mhz
        if b.lo >= b.hi or narrow or b.probes >= self.s.max_probes_per_bucket:
            self._search_done(now_s, b, batch)
            return
        b.state = "probe"
        given = prior is not None  # by the caller (a neighbour's or the held clock), not chained
        if prior is None:
            prior, b.next_prior = b.next_prior, None
        in_range = prior is not None and b.lo <= prior < b.hi
        b.from_prior = given and in_range
        if in_range:
            idx = prior  # a neighbouring bucket passed there on this GPU, or one step from the held clock
        else:
            idx = (b.lo + b.hi - 1) // 2  # lower middle: hi is known good
            # Bounded cost of a failed probe: never below max_step_down x the lowest clock known to pass.
            floor_mhz = self.s.max_step_down * hi_mhz
            while idx < b.hi - 1 and c[idx] < floor_mhz:
                idx += 1
        b.probe = idx
        b.samples, b.waited, b.decided, b.raising, b.stale = [], 0, False, False, 0
        b.probes += 1
        self.n_probes += 1
        self._emit(
            now_s,
            "probe",
            b.edge,
            batch,
            b=b,
            reason=f"bisection over {self.cands[b.lo]}..{'default' if b.hi >= len(self.cands) else self.cands[b.hi]} MHz",
        )

    def _verdict(self, now_s: float, b: _Bucket, batch: int, ref: list[StepSample], early: bool) -> None:
        assert b.probe is not None and b.fit is not None
        # The probe's steps against the default clock measured around them (the bucket's fit
        # alone where that is too short to fit: its slope and offset).
        line = _fit_line(ref, b.fit.ms_per_ctx_token) if len(ref) >= 2 else b.fit
        test = self._test(b, b.samples, line, len(ref))
        n, med, margin = test.n_steps, test.ratio, test.margin
        want = self.cands[b.probe]
        # Early (the sequential test stopped it, :meth:`_sprt_over`): over the target.
        verdict = "reject" if early or not test.passes else "accept"
        b.decided = True
        base = line.ms_at(b.samples[-1].ctx_tokens)
        self._emit(
            now_s,
            verdict,
            b.edge,
            batch,
            ran_at=want,
            step_ms=b.samples[-1].step_ms,
            ratio=med,
            margin=margin,
            base=base,
            b=b,
            reason=f"median of {n} steps at {want} MHz against {len(ref)} default-clock steps around them"
            + (f" (stopped early: sequential test {b.sprt:.1f})" if early else ""),
        )
        b.early_reject = early
        b.lo_before = b.lo
        if verdict == "accept" and b.from_prior:
            # A clock known to pass nearby (a neighbouring bucket, or the held one) passed here
            # too: the knee is likely close below it, so one resolution_mhz lower is tried next
            # rather than a bisection step far below (each failed probe costs the steps a raise
            # takes to land).
            b.next_prior = self._index_near(want - self.s.resolution_mhz)
        if verdict == "accept":
            b.hi = b.probe
        else:
            b.lo = b.probe + 1

    def _early_reject_void(self, b: _Bucket) -> bool:
        """Whether a probe the sequential test stopped early is to be probed again, judged once its
        closing reference window is in: the GPU is slower now than in the reference before it
        (the slowdown may have been the GPU's, not the clock's), or its steps pass the one test
        against both reference windows (the reference before it was too short to stop on: the
        first one after a baseline)."""
        assert b.fit is not None
        slope = b.fit.ms_per_ctx_token
        if not b.samples:
            return False
        if self._shifted(b.ref_prev, b.ref_cur, slope) and _fit_line(b.ref_cur, slope).mid_ms() > _fit_line(b.ref_prev, slope).mid_ms():
            return True
        ref = b.ref_prev + b.ref_cur
        return self._test(b, b.samples, _fit_line(ref, slope), len(ref)).passes

    def _probe_sample(self, now_s: float, b: _Bucket, batch: int, step_ms: float, ran_at: int | None, ctx: float) -> None:
        assert b.probe is not None
        want = self.cands[b.probe]
        if ran_at != want:
            if b.raising and ran_at is None:
                b.raising = False  # the early raise landed before the test decided: probe on
            b.waited += 1
            if b.waited > 3 * self.s.probe_steps + 10:
                if not self.dry_run:
                    b.waited = 0  # the clock was held up (dwell, compute-bound steps, read-back): keep asking
                    return
                self._emit(
                    now_s,
                    "unmeasured",
                    b.edge,
                    batch,
                    ran_at=ran_at,
                    step_ms=step_ms,
                    b=b,
                    reason=f"dry-run: no step ran at {want} MHz, counted as a reject",
                )
                b.lo = b.probe + 1
                b.samples, b.decided = [], True
                b.state, b.ref_cur = "ref", []
            return
        b.samples.append(StepSample(ctx, step_ms))
        n = len(b.samples)
        if b.ref_prev and self._sprt_over(b, ctx, step_ms) and n >= _EARLY_STEPS:
            self._verdict(now_s, b, batch, b.ref_prev, early=True)
        elif n >= _EARLY_STEPS and b.sprt_fast >= self._sprt_a() and b.stale < 2:
            # Faster than the default clock measured before it: that reference is stale (the GPU
            # was slower then), so measure the default clock again, then this probe from its start.
            # At most twice per probe; then its full window against both references decides.
            b.state, b.samples, b.ref_cur, b.ref_prev, b.raising = "ref", [], [], [], False
            b.stale += 1
            self._emit(now_s, "rebaseline", b.edge, batch, b=b, reason=f"steps at {want} MHz faster than the default clock before them")
            return
        b.raising = not b.decided and b.sprt >= self._raise_at(b)
        if b.decided or n >= b.n_win:
            b.state, b.ref_cur = "ref", []  # back to the default clock for the closing reference window
            return
        self._step(now_s, b, batch, ran_at, step_ms, None, None, None)

    def _sprt_over(self, b: _Bucket, ctx: float, step_ms: float) -> bool:
        """Wald's sequential probability ratio test on the probe's steps (one per step), whether it
        says: over the target. H0: the clock adds no slowdown beyond ``margin_pct`` (ratio
        ``1 + margin_pct``); H1: its slowdown is at the target; the gap ``d`` between them is the
        room the one test's window is sized for. Each step adds ``d / sigma`` times its ratio's
        distance from the midpoint, in single-step spreads ``sigma`` (clipped to +-``_CUSUM_CLIP``:
        an outlier step adds no more). Stop (reject) at ``A = ln((1 - beta) / alpha)``; the sum
        is floored at ``B = ln(beta / (1 - alpha))`` (where Wald's test would accept H0) and
        watched to the end of the window, where the one test decides. Error rates (Wald 1945,
        normal noise): Wald's bounds, ``alpha / (1 - beta)`` (0.51 % at the defaults) for
        stopping a clock with no slowdown and ``beta / (1 - alpha)`` (2 %) for a clock at the
        target running on, hold for the unfloored test; with the floor, simulated at 1 % noise
        over 122-step windows after a 61-step reference: 0.5 % of clocks with no slowdown beyond
        ``margin_pct`` stopped, 5.5 % of clocks at the target run on (where the one test still
        rejects them with probability 1 - Phi(-noise_z)). The ratios are
        against the reference window before the probe, whose own error (variance ``se_ref^2``,
        shared by every step) is paid for by raising the midpoint by ``A se_ref^2 / d``: for a
        Brownian walk the chance of crossing ``A`` then stays at its nominal bound averaged over
        that error."""
        fit = b.fit
        assert fit is not None
        if len(b.samples) == 1:  # a new probe (or one resumed): a fresh test
            b.sprt = b.sprt_fast = 0.0
            b.sprt_line = _fit_line(b.ref_prev, fit.ms_per_ctx_token) if len(b.ref_prev) >= 2 else fit
        d = b.target - 1.0 - self._margin0
        if d <= 0 or b.sprt_line is None:
            return False
        s = self.s
        a = self._sprt_a()
        sigma = max(fit.sigma, 1e-3)
        se_ref2 = (_MEDIAN_SE * sigma) ** 2 / len(b.ref_prev)
        mid = 1.0 + self._margin0 + d / 2 + a * se_ref2 / d
        r = step_ms / b.sprt_line.ms_at(ctx)
        x = (r - mid) / sigma
        b.sprt += d / sigma * min(_CUSUM_CLIP, max(-_CUSUM_CLIP, x))
        # Floored at B rather than stopping there: a clock that changes during the probe (another
        # tenant, thermals) is still caught, and the walk never carries more than |B| of credit.
        floor = math.log(s.sprt_beta / (1.0 - s.sprt_alpha))
        b.sprt = max(floor, b.sprt)
        # The mirror test, steps faster than the default by d (a lower clock never is): the
        # reference is stale (measured under another tenant), see _probe_sample.
        x_fast = (1.0 - d / 2 - a * se_ref2 / d - r) / sigma
        b.sprt_fast = max(floor, b.sprt_fast + d / sigma * min(_CUSUM_CLIP, max(-_CUSUM_CLIP, x_fast)))
        return b.sprt >= a

    def _sprt_a(self) -> float:
        """The sequential test's upper (reject) bound, ``ln((1 - beta) / alpha)``."""
        return math.log((1.0 - self.s.sprt_beta) / self.s.sprt_alpha)

    def _raise_at(self, b: _Bucket) -> float:
        """Where a probe's sequential test asks for the default clock ahead of its verdict when
        switches are slow (docs/closed-loop.md, step 3): at ``A - lag x KL``, ``KL = (d /
        sigma)^2 / 2`` being what a step at the target adds on average and ``lag`` the steps
        still run at the probe clock until a raise lands (:meth:`_lag_steps`), but never below
        ``A / 2``. The steps run while it lands still count (read back at the probe clock), and
        only ``A`` rejects: a raise that lands first is undone and the probe goes on, so the
        error rates are the test's. Inf (never) under a lag of less than two steps."""
        lag = self._lag_steps(b)
        d = b.target - 1.0 - self._margin0
        if lag < 2.0 or b.fit is None or d <= 0:
            return math.inf
        a = self._sprt_a()
        kl = 0.5 * (d / max(b.fit.sigma, 1e-3)) ** 2
        return max(a / 2, a - lag * kl)

    def _ref_sample(self, now_s: float, b: _Bucket, batch: int, step_ms: float, ctx: float) -> None:
        sample = StepSample(ctx, step_ms)
        b.ref_cur.append(sample)
        b.base.append(sample)
        if len(b.ref_cur) < self._ref_n(b) or self._straddled(b, b.ref_cur):
            return
        if b.knee_mode:
            self._knee_ref_done(now_s, b, batch)
            return
        if b.early_reject and b.probe is not None and b.probe != b.voided and self._early_reject_void(b):
            b.lo = min(b.lo, b.lo_before)  # the search interval as it was before that reject
            b.next_prior = b.voided = b.probe  # probed again once; a second early stop stands
        b.early_reject = False
        self._refit(b, b.ref_cur)
        n_win = self._window(b)
        if n_win <= 0 and b.floor < len(self.cands) and self._knee_ok(b):
            self._knee_enter(now_s, b, batch)  # the noise grew past what the windows resolve
            return
        if n_win <= 0:  # the noise grew past what the windows can resolve: keep what passed so far
            b.lo = b.hi
        else:
            b.n_win = n_win
        if b.probe is not None and not b.decided:
            if b.samples and b.stale < 2 and self._shifted(b.ref_prev, b.ref_cur, b.fit.ms_per_ctx_token):
                # The default clock changed between the windows around the probe (another tenant
                # came or went): its steps cannot be told apart from the change, so it runs again
                # after this fresh reference (at most twice per probe, as the mirror test).
                b.stale += 1
                b.samples = []
                self._emit(
                    now_s,
                    "rebaseline",
                    b.edge,
                    batch,
                    b=b,
                    reason=f"the default clock changed around the probe at {self.cands[b.probe]} MHz",
                )
            if b.samples:
                self._verdict(now_s, b, batch, b.ref_prev + b.ref_cur, early=False)
            else:  # resumed after a bucket change, or the GPU changed: probe again with this fresh reference
                b.ref_prev, b.ref_cur = b.ref_cur, []
                b.state, b.waited = "probe", 0
                return
        b.ref_prev, b.ref_cur = b.ref_cur, []
        self._next_probe(now_s, b, batch)

    def _hold_sample(self, now_s: float, b: _Bucket, batch: int, step_ms: float, ran_at: int | None, ctx: float) -> None:
        if b.knee_mode:
            self._knee_hold_sample(now_s, b, batch, step_ms, ran_at, ctx)
            return
        held = None if b.held >= len(self.cands) else self.cands[b.held]
        assert b.fit is not None
        if self._left_hold(now_s, b, batch, ctx, held) or ran_at != held:
            return
        base = self._predict(b, ctx)
        r = step_ms / base
        if held is None:
            b.base.append(StepSample(ctx, step_ms))  # holding the default: every step is a baseline sample
            self._step(now_s, b, batch, ran_at, step_ms, r, None, base)
            return
        s = self.s
        b.window.append(StepSample(ctx, step_ms))
        if s.tpot_slo_ms is not None:
            b.short_ms.append(step_ms)
        b.n_held += 1
        b.since_check += 1
        x = (r - b.target + self._margin0) / max(b.fit.sigma, 1e-3)
        b.cusum, b.cusum_n = _page_step(b.cusum, b.cusum_n, x, _HELD_CLIP)
        sus = self._held_failed(b)
        if sus is not None:
            self._violation(now_s, b, batch, ran_at, step_ms, base, held, sus)
            return
        if self._fit_stale(b, r):
            # Held steps faster than the default clock's fit: the GPU sped up (a tenant left), so the
            # fit is stale and the CUSUM above would be blind by as much; measure the default again.
            # Nothing is tested: the few steps since the change failed the one test on their margin
            # alone, and each tenant's departure probed the held clock again (co-tenant scenario,
            # docs/results/sim-closed-loop-adversarial.md); the CUSUM watches it on the fresh fit.
            self._start_check(b, [])
            return
        if b.check_due and b.since_check >= b.check_due:
            b.check_due = 0
            self._start_check(b, list(b.window))  # a window after a re-check too short to decide
            return
        if b.since_check >= (b.check_every or s.ref_every_steps) or (s.rebaseline_s and now_s - b.t_baselined > s.rebaseline_s):
            self._start_check(b, list(b.window))  # scheduled: the default clock measured again, then the same test
            b.check_scheduled = True
            return
        self._step(now_s, b, batch, ran_at, step_ms, r, None, base)

    def _left_hold(self, now_s: float, b: _Bucket, batch: int, ctx: float, held: int | None) -> bool:
        """Whether the held bucket leaves plain holding at this step (True: it did): a re-probe when
        the decode context left the fit's range by far, a retry when one is due (module
        docstring, step 5), a re-check (a held clock below the default only) when the context
        moved beyond what the fit may be extrapolated to."""
        s = self.s
        assert b.fit is not None
        lo, hi = b.fit.ctx_lo, b.fit.ctx_hi
        f = s.reprobe_ctx_factor
        if ctx > hi * f + 1 or ctx < lo / f - 1:
            b.floor = 0
            self._restart(
                now_s,
                b,
                batch,
                "reprobe",
                f"decode context {ctx:.0f} left the measured range {lo:.0f}..{hi:.0f} by more than x{f:g} (batch mix changed)",
                search=True,
            )
            return True
        if now_s >= b.t_retry:
            return self._retry(now_s, b, batch, held)
        if held is None:
            return False
        # Extrapolate the default-clock fit no further than the range it was measured over
        # (at least 5 %, at most rebaseline_ctx_pct): a slope from a narrow range is uncertain.
        reach = min(hi * s.rebaseline_ctx_pct / 100.0, max(0.05 * hi, hi - lo)) + 1
        if ctx > hi + reach or ctx < lo - reach:
            self._start_check(b, list(b.window))
            return True
        return False

    def _retry(self, now_s: float, b: _Bucket, batch: int, held: int | None) -> bool:
        """A due retry: a bucket at the default clock searches again from a fresh baseline; one
        holding a lower clock measures the default clock, re-tests, then tries one step lower."""
        b.t_retry = math.inf
        if held is None:
            b.floor = 0
            self._restart(now_s, b, batch, "retry", f"default clock held {b.retry_wait_s:.0f} s: searching again", search=True)
            return True
        if b.held == 0:
            self._schedule_retry(now_s, b, found=False)
            return False
        b.lowering_from = b.held
        self._emit(now_s, "retry", b.edge, batch, b=b, reason=f"{held} MHz held {b.retry_wait_s:.0f} s: trying one step lower")
        self._start_check(b, list(b.window))
        return True

    def _clearly_over(self, b: _Bucket, samples: list[StepSample], line: LineFit) -> bool:
        """All but one of ``samples`` (the last ``backoff_steps``) each over the target by more
        than ``margin_pct`` + ``noise_z`` single-step spreads: a large violation, told apart
        from a few slow outlier steps (2-5 % of steps at 3x fire it with probability ~1e-6)."""
        k = len(samples)
        if k < self.s.backoff_steps or b.fit is None:
            return False
        one = self._margin0 + self.s.noise_z * b.fit.sigma
        ratios = sorted(ms / line.ms_at(c) for c, ms in samples)
        return ratios[1 if k > 1 else 0] > b.target + one

    def _fit_stale(self, b: _Bucket, ratio: float) -> bool:
        """Page's CUSUM of held steps faster than the default-clock fit (the mirror of the one in
        :meth:`_held_failed`): a clock below the default is never faster than the default clock
        on the same GPU, so steps faster than ``1 - d`` (``d`` the room to the target) in
        single-step spreads, summed past ``_CUSUM_H``, say the GPU sped up since the fit."""
        assert b.fit is not None
        d = max(b.target - 1.0 - self._margin0, 0.0)
        x = (1.0 - d - ratio) / max(b.fit.sigma, 1e-3)
        b.fast, b.fast_n = _page_step(b.fast, b.fast_n, x, _CUSUM_CLIP)
        return b.fast > _CUSUM_H

    def _held_failed(self, b: _Bucket) -> Suspicion | None:
        """Why the held clock must be re-checked now, or ``None``: :meth:`_clearly_over` on the
        last ``backoff_steps`` steps (tested every step), or the test's point estimate plus its
        fixed margin over the target on the probe-length window (every 4 steps once full; the
        repeated looks make a full margin fire too often on a good clock). Either only raises the
        suspicion: a reference window of default-clock steps decides (:meth:`_check_done`)."""
        k = self.s.backoff_steps
        assert b.fit is not None
        last = list(b.window)[-k:]
        if self._clearly_over(b, last, b.fit):
            return Suspicion(f"{max(1, k - 1)} of the last {k} steps clearly over the target", last)
        if b.cusum > _CUSUM_H:
            # The re-check tests the steps since the CUSUM last stood at 0 (after the change).
            n = max(k, b.cusum_n)
            return Suspicion(f"CUSUM of the last {n} held steps' excess over the target {b.cusum:.1f} spreads", None, n)
        slo = self.s.tpot_slo_ms
        if slo is not None and len(b.short_ms) >= k and statistics.median(b.short_ms) > slo:
            return Suspicion(f"median of the last {k} steps over the TPOT SLO {slo:g} ms", None)
        n = len(b.window)
        if n == b.window.maxlen and n > k and b.n_held % 4 == 0:
            med = statistics.median(ms / b.fit.ms_at(c) for c, ms in b.window)
            if med + self._margin0 > b.target:
                return Suspicion(f"median of the last {n} steps {100 * (med - 1):+.2f} % over the target", None)
        return None

    def _violation(
        self, now_s: float, b: _Bucket, batch: int, ran_at: int | None, step_ms: float, base: float, held: int, sus: Suspicion
    ) -> None:
        """The held clock is suspect (:meth:`_held_failed`): the default clock at once, and a
        reference window that decides (:meth:`_check_done`)."""
        self._emit(
            now_s,
            "violation",
            b.edge,
            batch,
            ran_at=ran_at,
            step_ms=step_ms,
            base=base,
            b=b,
            reason=f"{sus.why} at {held} MHz: default clock now, then re-checked against it",
        )
        tested = list(b.window)
        self._start_check(b, tested[-sus.last_n :] if sus.last_n else tested, sus.guard)
        b.check_suspect = True

    def _start_check(self, b: _Bucket, tested: list[StepSample], guard: list[StepSample] | None = None) -> None:
        b.state, b.ref_cur, b.check, b.check_guard = "check", [], tested, guard
        b.check_scheduled = b.check_suspect = False
        self.n_checks += 1

    def _check_sample(self, now_s: float, b: _Bucket, batch: int, step_ms: float, ctx: float) -> None:
        sample = StepSample(ctx, step_ms)
        b.ref_cur.append(sample)
        b.base.append(sample)
        if len(b.ref_cur) < self._ref_n(b) or self._straddled(b, b.ref_cur):
            return
        self._check_done(now_s, b, batch)

    def _check_done(self, now_s: float, b: _Bucket, batch: int) -> None:
        """A re-check's reference window is complete: the held steps against the default clock
        measured around them, by the one test (the steps that fired a large-violation alarm by
        the same alarm: the default clock may have slowed as much, e.g. another tenant). Passes:
        held again (or, for a due retry, one step lower is tried); fails: a search above the
        held clock, from one ``resolution_mhz`` higher."""
        assert b.fit is not None
        # The reference windows before and after the held steps, unless the GPU changed between
        # them (then only the one after: a line through two GPU states fits neither).
        slope = b.fit.ms_per_ctx_token
        ref = b.ref_prev + b.ref_cur
        shifted = self._shifted(b.ref_prev, b.ref_cur, slope)
        if shifted:
            ref = list(b.ref_cur)
        line = _fit_line(ref, slope)
        # After a change, held steps no suspicion fired on were watched against the fit before
        # it and ran in its GPU state: against the window after it alone, a tenant's departure
        # failed them by its own +30 % and ratcheted clocks up (co-tenant scenario,
        # docs/results/sim-closed-loop-adversarial.md). Steps a CUSUM fired on are after its
        # change point: judged against the window after it.
        old_state = shifted and not b.check_suspect
        test_line, n_ref = (b.fit, b.fit.n_steps) if old_state else (line, len(ref))
        self._refit(b, b.ref_cur)
        b.t_baselined = now_s
        b.ref_prev, b.ref_cur = b.ref_cur, []
        held_mhz = self.cands[b.held] if b.held < len(self.cands) else self.default_mhz
        n_win = self._window(b)
        test = self._test(b, b.check, test_line, n_ref) if b.check else None
        fails = self._clearly_over(b, b.check_guard, line) if b.check_guard else test is not None and not test.passes
        b.check, b.check_guard = [], None
        if n_win > 0:
            b.n_win = n_win
        elif b.floor < len(self.cands) and self._knee_ok(b):
            self._knee_enter(now_s, b, batch)  # the noise grew past what the windows resolve
            return
        if (
            n_win > 0
            and fails
            and not b.check_suspect
            and test is not None
            and test.n_steps < b.n_win
            and test.ratio + self._margin0 <= b.target
        ):
            self._undecided(now_s, b, batch, held_mhz, test)
            return
        if fails or n_win <= 0:
            self._back_off(now_s, b, batch, held_mhz, test, len(ref))
            return
        if b.lowering_from is not None:
            b.lo, b.hi, b.probes = 0, b.held, 0
            self._next_probe(now_s, b, batch, prior=self._index_near(held_mhz - self.s.resolution_mhz))
            return
        b.state = "hold"
        self._clear_windows(b)
        # Each scheduled re-check that passes doubles the held steps to the next one (the CUSUM
        # and window tests watch the held clock between them; rebaseline_s still bounds the time).
        every = b.check_every or self.s.ref_every_steps
        b.check_every = 2 * every if b.check_scheduled else every
        if test is not None:
            self._emit(
                now_s,
                "recheck",
                b.edge,
                batch,
                ratio=test.ratio,
                margin=test.margin,
                b=b,
                reason=f"median of {test.n_steps} steps at {held_mhz} MHz within the target against {len(ref)} default-clock steps",
            )

    def _undecided(self, now_s: float, b: _Bucket, batch: int, held_mhz: int, test: Verdict) -> None:
        """A re-check no suspicion raised, of fewer held steps than a window, whose median is within
        the target and only their margin failed: too few to decide either way (one soon after the
        last, the context having moved on: most back-offs under a co-tenant, each probing the
        held clock again; docs/results/sim-closed-loop-adversarial.md). The clock is held on and
        re-checked once a window of held steps is in; the CUSUM watches it meanwhile. After a
        suspicion, that is evidence of a drift, and :meth:`_back_off` probes the held clock again."""
        b.state = "hold"
        self._clear_windows(b)
        b.check_due = b.n_win
        reason = f"{test.n_steps} steps at {held_mhz} MHz within the target: too few to decide; re-checked after {b.n_win}"
        self._emit(now_s, "recheck", b.edge, batch, ratio=test.ratio, margin=test.margin, b=b, reason=reason)

    def _back_off(self, now_s: float, b: _Bucket, batch: int, held_mhz: int, test: Verdict | None, n_ref: int) -> None:
        """The re-check failed: a search above the held clock, its first probe one
        ``resolution_mhz`` higher (the default clock where nothing is left or the noise grew past
        what the windows resolve)."""
        self.n_backoffs += 1
        b.check_every = 0  # the GPU changed: scheduled re-checks every ref_every_steps again
        b.lowering_from = None
        # Over the target on the point estimate: the search starts above the held clock. Within
        # it, and failed only on the margin of a short window (a suspicion's last steps): the
        # held clock is probed again first, by the sequential test against the fresh reference,
        # so that noise alone never ratchets a bucket upward.
        unproven = test is not None and test.ratio + self._margin0 <= b.target
        b.floor = min(len(self.cands), b.held + (0 if unproven else 1))
        self._emit(
            now_s,
            "backoff",
            b.edge,
            batch,
            ratio=None if test is None else test.ratio,
            margin=None if test is None else test.margin,
            b=b,
            reason=f"{held_mhz} MHz over the target against {n_ref} default-clock steps: searching above it",
        )
        if b.n_win <= 0 or self._window(b) <= 0 or b.floor >= len(self.cands):
            b.hi = len(self.cands)
            self._search_done(now_s, b, batch)
            return
        b.lo, b.hi, b.probes = b.floor, len(self.cands), 0
        self._next_probe(now_s, b, batch, prior=b.held if unproven else self._index_near(held_mhz + self.s.resolution_mhz))

    # -- knee mode (docs/closed-loop.md, "Noisy steps: locate the knee") -------------------------
    def _knee_ok(self, b: _Bucket) -> bool:
        """Whether a bucket whose noise the one test cannot resolve locates the knee instead of
        keeping the default clock: ``knee_locate``, a slowdown budget with room above the margin
        (not an absolute SLO: the knee bounds a slowdown), and clocks are set (not dry-run)."""
        room = b.target - 1.0 - self._margin0
        return self.s.knee_locate and not b.k_refuted and self.s.tpot_slo_ms is None and room > 0 and not self.dry_run and bool(self.cands)

    def _knee_above(self) -> int:
        """Knee mode where the one test needs windows longer than this (steps)."""
        return min(self.s.probe_steps_max, _KNEE_ABOVE_STEPS)

    def _knee_enter(self, now_s: float, b: _Bucket, batch: int) -> None:
        """Knee mode: a reference window of ``knee_ref_steps`` default-clock steps, then a locate
        (where no bound is known yet) or the hold at the known bound."""
        b.knee_mode, b.k_off, b.k_alarm, b.k_tested = True, 0, False, []
        # The slope from several reference windows (a wider context range): at 8 % noise one
        # window's slope is mostly noise, and extrapolated it fired the guards.
        b.base = deque(b.base, maxlen=_KNEE_BASE_STEPS)
        b.held, b.probe, b.t_retry, b.lowering_from = len(self.cands), None, math.inf, None
        b.state, b.ref_cur, b.samples = "ref", [], []
        b.k_phase = "enter"
        sigma = b.fit.sigma if b.fit else 0.0
        reason = f"step noise {100 * sigma:.2f} % needs more than {self.s.probe_steps_max} steps per window: locating the knee"
        self._emit(now_s, "locate", b.edge, batch, b=b, reason=reason)

    def _knee_ref_done(self, now_s: float, b: _Bucket, batch: int) -> None:
        """A knee-mode reference window is in: the fit from it; the steps an alarm fired on against
        it (their median over the target: the clock, not the GPU, is slow: one more candidate
        step above the bound); then a locate probe or the hold."""
        assert b.fit is not None
        self._refit(b, b.ref_cur)
        b.t_baselined = now_s
        b.ref_prev, b.ref_cur = b.ref_cur, []
        own = _fit_line(b.ref_prev, b.fit.ms_per_ctx_token).sigma  # this window's own spread
        if b.k_phase == "enter" and self._need(b, own) <= self._knee_above():
            self._knee_exit(now_s, b, batch)
            return
        if b.k_tested:
            line = _fit_line(b.ref_prev, b.fit.ms_per_ctx_token)
            med = statistics.median(ms / line.ms_at(c) for c, ms in b.k_tested)
            se = _MEDIAN_SE * max(b.fit.sigma, 1e-3) * math.sqrt(1.0 / len(b.k_tested) + 1.0 / len(b.ref_prev))
            b.k_tested = []
            if med - self.s.noise_z * se > b.target:  # significantly over the target: the clock
                b.k_off += 1
                b.k_phase = "locate"
            reason = f"alarm's steps {100 * (med - 1):+.2f} % (se {100 * se:.2f} %) against the fresh default clock"
            if b.k_off > _KNEE_MAX_OFF:
                self._knee_refuted(now_s, b, batch, reason)
                return
            self._emit(now_s, "recheck" if b.k_phase != "locate" else "backoff", b.edge, batch, ratio=med, b=b, reason=reason)
        if b.k_phase in ("locate", "enter") and (self.knee is None or now_s >= self.knee_due_s) or b.k_phase == "locate":
            b.k_bound, b.k_stairs = math.inf, 0
            self._knee_probe(now_s, b, batch, self._knee_first_probe())
        else:
            self._knee_hold(now_s, b, batch)

    def _knee_refuted(self, now_s: float, b: _Bucket, batch: int, why: str) -> None:
        """More confirmed alarms than ``_KNEE_MAX_OFF`` between scheduled re-locates: the held
        clock keeps failing above the bound, so the model (no slowdown above the knee) does not
        fit this bucket (e.g. steps near the compute ridge slow at every clock). The bucket keeps
        the default clock and retries by the one test only (knee mode off until a reset)."""
        b.knee_mode, b.k_refuted, b.k_phase = False, True, ""
        b.base = deque(b.base, maxlen=_BASE_STEPS)
        b.state, b.held, b.probe = "hold", len(self.cands), None
        b.t_searched = now_s
        self._clear_windows(b)
        self._schedule_retry(now_s, b, found=False)
        self._emit(now_s, "locate", b.edge, batch, b=b, reason=f"{why}: the knee model does not fit, default clock kept")

    def _knee_exit(self, now_s: float, b: _Bucket, batch: int) -> None:
        """The reference window that opened knee mode says the noise is low enough for the one
        test after all (the 12 baseline steps overstated it): the search instead."""
        b.knee_mode, b.k_phase = False, ""
        b.base = deque(b.base, maxlen=_BASE_STEPS)
        b.n_win = self._window(b)
        b.ref_prev = b.ref_prev[-self._ref_n(b) :]
        b.lo, b.hi, b.probes = b.floor, len(self.cands), 0
        self._emit(
            now_s,
            "locate",
            b.edge,
            batch,
            b=b,
            reason=f"step noise {100 * b.fit.sigma:.2f} % over {self.s.knee_ref_steps} steps: searching",
        )
        self._next_probe(now_s, b, batch, prior=self._prior(b))

    def _knee_first_probe(self) -> int:
        """First locate probe: ``_KNEE_DEPTH`` below the known bound (a slowdown of ~12 %: short
        extrapolation), else ``max_step_down`` x the default clock (a staircase down from there)."""
        f = self.knee.mhz / (1.0 + _KNEE_DEPTH) if self.knee is not None else self.s.max_step_down * self.default_mhz
        return min(len(self.cands) - 1, self._index_near(f))

    def _knee_probe(self, now_s: float, b: _Bucket, batch: int, idx: int) -> None:
        b.state, b.probe = "probe", idx
        b.samples, b.waited, b.decided, b.raising = [], 0, False, False
        b.probes += 1
        b.k_stairs += 1
        self.n_probes += 1
        self._emit(
            now_s, "probe", b.edge, batch, b=b, reason=f"locating the knee: {self.s.knee_probe_steps} steps at {self.cands[idx]} MHz"
        )

    def _knee_probe_sample(self, now_s: float, b: _Bucket, batch: int, step_ms: float, ran_at: int | None, ctx: float) -> None:
        assert b.probe is not None
        if ran_at != self.cands[b.probe]:
            b.waited += 1
            if b.waited > 3 * self.s.probe_steps + 10:
                b.waited = 0  # held up (dwell, compute-bound steps, read-back): keep asking
            return
        b.samples.append(StepSample(ctx, step_ms))
        if len(b.samples) >= self.s.knee_probe_steps:
            self._knee_located(now_s, b, batch)

    def _knee_located(self, now_s: float, b: _Bucket, batch: int) -> None:
        """The locate probe's verdict: its median slowdown ``s`` against the reference before it,
        with standard error ``se``, bounds the knee from above by ``f_p (1 + s + noise_z se)``
        (the model: below its knee a step's time grows as 1/f; above it, not at all). Without a
        clear slowdown (``s - noise_z se <= 0``: the probe may be above the knee) the next probe
        goes deeper, at most ``_KNEE_STAIRS`` probes per locate."""
        assert b.fit is not None and b.probe is not None
        fp = self.cands[b.probe]
        line = _fit_line(b.ref_prev, b.fit.ms_per_ctx_token) if len(b.ref_prev) >= 2 else b.fit
        ratios = [ms / line.ms_at(c) for c, ms in b.samples]
        med = statistics.median(ratios)
        own = _MAD_TO_SIGMA * statistics.median(abs(r / med - 1.0) for r in ratios)
        sigma = max(b.fit.sigma, own, 1e-3)
        se = _MEDIAN_SE * sigma * med * math.sqrt(1.0 / len(ratios) + 1.0 / max(1, len(b.ref_prev)))
        z = self.s.noise_z
        b.k_bound = min(b.k_bound, fp * (1.0 + max(0.0, med - 1.0 + z * se)))
        clear = med - 1.0 - z * se > 0
        reason = f"median slowdown {100 * (med - 1):+.2f} % (se {100 * se:.2f} %) over {len(ratios)} steps at {fp} MHz: knee <= {b.k_bound:.0f} MHz"
        self._emit(now_s, "locate", b.edge, batch, ran_at=fp, ratio=med, margin=z * se, b=b, reason=reason)
        if not clear and b.probe > 0 and b.k_stairs < _KNEE_STAIRS:
            step = self.s.max_step_down if self.knee is None else 1.0 / (1.0 + _KNEE_DEPTH)
            self._knee_probe(now_s, b, batch, min(b.probe - 1, self._index_near(fp * step)))
            return
        old = self.knee
        self.knee = KneeBound(b.k_bound, fp, med - 1.0, se, now_s, b.edge)
        put = old is not None and abs(b.k_bound / old.mhz - 1.0) <= self.s.knee_margin_pct / 200.0
        first = self.s.rebaseline_s or self.s.reprobe_after_s or math.inf
        self._knee_every_s = min(2.0 * self._knee_every_s, self.s.reprobe_after_s or math.inf) if put else first
        self.knee_due_s = now_s + self._knee_every_s
        self._knee_hold(now_s, b, batch)

    def _knee_hold(self, now_s: float, b: _Bucket, batch: int) -> None:
        """Hold ``knee_margin_pct`` above the knee's bound (and ``k_off`` candidate steps more)."""
        kb = self.knee
        idx = len(self.cands) if kb is None else self._index_near(kb.mhz * (1.0 + self.s.knee_margin_pct / 100.0))
        was = b.held
        b.state, b.held, b.probe = "hold", min(len(self.cands), idx + b.k_off), None
        b.k_seen_t = kb.t_s if kb is not None else now_s
        b.t_searched, b.t_retry = now_s, math.inf
        self._clear_windows(b)
        held = "default" if b.held >= len(self.cands) else f"{self.cands[b.held]} MHz"
        bound = "unknown" if kb is None else f"<= {kb.mhz:.0f} MHz (bucket {kb.bucket}, t {kb.t_s:.0f} s)"
        reason = f"{held}: knee {bound} + {self.s.knee_margin_pct:g} % and {b.k_off} steps"
        # The same clock again after a reference window that refreshed the fit: a re-check.
        self._emit(now_s, "hold" if b.held != was or b.k_phase == "locate" else "recheck", b.edge, batch, b=b, reason=reason)

    def _knee_leave_hold(self, now_s: float, b: _Bucket, batch: int, ctx: float) -> bool:
        """Whether a knee-mode held bucket leaves plain holding at this step: the newer bound of
        another bucket, the scheduled re-locate (the active bucket), a reference window where the
        context left the fit's reach (the fit only: the held clock comes from the knee, which a
        change of the batch mix does not move)."""
        s = self.s
        assert b.fit is not None
        lo, hi = b.fit.ctx_lo, b.fit.ctx_hi
        if self.knee is not None and self.knee.t_s > b.k_seen_t:
            self._knee_hold(now_s, b, batch)
            return True
        if now_s >= self.knee_due_s:
            self.knee_due_s = now_s + (s.rebaseline_s or math.inf)  # the fallback, should this bucket go idle
            b.k_off = b.k_off if b.k_alarm else max(0, b.k_off - 1)
            b.k_alarm = False
            self._knee_ref(b, "locate", now_s, batch, f"the knee located again after {self._knee_every_s:.0f} s")
            return True
        # The default clock measured again where the context part of the step has moved beyond the
        # fit's range by _KNEE_CTX_SHARE of the step (a re-check per 5 % of context, as outside
        # knee mode, cost a third of the decode steps at the default clock in the noise scenario).
        out = max(ctx - hi, lo - ctx, 0.0) * b.fit.ms_per_ctx_token
        if out > _KNEE_CTX_SHARE * b.fit.ms_at(ctx):
            self._knee_ref(b, "ref", now_s, batch, f"decode context {ctx:.0f} beyond the fit's {lo:.0f}..{hi:.0f}")
            return True
        return False

    def _knee_ref(self, b: _Bucket, phase: str, now_s: float = 0.0, batch: int = 0, why: str = "") -> None:
        """A reference window of default-clock steps in knee mode, then (``phase``) a locate, the
        test of the steps an alarm fired on, or the hold (a refresh of the fit)."""
        b.state, b.ref_cur, b.k_phase, b.probe = "ref", [], phase, None
        self.n_checks += 1
        if why:
            self._emit(now_s, "rebaseline", b.edge, batch, b=b, reason=why)

    def _knee_hold_sample(self, now_s: float, b: _Bucket, batch: int, step_ms: float, ran_at: int | None, ctx: float) -> None:
        """A held step in knee mode: watched by Page's CUSUM of the log-likelihood ratio of a
        slowdown at the target against none (each step adds ``d / sigma`` times its distance
        from the midpoint in spreads: at 8 % noise far fewer false alarms than the spread-scaled
        CUSUM of :meth:`_held_failed`), by :meth:`_clearly_over`, and by the mirror CUSUM of
        :meth:`_fit_stale` (then the fit is measured again)."""
        if self._knee_leave_hold(now_s, b, batch, ctx):
            return
        held = None if b.held >= len(self.cands) else self.cands[b.held]
        assert b.fit is not None
        base = self._predict(b, ctx)
        r = step_ms / base
        if ran_at != held:
            return
        if held is None:
            b.base.append(StepSample(ctx, step_ms))
            self._step(now_s, b, batch, ran_at, step_ms, r, None, base)
            return
        b.window.append(StepSample(ctx, step_ms))
        b.n_held += 1
        d = _KNEE_GUARD_X * (b.target - 1.0 - self._margin0)
        sigma = max(b.fit.sigma, 1e-3)
        x = (r - 1.0 - self._margin0 - d / 2) / sigma
        b.cusum = max(0.0, b.cusum + d / sigma * min(_CUSUM_CLIP, max(-_CUSUM_CLIP, x)))
        b.cusum_n = b.cusum_n + 1 if b.cusum > 0 else 0
        # The mirror (steps faster than the fit by d/2 past its midpoint: the GPU sped up).
        x_fast = (1.0 - d / 2 - r) / sigma
        b.fast = max(0.0, b.fast + d / sigma * min(_CUSUM_CLIP, max(-_CUSUM_CLIP, x_fast)))
        last = list(b.window)[-self.s.backoff_steps :]
        if b.cusum > _KNEE_GUARD_H or self._clearly_over(b, last, b.fit):
            n = max(self.s.backoff_steps, b.cusum_n)
            b.k_tested, b.k_alarm = list(b.window)[-n:], True
            med = statistics.median(ms / b.fit.ms_at(c) for c, ms in b.k_tested)
            why = f"log-likelihood CUSUM {b.cusum:.1f} over the last {n} held steps (median {100 * (med - 1):+.2f} %)"
            self._emit(
                now_s,
                "violation",
                b.edge,
                batch,
                ran_at=ran_at,
                step_ms=step_ms,
                base=base,
                b=b,
                reason=f"{why} at {held} MHz: default clock now, then its steps tested against it",
            )
            self._knee_ref(b, "alarm")
            return
        if b.fast > _KNEE_GUARD_H:
            self._knee_ref(b, "ref", now_s, batch, f"held steps at {held} MHz faster than the default-clock fit")
            return
        self._step(now_s, b, batch, ran_at, step_ms, r, None, base)

    def _step(
        self,
        now_s: float,
        b: _Bucket,
        batch: int,
        ran_at: int | None,
        step_ms: float,
        ratio: float | None,
        margin: float | None,
        base: float | None,
    ) -> None:
        # Per step only a tuple (hot path); events get a full record.
        self.last_step = MeasuredStep(now_s, b.edge, ran_at, step_ms, ratio)

    def _emit(
        self,
        now_s: float,
        event: str,
        bucket: int | None,
        batch: int,
        *,
        ran_at: int | None = None,
        step_ms: float | None = None,
        ratio: float | None = None,
        margin: float | None = None,
        base: float | None = None,
        b: _Bucket | None = None,
        reason: str = "",
    ) -> None:
        fit = b.fit if b is not None else None
        rec = ClosedLoopRecord(
            now_s,
            event,
            bucket,
            batch,
            self.clock_for(self.active),
            ran_at,
            step_ms,
            ratio,
            b.target if b is not None else None,
            margin,
            base,
            None if fit is None else 100 * fit.sigma,
            b.probes if b is not None else 0,
            reason,
        )
        self.records.append(rec)
        self.last = rec
        self.n_records += 1


__all__ = ["UNKNOWN", "ClosedLoopRecord", "DecodeClockTuner", "Suspicion", "Verdict"]
