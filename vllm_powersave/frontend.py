"""The API-server pool: how many front-end processes ``vllm serve`` runs when the user did not say.

Why the plugin sizes it: one API-server process tokenizes, detokenizes and streams for every client,
and at high concurrency it falls behind the GPU, which then idles while requests are in flight. On
the H200 test machine (16 cores, qwen2.5-7b shape, streamed) four API servers against one gave x1.54
output throughput (95 % CI 1.29-1.80) and p99 TPOT x0.68 at concurrency 256 (128 in / 128 out), and
x1.024 (1.017-1.030) at concurrency 64 (512 / 256), where one server was no longer the limit
(docs/results/h200-under-load.md). vLLM's own default is one API server per data-parallel rank,
whatever the load and the cores.

The rule (``api_server_count: "auto"``): up to :data:`AUTO_PER_ENGINE` API servers per local
engine, never more than the cores left once every engine process has one of its own, and never
fewer than vLLM's own default. Where vLLM refuses several API servers (headless, gRPC, an external
load balancer, the Rust front end, elastic EP, runtime LoRA updates) or where the CPU build computes
on the same cores, the pool is left as vLLM chooses, and the start line says why.

This module decides only; :func:`vllm_powersave.vllm_compat.serve_facts` reads vLLM's arguments and
``vllm_compat.install_serve_hook`` applies the count before ``vllm serve`` dispatches.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

#: API servers per local engine under "auto": the count measured on the H200 (see module docstring).
AUTO_PER_ENGINE = 4
#: Where the measured basis lives (named in the start line and the compare report).
BASIS = "measured on H200, streamed: x1.54 throughput at c256, x1.02 at c64 vs 1 (docs/results/h200-under-load.md)"


@dataclass(frozen=True)
class ServeFacts:
    """What ``vllm serve``'s parsed arguments and environment say about the front end."""

    #: ``--api-server-count`` as given; ``None``: not set on the command line.
    api_server_count: int | None
    data_parallel_size: int = 1
    #: Local data-parallel ranks (``--data-parallel-size-local``); ``None``: all of them.
    data_parallel_size_local: int | None = None
    #: Processes each engine keeps busy beside the API servers (tensor x pipeline parallel workers).
    workers_per_engine: int = 1
    #: Why vLLM itself runs exactly one front-end process here, or ``None``.
    refusal: str | None = None


@dataclass(frozen=True)
class FrontendChoice:
    """The API-server count to run and why (the start line prints :meth:`describe`)."""

    count: int | None  # None: vLLM's own choice, untouched
    changed: bool
    reason: str

    def describe(self) -> str:
        if self.count is None:
            return f"front end vLLM's choice ({self.reason})"
        return f"front end {self.count} API server{'s' if self.count != 1 else ''} ({self.reason})"


def usable_cores(affinity: set[int] | None = None, cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPU cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            affinity = set(range(os.cpu_count() or 1))
    cores = max(1, len(affinity))
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def vllm_default(facts: ServeFacts) -> int:
    """vLLM's own count when ``--api-server-count`` is unset (one per data-parallel rank it serves)."""
    return max(1, facts.data_parallel_size_local or facts.data_parallel_size)


def choose(setting: int | str, facts: ServeFacts, cores: int, on_gpu: bool) -> FrontendChoice:
    """The API-server count for ``setting`` (``"auto"``, ``"vllm"`` or a count) on this machine."""
    if facts.api_server_count is not None:
        return FrontendChoice(None, False, f"--api-server-count {facts.api_server_count} given")
    if setting == "vllm":
        return FrontendChoice(None, False, "api_server_count: vllm")
    if facts.refusal:
        return FrontendChoice(None, False, facts.refusal)
    if isinstance(setting, int):
        return FrontendChoice(setting, True, "api_server_count setting")
    if not on_gpu:
        return FrontendChoice(None, False, "no GPU: the engine computes on the same cores")
    engines = vllm_default(facts)
    spare = cores - engines * max(1, facts.workers_per_engine)
    count = max(engines, min(AUTO_PER_ENGINE * engines, spare))
    if count <= engines:
        return FrontendChoice(None, False, f"auto: {cores} usable cores leave none for more API servers")
    return FrontendChoice(count, True, f"auto: {cores} usable cores, {engines} engine{'s' if engines != 1 else ''}; {BASIS}")
