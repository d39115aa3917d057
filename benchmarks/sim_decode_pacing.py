"""Decode pacing on the SIMULATED H200: tokens per joule, batch and latency against the TPOT target.

Everything reported is **simulated** (a prediction, never a measurement): step time and energy come
from the roofline and power model of ``vllm_powersave/sim/gpu.py`` (qwen2.5-7b shape, stock clocks),
idle time between steps is priced at the model's loaded-idle power, and the scheduler is a small
model of vLLM V1's (running decodes first, then chunked prefills within the token budget, FCFS).
The pacing decision is the product's own :class:`~vllm_powersave.pacing.DecodePacer`, run on the
simulation's clock, with the input queue "non-empty" once a request has arrived.

Loads: open-loop Poisson arrivals at several rates (input uniform 128-1024, output uniform 32-512
tokens, as the rate4 load of ``h200_tune_serving``) and a closed loop at a fixed concurrency (the
case where pacing cannot grow the batch), whose clients send their next request
:data:`CLIENT_RTT_S` after the last one ends; there the pacer's closed-loop guard pauses it, and
``c128-unguarded`` shows the loop with the guard left out. Usage::

    python -m benchmarks.sim_decode_pacing [--duration-s 120] [--sweep-s 120] [--out docs/results]
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.lib.device import utc_now, write_record
from vllm_powersave.pacing import ClosedLoopGuard, DecodePacer, PaceFacts
from vllm_powersave.sim.gpu import H200, ModelCost, simulate_step

SHAPE = "qwen2.5-7b"
BUDGET_TOKENS, MAX_SEQS = 8192, 256
HOST_S = 0.0015  # host time per step outside the GPU (scheduling, sampling): a model figure
TARGETS_MS = (None, 20.0, 35.0)
#: A closed-loop client's round trip from a request's last token to its next request reaching the
#: engine (response, HTTP, tokenization): an assumption of this model, not a measurement.
CLIENT_RTT_S = 0.005


@dataclass(eq=False)  # each request is itself: equal lengths and arrivals must not make two one
class Req:
    arrival_s: float
    prompt: int
    out_target: int
    computed: int = 0
    out: int = 0
    first_token_s: float | None = None
    done_s: float | None = None


@dataclass
class Engine:
    """The simulated engine's clock, queues and energy."""

    pending: list[Req]  # not yet arrived, by arrival time
    closed_loop: int | None = None  # fixed concurrency: a finished request is replaced one round trip later
    client_rtt_s: float = 0.005
    fixed_lengths: tuple[int, int] | None = None  # a closed loop's (input, output) for every request
    think_s: tuple[float, float] | None = None  # a closed-loop client thinks this long (uniform) before its next request
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    now_s: float = 0.0
    energy_j: float = 0.0
    steps: int = 0
    batch_sum: int = 0
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    done: list[Req] = field(default_factory=list)

    def arrive(self) -> None:
        while self.pending and self.pending[0].arrival_s <= self.now_s:
            self.waiting.append(self.pending.pop(0))

    def idle(self, seconds: float) -> None:
        self.energy_j += H200.p_idle_w * seconds
        self.now_s += seconds


def _lengths(rng: random.Random) -> tuple[int, int]:
    return rng.randint(128, 1024), rng.randint(32, 512)


def _step(eng: Engine, cost: ModelCost) -> None:
    """One engine step: decodes first, then prefills within the token budget."""
    budget, decode, prefill_tokens, ctx = BUDGET_TOKENS, [], 0, 0
    for r in eng.running:
        if r.computed >= r.prompt:
            decode.append(r)
            ctx += r.prompt + r.out
    budget -= len(decode)
    prefills: list[tuple[Req, int]] = []
    for r in [r for r in eng.running if r.computed < r.prompt] + list(eng.waiting):
        if budget <= 0 or (r not in eng.running and len(eng.running) >= MAX_SEQS):
            break
        if r not in eng.running:
            eng.waiting.remove(r)
            eng.running.append(r)
        c = min(r.prompt - r.computed, budget)
        prefills.append((r, c))
        budget -= c
        prefill_tokens += c
    finishing = [r for r, c in prefills if r.computed + c >= r.prompt]
    res = simulate_step(H200, cost.step_work(len(decode) + prefill_tokens, len(decode) + len(finishing), ctx), H200.f_max_mhz)
    eng.energy_j += res.energy_j + H200.p_idle_w * HOST_S
    eng.now_s += res.time_s + HOST_S
    eng.steps += 1
    eng.batch_sum += len(decode)
    for r, c in prefills:
        r.computed += c
    for r in decode + finishing:
        r.out += 1
        r.first_token_s = r.first_token_s if r.first_token_s is not None else eng.now_s
    _retire(eng)


