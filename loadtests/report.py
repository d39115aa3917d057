"""Human-readable output: console table, Markdown report, multi-run comparison, optional plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .metrics import percentile_key

_NO_ENERGY = "n/a (no energy source)"

#: A steady-state window shorter than this, or holding fewer energy samples, is too short to
#: compare arms by (a few samples at the window's edges decide its joules): its rows are left out.
STEADY_MIN_WINDOW_S = 10.0
STEADY_MIN_SAMPLES = 3


def steady_state_samples(result: dict[str, Any]) -> int | None:
    """Energy samples inside a result's steady-state window (the fewest over its sources), from
    ``steady_state_energy_samples`` or counted on its timeline; None when neither says."""
    n = result.get("steady_state_energy_samples")
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    a, b = result.get("steady_state_start_s"), result.get("steady_state_end_s")
    series = ((result.get("timeline") or {}).get("series")) or []
    if a is None or b is None or not series:
        return None
    # The window's edges are snapped to sample times (averaged over sources): allow a little slack.
    eps_s = 0.05
    return min(sum(1 for t in s.get("t_s") or [] if a - eps_s <= t <= b + eps_s) for s in series)


def steady_state_unusable(result: dict[str, Any]) -> str | None:
    """Why a result's steady-state figures are too thin to show, or None when they are usable."""
    dur_s = result.get("steady_state_duration_s")
    if dur_s is None:
        return result.get("steady_state_note") or "no steady-state window"
    n = steady_state_samples(result)
    if dur_s < STEADY_MIN_WINDOW_S or n is None or n < STEADY_MIN_SAMPLES:
        got = f"{n} energy samples" if n is not None else "energy samples unknown"
        return f"window {dur_s:.1f} s, {got}; needs >= {STEADY_MIN_WINDOW_S:g} s and >= {STEADY_MIN_SAMPLES} samples"
    return None


def _lag_tag(r: dict) -> str:
    """The lag cell's reading: over the threshold from the client's own load, or from other
    processes taking the CPU (loadtests/looplag.py); nothing within it."""
    if r.get("client_bottleneck"):
        return " (client is the bottleneck)"
    return " (host CPU contention)" if r.get("client_cpu_contended") else ""


def _num(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.{digits}f}"
    return str(v)


def _model(result: dict[str, Any]) -> str:
    """The served model name, with the model's directory where the server lists a different one."""
    name, root = str(result.get("model_id")), result.get("model_root")
    if root and root != name:
        return f"{name} ({Path(root).name or root})"
    return name


def _energy(result: dict[str, Any], key: str, digits: int = 4) -> str:
    """An energy number with its provenance, e.g. ``0.0123 (simulated)``."""
    v = result.get(key)
    if result.get("energy_source") is None:
        return _NO_ENERGY
    if v is None:
        # Average power of simulated energy is left out on purpose (no one could measure it).
        return f"n/a ({result['energy_source']})"
    return f"{_num(v, digits)} ({result['energy_source']})"


def _latency_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    titles = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
    for name, title in titles.items():
        rows.append((f"Mean {title} (ms)", _num(result.get(f"mean_{name}_ms"))))
        rows.append((f"Median {title} (ms)", _num(result.get(f"median_{name}_ms"))))
        rows.append((f"Std {title} (ms)", _num(result.get(f"std_{name}_ms"))))
        for p in result.get("percentiles", [50, 90, 99]):
            k = percentile_key(p)
            rows.append((f"{k.upper()} {title} (ms)", _num(result.get(f"{k}_{name}_ms"))))
    return rows


