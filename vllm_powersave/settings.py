"""Plugin settings: one pydantic model, loaded from ``--additional-config`` or a YAML/JSON file.

Sources, later ones overriding earlier ones key by key:

1. a file named by the environment variable ``POWERSAVE_CONFIG`` (YAML or JSON);
2. a file named by ``config_file`` inside ``--additional-config '{"powersave": {...}}'``;
3. the inline ``powersave`` dict of ``--additional-config``.

Every validation failure becomes one :class:`SettingsError` whose message is a single line that
names the field and the offending value, so that ``vllm serve`` stops before any engine process is
started.
"""

from __future__ import annotations

import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import envs
from .envs import ENV_CONFIG_FILE, ENV_PERF_BOOST, ENV_SETTINGS_JSON  # noqa: F401 - re-exported; declared in envs.py

PHASES: tuple[str, ...] = ("prefill", "decode", "mixed", "idle")
Phase = Literal["prefill", "decode", "mixed", "idle"]


class SettingsError(ValueError):
    """An invalid powersave setting; ``str(err)`` is one line naming field and value."""


_INT_TEXT = re.compile(r"[-+]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")
_SCALARS = (int, float, bool)


def _scalar_kind(annotation: Any) -> type | None:
    """``int``, ``float`` or ``bool`` where a field holds one of them (or it or None)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if annotation in _SCALARS else None


def _from_text(value: Any, kind: type) -> Any:
    """A number or boolean written as text, as the value it spells; anything else as it came."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if kind is bool:
        return {"true": True, "false": False}.get(text.lower(), value)
    if _INT_TEXT.fullmatch(text) or (kind is float and _FLOAT_TEXT.fullmatch(text)):
        return kind(text)
    return value


