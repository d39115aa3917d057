"""A simulated GPU: step time and power as functions of the work and the SM clock.

Everything this module returns is **simulated** and must be labelled so wherever it is shown.

Model (roofline plus a DVFS power model), per engine step:

* time ``t = max(t_compute, t_memory) + t_fixed`` where ``t_compute = FLOPs / (peak * f / f_max)``
  (compute-bound kernels scale with the SM clock) and ``t_memory = bytes / bandwidth`` (HBM-bound
  kernels do not scale with the SM clock while the SM clock stays above ``mem_bound_min_mhz``);
* power ``P = P_busy_static + P_mem * u_mem + P_sm(f) * a`` with ``P_sm(f) ∝ f V(f)^2`` and ``V``
  linear in ``f`` between ``v_min`` and 1; the SM activity ``a`` is 1 for compute-bound and
  ``mem_bound_sm_activity`` for memory-bound work (stalled SMs still burn clock power, which is the
  waste a lower decode clock removes);
* a power cap: if ``P`` exceeds it the clock drops until it fits (the H200's SW power cap).

Calibration (H200, ``docs/h200-facts.md``, measured on the test GPU): engine-loaded idle
122 W at 1980 MHz; bf16 GEMM 661 TFLOP/s at a capped ~1450 MHz and 689 W; device copy 4.28 TB/s
at 674 W and ~1940 MHz. The power constants, the voltage floor and the memory-bound knee are
fitted (``python -m vllm_powersave.sim.calibrate``, docs/results/sim-calibration.md) to those points
and to public H200 decode figures with locked clocks (Ma, Afzal, Eitzinger, Wellein 2026,
arXiv:2605.11999: +7-13 % power 1590 -> 1980 MHz, 24-34 % less power and < 1 % throughput loss at
780 MHz). Fit error: GEMM throughput -4 %, GEMM and copy power < 2 %, the decode ranges met.

``clock_response`` scales every clock-induced change of step time (1: the model); with
:func:`misfit` it makes a GPU whose true clock response differs from the model's (tests and
benchmarks of the closed-loop controller).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from .shapes import SHAPES, param_count


@dataclass(frozen=True)
class GpuSpec:
    """Constants of a simulated GPU. Units: MHz, W, FLOP/s, B/s, s."""

    name: str
    sm_clocks_mhz: tuple[int, ...]
    f_max_mhz: int
    peak_flops: float  # dense bf16 at f_max, achievable
    mem_bw: float  # achievable HBM bandwidth
    power_cap_w: float
    p_idle_w: float  # engine loaded (CUDA context), no work
    p_busy_static_w: float
    p_mem_w: float  # HBM power at full bandwidth use
    p_sm_max_w: float  # SM dynamic power at f_max, full activity (uncapped)
    v_min: float  # relative voltage at the lowest clock
    mem_bound_sm_activity: float
    mem_bound_min_mhz: int  # below this even memory-bound kernels slow down
    t_fixed_s: float  # per-step launch/sync overhead on the GPU side
    clock_response: float = 1.0  # scales t(f) - t(f_max): a GPU responding more or less than modelled


def _h200_clocks() -> tuple[int, ...]:
    # 110 values 345..1980 MHz in ~15 MHz steps on the test GPU (nvmlDeviceGetSupportedGraphicsClocks).
    step = (1980 - 345) / 109
    return tuple(sorted({int(round(345 + i * step)) for i in range(110)}))


H200 = GpuSpec(
    name="NVIDIA H200 (simulated)",
    sm_clocks_mhz=_h200_clocks(),
    f_max_mhz=1980,
    peak_flops=900e12,  # uncapped at 1980 MHz; the cap brings GEMMs to ~660 TFLOP/s like the measurement
    mem_bw=4.28e12,
    power_cap_w=700.0,
    p_idle_w=122.0,
    # Fitted by sim/calibrate.py (docs/results/sim-calibration.md); the knee is bounded from above
    # only (< 1 % decode slowdown at 780 MHz), and the fit takes that bound.
    p_busy_static_w=133.8,
    p_mem_w=250.8,
    p_sm_max_w=884.5,
    v_min=0.788,
    mem_bound_sm_activity=0.328,
    mem_bound_min_mhz=780,
    t_fixed_s=150e-6,
)

SPECS: dict[str, GpuSpec] = {"h200": H200}


def misfit(spec: GpuSpec, error: float) -> GpuSpec:
    """A GPU whose true clock response differs from ``spec``'s by ``error`` (e.g. +0.3: +30 %):
    every clock-induced slowdown scaled by ``1 + error`` and the memory-bound knee moved by the
    same factor (a knee 30 % higher makes the model's decode clock 30 % too low). Simulated."""
    knee = int(round(spec.mem_bound_min_mhz * (1 + error)))
    return replace(
        spec,
        name=f"{spec.name} misfit {error:+.0%}",
        clock_response=spec.clock_response * (1 + error),
        mem_bound_min_mhz=max(spec.sm_clocks_mhz[0], min(spec.f_max_mhz, knee)),
    )


@dataclass(frozen=True)
class StepWork:
    """Work of one engine step, in FLOPs and bytes moved to/from HBM."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class StepResult:
    """Simulated outcome of one step: seconds, joules, watts and the effective SM clock (MHz)."""

    time_s: float
    energy_j: float
    power_w: float
    sm_clock_mhz: int
    power_capped: bool


def _voltage(spec: GpuSpec, f: float) -> float:
    f_min = spec.sm_clocks_mhz[0]
    return spec.v_min + (1.0 - spec.v_min) * (f - f_min) / (spec.f_max_mhz - f_min)


def _eval_kernel(spec: GpuSpec, work: StepWork, f: float) -> tuple[float, float]:
    """Kernel time (s) and power (W) of ``work`` at SM clock ``f`` (MHz), no fixed overhead, no cap."""
    if spec.clock_response != 1.0 and f != spec.f_max_mhz:
        # Same work, same average power; the clock-induced change of time scaled (misfit GPUs).
        t_ref, _ = _eval_kernel_model(spec, work, spec.f_max_mhz)
        t, p = _eval_kernel_model(spec, work, f)
        t2 = max(1e-12, t_ref + spec.clock_response * (t - t_ref)) if t > 0 else t
        return t2, p
    return _eval_kernel_model(spec, work, f)


def _eval_kernel_model(spec: GpuSpec, work: StepWork, f: float) -> tuple[float, float]:
    rel = f / spec.f_max_mhz
    t_c = work.flops / (spec.peak_flops * rel)
    bw = spec.mem_bw * min(1.0, f / spec.mem_bound_min_mhz)
    t_m = work.bytes / bw
    t_kernel = max(t_c, t_m)
    if t_kernel <= 0:
        return 0.0, spec.p_idle_w
    u_c = t_c / t_kernel
    u_m = t_m / t_kernel
    # Quadratic in the compute share: partly compute-bound kernels overlap with memory stalls.
    act = spec.mem_bound_sm_activity + (1.0 - spec.mem_bound_sm_activity) * u_c**2
    p_sm = spec.p_sm_max_w * rel * _voltage(spec, f) ** 2 * act
    return t_kernel, spec.p_busy_static_w + spec.p_mem_w * u_m + p_sm


def _eval(spec: GpuSpec, work: StepWork, f: float) -> tuple[float, float]:
    t_kernel, p_kernel = _eval_kernel(spec, work, f)
    t = t_kernel + spec.t_fixed_s
    if t_kernel <= 0:
        return t, spec.p_idle_w
    # The fixed part of the step (launches, syncs) runs near idle power.
    p = (p_kernel * t_kernel + spec.p_idle_w * spec.t_fixed_s) / t
    return t, p


def simulate_kernel(spec: GpuSpec, work: StepWork, sm_clock_mhz: float) -> StepResult:
    """Like :func:`simulate_step` for one kernel group (no per-step launch overhead). Simulated."""
    return _under_power_cap(spec, work, sm_clock_mhz, _eval_kernel)


def predict(
    profile: "StepWork | list[StepWork] | tuple[StepWork, ...]", sm_clock_mhz: float, spec: "GpuSpec | None" = None
) -> tuple[float, float, float]:
    """``(time s, average power W, energy J)`` of one step at a locked SM clock (MHz). Simulated.

    ``profile``: the step's work, whole (:class:`StepWork`) or as its kernel groups in order (a
    list: each group is priced on its own, with the power cap applied per group, plus the step's
    fixed launch overhead once). Use it to replay measured per-clock data through the model.
    """
    spec = spec or H200
    if isinstance(profile, StepWork):
        r = simulate_step(spec, profile, sm_clock_mhz)
        return r.time_s, r.power_w, r.energy_j
    t = spec.t_fixed_s
    e = spec.p_idle_w * spec.t_fixed_s
    for w in profile:
        r = simulate_kernel(spec, w, sm_clock_mhz)
        t += r.time_s
        e += r.energy_j
    return t, e / t, e


def idle_power_w(spec: GpuSpec, locked_mhz: int | None) -> float:
    """Power (W) of a loaded but idle GPU; a locked clock keeps it from dropping its clock. Simulated."""
    if locked_mhz is None:
        return spec.p_idle_w
    return spec.p_busy_static_w * 0.6 + 0.06 * spec.p_sm_max_w * (locked_mhz / spec.f_max_mhz) * _voltage(spec, locked_mhz) ** 2


def simulate_step(spec: GpuSpec, work: StepWork, sm_clock_mhz: float) -> StepResult:
    """Simulate one step at a requested SM clock (MHz), applying the power cap. Simulated."""
    return _under_power_cap(spec, work, sm_clock_mhz, _eval)


def _under_power_cap(spec: GpuSpec, work: StepWork, sm_clock_mhz: float, evaluate) -> StepResult:
    """The highest supported clock <= the request whose power stays under the cap, as the
    driver's power capping does; the lowest clock if none does (``capped``)."""
    clocks = [c for c in spec.sm_clocks_mhz if c <= sm_clock_mhz] or [spec.sm_clocks_mhz[0]]
    capped = False
    for f in reversed(clocks):
        t, p = evaluate(spec, work, f)
        if p <= spec.power_cap_w:
            return StepResult(t, p * t, p, f, capped)
        capped = True
    t, p = evaluate(spec, work, clocks[0])
    return StepResult(t, p * t, p, clocks[0], True)