def _summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("Label", str(result.get("label") or "-")),
        ("Model", _model(result)),
        ("Endpoint", str(result.get("endpoint"))),
        ("Successful requests", _num(result.get("completed"))),
        ("Failed requests", _num(result.get("failed"))),
        ("Benchmark duration (s)", _num(result.get("duration"))),
        ("Total input tokens", _num(result.get("total_input_tokens"))),
        ("Total generated tokens", _num(result.get("total_output_tokens"))),
        ("Request throughput (req/s)", _num(result.get("request_throughput"))),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", _num(result.get("request_goodput"))))
    rows += [
        ("Output token throughput (tok/s)", _num(result.get("output_throughput"))),
        ("Total token throughput (tok/s)", _num(result.get("total_token_throughput"))),
    ]
    rows += _latency_rows(result)
    rows += _method_rows(result)
    if result.get("energy_source") is None:
        rows.append(("GPU energy", result.get("energy_note") or _NO_ENERGY))
    else:
        rows += [
            ("GPU energy (J)", _energy(result, "gpu_energy_j", 2)),
            ("GPU average power (W)", _energy(result, "gpu_avg_power_w", 1)),
            ("Energy per output token (J)", _energy(result, "gpu_energy_per_output_token_j")),
            ("Energy per total token (J)", _energy(result, "gpu_energy_per_total_token_j")),
            ("Output tokens per joule", _energy(result, "output_tokens_per_joule")),
            ("Total tokens per joule", _energy(result, "total_tokens_per_joule")),
        ]
        for phase, j in sorted((result.get("energy_by_phase_j") or {}).items()):
            rows.append((f"  energy in {phase} (J)", f"{_num(j)} ({result['energy_source']})"))
        if result.get("gpu_idle_while_busy_energy_j") is not None:
            share = result.get("idle_while_busy_share")
            rows.append(
                (
                    "  idle while requests in flight (J)",
                    f"{_num(result['gpu_idle_while_busy_energy_j'])} ({result['energy_source']})"
                    + (f", {_num(100.0 * share, 1)} % of busy time" if share is not None else ""),
                )
            )
    rows += _request_energy_rows(result)
    rows += _steady_rows(result)
    if result.get("timed_out"):
        rows.append(("Note", f"global --timeout of {_num(result.get('timeout_s'), 0)} s reached"))
    return rows


def _request_energy(result: dict[str, Any]) -> str:
    """Mean per-request joules the server reported in ``usage``, with how many requests had one."""
    if "request_energy_reported" not in result:
        return "n/a"
    n, done = result.get("request_energy_reported"), result.get("completed")
    src = result.get("request_energy_source") or "?"
    return f"{_num(result.get('mean_request_energy_j'), 4)} ({src}; {n} of {done} requests)"


def _request_energy_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """Per-request joules from the server (only when some request carried them)."""
    if "request_energy_reported" not in result:
        return []
    src = result.get("request_energy_source") or "?"
    return [
        ("Per-request energy, mean (J)", _request_energy(result)),
        ("Per-request energy, total (J)", f"{_num(result.get('total_request_energy_j'), 2)} ({src})"),
    ]


def _method_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """How TTFT, ITL and token counts were taken, and the client's own event-loop lag."""
    how = result.get("methods")
    if not isinstance(how, dict):
        return []  # a result written before these fields existed
    rows = [
        ("TTFT method", str(how.get("ttft"))),
        ("ITL method", str(how.get("itl"))),
        ("Output tokens from", str(how.get("output_tokens"))),
    ]
    if result.get("client_loop_lag_samples"):
        rows.append(
            (
                "Client event-loop lag (ms)",
                f"p50 {_num(result.get('client_loop_lag_p50_ms'))} / p99 {_num(result.get('client_loop_lag_p99_ms'))}"
                f" / max {_num(result.get('client_loop_lag_max_ms'))} (bottleneck above p99 "
                f"{_num(result.get('client_bottleneck_threshold_ms'))})",
            )
        )
    if result.get("client_bottleneck_note"):
        rows.append(("Warning" if result.get("client_bottleneck") else "Client event-loop lag", str(result["client_bottleneck_note"])))
    return rows


