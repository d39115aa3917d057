"""Benchmark configuration (pydantic v2) with one-line validation errors."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import ConfigError

#: SLO keys accepted by ``goodput`` (values are milliseconds), as in ``vllm bench serve``.
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def _one_line(err: ValidationError, data: dict[str, Any]) -> str:
    """Collapse a pydantic ValidationError into ``invalid config: field 'x' = v: reason; ...``."""
    parts = []
    for e in err.errors():
        msg = " ".join(str(e["msg"]).removeprefix("Value error, ").split())
        if not e["loc"]:  # a cross-field rule: its message names the fields itself
            parts.append(msg)
            continue
        loc = ".".join(str(p) for p in e["loc"])
        top = e["loc"][0]
        # Show the value the user gave for the top-level field: nested locations
        # (e.g. goodput.ttft) are easier to fix when the whole value is visible.
        value = data.get(top, e.get("input")) if isinstance(top, str) else e.get("input")
        parts.append(f"field '{loc}' = {value!r}: {msg}")
    return "invalid config: " + "; ".join(parts)


def normalize_url(v: str) -> str:
    """``http(s)://host:port`` without trailing ``/`` or ``/v1``; ValueError otherwise."""
    v = v.strip()
    if not (v.startswith("http://") or v.startswith("https://")) or len(v.split("://", 1)[1]) == 0:
        raise ValueError(f"{v!r} must start with http:// or https:// and name a host")
    v = v.rstrip("/")
    # Accept ".../v1" as users often paste the OpenAI base URL; endpoints add /v1 themselves.
    if v.endswith("/v1"):
        v = v[: -len("/v1")]
    return v


