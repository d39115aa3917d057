"""Markdown + PNG report of a ``vllm-powersave tune`` run. Every figure says measured or simulated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .profile import group_table
from .solver import DEFAULT


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def _mhz(f: Any) -> str:
    return "default" if f in (None, DEFAULT) else f"{int(f)} MHz"


def write_report(res: Any) -> tuple[Path, Path | None]:
    """Write ``report.md`` and ``report.png`` (PNG skipped with a note if matplotlib is missing)."""
    md = _markdown(res)
    png = _plot(res, res.out_dir / "report.png")
    if png is None:
        md += "\n(report.png not written: matplotlib is not installed)\n"
    p = res.out_dir / "report.md"
    p.write_text(md)
    return p, png


def _markdown(res: Any) -> str:
    gpu = res.device["kind"] == "cuda"
    L = _header(res, gpu)
    if res.profiles:
        L += _profile_section(res, gpu)
    if res.chunk_table is not None:
        L += _chunking_section(res, gpu)
    if res.clock_mode:
        L += _solutions_section(res)
        if res.sweeps:
            L += _sweep_section(res, res.clock_mode[0])
        L += _presets_section(res, gpu)
    if res.preset_path:
        L += ["## Preset file", "", f"`{res.preset_path}`:", "", "```yaml", res.preset_path.read_text().rstrip(), "```", ""]
    if res.notes:
        L += ["## Notes", "", *(f"- {n}" for n in res.notes), ""]
    return "\n".join(L)


def _header(res: Any, gpu: bool) -> list[str]:
    o, dev, ce = res.opts, res.device, res.ceilings
    return [
        f"# vllm-powersave tune: {Path(o.model).name}",
        "",
        f"- Model: `{o.model}`; tensor parallel {o.tp}; device: {dev['name']}"
        + (f" (driver {dev['driver']})" if dev.get("driver") else ""),
        f"- Energy: {'measured (NVML counter)' if gpu else '**simulated** for an H200 (vllm_powersave/sim/gpu.py): this machine has no GPU'}",
        f"- Ceilings: {ce.peak_flops / 1e12:.0f} TFLOP/s bf16, {ce.mem_bw / 1e12:.2f} TB/s, ridge {ce.ridge:.0f} FLOP/B — {ce.source}",
        f"- Slowdown budget: {o.slowdown_pct:g} % ({'strict' if o.slowdown_pct == 0 else 'relaxed'})",
        "",
    ]


def _profile_section(res: Any, gpu: bool) -> list[str]:
    o, ce = res.opts, res.ceilings
    L: list[str] = []
    L += [
        "## Profile (one decoder layer measured x layers, vLLM-equal shapes)",
        "",
        (
            "Times: device time of each group's kernels under torch.profiler on this GPU (measured)."
            if gpu
            else "Time share: **CPU time** of each group under torch.profiler (measured on this CPU; not a GPU figure). "
            "H200 ms: the simulated H200's time for the same FLOPs and bytes (simulated). Bound label: from the simulated H200 ceilings."
        ),
        "FLOPs and bytes from the shapes (bf16). Communication at TP > 1 is modelled (NVLink 450 GB/s), not run.",
        "",
    ]
    for ph, sp in res.profiles.items():
        s = sp.step
        L += [
            f"### {ph}: {s.prompts} prompt(s) x {s.prompt_len} tokens + {s.decodes} decode(s) at context {s.ctx}; "
            f"{s.tokens} tokens, {s.lm_rows} LM-head rows; step {1000 * sp.total_s:.2f} ms "
            f"({'measured' if gpu else 'CPU'}), H200 {1000 * sp.sim_total_s:.3f} ms (simulated)",
            "",
            "| kernel group | time share | ms / step | H200 ms (sim.) | GFLOP | MB | FLOP/B | bound | top kernels / ops |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group_table(sp, ce):
            top = ", ".join(list(r["top_kernels"])[:2]) if r["top_kernels"] else ", ".join(r["ops"][:3])
            L.append(
                f"| {r['group']}{' (modelled)' if r['modelled'] else ''} | {100 * r['share']:.1f} % | {1000 * r['time_s']:.3f} | "
                f"{1000 * r['sim_time_s']:.3f} | {r['flops'] / 1e9:.2f} | {r['bytes'] / 1e6:.1f} | {r['intensity']:.1f} | {r['bound']} | {top[:70]} |"
            )
        if o.tp == 1:
            L.append("| communication | 0 % (TP = 1: none) | | | | | | | |")
        L.append("")
    return L


def _chunking_section(res: Any, gpu: bool) -> list[str]:
    L: list[str] = []
    L += [
        "## LM-head chunking",
        "",
        f"Source: {res.chunk_source}. Rule: `vllm_powersave.chunking.tune.choose_chunks` "
        "(the fastest count not worse in energy; none unless a gain exceeds the measured noise).",
        "",
        f"| rows | kind | chosen | noise | time vs 1 | energy vs 1 | candidates ({'ms' if gpu else 'H200 ms (simulated)'}, J per call) |",
        "|---|---|---|---|---|---|---|",
    ]
    kinds = {p["rows"]: p["kind"] for p in res.chunk_points}
    for rows, c in res.chunk_choice.items():
        cands = "; ".join(f"{k}: {v['ms']:.3f}, {v['j']:.4f}" for k, v in c["candidates"].items())
        L.append(
            f"| {rows} | {kinds.get(rows, '')} | {c['chunks']} | {100 * c['noise']:.1f} % | {c['time_ratio']:.3f} | {c['energy_ratio']:.3f} | {cands} |"
        )
    L += ["", f"Chunk table: `{res.chunk_table or '[] (no chunking)'}`", ""]
    return L


def _solutions_section(res: Any) -> list[str]:
    L: list[str] = []
    mode, why = res.clock_mode
    L += ["## SM clocks", "", f"Mode: **{mode}** ({why}). Source: {res.clock_source}.", ""]
    if mode != "sweep":
        L += [
            "No clock was set: every clock figure below is a **prediction** of the clock-response model "
            "(compute-bound time ∝ 1/f, memory-bound time flat, power from the calibrated DVFS model) — simulated, not measured.",
            "",
        ]
    L += [
        "Per phase: one clock for the whole step (what a phase preset applies); per region: a clock per contiguous region "
        "(attention / MLP per layer, LM head, sampling), globally (only the step total meets the budget) and locally "
        "(each region meets it); per kernel kind: the same, as an offline oracle (kernel kinds interleave within a "
        "layer far faster than a clock switch, so it cannot be applied; seed 000's fine-grained bound).",
        "",
        "| phase | solution | clocks | energy | time |",
        "|---|---|---|---|---|",
    ]
    for ph, sols in res.solutions.items():
        for name in ("single", "global_regions", "local_regions", "global_kinds_oracle"):
            s = sols[name]
            cl = {k: v for k, v in s["clocks_mhz"].items()}
            cls = _mhz(next(iter(cl.values()))) if name == "single" else ", ".join(f"{k} {_mhz(v)}" for k, v in cl.items())
            L.append(f"| {ph} | {name.replace('_', ' ')} (predicted) | {cls} | {_pct(-s['saving'])} | {_pct(s['slowdown'])} |")
    L.append("")
    return L


def _sweep_section(res: Any, mode: str) -> list[str]:
    L: list[str] = []
    L += [
        "### Sweep and re-measurement (guard against outlier-chasing)",
        "",
        f"{'Measured on this GPU' if mode == 'sweep' else 'Simulated: the sweep reads the model with injected noise'}. "
        "Expected = the sweep table's value at the chosen clocks; re-measured = fresh interleaved readings of the choice "
        "against the default. A round that disagrees beyond the tolerance folds its readings into the table and solves again; "
        "a re-measured saving within the tolerance keeps the default.",
        "",
        "| phase | solver | first choice (no guard) | final clocks | expected energy | re-measured energy | expected time | re-measured time | tolerance | rounds | fell back |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ph, d in res.sweeps.items():
        for solver, s in d.items():
            first = ", ".join(sorted({_mhz(v) for v in s.naive.clocks.values()})) if s.naive else ""
            final = (
                ", ".join(f"{k} {_mhz(v)}" for k, v in s.choice.clocks.items())
                if solver == "global"
                else _mhz(next(iter(s.choice.clocks.values())))
            )
            if s.fell_back:  # show what was rejected, not the default's zeros
                r = s.rounds[-1]
                ex = (
                    f"({_pct(-r['expected_saving'])} rejected)",
                    f"({_pct(-r['remeasured_saving'])})",
                    f"({_pct(r['expected_slowdown'])})",
                    f"({_pct(r['remeasured_slowdown'])})",
                )
            else:
                ex = (_pct(-s.expected_saving), _pct(-s.remeasured_saving), _pct(s.expected_slowdown), _pct(s.remeasured_slowdown))
            L.append(
                f"| {ph} | {solver} | {first} ({_pct(-s.naive.saving) if s.naive else ''}) | {final} | {ex[0]} | {ex[1]} | {ex[2]} | {ex[3]} | "
                f"±{100 * s.tolerance:.1f} % (time ±{100 * s.tolerance_time:.1f} %) | {len(s.rounds)} | {'yes' if s.fell_back else 'no'} |"
            )
    L.append("")
    return L


def _presets_section(res: Any, gpu: bool) -> list[str]:
    L: list[str] = []
    L += ["### Presets written", "", "| phase | preset | kernel-group clocks (global solution; durations ms) |", "|---|---|---|"]
    for ph, p in res.presets.items():
        gp = res.group_presets.get(ph, {})
        gps = ", ".join(
            f"{g} {_mhz(d['sm_clock_mhz'])} ({d['duration_ms']:.3f} ms{' sim.' if not gpu else ''})"
            for g, d in gp.items()
            if d.get("duration_ms") is not None
        )
        L.append(f"| {ph} | {_mhz(p.get('sm_clock_mhz'))} | {gps or '–'} |")
    L += [
        "",
        "Kernel-group clocks go into the preset only where this GPU measured the group's duration and it differs from "
        "the phase clock; the controller uses one only if the group lasts `group_min_switch_multiple` x `switch_latency_ms`.",
        "",
    ]
    return L


def _plot(res: Any, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    gpu = res.device["kind"] == "cuda"
    panels = [
        p
        for p in ("profile", "chunks", "clocks")
        if (p == "profile" and res.profiles) or (p == "chunks" and res.chunk_points) or (p == "clocks" and res.solutions)
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "profile":
            phases = list(res.profiles)
            bottom = [0.0] * len(phases)
            for kind in ("gemm", "attention", "elementwise", "lm_head", "sampling", "communication"):
                vals = [res.profiles[ph].kinds[kind].share * 100 for ph in phases]
                if any(vals):
                    ax.bar(phases, vals, bottom=bottom, label=kind)
                    bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_ylabel("time share, %")
            ax.set_title("kernel groups (" + ("measured" if gpu else "CPU time, measured") + ")")
            ax.legend(fontsize=7)
        elif panel == "chunks":
            for c in sorted({p["chunks"] for p in res.chunk_points}):
                xs, ys = [], []
                for rows, ch in res.chunk_choice.items():
                    cand = ch["candidates"].get(c)
                    if cand:
                        xs.append(rows)
                        ys.append(cand["j"] / ch["candidates"][1]["j"])
                ax.plot(xs, ys, marker="o", label=f"{c} chunk(s)")
            ax.set_xscale("log")
            ax.set_xlabel("rows reaching the LM head")
            ax.set_ylabel("energy per call vs 1 chunk")
            ax.set_title("LM-head chunking (" + ("measured" if gpu else "simulated H200") + ")")
            ax.legend(fontsize=7)
        else:
            for ph, sols in res.solutions.items():
                cur = sols["predicted_curve"]
                t0, e0 = cur["time_s"][-1], cur["energy_j"][-1]
                ax.plot([t / t0 for t in cur["time_s"]], [e / e0 for e in cur["energy_j"]], marker=".", ms=3, label=f"{ph} (predicted)")
                s = sols["single"]
                ax.plot([s["time_s"] / s["base_time_s"]], [s["energy_j"] / s["base_energy_j"]], "k*", ms=10)
            for ph, d in res.sweeps.items():
                s = d["single"]
                ax.plot(
                    [1 + s.remeasured_slowdown],
                    [1 - s.remeasured_saving],
                    "rx",
                    ms=9,
                    label=f"{ph} re-measured ({'measured' if res.clock_mode[0] == 'sweep' else 'simulated'})",
                )
            ax.axvline(1 + res.opts.slowdown_pct / 100, color="grey", ls="--", lw=0.8)
            ax.set_xlabel("step time vs default clock")
            ax.set_ylabel("step energy vs default clock")
            ax.set_title("SM clock response per phase (* chosen)")
            ax.legend(fontsize=7)
    fig.suptitle(
        f"vllm-powersave tune: {Path(res.opts.model).name} on {res.device['name']}" + ("" if gpu else " — energy SIMULATED for an H200"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
