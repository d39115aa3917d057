"""``vllm-powersave advise``: a run's figures turned into ranked, concrete recommendations.

Input: a loadtests result JSON (``python -m loadtests ... --out``, or ``vllm-powersave compare``'s
``result-*.json``; any other JSON is refused) and/or the server's ``/metrics`` (a URL or a saved scrape). Each recommendation
carries the figure behind it and two labels: ``evidence`` (``measured`` or ``simulated``: where the
figure comes from) and ``effect`` (``measured``: the change itself was measured, on the GPU named;
``predicted``: an estimate from the figure). Ranked by expected energy saving, largest first;
recommendations without an estimate come last.

Rules (the figures they rest on):

* **API servers**: GPU energy while the engine idled with requests in flight at the server
  (front-end starvation, ``starvation.py``). Fixing it saves at most that energy (predicted); on
  the H200, 1 -> 4 API servers at concurrency 64 gave -8.6 % J/token and +54 % throughput.
* **Perf boost**: idle energy of a server that keeps CUDA's boost (``cuda_perf_boost: on``):
  ``auto`` cuts idle power by 35 % (119.6 -> 77.4 W, medians) (measured on the H200, docs/results/h200-perf-boost.md), so it
  would save 35 % of that idle energy here (predicted). Never for a server that ran auto or off;
  conditional, without an estimate, where neither /metrics nor the result says which it ran.
* **Perf boost on**: a server that ran ``auto`` and spent under 1 % of its energy idle: ``on``
  gained ~0.7 % tokens per joule over ``auto`` at 8 req/s on an H100 (GPU busy ~99 %; measured,
  docs/results/h200-under-load.md), and auto's idle saving has nothing to save there (predicted).
* **Batch limit**: most of the run at the batch limit (steady state) with requests waiting:
  raise ``--max-num-seqs`` (no estimate: depends on memory and model).
* **Decode pacing**: an open-loop run (a request rate, no concurrency cap) that spent most of its
  energy in decode with nothing waiting, and pacing off: try ``decode_pacing.tpot_target_ms`` below
  the TPOT SLO (measured x1.37 tokens per joule at 4 req/s on an H100 over 6 pairs,
  docs/results/h100-decode-pacing.md; x1.48 and x1.51 on the H200, one pair and one search window;
  x1.7-2.2 at 1-8 req/s over 300 s on the simulated H200;
  no estimate for this run: it depends on the batch it reaches).
* **Clocks**: clock decisions recorded but not applied (dry-run): give the server clock permission
  or a zeusd; the saving is the controller's prediction where one is published.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .savings import PERF_BOOST_IDLE_SAVING, PERF_BOOST_ON_BUSY_GAIN, PERF_BOOST_ON_MAX_IDLE_SHARE
from .starvation import suggested_api_servers

#: Below these shares of the run's energy a finding is not worth a recommendation.
MIN_STARVATION_SHARE = 0.02
MIN_IDLE_SHARE = 0.03
MIN_STEADY_SHARE = 0.5
#: Decode pacing is worth trying where decode took at least this share of the run's energy.
MIN_DECODE_SHARE = 0.5


#: A run's own load-generator check (loadtests): it belongs to the result it was made in.
LAG_KEYS = ("client_loop_lag_p99_ms", "client_loop_lag_max_ms")
CLIENT_KEYS = ("client_bottleneck", *LAG_KEYS, "client_cpu_contended")
#: Every loadtests result has these (loadtests/runner.py); a file with neither is something else
#: (a comparison.json, a settings file) and its figures would be read as absent, not refused.
RESULT_KEYS = ("completed", "output_throughput")
#: Where a result may carry the server's powersave_info labels (the perf-boost mode).
INFO_KEYS = ("powersave_info", "server_info")
BOOST_MODES = ("on", "off", "auto")
#: A GPU whose worker has not published yet ("pending", metrics.py) or an engine without the label.
UNKNOWN_MODES = ("pending", "")
#: Result fields that are joules or seconds: a finite number >= 0 where present.
NONNEGATIVE_KEYS = (
    "gpu_energy_j",
    "gpu_idle_energy_j",
    "gpu_idle_while_busy_energy_j",
    "gpu_idle_while_busy_s",
    "frontend_busy_s",
    "duration",
    "steady_state_duration_s",
)


class AdviseError(ValueError):
    """Unusable input; ``str(err)`` is one line naming the input and why."""


@dataclass
class Recommendation:
    key: str
    action: str
    measurement: str
    evidence: str  # "measured" | "simulated"
    effect: str  # "measured" | "predicted"
    saving_share: float | None  # expected energy saving, share of the run's energy (None: no estimate)

    def line(self, rank: int) -> str:
        est = (
            f"expected up to {100 * self.saving_share:.1f} % less energy ({self.effect})"
            if self.saving_share is not None
            else f"no energy estimate ({self.effect})"
        )
        return f"{rank}. {self.action}  [{est}]\n   {self.evidence}: {self.measurement}"


def load_result(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise AdviseError(f"--result = {path!r}: {'a directory, not a file' if p.is_dir() else 'file not found'}")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise AdviseError(f"--result = {path!r}: not JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(data, dict):
        raise AdviseError(f"--result = {path!r}: not a loadtests result (top level is {type(data).__name__})")
    if not any(k in data for k in RESULT_KEYS):
        raise AdviseError(f"--result = {path!r}: not a loadtests result (no {RESULT_KEYS[0]!r} or {RESULT_KEYS[1]!r} key)")
    _check_server_fields(path, data)
    # The load generator's own check decides which fix comes first: a flag that is not a JSON
    # boolean (a "true" string) must not quietly read as a client that kept up.
    v = data.get("client_bottleneck")
    if v is not None and not isinstance(v, bool):
        raise AdviseError(f"--result = {path!r}: client_bottleneck = {v!r}: not true/false")
    v = data.get("energy_by_phase_j")
    if v is not None and not isinstance(v, dict):
        raise AdviseError(f"--result = {path!r}: energy_by_phase_j = {str(v)[:60]!r}: not an object of joules by phase")
    _check_amounts(path, data)
    return data


def _check_amounts(path: str, data: dict[str, Any]) -> None:
    """Joules, seconds and the client's lag must be finite and >= 0, and no part of the energy above the whole:
    a share over 100 % would rank a fix by a saving no run can have."""
    amounts = {k: data.get(k) for k in (*LAG_KEYS, *NONNEGATIVE_KEYS)}
    amounts.update({f"energy_by_phase_j.{ph}": v for ph, v in (data.get("energy_by_phase_j") or {}).items()})
    for k, v in amounts.items():
        if v is not None and (_num(v) is None or v < 0):
            raise AdviseError(f"--result = {path!r}: {k} = {v!r}: not a number >= 0")
    total = data.get("gpu_energy_j")
    idle = (data.get("energy_by_phase_j") or {}).get("idle", data.get("gpu_idle_energy_j"))
    for k, v in (("idle energy", idle), ("gpu_idle_while_busy_energy_j", data.get("gpu_idle_while_busy_energy_j"))):
        if total is not None and v is not None and v > 1.01 * total:
            raise AdviseError(f"--result = {path!r}: {k} = {v!r}: more than gpu_energy_j = {total!r}")


def result_perf_boost(data: dict[str, Any]) -> tuple[str, Any] | None:
    """(field, value) of the perf-boost mode a result carries: ``cuda_perf_boost`` at the top or
    in its server's ``powersave_info`` / ``server_info`` labels; None when it carries none."""
    if data.get("cuda_perf_boost") is not None:
        return "cuda_perf_boost", data["cuda_perf_boost"]
    for k in INFO_KEYS:
        info = data.get(k)
        if isinstance(info, dict) and info.get("cuda_perf_boost") is not None:
            return f"{k}.cuda_perf_boost", info["cuda_perf_boost"]
    return None


