"""Measuring one configuration: a ``vllm serve`` (OpenAI server) and one ``loadtests`` window.

:class:`Measurer` owns the server. A window of the configuration already being served reuses it;
any other configuration stops it and starts the new one: every searched setting is an engine or
front-end argument that takes effect only at start. Energy: on a GPU, the local NVML counter for
every configuration alike (stock vLLM publishes no energy of its own), ``measured``; without one,
every server runs the plugin as a meter only (savings off) pricing its engine steps on the simulated
H200, and the figures say ``simulated``; decode pacing, which needs no GPU, runs there too.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..settings import METERING_ONLY, merge_settings
from .slo import Slo, attainment_of
from .space import Config, override
from .state import Figures
from .traffic import Traffic, closed_loop_lengths, write_loadtests_dataset, write_loadtests_trace


class Refused(RuntimeError):
    """vLLM did not serve a configuration; the message is one line from its log."""


class MeasureError(RuntimeError):
    """A window could not be measured (the load test failed); one line."""


@dataclass(frozen=True)
class ServePlan:
    """How every server of a search is started."""

    model: Path
    base_args: tuple[str, ...]  # after the model: default_serve_args' and the user's --serve-arg
    gpu: bool
    out_dir: Path
    sim_shape: str | None = "qwen2.5-7b"
    startup_timeout_s: float = 600.0
    warmups: int = 2

    def serve_args(self, config: Config) -> list[str]:
        """``vllm serve`` arguments of ``config`` (model first)."""
        args = [str(self.model), *override(self.base_args, config.serve_flags())]
        if not self.gpu:
            sim: dict[str, Any] = {"meter": "simulated"}
            if self.sim_shape:
                sim["simulated_model_shape"] = self.sim_shape
            meter: dict[str, Any] = {"savings": "off", "clocks": {"backend": "simulated"}, "energy": sim}
            pacing = config.plugin_settings().get("decode_pacing")
            if pacing:  # acts on any machine: the meter's stock values spelled out, pacing on
                meter = merge_settings(METERING_ONLY, {"clocks": {"backend": "simulated"}, "energy": sim, "decode_pacing": pacing})
            return args + ["--additional-config", json.dumps({"powersave": meter})]
        plugin = config.plugin_settings()
        if plugin:
            args += ["--plugin", "powersave", "--additional-config", json.dumps({"powersave": plugin})]
        return args


#: Lines of a vLLM log that say why it stopped (the last one wins).
_REASON = re.compile(r"(\b\w*(Error|Exception)\b: .+|^error: .+)")


def refusal_reason(log_text: str) -> str:
    """The last error line of a server log, else its last line, cut to 300 characters."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    found = [(i, m.group(1)) for i, ln in enumerate(lines) if (m := _REASON.search(ln))]
    if not found:
        return (lines or ["(empty log)"])[-1][:300]
    i, reason = found[-1]
    if "validation error" in reason and i + 1 < len(lines):  # pydantic: the field's message is on the next line
        reason += ": " + lines[i + 1].split(" [type=")[0].removeprefix("Value error, ")
    return reason[:300]


