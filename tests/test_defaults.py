"""Defaults that save: perf boost auto, clock mode by permission, metering only, the start line."""

import logging
import sys
import time
from types import SimpleNamespace

import pytest

from tests.fakes import FakeNvml, FakeNvmlDevices, FakeZeusd
from vllm_powersave import runtime as rt_mod
from vllm_powersave import vllm_compat
from vllm_powersave.clocks import mode as mode_mod
from vllm_powersave.clocks.mode import clock_permission, select_clock_mode, zeusd_reachable
from vllm_powersave.savings import savings_state, start_line, startup_line
from vllm_powersave.settings import PowersaveSettings, SettingsError, load_settings

NO = (False, "no clock permission (needs root or CAP_SYS_ADMIN)")
YES = (True, "running as root")
NOZ = (False, "no zeusd socket")


def choose(mode="auto", backend="auto", presets=False, force=False, gpu=True, perm=NO, zeusd=NOZ):
    return select_clock_mode(mode, backend, presets, force_dry_run=force, on_gpu=gpu, nvml_permission=perm, zeusd=zeusd)


def test_clock_mode_auto_sets_clocks_only_where_the_process_may():
    assert choose(perm=YES).backend == "nvml"
    assert choose(zeusd=(True, "zeusd at /s")).backend == "zeusd"
    c = choose()
    assert c.backend == "dry-run" and c.predicted_only and "no clock permission: predicted only" in c.reason
    assert choose(perm=YES, force=True).backend == "dry-run"  # shared GPUs: POWERSAVE_FORCE_DRY_RUN wins
    assert choose(perm=YES, gpu=False).backend == "dry-run"
    assert choose(mode="dry_run", perm=YES).backend == "dry-run"


def test_clock_mode_picks_the_closed_loop_unless_presets_are_given():
    assert choose(perm=YES).controller == "closed_loop"
    assert choose(perm=NO).controller == "closed_loop"  # decisions computed, predicted only
    assert choose(perm=YES, presets=True).controller == "presets"  # given presets win in auto
    assert choose(mode="presets", perm=YES).controller == "presets"
    off = choose(mode="off", perm=YES)
    assert off.controller == "off" and not off.predicted_only
    assert choose(backend="simulated").backend == "simulated"  # an explicit backend is kept


def test_clock_permission_reads_root_or_cap_sys_admin(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000200000\n")
    assert clock_permission(str(status), euid=1000) == (True, "CAP_SYS_ADMIN")
    status.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    assert clock_permission(str(status), euid=1000)[0] is False
    assert clock_permission(str(status), euid=0) == (True, "running as root")


def test_zeusd_reachable_only_where_it_answers(tmp_path):
    sock = tmp_path / "zeusd.sock"
    assert zeusd_reachable(None)[0] is False
    assert zeusd_reachable(str(sock))[0] is False  # nothing listening
    with FakeZeusd(str(sock), [FakeNvml()]):
        assert zeusd_reachable(str(sock))[0] is True
    # A refusal (no token, gpu-control disabled) only shows at the first set: see the runtime test below.


def _runtime(monkeypatch, tmp_path, perm, extra=None, zeusd_sock=None):
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000",))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa-0000")
    monkeypatch.delenv("POWERSAVE_FORCE_DRY_RUN", raising=False)
    monkeypatch.delenv("ZEUSD_SOCK_PATH", raising=False)
    monkeypatch.setattr(mode_mod, "clock_permission", lambda: perm)
    monkeypatch.setattr(vllm_compat, "runner_identity", lambda r: {"rank": 0, "device_type": "cuda", "device_index": 0})
    runner = SimpleNamespace(rank=0, scheduler_config=SimpleNamespace(max_num_seqs=2, async_scheduling=False))
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = {"stats_dir": str(tmp_path), "energy": {"idle_after_s": 20.0}, **(extra or {})}
    if zeusd_sock:
        cfg["clocks"] = {"zeusd_socket": zeusd_sock, "presets": {"decode": {"sm_clock_mhz": 1200}}, "lease_dir": str(tmp_path / "leases")}
    return rt_mod.WorkerRuntime(runner, PowersaveSettings.model_validate(cfg))


