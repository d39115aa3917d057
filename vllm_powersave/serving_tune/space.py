"""The search space: settings that need no privilege, each a ``vllm serve`` flag or a plugin setting.

A configuration is one value per searched setting; a setting left out of the space keeps vLLM's
(or the plugin's) default and is not passed at all. The space is a grid (every combination of the
listed values), capped at ``max_configs`` by a seeded sample that always keeps the first value of
every setting together (the first listed configuration). Settings that cannot act on this machine
are skipped with a stated reason (:func:`applicable`): without a GPU there are no CUDA graphs, no
CUDA perf boost and no clock to set; without clock permission (or under
``POWERSAVE_FORCE_DRY_RUN=1``) the closed-loop budget would be predicted only, never measured.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

#: The searchable settings, in the order a configuration names them.
SETTINGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "api_server_count",
    "async_scheduling",
    "stream_interval",
    "cudagraph_capture_sizes",
    "cuda_perf_boost",
    "closed_loop_budget_pct",
    "decode_pacing_tpot_ms",
)
#: Settings that are plugin settings (``--additional-config``), not ``vllm serve`` flags.
PLUGIN_SETTINGS = ("cuda_perf_boost", "closed_loop_budget_pct", "decode_pacing_tpot_ms")
#: Settings that set GPU clocks (skipped where clocks may not be set).
CLOCK_SETTINGS = ("closed_loop_budget_pct",)
#: Settings that need a CUDA GPU to act at all.
GPU_SETTINGS = ("cudagraph_capture_sizes", "cuda_perf_boost", "closed_loop_budget_pct")


class SpaceError(ValueError):
    """A space that cannot be searched; the message is one line naming the field and the value."""


class SpaceSpec(BaseModel):
    """The values to try per setting (``--space FILE`` or the flags); ``None``: not searched. Types
    are strict: ``true`` or ``"8"`` is refused as a count, ``1`` or ``"yes"`` as a boolean and
    ``"5"`` as a percent (an integer is taken where a float is asked)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_num_seqs: list[StrictInt] | None = Field(default=None, min_length=1)
    max_num_batched_tokens: list[StrictInt] | None = Field(default=None, min_length=1)
    api_server_count: list[StrictInt] | None = Field(default=None, min_length=1)
    async_scheduling: list[bool] | None = Field(default=None, min_length=1)
    #: Output tokens the API server gathers per streamed chunk (vLLM's ``--stream-interval``): fewer
    #: chunks cost the front end less per token, while each chunk's gap (the ITL a client sees) grows.
    stream_interval: list[StrictInt] | None = Field(default=None, min_length=1)
    #: Each value is one list of batch sizes vLLM captures CUDA graphs for.
    cudagraph_capture_sizes: list[list[StrictInt]] | None = Field(default=None, min_length=1)
    cuda_perf_boost: list[Literal["on", "off", "auto"]] | None = Field(default=None, min_length=1)
    #: Closed-loop decode clock's slowdown budget, percent; ``null`` is the closed loop off.
    closed_loop_budget_pct: list[float | None] | None = Field(default=None, min_length=1)
    #: Decode pacing's TPOT target, ms (pacing/pacer.py); ``null`` is pacing off.
    decode_pacing_tpot_ms: list[float | None] | None = Field(default=None, min_length=1)

    def searched(self) -> dict[str, list[Any]]:
        """``setting -> values`` of the settings in the space, in :data:`SETTINGS` order."""
        return {k: list(v) for k in SETTINGS if (v := getattr(self, k)) is not None}


#: Bounds checked before anything starts (vLLM checks the rest and may refuse a configuration).
_BOUNDS: dict[str, tuple[float, float]] = {
    "max_num_seqs": (1, 65536),
    "max_num_batched_tokens": (1, 10_000_000),
    "api_server_count": (1, 64),
    "stream_interval": (1, 4096),
    "closed_loop_budget_pct": (0.0, 100.0),
    "decode_pacing_tpot_ms": (0.1, 1000.0),
}


def parse_space(data: dict[str, Any], where: str) -> SpaceSpec:
    """A :class:`SpaceSpec` from a mapping; :class:`SpaceError` (one line: where, field, value) otherwise."""
    boost = data.get("cuda_perf_boost") if isinstance(data, dict) else None
    if isinstance(boost, list):  # YAML 1.1 reads bare on/off as booleans: the setting's values are the words
        data = {**data, "cuda_perf_boost": [{True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v for v in boost]}
    try:
        spec = SpaceSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1]) or "space"
        value = data.get(field) if isinstance(data, dict) else data
        raise SpaceError(f"{where}: field {field!r} = {value!r}: {err['msg']}") from None
    for name, values in spec.searched().items():
        lo, hi = _BOUNDS.get(name, (None, None))
        for v in values:
            items = v if isinstance(v, list) else [v]
            if name == "cudagraph_capture_sizes" and (not items or any(x < 1 for x in items)):
                raise SpaceError(f"{where}: field {name!r} = {v!r}: each value is a non-empty list of batch sizes >= 1")
            if lo is not None and v is not None and not lo <= v <= hi:
                raise SpaceError(f"{where}: field {name!r} = {v!r}: must be in [{lo:g}, {hi:g}]")
        if len({json.dumps(v) for v in values}) != len(values):
            raise SpaceError(f"{where}: field {name!r} = {values!r}: a value is listed twice")
    return spec


