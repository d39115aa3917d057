"""The tune-serving record from ``benchmarks/h200_tune_serving.py`` outputs: per load, the winner
against vLLM's defaults in ABBA pairs, SLO attainment for both, and the tuning wall time.

``python -m benchmarks.h200_tune_serving_record --load rate4=DIR --load c128=DIR [--out-dir docs/results]``
writes ``h200-tune-serving.{json,md,png}`` (the plot: tokens per joule against p99 TPOT per load,
the SLO marked). ``DIR`` is a ``ts-<load>`` directory (``tune-serving.json``, ``calls.json``).
``--keep LOAD`` keeps that load's entry of the record already in ``--out-dir`` as it stands: a load
finished in an earlier session whose state directory (raw data, not in git) is gone. Every
figure keeps the label tune-serving gave it: measured on a GPU, simulated without one (a CPU smoke
run of this builder says so in the record's ``energy`` and title).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_powersave.serving_tune.report import pareto_front, pareto_points

from .lib.cli import one_line_errors
from .lib.device import write_record
from .lib.stats import rounded

NAME = "h200-tune-serving"
#: The twin's hand-written part starts at this heading and survives a rebuild.
KEEP_FROM = "## Reading"
#: The issue's goal per load.
GOAL_RATIO = 1.10
GOAL_MIN = 20.0
#: Final pairs the issue asks for; more extend a finished run to settle a claim.
GOAL_PAIRS = 3
#: How the goal column names each part of the goal a finished search missed (or could not judge).
MISSED = {
    "tok_per_j_ratio_ge_1_10": f"tok/J below x{GOAL_RATIO:.2f}",
    "slo_attainment_not_worse": "SLO attainment worse",
    "tuning_within_20_min": f"tuning over {GOAL_MIN:g} min",
    "three_pairs": "fewer than 3 pairs",
    "on_the_h200": "not on the H200",
}


def device_of(calls: list[dict[str, Any]], fallback: str) -> str:
    """The GPU a load's calls ran on (``calls.json`` names it since calls could land on another kind
    than asked); ``fallback`` for calls that predate the field. A resume across kinds is refused by
    the job, so more than one name here is a hand-assembled directory, said as such."""
    names = sorted({c["gpu"] for c in calls if c.get("gpu")})
    return fallback if not names else names[0] if len(names) == 1 else "mixed: " + ", ".join(names)


def tuning_wall_s(ts: dict[str, Any]) -> float | None:
    """The tuning run's wall time: the search and the issue's 3 pairs. Pairs past the third extend a
    finished run to settle its claim (6 pairs, benchmarks/h200_tune_serving.py --pairs) and are
    not part of tuning."""
    total = (ts.get("search") or {}).get("wall_time_s")
    extra = ((ts.get("final") or {}).get("pair_list") or [])[GOAL_PAIRS:]
    if total is None:
        return None
    return round(total - sum(float((p.get(arm) or {}).get("wall_s") or 0.0) for p in extra for arm in ("winner", "defaults")), 1)


def load_entry(load: str, ts: dict[str, Any], calls: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """One load: the issue's fields from a ``tune-serving.json`` and the device calls it took."""
    final = ts.get("final") or {}
    att = final.get("slo_attainment") or {}
    ratio = final.get("tok_per_j_ratio") or {"mean": None, "ci95": None}
    wall_s = tuning_wall_s(ts)
    w_att, d_att = (att.get("winner") or {}).get("mean"), (att.get("defaults") or {}).get("mean")
    return {
        "load": load,
        "device": device,
        "traffic": ts["traffic"]["description"],
        "slo": ts["slo"]["description"],
        "slo_limits": {k: v for k, v in ts["slo"].items() if k != "description"},
        "status": ts["status"],
        "energy": ts["energy_label"],
        "winner": (ts.get("winner") or {}).get("key"),
        "command": (ts.get("winner") or {}).get("command"),
        "closest_misses": (ts.get("closest") or {}).get("misses"),
        "pairs": final.get("pairs", 0),
        "tok_per_j_ratio": ratio,
        "throughput_ratio": final.get("throughput_ratio"),
        "p99_tpot_ratio": final.get("p99_tpot_ratio"),
        "pair_tok_per_j": [
            {arm: rounded((p.get(arm) or {}).get("output_tokens_per_joule")) for arm in ("winner", "defaults")}
            for p in final.get("pair_list") or []
        ],
        "slo_attainment": {"winner": att.get("winner"), "defaults": att.get("defaults")},
        "tuning_wall_time_s": wall_s,
        "device_calls": len(calls),
        "calls_utc": [c.get("ended_utc") or c.get("started_utc") for c in calls],  # older files named the end time started_utc
        "configurations": len(ts.get("configurations", [])),
        "skipped_settings": ts.get("skipped_settings", {}),
        "search_windows": [
            {
                "key": c["key"],
                "window_s": w.get("window_s"),
                "tok_per_j": rounded(w.get("output_tokens_per_joule")),
                "energy": w.get("energy_label"),
                "output_tok_s": rounded(w.get("output_throughput"), 1),
                "p99_tpot_ms": rounded(w.get("p99_tpot_ms"), 2),
                "p99_ttft_ms": rounded(w.get("p99_ttft_ms"), 1),
                "slo_met": w.get("slo_met"),
            }
            for c in ts.get("configurations", [])
            for w in c.get("windows", [])
        ],
        "goal": {
            "tok_per_j_ratio_ge_1_10": None if ratio.get("mean") is None else ratio["mean"] >= GOAL_RATIO,
            "slo_attainment_not_worse": None if w_att is None or d_att is None else w_att >= d_att,
            "tuning_within_20_min": None if wall_s is None else wall_s <= GOAL_MIN * 60,
            "three_pairs": final.get("pairs", 0) >= GOAL_PAIRS,
            "on_the_h200": "H200" in device,
        },
    }


