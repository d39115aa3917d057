"""The report of a search: ``tune-serving.json``, its Markdown twin ``tune-serving.md``, the Pareto
plot ``pareto.png`` (tokens per joule against p99 TPOT, the SLO marked) and ``winner-command.txt``
(the ``vllm serve`` command line of the winner). Every energy figure carries its source: measured
(NVML) or simulated (the plugin's simulated H200, without a GPU); latency and throughput are always
measured on this machine.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..intervals import mean_ci95
from .measure import ServePlan
from .slo import wilson_ci95
from .space import Config, drop_flags, override
from .state import Measurement

SIM_NOTE = (
    "Energy SIMULATED: no GPU here; each server ran the plugin as a meter (no saving but decode pacing where a "
    "configuration sets it), pricing the engine steps this CPU ran on the simulated H200. Throughput and latency "
    "are measured on this CPU."
)
GPU_NOTE = "Energy measured by the local NVML energy counter, alike for every configuration; latency and throughput measured."


def mean_ci(xs: list[float | None], nd: int = 4) -> dict[str, Any]:
    """``{"mean", "ci95"}`` over the finite values (no interval below 2 values)."""
    vals = [float(x) for x in xs if isinstance(x, (int, float))]
    if not vals:
        return {"mean": None, "ci95": None}
    if len(vals) == 1:
        return {"mean": round(vals[0], nd), "ci95": None}
    m, lo, hi = mean_ci95(vals)
    return {"mean": round(m, nd), "ci95": [round(lo, nd), round(hi, nd)]}


#: Flags the harness sets for its own servers (loopback, the model name its client asks for), which
#: an operator's server would not copy.
HARNESS_ONLY_FLAGS = ("--host", "--port", "--served-model-name")
#: Plugin settings that act without a GPU, and so were applied to a search's CPU servers.
NO_GPU_PLUGIN_SETTINGS = ("decode_pacing",)


def winner_command(plan: ServePlan, config: Config) -> str:
    """The ``vllm serve`` command line of ``config`` as a user would run it (no measuring meter, no
    harness-only flags)."""
    served = drop_flags(override(plan.base_args, config.serve_flags()), HARNESS_ONLY_FLAGS)
    args = ["vllm", "serve", str(plan.model), *served]
    plugin = config.plugin_settings()
    if plugin and not plan.gpu:  # without a GPU only what needs none was applied (measure.ServePlan)
        plugin = {k: v for k, v in plugin.items() if k in NO_GPU_PLUGIN_SETTINGS}
        plugin = {**plugin, "api_server_count": "vllm"} if plugin else plugin
    if plugin:
        args += ["--plugin", "powersave", "--additional-config", json.dumps({"powersave": plugin})]
    return shlex.join(args)


def window_entry(m: Measurement, verdict: Any) -> dict[str, Any]:
    """One window as the report shows it, energy labelled, attainment with its Wilson interval."""
    f = m.figures
    ci = wilson_ci95(f.good, f.sent)
    return {
        "step": m.step,
        "window_s": m.window_s,
        "seed": m.seed,
        **asdict(f),
        "energy_label": {"measured": "measured", "simulated": "simulated"}.get(str(f.energy_source), "unknown"),
        "attainment": round(verdict.attainment, 4),
        "attainment_ci95": None if ci is None else [round(ci[0], 4), round(ci[1], 4)],
        "slo_met": verdict.met,
        "slo_misses": list(verdict.misses),
        "server_started": m.restarted,
        "wall_s": round(m.wall_s, 1),
    }


def final_section(pairs: list[dict[str, Measurement]], verdict_of: Any) -> dict[str, Any]:
    """The ABBA pairs: per-pair ratios winner / defaults and each arm's SLO attainment."""

    def ratio(p: dict[str, Measurement], key: str) -> float | None:
        a, b = getattr(p["winner"].figures, key), getattr(p["defaults"].figures, key)
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

    att = {arm: [verdict_of(p[arm]).attainment for p in pairs] for arm in ("winner", "defaults")}
    met = {arm: [verdict_of(p[arm]).met for p in pairs] for arm in ("winner", "defaults")}
    tpj = mean_ci([ratio(p, "output_tokens_per_joule") for p in pairs])
    return {
        "pairs": len(pairs),
        "order": ["winner,defaults" if i % 2 == 0 else "defaults,winner" for i in range(len(pairs))],
        "tok_per_j_ratio": tpj,
        "verdict": pair_verdict(tpj, sum(met["winner"]), sum(met["defaults"])),
        "throughput_ratio": mean_ci([ratio(p, "output_throughput") for p in pairs]),
        "p99_tpot_ratio": mean_ci([ratio(p, "p99_tpot_ms") for p in pairs]),
        "slo_attainment": {
            arm: {**mean_ci(att[arm]), "windows_meeting_slo": sum(met[arm]), "windows": len(pairs)} for arm in ("winner", "defaults")
        },
        "arms": {
            arm: {
                k: mean_ci([getattr(p[arm].figures, k) for p in pairs], 4)
                for k in ("output_tokens_per_joule", "output_throughput", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms")
            }
            for arm in ("winner", "defaults")
        },
        "pair_list": [{arm: window_entry(p[arm], verdict_of(p[arm])) for arm in ("winner", "defaults")} for p in pairs],
    }


def pair_verdict(tok_per_j_ratio: dict[str, Any], winner_met: int, defaults_met: int) -> str:
    """What the final pairs say: the winner saves only where the whole 95 % interval of its tokens
    per joule over the defaults' lies above 1 and it met the SLO in as many windows; a search
    window is one sample, so a ranking inside the noise is not a saving (docs/tune-serving.md)."""
    ci = tok_per_j_ratio.get("ci95")
    if tok_per_j_ratio.get("mean") is None or ci is None:
        return "undecided: fewer than 2 pairs with an energy figure"
    if winner_met < defaults_met:
        return "keep vLLM's defaults: the winner met the SLO in fewer windows"
    if ci[0] > 1.0:
        return "winner saves: tokens per joule above the defaults' over the whole 95 % interval"
    if ci[1] < 1.0:
        return "keep vLLM's defaults: the winner's tokens per joule is lower over the whole 95 % interval"
    return "no difference shown: the 95 % interval of tokens per joule contains 1 (keep vLLM's defaults or run more pairs)"


def write_report(out_dir: Path, record: dict[str, Any]) -> list[Path]:
    """The JSON, its Markdown twin, the Pareto plot and the command line; the paths written."""
    from .report_md import markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "tune-serving.json", out_dir / "tune-serving.md"]
    paths[0].write_text(json.dumps(record, indent=1) + "\n")
    paths[1].write_text(markdown(record))
    if record.get("winner", {}).get("command"):
        (out_dir / "winner-command.txt").write_text(record["winner"]["command"] + "\n")
        paths.append(out_dir / "winner-command.txt")
    if pareto_plot(record, out_dir / "pareto.png"):
        paths.append(out_dir / "pareto.png")
    return paths