def _check_server_fields(path: str, data: dict[str, Any]) -> None:
    """The server facts a result may carry must read as what they claim, or the file is refused."""
    boost = result_perf_boost(data)
    # One value per GPU, joined by commas as powersave_info's label is (metrics.py); "pending" =
    # no worker had published yet.
    if boost is not None:
        field, v = boost
        modes = set(v.split(",")) if isinstance(v, str) else {None}
        if not modes <= {*BOOST_MODES, *UNKNOWN_MODES}:
            raise AdviseError(f"--result = {path!r}: {field} = {v!r}: not on, off or auto")
    n = data.get("api_server_count")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise AdviseError(f"--result = {path!r}: api_server_count = {n!r}: not an integer >= 1")


def load_metrics(source: str, timeout_s: float = 10.0) -> str:
    """The exposition text of a ``/metrics`` URL or a saved scrape file."""
    if source.startswith(("http://", "https://")):
        url = source if source.rstrip("/").endswith("/metrics") else source.rstrip("/") + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - the operator's own server
                return resp.read().decode("utf-8", "replace")
        except Exception as exc:
            raise AdviseError(f"--metrics = {source!r}: cannot scrape {url} ({type(exc).__name__}: {exc})") from None
    p = Path(source)
    if not p.is_file():
        raise AdviseError(f"--metrics = {source!r}: neither a http(s) URL nor a file")
    return p.read_text(errors="replace")