@dataclass
class ModelCost:
    """FLOPs and bytes per token of a decoder-only transformer (bf16 weights and KV cache).

    ``n_params``: parameters touched per token (embedding lookup excluded);
    ``kv_bytes_per_token``: K+V bytes per token over all layers.
    """

    n_params: float
    kv_bytes_per_token: float
    weight_bytes: float
    #: Parameters of the LM head (vocab x hidden), charged per LM-head row rather than per token.
    vocab_params: float = 0.0

    @classmethod
    def for_shape(cls, shape: str) -> "ModelCost":
        """Costs of a named real model shape (:data:`.shapes.SHAPES`), bf16."""
        cfg = SHAPES[shape]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        n = float(param_count(shape))
        kv = float(2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2)
        return cls(n, kv, 2 * n, float(cfg["vocab_size"] * cfg["hidden_size"]))

    def step_work(self, num_tokens: int, lm_head_rows: int, decode_ctx_tokens: int, vocab_params: float = 0.0) -> StepWork:
        """Work of a step with ``num_tokens`` scheduled tokens and ``lm_head_rows`` LM-head rows.

        Prefill tokens only need the LM head for their last row, which is why ``vocab_params`` is
        charged per LM-head row instead of per token.
        """
        body = self.n_params - vocab_params
        flops = 2.0 * body * num_tokens + 2.0 * vocab_params * lm_head_rows
        nbytes = self.weight_bytes + self.kv_bytes_per_token * (decode_ctx_tokens + num_tokens)
        return StepWork(flops=flops, bytes=nbytes)


