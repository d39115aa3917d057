"""A request with prompt logprobs through ``vllm serve``: stock vLLM vs ``--plugin powersave``.

vLLM computes a request's prompt logprobs over every prompt position at once: the whole logits,
then a float32 log-softmax (``Sampler.compute_logprobs``), none of which its start-up memory
profile reserves. The plugin runs the same functions per row block (``chunking/apply.py``,
installed by ``vllm_compat.install_prompt_logprobs``), sized by a chunking table rule or, on a
GPU, from free memory. This job starts one fresh server per arm in the order given, sends a
warm-up and then ``--requests`` completions of ``--prompt-tokens`` token ids with
``prompt_logprobs`` = ``--k`` and ``max_tokens`` = 1, and records per request the HTTP status,
the first line of any error, the seconds taken and whether every position got its logprobs; then
whether the server still answers ``/health``, and its peak memory:

* GPU: the peak of NVML's used memory (``NvmlGpu.memory_used_bytes``) sampled at 20 Hz while the requests ran, over
  its value before them (read-only NVML; no setting is changed);
* CPU: the model process's ``VmHWM`` (peak resident set) after the requests, over its value after
  the warm-up (torch keeps no CPU allocator statistics).

Refuses to start without ``POWERSAVE_FORCE_DRY_RUN=1``. Writes ``--out/served-prompt-logprobs-<tag>.json``;
``--record RAW... --out-dir docs/results`` builds ``NAME.{json,md}`` from raw files. On the H200::

    POWERSAVE_FORCE_DRY_RUN=1 python3 -m benchmarks.served_prompt_logprobs --model-dir /tmp/models/qwen2.5-7b \\
        --order stock,plugin --prompt-tokens 8192 --serve-args "--max-model-len 8448 --max-num-batched-tokens 8448 \\
        --gpu-memory-utilization 0.95 --enforce-eager"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .lib.device import log, require_dry_run, utc_now, write_json_atomic, write_record
from .lib.serve import SERVER_ENV, start_server, stop, wait_healthy

ARMS = ("stock", "plugin")
MIB = 2**20


@dataclass
class RequestResult:
    """One prompt-logprobs request: HTTP status (0: no answer), error line, seconds, positions scored."""

    status: int
    seconds: float
    positions: int | None = None
    error: str | None = None


@dataclass
class ArmRun:
    """One fresh server's run: its requests, whether it still answered, and its peak memory."""

    arm: str
    pos: int
    started_utc: str
    requests: list[RequestResult] = field(default_factory=list)
    alive_after: bool | None = None
    memory_source: str | None = None
    base_mib: float | None = None
    peak_mib: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def extra_peak_mib(self) -> float | None:
        return None if self.base_mib is None or self.peak_mib is None else self.peak_mib - self.base_mib