class BenchConfig(BaseModel):
    """One benchmark run against an OpenAI-compatible server.

    Times are seconds unless the name says otherwise; ``goodput`` thresholds are ms.
    Constructing with a bad value raises :class:`~loadtests.errors.ConfigError`
    (a ``ValueError``) whose message is one line naming the field and the value.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    base_url: str = "http://127.0.0.1:8000"
    #: A fleet: several servers behind no router; requests go round-robin. ``base_url`` is then the
    #: first of them. Only these addresses (and nothing they redirect to) are ever contacted.
    base_urls: list[str] | None = None
    model: str | None = None
    endpoint: Literal["completions", "chat"] = "completions"
    stream: bool = True
    #: Ask for per-chunk usage (``stream_options.continuous_usage_stats``, vLLM): each chunk's token
    #: count is then known, so ITL is per token and an empty-text chunk that carries a token starts TTFT.
    #: Off by default, as vllm bench serve (servers that lack it may refuse the field).
    continuous_usage_stats: bool = False
    num_prompts: int = Field(default=100, ge=1)
    max_concurrency: int | None = Field(default=None, ge=1)
    request_rate: float = Field(default=math.inf, gt=0)
    burstiness: float = Field(default=1.0, gt=0)
    input_len: int = Field(default=1024, ge=1)
    output_len: int = Field(default=128, ge=1)
    range_ratio: float = Field(default=0.0, ge=0, lt=1)
    num_warmups: int = Field(default=0, ge=0)
    seed: int = 0
    timeout_s: float = Field(default=1800.0, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    goodput: dict[str, float] = Field(default_factory=dict)
    percentiles: list[float] = Field(default_factory=lambda: [50.0, 90.0, 99.0])
    dataset: str = "random"
    prompt_logprobs: int | None = Field(default=None, ge=0)
    label: str | None = None
    gpus: list[int] | None = None
    #: Energy source: "auto" (server powersave_* metrics, else local NVML), "server", "nvml"
    #: (local NVML even when the server publishes metrics: the fair choice for A/B against a stock
    #: server on the same GPU), "zeusd" (Zeus's daemon at ``zeusd``: the GPUs of its host, also
    #: remote; JWT from ``$ZEUSD_TOKEN``) or "none".
    energy: Literal["auto", "server", "nvml", "zeusd", "none"] = "auto"
    #: zeusd address for ``energy="zeusd"``: ``http://host:4938`` (TCP mode) or its Unix socket path.
    zeusd: str | None = Field(default=None, min_length=1)
    #: Stop starting requests after this many seconds (requests already running finish); with a
    #: large ``num_prompts`` this gives fixed-length measurement windows (e.g. >= 15 s for NVML).
    duration_s: float | None = Field(default=None, gt=0)
    #: Inter-arrival law of open-loop runs: gamma (shape ``burstiness``; 1 = Poisson) or constant.
    arrival: Literal["gamma", "constant"] = "gamma"
    #: Scale a fixed-rate gamma schedule so its last request goes out at (n - 1) / rate, as
    #: ``vllm bench serve`` does (its throughput then does not depend on the seed's draw).
    normalize_arrivals: bool = True
    #: Let aiohttp read HTTP(S)_PROXY / NO_PROXY and ~/.netrc for every request, as vllm bench serve's
    #: session does (``trust_env=True``). Off by default: only the given URLs are contacted, and the
    #: per-request lookup sits inside the measured TTFT (+3 ms per request against the fake server, measured).
    trust_env: bool = False
    #: Ramp-up (names as ``vllm bench serve``): rate goes from start to end rps over
    #: ``ramp_up_duration_s`` (then held), or over the whole run when that is None.
    ramp_up_strategy: Literal["linear", "exponential"] | None = None
    ramp_up_start_rps: float | None = Field(default=None, gt=0)
    ramp_up_end_rps: float | None = Field(default=None, gt=0)
    ramp_up_duration_s: float | None = Field(default=None, gt=0)
    #: Timed trace (JSONL: timestamp, prompt | input_len, output_len): replaces dataset and arrivals.
    trace: str | None = None
    trace_time_scale: float = Field(default=1.0, gt=0)
    #: prefix-repetition dataset: shared prefix length (tokens) and number of prefix groups.
    prefix_len: int = Field(default=256, ge=1)
    num_prefixes: int = Field(default=10, ge=1)
    #: ShareGPT: fixed output length instead of the reply's length.
    sharegpt_output_len: int | None = Field(default=None, ge=1)
    #: Local Hugging Face tokenizer directory for dataset lengths (never downloaded).
    tokenizer: str | None = None
    #: Per-request limit, s: a stalled stream becomes a counted failure (the run limit is timeout_s).
    request_timeout_s: float | None = Field(default=None, gt=0)
    #: Progress bar on stderr (shown only when stderr is a terminal).
    progress: bool = True
    #: Target concurrency B of the steady-state window (ML.ENERGY rule); default max_concurrency.
    steady_state_batch: int | None = Field(default=None, ge=1)
    #: Period of energy/power/clock samples during the run, s (0 = only the window edges).
    sample_interval_s: float = Field(default=0.5, ge=0)
    #: Period of ``/metrics`` scrapes of the server under test between the window's edges, s (0 =
    #: the edges only). Every energy source gets them, so that a server with the plugin and one
    #: without see the same client: a scrape of vLLM's ~61 kB ``/metrics`` lands on the API server's
    #: event loop, which is the bottleneck at high concurrency (docs/results/h200-under-load.md).
    #: 15 s is within what operators use (Prometheus scrape intervals of 10-30 s). Where the server's
    #: counters are the energy source, energy samples come at this period too; local NVML and zeusd
    #: keep ``sample_interval_s``.
    metrics_interval_s: float = Field(default=15.0, ge=0)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(_one_line(e, data)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise ConfigError(_one_line(e, {name: value})) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> BenchConfig:  # type: ignore[override]
        """Like pydantic's, but raises :class:`ConfigError` with a one-line message."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            # pydantic routes validation through our __init__ and wraps its ConfigError; unwrap it.
            for err in e.errors():
                inner = (err.get("ctx") or {}).get("error")
                if isinstance(inner, ConfigError):
                    raise inner from None
            raise ConfigError(_one_line(e, obj if isinstance(obj, dict) else {})) from None

    @property
    def endpoints(self) -> list[str]:
        """The server base URLs of this run (one, or the fleet)."""
        return list(self.base_urls) if self.base_urls else [self.base_url]

    @model_validator(mode="before")
    @classmethod
    def _fleet_first(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("base_urls"):
            urls = data["base_urls"]
            if isinstance(urls, list) and urls and isinstance(urls[0], str):
                data = {**data, "base_url": urls[0]}
        return data

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, v: str) -> str:
        return normalize_url(v)

    @field_validator("base_urls")
    @classmethod
    def _check_base_urls(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("need at least one URL")
        urls = [normalize_url(u) for u in v]
        dup = sorted({u for u in urls if urls.count(u) > 1})
        if dup:
            raise ValueError(f"duplicate endpoint {dup[0]}")
        return urls

    @model_validator(mode="after")
    def _check_combinations(self) -> BenchConfig:
        ramp = (self.ramp_up_strategy, self.ramp_up_start_rps, self.ramp_up_end_rps)
        if any(x is not None for x in ramp) and any(x is None for x in ramp):
            raise ValueError(
                "ramp_up_strategy, ramp_up_start_rps and ramp_up_end_rps must be given together "
                f"(got {ramp[0]!r}, {ramp[1]!r}, {ramp[2]!r})"
            )
        if self.ramp_up_duration_s is not None and self.ramp_up_strategy is None:
            raise ValueError("ramp_up_duration_s needs ramp_up_strategy")
        if self.ramp_up_strategy is not None and math.isfinite(self.request_rate):
            raise ValueError(f"request_rate = {self.request_rate:g} conflicts with ramp_up_strategy: the ramp sets the rate")
        if not self.stream and "tpot" in self.goodput:
            raise ValueError(
                "goodput SLO tpot cannot be judged without streaming (non-streaming TTFT = E2E, so TPOT is "
                "always 0): drop tpot or use streaming"
            )
        if self.continuous_usage_stats and not self.stream:
            raise ValueError("continuous_usage_stats = true needs stream = true: per-chunk usage exists only in streams")
        if self.stream and self.prompt_logprobs:
            # vLLM answers 400 to every such request (CompletionRequest.check_logprobs), so refuse before the run.
            raise ValueError(
                f"prompt_logprobs = {self.prompt_logprobs} needs stream = false: vLLM returns prompt "
                "logprobs only on non-streamed requests (--no-stream)"
            )
        if (self.energy == "zeusd") != (self.zeusd is not None):
            raise ValueError(
                f"energy = {self.energy!r} with zeusd = {self.zeusd!r}: energy 'zeusd' needs the daemon's address "
                "(zeusd = http://host:4938 or a socket path), and only it uses one"
            )
        if self.trace is not None:
            if self.ramp_up_strategy is not None or math.isfinite(self.request_rate):
                raise ValueError("trace replay sets the arrival times itself: drop request_rate / ramp-up")
            if self.dataset != "random":
                raise ValueError(f"trace replay carries its own prompts: drop dataset = {self.dataset!r}")
        return self

    @field_validator("goodput")
    @classmethod
    def _check_goodput(cls, v: dict[str, float]) -> dict[str, float]:
        for k, ms in v.items():
            if k not in GOODPUT_KEYS:
                raise ValueError(f"unknown SLO {k!r}; expected one of {', '.join(GOODPUT_KEYS)}")
            if not (ms > 0 and math.isfinite(ms)):
                raise ValueError(f"SLO {k} must be a positive number of ms, got {ms}")
        return v

    @field_validator("percentiles")
    @classmethod
    def _check_percentiles(cls, v: list[float]) -> list[float]:
        if not v:
            raise ValueError("need at least one percentile")
        for p in v:
            if not 0 <= p <= 100:
                raise ValueError(f"percentile {p} is outside [0, 100]")
        return v

    @field_validator("dataset")
    @classmethod
    def _check_dataset(cls, v: str) -> str:
        if v in ("random", "prefix-repetition"):
            return v
        for kind in ("jsonl:", "sharegpt:"):
            if v.startswith(kind) and len(v) > len(kind):
                return v
        raise ValueError("expected 'random', 'prefix-repetition', 'jsonl:PATH' or 'sharegpt:PATH'")

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(i < 0 for i in v):
            raise ValueError("GPU indices must be >= 0")
        return v
