"""The record of a search (what ``tune-serving.json`` holds), built from the state and the outcome."""

from __future__ import annotations

from typing import Any

from .report import GPU_NOTE, SIM_NOTE, final_section, mean_ci, window_entry, winner_command
from .run import SearchOutcome, Session, verdict_of
from .space import Config
from .state import Measurement


def configuration_entries(s: Session) -> list[dict[str, Any]]:
    """Every configuration: its settings, flags, each search window, and vLLM's refusal if any."""
    by_key: dict[str, list[Measurement]] = {}
    for m in s.state.measurements.values():
        if m.phase == "search":
            by_key.setdefault(m.key, []).append(m)
    out = []
    for c in s.opts.configs:
        ws = sorted(by_key.get(c.key, []), key=lambda m: m.round or 0)
        entry: dict[str, Any] = {
            "key": c.key,
            "settings": c.as_dict(),
            "serve_flags": c.serve_flags(),
            "plugin_settings": c.plugin_settings() or None,
            "windows": [window_entry(m, verdict_of(m, s.opts.slo)) for m in ws],
            "rounds_reached": max((m.round or 0) for m in ws) + 1 if ws else 0,
        }
        # Windows differ in length (each round doubles it): the interval across them is a spread, shown where there are two or more.
        entry["tok_per_j_over_windows"] = mean_ci([m.figures.output_tokens_per_joule for m in ws])
        if c.key in s.state.rejections:
            entry["refused_by_vllm"] = s.state.rejections[c.key].reason
        out.append(entry)
    return out


def build_record(
    s: Session, outcome: SearchOutcome, winner: Config | None, pairs: list[dict[str, Measurement]], status: str
) -> dict[str, Any]:
    """The whole record; ``status``: done | slo_unmet | stopped."""
    o = s.opts
    gpu = o.plan.gpu
    top = outcome.ranking[0] if outcome.ranking else None
    rec: dict[str, Any] = {
        "kind": "vllm-powersave tune-serving",
        "status": status,
        "energy_label": "measured" if gpu else "simulated",
        "energy_note": GPU_NOTE if gpu else SIM_NOTE,
        "machine": {"gpu": gpu, "simulated_shape": None if gpu else o.plan.sim_shape},
        "model": str(o.plan.model),
        "serve_args": list(o.plan.base_args),
        "traffic": {"description": o.traffic.describe(), **o.traffic.identity()},
        "slo": {"description": o.slo.describe(), **o.slo.identity()},
        "space": {k: v for k, v in o.space.items()},
        "skipped_settings": dict(o.skipped),
        "search": {
            "method": f"successive halving: every configuration for {o.window_s:g} s, then the best 1/{o.eta} for {o.eta}x longer, until one is left",
            "eta": o.eta,
            "rounds": [{"round": r.index, "window_s": r.window_s, "seed": r.seed, "configs": list(r.keys)} for r in outcome.rounds],
            "budget_min": round(o.budget_s / 60.0, 2),
            "pairs_asked": o.pairs,
            "budget_stopped": outcome.budget_stopped,
            "not_measured": outcome.unmeasured,
            "stopped_round": outcome.stopped_round,
            "wall_time_s": round(s.budget.spent_s(), 1),
            "windows_reused_from_state": s.reused,
            "windows_measured_this_run": s.new_steps,
        },
        "configurations": configuration_entries(s),
    }
    if top is not None and winner is not None:
        rec["winner"] = {
            "key": winner.key,
            "slo_met": top.verdict.met,
            "settings": winner.as_dict(),
            "command": winner_command(o.plan, winner),
            "command_note": None if gpu else "measured with the plugin's simulated meter added (no GPU); the line above omits it",
        }
        if not top.verdict.met:
            rec["closest"] = {"key": top.key, "misses": list(top.verdict.misses), "attainment": round(top.verdict.attainment, 4)}
    if pairs:
        rec["final"] = final_section(pairs, lambda m: verdict_of(m, o.slo))
    return rec
