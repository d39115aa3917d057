"""CLI: ``python -m loadtests --base-url URL [options]``.

Exit codes: 0 = run finished with at least one completed request; 1 = every request
failed; 2 = bad input (config, dataset, unreachable server) with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from .config import BenchConfig
from .errors import LoadTestError
from .report import compare_table, format_markdown, format_table, plot_results, write_result_json
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


def build_parser() -> argparse.ArgumentParser:
    """Argument parser; option names follow ``vllm bench serve`` where they overlap."""
    p = _Parser(prog="python -m loadtests", description="Load generator for OpenAI-compatible servers; reports tokens per joule.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    p.add_argument("--model", default=None, help="model id (default: first id from GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--no-stream", action="store_true", help="use non-streaming requests (TTFT = E2E)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests (closed loop)")
    p.add_argument("--request-rate", type=_float_or_inf, default=math.inf, help="requests/s, 'inf' = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt length, ~tokens (random dataset)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="global run time limit, s")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs, e.g. ttft:200 tpot:50 e2el:5000")
    p.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="50,90,99")
    p.add_argument("--dataset", default="random", help="'random' or 'jsonl:PATH'")
    p.add_argument("--prompt-logprobs", type=int, default=None)
    p.add_argument("--label", default=None)
    p.add_argument("--gpus", default=None, help="NVML fallback GPU indices, e.g. 0,1 (default all)")
    p.add_argument("--duration", type=float, default=None, help="stop starting requests after this many seconds")
    p.add_argument("--ab-base-url", default=None, metavar="URL_B",
                   help="A/B mode: --base-url is A, this is B; runs --pairs interleaved pairs (ABBA) and reports ratios with 95%% CIs")
    p.add_argument("--pairs", type=int, default=3, help="A/B mode: number of pairs (default 3)")
    p.add_argument("--energy", choices=["auto", "server", "nvml", "none"], default="auto",
                   help="energy source: server powersave_* metrics, local NVML, or auto (server, else NVML)")
    p.add_argument("--result-json", default=None, help="write the full result here")
    p.add_argument("--markdown", default=None, help="write a Markdown report here")
    p.add_argument("--compare", nargs="+", default=None, metavar="RESULT_JSON",
                   help="print a comparison table of existing result files and exit")
    p.add_argument("--plot", default=None, help="with --compare: save a PNG bar chart (needs matplotlib)")
    return p


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


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see module docstring)."""
    try:
        args = build_parser().parse_args(argv)
        if args.compare:
            return _compare(args.compare, args.plot)
        gpus = None
        if args.gpus:
            gpus = [int(x) for x in _csv_floats(args.gpus, "--gpus")]
        cfg = BenchConfig(
            base_url=args.base_url, model=args.model, endpoint=args.endpoint, stream=not args.no_stream,
            num_prompts=args.num_prompts, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
            burstiness=args.burstiness, input_len=args.input_len, output_len=args.output_len,
            range_ratio=args.range_ratio, num_warmups=args.num_warmups, seed=args.seed, timeout_s=args.timeout,
            goodput=_goodput(args.goodput), percentiles=_csv_floats(args.percentiles, "--percentiles"),
            dataset=args.dataset, prompt_logprobs=args.prompt_logprobs, label=args.label, gpus=gpus, energy=args.energy, duration_s=args.duration,
        )
        if args.ab_base_url:
            if args.pairs < 1:
                raise _ArgError(f"--pairs must be >= 1 (got {args.pairs})")
            from .ab import format_ab, run_ab

            ab = run_ab(cfg, cfg.model_copy(update={"base_url": args.ab_base_url.rstrip("/").removesuffix("/v1")}), pairs=args.pairs)
            print(format_ab(ab))
            if args.result_json:
                write_result_json(ab, args.result_json)
            return 0
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
    if args.result_json:
        write_result_json(result, args.result_json)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(format_markdown(result))
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