def _retire(eng: Engine) -> None:
    for r in [r for r in eng.running if r.out >= r.out_target]:
        eng.running.remove(r)
        r.done_s = eng.now_s
        eng.done.append(r)
        if eng.closed_loop is not None:
            prompt, out = eng.fixed_lengths or _lengths(eng.rng)
            back_s = eng.client_rtt_s + (eng.rng.uniform(*eng.think_s) if eng.think_s else 0.0)
            bisect.insort(eng.pending, Req(eng.now_s + back_s, prompt, out), key=lambda q: q.arrival_s)


class _NoGuard(ClosedLoopGuard):
    """The pacer without its closed-loop guard (the ``-unguarded`` load): judges nothing, checks
    nothing, never pauses."""

    def _judge(self, lag: int, after_finish: bool, woken: bool, now: float) -> None:
        pass

    def _start_check(self, now: float) -> None:
        pass


def simulate(
    load: str,
    rate: float | None,
    concurrency: int | None,
    target_ms: float | None,
    duration_s: float,
    seed: int,
    guard: bool = True,
    client_rtt_s: float = CLIENT_RTT_S,
    fixed_lengths: tuple[int, int] | None = None,
    group: int = 1,
    think_s: tuple[float, float] | None = None,
) -> dict:
    """One load at one pacing target: the figures of the requests that finished. ``fixed_lengths``
    (input, output): every request that long, and open-loop arrivals at exactly ``rate`` per second
    unless ``group`` > 1: groups of that many requests at once, the groups Poisson at ``rate``.
    ``think_s`` (lo, hi): closed-loop clients think a uniform time in it before each next request."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    if concurrency is not None:
        reqs = [Req(0.0, *(fixed_lengths or _lengths(rng))) for _ in range(concurrency)]
    elif group > 1:
        while t < duration_s:
            t += rng.expovariate(rate)
            reqs.extend(Req(t, *(fixed_lengths or _lengths(rng))) for _ in range(group))
    elif fixed_lengths is not None:
        reqs = [Req(i / rate, *fixed_lengths) for i in range(1, int(duration_s * rate) + 1)]
    else:
        while t < duration_s:
            t += rng.expovariate(rate)
            reqs.append(Req(t, *_lengths(rng)))
    eng = Engine(reqs, closed_loop=concurrency, client_rtt_s=client_rtt_s, fixed_lengths=fixed_lengths, think_s=think_s, rng=rng)
    pacer = DecodePacer(target_ms, clock=lambda: eng.now_s, sleep=eng.idle) if target_ms else None
    if pacer is not None and not guard:
        pacer.guard = _NoGuard()
    cost = ModelCost.for_shape(SHAPE)

    first_pause_s = None  # when the guard first paused pacing (s)

    def queue_empty() -> bool:  # vLLM's input queue: empty until the next request has arrived
        return not (eng.pending and eng.pending[0].arrival_s <= eng.now_s)

    while eng.now_s < duration_s:
        # Either intake below may start a pause (an emptied engine's on the idle path): read it at
        # the next loop, at most one step after it began.
        if first_pause_s is None and pacer is not None and pacer.guard.pauses:
            first_pause_s = round(eng.now_s, 1)
        if pacer is not None and not (eng.running or eng.waiting) and eng.pending:
            # vLLM's idle engine: the pacer's hook runs at load 0, then the intake blocks until the
            # next request arrives and takes it in, however long that was.
            pacer.hold(PaceFacts(0, 0, MAX_SEQS, False), queue_empty)
            eng.idle(max(0.0, eng.pending[0].arrival_s - eng.now_s))
            eng.arrive()
            pacer.after_intake(len(eng.running), len(eng.waiting))
            _step(eng, cost)
            continue
        if pacer is None or not (eng.running or eng.waiting):
            eng.arrive()  # a paced engine takes its inputs after the hold, as vLLM's loop does
        if not eng.running and not eng.waiting:
            if not eng.pending:
                break
            eng.idle(max(0.0, eng.pending[0].arrival_s - eng.now_s))
            continue
        if pacer is not None:
            facts = PaceFacts(len(eng.running), len(eng.waiting), MAX_SEQS, any(r.computed < r.prompt for r in eng.running))
            pacer.hold(facts, queue_empty)
            eng.arrive()
            pacer.after_intake(len(eng.running), len(eng.waiting))
        _step(eng, cost)
    row = _figures(load, target_ms, eng)
    if pacer is not None and guard:
        row["closed_loop_pauses"], row["pauses_withdrawn"] = pacer.guard.pauses, pacer.guard.withdrawn
        row["closed_loop_checks"] = pacer.guard.checks
        row["first_pause_s"] = first_pause_s
    return row


def _figures(load: str, target_ms: float | None, eng: Engine) -> dict:
    done = [r for r in eng.done if r.out_target > 1]
    tpot = sorted((r.done_s - r.first_token_s) / (r.out_target - 1) * 1000 for r in done)
    ttft = sorted((r.first_token_s - r.arrival_s) * 1000 for r in eng.done)
    # Tokens generated inside the window, finished requests or not: a paced engine holds more in flight.
    out_tokens = sum(r.out for r in eng.done + eng.running)

    def pct(xs: list[float], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)

    return {
        "load": load,
        "tpot_target_ms": target_ms,
        "requests": len(eng.done),
        "out_tok_per_s": round(out_tokens / eng.now_s, 1),
        "tok_per_j": round(out_tokens / eng.energy_j, 4),
        "avg_power_w": round(eng.energy_j / eng.now_s, 1),
        "mean_decode_batch": round(eng.batch_sum / max(1, eng.steps), 1),
        "tpot_p50_ms": round(statistics.median(tpot), 2),
        "tpot_p99_ms": pct(tpot, 0.99),
        "ttft_p50_ms": round(statistics.median(ttft), 2),
        "ttft_p99_ms": pct(ttft, 0.99),
    }


LOADS = (
    ("rate1", 1.0, None),
    ("rate4", 4.0, None),
    ("rate8", 8.0, None),
    ("c4", None, 4),
    ("c128", None, 128),
    ("c128-rtt20", None, 128),
    ("c128-unguarded", None, 128),
    ("c64-think", None, 64),
    ("const8-fixed", 8.0, None),
)
#: Closed loops whose clients are slower than :data:`CLIENT_RTT_S`: a round trip as long as a
#: 20 ms target's gap, so the next request lands in the loop after the finish.
RTT_OF = {"c128-rtt20": 0.020}
#: Open-loop arrivals at a constant rate with fixed (input, output) lengths, as a benchmark's
#: ``--request-rate`` without Poisson and with ``ignore_eos``: each finish can land at a fixed phase
#: against the next arrival and look like a closed loop to the guard's counts; its pause probe tells.
FIXED_OF = {"const8-fixed": (256, 128)}
#: Closed-loop clients that think a uniform 0.3-2 s before each next request (an assumption, as a
#: chat user's or an agent's): their arrivals show no signature in the holds; a scheduled check finds them.
THINK_OF = {"c64-think": (0.3, 2.0)}


@dataclass(frozen=True)
class GuardSweep:
    """How the closed-loop guard's pauses fared over a sweep of loads (simulated)."""

    configs: int
    paused: int  # configurations with at least one pause
    standing: int  # ... with a pause its probe did not withdraw
    withdrawn_all: int  # ... whose every pause was withdrawn
    pauses: int  # pauses over all configurations
    withdrawn: int  # ... of them withdrawn by their probe
    checks: int  # scheduled checks over all configurations (a check whose arrivals rose, then fell back once paced again, is also a pause)
    first_pause_s: tuple[float, float] | None = None  # earliest and latest first pause over the paused ones