def facts_from_metrics(text: str, source: str = "") -> dict[str, Any]:
    """The figures advise uses from a /metrics text (sums over GPUs); ``source``: where it came from,
    for the error line."""
    from prometheus_client.parser import text_string_to_metric_families

    f: dict[str, Any] = {"energy_by_phase_j": {}}
    sources: set[str] = set()
    modes: set[str] = set()
    try:
        fams = list(text_string_to_metric_families(text))
    except Exception as exc:
        raise AdviseError(f"--metrics = {source!r}: not Prometheus text ({type(exc).__name__})") from None
    for fam in fams:
        for s in fam.samples:
            n, lab, v = s.name, s.labels, float(s.value)
            if n == "powersave_gpu_energy_joules_total":
                ph = lab.get("phase", "?")
                f["energy_by_phase_j"][ph] = f["energy_by_phase_j"].get(ph, 0.0) + v
                sources.add(lab.get("source", ""))
            elif n == "powersave_idle_while_busy_energy_joules_total":
                f["idle_while_busy_j"] = f.get("idle_while_busy_j", 0.0) + v
            elif n == "powersave_idle_while_busy_seconds_total":
                f["idle_while_busy_s"] = f.get("idle_while_busy_s", 0.0) + v
            elif n == "powersave_frontend_busy_seconds_total":
                f["frontend_busy_s"] = max(f.get("frontend_busy_s", 0.0), v)  # the same busy time seen per GPU
            elif n == "powersave_steady_seconds_total":
                f["steady_s"] = max(f.get("steady_s", 0.0), v)
            elif n == "powersave_clock_changes_total":
                f["clock_changes"] = f.get("clock_changes", 0.0) + v
            elif n == "powersave_closed_loop_decisions_total":
                f["closed_loop_decisions"] = f.get("closed_loop_decisions", 0.0) + v
            elif n == "powersave_info":  # one line per engine
                modes.add(lab.get("cuda_perf_boost", ""))  # "": an engine without the label (unknown)
                f["clock_backend"] = lab.get("clock_backend")
            elif n == "powersave_saving_state":
                f.setdefault("savings", {})[lab.get("saving", "?")] = lab.get("state")
            elif n == "vllm:num_requests_waiting":
                f["waiting"] = f.get("waiting", 0.0) + v
    if modes:  # every engine's mode, joined as the harness joins them (loadtests.energy.join_info)
        f["cuda_perf_boost"] = ",".join(sorted(modes))
    if f["energy_by_phase_j"]:
        f["energy_j"] = sum(f["energy_by_phase_j"].values())
        f["time_s"] = None
        f["energy_source"] = "measured" if sources == {"measured"} else "simulated"
    return f