@pytest.mark.parametrize("perm,kind", [(YES, "real"), (NO, "dry-run")])
def test_default_settings_select_perf_boost_auto_and_clock_backend_by_permission(monkeypatch, tmp_path, perm, kind):
    rt = _runtime(monkeypatch, tmp_path, perm)
    try:
        assert rt.boost is not None  # cuda_perf_boost auto by default, on a GPU known by UUID
        assert rt.clocks.backend.kind == kind
        sv = rt.snapshot()["savings"]
        assert sv["perf_boost"]["state"] == "auto" and sv["perf_boost"]["basis"] == "measured"
        assert sv["clocks"]["basis"] == ("predicted" if kind == "dry-run" else "measured")
    finally:
        rt.close()


def test_default_settings_use_a_reachable_zeusd_and_dry_run_where_it_refuses(monkeypatch, tmp_path):
    sock = str(tmp_path / "z.sock")
    with FakeZeusd(sock, [FakeNvml()]):
        rt = _runtime(monkeypatch, tmp_path / "a", NO, zeusd_sock=sock)
        try:
            assert rt.clock_choice.backend == "zeusd" and rt.clocks.backend.kind == "real"
        finally:
            rt.close()
    gpu = FakeNvml()
    with FakeZeusd(sock, [gpu], token="secret"):  # reachable, but refuses our sets: no token
        rt = _runtime(monkeypatch, tmp_path / "b", NO, zeusd_sock=sock)
        try:
            assert rt.clock_choice.backend == "zeusd"
            for i in range(4):  # lowering waits for the dwell; then the daemon answers 401
                rt.clocks.on_phase("decode", now=float(i))
            for _ in range(500):
                if rt.clocks.backend.kind == "dry-run":
                    break
                time.sleep(0.01)
            sv = rt.snapshot()["savings"]["clocks"]
            assert sv == {"state": "dry-run", "basis": "predicted", "why": "zeusd refused the set: predicted only"}
            assert gpu.locked is None
        finally:
            rt.close()


def test_metering_only_switch_keeps_every_saving_stock(monkeypatch, tmp_path):
    s = load_settings({"savings": "off"}, env={})
    assert s.cuda_perf_boost == "on" and s.clocks.mode == "off" and s.chunking.enabled is False
    assert PowersaveSettings.model_validate_json(s.model_dump_json()) == s  # survives the export to workers
    rt = _runtime(monkeypatch, tmp_path, YES, extra={"savings": "off"})
    try:
        assert rt.boost is None and rt.clock_choice.controller == "off"
        sv = rt.snapshot()["savings"]
        assert {k: v["state"] for k, v in sv.items()} == {"perf_boost": "off", "clocks": "off", "chunking": "off", "decode_pacing": "off"}
    finally:
        rt.close()


@pytest.mark.parametrize(
    "cfg,line",
    [
        ({"savings": "off", "cuda_perf_boost": "auto"}, "powersave settings: cuda_perf_boost 'auto' conflicts with savings 'off'"),
        (
            {"savings": "off", "clocks": {"mode": "closed_loop"}},
            "powersave settings: clocks.mode 'closed_loop' conflicts with savings 'off'",
        ),
        (
            {"savings": "off", "clocks": {"closed_loop": {"enabled": True}}},
            "powersave settings: clocks.closed_loop.enabled true conflicts with savings 'off'",
        ),
        (
            {"per_request_energy": True, "energy": {"meter": "off"}},
            "powersave settings: per_request_energy true needs an energy meter, energy.meter is 'off'",
        ),
        (
            {"clocks": {"closed_loop": {"probe_steps": 3000, "probe_steps_max": 10}}},
            "powersave setting 'clocks.closed_loop' = {'probe_steps': 3000, 'probe_steps_max': 10}: probe_steps 3000 exceeds",
        ),
        ({"savings": "maybe"}, "powersave setting 'savings' = 'maybe'"),
        ({"clocks": {"mode": "turbo"}}, "powersave setting 'clocks.mode' = 'turbo'"),
        ({"clocks": {"backend": "magic"}}, "powersave setting 'clocks.backend' = 'magic'"),
        ({"energy": {"starvation_warn_share": 1.5}}, "powersave setting 'energy.starvation_warn_share' = 1.5"),
        ({"energy": {"starvation_min_busy_s": 0}}, "powersave setting 'energy.starvation_min_busy_s' = 0"),
        ({"energy": {"starvation_warn_every_s": float("nan")}}, "powersave setting 'energy.starvation_warn_every_s' = nan"),
    ],
)
def test_bad_new_settings_stop_with_one_line_naming_field_and_value(cfg, line):
    with pytest.raises(SettingsError) as err:
        load_settings(cfg, env={})
    msg = str(err.value)
    assert msg.startswith(line) and "\n" not in msg


