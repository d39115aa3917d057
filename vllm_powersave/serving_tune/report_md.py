"""The Markdown twin of ``tune-serving.json``."""

from __future__ import annotations

from typing import Any


def _n(v: Any, fmt: str = ".4g") -> str:
    return "n/a" if v is None else format(v, fmt)


def _mci(d: dict[str, Any] | None, fmt: str = ".3f") -> str:
    if not d or d.get("mean") is None:
        return "n/a"
    ci = d.get("ci95")
    return f"{d['mean']:{fmt}}" + (f" (95 % CI {ci[0]:{fmt}}–{ci[1]:{fmt}})" if ci else " (one value: no interval)")


def _pct(d: dict[str, Any] | None) -> str:
    """An attainment ``{"mean", "ci95"}`` (shares) in per cent, as the tables show it."""
    if not d or d.get("mean") is None:
        return "n/a"
    ci = d.get("ci95")
    return f"{100 * d['mean']:.1f} %" + (f" (95 % CI {100 * ci[0]:.1f}–{100 * ci[1]:.1f} %)" if ci else "")


def _budget_stop(s: dict[str, Any]) -> str:
    if not s["budget_stopped"]:
        return ""
    where = "" if s.get("stopped_round") is None else f" in round {s['stopped_round']}"
    skipped = ", ".join(f"`{k}`" for k in s["not_measured"]) or "none"
    return f" (stopped by the budget{where}; not measured there: {skipped})"


def header_lines(r: dict[str, Any]) -> list[str]:
    s = r["search"]
    lines = [
        "# vllm-powersave tune-serving",
        "",
        f"Status: **{r['status']}**. {r['energy_note']}",
        "",
        f"- Model: `{r['model']}`",
        f"- Traffic: {r['traffic']['description']}",
        f"- SLO: {r['slo']['description']}",
        f"- Search: {s['method']}; budget {s['budget_min']:g} min, wall time {s['wall_time_s']:.0f} s" + _budget_stop(s),
        f"- Windows measured in this run: {s['windows_measured_this_run']}; reused from the state file: {s['windows_reused_from_state']}",
        "- Space: " + ("; ".join(f"`{k}` {v}" for k, v in r["space"].items()) or "(none)"),
    ]
    lines += [f"- Skipped `{k}`: {why}" for k, why in r["skipped_settings"].items()]
    return lines + [""]


def winner_lines(r: dict[str, Any]) -> list[str]:
    w = r.get("winner")
    if not w:
        return ["No configuration was measured.", ""]
    lines = ["## Winner" if w["slo_met"] else "## No configuration met the SLO", ""]
    if not w["slo_met"]:
        c = r["closest"]
        lines += [f"The closest is `{c['key']}`; it misses by: " + "; ".join(c["misses"]) + ".", ""]
    lines += ["```", w["command"], "```", ""]
    if w.get("command_note"):
        lines += [f"({w['command_note']}.)", ""]
    return lines


def final_lines(r: dict[str, Any]) -> list[str]:
    f = r.get("final")
    if not f:
        return []
    label = r["energy_label"]
    a = f["slo_attainment"]
    lines = [
        f"## Winner vs vLLM's defaults: {f['pairs']} pair(s) in ABBA order",
        "",
        f"- tokens per joule, winner / defaults: **{_mci(f['tok_per_j_ratio'])}** ({label}); verdict: **{f.get('verdict', 'n/a')}**",
        f"- output throughput ratio: {_mci(f['throughput_ratio'])} (measured); p99 TPOT ratio: {_mci(f['p99_tpot_ratio'])} (measured)",
        f"- SLO attainment, winner: {_pct(a['winner'])} ({a['winner']['windows_meeting_slo']} of {a['winner']['windows']} windows met the SLO); "
        f"defaults: {_pct(a['defaults'])} ({a['defaults']['windows_meeting_slo']} of {a['defaults']['windows']})",
        "",
        "| pair | arm | tok/J | tok/s | p99 TTFT ms | p99 TPOT ms | p99 ITL ms | attainment | SLO |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(f["pair_list"], start=1):
        for arm in f["order"][i - 1].split(","):
            w = p[arm]
            lines.append(
                f"| {i} | {arm} | {_n(w['output_tokens_per_joule'])} ({w['energy_label']}) | {_n(w['output_throughput'], '.1f')} | "
                f"{_n(w['p99_ttft_ms'], '.1f')} | {_n(w['p99_tpot_ms'], '.1f')} | {_n(w['p99_itl_ms'], '.1f')} | "
                f"{100 * w['attainment']:.1f} % | {'met' if w['slo_met'] else 'missed'} |"
            )
    return lines + [""]


def config_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        "## Every configuration tried",
        "",
        "Each window: tokens per joule (energy as labelled), throughput and latency (measured), SLO attainment with its "
        "95 % Wilson interval over the window's requests.",
        "",
        "| configuration | round | window s | tok/J | tok/s | p99 TTFT ms | p99 TPOT ms | p99 ITL ms | attainment (95 % CI) | SLO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["configurations"]:
        if c.get("refused_by_vllm"):
            lines.append(f"| `{c['key']}` | – | – | refused by vLLM: {c['refused_by_vllm'][:120]} | | | | | | |")
        for w in c["windows"]:
            ci = w["attainment_ci95"]
            att = f"{100 * w['attainment']:.1f} %" + (f" ({100 * ci[0]:.1f}–{100 * ci[1]:.1f})" if ci else "")
            lines.append(
                f"| `{c['key']}` | {w['step'].split('/')[1]} | {w['window_s']:g} | {_n(w['output_tokens_per_joule'])} ({w['energy_label']}) | "
                f"{_n(w['output_throughput'], '.1f')} | {_n(w['p99_ttft_ms'], '.1f')} | {_n(w['p99_tpot_ms'], '.1f')} | "
                f"{_n(w['p99_itl_ms'], '.1f')} | {att} | {'met' if w['slo_met'] else 'missed: ' + '; '.join(w['slo_misses'])} |"
            )
        if not c["windows"] and not c.get("refused_by_vllm"):
            lines.append(f"| `{c['key']}` | – | – | not measured (budget) | | | | | | |")
    return lines + ["", "Pareto plot: `pareto.png` (tokens per joule against p99 TPOT, the SLO marked).", ""]


def markdown(r: dict[str, Any]) -> str:
    return "\n".join(header_lines(r) + winner_lines(r) + final_lines(r) + config_lines(r))
