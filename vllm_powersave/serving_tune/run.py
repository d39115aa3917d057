"""The driver: successive halving over the configurations, then ABBA pairs of the winner against
vLLM's defaults, each step reused from the state file where an earlier run finished it.

Exit status: 0 done; 2 bad input (one line); 3 stopped before the end (``--stop-after`` or an
interruption: rerun the same command to resume); 4 no configuration met the SLO (the report names
the closest and by how much it misses); 1 a failure while measuring (what was measured is kept).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .measure import MeasureError, Measurer, Refused, ServePlan, stop_leftover_servers, utc_now
from .search import Budget, CostModel, Round, Scored, first_round, next_round, rank, survivors
from .slo import Slo, Verdict, judge
from .space import Config
from .state import STATE_NAME, Figures, Measurement, Rejection, StateError, StateFile
from .traffic import Traffic

EXIT_STOPPED = 3
EXIT_SLO_UNMET = 4


@dataclass(frozen=True)
class TuneServingOptions:
    """Everything a search needs, checked before anything starts."""

    plan: ServePlan
    traffic: Traffic
    slo: Slo
    configs: tuple[Config, ...]
    space: dict[str, list[Any]]
    skipped: dict[str, str]
    window_s: float
    eta: int = 2
    pairs: int = 3
    budget_s: float = 1200.0
    seed: int = 0
    stop_after: int | None = None
    progress: bool = True

    def header(self) -> dict[str, Any]:
        """What makes a rerun the same search (the state file's first line)."""
        return {
            "model": str(self.plan.model),
            "serve_args": list(self.plan.base_args),
            "gpu": self.plan.gpu,
            "sim_shape": None if self.plan.gpu else self.plan.sim_shape,
            "traffic": self.traffic.identity(),
            "slo": self.slo.identity(),
            "configs": [c.key for c in self.configs],
            "window_s": self.window_s,
            "eta": self.eta,
            "seed": self.seed,
            "warmups": self.plan.warmups,
        }


class Stopped(Exception):
    """``--stop-after`` new measurements were taken."""


def verdict_of(m: Measurement, slo: Slo) -> Verdict:
    f = m.figures
    return judge(f.good, f.sent, {"ttft": f.p99_ttft_ms, "tpot": f.p99_tpot_ms, "itl": f.p99_itl_ms}, slo)


def energy_label(source: str | None) -> str:
    return {"measured": "measured", "simulated": "simulated"}.get(str(source), "unknown source")


class Session:
    """One run of a search: its state file, the server, the budget, the progress bar."""

    def __init__(self, opts: TuneServingOptions) -> None:
        self.opts = opts
        self.state = StateFile(opts.plan.out_dir / STATE_NAME, opts.header())
        self.measurer = Measurer(opts.plan, opts.traffic, opts.slo)
        self.cost = CostModel(start_s=120.0 if opts.plan.gpu else 60.0, overhead_s=10.0)
        self.budget = Budget(opts.budget_s)
        self.new_steps = 0
        self.reused = 0
        self.best = ""
        self._bar: Any = None

    def start(self, planned_steps: int) -> int:
        self.state.lock()
        for group in stop_leftover_servers(self.opts.plan.out_dir / "servers"):
            print(f"[tune-serving] stopped vllm serve process group {group}, left running by a killed earlier run", flush=True)
        found = self.state.open()
        self.budget = Budget(self.opts.budget_s, self.state.spent_s())
        for m in self.state.measurements.values():  # a resumed search prices what is left at the starts it saw
            self._learn(m.wall_s / m.runs, m.window_s, m.restarted)
        if self.opts.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=planned_steps, desc="tune-serving", unit="window", file=sys.stderr, disable=not sys.stderr.isatty())
        return found

    def close(self) -> None:
        self.measurer.close()
        self.state.unlock()
        if self._bar is not None:
            self._bar.close()

    def note_best(self, text: str) -> None:
        self.best = text
        if self._bar is not None:
            self._bar.set_postfix_str(f"best so far: {text}"[:100])

    def _tick(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def step_cost_s(self, config: Config, window_s: float) -> float:
        return self.cost.measurement_s(window_s, self.measurer.needs_restart(config))

    def step(self, step_id: str, config: Config, window_s: float, seed: int, **where: Any) -> Measurement | None:
        """The measurement of ``step_id``: from the state file, or measured now (``None``: vLLM refused ``config``)."""
        if step_id in self.state.measurements:
            self.reused += 1
            self._tick()
            return self.state.measurements[step_id]
        if config.key in self.state.rejections:
            return None
        if self.opts.stop_after is not None and self.new_steps >= self.opts.stop_after:
            raise Stopped
        t0 = time.monotonic()
        started = utc_now()
        label = window_label(step_id)
        try:
            figs, restarted, runs = self._measure_with_energy(config, window_s, seed, label)
        except Refused as err:
            rej = Rejection(config.key, str(err), time.monotonic() - t0)
            self.state.add(rej)
            print(f"error: vllm serve refused configuration {config.key}: {err} (skipped; nothing measured is lost)", file=sys.stderr)
            return None
        wall = time.monotonic() - t0
        m = Measurement(step_id, where.pop("phase"), config.key, window_s, seed, figs, wall, restarted, started, **where, runs=runs)
        self.state.add(m)
        self.new_steps += 1
        self._learn(wall / runs, window_s, restarted)  # the cost model is per window
        self._tick()
        self.say(step_line(m, verdict_of(m, self.opts.slo)))
        return m

    def _measure_with_energy(self, config: Config, window_s: float, seed: int, label: str) -> tuple[Figures, bool, int]:
        """One window, and how many times it ran: measured once more when it came back without an
        energy figure although an earlier window of this search had one (a meter read that failed
        at a window's edge on a loaded host), so that no pair loses its ratio to one lost read. A
        meter that never gave a figure is not retried (every window would run twice); a second
        miss is kept as it is, and said."""
        figs, restarted = self.measurer.measure(config, window_s, seed, label)
        meter_works = any(m.figures.output_tokens_per_joule is not None for m in self.state.measurements.values())
        if figs.output_tokens_per_joule is not None or figs.sent == 0 or not meter_works:
            return figs, restarted, 1
        self.say(f"[tune-serving] {label}: no energy figure ({figs.energy_note}); measuring the window again")
        again, restarted_again = self.measurer.measure(config, window_s, seed, label + "-again")
        if again.output_tokens_per_joule is None:
            self.say(f"[tune-serving] {label}: no energy figure again ({again.energy_note}); kept without one")
        return again, restarted or restarted_again, 2

    def say(self, line: str) -> None:
        """A log line on stdout, above the progress bar where there is one."""
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def _learn(self, wall_s: float, window_s: float, restarted: bool) -> None:
        extra = max(0.0, wall_s - window_s)
        if restarted:
            self.cost = CostModel(start_s=max(1.0, extra - self.cost.overhead_s), overhead_s=self.cost.overhead_s)
        else:
            self.cost = CostModel(start_s=self.cost.start_s, overhead_s=extra)


def window_label(step_id: str) -> str:
    """A file-name-safe label of a step, unique per step: a long one is cut to 120 characters and
    ends in a hash of the whole id (cut alone, configurations differing only at the end, e.g.
    ``closed_loop_budget_pct=off`` and ``=1``, shared one file and overwrote each other's)."""
    label = step_id.replace("/", "-").replace("=", "").replace(",", "_").replace(":", "-")
    if len(label) <= 120:
        return label
    return label[:111] + "-" + hashlib.sha1(step_id.encode()).hexdigest()[:8]


def step_line(m: Measurement, v: Verdict) -> str:
    """One log line per finished window, every energy figure labelled."""
    f = m.figures
    where = f"search r{m.round} {m.key}" if m.phase == "search" else f"pair {m.pair} {m.arm}" + ("" if m.key == m.arm else f" ({m.key})")
    tpj = f"{f.output_tokens_per_joule:.4g} tok/J ({energy_label(f.energy_source)})" if f.output_tokens_per_joule else "tok/J n/a"
    lat = f"p99 TTFT {_ms(f.p99_ttft_ms)}, p99 TPOT {_ms(f.p99_tpot_ms)}, p99 ITL {_ms(f.p99_itl_ms)} (measured)"
    slo = "SLO met" if v.met else "SLO missed: " + "; ".join(v.misses)
    tput = f"{f.output_throughput:.1f} tok/s" if f.output_throughput is not None else "tok/s n/a"
    return f"[tune-serving] {where}: {tpj}, {tput}, {lat}, attainment {100 * v.attainment:.1f} % ({slo})" + (
        " [server started]" if m.restarted else ""
    )


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"


@dataclass
class SearchOutcome:
    """What the search found: each configuration's windows, the final ranking, what was not measured."""

    rounds: list[Round] = field(default_factory=list)
    ranking: list[Scored] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)  # the stopped round's configurations it did not measure
    budget_stopped: bool = False
    stopped_round: int | None = None  # the round the budget stopped (its ranking: see :func:`final_ranking`)
    last_window_s: float = 0.0
    needed_s: float = 0.0  # where the budget stopped the search: the next window and the final pairs, estimated


