#!/usr/bin/env python3
"""Where does vllm bench serve's extra TTFT come from? Request function vs session set-up (CPU, measured).

One process, one event loop, the fake server with exact timing (TTFT ``--ttft-ms``, one chunk per
``--itl-ms``): rounds of ``--conc`` concurrent streamed completions, rotating between

- ours: ``loadtests.client.send_request`` on a session with ``trust_env=False`` (loadtests' default);
- vllm bench's ``async_request_openai_completions`` on a session built as vllm bench builds it
  (``trust_env=True``, its connector and timeout settings);
- the same vllm bench function on that session with ``trust_env=False``.

Everything but the compared piece is shared, so a TTFT difference belongs to that piece. Writes
``docs/results/ttft-session-probe.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics as st
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.client import send_request  # noqa: E402
from loadtests.datasets import RequestInput  # noqa: E402


def vllm_like_session(trust_env: bool, conc: int) -> aiohttp.ClientSession:
    """The session of vllm bench serve (vllm/benchmarks/serve.py, 0.32), with ``trust_env`` as given."""
    conn = aiohttp.TCPConnector(limit=conc, limit_per_host=conc, ttl_dns_cache=300, use_dns_cache=True,
                                keepalive_timeout=60, enable_cleanup_closed=True, force_close=False)
    return aiohttp.ClientSession(connector=conn, trust_env=trust_env, timeout=aiohttp.ClientTimeout(total=6 * 60 * 60))


async def probe(url: str, rounds: int, conc: int, out_len: int) -> dict[str, list[float]]:
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    prompt = "hello " * 40

    async def ours(session: aiohttp.ClientSession) -> float:
        o = await send_request(session, url, "completions", "model", RequestInput(prompt=prompt, prompt_len=40, output_len=out_len))
        return o.ttft

    async def theirs(session: aiohttp.ClientSession) -> float:
        o = await async_request_openai_completions(
            RequestFuncInput(prompt=prompt, api_url=url + "/v1/completions", prompt_len=40, output_len=out_len, model="model"), session)
        return o.ttft

    names = ("ours, trust_env=False", "vllm bench function, vllm bench session (trust_env=True)",
             "vllm bench function, vllm bench session with trust_env=False")
    res: dict[str, list[float]] = {n: [] for n in names}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc), trust_env=False) as a, \
            vllm_like_session(True, conc) as b, vllm_like_session(False, conc) as c:
        cases = list(zip(names, (ours, theirs, theirs), (a, b, c)))
        for r in range(rounds):
            for name, fn, sess in (cases if r % 2 == 0 else cases[::-1]):  # rotating order: no position effect
                ttfts = await asyncio.gather(*[fn(sess) for _ in range(conc)])
                res[name] += [1000.0 * t for t in ttfts]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "ttft-session-probe.json"))
    ns = ap.parse_args()
    srv = subprocess.Popen([sys.executable, "-m", "loadtests.fake_server", "--port", "0", "--ttft-ms", str(ns.ttft_ms),
                            "--itl-ms", str(ns.itl_ms)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None
        url = srv.stdout.readline().strip()
        res = asyncio.run(probe(url, ns.rounds, ns.conc, 16))
    finally:
        srv.terminate()
        srv.wait(10)
    rows = {k: {"requests": len(v), "median_ttft_ms": st.median(v), "mean_ttft_ms": st.mean(v), "min_ttft_ms": min(v),
                "median_minus_true_ms": st.median(v) - ns.ttft_ms} for k, v in res.items()}
    doc = {"benchmark": "TTFT of the same requests through loadtests' and vllm bench serve's request code (measured, CPU)",
           "measured": True, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "config": {"fake_ttft_ms": ns.ttft_ms, "fake_itl_ms": ns.itl_ms, "rounds": ns.rounds, "concurrency": ns.conc,
                      "output_tokens": 16, "order": "the three cases rotate, reversed every other round"},
           "cases": rows}
    out = Path(ns.out)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    lines = ["# TTFT: request code vs session set-up (measured, CPU)", "",
             f"- {doc['date_utc']} (UTC), `benchmarks/ttft_session_probe.py`. One process and one event loop against the fake server "
             f"(TTFT exactly {ns.ttft_ms:g} ms, a chunk every {ns.itl_ms:g} ms), {ns.rounds} rounds of {ns.conc} concurrent streamed "
             "completions per case, the cases rotating. Only the named piece differs between cases.", "",
             "| case | requests | median TTFT (ms) | minus the true TTFT (ms) | mean (ms) | min (ms) |", "|---|---|---|---|---|---|"]
    for k, r in rows.items():
        lines.append(f"| {k} | {r['requests']} | {r['median_ttft_ms']:.2f} | {r['median_minus_true_ms']:+.2f} | {r['mean_ttft_ms']:.2f} | {r['min_ttft_ms']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
