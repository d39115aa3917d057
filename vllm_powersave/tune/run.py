"""``vllm-powersave tune MODEL``: profile, chunking tuner, clock solver, preset file and report.

Parts (``--only chunking`` / ``--only clocks`` runs one):

1. **Profile** (:mod:`.profile`): prefill, decode and mixed steps of the model's modules with
   vLLM-equal shapes under ``torch.profiler``; kernel groups with time share, arithmetic intensity
   and a compute-/memory-bound label from the ceilings (measured on a GPU, simulated H200 otherwise).
2. **Chunking** (:mod:`.lmhead`): LM-head time and energy per chunk count over a grid of row
   counts; chosen per row bucket by :func:`vllm_powersave.chunking.tune.choose_chunks`.
3. **Clocks** (:mod:`.solver`), in one of three modes:

   * ``sweep`` -- a GPU and clock permission (root or CAP_SYS_ADMIN): SM clocks are swept per kernel
     group after a thermal warm-up, solved, and the choice re-measured (measured);
   * ``predict`` -- otherwise, with ``--predict``, or whenever ``POWERSAVE_FORCE_DRY_RUN=1``: curves
     from the profile and the clock-response model; no clock is ever set (predicted, simulated);
   * ``simulated-sweep`` -- ``--simulate-sweep``: the sweep and its re-measurement guard run against
     the simulated H200 with injected noise (simulated; for machines without a GPU).

Outputs in ``--out``: ``preset.yaml`` (the settings schema: ``chunking.table``,
``clocks.presets``; validated before it is written), ``report.md``, ``report.png``, ``tune.json``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import envs
from ..clocks.mode import clock_permission
from ..device import GpuError, driver_version
from ..envs import ENV_FORCE_DRY_RUN
from ..sim.gpu import H200, GpuSpec
from . import lmhead
from .energy import SIM_KERNEL_OVERHEAD_S, busy_window, open_nvml
from .profile import (
    KINDS,
    REGIONS,
    Ceilings,
    ModelShape,
    StepProfile,
    StepSpec,
    default_steps,
    group_table,
    measure_ceilings,
    profile_step,
    region_durations_ms,
    simulated_ceilings,
)
from .solver import (
    DEFAULT,
    Curve,
    ResponseModel,
    SimulatedMeasurer,
    SweepResult,
    solve_global,
    solve_local,
    solve_single,
    sum_curves,
    sweep_and_solve,
)

PHASES = ("prefill", "decode", "mixed")
CPU_GRID = "8:decode,32:decode,128:spec,512:logprobs"


@dataclass
class TuneOptions:
    """Options of ``vllm-powersave tune`` (see ``vllm-powersave tune --help``)."""

    model: str
    out: str | None = None
    only: str | None = None  # None, "chunking" or "clocks"
    predict: bool = False
    simulate_sweep: bool = False
    sim_noise: float = 0.03
    slowdown_pct: float = 0.0
    phases: tuple[str, ...] = PHASES
    tp: int = 1
    device: str | None = None
    rows: str | None = None
    chunks: str = lmhead.DEFAULT_CHUNKS
    window_s: float | None = None
    repeats: int = 2
    warmup_s: float | None = None
    profile_repeats: int = 3
    sweep_points: int = 12
    sweep_repeats: int = 3
    sweep_window_s: float = 1.0
    thermal_warmup_s: float = 30.0
    progress: bool = True
    seed: int = 0
    steps: list[StepSpec] | None = None

    def validate(self) -> None:
        """Raises ValueError (one line naming the option and value) on bad input; touches nothing."""
        if self.only not in (None, "chunking", "clocks"):
            raise ValueError(f"--only = {self.only!r}: must be 'chunking' or 'clocks'")
        if not 0 <= self.slowdown_pct <= 100:
            raise ValueError(f"--slowdown = {self.slowdown_pct!r}: must be a percentage in [0, 100]")
        bad = [p for p in self.phases if p not in PHASES]
        if bad or not self.phases:
            raise ValueError(f"--phases = {','.join(self.phases)!r}: each must be one of {', '.join(PHASES)}")
        if self.tp < 1:
            raise ValueError(f"--tp = {self.tp}: must be >= 1")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"--device = {self.device!r}: must be 'cpu' or 'cuda'")
        if not 0 <= self.sim_noise <= 0.5:
            raise ValueError(f"--sim-noise = {self.sim_noise!r}: must be a fraction in [0, 0.5]")
        for name, v, lo in (
            ("--repeats", self.repeats, 1),
            ("--profile-repeats", self.profile_repeats, 1),
            ("--sweep-points", self.sweep_points, 2),
            ("--sweep-repeats", self.sweep_repeats, 1),
        ):
            if v < lo:
                raise ValueError(f"{name} = {v}: must be >= {lo}")
        for name, w in (("--window", self.window_s), ("--sweep-window", self.sweep_window_s)):
            if w is not None and not 0 < w <= 60:
                raise ValueError(f"{name} = {w}: must be in (0, 60] s")
        for name, v in (("--thermal-warmup", self.thermal_warmup_s), ("--warmup", self.warmup_s)):
            if v is not None and not 0 <= v <= 3600:
                raise ValueError(f"{name} = {v}: must be in [0, 3600] s")
        if self.rows is not None:
            try:
                lmhead.parse_grid(self.rows)
            except ValueError as err:
                raise ValueError(f"--rows = {self.rows!r}: {err}") from None
        lmhead.parse_ints(self.chunks, "--chunks")
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"--out = {self.out!r}: exists and is not a directory")


def clock_mode(predict: bool, simulate_sweep: bool, gpu: bool, permission: bool, env: dict[str, str] | None = None) -> tuple[str, str]:
    """``(mode, reason)``: "sweep", "predict" or "simulated-sweep". Forced dry-run always wins."""
    if envs.force_dry_run(env):
        return "predict", f"{ENV_FORCE_DRY_RUN}=1: clocks are never set here"
    if predict:
        return "predict", "--predict"
    if simulate_sweep:
        return "simulated-sweep", "--simulate-sweep (the simulated H200 with injected noise)"
    if not gpu:
        return "predict", "no GPU"
    if not permission:
        return "predict", "no clock permission (needs root or CAP_SYS_ADMIN)"
    return "sweep", "GPU with clock permission"


class GpuClockMeasurer:
    """``measure(item, clock) -> (s, J)`` on a real GPU: locks the SM clock, runs the item's workload
    back to back for a counter-aligned window (:func:`.energy.busy_window`) on ``gpu``. Measured.

    ``backend``: a :class:`~vllm_powersave.clocks.backends.ClockBackend` (nvml); ``scale``: per item,
    the factor from one workload call to one step (the layer count for per-layer regions).
    :meth:`close` resets the clocks; use it in ``finally``.
    """

    def __init__(
        self,
        backend: Any,
        workloads: dict[str, Callable[[], Any]],
        scale: dict[str, float],
        window_s: float,
        gpu: Any,
        window_fn: Callable[..., Any] = busy_window,
        settle_s: float = 0.05,
    ) -> None:
        self.backend, self.workloads, self.scale = backend, workloads, scale
        self.window_s, self.gpu, self.window_fn, self.settle_s = window_s, gpu, window_fn, settle_s
        self.current: int | None = None

    def __call__(self, item: str, f: int) -> tuple[float, float]:
        if f != self.current:
            if f == DEFAULT:
                self.backend.reset()
            else:
                self.backend.set_clocks(int(f))
            self.current = f
            time.sleep(self.settle_s)
        w = self.window_fn(self.workloads[item], self.window_s, self.gpu)
        k = self.scale.get(item, 1.0)
        return k * w.ms_per_call / 1000.0, k * w.j_per_call

    def close(self) -> None:
        self.backend.reset()
        self.current = DEFAULT


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _sweep_both(
    meas: Any, workloads: list[str], clocks: list[int], budget: float, repeats: int, source: str, progress: Callable[[int], None]
) -> dict[str, SweepResult]:
    """The single-operation and the global solver over one clock sweep: the global solver reuses
    the single one's readings (its ``table``), so the GPU is swept once."""
    out: dict[str, SweepResult] = {}
    for solver in ("single", "global"):
        out[solver] = sweep_and_solve(
            meas,
            workloads,
            clocks,
            budget,
            solver=solver,
            repeats=repeats,
            source=source,
            progress=progress,
            table=out["single"].table if out else None,
        )
    return out


