"""PNG plots (matplotlib, Agg): sweep curves and power / SM-clock timelines with phase shading.

Every energy or power axis names its source (``measured`` / ``simulated``); simulated figures are
never drawn without the word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PHASE_COLORS = {"prefill": "#f4a582", "decode": "#92c5de", "mixed": "#c2a5cf", "idle": "#e0e0e0"}


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _src(results: list[dict[str, Any]], key: str = "energy_source") -> str:
    srcs = sorted({str(r.get(key)) for r in results if r.get(key)})
    return ", ".join(srcs) if srcs else "no energy source"


def plot_sweep(results: list[dict[str, Any]], parameter: str, levels: list[Any], out_dir: str | Path) -> list[Path]:
    """Latency-throughput and tokens/J-throughput curves of a sweep; returns the files written.

    x is the output token throughput (tok/s) of each level; y is TTFT and TPOT (median and p99, ms)
    in the first figure, output tokens per joule (whole run and steady state) in the second.
    Returns [] when matplotlib is missing.
    """
    plt = _plt()
    if plt is None:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    x = [r.get("output_throughput") or 0.0 for r in results]
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name, title in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        ax.plot(x, [r.get(f"median_{name}_ms") for r in results], "o-", label="median")
        ax.plot(x, [r.get(f"p99_{name}_ms") for r in results], "s--", label="p99")
        for xi, r, lv in zip(x, results, levels):
            ax.annotate(
                f"{lv:g}" if isinstance(lv, float) else str(lv),
                (xi, r.get(f"median_{name}_ms") or 0),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs throughput ({parameter} sweep)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    p = out / "sweep-latency-throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r.get("output_tokens_per_joule") for r in results], "o-", label="whole run")
    ss = [r.get("steady_state_output_tokens_per_joule") for r in results]
    if any(v is not None for v in ss):
        ax.plot([r.get("steady_state_output_throughput") for r in results], ss, "s--", label="steady state")
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel(f"output tokens / J ({_src(results)})")
    ax.set_title(f"tokens per joule vs throughput\n({parameter} sweep; energy {_src(results)})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = out / "sweep-tokens-per-joule.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    return written


def _shade(ax: Any, t: list[float], phases: list[str | None]) -> set[str]:
    """Shade each sample interval by its dominant phase; returns the phases drawn."""
    seen: set[str] = set()
    for k in range(1, len(t)):
        ph = phases[k]
        if ph is None:
            continue
        ax.axvspan(t[k - 1], t[k], color=PHASE_COLORS.get(ph, "#ffffbf"), alpha=0.6, lw=0, label=ph if ph not in seen else None)
        seen.add(ph)
    return seen


def plot_timeline(result: dict[str, Any], path: str | Path) -> bool:
    """Power (W) and SM clock (MHz) over the run per energy source, intervals shaded by phase.

    Power is the counter's average over each sample interval (and the published power gauge when
    there is one). Returns False when there is nothing to draw or matplotlib is missing.
    """
    plt = _plt()
    series = [s for s in (result.get("timeline") or {}).get("series", []) if len(s.get("t_s", [])) >= 2]
    if plt is None or not series:
        return False
    fig, axes = plt.subplots(2 * len(series), 1, figsize=(10, 4.5 * len(series)), sharex=True, squeeze=False)
    for i, s in enumerate(series):
        t = s["t_s"]
        ax_p, ax_c = axes[2 * i][0], axes[2 * i + 1][0]
        src = s.get("energy_source") or "no energy source"
        _shade(ax_p, t, s.get("phase") or [])
        ax_p.step(t, s["avg_power_w"], where="pre", color="k", label=f"avg power per interval ({src})")
        if any(v is not None for v in s.get("power_w", [])):
            ax_p.plot(t, s["power_w"], ".", color="tab:red", ms=3, label=f"power gauge ({s.get('gauge_source')})")
        ax_p.set_ylabel("power (W)")
        ax_p.set_title(f"{s['name']}: power ({src})")
        ax_p.legend(fontsize=7, loc="upper right")
        ax_p.grid(alpha=0.3)
        _shade(ax_c, t, s.get("phase") or [])
        if any(v is not None for v in s.get("sm_clock_mhz", [])):
            ax_c.step(t, s["sm_clock_mhz"], where="post", color="tab:blue", label=f"SM clock ({s.get('gauge_source')})")
            ax_c.legend(fontsize=7, loc="upper right")
        else:
            ax_c.text(0.5, 0.5, "no SM clock published", transform=ax_c.transAxes, ha="center")
        ax_c.set_ylabel("SM clock (MHz)")
        ax_c.grid(alpha=0.3)
    axes[-1][0].set_xlabel("time since load start (s)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
