"""Energy meters: NVML's total-energy counter, sampled power, or the simulated GPU.

All meters expose the same small interface, so the per-phase accounting and the metrics do not care
which one runs. Every figure travels with two labels:

* ``source``: ``measured`` (read from the GPU) or ``simulated`` (the roofline/DVFS model);
* ``method``: how the joules were obtained, documented here and on ``/metrics``:

  - ``energy-counter``: ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver load, Volta and
    newer), with both window edges interpolated by instant power (see :class:`NvmlEnergyMeter`);
  - ``power-sampling``: the trapezoid integral of power sampled by a background thread, for GPUs
    without the counter (pre-Volta, some vGPUs answer ``NVML_ERROR_NOT_SUPPORTED``). Coarser: its
    error grows with the sampling period and, where only ``nvmlDeviceGetPowerUsage`` exists, with
    that reading's own averaging window (1 s on Ampere and newer, NVML docs);
  - ``model``: the simulated GPU (``source`` is then ``simulated``).

Every NVML reading goes through :class:`~vllm_powersave.device.NvmlGpu` (the device layer), which
raises only typed :class:`~vllm_powersave.device.GpuError` subclasses. Faults (any NVML error at
any call: NotSupported, NoPermission, GpuIsLost, Unknown, ...) never propagate: the figure
concerned reads ``None``, a failed energy read makes the meter
*unavailable* for the rest of the run (``energy_j()`` returns ``None``; no frozen or partial total
is ever presented as current), and each meter logs exactly one warning, for its first fault.

MIG: NVML counts energy and power only for the whole GPU, which the other MIG instances share, so
a MIG device's energy is not metered (one warning naming MIG); its clocks and temperature, read
from the parent, still show.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from ..device import GpuError, GpuMigError, GpuNotSupportedError, NvmlGpu
from ..sim.gpu import SimulatedGpu
from .crosscheck import EnergyCrossCheck

log = logging.getLogger("vllm.powersave.energy")

METHOD_COUNTER = "energy-counter"
METHOD_SAMPLING = "power-sampling"
METHOD_MODEL = "model"
METHOD_NONE = "none"

#: A counter step implying more than this per GPU is not energy but a glitch (the largest modules,
#: GB200 superchips, draw ~2.7 kW including the CPU).
MAX_PLAUSIBLE_W = 5000.0


class CounterStep(NamedTuple):
    """The counter stepped at ``t_s`` (the meter's clock), and the returned energy jumped by
    ``jump_j`` beyond what the previous read's rate predicted: the part of the period that ends at
    ``t_s`` which interpolation had not seen (negative where it had over-estimated).

    What the counter says exactly, for a caller that knows when the load changed: it drew
    ``span_j`` joules from its step at ``span_t0_s`` (the last one the previous read, at
    ``read_t0_s``, had seen) to ``t_s``; of that span, the reads up to ``read_t0_s`` had returned
    ``ext_j`` joules (their extension past ``span_t0_s``)."""

    t_s: float
    jump_j: float
    span_t0_s: float | None = None
    span_j: float | None = None
    read_t0_s: float | None = None
    ext_j: float | None = None


class _Bracket(NamedTuple):
    """Where a counter step was seen: after ``lo_s`` (a read's call, or a poll's) and at or before
    ``hi_s`` (the next read's return) (the meter's clock, s)."""

    lo_s: float
    hi_s: float

    @property
    def mid_s(self) -> float:
        return (self.lo_s + self.hi_s) / 2

    @property
    def width_s(self) -> float:
        return self.hi_s - self.lo_s


def _merged_overlap_s(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of ``[t0, t1]`` that the union of ``spans`` covers."""
    cut = sorted((max(a, t0), min(b, t1)) for a, b in spans if b > t0 and a < t1)
    total, end = 0.0, t0
    for a, b in cut:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class _ReadSpan(NamedTuple):
    """When an energy read was called and when it returned (the meter's clock, s)."""

    start_s: float
    end_s: float


class LoadHint(NamedTuple):
    """What the account tells a meter before a read (:meth:`EnergyMeter.hint_load`): when work ran
    (``end`` inf: it runs now), the GPU's power without work, and its power at rest just after
    work (``rest_w`` for ``rest_s`` after each span's end; ``None``: no rest price)."""

    busy_spans: tuple[tuple[float, float], ...]
    quiet_w: float
    rest_w: float | None = None
    rest_s: float = 0.0
    #: When the last work ended (the account remembers it past the spans it keeps, which cover
    #: about two counter periods): its rest window counts too.
    last_work_end_s: float | None = None

    def _rest_windows(self) -> list[tuple[float, float]]:
        ends = [b for _, b in self.busy_spans if math.isfinite(b)]
        if self.last_work_end_s is not None and math.isfinite(self.last_work_end_s):
            ends.append(self.last_work_end_s)
        return [(b, b + self.rest_s) for b in ends]

    @property
    def busy_now(self) -> bool:
        return any(b == math.inf for _, b in self.busy_spans)

    def busy_s(self, t0: float, t1: float) -> float:
        return _merged_overlap_s(list(self.busy_spans), t0, t1)

    def quiet_j(self, t0: float, t1: float) -> float:
        """Joules of ``[t0, t1]`` without work: at ``rest_w`` within ``rest_s`` of a span's end,
        else at ``quiet_w``."""
        busy = list(self.busy_spans)
        quiet_s = (t1 - t0) - _merged_overlap_s(busy, t0, t1)
        if self.rest_w is None or self.rest_s <= 0:
            return quiet_s * self.quiet_w
        windows = self._rest_windows()
        rest_s = _merged_overlap_s(windows, t0, t1) - _merged_overlap_s(
            [(max(a, w0), min(b, w1)) for a, b in busy for w0, w1 in windows if min(b, w1) > max(a, w0)], t0, t1
        )
        rest_s = min(quiet_s, max(0.0, rest_s))
        return rest_s * self.rest_w + (quiet_s - rest_s) * self.quiet_w

    def quiet_w_at(self, t: float) -> float:
        """The quiet power at ``t`` (the rate a read extends the counter with where no work runs)."""
        after_work = self.rest_w is not None and any(a <= t < b for a, b in self._rest_windows())
        return self.rest_w if after_work else self.quiet_w  # type: ignore[return-value]


class EnergyMeter(ABC):
    """Cumulative energy of one GPU since the meter was created."""

    source: str = "measured"
    method: str = METHOD_COUNTER
    gpu_id: str = "0"
    #: Counter anomalies seen (see NvmlEnergyMeter); 0 for meters without a counter.
    counter_resets: int = 0
    counter_wraps: int = 0
    phase_losses: int = 0  # reads that contradicted the counter's learnt phase (NvmlEnergyMeter)
    faults: int = 0
    unavailable_reason: str | None = None
    #: Whether the GPU draws power in the gaps between engine steps (a real GPU idles there; the
    #: account prices those gaps at the idle power it measured, see energy/account.py).
    powered_between_steps: bool = True

    @abstractmethod
    def energy_j(self) -> float | None:
        """Joules since the meter started; never decreases. ``None`` once the meter is unavailable."""

    @abstractmethod
    def power_w(self) -> float | None:
        """Instant power in W, or ``None`` where unavailable."""

    @abstractmethod
    def sm_clock_mhz(self) -> int | None:
        """Current SM clock in MHz, or ``None`` where unavailable."""

    @property
    def available(self) -> bool:
        """False once an energy read has failed: energy figures of this GPU are then unknown."""
        return self.unavailable_reason is None

    def extra(self) -> dict[str, float | int | None]:
        """Read-only device state: temperature (°C), memory clock (MHz), clock-event reasons (bitmask)."""
        return {}

    def on_idle(self, seconds: float) -> None:  # noqa: B027 - optional hook
        """Told that the engine was idle for ``seconds``; only a simulated meter needs this."""

    def hint_load(self, hint: LoadHint | None) -> None:  # noqa: B027 - optional hook
        """Told, before a read, when work ran on the GPU lately and what it draws without work
        (:class:`LoadHint`; ``None``: unknown). Only a meter that extends a stepping counter
        between its steps needs this."""

    def idle_power_w(self) -> float | None:
        """The GPU's idle power (W) where the meter knows it without measuring; ``None`` for a
        real GPU (the account then learns it from the counter over idle-only intervals)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    @property
    def counter_period_s(self) -> float:
        """Seconds between counter steps; 0 for meters whose reads are exact at any time."""
        return 0.0

    @property
    def read_t_s(self) -> float | None:
        """When the last :meth:`energy_j` value was taken (the meter's clock, s): the energy up to
        then. ``None`` where it is the time of the call (no read that takes time)."""
        return None

    def drain_counter_steps(self) -> list[CounterStep]:
        """The counter steps seen by reads since the last call (oldest first); none for meters
        without a stepping counter."""
        return []

    @property
    def counter_phase_known(self) -> bool:
        """Whether the meter knows when its counter steps, and so reports the steps
        (:meth:`drain_counter_steps`) that correct its extension; False for meters without one."""
        return False

    @property
    def crosscheck(self) -> EnergyCrossCheck | None:
        """The counter against the integral of instant power (:mod:`.crosscheck`); ``None`` for
        meters whose energy is not a counter (power sampling is that integral; the model)."""
        return None

    def crosscheck_sample(self) -> None:
        """Give the cross-check the last read, taken on the publisher's periodic tick (no-op for
        meters without one)."""


class _NvmlReader:
    """NVML readings of one device with the fault policy: first fault warns once, later ones are quiet.

    ``NotSupported`` on an optional reading (temperature, clock-event reasons, ...) is a capability
    of the device, not a fault: it is remembered and never asked again, without a warning.
    """

    def __init__(self, gpu: NvmlGpu, owner: EnergyMeter) -> None:
        self.gpu, self.gpu_id, self.owner = gpu, gpu.uuid, owner
        self.unsupported: set[str] = set()
        self.warned = False
        self.instant_ok = True

    def fault(self, what: str, exc: BaseException) -> None:
        self.owner.faults += 1
        if not self.warned:
            self.warned = True
            log.warning(
                "powersave: NVML %s failed on GPU %s (%s); the figures it feeds are marked unavailable, serving continues",
                what,
                self.gpu_id,
                exc,
            )
        else:
            log.debug("powersave: NVML %s failed on GPU %s (%s)", what, self.gpu_id, exc)

    def optional(self, key: str, fn: Callable[[], int]) -> int | None:
        if key in self.unsupported:
            return None
        try:
            return int(fn())
        except GpuNotSupportedError:
            self.unsupported.add(key)
        except Exception as exc:
            self.fault(key, exc)
        return None

    def instant_power_w(self) -> float:
        """``NVML_FI_DEV_POWER_INSTANT`` (W), falling back to ``nvmlDeviceGetPowerUsage``.

        ``nvmlDeviceGetPowerUsage`` is a 1 s average on Ampere and newer (NVML docs), so the field
        value is preferred where the driver has it (as Zeus does). Raises the
        :class:`~vllm_powersave.device.GpuError` of the average if neither answers.
        """
        if self.instant_ok:
            try:
                return self.gpu.instant_power_w()
            except GpuNotSupportedError:
                self.instant_ok = False  # this driver/GPU has no instant field: use the average
            except GpuError as exc:
                self.fault("instant power read", exc)  # then try the average for this reading
        return self.gpu.average_power_w()


#: Instant power this far from the counter's last step average (either way) means the load
#: changed since: idle (~80 W) against a 7B batch (~470 W) on the H200 is ~6x, while a steady
#: batch's kernel-to-kernel swings stay within ~2x (docs/results/h200-request-energy.md).
LOAD_CHANGE_RATIO = 2.5


class NvmlEnergyMeter(EnergyMeter):
    """``nvmlDeviceGetTotalEnergyConsumption``, interpolated between its steps.

    The counter (mJ) advances in steps, about every 100 ms on Hopper (ML.ENERGY; measured on the
    H200 test GPU in ``docs/results/h200-energy-meter.md``), so a raw difference of two reads is
    off by up to one step's energy at each edge: ±70 J per edge at 700 W, which makes short
    windows (and the per-tick attribution) meaningless. Each read therefore returns::

        E(t) = C + P(t) * (t - t_update)

    where ``C`` is the counter, ``t_update`` the time of its last step and ``P`` that step's
    average power, or the instant power where it differs from that average by more than
    :data:`LOAD_CHANGE_RATIO` (a load change; see :meth:`_interp_power_w`). The counter steps at a
    fixed period, so :meth:`sync_counter_phase` (called by the background publisher, never on the
    step path) polls it every 1 ms until it steps, which gives the phase to ~1 ms and, on the first
    call, the period where its polls pin it; later syncs (sooner while the period is uncertain,
    then every 30 s) measure it over the baseline between them. Every read
    checks the phase (a step seen where none was due, or none where one was due, beyond 3 ms) and
    drops it until the next sync if it is wrong (at once after a one-off; losses in a row back off
    to one sync per ``sync_every_s``). Without a phase the estimate uses the middle of
    the last step's bracket between two reads: at most ``P x period / 2`` per edge, half the raw
    counter's error. Errors do not accumulate: every read is re-anchored to the counter. Where the
    phase is known, each step a read sees is kept as a :class:`CounterStep` (its time and the
    joules the previous read's rate had not predicted) until :meth:`drain_counter_steps`: the
    account books them over the period they close (``energy/account.py``).

    Counter anomalies, each counted, logged with one warning and bridged with instant power x
    elapsed time instead of a negative or absurd value:

    * ``counter_resets``: the counter went backwards (driver reload), or jumped by more than
      :data:`MAX_PLAUSIBLE_W` over the interval;
    * ``counter_wraps``: it went backwards by a 32- or 64-bit wrap (the delta across the wrap is
      plausible and is kept).

    The returned total never decreases (a momentary over-estimate is held until the counter
    catches up). Any NVML error in the energy read makes the meter unavailable (``energy_j()`` ->
    ``None``) with exactly one warning per meter (shared with the other reads).

    Args:
        gpu: the device (its UUID labels the metrics).
        clock: monotonic seconds (tests inject one).
        counter_period_s: the counter's update period, s.
        interpolate: False reads the raw counter (quantised; for comparisons).

    Raises:
        the :class:`~vllm_powersave.device.GpuError` of the first counter read (e.g.
        ``GpuNotSupportedError`` on pre-Volta GPUs), so that :func:`open_nvml_meter` can fall back
        to power sampling.
    """

    source = "measured"
    method = METHOD_COUNTER

    def __init__(
        self, gpu: NvmlGpu, clock: Callable[[], float] = time.monotonic, counter_period_s: float = 0.1, interpolate: bool = True
    ) -> None:
        self.gpu = gpu
        self.gpu_id = gpu.uuid
        self.clock = clock
        self.period = counter_period_s
        self.interpolate = interpolate
        self._lock = threading.Lock()
        self._r = _NvmlReader(gpu, self)
        self.counter_resets = 0
        self.counter_wraps = 0
        self.faults = 0
        self.unavailable_reason = None
        t_call = clock()
        self._last_mj = gpu.total_energy_mj()  # raises: caller falls back
        self._t_read = clock()
        self._read_span = _ReadSpan(min(t_call, self._t_read), self._t_read)  # the last read's call and return
        self._acc_mj = 0.0  # counter energy since start (anomalies bridged)
        # When the counter steps: a time it stepped at (learnt by sync_counter_phase), else the
        # bracket (lo, hi] of the last step seen between two reads.
        self._phase_t: float | None = None
        self._last_sync_t: float | None = None
        self._last_sync_w = 0.0  # the width of that sync's step bracket, s
        #: How far the period may be off (s): 1 % for the nominal one, then what syncs measured.
        self.period_sigma_s = 0.01 * counter_period_s
        self._bracket = _Bracket(self._t_read - self.period, self._t_read)
        # The step the last read's value holds, by the learnt phase (None: unplaced), and that step
        # where the joules read placed it rather than time (_place_step; None: time placed it).
        self._seen_step_t: float | None = None
        self._joules_placed_t: float | None = None
        self.sync_every_s = 30.0
        self.sync_due = self._t_read
        self.phase_losses = 0
        self._losses_in_a_row = 0  # phases lost with no sync between that found one holding
        self._power: float | None = None
        self._power_before: float | None = None  # the instant reading before the last one, W
        self._t_power = -1.0
        self._step_avg_w: float | None = None  # the counter's last step: its energy / its period
        # The last single-period steps' averages (W) under steady work since work last paused, as
        # time placed them: what a period holds by the counter's own joules (_one_period_short).
        self._work_period_w: deque[float] = deque(maxlen=5)
        self._limit_w = self._read_limit_w()
        self._load: LoadHint | None = None  # hint_load's, for the next read
        self._offset_j = 0.0
        self._offset_j = self._estimate_j(self._t_read, self._read_power())
        self._reported = 0.0
        # The last returned read: its time and the rate (W) it extended the counter with; a step's
        # jump is measured against that rate continued (CounterStep). Bounded: an account drains it.
        self._t_out, self._rate_w = self._t_read, self._rate(self._power)
        # The counter at that read (J, as returned) and its last step then (CounterStep's span).
        self._c_out_j, self._t_u_out = self._acc_mj / 1000.0 - self._offset_j, self._t_read - self._since_update(self._t_read)
        self._counter_steps: deque[CounterStep] = deque(maxlen=256)
        self._crosscheck = EnergyCrossCheck(self.gpu_id, clock=clock)
        # The last read (time, J returned, W read with it), which crosscheck_sample hands on.
        self._last_read: tuple[float, float, float | None] | None = None

    # -- internals ---------------------------------------------------------------------------
    def _read_power(self) -> float | None:
        try:
            p = self._r.instant_power_w()
        except Exception as exc:
            self._r.fault("power read", exc)
            p = None
        self._power_before, self._power, self._t_power = self._power, p, self.clock()
        return p

    def _read_limit_w(self) -> float | None:
        """The enforced power limit (W), or None where NVML has none to read (no fault: optional)."""
        try:
            w = self.gpu.power_limit_w()
        except Exception:
            return None
        return w if math.isfinite(w) and w > 0 else None

    def _rate(self, p: float | None) -> float:
        """The power (W) the counter is extended with after its last step.

        Never above the enforced power limit: the GPU holds its average power under it, while
        single instant readings under a steady batch run to 1,270 W on the H200
        (docs/results/h200-request-energy.md). One such reading at the read that ends a burst
        extended the counter at ~1,440 W and booked the burst up to 1.76 x its energy (simulated,
        tests/test_energy_bursts_h200.py); the counter's next step takes the excess back only from
        what came after. The bound takes off only what lies above the limit: under a 470 W burst
        the same reading still books up to 1.275 x (docs/request-energy.md)."""
        if not self.interpolate or p is None:
            return 0.0
        return self._under_limit(max(0.0, self._interp_power_w(p)))

    def _under_limit(self, w: float) -> float:
        """``w`` (W), no more than the enforced power limit where one is known."""
        limit_w = self._limit_w  # one read: a sync may replace it
        return min(w, limit_w) if limit_w is not None else w

    def _estimate_j(self, t: float, p: float | None) -> float:
        since = self._since_update(t)
        load = self._load
        if load is None:
            return (self._acc_mj / 1000.0 + since * self._rate(p)) - self._offset_j
        # Where no work ran (hint_load), the extension is drawn at the quiet power the caller
        # measured, not at the last step's or the instant power, which lags the load by tens of
        # ms (docs/results/h200-energy-meter.md (c)): a burst starting or ending inside the
        # counter's period would otherwise spread its power over the idle beside it.
        # Just after work the GPU rests above its idle power for a while (its clocks fall back, the
        # perf boost releases: 121 W against 70 W for 1.5-2.1 s on the H100,
        # docs/results/h200-request-energy.md); extended at idle there, the counter's next step
        # corrected it with a positive jump that the period's last sliver of work took.
        t_u = t - since
        busy_s = min(since, load.busy_s(t_u, t))
        return (self._acc_mj / 1000.0 + busy_s * self._rate(p) + load.quiet_j(t_u, t)) - self._offset_j

    def _interp_power_w(self, p: float) -> float:
        """The power to extend the counter's last step with: the average of that step, unless the
        instant power says the load changed since (beyond :data:`LOAD_CHANGE_RATIO`).

        Instant power swings with each kernel (on the H200 under a steady batch, 16 ms ticks read
        0 to 1,270 W through it, docs/results/h200-request-energy.md), and every counter step
        re-anchors the estimate: extending by instant power jumps by (average - instant) x period
        at each step, tens of joules, which short ticks pass on to the few requests they split
        over. The last step's average changes little under steady load; at an idle/busy edge the
        instant power is the better guess, as before."""
        avg = self._step_avg_w
        if avg is None or avg <= 0 or not (1 / LOAD_CHANGE_RATIO <= p / avg <= LOAD_CHANGE_RATIO):
            return p
        return avg

    def _observe_update(self, prev: _ReadSpan, now: _ReadSpan, changed: bool) -> None:
        """Keep the bracket of the last step and check the learnt phase against this pair of reads.

        A read's value was taken somewhere between its call and its return (``_ReadSpan``): under
        load the return waits on the GIL behind the engine thread for milliseconds, and judged by
        its return time alone a read taken just before a step looked taken after it, so the phase
        was lost at each load's start and relearnt only seconds later (7 s of a 20 s segment in the
        H100 step trace, docs/results/h200-request-energy.md), with every jump left in its tick."""
        T = self.period
        t = now.end_s
        if changed:
            # After the previous value was taken, which may have been as early as that read's
            # call: a read called just before the counter's update returned after it with the
            # value from before, and bracketed from its return the update was placed a period
            # late, at the next read (-48.8 J there, +50.2 J over the 2 ms to the next step: H100
            # step trace, 16:11Z, docs/results/h200-request-energy.md).
            self._bracket = _Bracket(max(prev.start_s, t - T), t)
        if self._phase_t is None:
            return
        tol = self._phase_tol_s(t)
        if changed:  # some step boundary may lie between the two values
            ok = self._boundary_in(prev.start_s - tol, now.end_s + tol)
        else:  # no step boundary surely lies between them
            ok = not self._boundary_in(prev.end_s + tol, now.start_s - tol)
        if not ok:  # the counter does not step where the learnt phase says: relearn it soon
            self._phase_t = None
            # At once after a one-off; a counter that keeps contradicting its phase (a period other
            # than the one learnt, irregular steps) is polled less and less often, to one sync per
            # sync_every_s: each sync polls NVML on the publisher's thread for up to 2.5 periods.
            self.sync_due = t + min(self.sync_every_s, 0.5 * (2**self._losses_in_a_row - 1))
            self._losses_in_a_row += 1
            self.phase_losses += 1

    def _phase_tol_s(self, t: float) -> float:
        """How far (s) the learnt phase may be off at ``t``: the sync's poll resolution plus jitter,
        and how far it may have drifted since the sync that learnt it: the period is known to
        period_sigma_s, and syncs are spaced to let the phase drift up to a quarter period
        (sync_counter_phase), far past 3 ms."""
        T = self.period
        since_sync_s = 0.0 if self._last_sync_t is None else max(0.0, t - self._last_sync_t)
        return 0.003 + min(0.25 * T, self.period_sigma_s * since_sync_s / T)  # a sync that failed keeps the old one's

    def _place_step(self, now: _ReadSpan, d_j: float, p: float | None, steady: bool) -> int | None:
        """How many of the learnt phase's steps lie between the previous read's value (which held
        step ``_seen_step_t``) and the value read in ``now``, ``d_j`` joules past it, where the
        joules place the last one; None where time places it (:meth:`_since_update`). ``steady``:
        :meth:`_steady_work` for ``now``.

        A read within the phase's tolerance after a step may have been taken before it: taken as
        after, a phase a few ms early booked a period's joules as missing at one step and back at
        the next (-34 J and +49 J over 3 ms, reads in step with the counter in the H100 step trace,
        docs/results/h200-request-energy.md). There the step is taken as not yet seen where the
        joules say one period fewer (:meth:`_one_period_short`), over at most two periods, under
        steady work only (where work ended since the previous read, the joules fall short because
        the power fell: a burst's end, tests/test_energy_bursts.py). Only that one step, never a
        later one: a phase that is late is the bracket's to correct."""
        if self._phase_t is None or self._seen_step_t is None or p is None or not steady:
            return None
        T, tol = self.period, self._phase_tol_s(now.end_s)
        k0 = round((self._seen_step_t - self._phase_t) / T)
        n = self._period_index(now.end_s) - k0  # by time: every step the phase puts before the return
        sure = self._period_index(now.start_s - tol) - k0  # steps surely before the value was taken
        last_t = self._phase_t + (k0 + n) * T
        if max(1, sure) < n <= 2 and last_t > now.start_s - tol and self._one_period_short(d_j, n, p):
            self._joules_placed_t = last_t - T
            return n - 1
        return None

    def _one_period_short(self, d_j: float, n: int, p: float) -> bool:
        """Whether ``d_j`` joules are ``n - 1`` periods of work rather than the ``n`` the phase says.

        Weighed against the counter's own single periods under work since work last paused (the
        median of the last five, and the last one), not the instant power: under a steady batch
        the H200's single readings swing from a third to 2.3 x the median
        (docs/results/h200-request-energy.md), and one low reading passed a one-short read as two
        periods (-66 J, then +66 J, simulated, tests/test_request_energy_read_lag.py). The joules
        must fit ``n - 1`` periods to 20 % and miss ``n`` by over 35 % (a fall from 700 to 350 W
        under work two periods before the read is 1.26 periods, tests/test_energy.py), and two
        instant readings in a row under half the median say the power itself fell (300 W read
        two periods apart after 650 W, tests/test_energy.py). Where fewer than three periods are
        known, the joules must fall half a period short at the previous read's rate and at the
        power read now alike, as before those periods are seen."""
        T = self.period
        if len(self._work_period_w) < 3:
            return d_j < (n - 0.5) * min(self._rate_w, p) * T
        ref_w = statistics.median(self._work_period_w)
        fits = all(abs(d_j / (w * T * (n - 1)) - 1.0) <= 0.2 for w in (ref_w, self._work_period_w[-1]))
        fell = all(w is not None and w < 0.5 * ref_w for w in (p, self._power_before))
        return fits and abs(d_j / (ref_w * T * n) - 1.0) > 0.35 and not fell

    def _steady_work(self, now: _ReadSpan) -> bool:
        """Whether the account's hint says the GPU worked through the time since the previous read."""
        load, t0 = self._load, self._read_span.end_s
        return load is not None and now.end_s > t0 and load.busy_s(t0, now.end_s) >= 0.9 * (now.end_s - t0)

    def _boundary_in(self, a: float, b: float) -> bool:
        """Whether a counter step falls in ``(a, b]`` by the learnt phase (which must be known)."""
        return b > a and self._period_index(b) > self._period_index(a)

    def _period_index(self, t: float) -> int:
        """Which counter period ``t`` falls in, by the learnt phase (which must be known)."""
        return math.floor((t - self._phase_t) / self.period)  # type: ignore[operator]

    def _steps_between(self, t_prev: float, t: float) -> int:
        T = self.period
        if self._phase_t is None:
            return max(1, round((t - t_prev) / T))
        # By the phase, but an interval of length L holds floor(L/T) to ceil(L/T) steps: a phase a
        # millisecond off must not count two steps between reads 16 ms apart (halving the average).
        n = self._period_index(t) - self._period_index(t_prev)
        return min(max(n, math.floor((t - t_prev) / T), 1), max(1, math.ceil((t - t_prev) / T)))

    def _since_update(self, t: float) -> float:
        """Estimated seconds since the counter's last step before ``t`` (0 .. period)."""
        T = self.period
        lo, hi = self._bracket  # the reads saw the last step inside (lo, hi]
        if self._phase_t is None:  # phase unknown: the middle of that bracket
            return min(T, max(0.0, t - (lo + hi) / 2))
        if self._joules_placed_t is not None and self._joules_placed_t <= t:  # where the joules read placed it
            return t - self._joules_placed_t
        # The phase is right to the sync's ~1 ms (and checked to 3 ms): a read inside that error
        # would count a whole period twice (a step already in the counter, and the phase's ~T
        # since it) or not at all. So the phase's step nearest to the bracket the reads saw the
        # last step in, moved into that bracket.
        last = t - (t - self._phase_t) % T
        if last > hi + self._phase_tol_s(t):
            # A read past a step the phase expects whose value has not changed since ``hi`` (a
            # phase a few ms early) still holds the bracket's step, not the bracket's end.
            return t - min(max(last - T, lo), hi)
        step = last if abs(last - min(max(last, lo), hi)) <= abs(last + T - min(max(last + T, lo), hi)) else last + T
        return t - min(max(step, lo), hi)

    def sync_counter_phase(self, poll_s: float = 0.001, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Learn when the counter steps: poll it every ``poll_s`` until it changes (background only).

        The first call follows two steps and also measures the period where its brackets are
        narrow; later calls (as soon as the phase may have drifted a quarter period, at most every
        ``sync_every_s``, or after a read contradicted the phase) follow one step and measure the
        period over the baseline since the last sync. At most ~2.5 periods of polling (``poll_s``
        apart, NVML reads only). Returns False if the counter did not step in that time (phase
        stays unknown).
        """
        if self.unavailable_reason is not None or not self.interpolate:
            return False
        if self._phase_t is not None:  # the phase held until this sync
            self._losses_in_a_row = 0
        T = self.period
        steps: list[_Bracket] = []  # the polls that saw the counter step
        try:
            # A step lies after the previous poll's value, taken no earlier than that poll's call,
            # and no later than this poll's return: under load the returns wait on the GIL, and a
            # bracket between returns placed the phase late by that wait (see _observe_update).
            call_prev = self.clock()
            c_prev = self.gpu.total_energy_mj()
            deadline = self.clock() + 2.5 * T
            want = 2 if self._phase_t is None else 1
            while len(steps) < want and self.clock() < deadline:
                sleep(poll_s)
                call = self.clock()
                c, t = self.gpu.total_energy_mj(), self.clock()
                if c != c_prev:
                    steps.append(_Bracket(call_prev, t))
                c_prev, call_prev = c, call
        except Exception as exc:
            log.debug("powersave: counter phase sync failed on GPU %s: %s", self.gpu_id, exc)
            return False  # the next energy read reports the fault
        if len(steps) < want:
            self.sync_due = self.clock() + self.sync_every_s
            return False
        # The period is only as good as the brackets behind it: NVML reads take ~4 ms on the H200
        # test host (docs/results/h200-energy-meter.md), so two steps polled there pin it to ~5 %
        # only, and a phase then drifts 5 ms per period. A measurement is taken where it beats
        # what is known (period_sigma_s), and the next sync comes while the phase can have
        # drifted at most a quarter period, so that the periods between two syncs are counted
        # right and the period is measured again over that longer baseline.
        first, t_step, w_step = steps[0], steps[-1].mid_s, steps[-1].width_s
        if len(steps) == 2 and 0.5 * T < t_step - first.mid_s < 2.0 * T and (w_step + first.width_s) / 2 < self.period_sigma_s:
            T = self.period = t_step - first.mid_s
            self.period_sigma_s = (w_step + first.width_s) / 2
        elif self._last_sync_t is not None:
            n = round((t_step - self._last_sync_t) / T)
            sigma = (w_step + self._last_sync_w) / 2 / max(n, 1)
            if n >= 2 and n * self.period_sigma_s < 0.5 * T and sigma < self.period_sigma_s:
                T = self.period = (t_step - self._last_sync_t) / n
                self.period_sigma_s = sigma
        self._phase_t = self._last_sync_t = t_step
        self._last_sync_w = w_step
        self._limit_w = self._read_limit_w()  # an operator may change the power cap while serving
        self.sync_due = self.clock() + min(self.sync_every_s, 0.25 * T / self.period_sigma_s * T)
        return True

    def _step(self, now_mj: int, t: float, t_call: float, p: float | None = None) -> None:
        d = now_mj - self._last_mj
        now = _ReadSpan(min(t_call, t), t)
        steady = self._steady_work(now)  # against the previous read's span: before it is replaced
        self._observe_update(self._read_span, now, d != 0)
        if d != 0:
            self._joules_placed_t = None  # a new step: time places it unless _place_step does
        dt = max(t - self._t_read, 0.0)
        limit_mj = MAX_PLAUSIBLE_W * (dt + 2 * self.period) * 1000.0
        bridge = (self._power or 0.0) * dt * 1000.0
        if d < 0:
            for bits in (32, 64):
                wrapped = now_mj + (1 << bits) - self._last_mj
                if 0 <= wrapped <= limit_mj and self._last_mj < (1 << bits):
                    self.counter_wraps += 1
                    log.warning(
                        "powersave: NVML energy counter of GPU %s wrapped at 2^%d mJ; delta kept (%d mJ)", self.gpu_id, bits, wrapped
                    )
                    self._acc_mj += wrapped
                    break
            else:
                self.counter_resets += 1
                log.warning(
                    "powersave: NVML energy counter of GPU %s went backwards (%d -> %d mJ: driver reload?); "
                    "interval bridged with instant power x %.3f s",
                    self.gpu_id,
                    self._last_mj,
                    now_mj,
                    dt,
                )
                self._acc_mj += bridge
        elif d > limit_mj:
            self.counter_resets += 1
            log.warning(
                "powersave: NVML energy counter of GPU %s jumped by %d mJ in %.3f s (> %.0f W); interval bridged with instant power",
                self.gpu_id,
                d,
                dt,
                MAX_PLAUSIBLE_W,
            )
            self._acc_mj += bridge
        else:
            self._acc_mj += d
            if d > 0:
                # The steps between the two reads: as placed, by the learnt phase, else by the elapsed time.
                steps = self._place_step(now, d / 1000.0, p, steady) or self._steps_between(self._t_read, t)
                # Only a single period's: an average over several spans whatever load changes lay
                # between the reads (a burst and the idle after it), which is no guess for the next.
                self._step_avg_w = d / 1000.0 / (steps * self.period) if steps == 1 else None
                # Not a step the joules placed: a reference that took it would confirm the next such.
                if self._step_avg_w is not None and steady and self._joules_placed_t is None:
                    self._work_period_w.append(self._step_avg_w)
        if not steady:
            self._work_period_w.clear()  # work paused: the next periods may hold another load
        self._last_mj, self._t_read, self._read_span = now_mj, t, now

    # -- interface ---------------------------------------------------------------------------
    def energy_j(self) -> float | None:
        with self._lock:
            if self.unavailable_reason is not None:
                return None
            t_call = self.clock()
            try:
                now = self.gpu.total_energy_mj()
            except Exception as exc:
                self.unavailable_reason = f"energy counter read failed: {exc}"
                self._r.fault("energy counter read", exc)
                return None
            t = self.clock()
            p = self._read_power() if self.interpolate else self._power
            stepped = now != self._last_mj
            self._step(now, t, t_call, p)
            before = self._reported
            self._reported = max(before, self._estimate_j(t, p))
            c_j, t_u = self._acc_mj / 1000.0 - self._offset_j, t - self._since_update(t)
            self._seen_step_t = t_u if self._phase_t is not None else None  # where _place_step starts from
            if stepped and self._phase_t is not None:  # only where it is known when the counter steps
                predicted = before + self._rate_w * max(0.0, t - self._t_out)
                span = (self._t_u_out, c_j - self._c_out_j, self._t_out, before - self._c_out_j)
                self._counter_steps.append(CounterStep(t_u, self._reported - predicted, *span))
            load, self._load = self._load, None
            busy_now = load is None or load.busy_now
            self._t_out, self._rate_w = t, self._rate(p) if busy_now else load.quiet_w_at(t)  # type: ignore[union-attr]
            self._c_out_j, self._t_u_out = c_j, t_u
            self._last_read = (t, self._reported, p)
            return self._reported

    def crosscheck_sample(self) -> None:
        """Hand the last read (and the power read with it: no NVML read of its own) to the
        cross-check. Only the publisher's periodic tick calls this: reads that requests' finishes
        trigger land at step ends, where power under a batch dips, and an integral of those alone
        read 1.127 x low on an H100 over 30 s (docs/results/h200-request-energy.md)."""
        with self._lock:
            if self.interpolate and self._last_read is not None:
                self._crosscheck.add(*self._last_read)  # a read handed on twice counts once (EnergyCrossCheck.add)

    @property
    def counter_period_s(self) -> float:
        return self.period

    @property
    def counter_phase_known(self) -> bool:
        return self._phase_t is not None

    @property
    def read_t_s(self) -> float | None:
        # The value is the counter extended to the NVML call's return (_estimate_j at that t),
        # which under load comes 4-14 ms after the caller asked (docs/request-energy.md).
        return self._t_out

    @property
    def crosscheck(self) -> EnergyCrossCheck:
        return self._crosscheck

    def hint_load(self, hint: LoadHint | None) -> None:
        with self._lock:
            ok = hint is not None and self.interpolate and math.isfinite(hint.quiet_w) and hint.quiet_w >= 0
            if not ok:
                self._load = None
                return
            rest_w = hint.rest_w  # type: ignore[union-attr]
            rest_ok = rest_w is not None and math.isfinite(rest_w) and rest_w >= 0
            # Quiet power above the power limit is no rest: a rest price of 23,471 W extended
            # every quiet read after it on an H100 (docs/results/h200-request-energy.md).
            self._load = hint._replace(  # type: ignore[union-attr]
                quiet_w=self._under_limit(hint.quiet_w),  # type: ignore[union-attr]
                rest_w=self._under_limit(rest_w) if rest_ok else None,  # type: ignore[arg-type]
            )

    def drain_counter_steps(self) -> list[CounterStep]:
        with self._lock:
            out = list(self._counter_steps)
            self._counter_steps.clear()
        return out

    @property
    def last_power_w(self) -> float | None:
        """The instant power (W) read with the last energy read (no NVML read of its own); None
        on a meter that reads the raw counter (``interpolate=False``): it reads no power with it."""
        return self._last_read[2] if self._last_read is not None and self.interpolate else None

    def power_w(self) -> float | None:
        # The tick reads instant power with the counter; reuse a reading younger than 50 ms.
        if self._power is not None and self.clock() - self._t_power < 0.05:
            return self._power
        return self._read_power()

    def sm_clock_mhz(self) -> int | None:
        return self._r.optional("sm clock", self.gpu.sm_clock_mhz)

    def extra(self) -> dict[str, float | int | None]:
        return _extra(self._r)


def _extra(r: _NvmlReader) -> dict[str, float | int | None]:
    g = r.gpu
    return {
        "temperature_c": r.optional("temperature", g.temperature_c),
        "mem_clock_mhz": r.optional("memory clock", g.mem_clock_mhz),
        # The bitmask (0x4 = SW power cap); decode_clock_event_reasons() names its bits.
        "clock_event_reasons": r.optional("clock-event reasons", g.clock_event_reasons_mask),
    }


class PowerSamplingEnergyMeter(EnergyMeter):
    """Energy as the trapezoid integral of sampled power, for GPUs without the energy counter.

    A daemon thread samples instant power (``NVML_FI_DEV_POWER_INSTANT``, else
    ``nvmlDeviceGetPowerUsage``) every ``period_s``; ``energy_j()`` returns the integral up to the
    last sample plus the last power held to now. The same method as Zeus's pre-Volta path
    (``PowerMonitor`` + AUC). ``source`` is ``measured``, ``method`` ``power-sampling``.

    Args:
        gpu: as :class:`NvmlEnergyMeter`.
        period_s: sampling period, s (the error of a window grows with it).
        start_thread: False for tests, which call :meth:`sample` themselves.

    Raises:
        the :class:`~vllm_powersave.device.GpuError` of the first power read, when the GPU reports no power at all.
    """

    source = "measured"
    method = METHOD_SAMPLING

    def __init__(
        self, gpu: NvmlGpu, period_s: float = 0.05, clock: Callable[[], float] = time.monotonic, start_thread: bool = True
    ) -> None:
        self.gpu, self.gpu_id, self.clock = gpu, gpu.uuid, clock
        self.period_s = period_s
        self.faults = 0
        self.unavailable_reason = None
        self._r = _NvmlReader(gpu, self)
        self._lock = threading.Lock()
        p0 = self._r.instant_power_w()  # raises: no power reading at all
        self._t, self._p, self._j = clock(), p0, 0.0
        self.samples = 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name=f"powersave-power-{self.gpu_id}", daemon=True)
            self._thread.start()

    def sample(self) -> None:
        """Take one power sample and extend the integral (trapezoid rule)."""
        if self.unavailable_reason is not None:
            return
        try:
            p = self._r.instant_power_w()
        except Exception as exc:
            with self._lock:
                self.unavailable_reason = f"power read failed: {exc}"
            self._r.fault("power read", exc)
            return
        t = self.clock()
        with self._lock:
            self._j += (self._p + p) / 2.0 * max(0.0, t - self._t)
            self._t, self._p = t, p
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def energy_j(self) -> float | None:
        with self._lock:
            if self.unavailable_reason is not None:
                return None
            return self._j + self._p * max(0.0, self.clock() - self._t)

    def power_w(self) -> float | None:
        return None if self.unavailable_reason is not None else self._p

    def sm_clock_mhz(self) -> int | None:
        return self._r.optional("sm clock", self.gpu.sm_clock_mhz)

    def extra(self) -> dict[str, float | int | None]:
        return _extra(self._r)

    def close(self) -> None:
        self._stop.set()


class UnavailableEnergyMeter(EnergyMeter):
    """A GPU whose energy cannot be read (NVML fault at start, or no counter and no power).

    With a device, the other read-only gauges (power, clocks, temperature) are still read where
    they answer; their faults are quiet (the one warning was logged by whoever found the meter
    unavailable).
    """

    source = "measured"
    method = METHOD_NONE

    def __init__(self, gpu_id: str, reason: str, gpu: NvmlGpu | None = None) -> None:
        self.gpu_id = gpu_id
        self.unavailable_reason = reason
        self.faults = 0
        self._r = _NvmlReader(gpu, self) if gpu is not None else None
        if self._r is not None:
            self._r.warned = True

    def energy_j(self) -> float | None:
        return None

    def power_w(self) -> float | None:
        if self._r is None:
            return None
        try:
            return self._r.instant_power_w()
        except Exception as exc:
            self._r.fault("power read", exc)
            return None

    def sm_clock_mhz(self) -> int | None:
        if self._r is None:
            return None
        return self._r.optional("sm clock", self._r.gpu.sm_clock_mhz)

    def extra(self) -> dict[str, float | int | None]:
        return _extra(self._r) if self._r is not None else {}


class SimulatedEnergyMeter(EnergyMeter):
    """Energy of a :class:`SimulatedGpu`. Every figure is simulated."""

    source = "simulated"
    method = METHOD_MODEL
    #: The simulated GPU prices each step's modelled work, not the host's wall time around it, so
    #: the host gaps between steps cost nothing; idle time (no step for idle_after_s) is priced.
    powered_between_steps = False

    def __init__(self, gpu: SimulatedGpu, gpu_id: str = "sim0", shadow: SimulatedGpu | None = None) -> None:
        self.gpu = gpu
        self.gpu_id = gpu_id
        #: Optional twin at stock clocks fed the same steps and idle time: the counterfactual
        #: "these exact steps without the presets", free of run-to-run batching noise.
        self.shadow = shadow
        self._start = gpu.energy_j

    def energy_j(self) -> float | None:
        return self.gpu.energy_j - self._start

    def power_w(self) -> float | None:
        return self.gpu.last_power_w

    def on_idle(self, seconds: float) -> None:
        self.gpu.idle(seconds)
        if self.shadow is not None:
            self.shadow.idle(seconds)

    def idle_power_w(self) -> float | None:
        return self.gpu.idle_power_w()

    def sm_clock_mhz(self) -> int | None:
        return self.gpu.sm_clock_mhz


def open_nvml_meter(
    gpu: NvmlGpu, sample_period_s: float = 0.05, clock: Callable[[], float] = time.monotonic, start_thread: bool = True
) -> EnergyMeter:
    """The best meter this GPU allows: counter, else power sampling, else unavailable.

    Only ``NotSupported`` on the counter (a capability: pre-Volta, some vGPUs) leads to power
    sampling; any other error is a fault and the meter is unavailable. A MIG device is not metered
    (NVML's energy is the whole GPU's, shared with other instances). Never raises. Exactly one
    warning when the meter is not the counter.
    """
    gpu_id = gpu.uuid
    if gpu.is_mig():
        try:
            parent = gpu.parent().uuid
        except GpuError as exc:
            parent = f"unknown ({exc})"
        log.warning(
            "powersave: GPU %s is a MIG device: NVML reports energy only for the whole GPU %s, which other MIG "
            "instances share; energy figures of this device are marked unavailable, serving continues",
            gpu_id,
            parent,
        )
        return UnavailableEnergyMeter(gpu_id, f"MIG device (energy is only known for the whole GPU {parent})", gpu)
    try:
        return NvmlEnergyMeter(gpu, clock=clock)
    except Exception as exc:
        counter_exc = exc
    if not isinstance(counter_exc, GpuNotSupportedError) or isinstance(counter_exc, GpuMigError):
        log.warning(
            "powersave: NVML energy counter read failed on GPU %s (%s); energy figures of this GPU are marked unavailable, "
            "serving continues",
            gpu_id,
            counter_exc,
        )
        return UnavailableEnergyMeter(gpu_id, f"energy counter read failed: {counter_exc}", gpu)
    try:
        m = PowerSamplingEnergyMeter(gpu, period_s=sample_period_s, clock=clock, start_thread=start_thread)
    except Exception as exc:
        log.warning(
            "powersave: GPU %s: no NVML energy counter (%s) and no power reading (%s); energy figures unavailable", gpu_id, counter_exc, exc
        )
        return UnavailableEnergyMeter(gpu_id, f"no energy counter ({counter_exc}) and no power reading ({exc})", gpu)
    log.warning(
        "powersave: GPU %s has no NVML energy counter (%s); energy from power sampled every %.0f ms "
        "(method 'power-sampling', coarser than the counter)",
        gpu_id,
        counter_exc,
        1000 * sample_period_s,
    )
    return m
