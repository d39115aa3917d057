"""vLLM drift: a hooked attribute that a vLLM release removed, renamed or changed turns off the one
feature that needs it, with one warning naming both, and every other feature still installs.

The cases are built from ``vllm_compat.HOOKS`` (the one inventory), so a new hook is covered as soon
as it is listed there. Each case removes the attribute from the real vLLM 0.32 class (CPU build),
runs the plugin's own install path (``register()`` with the plugin enabled, then the API-server
hooks), and checks what was installed.
"""

import importlib
import json
import logging
import sys

import pytest

pytest.importorskip("vllm")

import vllm_powersave  # noqa: E402
from vllm_powersave import vllm_compat  # noqa: E402
from vllm_powersave.vllm_compat import FEATURES, HOOKS  # noqa: E402


def _imports(module):
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


# The API server's module must be loaded for the app hook to apply (as under `vllm serve`).
importlib.import_module(vllm_compat.APP_BUILDERS[0])

PRESENT = [h for h in HOOKS if _imports(h.module)]
#: One case per requirement: a hook, or a group of alternatives removed together.
REQUIREMENTS: dict[str, list] = {}
for _h in PRESENT:
    REQUIREMENTS.setdefault(f"{_h.feature}:{_h.group or _h.attr}", []).append(_h)
#: Features this vLLM build can have at all (the V2 runner needs Triton, absent in the CPU build).
AVAILABLE = {h.feature for h in PRESENT}


@pytest.fixture
def plugin(monkeypatch):
    """A fresh, enabled plugin state; every vLLM attribute the hooks replace is restored afterwards."""
    monkeypatch.setattr(vllm_compat, "_PATCHED", set())
    monkeypatch.setattr(vllm_compat, "_DISABLED", {})
    monkeypatch.setattr(vllm_compat, "_INSTALLED", set())
    monkeypatch.setattr(vllm_compat, "_PACER", [])
    monkeypatch.setattr(vllm_powersave, "_STATE", {"registered": False, "active": False})
    for h in PRESENT:
        owner = vllm_compat._owner(h)
        if h.attr in vars(owner):
            monkeypatch.setattr(owner, h.attr, vars(owner)[h.attr])
    from vllm.model_executor import custom_op

    # A registry without the LogitsProcessor an earlier test's register() left in this process.
    monkeypatch.setattr(custom_op, "op_registry_oot", {k: v for k, v in custom_op.op_registry_oot.items() if k != "LogitsProcessor"})
    monkeypatch.setenv("POWERSAVE_ENABLED", "1")
    # A chunking table, so that the LM-head hook is wanted (lm_head_hook_needed), and a TPOT
    # target, so that decode pacing is.
    monkeypatch.setenv(
        "POWERSAVE_SETTINGS_JSON",
        json.dumps({"chunking": {"table": [{"min_rows": 64, "chunks": 2}]}, "decode_pacing": {"tpot_target_ms": 30}}),
    )
    return monkeypatch


def _install():
    """The plugin's install path: register() (CLI flag, settings hook, worker and scheduler hooks),
    then the API-server hooks that the settings hook installs under `vllm serve`."""
    vllm_powersave.register()
    vllm_compat.install_serve_hook(lambda args: None)  # under `vllm serve`: once its parser is built
    vllm_compat.install_app_hook("vllm_powersave.request_energy:EnergyMiddleware")
    vllm_compat.install_metrics_registry_hook(lambda registry: None)


def _break(mp, hook, how):
    owner = vllm_compat._owner(hook)
    if how == "removed" or how == "renamed":
        raw = __import__("inspect").getattr_static(owner, hook.attr)
        for cls in getattr(owner, "__mro__", (owner,)):  # inherited (register_oot): gone from every base
            if hook.attr in vars(cls) and cls is not object:
                mp.delattr(cls, hook.attr)
        if how == "renamed":
            mp.setattr(owner, hook.attr + "_v2", raw, raising=False)
    else:  # "signature": takes none of the positional arguments the wrapper passes on

        def changed(*, config=None):
            return None

        mp.setattr(owner, hook.attr, changed)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "vllm.powersave"]