class Measurer:
    """Runs windows against servers it starts and stops; one server at a time."""

    def __init__(self, plan: ServePlan, traffic: Traffic, slo: Slo) -> None:
        self.plan = plan
        self.traffic = traffic
        self.slo = slo
        self._server: Any = None
        self._args: list[str] | None = None

    def needs_restart(self, config: Config) -> bool:
        return self._server is None or self._args != self.plan.serve_args(config)

    def _serve(self, config: Config, label: str) -> bool:
        """The server of ``config``, reused or started; whether one was started. :class:`Refused`."""
        from ..serving import ServerError, VllmServer

        if not self.needs_restart(config):
            return False
        self.close()
        args = self.plan.serve_args(config)
        logs = self.plan.out_dir / "servers"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"server-{len(list(logs.glob('server-*.log'))) + 1:03d}-{label}.log"
        server = VllmServer(args, log_path=log, startup_timeout_s=self.plan.startup_timeout_s)
        try:
            server.start()
        except BaseException as err:  # an interrupt during start-up must not leave the server running
            server.stop()
            if not isinstance(err, ServerError):
                raise
            try:
                text = log.read_text(errors="replace")
            except OSError:
                text = str(err)
            if "exited" not in str(err):  # no answer in time (a busy machine, a short --startup-timeout): not a refusal
                raise MeasureError(f"{err}; nothing is recorded for {config.key}: rerun to try it again") from None
            raise Refused(refusal_reason(text)) from None
        self._server, self._args = server, args
        return True

    def measure(self, config: Config, window_s: float, seed: int, label: str) -> tuple[Figures, bool]:
        """One window of ``config``: its figures, and whether a server was started for it."""
        restarted = self._serve(config, label)
        result = self._run_window(window_s, seed, label)
        runs = self.plan.out_dir / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        (runs / f"{label}.json").write_text(json.dumps(result, indent=1))
        return figures_of(result, self.slo), restarted

    def _run_window(self, window_s: float, seed: int, label: str) -> dict[str, Any]:
        from loadtests import BenchConfig, LoadTestError, run

        t = self.traffic
        common: dict[str, Any] = dict(
            base_url=self._server.base_url,
            stream=True,
            num_warmups=self.plan.warmups,
            seed=seed,
            label=label,
            progress=False,
            energy="nvml" if self.plan.gpu else "auto",
            request_timeout_s=max(120.0, 4 * window_s),
            timeout_s=max(600.0, 10 * window_s),
        )
        inputs = self.plan.out_dir / "inputs"
        if t.kind == "saturation":
            conc = int(t.concurrency or 1)
            n = saturation_requests(conc, window_s, t.output_len.lo, t.output_len.hi)
            data = write_loadtests_dataset(closed_loop_lengths(n, t.input_len, t.output_len, seed), inputs / f"{label}.jsonl", seed)
            cfg = BenchConfig(**common, dataset=f"jsonl:{data}", num_prompts=n, max_concurrency=conc, duration_s=window_s)
        else:
            rows = t.rows(window_s, seed)
            trace = write_loadtests_trace(rows, inputs / f"{label}.jsonl", seed)
            cfg = BenchConfig(**common, trace=str(trace), num_prompts=len(rows))
        try:
            return run(cfg)
        except LoadTestError as err:
            raise MeasureError(f"load test {label}: {err}") from None

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._server, self._args = None, None


#: The fastest decode a saturation window plans for (s per output token): a window that ran out of
#: requests would end early and measure less than ``--window-s`` (2 cores, the tiny model: ~3 ms).
MIN_TPOT_S = 0.002
MAX_WINDOW_REQUESTS = 20000


def saturation_requests(concurrency: int, window_s: float, out_lo: int, out_hi: int) -> int:
    """Requests to prepare for a closed-loop window: enough for each stream to keep busy for
    ``window_s`` at :data:`MIN_TPOT_S` per token (the run stops starting them at ``window_s``)."""
    per_request_s = max(MIN_TPOT_S * (out_lo + out_hi) / 2.0, 1e-3)
    return min(MAX_WINDOW_REQUESTS, int(concurrency * (window_s / per_request_s + 2)))


def leftover_servers(log_dir: Path) -> list[int]:
    """Process groups of servers whose output still goes to a log in ``log_dir``: servers an earlier
    run of this search started and could not stop (it was killed with SIGKILL). Linux ``/proc`` only."""
    proc, own = Path("/proc"), os.getpgid(0)
    if not proc.is_dir() or not log_dir.is_dir():
        return []
    logs = str(log_dir.resolve()) + os.sep
    groups: set[int] = set()
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.readlink(d / "fd" / "1").startswith(logs):
                groups.add(os.getpgid(int(d.name)))
        except OSError:  # gone, or not ours to read
            continue
    return sorted(groups - {own})


def stop_leftover_servers(log_dir: Path, grace_s: float = 10.0) -> list[int]:
    """Stop (SIGTERM, then SIGKILL) every :func:`leftover_servers` group; the groups stopped."""
    groups = leftover_servers(log_dir)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in groups:
            try:
                os.killpg(g, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline and leftover_servers(log_dir):
            time.sleep(0.2)
    return groups


def figures_of(result: dict[str, Any], slo: Slo) -> Figures:
    """The figures a search keeps of a ``loadtests`` result."""
    good, sent = attainment_of(result, slo)

    def num(key: str) -> float | None:
        v = result.get(key)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    return Figures(
        output_tokens_per_joule=num("output_tokens_per_joule"),
        energy_source=result.get("energy_source"),
        gpu_energy_j=num("gpu_energy_j"),
        output_throughput=num("output_throughput"),
        p99_ttft_ms=num("p99_ttft_ms"),
        p99_tpot_ms=num("p99_tpot_ms"),
        p99_itl_ms=num("p99_itl_ms"),
        good=good,
        sent=sent,
        completed=int(result.get("completed") or 0),
        failed=int(result.get("failed") or 0),
        duration_s=num("duration"),
        energy_note=None if num("output_tokens_per_joule") is not None else str(result.get("energy_note") or "no energy reading"),
    )


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
