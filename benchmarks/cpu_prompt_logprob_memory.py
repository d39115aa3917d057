#!/usr/bin/env python3
"""Peak memory of prompt-logprob requests through a real vLLM CPU server, LM-head chunking on vs off.

Why: the chunked LM head must never raise peak memory, and whether it lowers it in serving depends
on vLLM, not on the head alone: with ``prompt_logprobs`` vLLM's runner takes the logits of every
prompt position from the head and then computes an fp32 log-softmax over all of them in its own
code (``Sampler.compute_logprobs``), which no LM-head hook reaches.

What runs: ``vllm serve`` (this machine's CPU build) on the ``qwen2-tiny`` body with its vocabulary
widened to 151,936 (the Qwen2.5 size; ``--load-format dummy``, so the LM head is as wide as a real
one while the body stays cheap), the plugin on in both arms; arm ``off``: no chunking table, arm
``on``: 8 chunks from 256 rows. Each server is fresh (ABBA order); after one warm-up request, the
engine-core process's VmHWM (peak resident set, /proc) is read, then ``--requests`` completions
with ``prompt_logprobs=1`` over a ``--prompt-tokens``-token prompt run one after another, and VmHWM
is read again. Writes docs/results/cpu-prompt-logprob-memory.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import re
import statistics as st
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_powersave.modelgen import make_model  # noqa: E402
from vllm_powersave.serving import VllmServer, default_serve_args  # noqa: E402

VOCAB = 151936
CHUNK_TABLE = [{"min_rows": 256, "chunks": 8}]


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _status(pid: int) -> dict[str, object]:
    text = Path(f"/proc/{pid}/status").read_text()
    kb = {k: int(v) for k, v in re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", text, re.M)}
    return {"pid": pid, "comm": Path(f"/proc/{pid}/comm").read_text().strip(), "vm_hwm_mib": kb["VmHWM"] / 1024, "vm_rss_mib": kb["VmRSS"] / 1024}


def _engine(server: VllmServer) -> dict[str, object]:
    procs = []
    for p in _descendants(server.proc.pid):
        try:
            procs.append(_status(p))
        except (OSError, KeyError):
            pass
    engines = [p for p in procs if str(p["comm"]).startswith("VLLM::EngineCor")]
    return max(engines or procs, key=lambda p: p["vm_hwm_mib"])


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _chunk_calls(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^powersave_lm_head_calls_total\{chunks="(\d+)"[^}]*\} (\S+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def run_arm(model: Path, arm: str, prompt_tokens: int, requests: int, log_dir: Path, seed: int) -> dict:
    cfg = {"powersave": {"chunking": {"table": CHUNK_TABLE if arm == "on" else []}}}
    args = default_serve_args(str(model)) + ["--load-format", "dummy", "--max-model-len", str(prompt_tokens + 16),
                                             "--max-num-batched-tokens", str(max(4096, prompt_tokens + 16)),
                                             "--plugin", "powersave", "--additional-config", json.dumps(cfg)]
    srv = VllmServer(args, log_path=log_dir / f"server-{arm}-{seed}.log")
    t0 = time.monotonic()
    srv.start()
    try:
        _post(srv.base_url + "/v1/completions", {"model": "model", "prompt": "hello", "max_tokens": 2})
        before = _engine(srv)
        rng = random.Random(seed)
        seconds = []
        for _ in range(requests):
            ids = [rng.randrange(10, 4000) for _ in range(prompt_tokens)]
            t = time.monotonic()
            resp = _post(srv.base_url + "/v1/completions", {"model": "model", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1})
            seconds.append(time.monotonic() - t)
            assert len(resp["choices"][0]["prompt_logprobs"]) == prompt_tokens
        time.sleep(1.0)  # one publish period of the worker's counters
        after = _engine(srv)
        calls = _chunk_calls(srv.base_url)
    finally:
        srv.stop()
    return {"arm": arm, "engine_process": after["comm"], "vm_hwm_mib_after_warmup": round(before["vm_hwm_mib"], 1),
            "vm_hwm_mib": round(after["vm_hwm_mib"], 1), "vm_hwm_increase_mib": round(after["vm_hwm_mib"] - before["vm_hwm_mib"], 1),
            "request_s": [round(s, 2) for s in seconds], "lm_head_calls_by_chunks": calls,
            "server_s": round(time.monotonic() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=1, help="ABBA blocks: 2 servers per arm each")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "cpu-prompt-logprob-memory"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plp-mem-"))
    model = make_model(work / "qwen2-tiny-wide", "qwen2-tiny", weights=False)
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] = VOCAB
    cfg_path.write_text(json.dumps(cfg, indent=2))
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    runs = []
    for i in range(a.pairs):
        for j, arm in enumerate(("off", "on", "on", "off")):
            r = run_arm(model, arm, a.prompt_tokens, a.requests, work, seed=4 * i + j)
            print(json.dumps(r), flush=True)
            runs.append(r)
    by = {arm: [r for r in runs if r["arm"] == arm] for arm in ("off", "on")}
    summary = {arm: {"vm_hwm_mib_median": st.median(r["vm_hwm_mib"] for r in rs),
                     "vm_hwm_increase_mib_median": st.median(r["vm_hwm_increase_mib"] for r in rs),
                     "servers": len(rs)} for arm, rs in by.items()}
    rows, vocab = a.prompt_tokens, VOCAB
    record = {
        "name": "cpu-prompt-logprob-memory", "measured": True, "simulated": False, "started_utc": started,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "vllm": __import__("vllm").__version__,
        "what_ran": (f"vllm serve (CPU build) qwen2-tiny body, vocab {vocab}, --load-format dummy, bfloat16; plugin on in both arms; "
                     f"off: no chunking table, on: {CHUNK_TABLE}; fresh server per run, ABBA; after one warm-up request, "
                     f"{a.requests} sequential completions with prompt_logprobs=1 over {rows} random prompt token ids, max_tokens=1; "
                     "engine-core VmHWM from /proc before and after"),
        "prompt_tokens": rows, "requests_per_server": a.requests,
        "logits_bytes": {"head_output_bf16_mib": round(rows * vocab * 2 / 2**20, 1), "fp32_copy_mib": round(rows * vocab * 4 / 2**20, 1)},
        "runs": runs, "summary": summary,
        "difference_on_minus_off_mib": round(summary["on"]["vm_hwm_mib_median"] - summary["off"]["vm_hwm_mib_median"], 1),
    }
    Path(a.out + ".json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