def facts_from_result(r: dict[str, Any]) -> dict[str, Any]:
    f: dict[str, Any] = {
        "energy_j": r.get("gpu_energy_j"),
        "energy_source": r.get("energy_source"),
        "energy_by_phase_j": dict(r.get("energy_by_phase_j") or {}),
        "idle_while_busy_j": r.get("gpu_idle_while_busy_energy_j"),
        "idle_while_busy_s": r.get("gpu_idle_while_busy_s"),
        "frontend_busy_s": r.get("frontend_busy_s"),
        "duration_s": r.get("duration"),
        "steady_s": r.get("steady_state_duration_s"),
        "concurrency": r.get("max_concurrency"),
        "output_throughput": r.get("output_throughput"),
        **{k: r.get(k) for k in CLIENT_KEYS},
        "api_servers": r.get("api_server_count"),
        "request_rate": r.get("request_rate"),
        "max_concurrency": r.get("max_concurrency"),
        "p50_tpot_ms": r.get("p50_tpot_ms"),
        "cuda_perf_boost": (result_perf_boost(r) or (None, None))[1],
    }
    if f["energy_by_phase_j"].get("idle") is None and r.get("gpu_idle_energy_j") is not None:
        f["energy_by_phase_j"]["idle"] = r["gpu_idle_energy_j"]
    return {k: v for k, v in f.items() if v is not None}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _api_server_caveat(facts: dict[str, Any], client: bool) -> str:
    """What the API-server advice rests on in this run: a lagging client, or lag from other
    processes taking the CPU (loadtests/looplag.py), where more API servers are more processes on
    a host already short of cores."""
    out = " (only if the idle-while-busy time stays with an unhurried client)" if client else ""
    if facts.get("client_cpu_contended") is True:
        out += " (the client waited for a CPU in this run: give the server more cores first)"
    return out