def pareto_points(record: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    """``(key, p99 TPOT ms, tokens per joule, SLO met)`` of each configuration's latest window."""
    pts = []
    for c in record.get("configurations", []):
        if c.get("windows"):
            w = c["windows"][-1]
            if w.get("p99_tpot_ms") is not None and w.get("output_tokens_per_joule") is not None:
                pts.append((c["key"], w["p99_tpot_ms"], w["output_tokens_per_joule"], bool(w["slo_met"])))
    return pts


def pareto_front(pts: list[tuple[str, float, float, bool]]) -> list[tuple[str, float, float, bool]]:
    """The points no other point beats on both lower p99 TPOT and higher tokens per joule."""
    front, best = [], float("-inf")
    for p in sorted(pts, key=lambda p: (p[1], -p[2])):
        if p[2] > best:
            front.append(p)
            best = p[2]
    return front


def pareto_plot(record: dict[str, Any], path: Path) -> bool:
    """Tokens per joule against p99 TPOT, the SLO marked; False where nothing can be drawn."""
    pts = pareto_points(record)
    if not pts:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = record["energy_label"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for met in (True, False):
        sel = [p for p in pts if p[3] == met]
        ax.scatter([p[1] for p in sel], [p[2] for p in sel], marker="o" if met else "x", label="SLO met" if met else "SLO missed")
    front = pareto_front(pts)
    ax.plot([p[1] for p in front], [p[2] for p in front], "--", color="grey", label="Pareto front")
    win = record.get("winner", {}).get("key")
    for key, x, y, _ in pts:
        ax.annotate(key if len(pts) <= 8 else "", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if key == win:
            ax.scatter([x], [y], s=200, facecolors="none", edgecolors="red", label="winner")
    arms = record.get("final", {}).get("arms", {})
    if arms.get("defaults", {}).get("p99_tpot_ms", {}).get("mean") is not None:
        d = arms["defaults"]
        ax.scatter(
            [d["p99_tpot_ms"]["mean"]], [d["output_tokens_per_joule"]["mean"]], marker="s", color="black", label="vLLM defaults (pairs)"
        )
    slo = record["slo"]
    if slo.get("tpot_ms"):
        ax.axvline(slo["tpot_ms"], color="red", linestyle=":", label=f"SLO p99 TPOT {slo['tpot_ms']:g} ms")
    ax.set_xlabel("p99 TPOT, ms (measured)")
    ax.set_ylabel(f"output tokens per joule ({label})")
    ax.set_title("\n".join(textwrap.wrap(f"tune-serving: {record['traffic']['description']}", 90)), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