def _verdict(status: str, goal: dict[str, bool | None]) -> str:
    """The goal column: met, or no with the parts missed, for a finished search; pending for one a
    resume continues (``stopped``); no, with why, for one that ended otherwise (``slo_unmet`` is final)."""
    if status == "done":
        missed = [k for k, v in goal.items() if not v]
        return "yes" if not missed else "no: " + ", ".join(MISSED.get(k, k) for k in missed)
    return "pending (stopped: resume with --resume-from)" if status == "stopped" else f"no ({status})"


def _cell(v: Any) -> str:
    return "n/a" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class PlotPanel:
    """One load's panel: each configuration's latest search window as ``(key, p99 TPOT ms, tok/J, SLO met)``."""

    load: str
    title: str
    points: list[tuple[str, float, float, bool]]
    winner_key: str | None
    slo_tpot_ms: float | None
    energy: str


def panel_of_run(load: str, r: dict[str, Any]) -> PlotPanel:
    """The panel from a ``tune-serving.json``."""
    return PlotPanel(
        load, r["traffic"]["description"], pareto_points(r), (r.get("winner") or {}).get("key"), r["slo"].get("tpot_ms"), r["energy_label"]
    )


def panel_of_entry(e: dict[str, Any]) -> PlotPanel:
    """The panel from a kept record entry: its search windows, the latest per configuration."""
    latest = {w["key"]: w for w in e["search_windows"] if w.get("p99_tpot_ms") is not None and w.get("tok_per_j") is not None}
    pts = [(k, w["p99_tpot_ms"], w["tok_per_j"], bool(w["slo_met"])) for k, w in latest.items()]
    return PlotPanel(e["load"], e["traffic"], pts, e["winner"], (e.get("slo_limits") or {}).get("tpot_ms"), e["energy"])


#: What the twin and the plot read of a kept entry (``slo_limits`` is optional: no SLO line without it).
KEPT_FIELDS = (
    "load", "device", "traffic", "slo", "status", "energy", "winner", "command", "closest_misses", "pairs",
    "tok_per_j_ratio", "slo_attainment", "tuning_wall_time_s", "device_calls", "calls_utc", "search_windows", "goal",
)  # fmt: skip


class KeepError(Exception):
    """A ``--keep`` the record cannot serve; its message is the one line to print."""


def prior_loads(path: Path, keep: list[str]) -> list[dict[str, Any]]:
    """The load entries of the record already at ``path`` (none where there is no record). One that
    cannot be read is rebuilt without (one note), unless a ``--keep`` needs it."""
    if not path.exists():
        return []
    try:
        loads = json.loads(path.read_text())["loads"]
        if not isinstance(loads, list) or not all(isinstance(e, dict) for e in loads):
            raise ValueError("'loads' is not a list of entries")
        return loads
    except (ValueError, KeyError, TypeError) as e:
        if keep:
            raise KeepError(f"--keep {keep[0]}: the record at {path} cannot be read ({type(e).__name__}: {e})") from None
        print(f"note: {path}: the record there cannot be read ({type(e).__name__}); rebuilt from --load alone", file=sys.stderr)
        return []


