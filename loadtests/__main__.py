"""CLI: ``python -m loadtests --base-url URL [options]``.

Exit codes: 0 = run finished with at least one completed request; 1 = every request
failed; 2 = bad input (config, dataset, unreachable server) with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from .config import BenchConfig
from .errors import LoadTestError
from .report import (
    compare_table,
    format_markdown,
    format_table,
    plot_results,
    write_result_json,
)
from .runner import run


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse prints usage + exits on its own; route through the one-line error path instead.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgError(message)


def _float_or_inf(s: str) -> float:
    return math.inf if s.strip().lower() in ("inf", "infinity") else float(s)


def _goodput(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for it in items:
        key, sep, val = it.partition(":")
        if not sep:
            raise LoadTestError(f"invalid --goodput item {it!r}: expected KEY:MS, e.g. ttft:200")
        if key.strip() in out:
            raise LoadTestError(f"invalid --goodput: SLO {key.strip()!r} given twice ({out[key.strip()]:g} and {val})")
        try:
            out[key.strip()] = float(val)
        except ValueError:
            raise LoadTestError(f"invalid --goodput item {it!r}: {val!r} is not a number of ms") from None
    return out


def _csv_floats(s: str, what: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise LoadTestError(f"invalid {what} {s!r}: expected comma-separated numbers") from None


def _levels(s: str, what: str, conv: Any) -> list[Any]:
    """``"1,2,4"`` -> [1, 2, 4] (one value is a list of one)."""
    try:
        vals = [conv(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise LoadTestError(f"invalid {what} {s!r}: expected a number or comma-separated numbers") from None
    if not vals:
        raise LoadTestError(f"invalid {what} {s!r}: empty")
    return vals


def _int(s: str) -> int:
    return int(s.strip())


def build_parser() -> argparse.ArgumentParser:
    """Argument parser; option names follow ``vllm bench serve`` where they overlap."""
    p = _Parser(prog="python -m loadtests", description="Load generator for OpenAI-compatible servers; reports tokens per joule.")
    _add_server_args(p)
    _add_arrival_args(p)
    _add_request_args(p)
    _add_energy_args(p)
    _add_output_args(p)
    return p


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """The server under test: its URLs, model, endpoint and streaming."""
    p.add_argument(
        "--base-url",
        nargs="+",
        default=["http://127.0.0.1:8000"],
        metavar="URL",
        help="server base URL (with or without /v1); several = a fleet, requests round-robin",
    )
    p.add_argument("--model", default=None, help="model id (default: first id from GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--no-stream", action="store_true", help="use non-streaming requests (TTFT = E2E)")
    p.add_argument(
        "--continuous-usage-stats", action="store_true", help="ask for per-chunk usage (vLLM): per-token ITL, exact token counts per chunk"
    )


def _add_arrival_args(p: argparse.ArgumentParser) -> None:
    """How many requests and when they go out: concurrency, rate, arrivals, ramps, a trace."""
    p.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 100; a trace: all)")
    p.add_argument(
        "--max-concurrency", default=None, metavar="C[,C...]", help="cap on in-flight requests (closed loop); a list sweeps concurrency"
    )
    p.add_argument("--request-rate", default="inf", metavar="R[,R...]", help="requests/s, 'inf' = all at once; a list sweeps the rate")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument(
        "--arrival",
        choices=["gamma", "constant"],
        default="gamma",
        help="inter-arrival law: gamma (shape --burstiness) or constant gaps of 1/rate",
    )
    p.add_argument(
        "--trust-env",
        action="store_true",
        help="use HTTP(S)_PROXY/NO_PROXY and ~/.netrc from the environment for every request, as vllm bench "
        "serve does (its per-request lookup then counts in TTFT); default: only the given URLs are contacted",
    )
    p.add_argument(
        "--no-normalize-arrivals",
        action="store_true",
        help="keep the raw gamma draw; by default a fixed-rate schedule is scaled so that its last request "
        "goes out at (n-1)/rate, as vllm bench serve does",
    )
    p.add_argument("--ramp-up-strategy", choices=["linear", "exponential"], default=None)
    p.add_argument("--ramp-up-start-rps", type=float, default=None)
    p.add_argument("--ramp-up-end-rps", type=float, default=None)
    p.add_argument("--ramp-up-duration", type=float, default=None, help="ramp length, s (then end rps held); default: whole run")
    p.add_argument("--trace", default=None, metavar="PATH", help="replay a timed JSONL trace (timestamp, prompt|input_len, output_len)")
    p.add_argument("--trace-time-scale", type=float, default=1.0, help="multiply trace timestamps by this (0.5 = twice as fast)")


def _add_request_args(p: argparse.ArgumentParser) -> None:
    """What each request asks for, the run's limits, SLOs and the dataset."""
    p.add_argument("--input-len", type=int, default=1024, help="prompt length, ~tokens (random; prefix-repetition suffix)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="global run time limit, s")
    p.add_argument("--request-timeout", type=float, default=None, help="per-request limit, s (a stalled stream fails)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs, e.g. ttft:200 tpot:50 e2el:5000")
    p.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="50,90,99")
    p.add_argument("--dataset", default="random", help="'random', 'prefix-repetition', 'jsonl:PATH' or 'sharegpt:PATH'")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix, tokens")
    p.add_argument("--num-prefixes", type=int, default=10, help="prefix-repetition: number of prefix groups")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="ShareGPT: fixed output length")
    p.add_argument("--tokenizer", default=None, help="local tokenizer directory for dataset lengths (offline)")
    p.add_argument("--prompt-logprobs", type=int, default=None)
    p.add_argument("--label", default=None)