def _sweep_clocks(all_clocks: tuple[int, ...], n: int, f_max: int) -> list[int]:
    cl = [c for c in all_clocks if c < f_max]
    if len(cl) <= n:
        return cl
    step = (len(cl) - 1) / (n - 1)
    return sorted({cl[round(i * step)] for i in range(n)})


def _op_curves(sp: StepProfile, model: ResponseModel, use_measured: bool) -> list[tuple[dict, Curve]]:
    out = []
    for r in sp.ops:
        over = SIM_KERNEL_OVERHEAD_S * r["layers"] if not r["modelled"] else 0.0
        t_ref = r["time_s"] if use_measured and r["time_s"] > 0 else None
        out.append((r, model.curve(r["flops"], r["bytes"], t_ref_s=t_ref, overhead_s=0.0 if t_ref else over)))
    return out


def _group_curves(op_curves: list[tuple[dict, Curve]], key: str, names: tuple[str, ...]) -> dict[str, Curve]:
    groups: dict[str, list[Curve]] = {}
    for r, c in op_curves:
        groups.setdefault(r[key], []).append(c)
    return {n: sum_curves(groups[n]) for n in names if n in groups}


@dataclass
class TuneResult:
    """Everything the tuner found; :meth:`summary` is what ``tune.json`` holds."""

    opts: TuneOptions
    out_dir: Path
    device: dict
    ceilings: Ceilings | None = None
    profiles: dict[str, StepProfile] = field(default_factory=dict)
    chunk_points: list[dict] = field(default_factory=list)
    chunk_choice: dict = field(default_factory=dict)
    chunk_table: list[dict] | None = None
    chunk_source: str = ""
    clock_mode: tuple[str, str] | None = None
    clock_source: str = ""
    phase_curves: dict[str, dict[str, Curve]] = field(default_factory=dict)
    solutions: dict[str, dict[str, Any]] = field(default_factory=dict)
    sweeps: dict[str, dict[str, SweepResult]] = field(default_factory=dict)
    presets: dict[str, dict] = field(default_factory=dict)
    group_presets: dict[str, dict[str, dict]] = field(default_factory=dict)
    preset_path: Path | None = None
    model_name: str = ""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        def sweep_d(s: SweepResult) -> dict:
            return {
                "choice": s.choice.as_dict(),
                "expected_saving": s.expected_saving,
                "remeasured_saving": s.remeasured_saving,
                "expected_slowdown": s.expected_slowdown,
                "remeasured_slowdown": s.remeasured_slowdown,
                "noise": s.noise,
                "tolerance": s.tolerance,
                "fell_back": s.fell_back,
                "rounds": s.rounds,
                "first_choice_without_guard": s.naive.as_dict() if s.naive else None,
            }

        prof = {}
        for ph, sp in self.profiles.items():
            prof[ph] = {
                "step": dataclasses.asdict(sp.step),
                "total_s": sp.total_s,
                "sim_total_s": sp.sim_total_s,
                "kinds": group_table(sp, self.ceilings),
                "regions": group_table(sp, self.ceilings, "regions"),
                "ops": sp.ops,
            }
        return {
            "what": "vllm-powersave tune",
            "date": _now(),
            "model": self.opts.model,
            "device": self.device,
            "ceilings": dataclasses.asdict(self.ceilings) | {"ridge": self.ceilings.ridge} if self.ceilings else None,
            "profile": prof,
            "chunking": {
                "source": self.chunk_source,
                "table": self.chunk_table,
                "per_rows": {str(k): v for k, v in self.chunk_choice.items()},
                "points": self.chunk_points,
            }
            if self.chunk_table is not None
            else None,
            "clocks": {
                "mode": self.clock_mode[0],
                "reason": self.clock_mode[1],
                "source": self.clock_source,
                "slowdown_budget": self.opts.slowdown_pct / 100,
                "solutions": self.solutions,
                "sweeps": {ph: {k: sweep_d(v) for k, v in d.items()} for ph, d in self.sweeps.items()},
                "presets": self.presets,
                "group_presets": self.group_presets,
            }
            if self.clock_mode
            else None,
            "preset_file": str(self.preset_path) if self.preset_path else None,
            "notes": self.notes,
        }