class _Strict(BaseModel):
    # strict: a YAML ``true`` is not a 1.0 s period and ``1`` is not a boolean; pydantic's lax mode
    # would take both silently (https://docs.pydantic.dev/latest/concepts/strict_mode/). Strict mode
    # still takes an int where a float is asked; sequences opt back in to lists below.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _scalars_written_as_text(cls, data: Any) -> Any:
        """Numbers and booleans that arrive as text are read as such: vLLM's dotted form
        (``--additional-config.powersave.clocks.closed_loop.batch_buckets+ 1,8,32``) passes its list
        items and a ``True`` as strings, and YAML 1.1 reads ``5e-3`` as one."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, field in cls.model_fields.items():
            ann, value = field.annotation, out.get(name)
            if typing.get_origin(ann) is tuple and isinstance(value, (list, tuple)):
                args = typing.get_args(ann)
                if len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS:
                    out[name] = [_from_text(v, args[0]) for v in value]
            elif (kind := _scalar_kind(ann)) is not None and name in out:
                out[name] = _from_text(value, kind)
        return out


class ChunkRule(_Strict):
    """Use ``chunks`` LM-head chunks when at least ``min_rows`` rows reach the LM head."""

    #: The rule applies to LM-head calls with at least this many rows (the rule with the largest
    #: ``min_rows`` not above the call's rows wins).
    min_rows: int = Field(ge=1)
    #: Token-dimension chunks for such calls (capped at the rows, so that no chunk is empty).
    chunks: int = Field(ge=1, le=1024)


class ChunkingSettings(_Strict):
    """LM-head chunking policy keyed on the number of rows reaching the LM head.

    The default table is empty: no chunking, because on the GPUs we measured (H200) token-dimension
    chunking gives no time or energy gain (``docs/results``); a tuned preset file fills it in.
    """

    #: False: never chunk, whatever ``table`` says.
    enabled: bool = True
    #: Rules keyed on the rows reaching the LM head; empty: one chunk (vLLM's own call) everywhere.
    table: tuple[ChunkRule, ...] = Field(default=(), strict=False)
    #: Prompt logprobs with no table rule for their rows, on a GPU: rows per chunk are sized so that
    #: one chunk's temporaries (its logits, vLLM's float32 log-softmax and upcast, the rank
    #: comparison: ``vocab x (dtype bytes + 12)`` per row) take at most this share of free device
    #: memory (``torch.cuda.mem_get_info`` plus what torch's allocator holds unused), never fewer
    #: than 16 rows; all rows in one chunk where they fit. On CPU the table alone decides.
    #: See ``vllm_powersave/chunking/policy.py``.
    free_memory_share: float = Field(default=0.5, gt=0.0, le=1.0, allow_inf_nan=False)

    @field_validator("table")
    @classmethod
    def _sorted_unique(cls, table: tuple[ChunkRule, ...]) -> tuple[ChunkRule, ...]:
        seen = [r.min_rows for r in table]
        if len(set(seen)) != len(seen):
            raise ValueError(f"duplicate min_rows in {seen}")
        return tuple(sorted(table, key=lambda r: r.min_rows))


#: Kernel groups inside a step that may get their own clocks (``ClockPreset.groups``).
KERNEL_GROUPS: tuple[str, ...] = ("attention", "mlp", "lm_head", "sampling")
KernelGroup = Literal["attention", "mlp", "lm_head", "sampling"]


class GroupPreset(_Strict):
    """Clocks for one kernel group inside a phase (attention, MLP GEMMs, LM head, sampling).

    ``duration_ms``: measured duration of one *contiguous* run of the group on this GPU and model
    (ms; per layer for attention and MLP, which alternate layer by layer). The preset is used only
    if ``duration_ms >= clocks.group_min_switch_multiple * clocks.switch_latency_ms``; unmeasured
    (``None``) or shorter groups are ignored with one log line, because a clock needs
    ``switch_latency_ms`` to take effect and would otherwise land on the neighbouring kernels.
    """

    #: SM clock while the group runs (snapped to a supported clock); ``None``: the phase's clock.
    sm_clock_mhz: int | None = Field(default=None, ge=100, le=5000)
    #: Memory clock while the group runs, where the GPU supports memory locks.
    mem_clock_mhz: int | None = Field(default=None, ge=100, le=20000)
    duration_ms: float | None = Field(default=None, gt=0.0, le=3_600_000.0, allow_inf_nan=False)


class ClockPreset(_Strict):
    """Clocks for one phase; ``None`` means "leave the driver's default" (no lock).

    ``mem_clock_mhz`` is applied only where the GPU supports memory locks (not on the H200: one
    warning, then SM clocks only). ``groups``: optional kernel-group presets inside this phase.
    """

    #: SM clock for the phase (snapped to the GPU's supported clocks); ``None``: driver default.
    sm_clock_mhz: int | None = Field(default=None, ge=100, le=5000)
    #: Memory clock for the phase, where the GPU supports memory locks; ``None``: driver default.
    mem_clock_mhz: int | None = Field(default=None, ge=100, le=20000)
    #: Kernel-group presets inside this phase (used only where a group outlasts the switch latency).
    groups: dict[KernelGroup, GroupPreset] = Field(default_factory=dict)


class ClosedLoopSettings(_Strict):
    """Closed-loop decode clock (``clocks/closed_loop.py``): per decode-batch bucket, the lowest SM
    clock whose *measured* step time keeps the target, found while serving.

    Target: ``tpot_slo_ms`` if set (each decode step, i.e. one token per running request, within
    that many ms), else a slowdown of at most ``slowdown_budget_pct`` against the same bucket's step
    time measured at the driver's default clock. Compute-bound steps always keep the default clock.
    A static ``presets.decode`` clock, if set, overrides the loop (used as is, nothing probed).
    """

    #: Run the loop whatever ``clocks.mode`` chose. Leave it false normally: ``clocks.mode`` "auto"
    #: (the default) turns the loop on by itself where the process may set clocks, and
    #: "closed_loop" asks for it explicitly.
    enabled: bool = False
    #: Absolute TPOT / ITL target for a decode step, ms. ``None``: use ``slowdown_budget_pct``.
    tpot_slo_ms: float | None = Field(default=None, gt=0.0, le=60_000.0, allow_inf_nan=False)
    #: Allowed slowdown of a decode step against the default clock, percent (1 %: VoltanaLLM and
    #: GreenLLM report near-perfect SLO attainment at savings of 30-36 %, docs: ../shared/data/dvfs).
    slowdown_budget_pct: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    #: Fixed part of the noise margin, percent of the default-clock step time, added to the measured
    #: part (``noise_z`` standard errors of the measured step-time spread).
    margin_pct: float = Field(default=0.2, ge=0.0, le=50.0, allow_inf_nan=False)
    #: How many standard errors of the measured spread a candidate must keep below the target.
    noise_z: float = Field(default=2.0, ge=0.0, le=10.0, allow_inf_nan=False)
    #: Sequential probe test (Wald's SPRT, docs/closed-loop.md "How it decides" step 3): a probe
    #: is stopped as over the target once the evidence says so. ``sprt_alpha``: the chance that a
    #: clock with no slowdown beyond ``margin_pct`` is stopped (type I); ``sprt_beta``: the chance
    #: that a clock at the target is not stopped early (type II; the full-window test still
    #: rejects it). Fractions.
    sprt_alpha: float = Field(default=0.005, gt=0.0, le=0.2, allow_inf_nan=False)
    sprt_beta: float = Field(default=0.02, gt=0.0, le=0.5, allow_inf_nan=False)
    #: Default-clock steps measured per bucket before probing (and at each re-baseline).
    baseline_steps: int = Field(default=12, ge=3, le=10_000)
    #: Default-clock steps measured after each probe: every probe is compared with the default
    #: clock measured just before and just after it, so that context growth during the probe is
    #: not mistaken for a clock effect.
    ref_steps: int = Field(default=6, ge=2, le=10_000)
    #: Steps measured at a candidate clock, at least (a probe stops early once it is significantly
    #: over the target). Windows grow with the measured step noise so that the noise margin takes
    #: at most 1/2.5 of the room below the target, up to ``probe_steps_max``; a bucket whose noise
    #: needs more keeps the default clock (recorded) and retries later (``retry_after_s``).
    probe_steps: int = Field(default=16, ge=3, le=10_000)
    probe_steps_max: int = Field(default=2048, ge=3, le=100_000)
    #: Candidate clocks probed per bucket per search, at most. The search starts at the clock a
    #: neighbouring bucket holds (else half-way down), bisects, never probes below
    #: ``max_step_down`` x the lowest clock known to pass (a failed probe costs at most one such
    #: step of slowdown), and stops once the interval is narrower than ``resolution_mhz``.
    max_probes_per_bucket: int = Field(default=6, ge=1, le=64)
    #: Where the step noise needs longer windows than ``probe_steps_max`` to resolve the target,
    #: locate the memory-bound knee instead (docs/closed-loop.md, "Noisy steps: locate the
    #: knee"): ``knee_probe_steps`` steps at a clock with a large slowdown against
    #: ``knee_ref_steps`` default-clock steps bound the knee from above (under a stated model of
    #: its shape), and the bucket holds ``knee_margin_pct`` above that bound. ``False``: such a
    #: bucket keeps the default clock and retries later (``retry_after_s``).
    knee_locate: bool = True
    knee_probe_steps: int = Field(default=48, ge=3, le=10_000)
    knee_ref_steps: int = Field(default=192, ge=6, le=10_000)
    knee_margin_pct: float = Field(default=5.0, ge=0.0, le=100.0, allow_inf_nan=False)
    max_step_down: float = Field(default=0.7, gt=0.0, lt=1.0, allow_inf_nan=False)
    resolution_mhz: int = Field(default=60, ge=1, le=5000)
    #: A held clock is given up at once for the default clock when all but one of its last
    #: ``backoff_steps`` measured steps are clearly over the target (each above it by ``noise_z``
    #: of the measured spread: a few slow outlier steps never fire it), or when the one test
    #: (median + noise margin within the target) fails on a probe-length window. The default-clock
    #: steps that follow re-check the held clock against the default clock: it is kept if it
    #: passes (the GPU, not the clock, changed), else the bucket searches again above it.
    backoff_steps: int = Field(default=6, ge=1, le=1000)
    #: A held clock is also re-checked against the default clock after this many measured steps
    #: at it (one reference window of default-clock steps, then the same test; doubling while the
    #: re-checks pass), so that a change of the default clock's own step time is tracked. Two
    #: CUSUMs watch the held steps between re-checks (slower than the target: a violation;
    #: faster than the default clock: the fit is stale), so these can be rare: each costs a
    #: window of default-clock steps (docs/results/sim-closed-loop-adversarial.md).
    ref_every_steps: int = Field(default=2048, ge=16, le=1_000_000)
    #: Lowest SM clock the loop may probe, MHz (``None``: the GPU's lowest supported clock).
    min_sm_clock_mhz: int | None = Field(default=None, ge=100, le=5000)
    #: Decode batch-size buckets (lower edges, requests). A step belongs to the highest edge <= its batch.
    batch_buckets: tuple[int, ...] = Field(default=(1, 8, 32, 64, 128, 256, 512), strict=False)
    #: Steps a new bucket must persist before its clock is used (batch sizes fluctuate at an edge).
    bucket_dwell_steps: int = Field(default=8, ge=1, le=10_000)
    #: Re-measure the default-clock baseline of a held bucket this often, s (0: never), and whenever
    #: the decode context leaves the measured range by more than ``rebaseline_ctx_pct``: catches
    #: drift (context growth, thermals) that the per-step check cannot tell from a clock effect.
    rebaseline_s: float = Field(default=120.0, ge=0.0, le=86_400.0, allow_inf_nan=False)
    rebaseline_ctx_pct: float = Field(default=25.0, ge=0.0, le=1000.0, allow_inf_nan=False)
    #: Re-probe a bucket when its decode context (KV tokens) leaves the measured range by more than
    #: this factor (the batch mix changed; smaller moves only refresh the baseline: step times are
    #: compared through a fit in the context, so the clock found stays valid).
    reprobe_ctx_factor: float = Field(default=4.0, ge=1.0, le=100.0, allow_inf_nan=False)
    #: A bucket that holds the default clock (step noise too high, no clock left, SLO unattainable)
    #: searches again after ``retry_after_s``, and a bucket holding a lower clock tries the next
    #: clock one ``resolution_mhz`` below it then; each retry that finds nothing doubles the wait,
    #: up to ``reprobe_after_s`` (0: never retry). Seconds.
    retry_after_s: float = Field(default=20.0, gt=0.0, le=86_400.0, allow_inf_nan=False)
    reprobe_after_s: float = Field(default=600.0, ge=0.0, le=86_400.0, allow_inf_nan=False)
    #: Read-back: a clock switch counts only once the applied SM clock read back from the GPU
    #: (``nvmlDeviceGetClockInfo``, no privilege needed) shows it; a switch not seen within
    #: ``switch_confirm_ms`` is sent again, at most ``switch_retries`` times, then the closed loop
    #: turns off (one warning) and the default clock is requested. Steps are measurements at a
    #: clock only after its read-back; while holding, the clock is read back every
    #: ``readback_every_steps`` steps (a clock reset under us is noticed and re-sent). Four
    #: re-sends: a driver that loses 5 % of sets loses all of 5 tries of one switch about once in
    #: 3 million switches (with 3 tries, once in 8,000: within 30 min at ~5 switches a second,
    #: docs/results/sim-closed-loop-adversarial.md), and one that applies none is still found
    #: within 5 x ``switch_confirm_ms``.
    switch_confirm_ms: float = Field(default=150.0, gt=0.0, le=60_000.0, allow_inf_nan=False)
    switch_retries: int = Field(default=4, ge=0, le=100)
    readback_every_steps: int = Field(default=16, ge=1, le=100_000)

    @field_validator("batch_buckets")
    @classmethod
    def _buckets(cls, b: tuple[int, ...]) -> tuple[int, ...]:
        if not b or any(x < 1 for x in b) or len(set(b)) != len(b):
            raise ValueError(f"must be distinct positive batch sizes, got {list(b)}")
        return tuple(sorted(b))

    @model_validator(mode="after")
    def _probe_window(self) -> "ClosedLoopSettings":
        if self.probe_steps > self.probe_steps_max:
            raise ValueError(
                f"probe_steps {self.probe_steps} exceeds probe_steps_max {self.probe_steps_max}: raise the maximum or lower the start"
            )
        return self


class ClockSettings(_Strict):
    """Per-phase SM clock presets and how they are applied.

    ``mode`` (default ``auto``) picks what decides the clocks and whether they are set:

    * ``auto``: where this process may set clocks (root or CAP_SYS_ADMIN with NVML, checked without
      setting anything, or a zeusd that answers), the closed-loop controller sets them (the
      configured presets, where the build has no closed-loop controller or presets are given);
      elsewhere the same decisions run dry (recorded, and any saving shown as predicted only);
    * ``closed_loop``: the closed-loop controller, on the backend ``auto`` would pick;
    * ``presets``: the per-phase ``presets`` on ``backend`` (the behaviour before ``mode`` existed);
    * ``dry_run``: decide as ``auto`` would, never set a clock;
    * ``off``: no clock decisions at all (metering only).

    ``POWERSAVE_FORCE_DRY_RUN=1`` makes every mode dry-run (shared GPUs). See
    ``clocks/mode.py`` (:func:`~vllm_powersave.clocks.mode.select_clock_mode`).

    ``backend``: ``auto`` (default) = chosen by ``mode`` from this process's permissions;
    ``dry-run`` records decisions and never calls a setter; ``nvml`` locks
    clocks with ``nvmlDeviceSetGpuLockedClocks`` (needs root or CAP_SYS_ADMIN, falls back to
    dry-run with one warning); ``zeusd`` asks Zeus's privileged daemon over its Unix socket (for
    unprivileged servers; unreachable or refused -> dry-run with one warning); ``simulated`` drives
    the simulated GPU (machines without a GPU).
    """

    mode: Literal["auto", "closed_loop", "presets", "dry_run", "off"] = "auto"
    backend: Literal["auto", "dry-run", "nvml", "zeusd", "simulated"] = "auto"
    presets: dict[Phase, ClockPreset] = Field(default_factory=dict)
    #: Minimum time a clock stays applied before another change (hysteresis), in ms.
    min_dwell_ms: float = Field(default=500.0, ge=0.0, le=600_000.0, allow_inf_nan=False)
    #: A mixed step scheduling at most this many tokens in total is memory-bound (its FLOPs per
    #: weight byte equal its token count, below the GPU's ridge point: 661 TFLOP/s / 4.28 TB/s =
    #: 154 FLOP/B measured on the H200, docs/h200-facts.md) and gets
    #: the decode preset. Under continuous batching a new request joins every few steps, so pure
    #: decode runs rarely outlast the dwell; H200 traces: 97-99 % of steps are decode or such
    #: small mixed steps (docs/results/h200-vllm.md). 0 disables.
    memory_bound_max_tokens: int = Field(default=150, ge=0, le=100_000)
    #: Regime detection for continuous batching, where a new request joins every few steps: a
    #: time-weighted share of compute-bound steps (prefill, or mixed above
    #: memory_bound_max_tokens) over ``regime_window_s``; while it stays below
    #: ``compute_share_max`` every step gets the decode preset, so the occasional new prompt rides
    #: along instead of resetting the dwell. A prefill of ``prefill_burst_tokens`` or more always
    #: gets its own (higher) preset at once, so TTFT of real prefill bursts is not traded away.
    regime_window_s: float = Field(default=0.5, gt=0.0, le=60.0, allow_inf_nan=False)
    compute_share_max: float = Field(default=0.3, ge=0.0, le=1.0, allow_inf_nan=False)
    prefill_burst_tokens: int = Field(default=2048, ge=1)
    #: Directory of lease files (one per locked GPU) used to undo locks after a crash.
    lease_dir: str = Field(default="/tmp/vllm-powersave/leases", min_length=1)
    #: Look-ahead: raise the clock as soon as prompt tokens waiting in the scheduler's queue reach
    #: ``prefill_burst_tokens`` (before the burst's first step), and when a request arrives at an
    #: idle engine (single-process engines, see clocks/controller.py).
    lookahead: bool = True
    #: Time from a clock request until the new clock is in effect, in ms. Default 6 ms: the only
    #: public H200 figure (Velicka et al., as cited by Spaan, Chen, Varbanescu 2026,
    #: arXiv:2601.08539 Sec. 9; secondary, verbal; ../shared/data/dvfs/switch_latency.csv).
    #: Other reports for Hopper range 10-100 ms. Measure it on your GPU.
    switch_latency_ms: float = Field(default=6.0, gt=0.0, le=10_000.0, allow_inf_nan=False)
    #: A kernel-group preset is used only if the group's measured contiguous duration is at least
    #: this multiple of ``switch_latency_ms`` (10: at most ~10 % of the group runs at the old clock).
    group_min_switch_multiple: float = Field(default=10.0, ge=1.0, le=1000.0, allow_inf_nan=False)
    #: The out-of-process watchdog resets the clocks if the engine has not heart-beaten for this
    #: long (a hung step or a frozen process), not only when the process dies. Seconds.
    heartbeat_timeout_s: float = Field(default=30.0, ge=1.0, le=3600.0, allow_inf_nan=False)
    #: ``zeusd`` backend: Unix socket of Zeus's privileged daemon (default ``$ZEUSD_SOCK_PATH``).
    #: A JWT, if the daemon requires one, is read from ``$ZEUSD_TOKEN`` only (settings are logged).
    zeusd_socket: str | None = Field(default=None, min_length=1)
    #: zeusd's index of this worker's GPU; default: matched by PCI address from ``/discover``,
    #: else the CUDA device index.
    zeusd_gpu_index: int | None = Field(default=None, ge=0, le=1024)
    #: Closed-loop decode clock: measured, per batch bucket, with probes and back-off.
    closed_loop: ClosedLoopSettings = Field(default_factory=ClosedLoopSettings)


class EnergySettings(_Strict):
    """Energy meter: ``auto`` = NVML where a GPU is present, else the simulated GPU."""

    #: ``auto``: NVML where a GPU is present, else the simulated GPU; ``nvml``: NVML (no NVML
    #: device: the simulated meter, one warning); ``simulated``: the simulated GPU, labelled
    #: simulated; ``off``: no energy figures.
    meter: Literal["auto", "nvml", "simulated", "off"] = "auto"
    #: GPU model the simulated meter and clock backend stand for.
    simulated_gpu: Literal["h200"] = "h200"
    #: Simulate the steps as if the served model had this shape (e.g. "qwen2.5-7b"): the scheduled
    #: tokens and batches are the real ones, the FLOPs and bytes per step those of the named shape.
    #: For CPU demos with a tiny model, whose steps an H200 would spend almost entirely in launch
    #: overhead. Default: the served model's own parameter count.
    simulated_model_shape: Literal["qwen2.5-0.5b", "qwen2.5-7b", "llama3-8b"] | None = None
    #: Seconds without an engine step after which time is booked as idle.
    idle_after_s: float = Field(default=0.25, gt=0.0, le=60.0, allow_inf_nan=False)
    #: How often the background thread reads the energy counter and splits it over phases, s.
    tick_s: float = Field(default=0.25, ge=0.05, le=10.0, allow_inf_nan=False)
    #: How often the power, clock, temperature and clock-event gauges on /metrics are re-read, s.
    #: NVML reads take milliseconds on some machines (~4 ms each measured on the H200 host) and a
    #: GPU-bound step loop lost 0.26 % throughput with six reads every 0.25 s
    #: (docs/results/h200-energy-meter.md), so gauges are read far less often than the counter.
    gauge_period_s: float = Field(default=2.0, ge=0.0, le=300.0, allow_inf_nan=False)
    #: Sliding window of the tokens-per-joule gauge, s.
    window_s: float = Field(default=60.0, gt=0.0, le=86_400.0, allow_inf_nan=False)
    #: Power sampling period on GPUs without NVML's energy counter (method "power-sampling"), s.
    sample_period_s: float = Field(default=0.05, ge=0.005, le=10.0, allow_inf_nan=False)
    #: Steady state = steps whose running batch has at least this many requests (ML.ENERGY's
    #: window); default: the engine's max_num_seqs.
    steady_batch: int | None = Field(default=None, ge=1, le=65_536)
    #: With per_request_energy: how long a non-streaming completion, or the final usage chunk of a
    #: stream (``stream_options.include_usage``), waits for its energy before it is sent without it
    #: (``usage.energy_status`` "pending", no x-powersave-energy-j header; ms; 0 = never wait).
    #: Token chunks never wait. GET /powersave/requests/{id} serves the figure afterwards either way.
    response_wait_ms: float = Field(default=200.0, ge=0.0, le=10_000.0, allow_inf_nan=False)
    #: Front-end starvation watch (``starvation.py``): each API server counts its requests in flight
    #: through an ASGI middleware, which the starvation figures and warning need. False leaves the
    #: middleware out (the figures stay at 0), e.g. to measure what it costs a saturated API server.
    starvation_watch: bool = True
    #: Front-end starvation (``starvation.py``): warn when the GPU sat idle for more than this share
    #: of the time the API server had requests in flight (1 = never warn). The issue's H200 run:
    #: 9 % of the run's energy idle at concurrency 64 with one API server, gone with four.
    starvation_warn_share: float = Field(default=0.05, ge=0.0, le=1.0, allow_inf_nan=False)
    #: The share is judged over consecutive spans of at least this much busy time (s).
    starvation_min_busy_s: float = Field(default=30.0, ge=1.0, le=86_400.0, allow_inf_nan=False)
    #: After a starvation warning, the next one comes at the earliest this much later (s).
    starvation_warn_every_s: float = Field(default=600.0, ge=10.0, le=604_800.0, allow_inf_nan=False)


class TunedFor(_Strict):
    """What a preset file was tuned for. Any field left out is not checked.

    A mismatch stops the server at start-up with one line, unless ``allow_mismatch`` is true (then
    one warning): clocks tuned on one GPU model or driver can cost time on another.
    """

    gpu_name: str | None = Field(default=None, min_length=1)  # prefix, e.g. "NVIDIA H200"
    driver: str | None = Field(default=None, min_length=1)  # prefix, e.g. "580."
    vllm_version: str | None = Field(default=None, min_length=1)  # prefix, e.g. "0.25"
    model: str | None = Field(default=None, min_length=1)  # substring of the served model path/name
    #: True: a mismatch logs one warning instead of stopping the server.
    allow_mismatch: bool = False


#: The stock value of every saving, which ``savings: "off"`` (metering only) fills in.
METERING_ONLY: dict[str, Any] = {
    "cuda_perf_boost": "on",
    "clocks": {"mode": "off"},
    "chunking": {"enabled": False},
    "api_server_count": "vllm",
}


class DecodePacingSettings(_Strict):
    """Decode pacing (``pacing/pacer.py``, docs/decode-pacing.md): off unless a TPOT target is set."""

    #: Space decode-only engine steps at least this far apart (ms) while no request waits in the
    #: scheduler's queue, no running request is owed its prefill or first token and the batch is below
    #: ``max_num_seqs``; an arriving request ends a gap at once (TTFT +0.5 ms at most). Under
    #: open-loop arrivals the batch then grows with the period and each step's weight reads serve
    #: more tokens; under closed-loop clients at a fixed concurrency it only adds idle time, so
    #: measure it on your traffic (``vllm-powersave tune-serving``) before keeping it. Set it below
    #: your TPOT SLO: a request's TPOT comes out at about this value. Default: off.
    tpot_target_ms: float | None = Field(default=None, ge=0.1, le=1000.0, allow_inf_nan=False, strict=True)


class PowersaveSettings(_Strict):
    """All plugin settings (``--additional-config '{"powersave": {...}}'``)."""

    #: Provenance of the presets; checked against this server before anything starts.
    tuned_for: TunedFor | None = None
    chunking: ChunkingSettings = Field(default_factory=ChunkingSettings)
    clocks: ClockSettings = Field(default_factory=ClockSettings)
    energy: EnergySettings = Field(default_factory=EnergySettings)
    decode_pacing: DecodePacingSettings = Field(default_factory=DecodePacingSettings)
    #: Optional YAML/JSON file with further settings (inline keys win).
    config_file: str | None = Field(default=None, min_length=1)
    #: Directory where worker processes publish their figures for the API server's /metrics.
    stats_dir: str | None = Field(default=None, min_length=1)
    #: Attribute energy to requests (token share per step, see energy/account.py), write one line per
    #: finished request to ``stats_dir/requests-rank<N>.jsonl`` and export the totals on /metrics.
    per_request_energy: bool = False
    #: "off" sets CUDA_DISABLE_PERF_BOOST=1 in every engine process before it creates its CUDA
    #: context: the driver then stops holding the boost clock on a loaded-but-idle GPU and manages
    #: the SM clock itself under load. Needs no privilege and changes no device setting. Measured on
    #: the H200 test GPU: idle engine 119.6 W -> 77.4 W, -35 % (docs/results/h200-perf-boost.md). CUDA
    #: reads it once per process, so the engine's own context cannot switch; "auto" switches with a second one.
    #: "auto" (the default) also sets the variable, and boosts the GPU back while the engine is busy
    #: through a side CUDA context held by a helper process (no privilege; see clocks/boost.py),
    #: released after ``boost_release_after_s`` without a step: idle power of "off", latency of "on"
    #: under load (same record). GPU memory: the helper holds one primary CUDA context plus a 1 MiB
    #: buffer, outside vLLM's ``--gpu-memory-utilization`` share. Not measured on the H200 yet (the
    #: record above has no memory figure); a CUDA context on Hopper is commonly 0.3-0.6 GiB, so
    #: budget ~0.5 GiB (estimate). Where the helper cannot start (no memory left for a context, no
    #: driver) the engine serves unboosted, with one warning, and ``/metrics`` says so
    #: (``powersave_saving_state{saving="perf_boost",state="failed"}``). On a GPU that is busy
    #: nearly all the time "on" is the better choice: at 8 req/s on an H100 (busy ~99 %) it gave
    #: ~0.7 % more tokens per joule than "auto" (docs/results/h200-under-load.md); ``advise`` says so.
    cuda_perf_boost: Literal["on", "off", "auto"] = "auto"
    #: "auto" only: seconds without an engine step before the side context is released (s).
    #: At least 0.25 s: one hold plus one release takes ~0.24 s on the H200 (171 + 71 ms), so a
    #: shorter dwell only makes the side context flap between steps. Default 0.5 s (twice that):
    #: the boost is paid for every idle gap up to the dwell, and at 0.2 req/s a 2 s dwell kept 62 %
    #: of the idle-power saving on the table (docs/results/h200-defaults-release2s.md). A request
    #: that arrives unboosted costs ~3 ms more TTFT (15 vs 12 ms) until the hold lands
    #: (h200-perf-boost.md, wake-up). After a release the GPU itself stays at boosted idle power
    #: for ~1.3 s more (h200-defaults.md, release), which no dwell can save.
    boost_release_after_s: float = Field(default=0.5, ge=0.25, le=3600, allow_inf_nan=False)
    #: Write one JSON line per engine step (phase, tokens, LM-head rows, clock decision, host
    #: start/end times in s) to ``stats_dir/trace-rank<N>.jsonl``: the data the controller and the
    #: simulator are judged against. Costs a dict and a list append per step. The same file gets the
    #: closed loop's decisions (``{"closed_loop": ...}``), each finished perf-boost hold or release
    #: (``{"boost": {"t_s", "held", "ms"}}``, on the steps' clock; ``ms`` null where the boost was
    #: lost without a release: helper death, shutdown) and each energy tick (``{"tick":
    #: ...}``: the counter's joules over its span, step / gap / idle seconds, the requests it closed,
    #: the instant and learnt rest power, the counter steps its reads saw, and what each request
    #: in flight gained in it, ``request_j``).
    trace_steps: bool = False
    #: API-server processes of ``vllm serve`` when its command line sets no ``--api-server-count``.
    #: "auto": up to 4 per local engine, within the usable CPU cores (one left per engine process);
    #: on the H200, streamed, four against one gave x1.54 output throughput at concurrency 256 and
    #: x1.02 at 64, where one server was not the limit (docs/results/h200-under-load.md).
    #: "vllm": vLLM's own choice (one per data-parallel rank). A count: that many (1-64). Left
    #: alone wherever vLLM refuses several API servers, without a GPU, and under ``savings: off``.
    api_server_count: Literal["auto", "vllm"] | int = "auto"
    #: "auto": every saving that is on by default (``cuda_perf_boost``, ``clocks.mode``, the chunk
    #: table) runs as configured. "off": metering only: the engine keeps CUDA's boost (``"on"``),
    #: no clock decisions (``clocks.mode: off``) and no chunking; energy, phases and starvation are
    #: still measured. A saving set explicitly together with "off" is a contradiction and stops
    #: the server with one line.
    savings: Literal["auto", "off"] = "auto"

    @field_validator("api_server_count", mode="before")
    @classmethod
    def _api_server_count(cls, v: Any) -> Any:
        if v in ("auto", "vllm") or (type(v) is int and 1 <= v <= 64):
            return v
        raise ValueError('must be "auto", "vllm" or a count from 1 to 64')

    @model_validator(mode="before")
    @classmethod
    def _metering_only(cls, data: Any) -> Any:
        """``savings: off`` fills in the stock value of every saving (and rejects a saving set)."""
        if not isinstance(data, dict) or data.get("savings") != "off":
            return data
        data = dict(data)
        boost = data.get("cuda_perf_boost", "on")
        if boost != "on":
            raise ValueError(f"cuda_perf_boost {boost!r} conflicts with savings 'off' (metering only): drop one of them")
        clocks = data.get("clocks") or {}
        if isinstance(clocks, dict):
            mode = clocks.get("mode", "off")
            if mode != "off":
                raise ValueError(f"clocks.mode {mode!r} conflicts with savings 'off' (metering only): drop one of them")
            if clocks.get("presets"):
                raise ValueError("clocks.presets conflicts with savings 'off' (metering only): drop one of them")
            loop = clocks.get("closed_loop")
            if isinstance(loop, dict) and loop.get("enabled") is True:
                raise ValueError("clocks.closed_loop.enabled true conflicts with savings 'off' (metering only): drop one of them")
            clocks = {**clocks, **METERING_ONLY["clocks"]}
        chunking = data.get("chunking") or {}
        if isinstance(chunking, dict):
            if chunking.get("table") and chunking.get("enabled", True):
                raise ValueError("chunking.table conflicts with savings 'off' (metering only): drop one of them")
            chunking = {**chunking, **METERING_ONLY["chunking"]}
        pacing = data.get("decode_pacing") or {}
        if isinstance(pacing, dict) and pacing.get("tpot_target_ms") is not None:
            target = pacing["tpot_target_ms"]
            raise ValueError(f"decode_pacing.tpot_target_ms {target!r} conflicts with savings 'off' (metering only): drop one of them")
        servers = data.get("api_server_count", "vllm")
        if servers != "vllm":
            raise ValueError(f"api_server_count {servers!r} conflicts with savings 'off' (metering only): drop one of them")
        data.update(METERING_ONLY, clocks=clocks, chunking=chunking)
        return data

    @model_validator(mode="after")
    def _per_request_needs_a_meter(self) -> "PowersaveSettings":
        if self.per_request_energy and self.energy.meter == "off":
            raise ValueError("per_request_energy true needs an energy meter, energy.meter is 'off': drop one of them")
        return self

    @model_validator(mode="after")
    def _simulated_needs_sim_meter(self) -> "PowersaveSettings":
        if self.clocks.backend == "simulated" and self.energy.meter == "nvml":
            raise ValueError(
                "clocks.backend 'simulated' needs a simulated GPU, energy.meter 'nvml' measures a real one: use energy.meter 'simulated' or 'auto'"
            )
        return self


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'"


class _Held(NamedTuple):
    """The settings model a field's annotation holds, and how many key or index parts of an error
    location stand between the field and that model's own fields (dict values, list items)."""

    model: type[BaseModel]
    containers: int