#: The guard sweeps: open-loop arrivals at a constant rate with fixed lengths (which can mimic a
#: closed loop), closed loops, and Poisson arrivals (which must never pause).
SWEEPS = ("fixed_rate_open_loop", "closed_loop", "poisson", "grouped_open_loop", "thinking_closed_loop")


def _sweep_loads(kind: str) -> list[dict]:
    if kind == "closed_loop":
        mixed = [dict(concurrency=c, client_rtt_s=rtt) for c in (4, 16, 64, 128) for rtt in (0.005, 0.01, 0.02, 0.04)]
        # A benchmark's fixed lengths: clients that start together finish together.
        return mixed + [dict(concurrency=c, fixed_lengths=(512, 256)) for c in (4, 16, 64, 128)]
    if kind == "thinking_closed_loop":
        return [dict(concurrency=c, think_s=think) for c in (4, 16, 64, 128) for think in ((0.3, 2.0), (1.0, 5.0))]
    if kind == "poisson":
        return [dict(rate=float(r)) for r in (0.5, 1, 2, 4, 8, 16, 32, 64)]
    if kind == "grouped_open_loop":
        # A benchmark sending requests in groups: equal lengths in a group finish together, as a
        # closed loop's round does, but the next group comes whenever.
        groups = [(4, 0.5), (4, 2.0), (16, 0.25), (16, 1.0), (64, 0.1), (64, 0.25)]
        return [dict(rate=g_per_s, group=n, fixed_lengths=lengths) for n, g_per_s in groups for lengths in ((512, 256), (256, 64))]
    return [dict(rate=float(r), fixed_lengths=(i, o)) for r in (2, 4, 8, 16) for i in (256, 1024) for o in (64, 128, 256)]