def kept_entries(path: Path, prior: list[dict[str, Any]], keep: list[str]) -> dict[str, dict[str, Any]]:
    """The ``keep`` loads' entries of the record at ``path`` (``prior``: its loads), each whole."""
    if keep and not path.exists():
        raise KeepError(f"--keep {keep[0]}: no record at {path} to keep it from")
    have = {e.get("load"): e for e in prior}
    for k in keep:
        if k not in have:
            raise KeepError(f"--keep {k}: {path} has no such load (it has: {', '.join(map(str, have)) or 'none'})")
        lacking = [f for f in KEPT_FIELDS if f not in have[k]]
        if lacking:
            raise KeepError(f"--keep {k}: its entry in {path} lacks {lacking[0]!r}: rebuild it with --load {k}=DIR")
    return {k: have[k] for k in keep}


def build(
    loads: dict[str, Path], device: str, kept: dict[str, dict[str, Any]] | None = None, prior_order: list[str] | None = None
) -> tuple[dict[str, Any], list[PlotPanel]]:
    """The record, and a plot panel per load; ``kept`` loads' entries are taken as they stand. Loads
    keep their place in the record before (``prior_order``); new ones follow."""
    kept = kept or {}
    raw = {k: json.loads((d / "tune-serving.json").read_text()) for k, d in loads.items()}
    calls = {k: json.loads((d / "calls.json").read_text()) if (d / "calls.json").exists() else [] for k, d in loads.items()}
    entries = {**{k: load_entry(k, raw[k], calls[k], device_of(calls[k], device)) for k in loads}, **kept}
    given, prior_order = [*loads, *kept], prior_order or []
    order = [k for k in prior_order if k in given] + [k for k in given if k not in prior_order]
    devices = {entries[k]["device"] for k in order}
    labels = sorted({entries[k]["energy"] for k in order})
    rec = {
        "name": NAME,
        "issue": 32,
        "device": next(iter(devices)) if len(devices) == 1 else "per load (see each load)",
        "energy": labels[0] if len(labels) == 1 else "mixed: " + ", ".join(labels),
        "what": "vllm-powersave tune-serving per load: the winner vs vLLM's defaults in ABBA pairs (tok_per_j_ratio = winner / defaults)",
        "loads": [entries[k] for k in order],
    }
    panels = [panel_of_entry(entries[k]) if k in kept else panel_of_run(k, raw[k]) for k in order]
    return rec, panels


def _mci(d: dict[str, Any] | None, fmt: str = ".4f") -> str:
    # As many places as tune-serving.json keeps (4): fewer would round a rounded figure (1.31848
    # kept as 1.3185 would print 1.319, not the interval's 1.318).
    if not d or d.get("mean") is None:
        return "n/a"
    ci = d.get("ci95")
    return f"{d['mean']:{fmt}}" + (f" ({ci[0]:{fmt}}–{ci[1]:{fmt}})" if ci else "")


