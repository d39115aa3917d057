"""Start and stop a real ``vllm serve`` process for the comparison job and the end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServerError(RuntimeError):
    """The server did not come up; the message is one line and names the log file."""


#: uvicorn logs this once per API-server process (vLLM 0.25 and 0.32).
API_SERVER_STARTED = re.compile(r"Started server process \[\d+\]")


def api_servers_in_log(log_path: str | Path) -> int | None:
    """API-server processes a ``vllm serve`` log shows started; None before any or without a log."""
    try:
        return len(API_SERVER_STARTED.findall(Path(log_path).read_text(errors="replace"))) or None
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_command() -> list[str]:
    """The ``vllm`` CLI of this environment (the CPU build needs our launcher, see launcher.py)."""
    exe = Path(sys.executable).parent / "vllm"
    try:
        import importlib.metadata as md

        md.version("vllm")
        if exe.exists():
            return [str(exe)]
    except Exception:
        pass
    return [sys.executable, "-m", "vllm_powersave.launcher"]


def cpu_only() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:
        return True


def default_serve_args(model: str) -> list[str]:
    """Arguments that make a small model serve quickly; on CPU also the CPU-backend limits."""
    args = [model, "--host", "127.0.0.1", "--max-model-len", "1024", "--served-model-name", "model"]
    if cpu_only():
        # Eager: torch.compile costs ~40 s of start-up and gains nothing for the tiny model on 2 cores.
        args += ["--dtype", "bfloat16", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--enforce-eager"]
    return args


class VllmServer:
    """A ``vllm serve`` subprocess.

    Args:
        args: arguments after ``vllm serve`` (model first).
        env: extra environment variables.
        log_path: file receiving the server's stdout and stderr.
        port: TCP port on 127.0.0.1 (a free one if ``None``).
        startup_timeout_s: seconds to wait for ``/health``.
        cpus: CPU ids the server and every process it starts (EngineCore, workers) may run on
            (inherited affinity); ``None`` = unrestricted.
    """

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        log_path: str | Path = "vllm-server.log",
        port: int | None = None,
        startup_timeout_s: float = 600.0,
        cpus: set[int] | None = None,
    ) -> None:
        self.args = list(args)
        self.cpus = set(cpus) if cpus else None
        self.env = dict(env or {})
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "VllmServer":
        model = self.args[0] if self.args else ""
        if not model or (not Path(model).is_dir() and (model.startswith((".", "/")) or os.sep in model)):
            raise ServerError(f"model directory not found: {model!r}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        env.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub: models are local
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if cpu_only():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cmd = [*vllm_command(), "serve", *self.args, "--port", str(self.port)]
        self._log = open(self.log_path, "wb")
        self._log.write((" ".join(cmd) + "\n").encode())
        self._log.flush()
        # Own process group: stopping the server also stops its EngineCore and workers.
        cpus = self.cpus
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail(1)
                raise ServerError(f"vllm serve exited with code {self.proc.returncode} during start-up: {tail} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"vllm serve did not become healthy within {self.startup_timeout_s:.0f} s (log: {self.log_path})")

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def api_server_count(self) -> int | None:
        """API-server processes this server started (:func:`api_servers_in_log`)."""
        return api_servers_in_log(self.log_path)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (vLLM's graceful shutdown), then SIGTERM, then SIGKILL, to the process group."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # stragglers of the group (engine core, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