def guard_sweep(duration_s: float, seed: int, kind: str) -> GuardSweep:
    """One of :data:`SWEEPS` at 20 and 35 ms: constant 2-16 req/s with fixed lengths (input 256 or
    1,024, output 64-256), closed loops (4-128 clients, 5-40 ms round trips, or 512 / 256 tokens
    each), Poisson 0.5-64 req/s, groups of 4-64 equal requests whose groups come Poisson, or closed
    loops of 4-128 clients that think 0.3-2 s or 1-5 s."""
    paused = standing = withdrawn_all = configs = pauses_n = withdrawn_n = checks_n = 0
    firsts = []
    for load in _sweep_loads(kind):
        for target in (20.0, 35.0):
            kw = {"rate": None, "concurrency": None, **load}
            row = simulate("sweep", kw.pop("rate"), kw.pop("concurrency"), target, duration_s, seed, **kw)
            configs += 1
            pauses, withdrawn = row["closed_loop_pauses"], row["pauses_withdrawn"]
            paused += pauses > 0
            standing += pauses > withdrawn
            withdrawn_all += pauses > 0 and pauses == withdrawn
            pauses_n, withdrawn_n, checks_n = pauses_n + pauses, withdrawn_n + withdrawn, checks_n + row["closed_loop_checks"]
            if row["first_pause_s"] is not None:
                firsts.append(row["first_pause_s"])
    span = (min(firsts), max(firsts)) if firsts else None
    return GuardSweep(configs, paused, standing, withdrawn_all, pauses_n, withdrawn_n, checks_n, span)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write sim-decode-pacing.{json,md} here")
    ap.add_argument("--sweep-s", type=float, default=0.0, help="also sweep the guard over open- and closed-loop loads this long each")
    ns = ap.parse_args(argv)
    sweeps = {}
    if ns.sweep_s > 0:
        for name in SWEEPS:
            sweeps[name] = asdict(guard_sweep(ns.sweep_s, ns.seed, name))
            print(f"[simulated] guard sweep {name}: {sweeps[name]}", flush=True)
    rows = []
    for load, rate, conc in LOADS:
        base = None
        for target in TARGETS_MS:
            guard = not load.endswith("-unguarded")
            row = simulate(
                load,
                rate,
                conc,
                target,
                ns.duration_s,
                ns.seed,
                guard=guard,
                client_rtt_s=RTT_OF.get(load, CLIENT_RTT_S),
                fixed_lengths=FIXED_OF.get(load),
                think_s=THINK_OF.get(load),
            )
            base = base or row
            row["tok_per_j_ratio"] = round(row["tok_per_j"] / base["tok_per_j"], 3)
            row["throughput_ratio"] = round(row["out_tok_per_s"] / base["out_tok_per_s"], 3)
            rows.append(row)
            print(f"[simulated] {load} pacing {target or 'off'}: {row}", flush=True)
    if ns.out is not None:
        rec = {
            "what": "decode pacing on the simulated H200 (qwen2.5-7b shape): tokens per joule, batch, TPOT, TTFT",
            "simulated": True,
            "measured": False,
            "recorded_utc": utc_now(),
            "duration_s": ns.duration_s,
            "seed": ns.seed,
            "rows": rows,
            "guard_sweeps": {"duration_s": ns.sweep_s, **sweeps} if sweeps else None,
            "scripts": ["benchmarks/sim_decode_pacing.py"],
        }
        write_record(ns.out, "sim-decode-pacing", rec, _markdown(rows, ns) + _sweep_markdown(sweeps, ns))
    return 0