def load_space_file(path: str | Path) -> SpaceSpec:
    """The space of a YAML or JSON file (a mapping of setting -> list of values)."""
    where = f"--space {path}"
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise SpaceError(f"{where}: cannot read: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(data, dict) or not data:
        raise SpaceError(f"{where}: expected a mapping of setting -> list of values, got {type(data).__name__}")
    return parse_space(data, where)


#: Decode pacing's targets in the built-in space, as shares of the TPOT SLO: a request's TPOT comes
#: out at about the target (docs/decode-pacing.md), so these keep a margin for prefill steps.
PACING_SHARES_OF_SLO = (0.4, 0.7)


def default_space(gpu: bool, slo_tpot_ms: float | None = None) -> SpaceSpec:
    """The space searched when none is given: batch limits on any machine, the front end, async
    scheduling and the plugin's savings on a GPU; with a TPOT SLO, decode pacing off and at
    :data:`PACING_SHARES_OF_SLO` of it."""
    pacing = [None, *(round(share * slo_tpot_ms, 1) for share in PACING_SHARES_OF_SLO)] if slo_tpot_ms else None
    if not gpu:
        return SpaceSpec(max_num_seqs=[64, 8], max_num_batched_tokens=[4096, 1024], decode_pacing_tpot_ms=pacing)
    return SpaceSpec(
        decode_pacing_tpot_ms=pacing,
        max_num_seqs=[256, 128, 512],
        max_num_batched_tokens=[8192, 2048, 16384],
        api_server_count=[1, 4],
        async_scheduling=[False, True],
        cuda_perf_boost=["on", "auto", "off"],
        closed_loop_budget_pct=[None, 1.0],
    )


@dataclass(frozen=True)
class MachineFacts:
    """What decides which settings can act here."""

    gpu: bool
    clocks_settable: bool
    clocks_reason: str


def applicable(spec: SpaceSpec, facts: MachineFacts) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """``(setting -> values that can act here, setting -> why it was skipped)``."""
    keep, skipped = {}, {}
    for name, values in spec.searched().items():
        if not facts.gpu and name in GPU_SETTINGS:
            skipped[name] = {
                "cudagraph_capture_sizes": "no GPU: the CPU build serves eagerly, no CUDA graphs are captured",
                "cuda_perf_boost": "no GPU: there is no CUDA context to boost",
                "closed_loop_budget_pct": "no GPU: clocks cannot be set here, a budget's effect would be predicted only",
            }[name]
        elif name in CLOCK_SETTINGS and not facts.clocks_settable:
            skipped[name] = f"clocks may not be set here ({facts.clocks_reason}): its effect would be predicted only, not measured"
        else:
            keep[name] = values
    return keep, skipped


@dataclass(frozen=True)
class Config:
    """One configuration: ``(setting, value)`` pairs in :data:`SETTINGS` order; empty: vLLM's defaults."""

    items: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> str:
        """A stable name, e.g. ``max_num_seqs=8,async_scheduling=true`` (``defaults`` when empty)."""
        return ",".join(f"{k}={_fmt(v)}" for k, v in self.items) or "defaults"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def serve_flags(self) -> list[str]:
        """The ``vllm serve`` flags of this configuration (plugin settings excluded)."""
        out: list[str] = []
        for k, v in self.items:
            if k in PLUGIN_SETTINGS:
                continue
            if k == "async_scheduling":
                out.append("--async-scheduling" if v else "--no-async-scheduling")
            elif k == "cudagraph_capture_sizes":
                out += ["--cudagraph-capture-sizes", *map(str, v)]
            else:
                out += ["--" + k.replace("_", "-"), str(v)]
        return out

    def plugin_settings(self) -> dict[str, Any]:
        """The ``powersave`` settings this configuration sets; empty: the plugin is not needed."""
        d = self.as_dict()
        out: dict[str, Any] = {}
        if "cuda_perf_boost" in d:
            out["cuda_perf_boost"] = d["cuda_perf_boost"]
        if "closed_loop_budget_pct" in d:
            budget = d["closed_loop_budget_pct"]
            out["clocks"] = {"mode": "off"} if budget is None else {"mode": "closed_loop", "closed_loop": {"slowdown_budget_pct": budget}}
        if d.get("decode_pacing_tpot_ms") is not None:
            out["decode_pacing"] = {"tpot_target_ms": d["decode_pacing_tpot_ms"]}
        if out and "api_server_count" not in d:
            out["api_server_count"] = "vllm"  # the plugin would size the front end itself: keep vLLM's count
        return out


def drop_flags(args: list[str] | tuple[str, ...], names: set[str] | tuple[str, ...]) -> list[str]:
    """``args`` without the flags ``names`` and their values (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for a in args:
        if skip and not a.startswith("--"):
            skip = False
            continue
        name = a.split("=", 1)[0]
        skip = name in names and "=" not in a
        if name not in names:
            out.append(a)
    return out


def override(base_args: list[str] | tuple[str, ...], flags: list[str]) -> list[str]:
    """``base_args`` without the flags ``flags`` sets again (and their values), then ``flags``: one
    value per setting on the command line, the configuration's."""
    names = {f.split("=", 1)[0] for f in flags if f.startswith("--")}
    names |= {"--async-scheduling", "--no-async-scheduling"} if names & {"--async-scheduling", "--no-async-scheduling"} else set()
    return drop_flags(base_args, names) + list(flags)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "off"
    if isinstance(v, list):
        return ":".join(map(str, v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def configurations(values: dict[str, list[Any]], max_configs: int, seed: int = 0) -> list[Config]:
    """The grid of ``values``, capped at ``max_configs``: the first configuration (each setting's
    first value) always, the rest a seeded sample in grid order."""
    names = [k for k in SETTINGS if k in values]
    grid = [Config(tuple(zip(names, combo))) for combo in itertools.product(*(values[k] for k in names))]
    if len(grid) <= max_configs:
        return grid
    rest = sorted(random.Random(seed).sample(range(1, len(grid)), max_configs - 1))
    return [grid[0]] + [grid[i] for i in rest]
