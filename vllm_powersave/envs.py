"""Every environment variable vllm-powersave and its load tests read or set, declared in one table.

Modelled on ``vllm/envs.py``: one :class:`EnvVar` per variable (name, type, default, doc) and one
accessor function per variable. Each accessor takes an optional mapping (``None``: ``os.environ``)
so that callers that validate another process's environment, and tests, pass their own.

Adding a variable: one ``EnvVar`` row in :data:`ENV_VARS`, one name constant, one accessor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: ``parse`` turns the raw value (``None``: unset) into ``type``."""

    name: str
    type: str
    default: Any
    doc: str
    parse: Callable[[str | None], Any]

    def get(self, env: Mapping[str, str] | None = None) -> Any:
        return self.parse((os.environ if env is None else env).get(self.name))


def _flag(*off: str) -> Callable[[str | None], bool]:
    """Set and not one of ``off`` (the empty string is always off)."""
    falsy = frozenset(("", *off))
    return lambda raw: raw is not None and raw not in falsy


def _str_or_none(raw: str | None) -> str | None:
    return raw or None


# Names (importable constants; the table below documents each).
ENV_ENABLE = "POWERSAVE_ENABLED"
ENV_CONFIG_FILE = "POWERSAVE_CONFIG"
ENV_SETTINGS_JSON = "POWERSAVE_SETTINGS_JSON"
ENV_FORCE_DRY_RUN = "POWERSAVE_FORCE_DRY_RUN"
ENV_PERF_BOOST = "CUDA_DISABLE_PERF_BOOST"
ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ENV_ZEUSD_SOCK = "ZEUSD_SOCK_PATH"
ENV_ZEUSD_TOKEN = "ZEUSD_TOKEN"
ENV_VLLM_PLUGINS = "VLLM_PLUGINS"
ENV_RAY_EXTRA_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
ENV_RAY_EXTRA_VARS = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"
ENV_VLLM_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"
ENV_STARTED_BY = "POWERSAVE_STARTED_BY"
ENV_VLLM_RUST_FRONTEND = "VLLM_RUST_FRONTEND_PATH"
ENV_VLLM_RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

#: Prefix of the plugin's own variables (what vLLM's Ray executor is asked to copy to workers).
PREFIX = "POWERSAVE_"

ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            ENV_ENABLE,
            "bool",
            False,
            "Enables the plugin in this process and its children (set by `--plugin powersave`); '', '0', 'false', 'False' mean off.",
            _flag("0", "false", "False"),
        ),
        EnvVar(ENV_CONFIG_FILE, "path", None, "YAML/JSON settings file, merged under the inline `powersave` settings.", _str_or_none),
        EnvVar(
            ENV_SETTINGS_JSON,
            "json",
            None,
            "The validated settings, exported by the API-server process so that EngineCore and "
            "worker processes (fork or spawn) see exactly what was validated there.",
            _str_or_none,
        ),
        EnvVar(
            ENV_FORCE_DRY_RUN,
            "bool",
            False,
            "Set on machines whose GPU settings must never change: every clock backend becomes "
            "dry-run and the tuner only predicts; '' and '0' mean off.",
            _flag("0"),
        ),
        EnvVar(
            ENV_PERF_BOOST,
            "bool",
            False,
            "CUDA's per-process switch behind `cuda_perf_boost: off` (read at CUDA context creation); only '1' means set.",
            lambda raw: raw == "1",
        ),
        EnvVar(
            ENV_CUDA_VISIBLE_DEVICES,
            "str",
            None,
            "CUDA's device list; maps a torch device index to an NVML device where torch gives no UUID.",
            _str_or_none,
        ),
        EnvVar(ENV_ZEUSD_SOCK, "path", None, "zeusd's socket when `clocks.zeusd_socket` is not set (Zeus's own convention).", _str_or_none),
        EnvVar(
            ENV_ZEUSD_TOKEN,
            "str",
            None,
            "JWT for a zeusd started with auth; read from the environment only (settings are logged).",
            _str_or_none,
        ),
        EnvVar(
            ENV_VLLM_PLUGINS,
            "csv",
            (),
            "vLLM's plugin list; naming `powersave` enables the plugin.",
            lambda raw: tuple(p.strip() for p in raw.split(",")) if raw is not None else (),
        ),
        EnvVar(
            ENV_RAY_EXTRA_PREFIXES,
            "csv",
            (),
            "vLLM's additive list of variable prefixes its legacy Ray executor copies to workers (appended to, never replaced).",
            lambda raw: tuple(x.strip() for x in (raw or "").split(",") if x.strip()),
        ),
        EnvVar(
            ENV_RAY_EXTRA_VARS,
            "csv",
            (),
            "vLLM's additive list of variable names its legacy Ray executor copies to workers.",
            lambda raw: tuple(x.strip() for x in (raw or "").split(",") if x.strip()),
        ),
        EnvVar(
            ENV_VLLM_BATCH_INVARIANT,
            "bool",
            False,
            "vLLM's batch-invariant kernels; where set, the LM head is never chunked (a chunk's GEMM would not be vLLM's invariant one).",
            _flag("0"),
        ),
        EnvVar(
            ENV_STARTED_BY,
            "int",
            None,
            "PID of the process that logged the server's start line; the API-server processes of "
            "`--api-server-count N` inherit it and log none (one start line per server).",
            lambda raw: int(raw) if raw and raw.isdigit() else None,
        ),
        EnvVar(
            ENV_VLLM_RUST_FRONTEND,
            "path",
            None,
            "vLLM's Rust front end; where set, vLLM runs one (multithreaded) front-end process and the API-server pool is left alone.",
            _str_or_none,
        ),
        EnvVar(
            ENV_VLLM_RUNTIME_LORA,
            "bool",
            False,
            "vLLM's runtime LoRA updating, which vLLM refuses with several API servers; where on ('1' or 'true', as vLLM "
            "reads it), the pool stays at one.",
            lambda raw: (raw or "").strip().lower() in ("1", "true"),
        ),
    )
}


