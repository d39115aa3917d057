"""``vllm-powersave compare``: request rates and the "measured or predicted" savings section.

The main job compares stock vLLM with the plugin's defaults in ABBA order at each request rate:
Poisson arrivals at moderate rates (the GPU idles between requests, where perf boost ``auto``
saves) and a saturation point (``inf``: closed loop at ``--concurrency``). This module parses the
rates and writes the section that says, per rate, which savings were measured in these runs and
which are predictions (from a measurement on another machine, or from the simulated GPU).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from . import intervals
from .advise import MIN_STARVATION_SHARE
from .savings import PERF_BOOST_IDLE_SAVING

#: Front-end starvation above this share of the busy time earns the API-server advice (as do
#: joules above advise's MIN_STARVATION_SHARE of the arm's energy).
STARVATION_ADVICE_SHARE = 0.05
#: The advice and the measurement it rests on (docs/results/h200-under-load.md).
API_SERVER_ADVICE = (
    "run more API servers (--api-server-count 4, or leave the plugin's api_server_count: auto): measured on H200, "
    "7B shape, streamed: x1.54 throughput and p99 TPOT x0.68 at c256, x1.02 at c64 (docs/results/h200-under-load.md)"
)


def parse_rates(text: str) -> list[float]:
    """``"0.2,2,inf"`` -> ``[0.2, 2.0, inf]`` (req/s; ``inf`` = saturation). One line on bad input."""
    out: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"--rates = {text!r}: {part!r} is not a request rate (req/s, or inf)") from None
        if not v > 0 or math.isnan(v):
            raise ValueError(f"--rates = {text!r}: {part!r} must be > 0 (req/s, or inf for saturation)")
        out.append(v)
    if not out:
        raise ValueError(f"--rates = {text!r}: no rate given")
    return out


def rate_label(rate: float) -> str:
    return "saturation" if math.isinf(rate) else f"{rate:g} req/s"


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def mean_ci95(xs: list[float]) -> tuple[float, float, float] | None:
    """(mean, low, high): the mean and its two-sided 95 % t interval; None below two values."""
    return intervals.mean_ci95(xs) if len(xs) >= 2 else None


def _arm_names(gpu: bool) -> dict[str, str]:
    # On a GPU "on" is the plugin's defaults against stock vLLM; without one it is the simulated
    # H200's clock presets against the same meter at stock clocks (cli._configs).
    return {"off": "stock", "on": "defaults"} if gpu else {"off": "stock clocks", "on": "presets"}


def _energy_lines(off: list[dict], on: list[dict], gpu: bool, same_steps: list[float]) -> list[str]:
    """The J / output token change. On the CPU the saving is the identical-steps figure
    (``same_steps``: each "on" run's saving in %); the run-to-run change follows how the CPU
    happened to batch, so it is shown only under that name (README, "Try it")."""
    jt_off = _mean([x["gpu_energy_per_output_token_j"] for x in off if x.get("gpu_energy_per_output_token_j")])
    jt_on = _mean([x["gpu_energy_per_output_token_j"] for x in on if x.get("gpu_energy_per_output_token_j")])
    per_run = 100 * (jt_on / jt_off - 1) if jt_off and jt_on else None
    if gpu:
        if per_run is None:
            return ["- J / output token, defaults vs stock: n/a (no energy figure in some run)"]
        return [f"- J / output token, defaults vs stock: {per_run:+.1f} % (measured, mean of {len(on)} and {len(off)} runs)"]
    what = "J / output token, clock presets vs stock clocks"
    if same_steps:
        out = [
            f"- {what}, on identical engine steps: {-statistics.fmean(same_steps):+.1f} % (simulated, mean of "
            f'{len(same_steps)} "on" runs; see "Clock presets on identical engine steps")'
        ]
    else:
        out = [f"- {what}: n/a (no identical-steps figure in these runs)"]
    if per_run is not None:
        out.append(
            f"- run-to-run (includes the CPU's batching noise, not the presets' effect): presets runs vs stock-clocks runs "
            f"{per_run:+.1f} % J / output token (simulated, mean of {len(on)} and {len(off)} runs)"
        )
    return out


def _perf_boost_line(off: list[dict], src: str) -> str:
    idle = _mean([x["gpu_idle_energy_j"] for x in off if x.get("gpu_idle_energy_j") is not None])
    total = _mean([x["gpu_energy_j"] for x in off if x.get("gpu_energy_j")])
    if idle is not None and total:
        return (
            f"- perf boost auto: stock idled {idle:.0f} J ({100 * idle / total:.1f} % of its energy, {src}); at "
            f"-35 % idle power (perf boost alone, measured on the H200: docs/results/h200-perf-boost.md) that is {100 * PERF_BOOST_IDLE_SAVING * idle / total:.1f} % "
            f"of stock's energy (predicted)"
        )
    return (
        "- perf boost auto: stock's idle energy unknown here (a stock server publishes no phases); "
        "bound: stock's idle seconds x the idle power difference (predicted)"
    )


def _starvation(arm: list[dict]) -> tuple[float, float | None, float | None] | None:
    """(J idle while requests were in flight, share of busy time, share of the energy), means
    over the arm's runs that carry the figure; None when none does."""
    got = [x for x in arm if x.get("gpu_idle_while_busy_energy_j") is not None]
    if not got:
        return None
    j = statistics.fmean(x["gpu_idle_while_busy_energy_j"] for x in got)
    share = _mean([x["idle_while_busy_share"] for x in got if x.get("idle_while_busy_share") is not None])
    e = _mean([x["gpu_energy_j"] for x in got if x.get("gpu_energy_j")])
    return j, share, (j / e if e else None)


def _starvation_lines(off: list[dict], on: list[dict], gpu: bool, src: str) -> list[str]:
    """Front-end starvation per arm and, on a GPU where it is material, the API-server advice."""
    names = _arm_names(gpu)
    lines: list[str] = []
    material = False
    for lab, arm in (("off", off), ("on", on)):
        st = _starvation(arm)
        if st is None:
            # Stock vLLM has no powersave_* series; without a GPU both arms run the plugin's meter.
            why = "stock publishes no starvation counter" if gpu and lab == "off" else "no starvation counter in these runs"
            lines.append(f"- front-end starvation, {names[lab]}: n/a ({why})")
            continue
        j, share, e_share = st
        material = material or (share or 0.0) > STARVATION_ADVICE_SHARE or (e_share or 0.0) >= MIN_STARVATION_SHARE
        n = sum(1 for x in arm if x.get("gpu_idle_while_busy_energy_j") is not None)
        lines.append(
            f"- front-end starvation, {names[lab]}: {j:.0f} J idle while requests were in flight"
            + (f", {100 * share:.1f} % of busy time" if share is not None else "")
            + (f", {100 * e_share:.1f} % of the energy" if e_share is not None else "")
            + f" ({src}, mean of {n} run{'s' if n != 1 else ''})"
        )
    # The advice rests on an H200 measurement; on a CPU the API servers would share the cores
    # the engine runs on, so it is not given there.
    if gpu and material:
        lines.append(f"- advice: {API_SERVER_ADVICE}")
    if any(x.get("gpu_idle_while_busy_energy_j") is not None for x in off + on):
        # One file: advise reads one run's result (a shell glob would pass it several).
        n = next((x["run_index"] for x in on if isinstance(x.get("run_index"), int)), None)
        name = f"result-on-{n}.json" if n is not None else "result-on-N.json (one run's file)"
        lines.append(f"- `vllm-powersave advise --result {name}` (a file in this run's folder) says what to change")
    return lines


def _api_server_line(off: list[dict], on: list[dict], gpu: bool) -> str | None:
    """The API-server count each arm ran with, where the results carry it (the server's start line)."""
    counts = {
        lab: sorted({int(x["api_server_count"]) for x in arm if isinstance(x.get("api_server_count"), int)})
        for lab, arm in (("off", off), ("on", on))
    }
    if not counts["off"] and not counts["on"]:
        return None
    names = _arm_names(gpu)
    return "- API servers: " + ", ".join(f"{names[lab]} {'/'.join(map(str, c)) or 'n/a'}" for lab, c in counts.items())


def _same_steps(on: list[dict], counterfactual: dict[str, dict]) -> list[float]:
    """The identical-steps savings (%) of these "on" runs, keyed as cli names them (``on (run 2)``)."""
    out = []
    for res in on:
        cf = counterfactual.get(f"on (run {res.get('run_index')})")
        if cf and cf.get("saving_pct") is not None:
            out.append(float(cf["saving_pct"]))
    return out


def savings_section(runs: list[tuple[str, float, dict[str, Any]]], gpu: bool, counterfactual: dict[str, dict] | None = None) -> str:
    """Markdown: per rate, the J/output-token change of the plugin's defaults (``measured`` on a GPU,
    ``simulated`` without one), the perf-boost saving predicted from stock's idle energy, the
    front-end starvation of both arms and the API servers each ran with.

    ``runs``: ``(label "off"/"on", request rate, loadtests result)`` in run order. ``counterfactual``:
    cli's identical-steps figures by run (``on (run 2)`` -> ``saving_pct``), the CPU's saving.
    """
    src = "measured" if gpu else "simulated"
    lines = ["", "## Savings: measured and predicted" if gpu else "## Savings: simulated and predicted", ""]
    if not gpu:
        lines.append(
            "No GPU here: every joule below is *simulated* (an H200 running the same engine steps); perf boost "
            "cannot act on a CPU, so its saving is *predicted* from the H200 measurement."
        )
        lines.append("")
    for rate in dict.fromkeys(r for _, r, _ in runs):
        at = [(lab, res) for lab, r, res in runs if r == rate]
        off = [res for lab, res in at if lab == "off"]
        on = [res for lab, res in at if lab == "on"]
        lines += [f"### {rate_label(rate)}", ""]
        lines += _energy_lines(off, on, gpu, _same_steps(on, counterfactual or {}))
        lines.append(_perf_boost_line(off, src))
        lines += _starvation_lines(off, on, gpu, src)
        servers = _api_server_line(off, on, gpu)
        if servers:
            lines.append(servers)
        lines.append("")
    return "\n".join(lines)


#: Steady-state figures shown per arm: (row title, result key, digits, an energy figure).
_STEADY_ROWS = (
    ("output tok/s", "steady_state_output_throughput", 1, False),
    ("J / output token", "steady_state_gpu_energy_per_output_token_j", 4, True),
    ("output tokens / J", "steady_state_output_tokens_per_joule", 3, True),
)


def _steady_cell(arm: list[dict], key: str, digits: int, energy: bool) -> str:
    """One arm's steady-state figure: the mean with its 95 % t interval over the arm's runs."""
    xs = [float(x[key]) for x in arm if x.get(key) is not None]
    srcs = {x.get("steady_state_energy_source") for x in arm if x.get(key) is not None}
    src = ("; measured" if srcs == {"measured"} else "; simulated") if energy and xs else ""
    if not xs:
        return "n/a"
    ci = mean_ci95(xs)
    if ci is None:
        return f"{xs[0]:.{digits}f} (one run: no interval{src})"
    m, lo, hi = ci
    return f"{m:.{digits}f} (95 % CI {lo:.{digits}f}–{hi:.{digits}f}, {len(xs)} runs{src})"


def steady_state_section(runs: list[tuple[str, float, dict[str, Any]]], gpu: bool) -> str:
    """Markdown: per rate, each arm's steady-state figures over the runs whose window is long
    enough to mean something (loadtests.report.steady_state_unusable), with a 95 % interval."""
    from loadtests.report import STEADY_MIN_SAMPLES, STEADY_MIN_WINDOW_S, steady_state_unusable

    names = _arm_names(gpu)
    need = f">= {STEADY_MIN_WINDOW_S:g} s with >= {STEADY_MIN_SAMPLES} energy samples"
    lines = ["", "## Steady state (ML.ENERGY window), per arm", ""]
    body: list[str] = []
    for rate in dict.fromkeys(r for _, r, _ in runs):
        arms = {lab: [res for lb, r, res in runs if r == rate and lb == lab] for lab in ("off", "on")}
        ok = {lab: [x for x in arm if steady_state_unusable(x) is None] for lab, arm in arms.items()}
        if not ok["off"] and not ok["on"]:
            why = next((steady_state_unusable(x) for arm in arms.values() for x in arm), "no run")
            body += [f"### {rate_label(rate)}", "", f"- no steady-state figures: no run's window is {need} (e.g. {why})", ""]
            continue
        used = ", ".join(f"{names[lab]} {len(ok[lab])} of {len(arms[lab])} runs" for lab in arms)
        body += [f"### {rate_label(rate)}", "", f"Runs with a window {need}: {used}.", ""]
        body += ["| steady state | " + " | ".join(names[lab] for lab in arms) + " |", "|---|---|---|"]
        for title, key, digits, energy in _STEADY_ROWS:
            body.append(f"| {title} | " + " | ".join(_steady_cell(ok[lab], key, digits, energy) for lab in arms) + " |")
        body.append("")
    return "\n".join(lines + body)
