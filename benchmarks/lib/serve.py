"""vLLM OpenAI servers for the device A/B runs: start, port guard, health, stop.

A port that already has a listener is refused: two jobs on one port once sent both jobs' load to
one server (uvicorn's SO_REUSEPORT binds silently).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .device import log

# NVLink multicast stays off (a program using it can take a shared host's GPUs out of service);
# vLLM's symmetric-memory all-reduce would use it on Hopper, so that path is off too.
#: The environment of every vLLM server on the GPU machine: the bundle has no FlashInfer, nothing
#: may reach the network, tokenizers stay single-threaded beside the server's own pool.
SERVER_ENV = dict(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
SERVER_ENV.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
NO_MULTICAST = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", VLLM_ALLREDUCE_USE_SYMM_MEM="0")


def start_server(
    label: str,
    model: Path,
    port: int,
    extra: list[str],
    pythonpath: str | None,
    out: Path,
    serve_args: list[str],
    env_extra: dict[str, str] | None = None,
    max_model_len: int = 2048,
) -> subprocess.Popen:
    """A server on ``port`` (refused if taken) with a dummy-weight ``model`` and ``serve_args``, logging to
    ``out/server-<label>.log`` (first line: ``env_extra`` and the command as one shell line);
    ``pythonpath``: None inherits this process's; ``env_extra``: e.g. ``CUDA_VISIBLE_DEVICES``."""
    check_port_free(port)
    site = {} if pythonpath is None else {"PYTHONPATH": pythonpath}
    env = {**os.environ, **site, **NO_MULTICAST, **(env_extra or {})}  # env_extra wins
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "model"]
    cmd += ["--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len)]
    cmd += [*serve_args, *extra]
    logf = open(out / f"server-{label}.log", "wb")
    logf.write((" ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env_extra or {}).items()), *cmd]) + "\n").encode())
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)


PROC_NET_TCP = ("/proc/net/tcp", "/proc/net/tcp6")


def tcp_listeners(port: int) -> int:
    """Sockets in LISTEN state on ``port`` (IPv4 and IPv6), from /proc/net/tcp*; -1 where no table is
    readable (a kernel without IPv6 has no tcp6: the IPv4 table still counts)."""
    n, read = 0, 0
    for f in PROC_NET_TCP:
        try:
            lines = Path(f).read_text().splitlines()[1:]
        except OSError:
            continue
        read += 1
        n += sum(1 for ln in lines if (c := ln.split()) and int(c[1].rsplit(":", 1)[1], 16) == port and c[3] == "0A")
    return n if read else -1


def check_port_free(port: int) -> None:
    """Refuse to start a server on a port something already listens on (RuntimeError)."""
    if tcp_listeners(port) > 0:
        raise RuntimeError(f"port {port} already has a listener: another benchmark job is using it")


#: Start-up failures after which the API server may stay up without an engine (it never turns healthy).
DEAD_ENGINE = ("EngineDeadError", "Engine core initialization failed")


def wait_healthy(procs: dict[str, tuple[subprocess.Popen, int]], timeout_s: float, logs: dict[str, Path] | None = None) -> None:
    """Wait for /health of every server; RuntimeError if one exits, times out, or shares its port,
    or if its log (``logs``, by label) shows that its engine died during start-up."""
    pending = dict(procs)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for label, (p, port) in list(pending.items()):
            if p.poll() is not None:
                raise RuntimeError(f"server {label} exited with {p.returncode} during start-up")
            text = logs[label].read_text(errors="replace") if logs and label in logs else ""
            if dead := next((m for m in DEAD_ENGINE if m in text), None):
                raise RuntimeError(f"server {label}: engine died during start-up (server log: {dead})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        if (n := tcp_listeners(port)) > 1:
                            raise RuntimeError(f"server {label}: {n} listeners on port {port}; requests would reach another server")
                        log(f"server {label} healthy")
                        pending.pop(label)
            except RuntimeError:
                raise
            except Exception:
                pass
        time.sleep(1)
    if pending:
        raise RuntimeError(f"servers {sorted(pending)} not healthy after {timeout_s:.0f} s")


def metrics_text(port: int) -> str:
    """The server's whole /metrics text; ``# scrape failed: ...`` where it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except Exception as exc:
        return f"# scrape failed: {exc}\n"


def stop(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 5)):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
            p.wait(wait)
        except Exception:
            pass