def markdown(rec: dict[str, Any]) -> str:
    lines = [
        f"# {NAME}: the energy-optimal vLLM configuration under an SLO ({rec['energy']})",
        "",
        f"Device: {rec['device']}. {rec['what']}. Made by `benchmarks/h200_tune_serving.py`; "
        f"goal ≥ ×{GOAL_RATIO:.2f} tokens per joule at equal or better SLO attainment, ≤ {GOAL_MIN:g} min of tuning per load.",
        "",
        "| load | device | SLO | winner | pairs | tok/J ratio (95 % CI) | SLO attainment winner / defaults | tuning wall time | goal met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in rec["loads"]:
        a = e["slo_attainment"]
        verdict = _verdict(e["status"], e["goal"])
        winner = "none" if e["winner"] is None else f"best so far: `{e['winner']}`" if e["status"] == "stopped" else f"`{e['winner']}`"
        wall = "n/a" if e["tuning_wall_time_s"] is None else f"{e['tuning_wall_time_s'] / 60:.1f} min ({e['device_calls']} calls)"
        lines.append(
            f"| {e['traffic']} | {e['device']} | {e['slo']} | {winner} | {e['pairs']} | {_mci(e['tok_per_j_ratio'])} ({e['energy']}) | "
            f"{_mci(a['winner'])} / {_mci(a['defaults'])} | {wall} | {verdict} |"
        )
    lines += [""]
    for e in rec["loads"]:
        lines += [
            f"- {e['load']}: device calls ended (UTC) {', '.join(str(t) for t in e['calls_utc']) or 'n/a'}"
            + (f"; `{e['command']}`" if e["command"] else "; no command yet")
            + (f"; closest misses: {'; '.join(e['closest_misses'])}" if e["closest_misses"] else "")
        ]
    for e in rec["loads"]:
        lines += ["", f"Search windows, {e['load']} (each a fresh server; tokens per joule {e['energy']}):", ""]
        lines += ["| configuration | window s | tok/J | out tok/s | p99 TTFT ms | p99 TPOT ms | SLO |", "|---|---|---|---|---|---|---|"]
        lines += [
            f"| `{w['key']}` | {_cell(w['window_s'])} | {_cell(w['tok_per_j'])} | {_cell(w['output_tok_s'])} | "
            f"{_cell(w['p99_ttft_ms'])} | {_cell(w['p99_tpot_ms'])} | "
            f"{'met' if w['slo_met'] else 'missed'} |"
            for w in e["search_windows"]
        ]
    lines += ["", "Plot: [h200-tune-serving.png](h200-tune-serving.png).", ""]
    return "\n".join(lines)


def plot(panels: list[PlotPanel], path: Path) -> bool:
    """One panel per load: tokens per joule against p99 TPOT, Pareto front, winner, SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, p in zip(axes[0], panels):
        pts = p.points
        ax.scatter([q[1] for q in pts], [q[2] for q in pts], c=["tab:blue" if q[3] else "tab:orange" for q in pts])
        front = pareto_front(pts)
        ax.plot([q[1] for q in front], [q[2] for q in front], "--", color="grey")
        win = [q for q in pts if q[0] == p.winner_key]
        ax.scatter([q[1] for q in win], [q[2] for q in win], s=200, facecolors="none", edgecolors="red", label="winner")
        if p.slo_tpot_ms:
            ax.axvline(p.slo_tpot_ms, color="red", linestyle=":", label=f"SLO p99 TPOT {p.slo_tpot_ms:g} ms")
        ax.set_title(f"{p.load}: {p.title[:60]}", fontsize=8)
        ax.set_xlabel("p99 TPOT, ms (measured)")
        ax.set_ylabel(f"output tokens per joule ({p.energy})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", action="append", default=[], help="LOAD=DIR (a ts-<load> directory), repeatable")
    ap.add_argument("--keep", action="append", default=[], help="LOAD: keep its entry of the record in --out-dir as it stands, repeatable")
    ap.add_argument("--out-dir", default="docs/results")
    ap.add_argument("--device", default="NVIDIA H200", help="the GPU of loads whose calls.json does not name one")
    ns = ap.parse_args(argv)
    bad = [x for x in ns.load if "=" not in x or not x.split("=", 1)[0]]
    if bad:
        ap.error(f"--load {bad[0]!r}: expected LOAD=DIR, e.g. rate4=runs/h200-ts/ts-rate4")
    if not ns.load and not ns.keep:
        ap.error("give at least one --load LOAD=DIR or --keep LOAD")
    loads = {x.split("=", 1)[0]: Path(x.split("=", 1)[1]) for x in ns.load}
    both = sorted(set(loads) & set(ns.keep))
    if both:
        ap.error(f"--keep {both[0]}: also given as --load; keep it or rebuild it, not both")
    out = Path(ns.out_dir)
    path = out / f"{NAME}.json"
    try:
        prior = prior_loads(path, ns.keep)
        kept = kept_entries(path, prior, ns.keep)
    except KeepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rec, panels = build(loads, ns.device, kept, [e.get("load") for e in prior])
    for e in prior:
        if e.get("load") not in loads and e.get("load") not in kept:
            print(f"note: {e.get('load')}: in the record before, neither --load nor --keep now: dropped", file=sys.stderr)
    for e in kept.values():
        if not e.get("slo_limits"):
            print(f"note: {e['load']}: the kept entry has no slo_limits: its panel has no SLO line", file=sys.stderr)
    write_record(out, NAME, rec, markdown(rec), keep_from=KEEP_FROM)
    plot(panels, out / f"{NAME}.png")
    print(f"wrote {out / NAME}.json, .md and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