def test_start_line_names_each_saving_and_why(monkeypatch):
    monkeypatch.setattr(mode_mod, "clock_permission", lambda: NO)
    env = {}
    line = startup_line(load_settings({}, env={}), on_gpu=True, env=env)
    assert line == (
        "powersave: savings: perf-boost auto (idle power, measured -35 % on H200); clocks dry-run "
        "(closed loop; no clock permission: predicted only); "
        "chunking off (no table); decode pacing off (no TPOT target)"
    )
    monkeypatch.setattr(mode_mod, "clock_permission", lambda: YES)
    assert "clocks closed_loop (closed loop; running as root)" in startup_line(load_settings({}, env={}), on_gpu=True, env=env)
    assert "clocks dry-run (closed loop; POWERSAVE_FORCE_DRY_RUN=1: predicted only)" in startup_line(
        load_settings({}, env={}), on_gpu=True, env={"POWERSAVE_FORCE_DRY_RUN": "1"}
    )
    assert startup_line(load_settings({"savings": "off"}, env={}), on_gpu=True, env=env).startswith("powersave: metering only")
    assert startup_line(load_settings({"savings": "off"}, env={}), on_gpu=True, env=env).endswith("energy still measured")
    # No GPU: the energy is the simulated GPU's, never called measured.
    assert startup_line(load_settings({"savings": "off"}, env={}), on_gpu=False, env=env).endswith("energy still metered (simulated)")
    assert "perf-boost n/a (no GPU)" in startup_line(load_settings({}, env={}), on_gpu=False, env=env)


def test_workers_add_no_second_start_line(monkeypatch, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="vllm.powersave"):
        rt = _runtime(monkeypatch, tmp_path, NO)
        rt.close()
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "powersave: savings:" in r.getMessage()]


def test_boost_helper_failure_and_clock_fault_show_as_failed():
    s = load_settings({}, env={})
    choice = choose(perm=YES)
    st = savings_state(s, choice, {"held": False, "disabled": "err no CUDA driver"}, on_gpu=True, clock_disabled="nvml: GpuIsLost")
    assert st["perf_boost"]["state"] == "failed" and "no CUDA driver" in st["perf_boost"]["why"]
    assert st["clocks"]["state"] == "failed"
    assert start_line(st, metering_only=True).startswith("powersave: metering only")


START = r"""
import logging, sys, types
logging.getLogger("vllm.powersave").addHandler(logging.StreamHandler(sys.stdout))
logging.getLogger("vllm.powersave").setLevel(logging.INFO)
import vllm_powersave
vllm_powersave._on_engine_args(types.SimpleNamespace(additional_config={"powersave": {}}, model="x"))
"""


@pytest.mark.parametrize("second_api_server", [False, True])
def test_server_start_logs_exactly_one_savings_line(tmp_path, second_api_server):
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("POWERSAVE_", "VLLM_PLUGINS", "ZEUSD_"))}
    env["TMPDIR"] = str(tmp_path)
    if second_api_server:  # --api-server-count N: the first API server's directory is inherited
        inherited = tmp_path / "1-1-x"
        inherited.mkdir()
        env["POWERSAVE_SETTINGS_JSON"] = json.dumps({"stats_dir": str(inherited)})
    p = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [x for x in (p.stdout + p.stderr).splitlines() if "powersave: savings:" in x]
    assert len(lines) == (0 if second_api_server else 1), p.stdout[-2000:]
    if lines:
        assert "perf-boost" in lines[0] and "clocks" in lines[0] and "chunking off (no table)" in lines[0]


EXPLICIT = START.replace('{"powersave": {}}', '{"powersave": {"stats_dir": sys.argv[1]}}')


