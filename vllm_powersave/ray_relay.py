"""Worker figures across nodes: vLLM's Ray executor, reporting through a named Ray actor.

Workers normally publish into ``stats_dir`` on their own file system (``rank<N>.json`` snapshots,
``trace-rank<N>.jsonl`` and ``requests-rank<N>.jsonl`` lines), and the API server reads that
directory (``metrics.py``, ``request_energy.py``). Under vLLM's Ray executor the workers of other
nodes cannot see that directory. So, when the engine is a Ray driver:

* the EngineCore process (the Ray driver, always on the API server's node under ``vllm serve``)
  starts one :class:`StatsRelay` actor, named after ``stats_dir`` and pinned to its own node with
  Ray's ``NodeAffinitySchedulingStrategy`` (``num_cpus=0``; owned by the driver, so it ends with
  the engine), before the first engine step (:func:`ensure_relay`, from the scheduler's
  ``add_request`` hook);
* every worker that runs inside a Ray actor looks the relay up by name (:func:`connect`, once, on
  its first step) and sends what it would have written: the same JSON text and lines, with
  fire-and-forget actor calls from its publisher thread, never from the step path. Ray runs the
  calls of one caller in submission order, so lines arrive in order and a snapshot never
  overtakes the lines published before it;
* the relay writes them into ``stats_dir`` exactly as a local worker would (snapshots by atomic
  rename), so the collector and the per-request route read the same files whatever the
  executor.

Nothing here touches vLLM internals; only Ray's public API (``ray.remote``, named actors,
``ray.get_actor``, ``ray.get_runtime_context``). Where no relay is found (multiprocess executor,
Ray not initialised, or a relay that could not start) workers write files as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from .stats_contract import snapshot_name

log = logging.getLogger("vllm.powersave")

#: Name prefix of the relay actor; the rest is a hash of the API server's ``stats_dir``.
RELAY_PREFIX = "powersave-stats-"
#: Files a relay may write (anything else sent to it is refused: it writes only into stats_dir).
_LINE_FILES = re.compile(r"^(trace|requests)-rank\d+\.jsonl$")
#: Longest wait (s) for Ray to register the relay's name before the first step goes out.
REGISTER_TIMEOUT_S = 10.0
#: Handles of the relays this process (the Ray driver) started, by name.
_OWNED: dict[str, Any] = {}


def relay_name(stats_dir: str | os.PathLike[str]) -> str:
    """The relay's actor name for one server's ``stats_dir`` (the path as the API server set it)."""
    digest = hashlib.sha1(os.path.normpath(str(stats_dir)).encode()).hexdigest()[:16]
    return RELAY_PREFIX + digest


class StatsRelay:
    """Ray actor on the API server's node: writes what workers send into ``stats_dir``.

    Methods return nothing useful and never raise (callers do not wait on them); a failed write is
    logged once per file and counted (:meth:`stats`).
    """

    def __init__(self, stats_dir: str) -> None:
        self.dir = Path(stats_dir)
        self.snapshots = 0
        self.lines = 0
        self.failures = 0
        self._warned: set[str] = set()

    def snapshot(self, rank: int, text: str) -> None:
        """Write ``rank<rank>.json`` atomically (``text``: the worker's JSON snapshot)."""
        path = self.dir / snapshot_name(rank)
        try:
            tmp = path.with_suffix(f".relay{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
            self.snapshots += 1
        except OSError as exc:
            self._fail(path.name, exc)

    def append(self, name: str, lines: list[str]) -> None:
        """Append ``lines`` (each ending in a newline) to ``trace-rank<N>.jsonl`` /
        ``requests-rank<N>.jsonl``."""
        if not _LINE_FILES.match(name):
            self._fail(name, ValueError("not a powersave line file"))
            return
        try:
            with open(self.dir / name, "a") as f:
                f.writelines(lines)
            self.lines += len(lines)
        except OSError as exc:
            self._fail(name, exc)

    def stats(self) -> dict[str, Any]:
        """Counts and where the relay runs (for tests and ``ray`` tooling)."""
        node = None
        ray = _ray_if_initialized()  # never ray.get_runtime_context() unconnected: it would start a cluster
        if ray is not None:
            try:
                node = ray.get_runtime_context().get_node_id()
            except Exception:
                pass
        return {
            "stats_dir": str(self.dir),
            "snapshots": self.snapshots,
            "lines": self.lines,
            "failures": self.failures,
            "node_id": node,
            "pid": os.getpid(),
        }

    def _fail(self, name: str, exc: Exception) -> None:
        self.failures += 1
        if name not in self._warned:
            self._warned.add(name)
            log.warning("powersave: relay cannot write %s into %s: %s", name, self.dir, exc)


def _ray_if_initialized() -> Any | None:
    """The ``ray`` module if this process is connected to a Ray cluster (never imports Ray anew:
    vLLM's Ray executor has imported it wherever it runs)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        return ray if ray.is_initialized() else None
    except Exception:
        return None


def ensure_relay(stats_dir: str | os.PathLike[str]) -> bool:
    """Start this server's relay on the current node if this process is a Ray driver.

    Called in the EngineCore process before the first step. Idempotent across processes
    (``get_if_exists``). Returns ``True`` if a relay now exists. Ray errors are logged once and
    leave the workers on local files.
    """
    ray = _ray_if_initialized()
    if ray is None:
        return False
    if relay_name(stats_dir) in _OWNED:
        return True  # replacing the owner's handle would end the actor
    try:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        actor = ray.remote(StatsRelay).options(
            name=relay_name(stats_dir),
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        )
        # Keep the handle: a named actor that is not detached still ends when its owner drops
        # every handle to it (Ray's reference counting); this one must live as long as the engine.
        _OWNED[relay_name(stats_dir)] = actor.remote(str(stats_dir))
        # Ray registers actor names asynchronously: wait until the workers' look-up (on their
        # first step, right after this request is scheduled) can find it: 0.7 s on the 2-core test
        # machine, once per engine. The actor process may start later; calls queue until it does.
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while True:
            try:
                ray.get_actor(relay_name(stats_dir))
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"actor name not registered within {REGISTER_TIMEOUT_S:g} s") from None
                time.sleep(0.005)
    except Exception as exc:
        log.warning("powersave: cannot start the Ray stats relay (%s); workers on other nodes will not report", exc)
        return False
    log.info("powersave: Ray stats relay %s on node %s writes into %s", relay_name(stats_dir), node, stats_dir)
    return True


class RelayClient:
    """Worker side: sends snapshots and lines to the relay without waiting for it."""

    def __init__(self, handle: Any, name: str, node_id: str | None = None) -> None:
        self.handle = handle
        self.name = name
        self.node_id = node_id  # the Ray node this worker runs on (in its snapshot)
        self._warned = False

    def snapshot(self, rank: int, text: str) -> None:
        self._send(self.handle.snapshot, rank, text)

    def append(self, name: str, lines: list[str]) -> None:
        self._send(self.handle.append, name, lines)

    def _send(self, method: Any, *args: Any) -> None:
        try:
            method.remote(*args)  # the ObjectRef is dropped: nothing waits on the relay
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning("powersave: sending figures to the Ray stats relay failed (%s)", exc)


def connect(stats_dir: str | os.PathLike[str] | None) -> RelayClient | None:
    """The relay of ``stats_dir`` if this process is a Ray actor (a worker of vLLM's Ray executor)
    and the relay exists; else ``None`` (publish to local files)."""
    if not stats_dir:
        return None
    ray = _ray_if_initialized()
    if ray is None:
        return None
    try:
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is None:
            return None  # a Ray driver or task, not an executor worker: local files
        name = relay_name(stats_dir)
        return RelayClient(ray.get_actor(name), name, ctx.get_node_id())
    except ValueError:  # no actor of that name
        log.warning("powersave: running in a Ray actor but no stats relay %s; publishing to local files", relay_name(stats_dir))
        return None
    except Exception as exc:
        log.warning("powersave: Ray stats relay lookup failed (%s); publishing to local files", exc)
        return None


def describe(client: RelayClient | None) -> str:
    """``"ray-relay"`` or ``"file"``: how a worker publishes (recorded in its snapshot)."""
    return "ray-relay" if client is not None else "file"


__all__ = ["RELAY_PREFIX", "RelayClient", "StatsRelay", "connect", "describe", "ensure_relay", "relay_name"]