def _steady_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    if "steady_state_batch" not in result:
        return []
    if result.get("steady_state_duration_s") is None:
        return [("Steady state", result.get("steady_state_note") or "n/a")]
    src = result.get("steady_state_energy_source")

    def en(key: str, digits: int = 4) -> str:
        v = result.get(key)
        if src is None:
            return _NO_ENERGY
        return f"n/a ({src})" if v is None else f"{_num(v, digits)} ({src})"

    rows = [
        ("Steady state: target batch B", _num(result.get("steady_state_batch"))),
        (
            "Steady state: window (s)",
            f"{_num(result.get('steady_state_start_s'))} - {_num(result.get('steady_state_end_s'))}"
            f" ({_num(result.get('steady_state_duration_s'))} s)",
        ),
        (
            "Steady state: avg concurrency",
            f"{_num(result.get('steady_state_avg_concurrency'))} ({_num(result.get('steady_state_batch_utilization'))} of B)",
        ),
        ("Steady state: output throughput (tok/s)", _num(result.get("steady_state_output_throughput"))),
        ("Steady state: GPU energy (J)", en("steady_state_gpu_energy_j", 2)),
        ("Steady state: GPU average power (W)", en("steady_state_gpu_avg_power_w", 1)),
        ("Steady state: energy per output token (J)", en("steady_state_gpu_energy_per_output_token_j")),
        ("Steady state: output tokens per joule", en("steady_state_output_tokens_per_joule")),
    ]
    if result.get("steady_state_note"):
        rows.append(("Steady state: note", str(result["steady_state_note"])))
    return rows


def _endpoint_table(result: dict[str, Any]) -> list[str]:
    """Markdown rows per fleet endpoint (only for fleets of two or more)."""
    eps = result.get("endpoints") or []
    if len(eps) < 2:
        return []
    lines = [
        "",
        "### Per endpoint",
        "",
        "| Endpoint | Completed / failed | Output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | GPU energy (J) | J / output token | Output tokens / J | Steady state: tokens / J |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ep in eps + [dict(result, base_url="**fleet total**")]:
        ss = _steady_tpj(ep)
        lines.append(
            f"| {ep['base_url']} | {ep.get('completed')} / {ep.get('failed')} | {_num(ep.get('output_throughput'))} | "
            f"{_num(ep.get('median_ttft_ms'))} | {_num(ep.get('median_tpot_ms'))} | {_energy(ep, 'gpu_energy_j', 2)} | "
            f"{_energy(ep, 'gpu_energy_per_output_token_j')} | {_energy(ep, 'output_tokens_per_joule')} | {ss} |"
        )
    return lines


def _steady_tpj(ep: dict[str, Any]) -> str:
    """Steady-state output tokens per joule with provenance, or why there is none."""
    v, src = ep.get("steady_state_output_tokens_per_joule"), ep.get("steady_state_energy_source")
    if v is not None and src:
        return f"{_num(v, 4)} ({src})"
    return "n/a"


def format_table(result: dict[str, Any]) -> str:
    """Plain-text console table in the style of ``vllm bench serve``."""
    rows = _summary_rows(result)
    width = max(len(k) for k, _ in rows) + 2
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=60, c="=")]
    lines += [f"{k + ':':<{width}}{v}" for k, v in rows]
    lines.append("=" * 60)
    fleet = result.get("endpoints") or []
    for ep in fleet if len(fleet) > 1 else []:
        lines.append(
            f"  {ep['base_url']}: {ep.get('completed')} ok / {ep.get('failed')} failed, "
            f"{_num(ep.get('output_throughput'))} tok/s, J/output token {_energy(ep, 'gpu_energy_per_output_token_j')}"
        )
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        lines.append(f"First error ({len(errors)} failed): {errors[0]}")
    return "\n".join(lines)


def format_markdown(result: dict[str, Any]) -> str:
    """Markdown report of one result: a two-column metric table plus the first error."""
    rows = _summary_rows(result)
    title = f"## Load test: {result.get('label') or result.get('model_id')}"
    lines = [title, "", "| Metric | Value |", "|---|---|"]
    lines += [f"| {k.strip()} | {v} |" for k, v in rows]
    lines += _endpoint_table(result)
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        lines += ["", f"First error ({len(errors)} failed): `{errors[0]}`"]
    return "\n".join(lines) + "\n"


