"""Argument parser and entry of ``vllm-powersave tune-serving`` (kept apart so ``cli.py`` needs two lines)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .space import (
    SETTINGS,
    MachineFacts,
    SpaceError,
    SpaceSpec,
    applicable,
    configurations,
    default_space,
    load_space_file,
    override,
    parse_space,
)

#: Flags that list a setting's values (comma-separated; cudagraph sizes: ';'-separated lists of ' '-separated sizes).
SPACE_FLAGS = {name: "--" + name.replace("_", "-") for name in SETTINGS}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    t = sub.add_parser(
        "tune-serving",
        help="find the vLLM configuration with the most tokens per joule that meets your SLO under your traffic (measured)",
        description="Measure a bounded search (successive halving under --budget-min) over vLLM settings that need no "
        "privilege, under your traffic, through a real vllm serve and the loadtests harness; then ABBA pairs of the winner "
        "against vLLM's defaults. Writes OUT/tune-serving.{json,md}, OUT/pareto.png, OUT/winner-command.txt and the "
        "resumable OUT/state.jsonl (rerun the same command to resume). Without a GPU, energy is simulated and labelled so. "
        "See docs/tune-serving.md.",
    )
    t.add_argument("--model", default=None, help="local Hugging Face model directory (default: generate --shape in .models/)")
    t.add_argument("--shape", default="qwen2-tiny", help="shape generated when no --model is given (default %(default)s)")
    load = t.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals, req/s")
    load.add_argument("--concurrency", type=int, default=None, help="saturation: this many concurrent streams (closed loop)")
    load.add_argument("--trace", default=None, help="trace file: JSON lines or CSV of arrival_s, input_len, output_len")
    t.add_argument("--input-len", default="128:1024", help="input tokens, uniform LO:HI or fixed N (default %(default)s)")
    t.add_argument("--output-len", default="32:512", help="output tokens, uniform LO:HI or fixed N (default %(default)s)")
    t.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT target per request, ms")
    t.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT target per request, ms")
    t.add_argument("--slo-itl-ms", type=float, default=None, help="p99 inter-token latency target of a window, ms")
    t.add_argument("--slo-attainment", type=float, default=0.99, help="share of requests that must meet TTFT and TPOT (default 0.99)")
    t.add_argument("--space", default=None, help="YAML/JSON file: setting -> list of values (default: a built-in space)")
    for name, flag in SPACE_FLAGS.items():
        sep = "';'-separated lists of ' '-separated sizes" if name == "cudagraph_capture_sizes" else "comma-separated"
        t.add_argument(flag, dest=f"space_{name}", default=None, help=f"values of {name}, {sep} (overrides --space)")
    t.add_argument("--max-configs", type=int, default=8, help="configurations sampled from the grid at most (default 8)")
    t.add_argument("--window-s", type=float, default=30.0, help="first round's window per configuration, s (default 30)")
    t.add_argument("--eta", type=int, default=2, help="successive halving: keep 1/ETA per round, windows ETA x longer (default 2)")
    t.add_argument("--pairs", type=int, default=3, help="final ABBA pairs, winner vs vLLM's defaults (default 3)")
    t.add_argument("--budget-min", type=float, default=20.0, help="time budget for search and pairs, minutes (default 20)")
    t.add_argument("--warmups", type=int, default=2, help="warm-up requests before each window (default 2)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--sim-shape", default="qwen2.5-7b", help="no GPU: model shape the simulated H200 prices ('served': the model itself)")
    t.add_argument("--serve-arg", action="append", help="extra argument for every vllm serve (repeatable)")
    t.add_argument("--startup-timeout", type=float, default=600.0, help="s to wait for a server to become healthy")
    t.add_argument("--out", default="runs/tune-serving", help="output and state directory; rerun with the same one to resume")
    t.add_argument("--stop-after", type=int, default=None, help="stop after N new measurements (resume later; for split leases and tests)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=run)
    return t


def _flag_values(name: str, text: str) -> list[Any]:
    """A space flag's comma list as YAML scalars (``on``/``off`` read as booleans for async scheduling)."""
    import yaml

    if name == "cudagraph_capture_sizes":
        return [[int(x) for x in part.split()] if part.split() else [] for part in text.split(";")]
    out: list[Any] = []
    for part in (p.strip() for p in text.split(",")):
        if name == "async_scheduling" and part in ("on", "off"):
            out.append(part == "on")
        elif name in ("closed_loop_budget_pct", "decode_pacing_tpot_ms") and part == "off":
            out.append(None)
        else:
            out.append(yaml.safe_load(part) if part else part)
    return out