def planned_steps(n: int, eta: int, pairs: int) -> int:
    total, k = n, n
    while k > 1 and (k := survivors(k, eta)) > 1:
        total += k
    return total + 2 * pairs


def run_search(s: Session) -> SearchOutcome:
    """Successive halving; each window from the state file where it was finished before."""
    opts = s.opts
    by_key = {c.key: c for c in opts.configs}
    rnd: Round | None = first_round(list(by_key), opts.window_s, opts.seed)
    out = SearchOutcome()
    latest: dict[str, Scored] = {}
    by_round: dict[int, dict[str, Scored]] = {}
    # Once final pairs are measured the search is over: a resume (more --pairs, a larger
    # --budget-min) does not measure further search windows, which could pick another winner.
    paired = any(m.phase == "final" for m in s.state.measurements.values())
    while rnd is not None:
        out.rounds.append(rnd)
        out.last_window_s = rnd.window_s
        scored = []
        reserve = s.cost.pairs_s(opts.pairs, rnd.window_s)
        for key in rnd.keys:
            step_id = f"search/r{rnd.index}/{key}"
            if step_id not in s.state.measurements and (paired or not s.budget.allows(s.step_cost_s(by_key[key], rnd.window_s), reserve)):
                out.budget_stopped, out.needed_s = True, s.step_cost_s(by_key[key], rnd.window_s) + reserve
                out.stopped_round = rnd.index
                out.unmeasured = [k for k in rnd.keys if f"search/r{rnd.index}/{k}" not in s.state.measurements]
                break
            m = s.step(step_id, by_key[key], rnd.window_s, rnd.seed, phase="search", round=rnd.index)
            if m is not None:
                latest[key] = Scored(key, rnd.index, m.figures.output_tokens_per_joule, verdict_of(m, opts.slo))
                by_round.setdefault(rnd.index, {})[key] = latest[key]
                scored.append(latest[key])
                _note_best(s, list(latest.values()))
        if out.budget_stopped:
            break
        rnd = next_round(rnd, scored, opts.eta)
    out.ranking = final_ranking(out, by_round, latest)
    return out