def _markdown(rows: list[dict], ns: argparse.Namespace) -> str:
    head = (
        "# sim-decode-pacing: decode pacing on the simulated H200 (simulated, predicted)\n\n"
        f"Made by `python -m benchmarks.sim_decode_pacing --duration-s {ns.duration_s:g} --seed {ns.seed}` on "
        f"{utc_now()[:10]}, on the CPU: every figure is **simulated** (sim/gpu.py's model of an H200, qwen2.5-7b "
        "shape, stock clocks; idle between steps at the model's 122 W). Input uniform 128-1024, output uniform "
        "32-512 tokens; rateN: Poisson arrivals at N req/s (open loop); c4, c128: 4 and 128 clients in a closed loop; "
        "const8-fixed: open-loop arrivals at exactly 8 req/s, 256 tokens in and 128 out each. "
        "c64-think: 64 clients that think 0.3-2 s before each next request. "
        "Ratios against pacing off on the same requests; pauses: the closed-loop guard's, how many of them "
        "its probe withdrew, and its scheduled checks.\n\n"
        "| load | TPOT target ms | tok/J | ratio | out tok/s | ratio | mean decode batch | TPOT p50 / p99 ms | TTFT p50 / p99 ms | pauses (withdrawn), checks |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['load']} | {r['tpot_target_ms'] or 'off'} | {r['tok_per_j']} | x{r['tok_per_j_ratio']} | {r['out_tok_per_s']} | "
        f"x{r['throughput_ratio']} | {r['mean_decode_batch']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} | "
        f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {_pauses(r)} |\n"
        for r in rows
    )
    reading = (
        "\nReading (simulated): under open-loop arrivals the decode batch grows with the period (Little's law) "
        "while each step's energy hardly does, so tokens per joule rise with the target; the tokens per second "
        "stay the arrival rate's (the 1-2 % short is the larger backlog still in flight when the window ends). "
        "In the closed loop the batch is the concurrency whatever the period: gaps cost throughput and add idle "
        "energy, so pacing loses (c128-unguarded); the pacer's closed-loop guard sees arrivals follow finished "
        f"requests (clients {CLIENT_RTT_S * 1e3:g} ms behind, an assumption; c128-rtt20: 20 ms, as long as a 20 ms "
        "target's gap, caught in the next loop's intake) and pauses it (c128); 4 clients finish a request every "
        "~2.4 s when paced at 35 ms; the guard pauses after 4 finishes that all saw an arrival (7-13 s), and c4 "
        "loses throughput only while paced before each pause (x0.90 at 35 ms over 300 s, against x0.80 when the "
        "guard waited for 8 finishes and x0.41 for 32). With 128 clients 20 ms behind, open-loop verdicts from "
        "all three counts a few seconds after a pause ran out can start the next pause from 30 s again "
        "(c128-rtt20 at 35 ms: 7 pauses, x0.947; x0.91-0.955 over seeds 1-4, against x0.935-0.966 with "
        "8 finishes). Closed loops with a benchmark's fixed 512 / 256 tokens (the sweep's last 8 configurations) "
        "finish together, each round one case (a finish that empties the engine, the next request back within "
        "a period): 4 and 16 clients paused after 21-37 s (x0.71-0.82 throughput over 300 s; never before that "
        "case was counted), 64 and 128 after 18-31 s. Their requests come back in rounds (a round every 10 s at "
        "35 ms with 128 clients, spread over 1.5 s by chunked prefill), so the probe reads rates from round start "
        "to round start and keeps every pause: x0.86 and x0.84 throughput at 35 ms with 64 and 128 clients "
        "(x0.785 and x0.60 when it read the last 5 s, which held part of one round: 2 of 5 and 12 of 14 pauses "
        "withdrawn). Open-loop requests sent in groups of 4-64 equal requests never paused (the grouped sweep). "
        "Constant-rate arrivals with fixed "
        "lengths (const8-fixed) put each finish at a fixed phase before an arrival and mimic that signature; "
        "the pause's probe sees their rate unchanged while unpaced and withdraws it after 3 s (the guard before "
        "its probe, commit 6de913b, kept 7 pauses there: x1.21 tokens per joule at 35 ms). The measured figures "
        "are in results/h100-decode-pacing.md and results/h200-decode-pacing.md. "
        "Clients that think before their next request (c64-think, the thinking sweep) show no signature in "
        "the holds; a scheduled check after 60 s of pacing lifts it, sees their arrivals rise, paces again and "
        "sees them fall back, and becomes a pause: over the sweep's 16 configurations x0.496-0.856 throughput, "
        "median x0.753 (x0.245-0.647, median x0.427, without checks). A light load's paced window widens to 40 or "
        "60 s until it holds 24 arrivals, and a short idle spell ends a check only where arrivals did not rise: "
        "4 clients that think 0.3-2 s kept x0.787 throughput and x0.958 tokens per joule over 1800 s at 35 ms "
        "(x0.464 and x0.841 with a 20 s window that an idle spell ended). 64 clients over 1800 s: x0.917 "
        "throughput and x0.986 tokens per joule (x0.324 and x0.757 without checks). Open-loop traffic pays for "
        "each check with a few seconds unpaced and the batch regrowing: over these 300 s windows rate1-rate8 read "
        "x1.885-2.201 at 35 ms (x2.005-2.324 without checks); over 1800 s rate0.5, rate1 and rate4 read x1.719, "
        "x2.115 and x2.284 (x2.192 and x2.351 for rate1 and rate4 without checks; rate0.5 x1.746 with the 20 s "
        "window).\n"
    )
    return head + body + reading