def _model_in(tp: Any) -> _Held | None:
    """The settings model in a field's annotation (through Optional, dict values and list items)."""
    import typing

    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _Held(tp, 0)
    args, origin = typing.get_args(tp), typing.get_origin(tp)
    inner = args[1] if origin is dict and len(args) == 2 else args[0] if origin in (list, tuple) and args else None
    if inner is not None:
        held = _model_in(inner)
        return _Held(held.model, held.containers + 1) if held else None
    return next((h for h in map(_model_in, args) if h is not None), None)


def _did_you_mean(loc: list[str]) -> str:
    """ ", did you mean 'x'?" for a misspelt key: the closest field name where the key stands."""
    import difflib

    model, skip = PowersaveSettings, 0
    for part in loc[:-1]:
        if skip:  # a dict key or a list index
            skip -= 1
            continue
        field = model.model_fields.get(part)
        held = _model_in(field.annotation) if field is not None else None
        if held is None:
            return ""
        model, skip = held
    if skip:
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f", did you mean '{close[0]}'?" if close else ""


def _one_line(err: ValidationError) -> str:
    errors = err.errors()
    # A misspelt key also makes its real one "missing": the unknown key is the one to name.
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    loc = ".".join(str(p) for p in first["loc"] if p != "[key]")
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    msg = first["msg"].removeprefix("Value error, ")
    unknown = first.get("type") == "extra_forbidden"  # pydantic's "Extra inputs are not permitted"
    if unknown:
        key = str(first["loc"][-1]) if first["loc"] else ""
        hint = " (nested settings are objects: {'clocks': {'mode': ...}}, not 'clocks.mode')" if "." in key else ""
        msg = "unknown setting" + (hint or _did_you_mean([str(p) for p in first["loc"]]))
    if not loc and not unknown:  # a rule across fields: the message names them
        return f"powersave settings: {msg}{more}"
    # repr, shortened: a key with a newline or of thousands of characters still makes one line.
    return f"powersave setting {_short(loc)} = {_short(first.get('input'))}: {msg}{more}"


