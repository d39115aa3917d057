"""Which savings run on this server, and why: the start line and the figures on ``/metrics``.

The API server logs one line at start (the first API-server process only), e.g.::

    powersave: savings: perf-boost auto (idle power, measured -35 % on H200); clocks dry-run
    (no clock permission: predicted only); chunking off (no table); decode pacing off (no TPOT target)

from the settings and the same permission probe the workers run (nothing is set); every worker
then publishes what it actually got in its snapshot (``savings``), exported as
``powersave_saving_state{gpu, saving, state, basis}`` = 1, so that a saving that turned itself off
at run time (a boost helper that failed, a clock backend that faulted) shows as ``failed``.
``basis``: ``measured`` where the saving's effect has a measurement in docs/results, ``predicted``
where it is a model's figure or decisions are only recorded (dry-run).
"""

from __future__ import annotations

from typing import Any

#: The idle-power saving of cuda_perf_boost off/auto, measured on the H200 test GPU: 119.6 W ->
#: 77.4 W over 5 adjacent pairs (docs/results/h200-perf-boost.md).
PERF_BOOST_IDLE_SAVING = 1 - 77.4 / 119.6
PERF_BOOST_BASIS = "idle power, measured -35 % on H200"
#: What cuda_perf_boost "on" gained over "auto" in tokens per joule where the GPU hardly idled:
#: 8 req/s on an H100 (GPU busy ~99 %), 3 adjacent auto/on comparisons, -0.5 to -1.0 % each for
#: auto; none at 2 req/s (docs/results/h200-under-load.md, ablations). Auto's side context
#: holds the boost there, so what it costs is the arrangement, not a missing boost.
PERF_BOOST_ON_BUSY_GAIN = 0.007
#: Below this share of a run's energy spent idle, auto's idle saving has (almost) nothing to save.
PERF_BOOST_ON_MAX_IDLE_SHARE = 0.01


#: Features (``vllm_compat.FEATURES``) without which the clock controller never acts: the runners'
#: step hooks. Either runner's suffices; clocks are off only when none is installed.
STEP_FEATURES = ("step_v1", "step_v2")


def _lost_why(lost: dict[str, str], features: tuple[str, ...], installed: set[str] | None = None) -> str | None:
    """The drift reason when every one of ``features`` is lost (``installed``: none of them is in
    place either), else ``None``."""
    hit = [f for f in features if f in lost]
    if not hit or (installed is not None and installed & set(features)):
        return None
    if installed is None and len(hit) < len(features):
        return None
    return "hook lost to vLLM drift: " + "; ".join(f"{f}: {lost[f]}" for f in hit)


