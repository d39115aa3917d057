"""Argument parser and entry of ``vllm-powersave tune`` (kept apart so ``cli.py`` needs one line)."""

from __future__ import annotations

import argparse
import sys

from . import lmhead


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    t = sub.add_parser(
        "tune",
        help="profile a model, tune LM-head chunking and SM clock presets, write a preset file and a report",
        description="Profile MODEL's prefill/decode/mixed steps (vLLM-equal shapes, torch.profiler), tune the LM-head chunk table "
        "and per-phase SM clock presets, and write OUT/preset.yaml, OUT/report.md, OUT/report.png, OUT/tune.json. "
        "Clocks are swept only on a GPU with clock permission; otherwise, with --predict, or whenever "
        "POWERSAVE_FORCE_DRY_RUN=1, they are predicted (never set).",
    )
    t.add_argument("model", help="Hugging Face model directory (config.json is enough; e.g. from `vllm-powersave make-model`)")
    t.add_argument("--out", default=None, help="output directory (default runs/tune-MODEL-TIMESTAMP)")
    t.add_argument("--only", choices=["chunking", "clocks"], default=None, help="run one part only")
    t.add_argument(
        "--predict", action="store_true", help="clock part: predict from the profile and the clock-response model; never set clocks"
    )
    t.add_argument(
        "--simulate-sweep",
        action="store_true",
        help="clock part: sweep the simulated H200 with injected noise, with re-measurement (no GPU needed; simulated)",
    )
    t.add_argument("--sim-noise", type=float, default=0.03, help="relative energy noise for --simulate-sweep (default 0.03)")
    t.add_argument("--slowdown", type=float, default=0.0, help="allowed slowdown in %% (default 0: strict)")
    t.add_argument("--phases", default="prefill,decode,mixed", help="phases to profile and tune (default %(default)s)")
    t.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: per-rank shapes; communication modelled")
    t.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    t.add_argument(
        "--rows",
        default=None,
        help=f"LM-head grid ROWS:KIND,... KIND decode|spec|logprobs (default GPU: {lmhead.DEFAULT_GRID}; CPU: a small grid)",
    )
    t.add_argument("--chunks", default=lmhead.DEFAULT_CHUNKS, help="candidate chunk counts (default %(default)s)")
    t.add_argument("--window", type=float, default=None, help="LM-head energy window per point, s (default 1 on a GPU)")
    t.add_argument("--repeats", type=int, default=2, help="LM-head repeats per point (default 2)")
    t.add_argument("--warmup", type=float, default=None, help="LM-head warm-up per shape, s (default 2 on a GPU)")
    t.add_argument("--profile-repeats", type=int, default=3)
    t.add_argument("--sweep-points", type=int, default=12, help="SM clocks per sweep, spread over the supported range (default 12)")
    t.add_argument("--sweep-repeats", type=int, default=3)
    t.add_argument("--sweep-window", type=float, default=1.0, help="energy window per sweep point, s (default 1)")
    t.add_argument("--thermal-warmup", type=float, default=30.0, help="s at default clocks before a real sweep (default 30)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=run)
    return t


def run(ns: argparse.Namespace) -> int:
    from .run import TuneOptions, run_tune

    opts = TuneOptions(
        model=ns.model,
        out=ns.out,
        only=ns.only,
        predict=ns.predict,
        simulate_sweep=ns.simulate_sweep,
        sim_noise=ns.sim_noise,
        slowdown_pct=ns.slowdown,
        phases=tuple(p.strip() for p in ns.phases.split(",") if p.strip()),
        tp=ns.tp,
        device=ns.device,
        rows=ns.rows,
        chunks=ns.chunks,
        window_s=ns.window,
        repeats=ns.repeats,
        warmup_s=ns.warmup,
        profile_repeats=ns.profile_repeats,
        sweep_points=ns.sweep_points,
        sweep_repeats=ns.sweep_repeats,
        sweep_window_s=ns.sweep_window,
        thermal_warmup_s=ns.thermal_warmup,
        progress=not ns.no_progress,
    )
    try:
        run_tune(opts)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