def compare_table(results: dict[str, dict[str, Any]], steady_state: bool = True) -> str:
    """Side-by-side Markdown table of labelled results (one column per label).

    Every energy number carries its provenance ("measured"/"simulated") so simulated
    numbers are never mistaken for measurements. Steady-state rows appear only where some run's
    window is usable (:func:`steady_state_unusable`), and not at all with ``steady_state=False``
    (a caller that shows them per arm with an interval).
    """
    labels = list(results)
    rows: list[tuple[str, list[str]]] = []

    def add(title: str, fn: Any) -> None:
        rows.append((title, [fn(results[lab]) for lab in labels]))

    add("Model", _model)
    add("Completed / failed", lambda r: f"{r.get('completed')} / {r.get('failed')}")
    add("Request throughput (req/s)", lambda r: _num(r.get("request_throughput")))
    add("Output throughput (tok/s)", lambda r: _num(r.get("output_throughput")))
    add("Total token throughput (tok/s)", lambda r: _num(r.get("total_token_throughput")))
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        # The median is p50 under any --percentiles choice, so p50 is always available.
        add(f"{title} p50 (ms)", lambda r, k=f"median_{name}_ms": _num(r.get(k)))
        add(f"{title} p99 (ms)", lambda r, k=f"p99_{name}_ms": _num(r.get(k)))
    add("ITL method", lambda r: str(r.get("itl_method") or "n/a"))
    add("Output tokens from", lambda r: str(r.get("output_tokens_source") or "n/a"))
    add(
        "Client loop lag p99 (ms)",
        lambda r: _num(r.get("client_loop_lag_p99_ms")) + _lag_tag(r),
    )
    add("GPU avg power (W)", lambda r: _energy(r, "gpu_avg_power_w", 1))
    add("J / output token", lambda r: _energy(r, "gpu_energy_per_output_token_j"))
    add("of which idle (J total)", lambda r: _energy(r, "gpu_idle_energy_j", 1))
    if any(r.get("gpu_idle_while_busy_energy_j") is not None for r in results.values()):
        add("of which idle while requests in flight (J total)", lambda r: _energy(r, "gpu_idle_while_busy_energy_j", 1))
        add(
            "Engine idle while requests in flight (% of busy time, wall clock)",
            lambda r: _num(100.0 * r["idle_while_busy_share"], 1) if r.get("idle_while_busy_share") is not None else "n/a",
        )
    add("J / output token, active phases only", lambda r: _energy(r, "gpu_active_energy_per_output_token_j"))
    add("Output tokens / J", lambda r: _energy(r, "output_tokens_per_joule"))
    add("Total tokens / J", lambda r: _energy(r, "total_tokens_per_joule"))
    if any("request_energy_reported" in r for r in results.values()):
        add("Per-request energy, mean (J)", _request_energy)
    add("Energy source", lambda r: r.get("energy_source") or "none")
    if steady_state and any(steady_state_unusable(r) is None for r in results.values()):

        def ss(key: str, digits: int = 4) -> Any:
            def f(r: dict[str, Any]) -> str:
                v, src = r.get(key), r.get("steady_state_energy_source")
                why = steady_state_unusable(r)
                if why is not None:
                    return f"n/a ({why})"
                if "energy" in key or "joule" in key or "power" in key:
                    if src is None:
                        return _NO_ENERGY
                    return f"n/a ({src})" if v is None else f"{_num(v, digits)} ({src})"
                return _num(v, digits)

            return f

        add("Steady state duration (s)", ss("steady_state_duration_s", 2))
        add("Steady state output tok/s", ss("steady_state_output_throughput", 2))
        add("Steady state J / output token", ss("steady_state_gpu_energy_per_output_token_j"))
        add("Steady state output tokens / J", ss("steady_state_output_tokens_per_joule"))

    header = "| Metric | " + " | ".join(labels) + " |"
    sep = "|---|" + "---|" * len(labels)
    return "\n".join([header, sep] + [f"| {t} | " + " | ".join(v) + " |" for t, v in rows]) + "\n"


def write_result_json(result: dict[str, Any], path: str | Path) -> None:
    """Write strict JSON (no NaN/Infinity) so any consumer can read it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def plot_results(results: dict[str, dict[str, Any]], path: str | Path) -> bool:
    """Bar chart of output throughput and output tokens/J per label; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(6, 2 * len(labels)), 4))
    ax1.bar(labels, [results[k].get("output_throughput") or 0 for k in labels])
    ax1.set_ylabel("output tokens / s")
    ax2.bar(labels, [results[k].get("output_tokens_per_joule") or 0 for k in labels])
    ax2.set_ylabel("output tokens / J")
    srcs = {results[k].get("energy_source") or "none" for k in labels}
    ax2.set_title("energy: " + ", ".join(sorted(srcs)))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