class GpuMemorySampler:
    """Peak ``used`` memory of one GPU at 20 Hz while running (NVML reads only); unavailable off a GPU."""

    def __init__(self, index: int, nvml: object = None) -> None:
        self.peak_b = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            from vllm_powersave.device import NvmlGpu

            self._gpu: object | None = NvmlGpu.from_index(index, nvml)
        except Exception:  # no NVML here (a CPU run): peak memory comes from the model process
            self._gpu = None

    @property
    def available(self) -> bool:
        return self._gpu is not None

    def used_b(self) -> int:
        return self._gpu.memory_used_bytes()

    def start(self) -> None:
        self.peak_b, self._stop = self.used_b(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_b = max(self.peak_b, self.used_b())

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.peak_b


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += kids.get(p, [])
    return out


def vm_hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def model_process_hwm_mib(server_pid: int) -> float | None:
    """The largest ``VmHWM`` below the server (its engine-core or worker process holds the model)."""
    vals = [v for v in (vm_hwm_mib(p) for p in descendants(server_pid)) if v is not None]
    return max(vals) if vals else None


def post_completion(port: int, prompt: list[int], k: int, timeout_s: float) -> RequestResult:
    body = {"model": "model", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": k, "temperature": 0.0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            got = json.loads(r.read())
        scored = got["choices"][0].get("prompt_logprobs") or []
        return RequestResult(200, round(time.monotonic() - t0, 2), positions=len(scored))
    except urllib.error.HTTPError as exc:
        line = exc.read().decode(errors="replace").strip().splitlines()[:1]
        return RequestResult(exc.code, round(time.monotonic() - t0, 2), error=(line[0] if line else str(exc))[:300])
    except Exception as exc:  # no answer: connection reset, timeout, server gone
        return RequestResult(0, round(time.monotonic() - t0, 2), error=f"{type(exc).__name__}: {exc}"[:300])


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status == 200
    except Exception:
        return False


def arm_launch(ns: argparse.Namespace, arm: str, workdir: Path) -> tuple[str | None, list[str], dict[str, str]]:
    """PYTHONPATH, extra flags and environment of ``arm`` (stock: no plugin loaded at all)."""
    env = dict(SERVER_ENV)
    if arm == "stock":
        if not ns.stock_site:
            env["VLLM_PLUGINS"] = ""
        return ns.stock_site or None, [], env
    if ns.plugin_settings:
        (cfg := workdir / "powersave-plugin.json").write_text(json.dumps({"powersave": json.loads(ns.plugin_settings)}))
        env["POWERSAVE_CONFIG"] = str(cfg)
    return (f"{ns.plugin_site}:{ns.stock_site}" if ns.plugin_site else None), ["--plugin", "powersave"], env


def run_arm(ns: argparse.Namespace, arm: str, pos: int, workdir: Path, gpu: GpuMemorySampler) -> ArmRun:
    """Start ``arm``'s server, warm it, send the prompt-logprobs requests, read its peak memory, stop it."""
    run, port = ArmRun(arm, pos, utc_now()), ns.port + pos
    pythonpath, extra, env = arm_launch(ns, arm, workdir)
    p = start_server(f"{arm}{pos}", Path(ns.model_dir), port, extra, pythonpath, workdir, shlex.split(ns.serve_args), env, ns.max_model_len)
    rng = random.Random(ns.seed)
    try:
        wait_healthy({arm: (p, port)}, ns.start_timeout_s, {arm: workdir / f"server-{arm}{pos}.log"})
        warm = post_completion(port, [rng.randrange(1, ns.max_token_id) for _ in range(32)], ns.k, ns.timeout_s)
        if warm.status != 200:
            run.notes.append(f"warm-up: {warm.status} {warm.error}")
        run.memory_source = "nvml used (GPU)" if gpu.available else "VmHWM of the model process (CPU)"
        run.base_mib = gpu.used_b() / MIB if gpu.available else model_process_hwm_mib(p.pid)
        if gpu.available:
            gpu.start()
        for _ in range(ns.requests):
            prompt = [rng.randrange(1, ns.max_token_id) for _ in range(ns.prompt_tokens)]
            run.requests.append(res := post_completion(port, prompt, ns.k, ns.timeout_s))
            log(f"[{arm}{pos}] {ns.prompt_tokens}-token prompt logprobs: {res.status} in {res.seconds} s {res.error or ''}")
        run.peak_mib = gpu.stop() / MIB if gpu.available else model_process_hwm_mib(p.pid)
        run.alive_after = healthy(port)
    except Exception as exc:
        run.notes.append(f"error: {type(exc).__name__}: {exc}")
    finally:
        stop(p)
        time.sleep(3.0)
    return run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/models/qwen2.5-7b")
    ap.add_argument("--order", default="stock,plugin", help=f"arms in server order: {', '.join(ARMS)}")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--k", type=int, default=1, help="prompt_logprobs per position")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--max-token-id", type=int, default=1000, help="prompt ids are drawn below this (inside any local tokenizer)")
    ap.add_argument("--serve-args", default="--max-model-len 8448 --max-num-batched-tokens 8448 --gpu-memory-utilization 0.95")
    ap.add_argument("--max-model-len", type=int, default=8448)
    ap.add_argument("--plugin-settings", default="", help="JSON settings of the plugin arm (default: none, the plugin's defaults)")
    ap.add_argument("--plugin-site", default="/tmp/psite", help="'' = inherit PYTHONPATH (CPU)")
    ap.add_argument("--stock-site", default="/tmp/site", help="'' = inherit PYTHONPATH (CPU)")
    ap.add_argument("--port", type=int, default=8500)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--record", nargs="*", default=None, help="RAW files: build the record instead of running")
    ap.add_argument("--out-dir", default="docs/results")
    ap.add_argument("--name", default="h200-served-prompt-logprobs")
    return ap.parse_args(argv)


def run_job(ns: argparse.Namespace) -> int:
    order = [a for a in ns.order.split(",") if a]
    if bad := [a for a in order if a not in ARMS]:
        print(f"error: --order: unknown arm {bad[0]!r} ({', '.join(ARMS)})", file=sys.stderr)
        return 2
    tag = ns.tag or time.strftime("%m%d%H%M%S", time.gmtime())
    out, workdir = Path(ns.out), Path("/tmp") / f"served-plp-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    gpu = GpuMemorySampler(ns.gpu)
    raw = {"tag": tag, "started_utc": utc_now(), "measured": True, "memory": "GPU" if gpu.available else "CPU", "runs": []}
    raw.update(prompt_tokens=ns.prompt_tokens, k=ns.k, requests=ns.requests, serve_args=ns.serve_args, plugin_settings=ns.plugin_settings)
    raw["model"] = ns.model_dir
    raw_f = out / f"served-prompt-logprobs-{tag}.json"
    for pos, arm in enumerate(order):
        run = run_arm(ns, arm, pos, workdir, gpu)
        raw["runs"].append({**asdict(run), "extra_peak_mib": run.extra_peak_mib})
        write_json_atomic(raw_f, raw, indent=1)
    raw["ended_utc"] = utc_now()
    write_json_atomic(raw_f, raw, indent=1)
    log(f"wrote {raw_f}")
    return 0


def record(raws: list[dict]) -> tuple[dict, str]:
    """The record (JSON) and its Markdown twin from raw files."""
    rows = [{"tag": r["tag"], "memory": r["memory"], **run} for r in raws for run in r["runs"]]
    ok = {arm: [all(q["status"] == 200 for q in x["requests"]) for x in rows if x["arm"] == arm] for arm in ARMS}
    rec = {"name": "served-prompt-logprobs", "measured": True, "simulated": False, "runs": rows, "all_requests_ok": ok}
    rec.update({k: raws[0].get(k) for k in ("prompt_tokens", "k", "serve_args", "plugin_settings", "model")})
    md = [
        f"# Prompt logprobs through vllm serve: stock vs --plugin powersave (measured, {raws[0]['memory']})\n",
        f"What ran: `benchmarks/served_prompt_logprobs.py`, one fresh server per run, {rec['prompt_tokens']}-token prompts, "
        f"prompt_logprobs={rec['k']}, max_tokens=1; serve flags `{rec['serve_args']}`; plugin settings `{rec['plugin_settings'] or 'defaults'}`.\n",
        "| run | arm | started (UTC) | requests ok | seconds | server alive after | peak extra MiB | memory source | first error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        err = next((q["error"] for q in x["requests"] if q["error"]), "")
        good = sum(q["status"] == 200 for q in x["requests"])
        extra = "n/a" if x["extra_peak_mib"] is None else f"{x['extra_peak_mib']:.0f}"
        secs = ", ".join(str(q["seconds"]) for q in x["requests"])
        md.append(
            f"| {x['tag']}/{x['pos']} | {x['arm']} | {x['started_utc']} | {good}/{len(x['requests'])} | {secs} | {x['alive_after']} | "
            f"{extra} | {x['memory_source']} | {err[:120]} |"
        )
    return rec, "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    require_dry_run()  # first: nothing may touch a GPU before this
    ns = parse_args(argv)
    if ns.record is not None:
        rec, md = record([json.loads(Path(f).read_text()) for f in ns.record])
        write_record(Path(ns.out_dir), ns.name, rec, md, keep_from="## Reading")
        print(md)
        return 0
    return run_job(ns)


if __name__ == "__main__":
    sys.exit(main())