def advise(facts: dict[str, Any]) -> list[Recommendation]:
    """Ranked recommendations from merged facts (result first, metrics filling gaps)."""
    out: list[Recommendation] = []
    e = _num(facts.get("energy_j"))
    src = facts.get("energy_source") or "measured"
    src = "measured" if src == "measured" else "simulated"
    iwb_j, iwb_s, busy_s = _num(facts.get("idle_while_busy_j")), _num(facts.get("idle_while_busy_s")), _num(facts.get("frontend_busy_s"))
    if e and iwb_j is not None and iwb_j / e >= MIN_STARVATION_SHARE:
        n = int(facts.get("api_servers") or 1)
        busy = f"; {100 * iwb_s / busy_s:.1f} % of busy time" if iwb_s is not None and busy_s else ""
        seen = (
            f"GPU idle {iwb_s or 0:.1f} s while requests were in flight: {iwb_j:.0f} J, {100 * iwb_j / e:.1f} % of the run's energy{busy}"
        )
        # The engine waits on everything in front of it, the load generator included. When the
        # client fell behind its own schedule, more API servers did not help on the H200
        # (docs/results/h200-defaults.md, starvation at concurrency 256): measure the client first.
        client = facts.get("client_bottleneck") is True
        if client:
            lag = _num(facts.get("client_loop_lag_p99_ms"))
            lag_max = _num(facts.get("client_loop_lag_max_ms"))
            lags = ([f"p99 {lag:.2f} ms"] if lag is not None else []) + ([f"max {lag_max:.0f} ms"] if lag_max is not None else [])
            out.append(
                Recommendation(
                    "client",
                    "Split the load over more client processes (or a bigger client machine) and measure again, "
                    "before adding API servers: the load generator was behind its own schedule",
                    f"{seen}; the run's own check flagged the client (event-loop lag {', '.join(lags) or 'not recorded'})"
                    + "; H200, concurrency 256 with a lagging client: 1 -> 4 API servers gave x0.94 "
                    "throughput (docs/results/h200-defaults.md)",
                    src,  # the run's joules and share, simulated where its energy was
                    "predicted",
                    iwb_j / e,
                )
            )
        out.append(
            Recommendation(
                "api_servers",
                f"Run more API servers: --api-server-count {suggested_api_servers(n)}" + _api_server_caveat(facts, client),
                f"{seen} (the engine waited on the front end; H200, 1 -> 4 API servers: -8.6 % J/token, +54 % throughput, measured)",
                src,
                "predicted",
                None if client else iwb_j / e,
            )
        )
    for boost in (_perf_boost(facts, e, iwb_j, src), _perf_boost_on(facts, e, iwb_j, src)):
        if boost is not None:
            out.append(boost)
    steady, dur = _num(facts.get("steady_s")), _num(facts.get("duration_s"))
    if steady is not None and dur and steady / dur >= MIN_STEADY_SHARE and (facts.get("waiting") or 0) > 0:
        out.append(
            Recommendation(
                "batch_limit",
                "Raise the batch limit: --max-num-seqs (e.g. 2x), memory permitting",
                f"{100 * steady / dur:.0f} % of the run at the batch limit with {facts['waiting']:.0f} request(s) waiting",
                "measured",
                "predicted",
                None,
            )
        )
    pacing = _decode_pacing(facts, e)
    if pacing is not None:
        out.append(pacing)
    clocks = (facts.get("savings") or {}).get("clocks") or ("dry-run" if facts.get("clock_backend") == "dry-run" else None)
    # Simulated energy means no GPU behind the run (the CPU build): no privilege would let a clock act.
    if clocks == "dry-run" and facts.get("energy_source") != "simulated":
        changes = _num(facts.get("clock_changes")) or 0.0
        loop = _num(facts.get("closed_loop_decisions")) or 0.0
        out.append(
            Recommendation(
                "clocks",
                "Let the clock controller act: run the server with CAP_SYS_ADMIN (or root), or give it a zeusd "
                "(clocks.zeusd_socket); then clocks.mode auto applies what it now only records",
                f"{changes:.0f} clock changes and {loop:.0f} closed-loop decisions recorded in dry-run"
                + ("" if changes or loop else " (none yet: no decode steps seen)"),
                "measured",
                "predicted",
                None,
            )
        )
    return sorted(out, key=lambda r: (r.saving_share is None, -(r.saving_share or 0.0)))


def _decode_pacing(facts: dict[str, Any], e: float | None) -> Recommendation | None:
    """Decode pacing for an open-loop, decode-heavy run without a queue (docs/decode-pacing.md)."""
    rate, decode_j = _num(facts.get("request_rate")), _num((facts.get("energy_by_phase_j") or {}).get("decode"))
    open_loop = rate is not None and rate > 0 and facts.get("max_concurrency") is None
    if not (open_loop and e and decode_j is not None and decode_j / e >= MIN_DECODE_SHARE):
        return None
    if (facts.get("waiting") or 0) > 0 or (facts.get("savings") or {}).get("decode_pacing") == "on":
        return None
    tpot = _num(facts.get("p50_tpot_ms"))
    now = f"; TPOT p50 {tpot:.1f} ms now" if tpot is not None else ""
    return Recommendation(
        "decode_pacing",
        "Try decode pacing at a TPOT target under your SLO (decode_pacing.tpot_target_ms, e.g. 0.7x the SLO), "
        "and keep it only if vllm-powersave tune-serving measures it ahead on your traffic",
        f"open-loop arrivals at {rate:g} req/s, {100 * decode_j / e:.0f} % of the run's energy in decode, nothing waiting{now}; "
        "4 req/s, 35 ms: x1.37 (1.32-1.41) tokens per joule for the same requests over 6 pairs on an H100 "
        "(docs/results/h100-decode-pacing.md), x1.48 and x1.51 in one pair and one window on the H200 "
        "(h200-decode-pacing.md); not settled; simulated H200, 1-8 req/s over 300 s: x1.7-2.2",
        "measured",
        "predicted",
        None,
    )