def test_api_servers_with_an_explicit_stats_dir_log_no_second_start_line(tmp_path):
    """`vllm serve --api-server-count 4` with a ``stats_dir`` set (as `vllm-powersave compare` does):
    the spawned API servers inherit the first one's PID, not a PID-named directory, and stay quiet."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("POWERSAVE_", "VLLM_PLUGINS", "ZEUSD_"))}
    first = subprocess.run([sys.executable, "-c", EXPLICIT, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sum("powersave: savings:" in x for x in (first.stdout + first.stderr).splitlines()) == 1
    env["POWERSAVE_STARTED_BY"] = "1"  # PID 1 logged it: this process is one of its API servers
    child = subprocess.run([sys.executable, "-c", EXPLICIT, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert not [x for x in (child.stdout + child.stderr).splitlines() if "powersave: savings:" in x or "enabled; settings" in x]
    assert sum("enabled; settings" in x for x in (first.stdout + first.stderr).splitlines()) == 1


def _lose(monkeypatch, owner, *attrs):
    """A vLLM drift: ``attrs`` gone from ``owner`` (as in tests/test_drift.py), in a fresh plugin state."""
    monkeypatch.setattr(vllm_compat, "_DISABLED", {})
    monkeypatch.setattr(vllm_compat, "_PATCHED", set())
    monkeypatch.setattr(vllm_compat, "_INSTALLED", set())
    for attr in attrs:
        for cls in owner.__mro__:
            if attr in vars(cls) and cls is not object:
                monkeypatch.delattr(cls, attr)


def _scraped_states(tmp_path, snap, saving):
    import json

    from tests.fakes import metrics_text

    (tmp_path / "rank0.json").write_text(json.dumps(snap))
    text = metrics_text(tmp_path)
    return [ln for ln in text.splitlines() if ln.startswith("powersave_saving_state{") and f'saving="{saving}"' in ln]


def test_chunking_reports_off_with_the_drift_reason_when_the_lm_head_hook_is_lost(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    _lose(monkeypatch, LogitsProcessor, "_apply_head", "_get_logits")
    assert vllm_compat.register_logits_processor(lambda h: 0, lambda *a: None) is False
    assert "lm_head" in vllm_compat.disabled_features()
    rt = _runtime(monkeypatch, tmp_path, YES, extra={"chunking": {"table": [{"min_rows": 64, "chunks": 2}]}})
    try:
        snap = rt.snapshot()
    finally:
        rt.close()
    ch = snap["savings"]["chunking"]
    assert ch["state"] == "off" and "vLLM drift" in ch["why"] and "_apply_head" in ch["why"], ch
    lines = _scraped_states(tmp_path, snap, "chunking")
    assert len(lines) == 1 and 'state="off"' in lines[0], lines
    # The same table without the drift: on.
    assert (
        savings_state(load_settings({"chunking": {"table": [{"min_rows": 64, "chunks": 2}]}}, env={}), choose(perm=YES), None, False)[
            "chunking"
        ]["state"]
        == "on"
    )


def test_clocks_report_off_when_no_step_hook_is_installed(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    import importlib

    _lose(monkeypatch, importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner, "execute_model")
    try:  # the V2 runner where this build has it (its module needs Triton)
        _lose(monkeypatch, importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner, "execute_model")
    except ImportError:
        pass
    vllm_compat.install_step_hooks(lambda r, so: None, lambda r: None)
    assert "step_v1" in vllm_compat.disabled_features() and not vllm_compat.installed_features()
    rt = _runtime(monkeypatch, tmp_path, YES)
    try:
        snap = rt.snapshot()
    finally:
        rt.close()
    cl = snap["savings"]["clocks"]
    assert cl["state"] == "off" and "execute_model" in cl["why"], cl
    lines = _scraped_states(tmp_path, snap, "clocks")
    assert len(lines) == 1 and 'state="off"' in lines[0], lines
    # One runner's hook lost while the other's is in place: clocks still act there.
    st = savings_state(load_settings({}, env={}), choose(perm=YES), None, True, lost={"step_v1": "x"}, installed={"step_v2"})
    assert st["clocks"]["state"] != "off"