def _sweep_markdown(sweeps: dict, ns: argparse.Namespace) -> str:
    if not sweeps:
        return ""
    what = {
        "fixed_rate_open_loop": "open loop at a constant 2-16 req/s, fixed lengths (input 256 or 1,024, output 64-256)",
        "closed_loop": "closed loops of 4-128 clients, round trips 5-40 ms; and 512 / 256 tokens each, 5 ms",
        "poisson": "open loop, Poisson arrivals at 0.5-64 req/s (input 128-1024, output 32-512)",
        "grouped_open_loop": "open loop in groups of 4-64 equal requests (512 / 256 or 256 / 64), groups Poisson at 0.1-2 per s",
        "thinking_closed_loop": "closed loops of 4-128 clients that think 0.3-2 s or 1-5 s (uniform) before each next request",
    }

    def first(v: dict) -> str:
        span = v.get("first_pause_s")
        return f"{span[0]:g}-{span[1]:g}" if span else "-"

    lines = "".join(
        f"| {what[k]} | {v['configs']} | {v['paused']} | {v['standing']} | {v['withdrawn_all']} | {v['pauses']} ({v['withdrawn']}) | {v['checks']} | {first(v)} |\n"
        for k, v in sweeps.items()
    )
    return (
        f"\nGuard sweeps (simulated, `--sweep-s {ns.sweep_s:g}`, targets 20 and 35 ms): configurations, how many "
        "paused, how many kept a pause standing, how many had every pause withdrawn by its probe, all pauses (withdrawn), "
        "scheduled checks (a check whose arrivals rose, then fell back once paced again, is a pause too), and the earliest and latest first pause (s into "
        "the load).\n\n"
        "| loads | configurations | paused | a pause stood | all withdrawn | pauses (withdrawn) | checks | first pause s |\n"
        "|---|---|---|---|---|---|---|---|\n" + lines
    )


def _pauses(row: dict) -> str:
    if "closed_loop_pauses" not in row:
        return "-"
    return f"{row['closed_loop_pauses']} ({row['pauses_withdrawn']}), {row.get('closed_loop_checks', 0)} checks"


if __name__ == "__main__":
    raise SystemExit(main())