def _modes(mode: Any) -> set[str] | None:
    """The perf-boost modes of a run's GPUs; None where any is unknown (pending, unlabelled)."""
    if not isinstance(mode, str):
        return None
    modes = set(mode.split(","))
    return None if modes & set(UNKNOWN_MODES) else modes


def _quiet_idle_j(facts: dict[str, Any], iwb_j: float | None) -> float | None:
    """Idle energy with no request in flight (J): what perf boost's modes act on, starvation being
    the front end's. None where the run has no idle figure."""
    idle_j = _num((facts.get("energy_by_phase_j") or {}).get("idle"))
    return None if idle_j is None else max(idle_j - (iwb_j or 0.0), 0.0)


def _perf_boost(facts: dict[str, Any], e: float | None, iwb_j: float | None, src: str) -> Recommendation | None:
    """``cuda_perf_boost: "auto"`` for a server that kept CUDA's boost on every GPU. Never for one
    that already ran auto or off; where the mode is unknown (a result without it, no /metrics),
    the advice is conditional and carries no estimate to rank by: the plugin's default is auto."""
    quiet = _quiet_idle_j(facts, iwb_j)
    modes = _modes(facts.get("cuda_perf_boost"))
    if not e or quiet is None or (modes is not None and modes != {"on"}):
        return None
    if quiet / e < MIN_IDLE_SHARE:
        return None
    action = 'Set cuda_perf_boost: "auto" (or drop a "savings: off"/"cuda_perf_boost: on" setting)'
    if modes is None:
        action = 'If this server ran with cuda_perf_boost: "on" or savings: "off": set cuda_perf_boost: "auto"'
    return Recommendation(
        "perf_boost",
        action,
        f"idle energy {quiet:.0f} J, {100 * quiet / e:.1f} % of the run's energy; idle power -35 % with auto "
        f"(measured on the H200, docs/results/h200-perf-boost.md)"
        + ("" if modes else "; perf-boost mode unknown (give the server's --metrics, or a result that carries cuda_perf_boost)"),
        src,
        "predicted",
        PERF_BOOST_IDLE_SAVING * quiet / e if modes else None,
    )


def _perf_boost_on(facts: dict[str, Any], e: float | None, iwb_j: float | None, src: str) -> Recommendation | None:
    """``cuda_perf_boost: "on"`` for a server that ran auto on every GPU and hardly idled: auto's
    saving is idle power, and where the GPU is busy nearly all the time its arrangement (an
    unboosted engine beside a boosting side context) cost a little more than CUDA's own boost."""
    quiet = _quiet_idle_j(facts, iwb_j)
    if not e or quiet is None or _modes(facts.get("cuda_perf_boost")) != {"auto"}:
        return None
    # Decode pacing's holds keep the engine's busy time up while the GPU waits between paced steps
    # (docs/decode-pacing.md): little idle there does not mean a busy GPU.
    if quiet / e >= PERF_BOOST_ON_MAX_IDLE_SHARE or (facts.get("savings") or {}).get("decode_pacing") == "on":
        return None
    return Recommendation(
        "perf_boost_on",
        'If the server stays this busy, set cuda_perf_boost: "on" (auto saves idle power, and there was almost none)',
        f"idle energy {quiet:.0f} J, {100 * quiet / e:.2f} % of the run's energy; at 8 req/s on an H100 "
        f"(GPU busy ~99 %) on gave ~{100 * PERF_BOOST_ON_BUSY_GAIN:.1f} % more tokens per joule than auto, 3 adjacent "
        "comparisons (measured, docs/results/h200-under-load.md); none at 2 req/s",
        src,
        "predicted",
        PERF_BOOST_ON_BUSY_GAIN,
    )