class _Bar:
    """tqdm when wanted and installed, else a silent counter."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="pt", desc="tune", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def update(self, n: int = 1, desc: str | None = None) -> None:
        if self.bar is not None:
            if desc:
                self.bar.set_description(desc)
            self.bar.update(n)

    def grow(self, n: int) -> None:
        if self.bar is not None:
            self.bar.total += n
            self.bar.refresh()

    def write(self, msg: str, log: Callable[[str], None]) -> None:
        if self.bar is not None:
            self.bar.write(msg)  # above the bar instead of through it
        else:
            log(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _device_info(torch: Any, gpu: bool) -> tuple[dict, Any]:
    if not gpu:
        return {"kind": "cpu", "name": "cpu", "target": H200.name, "energy": "simulated"}, None
    nv = open_nvml(torch.cuda.current_device())
    info = {"kind": "cuda", "name": torch.cuda.get_device_name(), "energy": "measured" if nv else "unavailable (no NVML)"}
    if nv:
        try:
            info["driver"] = driver_version(nv.nvml)
        except GpuError:
            pass
    return info, nv


def _gpu_spec(info: dict, nv: Any, ceilings: Ceilings) -> tuple[GpuSpec, str]:
    """The response model's GPU: the H200 model, or its power calibration with this GPU's clocks/ceilings."""
    if info["kind"] != "cuda" or str(info.get("name", "")).startswith("NVIDIA H200"):
        return H200, "simulated H200 (vllm_powersave/sim/gpu.py)"
    clocks = H200.sm_clocks_mhz
    if nv:
        try:
            clocks = nv.supported_sm_clocks_mhz()  # read-only queries
        except GpuError:
            pass
    spec = dataclasses.replace(
        H200,
        name=f"{info['name']} (H200-calibrated power model)",
        sm_clocks_mhz=tuple(clocks),
        f_max_mhz=max(clocks),
        peak_flops=ceilings.peak_flops,
        mem_bw=ceilings.mem_bw,
    )
    return spec, f"{info['name']}: measured ceilings, H200-calibrated power model (simulated)"


def run_tune(opts: TuneOptions, log: Callable[[str], None] = print) -> TuneResult:
    """Run the tuner and write preset, report and JSON into the output directory.

    Raises:
        ValueError: bad options or model (one line; nothing is written).
        RuntimeError: a GPU without NVML where energy must be measured.
    """
    opts.validate()
    shape = ModelShape.from_dir(opts.model)
    rank_shape = shape.sharded(opts.tp)  # validates tp against the heads before anything runs
    import torch

    gpu = (opts.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if gpu and not torch.cuda.is_available():
        raise ValueError("--device = 'cuda': no CUDA device available")
    out_dir = Path(opts.out or Path("runs") / f"tune-{shape.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:  # before any work: a run must not end in a traceback over its output directory
        out_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(out_dir, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        raise ValueError(f"--out = {str(out_dir)!r}: cannot create or write the directory: {exc.strerror or exc}") from None
    info, nv = _device_info(torch, gpu)
    res = TuneResult(opts, out_dir, info, model_name=shape.name)
    dev = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    do_chunks, do_clocks = opts.only in (None, "chunking"), opts.only in (None, "clocks")
    steps = [s for s in (opts.steps or default_steps(gpu)) if s.phase in opts.phases]
    rows = opts.rows or (lmhead.DEFAULT_GRID if gpu else CPU_GRID)
    window = opts.window_s if opts.window_s is not None else (1.0 if gpu else 0.05)
    warm = opts.warmup_s if opts.warmup_s is not None else (2.0 if gpu else 0.0)
    grid, chunks = lmhead.parse_grid(rows), lmhead.parse_ints(opts.chunks, "--chunks")
    n_chunk_pts = lmhead.planned_points([(rank_shape.hidden, rank_shape.vocab)], grid, chunks, opts.repeats) if do_chunks else 0
    bar = _Bar(opts.progress, (len(steps) if do_clocks else 0) + n_chunk_pts)
    try:
        res.ceilings = measure_ceilings(torch, dev) if gpu else simulated_ceilings()
        bar.write(
            f"[tune] {shape.name}: {shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}, tp {opts.tp}; device {info['name']}; "
            f"ceilings {res.ceilings.peak_flops / 1e12:.0f} TFLOP/s, {res.ceilings.mem_bw / 1e12:.2f} TB/s ({res.ceilings.source.split(' (')[0]})",
            log,
        )
        if do_clocks:
            for s in steps:
                bar.update(0, f"profile {s.phase}")
                res.profiles[s.phase] = profile_step(
                    shape, s, torch=torch, device=dev, dtype=dtype, ceilings=res.ceilings, tp=opts.tp, repeats=opts.profile_repeats
                )
                bar.update(1)
        if do_chunks:
            _tune_chunks(res, torch, rank_shape, grid, chunks, window, warm, gpu, bar)
        if do_clocks:
            perm, why = clock_permission()
            res.clock_mode = clock_mode(opts.predict, opts.simulate_sweep, gpu, perm, os.environ)
            bar.write(f"[tune] clocks: {res.clock_mode[0]} ({res.clock_mode[1]})", log)
            _tune_clocks(res, torch, shape, dev, dtype, nv, bar)
    finally:
        bar.close()
    res.preset_path = write_preset(res, out_dir / "preset.yaml")
    from .report import write_report

    write_report(res)
    (out_dir / "tune.json").write_text(json.dumps(res.summary(), indent=1, default=str))
    log(f"[tune] wrote {res.preset_path}, {out_dir / 'report.md'}, {out_dir / 'report.png'}, {out_dir / 'tune.json'}")
    return res


def _tune_chunks(
    res: TuneResult, torch: Any, shape: ModelShape, grid: list, chunks: list[int], window: float, warm: float, gpu: bool, bar: _Bar
) -> None:
    from ..chunking.tune import choose_chunks, combine_modes, to_table

    pts = []
    for p in lmhead.measure(
        [(shape.hidden, shape.vocab)],
        grid,
        chunks,
        window_s=window,
        repeats=res.opts.repeats,
        warmup_s=warm,
        device="cuda" if gpu else "cpu",
        seed=res.opts.seed,
    ):
        pts.append(p)
        bar.update(1, f"lm-head {p['rows']} rows")
    res.chunk_points = pts
    # On a GPU: measured time and energy. On a CPU both from the H200 model (a prediction for the
    # H200; the CPU's own LM-head time is kept in the points but mixing it with simulated energy
    # would choose for neither machine).
    tkey = "ms" if gpu else "sim_ms"
    res.chunk_source = (
        "measured (CUDA events, NVML)" if gpu else "simulated H200 (time and energy from the model; CPU time shown for reference)"
    )
    per_mode = []
    for mode in sorted({p["mode"] for p in pts}):
        per_mode.append(
            choose_chunks(
                [{"rows": p["rows"], "chunks": p["chunks"], "ms": p[tkey], "j": p["j_per_call"]} for p in pts if p["mode"] == mode]
            )
        )
    res.chunk_choice = combine_modes(per_mode)
    res.chunk_table = to_table(res.chunk_choice)


def _tune_clocks(res: TuneResult, torch: Any, shape: ModelShape, dev: Any, dtype: Any, nv: Any, bar: _Bar) -> None:
    mode = res.clock_mode[0]
    budget = res.opts.slowdown_pct / 100.0
    gpu = res.device["kind"] == "cuda"
    spec, spec_src = _gpu_spec(res.device, nv, res.ceilings)
    model = ResponseModel(spec)
    res.clock_source = {
        "predict": f"predicted: profile {'measured on this GPU' if gpu else 'costed by the simulated H200'} + clock-response model ({spec_src})",
        "simulated-sweep": f"simulated sweep of {spec_src} with {res.opts.sim_noise:.0%} injected noise",
        "sweep": "measured: SM clock sweep on this GPU",
    }[mode]
    for ph, sp in res.profiles.items():
        ops = _op_curves(sp, model, use_measured=gpu)
        regions = _group_curves(ops, "region", REGIONS)
        kinds = _group_curves(ops, "kind", KINDS)
        res.phase_curves[ph] = regions
        sol = {
            "single": solve_single(regions, budget),
            "global_regions": solve_global(regions, budget),
            "local_regions": solve_local(regions, budget),
            "global_kinds_oracle": solve_global(kinds, budget),
        }
        res.solutions[ph] = {k: v.as_dict() for k, v in sol.items()}
        res.solutions[ph]["predicted_curve"] = {
            "clocks_mhz": list(regions[next(iter(regions))].clocks),
            "time_s": list(sum_curves(list(regions.values())).t),
            "energy_j": list(sum_curves(list(regions.values())).e),
        }
        chosen = sol["single"]
        glob = sol["global_regions"]
        if mode == "simulated-sweep":
            clocks = _sweep_clocks(model.clocks, res.opts.sweep_points, spec.f_max_mhz)
            truth = {k: Curve(c.clocks[:-1] + (DEFAULT,), c.t, c.e, "simulated") for k, c in regions.items()}
            bar.grow((len(clocks) + 1) * len(truth) * res.opts.sweep_repeats)
            meas = SimulatedMeasurer(
                {k: _restrict(c, clocks) for k, c in truth.items()},
                noise_t=res.opts.sim_noise / 3,
                noise_e=res.opts.sim_noise,
                seed=res.opts.seed + zlib.crc32(ph.encode()) % 1000,
            )
            sweeps = _sweep_both(
                meas, list(truth), clocks, budget, res.opts.sweep_repeats, "simulated", lambda k: bar.update(k, f"sim sweep {ph}")
            )
            res.sweeps[ph] = sweeps
            chosen, glob = sweeps["single"].choice, sweeps["global"].choice
        elif mode == "sweep":
            res.sweeps[ph] = _real_sweep(res, torch, shape, sp, dev, dtype, nv, spec, budget, bar)
            chosen, glob = res.sweeps[ph]["single"].choice, res.sweeps[ph]["global"].choice
        f = next(iter(chosen.clocks.values()))
        res.presets[ph] = {} if f == DEFAULT else {"sm_clock_mhz": int(f)}
        durations = region_durations_ms(sp, shape.layers, use_sim=not gpu)
        res.group_presets[ph] = {
            g: {"sm_clock_mhz": None if c == DEFAULT else int(c), "duration_ms": durations.get(g)} for g, c in glob.clocks.items()
        }
    res.presets["idle"] = {"sm_clock_mhz": int(min(spec.sm_clocks_mhz))}
    res.notes.append(
        "idle preset: the lowest supported SM clock (rule, not tuned: a locked low clock draws less than an "
        "unlocked loaded engine, 76 vs 122 W in the simulated H200; the next step pays the switch latency)."
    )


def _restrict(c: Curve, clocks: list[int]) -> Curve:
    idx = [c.clocks.index(f) for f in clocks] + [len(c.clocks) - 1]
    return Curve(tuple(clocks) + (DEFAULT,), tuple(c.t[i] for i in idx), tuple(c.e[i] for i in idx), c.source)


def _real_sweep(
    res: TuneResult, torch: Any, shape: ModelShape, sp: StepProfile, dev: Any, dtype: Any, nv: Any, spec: GpuSpec, budget: float, bar: _Bar
) -> dict[str, SweepResult]:
    """SM-clock sweep on this GPU (needs clock permission; never reached with POWERSAVE_FORCE_DRY_RUN=1)."""
    from ..clocks.backends import NvmlClockBackend
    from .profile import build_ops

    if nv is None:
        raise RuntimeError("clock sweep needs NVML (nvidia-ml-py) for energy")
    ops = build_ops(shape, sp.step, torch, dev, dtype, res.opts.tp)
    runnable = [o for o in ops if o.fn is not None]
    with torch.no_grad():
        for o in runnable:  # one full step populates every op's inputs
            o.fn()
    workloads, scale = {}, {}
    for region in REGIONS:
        mine = [o.fn for o in runnable if o.region == region]
        if mine:
            workloads[region] = (lambda fs: lambda: [f() for f in fs])(mine)
            scale[region] = float(shape.layers) if region in ("attention", "mlp") else 1.0
    backend = NvmlClockBackend(nv)
    clocks = _sweep_clocks(backend.supported_sm_clocks(), res.opts.sweep_points, max(backend.supported_sm_clocks()))
    meas = GpuClockMeasurer(backend, workloads, scale, res.opts.sweep_window_s, nv)
    try:
        with torch.no_grad():
            step_fn = workloads.get("mlp") or next(iter(workloads.values()))
            t_end = time.monotonic() + res.opts.thermal_warmup_s
            while time.monotonic() < t_end:  # thermal warm-up at default clocks (seed 000: 100 s)
                step_fn()
            torch.cuda.synchronize()
            bar.grow((len(clocks) + 1) * len(workloads) * res.opts.sweep_repeats)
            out = _sweep_both(
                meas,
                list(workloads),
                clocks,
                budget,
                res.opts.sweep_repeats,
                "measured",
                lambda k: bar.update(k, f"clock sweep {sp.step.phase}"),
            )
    finally:
        meas.close()
    return out


def write_preset(res: TuneResult, path: Path) -> Path:
    """Write the preset YAML (only fields the settings schema accepts; validated first).

    Raises:
        ValueError: the assembled preset does not validate (a bug: nothing is written).
    """
    import yaml

    from ..settings import ClockPreset, PowersaveSettings

    body: dict[str, Any] = {}
    gpu = res.device["kind"] == "cuda"
    body["tuned_for"] = {"gpu_name": res.device["name"] if gpu else "NVIDIA H200", "model": res.model_name or Path(res.opts.model).name}
    if res.chunk_table is not None:
        body["chunking"] = {"table": res.chunk_table}
    if res.clock_mode:
        presets: dict[str, dict] = {}
        has_groups = "groups" in ClockPreset.model_fields
        for ph, p in res.presets.items():
            presets[ph] = dict(p)
            gp = res.group_presets.get(ph) or {}
            # Kernel-group clocks only where this GPU measured the group's duration (the controller
            # uses a group preset only if it lasts long enough for a clock switch) and only where it
            # differs from the phase clock.
            if has_groups and gpu and res.clock_mode[0] != "simulated-sweep":
                groups = {
                    g: {k: (round(v, 4) if k == "duration_ms" else v) for k, v in d.items() if v is not None}
                    for g, d in gp.items()
                    if d.get("duration_ms") and d.get("sm_clock_mhz") != p.get("sm_clock_mhz")
                }
                if groups:
                    presets[ph]["groups"] = groups
        body["clocks"] = {"presets": presets}
    try:
        PowersaveSettings.model_validate(body)
    except ValueError as exc:
        if not any("groups" in p for p in body.get("clocks", {}).get("presets", {}).values()):
            raise  # a bug: nothing is written
        for p in body["clocks"]["presets"].values():  # an older schema without kernel-group presets
            p.pop("groups", None)
        PowersaveSettings.model_validate(body)
        res.notes.append(
            f"kernel-group presets left out of the preset file: this settings schema refuses them ({str(exc).splitlines()[0]})"
        )
    mode = res.clock_mode[0] if res.clock_mode else None
    what = []
    if res.chunk_table is not None:
        what.append(f"chunking table: {res.chunk_source}")
    if mode:
        what.append(f"clock presets: {res.clock_source}" + ("" if mode == "sweep" else " -- PREDICTED/SIMULATED, not measured"))
    header = [
        f"# Generated by `vllm-powersave tune {res.opts.model}` on {_now()} ({res.device['name']}).",
        *(f"# {w}" for w in what),
        f"# Slowdown budget: {res.opts.slowdown_pct:g} %. Report: {res.out_dir / 'report.md'}.",
        '# Use: vllm serve MODEL --plugin powersave --additional-config \'{"powersave": {"config_file": "THIS_FILE"}}\'',
        "# (clocks.backend defaults to dry-run; set it to nvml where clocks may be changed).",
    ]
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump({"powersave": body}, sort_keys=False))
    return path