def _yaml12_loader() -> type:
    """PyYAML's SafeLoader with YAML 1.2's booleans and numbers. Under YAML 1.1 a bare
    ``off``/``on``/``yes``/``no`` is a boolean, so ``savings: off`` would reach the settings as
    ``False`` while every mode field here takes the string (docs/settings.md spells them bare);
    ``1:30`` is 90 and ``010`` is 8, while ``5e-3`` is text. Here only true/false are booleans,
    ``010`` is 10, ``5e-3`` is 0.005 and ``1:30`` stays text."""
    import yaml

    class Yaml12Loader(yaml.SafeLoader):
        pass

    dropped = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
    Yaml12Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in dropped]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
    Yaml12Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(loader.construct_scalar(node)))
    Yaml12Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."),
    )
    return Yaml12Loader


def _read_file(path: str, field: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise SettingsError(f"powersave setting '{field}' = {path!r}: is a directory, not a YAML/JSON file")
    if not p.is_file():
        raise SettingsError(f"powersave setting '{field}' = {path!r}: file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"powersave setting '{field}' = {path!r}: cannot read: {type(exc).__name__}") from None
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.load(text, Loader=_yaml12_loader())  # a SafeLoader subclass: no arbitrary objects
        else:
            data = json.loads(text)
    except Exception as exc:  # parse errors differ per format; keep the first line only
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SettingsError(f"powersave setting '{field}' = {path!r}: cannot parse: {msg}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"powersave setting '{field}' = {path!r}: top level must be a mapping")
    # A file may hold the settings bare or under a "powersave" key (same shape as additional-config).
    data = data["powersave"] if isinstance(data.get("powersave"), dict) else data
    if "config_file" in data:
        raise SettingsError(f"powersave setting '{field}' = {path!r}: a settings file may not name another config_file")
    return data


def merge_settings(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, mapping by mapping (a leaf of ``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_settings(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_settings(inline: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> PowersaveSettings:
    """Validate settings from the inline dict, ``config_file`` and ``$POWERSAVE_CONFIG``.

    Raises:
        SettingsError: one line naming the first invalid field and its value.
    """
    if inline is not None and not isinstance(inline, dict):
        raise SettingsError(f"powersave setting 'powersave' = {inline!r}: must be a mapping")
    data: dict[str, Any] = {}
    config_file = envs.config_file(env)
    if config_file:
        data = merge_settings(data, _read_file(config_file, ENV_CONFIG_FILE))
    inline = dict(inline or {})
    if inline.get("config_file"):
        data = merge_settings(data, _read_file(str(inline["config_file"]), "config_file"))
    data = merge_settings(data, inline)
    try:
        return PowersaveSettings.model_validate(data)
    except ValidationError as err:
        raise SettingsError(_one_line(err)) from None


def settings_from_env(env: dict[str, str] | None = None) -> PowersaveSettings:
    """Settings exported by the API-server process, or defaults plus ``$POWERSAVE_CONFIG``."""
    raw = envs.settings_json(env)
    if raw:
        try:
            return PowersaveSettings.model_validate_json(raw)
        except ValidationError as err:
            raise SettingsError(_one_line(err)) from None
    return load_settings(None, env)


def check_tuned_for(tuned: TunedFor | None, facts: dict[str, str | None]) -> list[str]:
    """Mismatches between a preset's ``tuned_for`` and this server's facts (one line each).

    ``facts``: ``gpu_name``, ``driver``, ``vllm_version``, ``model`` (``None`` = unknown here,
    which is reported as a mismatch only for fields the preset pins).
    """
    if tuned is None:
        return []
    out = []
    for field, how in (("gpu_name", "prefix"), ("driver", "prefix"), ("vllm_version", "prefix"), ("model", "substring")):
        want = getattr(tuned, field)
        if want is None:
            continue
        have = facts.get(field)
        ok = have is not None and (have.startswith(want) if how == "prefix" else want in have)
        if not ok:
            out.append(f"powersave setting 'tuned_for.{field}' = {want!r}: this server has {have!r}")
    return out
