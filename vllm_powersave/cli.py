"""``vllm-powersave`` command line: make-model, compare (the main job), advise, reset-clocks, tune, tune-serving."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .stats_contract import WorkerSnapshot, snapshot_from_json, snapshot_name

PRESET_DIR = Path(__file__).parent / "presets"


def _suspect_runs(results: dict[str, dict], rate_of: dict[str, float] | None = None) -> dict[str, float]:
    """Runs whose output throughput is below half the median of the runs at the same request rate
    (``rate_of``: label -> req/s; a rate-capped run is not compared with a saturated one), e.g. on
    a busy 2-core CPU."""
    import statistics

    groups: dict[float | None, dict[str, float]] = {}
    for k, r in results.items():
        if r.get("output_throughput"):
            groups.setdefault((rate_of or {}).get(k), {})[k] = r["output_throughput"]
    out: dict[str, float] = {}
    for tput in groups.values():
        if len(tput) >= 3:
            med = statistics.median(tput.values())
            out.update({k: v / med for k, v in tput.items() if v < 0.5 * med})
    return out


def _keyed_runs(runs: list[tuple[str, dict]], plan_rates: list[float], n_configs: int) -> tuple[dict[str, dict], dict[str, float]]:
    """The runs keyed as the report names them (``off (run 1) @ 1 req/s``; just the config's label
    for one run per config), and each key's request rate (``plan_rates[i]``: run i's)."""
    from .compare_report import rate_label

    many = len(plan_rates) > n_configs
    multi_rate = len(set(plan_rates)) > 1
    results: dict[str, dict] = {}
    rate_of: dict[str, float] = {}
    for i, (label, res) in enumerate(runs):
        key = f"{label} (run {i + 1})" + (f" @ {rate_label(plan_rates[i])}" if multi_rate else "") if many else label
        results[key] = res
        rate_of[key] = plan_rates[i]
    return results, rate_of


def _cmd_make_model(ns: argparse.Namespace) -> int:
    from .modelgen import make_model

    weights = False if ns.no_weights else (True if ns.weights else None)
    try:
        out = make_model(Path(ns.dir), ns.shape, seed=ns.seed, weights=weights, overwrite=ns.overwrite)
    except OSError as err:  # a path that cannot be made or written: one line, as for any bad input
        raise ValueError(f"make-model: cannot write {ns.dir!r}: {err.strerror or type(err).__name__}") from None
    print(f"wrote {ns.shape} model to {out}")
    return 0


def _configs(
    gpu: bool, clock_backend: str | None, sim_shape: str | None = None, plugin_config: dict[str, Any] | None = None
) -> list[tuple[str, str, list[str]]]:
    """(label, description, extra serve args) for the off and on servers; ``plugin_config``
    (``--plugin-config``) is merged into the on server's settings."""
    from .settings import merge_settings

    more = plugin_config or {}
    named = f" + --plugin-config {json.dumps(more)}" if more else ""
    if gpu:
        # The plugin's defaults: perf boost auto, clocks by permission (dry-run where the machine
        # forces it: POWERSAVE_FORCE_DRY_RUN=1), no chunk table. --clock-backend overrides clocks.
        on: dict[str, Any] = merge_settings({"clocks": {"backend": clock_backend}} if clock_backend else {}, more)
        return [
            ("off", "stock vLLM (energy: NVML on this machine, measured)", []),
            (
                "on",
                "vLLM + powersave defaults (perf boost auto; clocks "
                + (clock_backend or "by permission, dry-run without it")
                + ")"
                + named,
                ["--plugin", "powersave", "--additional-config", json.dumps({"powersave": on})],
            ),
        ]
    # No GPU: a stock server has no energy at all, so the baseline runs the plugin's simulated meter
    # as a meter only (savings "off": no clock decision, closed loop included, and no chunking);
    # only the "on" server applies the (simulated) presets.
    sim = {"meter": "simulated", "simulated_model_shape": sim_shape} if sim_shape else {"meter": "simulated"}
    base = {"savings": "off", "clocks": {"backend": "simulated"}, "energy": sim}
    on = merge_settings({"config_file": str(PRESET_DIR / "h200-simulated.yaml"), "energy": sim}, more)
    as_what = f"an H200 running a {sim_shape}-shaped model through the same steps" if sim_shape else "an H200"
    return [
        (
            "off",
            f"vLLM, stock clocks, no chunking (powersave meter only; energy simulated for {as_what})",
            ["--additional-config", json.dumps({"powersave": base})],
        ),
        (
            "on",
            f"vLLM + powersave, h200-simulated clock presets (energy simulated for {as_what}){named}",
            ["--plugin", "powersave", "--additional-config", json.dumps({"powersave": on})],
        ),
    ]