def _get(name: str, env: Mapping[str, str] | None) -> Any:
    return ENV_VARS[name].get(env)


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return _get(ENV_ENABLE, env)


def config_file(env: Mapping[str, str] | None = None) -> str | None:
    return _get(ENV_CONFIG_FILE, env)


def settings_json(env: Mapping[str, str] | None = None) -> str | None:
    return _get(ENV_SETTINGS_JSON, env)


def force_dry_run(env: Mapping[str, str] | None = None) -> bool:
    return _get(ENV_FORCE_DRY_RUN, env)


def perf_boost_disabled(env: Mapping[str, str] | None = None) -> bool:
    return _get(ENV_PERF_BOOST, env)


def cuda_visible_devices(env: Mapping[str, str] | None = None) -> str | None:
    return _get(ENV_CUDA_VISIBLE_DEVICES, env)


def zeusd_socket(env: Mapping[str, str] | None = None) -> str | None:
    return _get(ENV_ZEUSD_SOCK, env)


def zeusd_token(env: Mapping[str, str] | None = None) -> str | None:
    return _get(ENV_ZEUSD_TOKEN, env)


def vllm_batch_invariant(env: Mapping[str, str] | None = None) -> bool:
    return _get(ENV_VLLM_BATCH_INVARIANT, env)


def vllm_plugins(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    return _get(ENV_VLLM_PLUGINS, env)


def ray_extra_list(name: str, env: Mapping[str, str] | None = None) -> list[str]:
    """One of vLLM's two Ray copy lists (:data:`ENV_RAY_EXTRA_PREFIXES`, :data:`ENV_RAY_EXTRA_VARS`)."""
    if name not in (ENV_RAY_EXTRA_PREFIXES, ENV_RAY_EXTRA_VARS):
        raise KeyError(name)
    return list(_get(name, env))


def vllm_rust_frontend(env: Mapping[str, str] | None = None) -> str | None:
    return _get(ENV_VLLM_RUST_FRONTEND, env)


def vllm_runtime_lora(env: Mapping[str, str] | None = None) -> bool:
    return _get(ENV_VLLM_RUNTIME_LORA, env)


def started_by(env: Mapping[str, str] | None = None) -> int | None:
    return _get(ENV_STARTED_BY, env)
