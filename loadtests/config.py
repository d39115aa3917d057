"""Benchmark configuration (pydantic v2) with one-line validation errors."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError

#: SLO keys accepted by ``goodput`` (values are milliseconds), as in ``vllm bench serve``.
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def _one_line(err: ValidationError, data: dict[str, Any]) -> str:
    """Collapse a pydantic ValidationError into ``invalid config: field 'x' = v: reason; ...``."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<config>"
        top = e["loc"][0] if e["loc"] else None
        # Show the value the user gave for the top-level field: nested locations
        # (e.g. goodput.ttft) are easier to fix when the whole value is visible.
        value = data.get(top, e.get("input")) if isinstance(top, str) else e.get("input")
        msg = " ".join(str(e["msg"]).removeprefix("Value error, ").split())
        parts.append(f"field '{loc}' = {value!r}: {msg}")
    return "invalid config: " + "; ".join(parts)


class BenchConfig(BaseModel):
    """One benchmark run against an OpenAI-compatible server.

    Times are seconds unless the name says otherwise; ``goodput`` thresholds are ms.
    Constructing with a bad value raises :class:`~loadtests.errors.ConfigError`
    (a ``ValueError``) whose message is one line naming the field and the value.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: Literal["completions", "chat"] = "completions"
    stream: bool = True
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
    #: server on the same GPU) or "none".
    energy: Literal["auto", "server", "nvml", "none"] = "auto"
    #: Stop starting requests after this many seconds (requests already running finish); with a
    #: large ``num_prompts`` this gives fixed-length measurement windows (e.g. >= 15 s for NVML).
    duration_s: float | None = Field(default=None, gt=0)

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

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, v: str) -> str:
        v = v.strip()
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError("must start with http:// or https://")
        v = v.rstrip("/")
        # Accept ".../v1" as users often paste the OpenAI base URL; endpoints add /v1 themselves.
        if v.endswith("/v1"):
            v = v[: -len("/v1")]
        return v

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
        if v != "random" and not (v.startswith("jsonl:") and len(v) > len("jsonl:")):
            raise ValueError("expected 'random' or 'jsonl:PATH'")
        return v

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(i < 0 for i in v):
            raise ValueError("GPU indices must be >= 0")
        return v