@dataclass(frozen=True)
class KernelGroupCost:
    """Work of one engine step split into kernel groups, in execution order (bf16 weights, KV cache).

    Groups: per layer ``attention`` (QKV/O projections, norms, rotary, attention core, KV-cache
    reads and writes) then ``mlp`` (gate/up/down GEMMs and activation); after the last layer
    ``lm_head`` (logits GEMM, fp32 logits written) and ``sampling`` (passes over the logits). A
    group's contiguous run is one layer's attention or MLP, which is what a clock switch must
    outlast. Roofline inputs only: the times and powers come from :func:`simulate_kernel`. Simulated.
    """

    layers: int
    hidden: int
    q_dim: int  # attention heads x head_dim
    kv_dim: int  # KV heads x head_dim
    intermediate: int
    vocab: int

    @classmethod
    def for_shape(cls, shape: str) -> "KernelGroupCost":
        """Group costs of a named model shape (:data:`.shapes.SHAPES`)."""
        c = SHAPES[shape]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(
            c["num_hidden_layers"],
            c["hidden_size"],
            c["num_attention_heads"] * head_dim,
            c["num_key_value_heads"] * head_dim,
            c["intermediate_size"],
            c["vocab_size"],
        )

    def layer(self, tokens: int, decode_ctx: int, prefill_attend: int) -> tuple[StepWork, StepWork]:
        """``(attention, mlp)`` work of one layer.

        ``tokens``: scheduled tokens; ``decode_ctx``: KV tokens read by decoding requests;
        ``prefill_attend``: sum over prefill tokens of the positions each attends to.
        """
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        proj = h * (q + 2 * kv) + q * h
        kv_tok = 2 * kv * 2  # K and V bytes per token and layer
        attn_flops = 2.0 * tokens * proj + 4.0 * q * (decode_ctx + prefill_attend)
        # Flash attention re-reads K/V once per 64-query tile of a prompt chunk.
        attn_bytes = 2.0 * proj + kv_tok * (decode_ctx + prefill_attend / 64.0 + tokens) + tokens * (h * 8.0 + (q + 2 * kv) * 4.0)
        mlp_params = 3 * h * self.intermediate
        mlp = StepWork(2.0 * tokens * mlp_params, 2.0 * mlp_params + tokens * (h * 8.0 + self.intermediate * 6.0))
        return StepWork(attn_flops, attn_bytes), mlp

    def head(self, rows: int) -> tuple[StepWork, StepWork]:
        """``(lm_head, sampling)`` work for ``rows`` rows reaching the LM head."""
        params = self.vocab * self.hidden
        lm = StepWork(2.0 * rows * params, 2.0 * params + rows * (self.vocab * 4.0 + self.hidden * 2.0))
        return lm, StepWork(8.0 * rows * self.vocab, 12.0 * rows * self.vocab)

    def groups(self, tokens: int, rows: int, decode_ctx: int, prefill_attend: int) -> list[tuple[str, StepWork]]:
        """The step's groups in execution order (``2 * layers + 2`` entries)."""
        attn, mlp = self.layer(tokens, decode_ctx, prefill_attend)
        lm, smp = self.head(rows)
        return [g for _ in range(self.layers) for g in (("attention", attn), ("mlp", mlp))] + [("lm_head", lm), ("sampling", smp)]