def savings_state(
    settings: Any,
    clock_choice: Any,
    boost: dict[str, Any] | None,
    on_gpu: bool,
    clock_disabled: str | None = None,
    clock_kind: str | None = None,
    lost: dict[str, str] | None = None,
    installed: set[str] | None = None,
    pacing_off: str | None = None,
) -> dict[str, dict[str, str]]:
    """``{saving: {"state", "basis", "why"}}`` for ``perf_boost``, ``clocks``, ``chunking`` and ``decode_pacing``.

    ``boost``: the booster's snapshot (``disabled`` set when its helper failed) or ``None``;
    ``clock_disabled``: the clock controller's ``disabled_reason`` (a backend that faulted);
    ``clock_kind``: the controller's backend now (``dry-run`` after a refused set: nvml
    NoPermission, zeusd 401/403/404); ``lost``: features whose hook is missing in this process,
    with why (``vllm_compat.disabled_features()``): chunking is ``off`` without its ``lm_head``
    hook, clocks ``off`` without a step hook (``installed``: ``vllm_compat.installed_features()``).
    """
    lost = lost or {}
    out: dict[str, dict[str, str]] = {}
    mode = settings.cuda_perf_boost
    if getattr(settings, "savings", "auto") == "off":
        out["perf_boost"] = {"state": "off", "basis": "", "why": "metering only"}
    elif mode == "on":
        out["perf_boost"] = {"state": "off", "basis": "", "why": "cuda_perf_boost on (CUDA's default)"}
    elif not on_gpu:
        out["perf_boost"] = {"state": "n/a", "basis": "", "why": "no GPU"}
    elif mode == "auto" and boost is None:
        out["perf_boost"] = {"state": "failed", "basis": "", "why": "no NVIDIA GPU by UUID: engine unboosted"}
    elif mode == "auto" and boost.get("disabled"):
        out["perf_boost"] = {"state": "failed", "basis": "", "why": f"boost helper: {boost['disabled']}: engine unboosted"}
    else:
        out["perf_boost"] = {"state": mode, "basis": "measured", "why": PERF_BOOST_BASIS}
    clock_lost = _lost_why(lost, STEP_FEATURES, installed)
    if clock_choice.controller == "off":
        out["clocks"] = {"state": "off", "basis": "", "why": clock_choice.reason}
    elif clock_lost:
        out["clocks"] = {"state": "off", "basis": "", "why": clock_lost}
    elif clock_disabled:
        out["clocks"] = {"state": "failed", "basis": "", "why": clock_disabled}
    elif clock_kind == "dry-run" and clock_choice.backend in ("nvml", "zeusd"):
        out["clocks"] = {"state": "dry-run", "basis": "predicted", "why": f"{clock_choice.backend} refused the set: predicted only"}
    else:
        state = {"dry-run": "dry-run", "simulated": "simulated"}.get(clock_choice.backend, clock_choice.controller)
        basis = "predicted" if clock_choice.backend in ("dry-run", "simulated") else "measured"
        out["clocks"] = {"state": state, "basis": basis, "why": clock_choice.reason}
    c = settings.chunking
    if not c.enabled:
        out["chunking"] = {"state": "off", "basis": "", "why": "chunking.enabled false"}
    elif "lm_head" in lost:
        out["chunking"] = {"state": "off", "basis": "", "why": _lost_why(lost, ("lm_head",)) or "lm_head hook missing"}
    elif not any(r.chunks > 1 for r in c.table):
        out["chunking"] = {"state": "off", "basis": "", "why": "no table"}
    else:
        out["chunking"] = {"state": "on", "basis": "measured", "why": f"{len(c.table)} rules"}
    out["decode_pacing"] = _pacing_state(settings, lost, pacing_off)
    return out


def _pacing_state(settings: Any, lost: dict[str, str], off_reason: str | None) -> dict[str, str]:
    """Decode pacing's entry: off without a TPOT target or without its hook (vLLM drift), failed
    where the engine's pacer turned itself off (``off_reason``, carried on the steps)."""
    pacing = getattr(settings, "decode_pacing", None)
    target_ms = getattr(pacing, "tpot_target_ms", None)
    if target_ms is None:
        return {"state": "off", "basis": "", "why": "no TPOT target"}
    if "pacing" in lost:
        return {"state": "off", "basis": "", "why": _lost_why(lost, ("pacing",)) or "pacing hook missing"}
    if off_reason:
        return {"state": "failed", "basis": "", "why": f"{off_reason}: decode steps unspaced"}
    return {"state": "on", "basis": "predicted", "why": f"decode steps spaced to {target_ms:g} ms"}


def start_line(state: dict[str, dict[str, str]], metering_only: bool = False, energy_source: str = "measured") -> str:
    """The one start line naming each saving, its state and why. ``energy_source``: "measured",
    or "simulated" where no GPU meters it (the simulated GPU's figures are never called measured)."""
    if metering_only:
        metered = "measured" if energy_source == "measured" else f"metered ({energy_source})"
        return f"powersave: metering only (savings: off): CUDA boost, clocks and LM head left as stock; energy still {metered}"
    names = {"perf_boost": "perf-boost", "clocks": "clocks", "chunking": "chunking", "decode_pacing": "decode pacing"}
    parts = [f"{names.get(k, k)} {v['state']} ({v['why']})" for k, v in state.items()]
    return "powersave: savings: " + "; ".join(parts)


def startup_line(settings: Any, on_gpu: bool, env: dict[str, str] | None = None, frontend: Any = None) -> str:
    """The start line for ``settings`` on this machine (API-server process, before engines start):
    the clock choice from the workers' probe (no setter called), perf boost as configured, and
    the API-server pool (``frontend``: a :class:`~vllm_powersave.frontend.FrontendChoice`, or
    ``None`` where ``vllm serve`` did not run, e.g. the offline ``LLM``)."""
    from .clocks.mode import probe_and_select

    choice = probe_and_select(settings, on_gpu, env)
    state = savings_state(settings, choice, {"disabled": None}, on_gpu)
    energy_source = "measured" if on_gpu else "simulated"
    line = start_line(state, metering_only=getattr(settings, "savings", "auto") == "off", energy_source=energy_source)
    return line + (f"; {frontend.describe()}" if frontend is not None else "")