def _add_energy_args(p: argparse.ArgumentParser) -> None:
    """Energy and sampling: the source, its periods, the steady-state window, A/B mode."""
    p.add_argument("--gpus", default=None, help="NVML fallback GPU indices, e.g. 0,1 (default all)")
    p.add_argument("--duration", type=float, default=None, help="stop starting requests after this many seconds")
    p.add_argument(
        "--steady-state-batch", type=int, default=None, help="target batch B of the steady-state window (default --max-concurrency)"
    )
    p.add_argument("--sample-interval", type=float, default=0.5, help="energy/power/clock sample period, s (0 = edges only)")
    p.add_argument(
        "--metrics-interval",
        type=float,
        default=15.0,
        help="period of /metrics scrapes of the server under test, s (0 = window edges only; default 15, as operators scrape); "
        "also the energy sample period where the server's counters are the source",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is only shown on a terminal anyway)")
    p.add_argument(
        "--ab-base-url",
        nargs="+",
        default=None,
        metavar="URL_B",
        help="A/B mode: --base-url is A, this is B; runs --pairs interleaved pairs (ABBA) and reports ratios with 95%% CIs",
    )
    p.add_argument("--pairs", type=int, default=3, help="A/B mode: number of pairs (default 3)")
    p.add_argument(
        "--energy",
        choices=["auto", "server", "nvml", "zeusd", "none"],
        default="auto",
        help="energy source: server powersave_* metrics, local NVML, Zeus's daemon (--zeusd), or auto (server, else NVML)",
    )
    p.add_argument(
        "--zeusd",
        default=None,
        metavar="URL_OR_SOCKET",
        help="zeusd address for --energy zeusd: http://host:4938 or its Unix socket path (JWT from $ZEUSD_TOKEN)",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """Where results go, and --compare of existing results."""
    p.add_argument("--result-json", default=None, help="write the full result here")
    p.add_argument("--markdown", default=None, help="write a Markdown report here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here (timeline; sweep curves)")
    p.add_argument(
        "--compare", nargs="+", default=None, metavar="RESULT_JSON", help="print a comparison table of existing result files and exit"
    )
    p.add_argument("--plot", default=None, help="with --compare: save a PNG bar chart (needs matplotlib)")


def _compare(paths: list[str], plot: str | None) -> int:
    results: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                r = json.load(f)
        except (OSError, ValueError) as e:
            raise LoadTestError(f"cannot read result file {path}: {' '.join(str(e).split())}") from None
        if not isinstance(r, dict) or "output_throughput" not in r:
            raise LoadTestError(f"not a load-test result file: {path} (expected a JSON object written by --result-json)")
        name = str(r.get("label") or path)
        results[name if name not in results else f"{name} ({path})"] = r
    print(compare_table(results), end="")
    if plot and not plot_results(results, plot):
        print("warning: matplotlib not installed; no plot written", file=sys.stderr)
    return 0


def _config(args: argparse.Namespace, rate: float, conc: int | None) -> BenchConfig:
    gpus = [int(x) for x in _csv_floats(args.gpus, "--gpus")] if args.gpus else None
    urls = args.base_url
    kw: dict[str, Any] = dict(
        base_url=urls[0],
        model=args.model,
        endpoint=args.endpoint,
        stream=not args.no_stream,
        continuous_usage_stats=args.continuous_usage_stats,
        max_concurrency=conc,
        request_rate=rate,
        burstiness=args.burstiness,
        arrival=args.arrival,
        normalize_arrivals=not args.no_normalize_arrivals,
        trust_env=args.trust_env,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_warmups=args.num_warmups,
        seed=args.seed,
        timeout_s=args.timeout,
        goodput=_goodput(args.goodput),
        percentiles=_csv_floats(args.percentiles, "--percentiles"),
        dataset=args.dataset,
        prompt_logprobs=args.prompt_logprobs,
        label=args.label,
        gpus=gpus,
        energy=args.energy,
        zeusd=args.zeusd,
        duration_s=args.duration,
        ramp_up_strategy=args.ramp_up_strategy,
        ramp_up_start_rps=args.ramp_up_start_rps,
        ramp_up_end_rps=args.ramp_up_end_rps,
        ramp_up_duration_s=args.ramp_up_duration,
        trace=args.trace,
        trace_time_scale=args.trace_time_scale,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        sharegpt_output_len=args.sharegpt_output_len,
        tokenizer=args.tokenizer,
        request_timeout_s=args.request_timeout,
        progress=not args.no_progress,
        steady_state_batch=args.steady_state_batch,
        sample_interval_s=args.sample_interval,
        metrics_interval_s=args.metrics_interval,
    )
    if len(urls) > 1:
        kw["base_urls"] = urls
    if args.num_prompts is not None:
        kw["num_prompts"] = args.num_prompts
    return BenchConfig(**kw)


def _write_outputs(args: argparse.Namespace, result: dict[str, Any], markdown: str) -> None:
    if args.result_json:
        write_result_json(result, args.result_json)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see module docstring)."""
    try:
        args = build_parser().parse_args(argv)
        if args.compare:
            return _compare(args.compare, args.plot)
        rates = _levels(args.request_rate, "--request-rate", _float_or_inf)
        concs = _levels(args.max_concurrency, "--max-concurrency", _int) if args.max_concurrency else [None]
        if len(rates) > 1 and len(concs) > 1:
            raise _ArgError("sweep one parameter at a time: --request-rate or --max-concurrency, not both")
        cfg = _config(args, rates[0], concs[0])
        if args.ab_base_url:
            if args.pairs < 1:
                raise _ArgError(f"--pairs must be >= 1 (got {args.pairs})")
            if len(rates) > 1 or len(concs) > 1:
                raise _ArgError("A/B mode takes one --request-rate and one --max-concurrency")
            from .ab import format_ab, run_ab

            b_urls = args.ab_base_url
            b = BenchConfig.model_validate(
                {**cfg.model_dump(exclude_unset=True), "base_url": b_urls[0], "base_urls": b_urls if len(b_urls) > 1 else None}
            )
            ab = run_ab(cfg, b, pairs=args.pairs)
            print(format_ab(ab))
            _write_outputs(args, ab, format_ab(ab))
            return 0
        if len(rates) > 1 or len(concs) > 1:
            from .sweep import format_sweep, run_sweep

            param, levels = ("request_rate", rates) if len(rates) > 1 else ("max_concurrency", concs)
            sweep = run_sweep(cfg, param, levels)  # type: ignore[arg-type]
            report = format_sweep(sweep)
            print(report)
            _write_outputs(args, sweep, report)
            if args.plot_dir:
                _sweep_plots(sweep, args.plot_dir)
            return 0 if any(r["completed"] > 0 for r in sweep["results"]) else 1
        result = run(cfg)
    except _ArgError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LoadTestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    print(format_table(result))
    _write_outputs(args, result, format_markdown(result))
    if args.plot_dir:
        from .plots import plot_timeline

        path = Path(args.plot_dir) / "timeline.png"
        if plot_timeline(result, path):
            print(f"plot: {path}")
        else:
            print("warning: no timeline plot (no energy samples, or matplotlib missing)", file=sys.stderr)
    return 0 if result["completed"] > 0 else 1


def _sweep_plots(sweep: dict[str, Any], plot_dir: str) -> None:
    from .plots import plot_sweep, plot_timeline

    files = plot_sweep(sweep["results"], sweep["sweep"]["parameter"], sweep["sweep"]["levels"], plot_dir)
    for k, r in enumerate(sweep["results"]):
        p = Path(plot_dir) / f"timeline-{k}.png"
        if plot_timeline(r, p):
            files.append(p)
    if not files:
        print("warning: matplotlib not installed; no plots written", file=sys.stderr)
    for f in files:
        print(f"plot: {f}")


if __name__ == "__main__":
    sys.exit(main())