def run(results: list[str], metrics: list[str], api_servers: int | None = None, as_json: bool = False) -> str:
    """The report text (or JSON) for the given inputs; raises :class:`AdviseError` on bad input.
    Each ``--result`` is its own run and gets its own advice (the server's ``/metrics`` fill the
    gaps of each); every recommendation in the JSON names the result it came from."""
    if not results and not metrics:
        raise AdviseError("give --result FILE and/or --metrics URL|FILE")
    if api_servers is not None and api_servers < 1:
        raise AdviseError(f"--api-servers = {api_servers}: must be >= 1")
    base: dict[str, Any] = {"api_servers": 1}
    for m in metrics:
        for k, v in facts_from_metrics(load_metrics(m), m).items():
            base.setdefault(k, v)
    results = list(dict.fromkeys(results))  # a file given twice is one run
    loaded = [(r, facts_from_result(load_result(r))) for r in results]  # every file checked before any advice
    runs: list[RunAdvice] = []
    for path, f in loaded or [(None, {})]:
        facts = {**base, **f}  # the run's own window wins over the server's totals since start
        if api_servers is not None:  # the operator's word wins over the count a result carries
            facts["api_servers"] = api_servers
        runs.append(RunAdvice(path, advise(facts), facts))
    if as_json:
        recs = [{**asdict(r), "result": run_.result} for run_ in runs for r in run_.recommendations]
        per_run = [
            {
                "result": x.result,
                "recommendations": len(x.recommendations),
                "nothing_because": None if x.recommendations else _nothing_because(x.facts),
            }
            for x in runs
        ]
        return json.dumps({"inputs": {"results": results, "metrics": metrics}, "runs": per_run, "recommendations": recs}, indent=2)
    lines: list[str] = []
    for run_ in runs:
        if len(runs) > 1:
            lines.append(f"== {run_.result}")
        lines.append(run_.text())
    return "\n".join(lines)


@dataclass
class RunAdvice:
    """One run's advice: the result file it came from (None: /metrics only), the ranked
    recommendations and the facts they were drawn from (for why there are none)."""

    result: str | None
    recommendations: list[Recommendation]
    facts: dict[str, Any]

    def text(self) -> str:
        if not self.recommendations:
            why = _nothing_because(self.facts)
            return "vllm-powersave advise: nothing to recommend from these figures" + (f" ({why})" if why else "")
        head = f"vllm-powersave advise: {len(self.recommendations)} recommendation(s), largest expected saving first"
        return "\n".join([head, *(r.line(i) for i, r in enumerate(self.recommendations, start=1))])


def _nothing_because(facts: dict[str, Any]) -> str:
    """What the rules saw, where they found nothing: the perf-boost mode and the shares that stayed
    below their thresholds."""
    parts = []
    modes = _modes(facts.get("cuda_perf_boost"))
    if modes and "on" not in modes:
        parts.append(f"perf boost already {','.join(sorted(modes))}")
    e, iwb_j = _num(facts.get("energy_j")), _num(facts.get("idle_while_busy_j"))
    # Shares of simulated joules say so: a model's number is never shown as a measurement.
    energy = "the simulated energy" if facts.get("energy_source") == "simulated" else "the energy"
    if not e:
        parts.append("no usable energy total in these figures")
    if e and iwb_j is not None:
        parts.append(f"front-end starvation {100 * iwb_j / e:.1f} % of {energy} (advice from {100 * MIN_STARVATION_SHARE:.0f} %)")
    quiet = _quiet_idle_j(facts, iwb_j)
    if e and quiet is not None:
        share = f"idle {100 * quiet / e:.1f} % of {energy}"
        if modes is None or "on" in modes:
            parts.append(f"{share} (idle advice from {100 * MIN_IDLE_SHARE:.0f} %)")
        else:  # the one idle rule left: hold the boost on, which pays only where the GPU is hardly idle
            parts.append(f"{share} (holding the boost on pays only below {100 * PERF_BOOST_ON_MAX_IDLE_SHARE:.0f} %)")
    return "; ".join(parts)