def space_of(ns: argparse.Namespace, gpu: bool) -> SpaceSpec:
    """The space: --space, overridden per setting by its flag; the built-in one when neither is given."""
    import yaml

    spec = load_space_file(ns.space) if ns.space else None
    flags = {n: getattr(ns, f"space_{n}") for n in SETTINGS if getattr(ns, f"space_{n}") is not None}
    if not flags:
        return spec or default_space(gpu, getattr(ns, "slo_tpot_ms", None))
    data = {k: v for k, v in (spec.model_dump() if spec else {}).items() if v is not None}
    for name, text in flags.items():
        try:
            data[name] = _flag_values(name, text)
        except (ValueError, yaml.YAMLError):
            raise SpaceError(f"{SPACE_FLAGS[name]} = {text!r}: not a list of values") from None
    return parse_space(data, "space flags")


def _model(ns: argparse.Namespace) -> Path:
    if ns.model is not None:
        model = Path(ns.model)
        if not (model / "config.json").exists():
            raise ValueError(f"--model = {ns.model!r}: not a Hugging Face model directory (no config.json)")
        return model
    model = Path(".models") / ns.shape
    if not (model / "config.json").exists():
        from ..modelgen import make_model

        print(f"[tune-serving] generating the {ns.shape} model in {model}", flush=True)
        make_model(model, ns.shape)
    return model


def _check_numbers(ns: argparse.Namespace) -> None:
    import math

    def positive(v: float | None) -> bool:  # NaN and infinity are refused too (an infinite rate never ends a window)
        return v is None or (math.isfinite(v) and v > 0)

    checks = [
        ("--window-s", ns.window_s, positive(ns.window_s)),
        ("--eta", ns.eta, ns.eta >= 2),
        ("--pairs", ns.pairs, ns.pairs >= 1),
        ("--budget-min", ns.budget_min, positive(ns.budget_min)),
        ("--max-configs", ns.max_configs, ns.max_configs >= 1),
        ("--warmups", ns.warmups, ns.warmups >= 0),
        ("--startup-timeout", ns.startup_timeout, positive(ns.startup_timeout)),
        ("--rate", ns.rate, positive(ns.rate)),
        ("--concurrency", ns.concurrency, ns.concurrency is None or ns.concurrency >= 1),
        ("--stop-after", ns.stop_after, ns.stop_after is None or ns.stop_after >= 0),
    ]
    for flag, value, ok in checks:
        if not ok:
            raise ValueError(f"{flag} = {value!r}: out of range (see --help)")


def machine_facts(gpu: bool) -> MachineFacts:
    """Whether clocks may be set here (a GPU, permission, and no POWERSAVE_FORCE_DRY_RUN=1)."""
    from ..clocks.mode import clock_permission
    from ..envs import ENV_FORCE_DRY_RUN, force_dry_run

    if not gpu:
        return MachineFacts(False, False, "no GPU")
    if force_dry_run():
        return MachineFacts(True, False, f"{ENV_FORCE_DRY_RUN}=1")
    ok, why = clock_permission()
    return MachineFacts(True, ok, why)


def _max_model_len(args: list[str] | tuple[str, ...]) -> int | None:
    """The ``--max-model-len`` that ``args`` set (``--flag N`` or ``--flag=N``; the last wins), if any."""
    value = None
    for i, a in enumerate(args):
        if a.startswith("--max-model-len="):
            value = a.split("=", 1)[1]
        elif a == "--max-model-len" and i + 1 < len(args):
            value = args[i + 1]
    return int(value) if value is not None and value.isdigit() else None


