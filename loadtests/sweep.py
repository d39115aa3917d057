"""Rate and concurrency sweeps: one full run per level, one combined result and report."""

from __future__ import annotations

from typing import Any, Literal

from .config import BenchConfig
from .report import compare_table
from .runner import run

SweepParam = Literal["request_rate", "max_concurrency"]


def level_configs(cfg: BenchConfig, parameter: SweepParam, levels: list[Any]) -> list[BenchConfig]:
    """One validated config per level (raises ConfigError naming the bad level); same seed for all,
    so every level sends the same prompts."""
    base = cfg.model_dump(exclude_unset=True)
    out = []
    for v in levels:
        label = (
            f"{cfg.label + ' ' if cfg.label else ''}{parameter}={v:g}"
            if isinstance(v, float)
            else f"{cfg.label + ' ' if cfg.label else ''}{parameter}={v}"
        )
        out.append(BenchConfig.model_validate({**base, parameter: v, "label": label}))
    return out


def run_sweep(cfg: BenchConfig, parameter: SweepParam, levels: list[Any]) -> dict[str, Any]:
    """Run every level in order; returns ``{"sweep": {...}, "results": [result per level]}``.

    Levels are validated before the first run starts, so a bad level never leaves a half sweep.
    """
    if not levels:
        raise ValueError("a sweep needs at least one level")
    cfgs = level_configs(cfg, parameter, levels)
    results = [run(c) for c in cfgs]
    sources = {r.get("energy_source") for r in results}
    return {
        "sweep": {"parameter": parameter, "levels": levels},
        "label": cfg.label,
        "energy_source": "simulated" if "simulated" in sources else ("measured" if sources == {"measured"} else None),
        "results": results,
    }


def format_sweep(sweep: dict[str, Any]) -> str:
    """Markdown: one column per level (throughput, latency, energy, steady state)."""
    p = sweep["sweep"]["parameter"]
    table = compare_table({str(r.get("label")): r for r in sweep["results"]})
    head = f"## Sweep over {p}: {', '.join(str(v) for v in sweep['sweep']['levels'])}\n\n"
    return head + table