@dataclass
class SimulatedGpu:
    """Stateful simulated GPU: current SM clock and cumulative energy (J). Thread-safe. Simulated."""

    spec: GpuSpec = H200
    sm_clock_mhz: int = 0
    locked: bool = False
    energy_j: float = 0.0
    busy_time_s: float = 0.0
    last_power_w: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.sm_clock_mhz:
            self.sm_clock_mhz = self.spec.f_max_mhz
        self.last_power_w = self.spec.p_idle_w

    def set_sm_clock(self, mhz: int | None) -> None:
        """Lock the simulated SM clock (MHz), or unlock (``None``: back to the boost clock)."""
        with self._lock:
            self.locked = mhz is not None
            self.sm_clock_mhz = int(mhz) if mhz is not None else self.spec.f_max_mhz

    def run(self, work: StepWork) -> StepResult:
        with self._lock:
            res = simulate_step(self.spec, work, self.sm_clock_mhz)
            self.energy_j += res.energy_j
            self.busy_time_s += res.time_s
            self.last_power_w = res.power_w
            return res

    def idle_power_w(self) -> float:
        """Power (W) :meth:`idle` books now (a locked clock keeps the idle GPU from dropping it)."""
        with self._lock:
            return idle_power_w(self.spec, self.sm_clock_mhz if self.locked else None)

    def idle(self, seconds: float) -> float:
        """Book ``seconds`` of idle time; returns the joules added. An unlocked idle GPU draws p_idle."""
        if seconds <= 0:
            return 0.0
        with self._lock:
            p = idle_power_w(self.spec, self.sm_clock_mhz if self.locked else None)
            self.energy_j += p * seconds
            self.last_power_w = p
            return p * seconds