def _fit_max_model_len(args: list[str], user_args: list[str] | None, traffic: Any) -> list[str]:
    """``args`` with ``--max-model-len`` raised to fit the traffic's longest request (rounded up to
    256 tokens) unless the user set it with ``--serve-arg``: the default (1024) would fail every
    longer request, and both arms run with the same value."""
    if any(a.split("=", 1)[0] == "--max-model-len" for a in user_args or []):
        return args
    need = -(-traffic.longest_request_tokens() // 256) * 256
    current = _max_model_len(args)
    if current is not None and current >= need:
        return args
    return override(args, ["--max-model-len", str(need)])


def _check_fits(traffic: Any, serve_args: tuple[str, ...], flag: str) -> None:
    """Refuse traffic whose longest request cannot fit the servers' ``--max-model-len`` (every
    such request would fail and count against the SLO); silent where the flag is not given."""
    limit = _max_model_len(serve_args)
    need = traffic.longest_request_tokens()
    if limit is not None and need > limit:
        raise ValueError(
            f"{flag}: the longest request needs {need} tokens, over the servers' --max-model-len {limit} (raise it with --serve-arg)"
        )


def _check_context(model: Path, traffic: Any, flag: str) -> None:
    """Refuse traffic whose longest request exceeds the model's context (``max_position_embeddings``
    in its ``config.json``): vLLM would refuse every server, one configuration after another.
    Silent where the config cannot tell (none, no such field, or RoPE scaling that extends it)."""
    import json

    cfg = Path(model) / "config.json"
    try:
        c = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    ctx = c.get("max_position_embeddings") if isinstance(c, dict) else None
    if type(ctx) is not int or c.get("rope_scaling"):
        return
    need = traffic.longest_request_tokens()
    if need > ctx:
        raise ValueError(
            f"{flag}: the longest request needs {need} tokens, over the model's context of {ctx} (max_position_embeddings in {cfg})"
        )


def options_from(ns: argparse.Namespace) -> Any:
    """Every input checked (one ``ValueError`` line naming the flag and value) before anything starts."""
    from ..serving import cpu_only, default_serve_args
    from .measure import ServePlan
    from .run import TuneServingOptions
    from .slo import Slo
    from .traffic import Traffic, parse_length_range, parse_trace

    _check_numbers(ns)
    out = Path(ns.out)
    if any(p.exists() and not p.is_dir() for p in (out, *out.parents)):
        raise ValueError(f"--out = {ns.out!r}: not a directory (it or a folder above it is a file)")
    gpu = not cpu_only()
    slo = Slo(ns.slo_ttft_ms, ns.slo_tpot_ms, ns.slo_itl_ms, ns.slo_attainment)
    lens = dict(input_len=parse_length_range(ns.input_len, "--input-len"), output_len=parse_length_range(ns.output_len, "--output-len"))
    if ns.trace is not None:
        traffic = Traffic("trace", trace=parse_trace(ns.trace), trace_path=str(ns.trace), **lens)
    elif ns.rate is not None:
        traffic = Traffic("poisson", rate_rps=ns.rate, **lens)
    else:
        traffic = Traffic("saturation", concurrency=ns.concurrency, **lens)
    values, skipped = applicable(space_of(ns, gpu), machine_facts(gpu))
    if not values:
        raise SpaceError("the space has no setting that can act on this machine: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    model = _model(ns)
    plan = ServePlan(
        model=model,
        base_args=tuple(_fit_max_model_len(override(default_serve_args(str(model))[1:], list(ns.serve_arg or [])), ns.serve_arg, traffic)),
        gpu=gpu,
        out_dir=Path(ns.out),
        sim_shape=None if ns.sim_shape == "served" else ns.sim_shape,
        startup_timeout_s=ns.startup_timeout,
        warmups=ns.warmups,
    )
    flag = "--trace" if ns.trace is not None else "--input-len/--output-len"
    _check_context(model, traffic, flag)
    _check_fits(traffic, plan.base_args, flag)
    configs = tuple(configurations(values, ns.max_configs, ns.seed))
    return TuneServingOptions(
        plan=plan,
        traffic=traffic,
        slo=slo,
        configs=configs,
        space=values,
        skipped=skipped,
        window_s=ns.window_s,
        eta=ns.eta,
        pairs=ns.pairs,
        budget_s=ns.budget_min * 60.0,
        seed=ns.seed,
        stop_after=ns.stop_after,
        progress=not ns.no_progress,
    )


def run(ns: argparse.Namespace) -> int:
    from .run import execute
    from .state import StateError

    try:
        opts = options_from(ns)
    except ValueError as err:  # SpaceError, TrafficError, SloError, bad numbers: one line each
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, why in opts.skipped.items():
        print(f"[tune-serving] skipped {name}: {why}", flush=True)
    print(
        f"[tune-serving] {len(opts.configs)} configuration(s); traffic: {opts.traffic.describe()}; SLO: {opts.slo.describe()}", flush=True
    )
    if not opts.plan.gpu:
        print("[tune-serving] no GPU: every energy figure is SIMULATED (the plugin's simulated H200); latency is measured", flush=True)
    try:
        return execute(opts)
    except StateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
