"""vllm-powersave: a vLLM plugin that cuts GPU energy per generated token.

Enable it for one server with any of:

* ``vllm serve MODEL --plugin powersave``
* ``VLLM_PLUGINS=powersave vllm serve MODEL`` (or ``POWERSAVE_ENABLED=1``)
* ``vllm serve MODEL --additional-config '{"powersave": {...}}'``

Installed but not enabled, it changes nothing but accepting the ``--plugin`` flag (and a malformed
``--additional-config`` value, which vLLM rejects anyway, ends in one error line, not a traceback).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time

from . import envs
from .envs import ENV_ENABLE

__version__ = "0.1.0"

log = logging.getLogger("vllm.powersave")

#: Process state: hooks registered / active, and under `vllm serve` the API-server pool chosen and
#: the server's facts (GPU, driver, vLLM, model) read for it.
_STATE: dict[str, object] = {"registered": False, "active": False, "frontend": None, "server_facts": None}


def enabled_by_env(env: dict[str, str] | None = None) -> bool:
    """True if ``POWERSAVE_ENABLED`` is set (non-zero) or ``VLLM_PLUGINS`` names ``powersave``."""
    return envs.enabled(env) or "powersave" in envs.vllm_plugins(env)


def register() -> None:
    """``vllm.general_plugins`` entry point. Idempotent and cheap; starts neither CUDA nor NVML.

    Runs in every vLLM process (CLI/API server, EngineCore, workers). It installs two inert hooks
    (the ``--plugin`` flag and a settings check before vLLM builds its config); worker-side hooks
    (LM-head chunking, step hook) are installed only where the plugin is enabled.
    """
    if _STATE["registered"]:
        return
    _STATE["registered"] = True
    from . import vllm_compat

    ok, why = vllm_compat.check_version()
    if not ok:
        if enabled_by_env():
            log.warning("powersave: disabled: %s", why)
        return
    vllm_compat.install_cli_flag(_on_serve_args)
    vllm_compat.install_config_hook(_on_engine_args)
    if enabled_by_env():
        activate()


def apply_process_env(settings: object) -> None:
    """Set per-process CUDA variables the settings ask for (before any CUDA context exists).

    Called in the API server before engine processes start (they inherit the environment) and
    again in each engine process's ``register()``, which vLLM runs before the worker's device init.
    """
    from .envs import ENV_PERF_BOOST

    mode = getattr(settings, "cuda_perf_boost", "on")
    if mode in ("off", "auto"):
        if not envs.perf_boost_disabled():
            os.environ[ENV_PERF_BOOST] = "1"
            log.info("powersave: %s=1 (cuda_perf_boost: %s) for this process and its children", ENV_PERF_BOOST, mode)


def activate() -> None:
    """Install the worker-side hooks in this process (inherited by forked engine processes)."""
    if _STATE["active"]:
        return
    _STATE["active"] = True
    from . import runtime, vllm_compat

    if lm_head_hook_needed():
        vllm_compat.register_logits_processor(runtime.head_chunks, runtime.chunked_head)
    if prompt_logprob_hook_needed():
        from .chunking.apply import chunked_logprobs

        vllm_compat.install_prompt_logprobs(runtime.logprob_chunk_rows, chunked_logprobs)
    vllm_compat.install_step_hooks(runtime.on_step_start, runtime.on_step_end)
    # EngineCore side: look-ahead facts stamped on each SchedulerOutput, arrival ramp.
    vllm_compat.install_scheduler_hooks(runtime.on_arrival)
    target_ms = decode_pacing_target_ms()
    if target_ms is not None:
        from .pacing import DecodePacer

        vllm_compat.install_pacing_hook(DecodePacer(target_ms))  # logs once where it paces


def decode_pacing_target_ms(env: dict[str, str] | None = None) -> float | None:
    """``decode_pacing.tpot_target_ms`` of this server's settings (``None``: off, and where the
    settings cannot be read: pacing is a saving that changes latency, so it never runs unasked)."""
    from .settings import settings_from_env

    try:
        return settings_from_env(env).decode_pacing.tpot_target_ms
    except Exception:
        return None


def prompt_logprob_hook_needed(env: dict[str, str] | None = None) -> bool:
    """Whether prompt logprobs may run in blocks here: chunking enabled (a table rule, or free
    memory on a GPU, sizes the blocks: chunking/policy.py). A step without prompt logprobs pays one
    attribute read for the hook. Unreadable settings keep it."""
    from .settings import settings_from_env

    try:
        return bool(settings_from_env(env).chunking.enabled)
    except Exception:
        return True


def lm_head_hook_needed(env: dict[str, str] | None = None) -> bool:
    """Whether this server's settings can ever act in the LM head (a chunk count > 1 or an
    ``lm_head`` kernel-group clock preset).

    If not, vLLM's own ``LogitsProcessor`` stays in place: a wrapper that always picks one chunk
    still costs a Python call and a policy lookup per step, which a host-bound small model pays in
    throughput (H200 bisect, ``docs/results/h200-vllm.md``). Unknown or unreadable settings keep
    the hook (the safe side for a table that may chunk).
    """
    from .settings import settings_from_env

    try:
        s = settings_from_env(env)
    except Exception:
        return True
    if s.chunking.enabled and any(rule.chunks > 1 for rule in s.chunking.table):
        return True
    return any("lm_head" in (preset.groups or {}) for preset in s.clocks.presets.values())


def api_server_middleware(settings: object) -> list[str]:  # settings: PowersaveSettings
    """Import paths of the ASGI middlewares each API server adds (configured for ``settings``): the
    starvation watch, which counts requests in flight (``starvation.py``), unless
    ``energy.starvation_watch`` is off, and in-band request energy with ``per_request_energy``."""
    from . import starvation

    middleware = [starvation.configure(settings.stats_dir)] if settings.energy.starvation_watch else []
    if settings.per_request_energy:
        from . import request_energy

        middleware.append(request_energy.configure(settings.stats_dir, settings.energy.response_wait_ms / 1000.0))
    return middleware


def _server_facts(engine_args: object, settings: object) -> dict:
    """GPU name and driver (NVML, read-only; no CUDA), vLLM version and model of this server."""
    from . import vllm_compat

    facts = {
        "gpu_name": None,
        "driver": None,
        "vllm_version": vllm_compat.vllm_version(),
        "model": str(getattr(engine_args, "model", "") or ""),
    }
    try:
        from .device import NvmlGpu, driver_version

        gpu = NvmlGpu.for_cuda_device(0, visible=envs.cuda_visible_devices())  # CUDA device 0, no CUDA init
        facts["gpu_name"] = gpu.name()
        facts["driver"] = driver_version(gpu.nvml)
    except Exception:
        clocks = getattr(settings, "clocks", None)
        if getattr(clocks, "backend", None) == "simulated":
            from .sim.gpu import SPECS

            facts["gpu_name"] = SPECS[settings.energy.simulated_gpu].name  # type: ignore[attr-defined]
    return facts


def _prepare_stats_dir(settings):  # type: ignore[no-untyped-def]
    """Create the directory workers publish into; a default one is removed when this process exits.

    Default directories of servers that are gone (their PID is the name's prefix) are pruned here,
    so crashed servers do not leave a growing pile behind.
    """
    import atexit
    import shutil

    from .clocks.leases import pid_alive

    if settings.stats_dir is not None:
        os.makedirs(settings.stats_dir, exist_ok=True)
        if not os.path.isdir(settings.stats_dir):
            raise NotADirectoryError(20, "not a directory", settings.stats_dir)
        return settings
    inherited = _inherited_stats_dir()
    if inherited is not None:
        # An API-server process of `--api-server-count N`, started by the process that created the
        # directory (and removes it): publish and read in the same place as the engine's workers.
        return settings.model_copy(update={"stats_dir": inherited})
    base = os.path.join(tempfile.gettempdir(), "vllm-powersave", "stats")
    os.makedirs(base, exist_ok=True)
    for name in os.listdir(base):
        pid = name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    stats_dir = tempfile.mkdtemp(prefix=f"{os.getpid()}-{int(time.time())}-", dir=base)
    atexit.register(shutil.rmtree, stats_dir, True)
    return settings.model_copy(update={"stats_dir": stats_dir})


def _inherited_stats_dir() -> str | None:
    """The default stats directory exported by a parent process (not by this one), if it exists."""
    try:
        d = json.loads(envs.settings_json() or "{}").get("stats_dir")
    except (ValueError, AttributeError):
        return None
    if not d or not os.path.isdir(d):
        return None
    pid = os.path.basename(os.path.normpath(d)).split("-", 1)[0]
    return d if pid.isdigit() and int(pid) != os.getpid() else None


def _stop_startup(err: Exception) -> None:
    """A setting problem found before vLLM builds its config: one line and exit 2 under the CLI
    (nothing has started yet), the exception itself for library callers (offline ``LLM``)."""
    from . import vllm_compat

    if vllm_compat.CLI_STATE["parser_built"]:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    raise err


def _plugin_settings(args: object):  # type: ignore[no-untyped-def]
    """The validated settings where the plugin is on for this server (``--additional-config``'s
    ``powersave`` or the environment), else None; a bad setting stops the start with one line."""
    from . import vllm_compat
    from .settings import SettingsError, load_settings

    inline = vllm_compat.additional_config(args).get("powersave")
    if inline is None and not enabled_by_env():
        return None
    try:
        return load_settings(inline if inline is not None else {})
    except SettingsError as err:
        _stop_startup(err)


def _real_gpu(gpu_name: object, settings: object) -> bool:
    """A GPU that is not the simulated one (savings that act on hardware can act)."""
    clocks = getattr(settings, "clocks", None)
    return bool(gpu_name) and "simulated" not in str(gpu_name) and getattr(clocks, "backend", None) != "simulated"


def _on_serve_args(args: object) -> None:
    """``vllm serve``, before it picks its API-server count: size the pool (frontend.py)."""
    from . import frontend, vllm_compat

    settings = _plugin_settings(args)
    if settings is None:
        return
    facts = _STATE["server_facts"] = _server_facts(args, settings)  # the engine-args hook reuses them
    on_gpu = _real_gpu(facts.get("gpu_name"), settings)
    choice = frontend.choose(settings.api_server_count, vllm_compat.serve_facts(args), frontend.usable_cores(), on_gpu)
    if choice.changed:
        vllm_compat.set_api_server_count(args, choice.count)
    _STATE["frontend"] = choice


def _on_engine_args(engine_args: object) -> None:
    """Before vLLM builds its config: validate settings, export them, start the metrics collector."""
    from . import vllm_compat
    from .envs import ENV_SETTINGS_JSON
    from .settings import SettingsError

    settings = _plugin_settings(engine_args)
    if settings is None:
        return
    from .settings import check_tuned_for

    # Under `vllm serve` the serve hook read them already in this process (NVML opened once).
    facts = _STATE.get("server_facts") or _server_facts(engine_args, settings)
    mismatches = check_tuned_for(settings.tuned_for, facts)
    if mismatches and settings.tuned_for is not None and settings.tuned_for.allow_mismatch:
        for m in mismatches:
            log.warning("%s (allowed by tuned_for.allow_mismatch)", m)
    elif mismatches:
        _stop_startup(SettingsError(mismatches[0] + (f" (+{len(mismatches) - 1} more)" if len(mismatches) > 1 else "")))
    # --api-server-count N: the other API servers inherit the directory, or (an explicit stats_dir)
    # the PID of the process that logged the start line.
    first_api_server = _inherited_stats_dir() is None and envs.started_by() in (None, os.getpid())
    try:
        settings = _prepare_stats_dir(settings)
    except OSError as exc:
        _stop_startup(
            SettingsError(
                f"powersave setting 'stats_dir' = {settings.stats_dir!r}: cannot create the stats directory: {exc.strerror or exc}"
            )
        )
    os.environ[ENV_ENABLE] = "1"
    os.environ[ENV_SETTINGS_JSON] = settings.model_dump_json()
    apply_process_env(settings)
    # Ray executor: workers on other nodes get these only if vLLM copies them (ray_relay.py).
    vllm_compat.ray_copy_env((envs.PREFIX,), (envs.ENV_PERF_BOOST,))
    activate()
    from .metrics import register_collector

    register_collector(settings.stats_dir, __version__)
    if middleware := api_server_middleware(settings):
        vllm_compat.install_app_hook(middleware)
    # The settings once per server: the API servers of --api-server-count N run the same ones.
    log.log(
        logging.INFO if first_api_server else logging.DEBUG,
        "powersave: enabled; settings %s",
        json.dumps(settings.model_dump(mode="json"), sort_keys=True),
    )
    if first_api_server:  # one line per server: which savings run, and why
        os.environ[envs.ENV_STARTED_BY] = str(os.getpid())
        from .savings import startup_line

        log.info("%s", startup_line(settings, _real_gpu(facts.get("gpu_name"), settings), frontend=_STATE.get("frontend")))
