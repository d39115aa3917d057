"""The tune-serving record from ``benchmarks/h200_tune_serving.py`` outputs: per load, the winner
against vLLM's defaults in ABBA pairs, SLO attainment for both, and the tuning wall time.

``python -m benchmarks.h200_tune_serving_record --load rate4=DIR --load c128=DIR [--out-dir docs/results]``
writes ``h200-tune-serving.{json,md,png}`` (the plot: tokens per joule against p99 TPOT per load,
the SLO marked). ``DIR`` is a ``ts-<load>`` directory (``tune-serving.json``, ``calls.json``). Every
figure keeps the label tune-serving gave it: measured on a GPU, simulated without one (a CPU smoke
run of this builder says so in the record's ``energy`` and title).
"""

from __future__ import annotations

import argparse
import json
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


def load_entry(load: str, ts: dict[str, Any], calls: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """One load: the issue's fields from a ``tune-serving.json`` and the device calls it took."""
    final = ts.get("final") or {}
    att = final.get("slo_attainment") or {}
    ratio = final.get("tok_per_j_ratio") or {"mean": None, "ci95": None}
    wall_s = (ts.get("search") or {}).get("wall_time_s")
    w_att, d_att = (att.get("winner") or {}).get("mean"), (att.get("defaults") or {}).get("mean")
    return {
        "load": load,
        "device": device,
        "traffic": ts["traffic"]["description"],
        "slo": ts["slo"]["description"],
        "status": ts["status"],
        "energy": ts["energy_label"],
        "winner": (ts.get("winner") or {}).get("key"),
        "command": (ts.get("winner") or {}).get("command"),
        "closest_misses": (ts.get("closest") or {}).get("misses"),
        "pairs": final.get("pairs", 0),
        "tok_per_j_ratio": ratio,
        "throughput_ratio": final.get("throughput_ratio"),
        "p99_tpot_ratio": final.get("p99_tpot_ratio"),
        "slo_attainment": {"winner": att.get("winner"), "defaults": att.get("defaults")},
        "tuning_wall_time_s": wall_s,
        "device_calls": len(calls),
        "calls_utc": [c.get("started_utc") for c in calls],
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
            "three_pairs": final.get("pairs", 0) >= 3,
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


def build(loads: dict[str, Path], device: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The record, and each load's ``tune-serving.json`` (for the plot)."""
    raw = {k: json.loads((d / "tune-serving.json").read_text()) for k, d in loads.items()}
    calls = {k: json.loads((d / "calls.json").read_text()) if (d / "calls.json").exists() else [] for k, d in loads.items()}
    labels = sorted({r["energy_label"] for r in raw.values()})
    devices = {k: device_of(calls[k], device) for k in loads}
    rec = {
        "name": NAME,
        "issue": 32,
        "device": next(iter(set(devices.values()))) if len(set(devices.values())) == 1 else "per load (see each load)",
        "energy": labels[0] if len(labels) == 1 else "mixed: " + ", ".join(labels),
        "what": "vllm-powersave tune-serving per load: the winner vs vLLM's defaults in ABBA pairs (tok_per_j_ratio = winner / defaults)",
        "loads": [load_entry(k, raw[k], calls[k], devices[k]) for k in loads],
    }
    return rec, raw


def _mci(d: dict[str, Any] | None, fmt: str = ".3f") -> str:
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


def plot(raw: dict[str, dict[str, Any]], path: Path) -> bool:
    """One panel per load: tokens per joule against p99 TPOT, Pareto front, winner, SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(raw), figsize=(6 * len(raw), 4.2), squeeze=False)
    for ax, (load, r) in zip(axes[0], raw.items()):
        pts = pareto_points(r)
        ax.scatter([p[1] for p in pts], [p[2] for p in pts], c=["tab:blue" if p[3] else "tab:orange" for p in pts])
        front = pareto_front(pts)
        ax.plot([p[1] for p in front], [p[2] for p in front], "--", color="grey")
        win = [p for p in pts if p[0] == (r.get("winner") or {}).get("key")]
        ax.scatter([p[1] for p in win], [p[2] for p in win], s=200, facecolors="none", edgecolors="red", label="winner")
        if r["slo"].get("tpot_ms"):
            ax.axvline(r["slo"]["tpot_ms"], color="red", linestyle=":", label=f"SLO p99 TPOT {r['slo']['tpot_ms']:g} ms")
        ax.set_title(f"{load}: {r['traffic']['description'][:60]}", fontsize=8)
        ax.set_xlabel("p99 TPOT, ms (measured)")
        ax.set_ylabel(f"output tokens per joule ({r['energy_label']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", action="append", required=True, help="LOAD=DIR (a ts-<load> directory), repeatable")
    ap.add_argument("--out-dir", default="docs/results")
    ap.add_argument("--device", default="NVIDIA H200", help="the GPU of loads whose calls.json does not name one")
    ns = ap.parse_args(argv)
    bad = [x for x in ns.load if "=" not in x or not x.split("=", 1)[0]]
    if bad:
        ap.error(f"--load {bad[0]!r}: expected LOAD=DIR, e.g. rate4=runs/h200-ts/ts-rate4")
    loads = {x.split("=", 1)[0]: Path(x.split("=", 1)[1]) for x in ns.load}
    rec, raw = build(loads, ns.device)
    out = Path(ns.out_dir)
    write_record(out, NAME, rec, markdown(rec), keep_from=KEEP_FROM)
    plot(raw, out / f"{NAME}.png")
    print(f"wrote {out / NAME}.json, .md and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