def final_ranking(out: SearchOutcome, by_round: dict[int, dict[str, Scored]], latest: dict[str, Scored]) -> list[Scored]:
    """The last round's configurations, ranked. A round the budget cut short after round 0 ranks
    them by the round before's windows: one seed (the same requests) and one length for all, where
    their latest windows would set a longer window of other requests against a shorter one (vLLM's
    defaults read 2.05-2.31 tokens per joule over three pairs of other requests and times,
    docs/results/h200-tune-serving.md). A configuration whose window in the cut round missed the
    SLO keeps that verdict: a miss is not undone by an older window."""
    last = out.rounds[-1]
    if out.budget_stopped and last.index > 0:
        prev, cut = by_round.get(last.index - 1, {}), by_round.get(last.index, {})
        ranked = rank([_with_later_miss(prev[k], cut.get(k)) for k in last.keys if k in prev])
        if ranked:
            return ranked
    return rank([latest[k] for k in last.keys if k in latest]) or rank(list(latest.values()))


def _with_later_miss(earlier: Scored, later: Scored | None) -> Scored:
    """``earlier``, with ``later``'s verdict where that window missed the SLO."""
    return earlier if later is None or later.verdict.met else dataclasses.replace(earlier, verdict=later.verdict)


def _note_best(s: Session, scored: list[Scored]) -> None:
    top = rank(scored)[0]
    tpj = f"{top.tok_per_j:.4g} tok/J" if top.tok_per_j else "tok/J n/a"
    label = "" if s.opts.plan.gpu else " (simulated)"
    s.note_best(f"{top.key} {tpj}{label}{'' if top.verdict.met else ', SLO missed'}")


def run_pairs(s: Session, winner: Config, window_s: float) -> list[dict[str, Measurement]]:
    """ABBA pairs of ``winner`` against vLLM's defaults (pair 1 winner first, pair 2 defaults first, ...)."""
    arms = {"winner": winner, "defaults": Config()}
    finals = [m for m in s.state.measurements.values() if m.phase == "final"]
    for m in finals:  # a resume whose search went further (a larger --budget-min) may pick another winner
        if m.key != arms.get(m.arm or "", Config()).key or m.window_s != window_s:
            raise StateError(
                f"{s.state.path}: pair {m.pair} was measured for {m.key} ({m.window_s:g} s windows), the search now "
                f"pairs {arms.get(m.arm or '', Config()).key} ({window_s:g} s): its pairs would mix; use another --out"
            )
    done = {m.pair for m in finals}
    n = s.budget.pairs_that_fit(s.opts.pairs, window_s, s.cost, done=len(done))
    if n < s.opts.pairs:
        s.say(f"[tune-serving] budget: {n} of {s.opts.pairs} final pair(s) fit in what is left (raise --budget-min for more)")
    pairs = []
    for i in range(1, n + 1):
        order = ("winner", "defaults") if i % 2 == 1 else ("defaults", "winner")
        pair: dict[str, Measurement] = {}
        for arm in order:
            m = s.step(f"final/p{i}/{arm}", arms[arm], window_s, s.opts.seed + 1000 + i, phase="final", pair=i, arm=arm)
            if m is None:
                raise MeasureError(f"vllm serve refused the {arm} configuration ({arms[arm].key}) in the final pairs: see servers/")
            pair[arm] = m
        pairs.append(pair)
    return pairs


