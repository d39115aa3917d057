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

from .savings import PERF_BOOST_IDLE_SAVING


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


def savings_section(runs: list[tuple[str, float, dict[str, Any]]], gpu: bool) -> str:
    """Markdown: per rate, the J/output-token change of the plugin's defaults (``measured`` on a GPU,
    ``simulated`` without one), the perf-boost saving predicted from stock's idle energy, and the
    front-end starvation the plugin counted.

    ``runs``: ``(label "off"/"on", request rate, loadtests result)`` in run order.
    """
    src = "measured" if gpu else "simulated"
    lines = ["", "## Savings: measured and predicted", ""]
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
        jt_off = _mean([x["gpu_energy_per_output_token_j"] for x in off if x.get("gpu_energy_per_output_token_j")])
        jt_on = _mean([x["gpu_energy_per_output_token_j"] for x in on if x.get("gpu_energy_per_output_token_j")])
        lines.append(f"### {rate_label(rate)}")
        lines.append("")
        # On a GPU "on" is the plugin's defaults against stock vLLM; without one it is the
        # simulated H200's clock presets against the same meter at stock clocks (cli._configs).
        what = "defaults vs stock" if gpu else "clock presets vs stock clocks"
        if jt_off and jt_on:
            lines.append(f"- J / output token, {what}: {100 * (jt_on / jt_off - 1):+.1f} % ({src}, mean of {len(on)} and {len(off)} runs)")
        else:
            lines.append(f"- J / output token, {what}: n/a (no energy figure in some run)")
        idle = _mean([x["gpu_idle_energy_j"] for x in off if x.get("gpu_idle_energy_j") is not None])
        total = _mean([x["gpu_energy_j"] for x in off if x.get("gpu_energy_j")])
        if idle is not None and total:
            lines.append(
                f"- perf boost auto: stock idled {idle:.0f} J ({100 * idle / total:.1f} % of its energy, {src}); at "
                f"-35 % idle power (measured on the H200) that is {100 * PERF_BOOST_IDLE_SAVING * idle / total:.1f} % "
                f"of stock's energy (predicted)"
            )
        else:
            lines.append(
                "- perf boost auto: stock's idle energy unknown here (a stock server publishes no phases); "
                "bound: stock's idle seconds x the idle power difference (predicted)"
            )
        starved = [x for x in on if x.get("gpu_idle_while_busy_energy_j") is not None]
        if starved:
            j = _mean([x["gpu_idle_while_busy_energy_j"] for x in starved]) or 0.0
            share = _mean([x["idle_while_busy_share"] for x in starved if x.get("idle_while_busy_share") is not None])
            lines.append(
                f"- front-end starvation (plugin runs): {j:.0f} J idle while requests were in flight"
                + (f", {100 * share:.1f} % of busy time" if share is not None else "")
                + f" ({src}); "
                "`vllm-powersave advise --result result-on-*.json` says what to change"
            )
        lines.append("")
    return "\n".join(lines)