def test_drift_inventory_installs_every_available_feature_without_warnings(plugin, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        _install()
    assert _warnings(caplog) == []
    assert vllm_compat.installed_features() == AVAILABLE
    assert vllm_compat.disabled_features() == {}
    assert {"cli_flag", "settings", "lm_head", "step_v1", "arrival", "lookahead", "app", "metrics_mp", "frontend", "pacing"} <= AVAILABLE


@pytest.mark.parametrize("how", ["removed", "renamed", "signature"])
@pytest.mark.parametrize("req", sorted(REQUIREMENTS))
def test_drift_missing_hook_disables_only_its_feature(plugin, caplog, req, how):
    hooks = REQUIREMENTS[req]
    feature = hooks[0].feature
    for h in hooks:
        _break(plugin, h, how)
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        _install()  # returns cleanly: no AttributeError, no TypeError
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert all(h.attr in warnings[0] for h in hooks) and FEATURES[feature] in warnings[0], warnings[0]
    assert set(vllm_compat.disabled_features()) == {feature}
    assert vllm_compat.installed_features() == AVAILABLE - {feature}
    # The plugin's wrapper is not on anything of the broken feature's class that is still there.
    for h in HOOKS:
        if h.feature == feature and h in PRESENT:
            still = getattr(vllm_compat._owner(h), h.attr, None)
            assert not hasattr(still, "__powersave_original__"), h.name
    # A second install (another process start, register() again) adds no second warning.
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        caplog.clear()
        vllm_powersave._STATE.update(registered=False, active=False)
        _install()
    assert _warnings(caplog) == []


def test_drift_lm_head_falls_back_to_get_logits_without_apply_head(plugin, caplog):
    """A vLLM without ``_apply_head`` (the GEMM alone) still chunks through ``_get_logits``."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    plugin.delattr(LogitsProcessor, "_apply_head")
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        _install()
    assert _warnings(caplog) == []
    assert "lm_head" in vllm_compat.installed_features()
    from vllm.model_executor import custom_op

    assert "_get_logits" in vars(custom_op.op_registry_oot["LogitsProcessor"])


def test_drift_feature_off_when_the_owning_module_is_gone(plugin, caplog):
    """A module moved by a release (import fails) is drift like a missing attribute, except for a
    runner that the build cannot have (V2 without Triton: off silently)."""
    import sys

    plugin.setitem(sys.modules, "vllm.v1.core.sched.scheduler", None)  # import raises ImportError
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        _install()
    warnings = _warnings(caplog)
    assert len(warnings) == 2 and all("vllm.v1.core.sched.scheduler" in w for w in warnings), warnings
    assert set(vllm_compat.disabled_features()) == {"arrival", "lookahead"}
    assert vllm_compat.installed_features() == AVAILABLE - {"arrival", "lookahead"}


def test_another_plugins_logits_processor_turns_off_chunking_only(plugin, caplog, monkeypatch):
    from vllm.model_executor import custom_op

    monkeypatch.setattr(custom_op, "op_registry_oot", {**custom_op.op_registry_oot, "LogitsProcessor": object})
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        _install()  # no AssertionError out of vLLM's register_oot
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "LM-head chunking is off" in warnings[0]
    assert "lm_head" not in vllm_compat.installed_features()
    assert custom_op.op_registry_oot["LogitsProcessor"] is object


def test_api_server_run_as_main_module_gets_the_app_hook(plugin, monkeypatch):
    """`python -m vllm.entrypoints.openai.api_server`: its build_app lives in __main__, which is
    what must be wrapped (the per-request headers and the starvation middleware ride on it)."""
    import types

    from vllm.entrypoints.openai import api_server

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="vllm.entrypoints.openai.api_server")
    main.build_app = api_server.build_app
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.delitem(sys.modules, "vllm.entrypoints.launchers.api_server.entry", raising=False)
    assert vllm_compat.install_app_hook("x.Middleware") == "vllm.entrypoints.openai.api_server"
    assert main.build_app is not api_server.build_app  # wrapped where run_server looks it up