def finish(s: Session, outcome: SearchOutcome, winner: Config | None, pairs: list[dict[str, Measurement]], status: str) -> dict[str, Any]:
    """Write the report of what is known now (also after a stop: nothing measured is left out)."""
    from .record import build_record
    from .report import write_report

    rec = build_record(s, outcome, winner, pairs, status)
    paths = write_report(s.opts.plan.out_dir, rec)
    print(f"[tune-serving] wrote {', '.join(str(p) for p in paths)}", flush=True)
    return rec


def _terminate_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM/SIGHUP (timeout, a closed terminal, a scheduler): stop the server, keep the state


def execute(opts: TuneServingOptions) -> int:
    """Run (or resume) the search and the final pairs, then write the report; the exit status."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _execute(opts)
    old = {sig: signal.signal(sig, _terminate_as_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _execute(opts)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _execute(opts: TuneServingOptions) -> int:
    s = Session(opts)
    outcome, pairs, winner, status, rc = SearchOutcome(), [], None, "stopped", EXIT_STOPPED
    try:
        if found := s.start(planned_steps(len(opts.configs), opts.eta, opts.pairs)):
            print(f"[tune-serving] resuming: {found} finished step(s) in {s.state.path} are reused, none is measured again", flush=True)
        outcome = run_search(s)
        if not outcome.ranking and outcome.budget_stopped:
            print(
                f"error: --budget-min = {opts.budget_s / 60.0:g}: too small: one {outcome.last_window_s:g} s window and the final "
                f"pairs need about {outcome.needed_s / 60.0:.1f} min (raise --budget-min or lower --window-s/--pairs)",
                file=sys.stderr,
            )
            status, rc = "budget_too_small", 2
        elif not outcome.ranking:
            print("error: vllm serve refused every configuration of the space (reasons in the report)", file=sys.stderr)
            status, rc = "refused", 2
        else:
            top = outcome.ranking[0]
            winner = next(c for c in opts.configs if c.key == top.key)
            if not top.verdict.met:
                status, rc = "slo_unmet", EXIT_SLO_UNMET
                print(
                    f"error: no configuration met the SLO ({opts.slo.describe()}): the closest, {top.key}, misses by "
                    + "; ".join(top.verdict.misses),
                    file=sys.stderr,
                )
            else:
                pairs = run_pairs(s, winner, outcome.last_window_s)
                status, rc = "done", 0
    except Stopped:
        print(
            f"[tune-serving] stopped after {s.new_steps} new measurement(s) (--stop-after): every finished one is in "
            f"{s.state.path}; rerun the same command to resume",
            flush=True,
        )
    except KeyboardInterrupt:
        print(f"[tune-serving] interrupted: every finished measurement is in {s.state.path}; rerun the same command to resume", flush=True)
    except MeasureError as err:
        print(f"error: {err} (every finished measurement is kept in {s.state.path})", file=sys.stderr)
        status, rc = "failed", 1
    finally:
        s.close()
    rec = finish(s, outcome, winner, pairs, status)
    if status == "done":
        f = rec["final"]
        print(
            f"[tune-serving] winner {winner.key if winner else ''}: tokens per joule x{_ratio_text(f['tok_per_j_ratio'])} vs vLLM's defaults "
            f"({rec['energy_label']}, {f['pairs']} pair(s)); SLO attainment {_att(f['slo_attainment']['winner'])} vs {_att(f['slo_attainment']['defaults'])}"
        )
        print(f"[tune-serving] verdict: {f['verdict']}")
        if not str(f["verdict"]).startswith("winner saves"):  # a command line alone reads as advice to switch
            print("[tune-serving] the search's best configuration, not shown to save against vLLM's defaults:")
        print(rec["winner"]["command"])
    return rc


def _ratio_text(d: dict[str, Any]) -> str:
    ci = d.get("ci95")
    # A ratio is positive: a t interval of few pairs that reaches below 0 is shown from 0.
    return "n/a" if d.get("mean") is None else f"{d['mean']:.3f}" + (f" (95 % CI {max(ci[0], 0.0):.3f}–{ci[1]:.3f})" if ci else "")


def _att(d: dict[str, Any]) -> str:
    return "n/a" if d.get("mean") is None else f"{100 * d['mean']:.1f} %"