def _with_stats_dir(extra: list[str], stats_dir: str) -> list[str]:
    """Put ``stats_dir`` into the powersave dict of an ``--additional-config`` argument, if any."""
    out = list(extra)
    for i, a in enumerate(out[:-1]):
        if a == "--additional-config":
            cfg = json.loads(out[i + 1])
            cfg.setdefault("powersave", {})["stats_dir"] = stats_dir
            out[i + 1] = json.dumps(cfg)
    return out


def _read_snapshot(stats_dir: Path) -> WorkerSnapshot:
    try:
        return snapshot_from_json((stats_dir / snapshot_name(0)).read_text())
    except (OSError, ValueError):
        return {}


def _plugin_config(text: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """``--plugin-config``'s JSON object, or the one line saying why it is not one."""
    if text is None:
        return None, None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return None, f"--plugin-config = {text[:120]!r}: not a JSON object of powersave settings"
    return value, None


def _plugin_config_error(plugin_config: dict[str, Any] | None, on_args: list[str]) -> str | None:
    """``--plugin-config`` checked as the server would (one line naming field and value): alone
    first, so that a contradiction of the user's own names their field, then as merged into the on
    server's settings (``on_args``: its extra serve args)."""
    from .settings import SettingsError, load_settings

    if not plugin_config:
        return None
    merged = json.loads(on_args[on_args.index("--additional-config") + 1])["powersave"]
    try:
        load_settings(plugin_config, env={})
        load_settings(merged, env={})
    except SettingsError as exc:
        return f"--plugin-config: {exc}"
    return None


def _compare_arg_error(ns: argparse.Namespace, order: list[str], configs: dict) -> str | None:
    """One line naming the compare flag and value that cannot run, or None."""
    if not 0 < ns.rate_window_s <= 3600:
        return f"--rate-window-s = {ns.rate_window_s:g}: must be in (0, 3600] s"
    for flag, value in (("--concurrency", ns.concurrency), ("--num-prompts", ns.num_prompts)):
        if value < 1:
            return f"{flag} = {value}: must be >= 1"
    for flag, value in (("--input-len", ns.input_len), ("--output-len", ns.output_len)):
        if value < 1:
            return f"{flag} = {value}: must be >= 1 token"
    if ns.warmups < 0:
        return f"--warmups = {ns.warmups}: must be >= 0"
    if not 0 < ns.startup_timeout < float("inf"):  # also refuses nan
        return f"--startup-timeout = {ns.startup_timeout:g}: must be a number of seconds > 0"
    if ns.model is None:
        from .sim.shapes import SHAPES

        if ns.shape not in SHAPES:
            return f"--shape = {ns.shape!r}: unknown shape ({', '.join(sorted(SHAPES))})"
    if sorted(set(order)) != sorted(configs):
        return f"--order must name off and on, e.g. 'off,on' or 'on,off,off,on' (got {ns.order!r})"
    return None


def _cmd_compare(ns: argparse.Namespace) -> int:
    from .compare_report import parse_rates
    from .serving import cpu_only

    rates = parse_rates(ns.rates)
    gpu = not cpu_only()
    sim_shape = None if ns.sim_shape == "served" else ns.sim_shape
    plugin_config, err = _plugin_config(ns.plugin_config)
    configs = {c[0]: c for c in _configs(gpu, ns.clock_backend, sim_shape, plugin_config)}
    order = [x.strip() for x in ns.order.split(",") if x.strip()]
    # Every flag checked before a model is made, a folder written or a server started.
    if err := err or _plugin_config_error(plugin_config, configs["on"][2]) or _compare_arg_error(ns, order, configs):
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = _compare_model(ns)
    if model is None:
        return 2
    out_dir = Path(ns.out) / time.strftime("compare-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Runs are numbered from 1, as in the report's columns ("off (run 1)"), and so are their files.
    # Several rates: the ABBA order runs at each rate in turn (rate-major), numbering continues.
    plan = [(rate, label) for rate in rates for label in order]
    runs = _CompareRuns()
    for run_i, (rate, label) in enumerate(plan, start=1):
        if not _compare_one_run(ns, runs, _CompareArm(label, rate, run_i, configs[label]), model, out_dir, gpu):
            return 1
    results, rate_of = _keyed_runs(runs.runs, [p[0] for p in plan], len(configs))
    md = _compare_markdown(ns, model, gpu, rates, runs)
    md += _compare_tables(rates, plan, runs, results, rate_of, gpu)
    (out_dir / "comparison.md").write_text(md)
    (out_dir / "comparison.json").write_text(
        json.dumps(
            {
                "model": str(model),
                "gpu": gpu,
                "results": results,
                "rates": ["inf" if math.isinf(r) else r for r in rates],
                "simulated_same_steps": runs.counterfactual,
            },
            indent=2,
        )
    )
    print()
    print(md)
    print(f"[compare] results in {out_dir}")
    return 0


def _compare_model(ns: argparse.Namespace) -> Path | None:
    """The served model's directory, generated from ``--shape`` when no ``--model`` is given;
    ``None`` (after one error line) when there is none."""
    if ns.model is not None and not ns.model.strip():
        print("error: --model is empty (give a Hugging Face model directory, or omit it to generate --shape)", file=sys.stderr)
        return None
    model = Path(ns.model) if ns.model else Path(".models") / ns.shape
    if ns.model is None and not (model / "config.json").exists():
        from .modelgen import make_model

        print(f"[compare] generating the {ns.shape} model in {model}")
        make_model(model, ns.shape)
    if not (model / "config.json").exists():
        print(f"error: model directory not found or not a Hugging Face model: {str(model)!r}", file=sys.stderr)
        return None
    return model


class _CompareArm(NamedTuple):
    """One run of the plan: its arm (``off``/``on``), request rate (req/s; inf: saturation), number
    and ``_configs`` row."""

    label: str
    rate: float
    run_index: int
    config: tuple[str, str, list[str]]


@dataclass
class _CompareRuns:
    """What the runs of one comparison gathered, in plan order."""

    runs: list[tuple[str, dict]] = field(default_factory=list)  # (arm, result)
    rated: list[tuple[str, float, dict]] = field(default_factory=list)  # (arm, rate req/s, result)
    counterfactual: dict[str, dict] = field(default_factory=dict)  # "<arm> (run <n>)" -> simulated same-steps figures
    descriptions: dict[str, str] = field(default_factory=dict)  # arm -> its configuration in words


def _compare_one_run(ns: argparse.Namespace, runs: _CompareRuns, arm: _CompareArm, model: Path, out_dir: Path, gpu: bool) -> bool:
    """Serve one arm, drive its load and record its result; ``False`` when the server did not start."""
    from loadtests import run

    from .serving import ServerError, VllmServer, default_serve_args

    label, rate, run_i = arm.label, arm.rate, arm.run_index
    _, desc, extra = arm.config
    runs.descriptions[label] = desc
    print(f"[compare] {label}: starting vllm serve ({desc})", flush=True)
    stats_dir = (out_dir / f"stats-{label}-{run_i}").resolve()
    extra = _with_stats_dir(extra, str(stats_dir))
    server = VllmServer(
        default_serve_args(str(model)) + extra + list(ns.serve_arg or []),
        log_path=out_dir / f"server-{label}-{run_i}.log",
        startup_timeout_s=ns.startup_timeout,
    )
    try:
        server.start()
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return False
    try:
        cfg = _compare_bench_config(ns, server.base_url, label, rate, gpu)
        print(
            f"[compare] {label}: "
            + (
                f"{ns.num_prompts} requests at concurrency {ns.concurrency}"
                if math.isinf(rate)
                else f"Poisson arrivals at {rate:g} req/s for {ns.rate_window_s:g} s (concurrency cap {ns.concurrency})"
            ),
            flush=True,
        )
        res = run(cfg)
        res["config_description"] = desc
        res["run_index"] = run_i
        res["api_server_count"] = server.api_server_count()
        runs.runs.append((label, res))
        runs.rated.append((label, rate, res))
    finally:
        server.stop()
    (out_dir / f"result-{label}-{run_i}.json").write_text(json.dumps(res, indent=2))
    snap = _read_snapshot(stats_dir)
    if snap.get("sim_stock_clocks_energy_j"):
        runs.counterfactual[f"{label} (run {run_i})"] = {
            "with_presets_j": snap["sim_energy_j"],
            "stock_clocks_j": snap["sim_stock_clocks_energy_j"],
            "saving_pct": 100.0 * (1 - snap["sim_energy_j"] / snap["sim_stock_clocks_energy_j"]),
            "gpu_time_change_pct": 100.0 * (snap["sim_busy_s"] / snap["sim_stock_clocks_busy_s"] - 1)
            if snap.get("sim_stock_clocks_busy_s")
            else None,
        }
    return True


def _compare_bench_config(ns: argparse.Namespace, base_url: str, label: str, rate: float, gpu: bool) -> Any:
    """The load of one run: saturation (``rate`` inf) or Poisson arrivals for ``--rate-window-s``."""
    from loadtests import BenchConfig

    return BenchConfig(
        base_url=base_url,
        model=None,
        endpoint=ns.endpoint,
        num_prompts=ns.num_prompts if math.isinf(rate) else max(8, int(rate * ns.rate_window_s * 2)),
        max_concurrency=ns.concurrency,
        request_rate=rate,
        duration_s=None if math.isinf(rate) else ns.rate_window_s,
        input_len=ns.input_len,
        output_len=ns.output_len,
        num_warmups=ns.warmups,
        seed=ns.seed,
        label=label,
        # One energy source for both arms on a GPU: the local NVML counter, sampled alike,
        # and /metrics scraped alike (edges and every 15 s), so the two servers see the same
        # client (docs/results/h200-under-load.md).
        energy="nvml" if gpu else "auto",
    )


def _compare_markdown(ns: argparse.Namespace, model: Path, gpu: bool, rates: list[float], runs: _CompareRuns) -> str:
    """The report's header, legend and (simulated) identical-steps section, up to the runs' table."""
    from .compare_report import rate_label

    load = (
        f"{ns.num_prompts} requests, concurrency {ns.concurrency}"
        if rates == [math.inf]
        else "request rates " + ", ".join(rate_label(r) for r in rates) + f" (Poisson for {ns.rate_window_s:g} s each; saturation: "
        f"{ns.num_prompts} requests at concurrency {ns.concurrency})"
    )
    header = f"# vllm-powersave: plugin off vs on\n\nModel: `{model}`; {load}, {ns.input_len} in / {ns.output_len} out; machine: {'GPU (energy measured by NVML)' if gpu else 'no GPU (energy SIMULATED for an H200 by the plugin meter)'}\n\n"
    legend = "".join(f"- **{k}**: {v}\n" for k, v in runs.descriptions.items())
    if not gpu:
        legend += (
            "- *simulated*: joules an H200 would spend on exactly the engine steps this CPU run executed "
            "(vllm_powersave/sim/gpu.py), each step costed for the model shape named above; throughput and latency are "
            "the CPU's own, measured (noisy on 2 cores: compare repeated runs). No average power is shown: simulated "
            "joules over a CPU run's wall time is not a power anyone could measure.\n"
        )
    md = header + legend
    if runs.counterfactual:
        md += (
            "\n## Clock presets on identical engine steps (simulated, free of run-to-run noise)\n\n"
            'Each "on" server\'s exact step sequence, priced by the simulated H200 at stock clocks and with the presets:\n\n'
        )
        for label, cf in runs.counterfactual.items():
            md += (
                f"- {label}: {cf['stock_clocks_j']:.1f} J (simulated) at stock clocks vs {cf['with_presets_j']:.1f} J (simulated) "
                f"with the presets: **{-cf['saving_pct']:+.1f} % energy (simulated)**, "
                + (
                    f"{cf['gpu_time_change_pct']:+.1f} % GPU busy time (simulated)\n"
                    if cf.get("gpu_time_change_pct") is not None
                    else "GPU busy time n/a\n"
                )
            )
        md += (
            "\n## Per run\n\nThroughput and latency measured on this machine. Energy is simulated and follows how the "
            "engine happened to batch in each run, which on a 2-core CPU varies a lot: use the section above for the presets' effect.\n"
        )
    return md


def _compare_tables(
    rates: list[float],
    plan: list[tuple[float, str]],
    runs: _CompareRuns,
    results: dict[str, dict],
    rate_of: dict[str, float],
    gpu: bool,
) -> str:
    """The runs' table (one per rate), the runs flagged as suspect, and the savings and steady-state sections."""
    from loadtests import compare_table

    from .compare_report import rate_label, savings_section, steady_state_section

    # Steady-state figures appear per arm with an interval (steady_state_section), not per run.
    if len(rates) > 1:  # one table per rate: columns of one load side by side
        table = "\n".join(
            f"### {rate_label(rate)}\n\n"
            + compare_table({k: r for i, (k, r) in enumerate(results.items()) if plan[i][0] == rate}, steady_state=False)
            for rate in rates
        )
    else:
        table = compare_table(results, steady_state=False)
    md = "\n" + table + "\n"
    suspect = _suspect_runs(results, rate_of)
    if suspect:
        md += "\n" + "".join(
            f"- **{k}**: output throughput {v:.2f}x the median of the runs at its request rate: the machine was likely busy "
            "with something else; treat this run's figures as unreliable and repeat it.\n"
            for k, v in suspect.items()
        )
    # On the CPU the identical-steps figures are the presets' saving (compare_report._energy_lines).
    md += savings_section(runs.rated, gpu, runs.counterfactual) + "\n" + steady_state_section(runs.rated, gpu) + "\n"
    return md


def _cmd_advise(ns: argparse.Namespace) -> int:
    from .advise import AdviseError, run

    try:
        print(run(ns.result or [], ns.metrics or [], ns.api_servers, ns.json))
    except AdviseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _cmd_reset_clocks(ns: argparse.Namespace) -> int:
    from .clocks import LeaseStore
    from .clocks.backends import LeaseError, reset_from_lease

    if Path(ns.lease_dir).exists() and not Path(ns.lease_dir).is_dir():
        print(f"error: --lease-dir = {ns.lease_dir!r}: not a directory", file=sys.stderr)
        return 2
    store = LeaseStore(ns.lease_dir)
    every = store.all()
    leases = store.stale() if not ns.all else every
    if not leases:
        live = len(every)
        print(
            "no clock leases to reset"
            + (f" ({live} held by running processes; --all resets them too)" if live else "")
            + ("" if Path(ns.lease_dir).is_dir() else f" (no lease directory {ns.lease_dir})")
        )
        return 0
    rc = 0
    for lease in leases:
        gpu = str(lease["gpu"])
        try:
            # Each lease says how its lock was taken (nvml or zeusd) and so how to undo it.
            reset_from_lease(lease)
            store.release(gpu)
            print(f"reset clocks of {gpu}")
        except LeaseError as exc:  # the lease is garbage: say which file and field; it is kept
            print(f"error: reset of {gpu} not attempted: {lease.get('path')}: {exc}", file=sys.stderr)
            rc = 2
        except Exception as exc:
            print(f"error: reset of {gpu} failed: {exc}", file=sys.stderr)
            rc = rc or 1
    return rc


class _Parser(argparse.ArgumentParser):
    """argparse with bad arguments reported in one line (no usage block), exit status 2;
    sub-commands inherit it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _shape_names() -> str:
    from .sim.shapes import SHAPES

    return ", ".join(sorted(SHAPES))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vllm-powersave", description=__doc__.replace("``", ""))
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-model", help="write an offline Hugging Face model directory with random weights")
    m.add_argument("dir")
    m.add_argument("--shape", default="qwen2-tiny", help=f"model architecture and size (default %(default)s): {_shape_names()}")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    m.add_argument("--no-weights", action="store_true", help="config + tokenizer only (serve with --load-format dummy)")
    m.add_argument("--weights", action="store_true", help="write weights even for shapes over 2 GB (default: only small shapes)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing model directory")
    m.set_defaults(fn=_cmd_make_model)

    c = sub.add_parser("compare", help="serve a model with the plugin off and on, load-test both, print one table")
    c.add_argument("--model", default=None, help="local HF model directory (default: generate --shape in .models/)")
    c.add_argument(
        "--shape", default="qwen2-tiny", help=f"shape generated when no --model is given (default %(default)s): {_shape_names()}"
    )
    c.add_argument("--num-prompts", type=int, default=400)
    c.add_argument("--concurrency", type=int, default=16)
    c.add_argument("--input-len", type=int, default=128)
    c.add_argument("--output-len", type=int, default=64)
    c.add_argument("--warmups", type=int, default=4)
    c.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--clock-backend", choices=["dry-run", "nvml"], default=None, help="GPU machines only; default dry-run")
    c.add_argument(
        "--plugin-config",
        default=None,
        help="JSON of powersave settings merged into the 'on' server's, e.g. '{\"decode_pacing\": {\"tpot_target_ms\": 35}}'",
    )
    c.add_argument(
        "--order",
        default="off,on,on,off",
        help="server runs in this order; repeating them in ABBA order cancels drift (default off,on,on,off)",
    )
    c.add_argument(
        "--sim-shape",
        default="qwen2.5-7b",
        choices=["served", "qwen2.5-0.5b", "qwen2.5-7b", "llama3-8b"],
        help="no-GPU machines: simulate energy as if each step ran a model of this shape ('served': the served model itself)",
    )
    c.add_argument(
        "--rates",
        default="inf",
        help="request rates (req/s, comma-separated; inf = saturation at --concurrency), each run in --order: "
        "e.g. 0.2,1,4,inf (default inf)",
    )
    c.add_argument("--rate-window-s", type=float, default=60.0, help="seconds of Poisson arrivals per finite rate (default 60)")
    c.add_argument("--serve-arg", action="append", help="extra argument passed to vllm serve (repeatable)")
    c.add_argument("--startup-timeout", type=float, default=600.0)
    c.add_argument("--out", default="runs")
    c.set_defaults(fn=_cmd_compare)

    a = sub.add_parser(
        "advise",
        help="ranked recommendations from a run's figures (loadtests result, /metrics)",
        description="Ranked recommendations from a run's figures (a loadtests result and/or a server's /metrics), "
        "each with the measurement behind it and whether its effect is measured or predicted.",
    )
    a.add_argument("--result", action="append", help="loadtests result JSON (repeatable)")
    a.add_argument("--metrics", action="append", help="the server's /metrics: http(s) URL or a saved scrape (repeatable)")
    a.add_argument(
        "--api-servers", type=int, default=None, help="API servers the run used (default: the result's api_server_count, else 1)"
    )
    a.add_argument("--json", action="store_true", help="print JSON instead of text")
    a.set_defaults(fn=_cmd_advise)

    r = sub.add_parser("reset-clocks", help="reset GPU clocks left locked by a crashed server")
    r.add_argument("--lease-dir", default="/tmp/vllm-powersave/leases")
    r.add_argument("--all", action="store_true", help="reset every leased GPU, not only those of dead processes")
    r.set_defaults(fn=_cmd_reset_clocks)

    from .tune.cli import add_parser as _add_tune_parser

    _add_tune_parser(sub)
    from .serving_tune.command import add_parser as _add_tune_serving_parser

    _add_tune_serving_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.fn(ns) or 0)
    except ValueError as err:  # validation errors are one line by construction
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
