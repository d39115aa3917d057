"""A small OpenAI-compatible fake server (aiohttp) with exact timing and error injection.

Used by the tests (in a thread: :meth:`FakeServer.start`) and by harness benchmarks (in their own
process: ``python -m loadtests.fake_server --port 0``; ``docs/results/harness-overhead.md``). It binds to 127.0.0.1 only.

Timing: the first text chunk is written ``first_delay`` s after the request arrives, each further
chunk ``itl_delay`` s after the previous one (0 = no sleep at all).

Energy (deterministic, labelled ``simulated`` unless ``sources`` says otherwise): each request adds
``PREFILL_J`` to the ``prefill`` series and ``DECODE_J`` per generated token to ``decode``; the
``idle`` series grows by ``idle_power_w`` x the time with no request in flight. Values are dyadic,
so float sums are exact. Also published: ``powersave_gpu_power_watts`` (100 W + 10 W per request in
flight), ``powersave_sm_clock_mhz`` (345 idle, 1980 while a prefill was the last event, 1200 in
decode), ``powersave_steps_total`` and vLLM's ``vllm:num_requests_running``.

Prompt markers inject faults: ``MALFORMED`` (bad JSON chunk mid-stream), ``HTTP500`` (error
status), ``SLOW`` (first token after ``slow_delay``), ``HANG`` (no answer for 30 s), ``STALL``
(one token, then silence for 30 s), ``NODONE`` (stream closes without ``[DONE]``), ``BADUTF8``
(a chunk with invalid UTF-8), ``ERRCHUNK`` (an ``{"error": ...}`` chunk mid-stream), ``EMPTYFIRST``
(the first two token chunks carry empty text, like tokens that do not decode to text alone),
``EMPTYDELTA`` (an empty delta carrying no token right away, before the first token, as some servers
send). With ``stream_options.continuous_usage_stats`` every choice chunk carries ``usage`` with the
completion tokens so far (vLLM's per-chunk usage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from typing import Any

from aiohttp import web

PREFILL_J = 0.5
DECODE_J = 0.25
#: Starvation the fake books per finished request: idle-while-busy J and s (busy time: ten times that).
STARVED_J = 0.1
STARVED_S = 0.002
CLOCKS_MHZ = {"idle": 345.0, "prefill": 1980.0, "decode": 1200.0}


class FakeServer:
    """Fake ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and ``/metrics``."""

    def __init__(
        self,
        *,
        first_delay: float = 0.02,
        itl_delay: float = 0.002,
        slow_delay: float = 0.4,
        usage: bool = True,
        tokens_per_chunk: int = 1,
        metrics: bool = True,
        sources: dict[str, str] | None = None,
        typed_total: bool = False,
        idle_power_w: float = 0.0,
        model: str = "fake-model",
        record_payloads: bool = True,
        powersave: bool = True,
    ) -> None:
        self.first_delay = first_delay
        self.itl_delay = itl_delay
        self.slow_delay = slow_delay
        self.usage = usage
        self.tokens_per_chunk = tokens_per_chunk
        self.metrics = metrics
        self.sources = sources or {"prefill": "simulated", "decode": "simulated", "idle": "simulated"}
        self.typed_total = typed_total
        self.idle_power_w = idle_power_w
        self.model = model
        self.record_payloads = record_payloads
        self.powersave = powersave  # False: /metrics has vLLM's own series only (stock vLLM)
        self.energy = {"prefill": 0.0, "decode": 0.0, "idle": 3.0}
        self.steps = {"prefill": 0, "decode": 0}
        self.last_event = "idle"
        self.payloads: list[dict[str, Any]] = []
        self.metrics_scrapes = 0
        self.crosscheck_ratio: float | None = None  # set: published as powersave_energy_crosscheck_ratio{gpu="0"}
        self.info: dict[str, str] | None = None  # set: published as powersave_info{...} 1
        self.finished = 0  # requests whose handler returned (each books STARVED_J of starvation)
        self.inflight = 0
        self.max_inflight = 0
        self.url = ""
        self._idle_since: float | None = time.perf_counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # -- lifecycle -------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        if self.metrics:
            app.router.add_get("/metrics", self._metrics)
        return app

    async def start_async(self, port: int = 0) -> str:
        """Serve on 127.0.0.1:``port`` (0 = any free port) in the running loop; returns the URL."""
        # handler_cancellation: a HANG handler dies when the client gives up, so shutdown is quick.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    def start(self) -> FakeServer:
        """Serve from a daemon thread with its own event loop (for synchronous tests)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.start_async(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        assert self._runner is not None and self._loop is not None and self._thread is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # -- state -----------------------------------------------------------------------
    def _book_idle(self) -> None:
        now = time.perf_counter()
        if self._idle_since is not None:
            self.energy["idle"] += self.idle_power_w * (now - self._idle_since)
            self._idle_since = now

    def _enter(self) -> None:
        self._book_idle()
        self._idle_since = None
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)

    def _leave(self) -> None:
        self.inflight -= 1
        self.finished += 1
        if self.inflight == 0:
            self._idle_since = time.perf_counter()
            self.last_event = "idle"

    # -- handlers --------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        # vLLM lists the model's path as "root"; the fake lists a made-up one the same way.
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "root": f"/models/{self.model}-weights"}]}
        )

    def metrics_text(self) -> str:
        """Prometheus text of the current counters and gauges."""
        self._book_idle()
        name = "powersave_gpu_energy_joules_total" if self.typed_total else "powersave_gpu_energy_joules"
        src = sorted(set(self.sources.values()))[0]
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} {float(self.inflight)}',
        ]
        if not self.powersave:
            return "\n".join(lines) + "\n"
        lines += [
            f"# HELP {name} GPU energy by phase",
            f"# TYPE {name} counter",
        ]
        for phase, v in self.energy.items():
            labels = f'gpu="0",phase="{phase}",source="{self.sources[phase]}"'
            lines.append(f"powersave_gpu_energy_joules_total{{{labels}}} {v!r}")
            lines.append(f"powersave_gpu_energy_joules_created{{{labels}}} 1.7e9")
        lines += [
            "# TYPE powersave_idle_while_busy_energy_joules counter",
            f'powersave_idle_while_busy_energy_joules_total{{gpu="0",source="{src}"}} {STARVED_J * self.finished!r}',
            "# TYPE powersave_idle_while_busy_seconds counter",
            f'powersave_idle_while_busy_seconds_total{{gpu="0"}} {STARVED_S * self.finished!r}',
            "# TYPE powersave_frontend_busy_seconds counter",
            f'powersave_frontend_busy_seconds_total{{gpu="0"}} {10 * STARVED_S * self.finished!r}',
        ]
        if self.info is not None:
            labels = ",".join(f'{k}="{v}"' for k, v in self.info.items())
            lines += ["# TYPE powersave_info gauge", f"powersave_info{{{labels}}} 1.0"]
        if self.crosscheck_ratio is not None:
            lines += [
                "# TYPE powersave_energy_crosscheck_ratio gauge",
                f'powersave_energy_crosscheck_ratio{{gpu="0"}} {self.crosscheck_ratio!r}',
            ]
        lines += ["# TYPE powersave_steps counter"]
        lines += [f'powersave_steps_total{{gpu="0",phase="{p}"}} {float(n)}' for p, n in self.steps.items()]
        lines += [
            "# TYPE powersave_gpu_power_watts gauge",
            f'powersave_gpu_power_watts{{gpu="0",source="{src}"}} {100.0 + 10.0 * self.inflight}',
            "# TYPE powersave_sm_clock_mhz gauge",
            f'powersave_sm_clock_mhz{{gpu="0",source="{src}"}} {CLOCKS_MHZ[self.last_event]}',
            "# TYPE other_metric gauge",
            "other_metric 42.0",
        ]
        return "\n".join(lines) + "\n"

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.record_payloads:
            self.payloads.append(body)
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if "HTTP500" in prompt:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self._enter()
        try:
            return await self._generate(request, body, chat, prompt)
        finally:
            self._leave()

    async def _generate(self, request: web.Request, body: dict[str, Any], chat: bool, prompt: str) -> web.StreamResponse:
        self.energy["prefill"] += PREFILL_J
        self.steps["prefill"] += 1
        self.last_event = "prefill"
        n = int(body["max_tokens"])
        usage = {"prompt_tokens": len(prompt.split()) + 1, "completion_tokens": n, "total_tokens": 0}
        first = self.slow_delay if "SLOW" in prompt else self.first_delay
        if "HANG" in prompt:
            await asyncio.sleep(30)
        if not body.get("stream"):
            if first:
                await asyncio.sleep(first)
            self.energy["decode"] += DECODE_J * n
            text = " ".join(f"tok{i}" for i in range(n))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            out: dict[str, Any] = {"choices": [choice]}
            if self.usage:
                out["usage"] = usage
            return web.json_response(out)

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        per_chunk_usage = bool(self.usage and (body.get("stream_options") or {}).get("continuous_usage_stats"))

        def chunk(choice: dict[str, Any], tokens: int) -> dict[str, Any]:
            out: dict[str, Any] = {"choices": [choice]}
            if per_chunk_usage:
                out["usage"] = usage | {"completion_tokens": tokens}
            return out

        if chat:  # role-only chunk with empty content must not count as the first token
            await send(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}}, 0))
        if "EMPTYDELTA" in prompt:  # an empty delta before any work: not a token
            await send(chunk({"index": 0, "delta": {"content": ""}} if chat else {"index": 0, "text": ""}, 0))
        sent = 0
        while sent < n:
            delay = first if sent == 0 else self.itl_delay
            if delay:
                await asyncio.sleep(delay)
            k = min(self.tokens_per_chunk, n - sent)
            self.energy["decode"] += DECODE_J * k
            self.steps["decode"] += k
            self.last_event = "decode"
            text = "" if "EMPTYFIRST" in prompt and sent < 2 else "".join(f" tok{sent + j}" for j in range(k))
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            await send(chunk(choice, sent + k))
            sent += k
            if "MALFORMED" in prompt:
                await send("{this is not json")
                return resp
            if "BADUTF8" in prompt:
                await resp.write(b'data: {"choices": [{"text": "\xff\xfe"}]}\n\n')
            if "ERRCHUNK" in prompt:
                await send({"error": {"message": "engine died", "code": 500}})
                return resp
            if "STALL" in prompt:
                await asyncio.sleep(30)
            if "NODONE" in prompt:
                return resp
        if self.usage and body.get("stream_options", {}).get("include_usage"):
            await send({"choices": [], "usage": usage})
        await send("[DONE]")
        return resp


def main(argv: list[str] | None = None) -> None:
    """``python -m loadtests.fake_server --port 0``: serve until killed; prints the URL first."""
    p = argparse.ArgumentParser(prog="python -m loadtests.fake_server", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--no-usage", action="store_true")
    ns = p.parse_args(argv)

    async def serve() -> None:
        srv = FakeServer(first_delay=ns.ttft_ms / 1000.0, itl_delay=ns.itl_ms / 1000.0, usage=not ns.no_usage, record_payloads=False)
        print(await srv.start_async(ns.port), flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
