"""`vllm-powersave tune` end to end on the CPU, clock-mode decisions, the sweep driver with a fake NVML,
and the preset's kernel-group clocks."""

import json

import pytest
import yaml
from fakes import FakeNvml

from vllm_powersave.cli import main
from vllm_powersave.clocks.backends import NvmlClockBackend
from vllm_powersave.clocks.mode import clock_permission
from vllm_powersave.device import NvmlGpu
from vllm_powersave.settings import load_settings
from vllm_powersave.tune.energy import Window
from vllm_powersave.tune.run import ENV_FORCE_DRY_RUN, GpuClockMeasurer, clock_mode
from vllm_powersave.tune.solver import DEFAULT

FAST = ["--profile-repeats", "1", "--window", "0.01", "--repeats", "2", "--rows", "8:decode,256:logprobs", "--no-progress"]


def test_tune_predict_on_cpu_writes_valid_preset_and_labelled_report(tiny_config, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_FORCE_DRY_RUN, raising=False)
    out = tmp_path / "out"
    assert main(["tune", str(tiny_config), "--out", str(out), *FAST]) == 0
    preset = yaml.safe_load((out / "preset.yaml").read_text())["powersave"]
    s = load_settings({"config_file": str(out / "preset.yaml")}, env={})
    assert s.chunking.table == ()  # simulated H200: every extra chunk re-reads the weight
    assert set(preset["clocks"]["presets"]) == {"prefill", "decode", "mixed", "idle"}
    summary = json.loads((out / "tune.json").read_text())
    decode = summary["clocks"]["solutions"]["decode"]["single"]
    assert summary["clocks"]["mode"] == "predict" and summary["clocks"]["reason"] == "no GPU"
    # The preset is the single-clock solution; the strict budget holds in the prediction.
    assert s.clocks.presets["decode"].sm_clock_mhz == decode["clocks_mhz"]["attention"]
    assert decode["slowdown"] <= 1e-9 and decode["saving"] > 0
    # Global across regions is never worse than one clock for the phase.
    for ph in ("prefill", "decode", "mixed"):
        sol = summary["clocks"]["solutions"][ph]
        assert sol["global_regions"]["energy_j"] <= sol["single"]["energy_j"] + 1e-15
    assert s.clocks.presets["idle"].sm_clock_mhz == 345
    report = (out / "report.md").read_text()
    assert "simulated" in report and "PREDICTED" in (out / "preset.yaml").read_text()
    assert (out / "report.png").stat().st_size > 10_000
    prof = summary["profile"]["decode"]
    assert abs(sum(r["share"] for r in prof["kinds"]) - 1) < 1e-9


def test_force_dry_run_wins_over_simulate_sweep(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_FORCE_DRY_RUN, "1")
    out = tmp_path / "forced"
    assert main(["tune", str(tiny_config), "--out", str(out), "--only", "clocks", "--simulate-sweep", "--phases", "decode", *FAST]) == 0
    summary = json.loads((out / "tune.json").read_text())
    assert summary["clocks"]["mode"] == "predict" and ENV_FORCE_DRY_RUN in summary["clocks"]["reason"]
    assert summary["chunking"] is None and "chunking" not in yaml.safe_load((out / "preset.yaml").read_text())["powersave"]


def test_simulated_sweep_reports_expected_vs_remeasured(tiny_config, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_FORCE_DRY_RUN, raising=False)
    out = tmp_path / "sim"
    assert (
        main(
            [
                "tune",
                str(tiny_config),
                "--out",
                str(out),
                "--only",
                "clocks",
                "--simulate-sweep",
                "--phases",
                "decode",
                "--sweep-points",
                "8",
                *FAST,
            ]
        )
        == 0
    )
    sw = json.loads((out / "tune.json").read_text())["clocks"]["sweeps"]["decode"]
    for solver in ("single", "global"):
        r = sw[solver]
        assert r["rounds"] and abs(r["expected_saving"] - r["remeasured_saving"]) <= r["tolerance"] or r["fell_back"]
    assert "re-measured" in (out / "report.md").read_text()


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["tune", str(tmp_path / "nope"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no config.json" in err[0]
    assert not out.exists()
    assert main(["tune", str(tmp_path / "nope"), "--out", str(out), "--phases", "decode,warmup"]) == 2
    assert "--phases" in capsys.readouterr().err


def test_clock_mode_decisions():
    assert clock_mode(False, False, True, True, {})[0] == "sweep"
    assert clock_mode(False, False, True, False, {})[0] == "predict"
    assert clock_mode(False, False, False, True, {})[0] == "predict"
    assert clock_mode(True, False, True, True, {})[0] == "predict"
    assert clock_mode(False, True, False, False, {})[0] == "simulated-sweep"
    assert clock_mode(False, False, True, True, {ENV_FORCE_DRY_RUN: "1"}) == (
        "predict",
        f"{ENV_FORCE_DRY_RUN}=1: clocks are never set here",
    )
    assert clock_mode(False, False, True, True, {ENV_FORCE_DRY_RUN: "0"})[0] == "sweep"


def test_clock_permission_reads_cap_sys_admin(tmp_path, monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    st = tmp_path / "status"
    st.write_text("Name:\tpython\nCapEff:\t0000000000200000\n")
    assert clock_permission(str(st)) == (True, "CAP_SYS_ADMIN")
    st.write_text("Name:\tpython\nCapEff:\t0000000000000000\n")
    assert clock_permission(str(st))[0] is False


def test_gpu_sweep_driver_locks_each_clock_once_and_resets():
    nv = FakeNvml()
    backend = NvmlClockBackend(NvmlGpu(nv, 0))
    seen = []

    def window(call, window_s, gpu):  # stands in for the NVML energy window
        call()
        f = nv.locked[0] if nv.locked else 1980
        seen.append(f)
        return Window(
            ms_per_call=1000.0 / f, j_per_call=f / 1000.0, window_s=window_s, calls=1, power_w=1.0, sm_clock_mhz=f, source="measured"
        )

    m = GpuClockMeasurer(backend, {"mlp": lambda: None}, {"mlp": 28.0}, 1.0, NvmlGpu(nv, 0), window_fn=window, settle_s=0.0)
    try:
        assert m("mlp", 1200) == pytest.approx((28 * 1 / 1200, 28 * 1.2))
        m("mlp", 1200)
        m("mlp", DEFAULT)
    finally:
        m.close()
    assert seen == [1200, 1200, 1980]
    assert [c for c in nv.calls if c[0] in ("set", "reset")] == [("set", 1200, 1200), ("reset",), ("reset",)]
    assert nv.locked is None


def test_preset_writes_kernel_group_clocks_only_with_measured_durations(tmp_path):
    from vllm_powersave.tune.run import TuneOptions, TuneResult, write_preset

    def result(kind):
        r = TuneResult(
            TuneOptions(model=str(tmp_path / "m")),
            tmp_path,
            {"kind": kind, "name": "NVIDIA H200" if kind == "cuda" else "cpu"},
            model_name="m",
            clock_mode=("predict", "test"),
            clock_source="test",
        )
        r.presets = {"prefill": {"sm_clock_mhz": 1500}, "decode": {"sm_clock_mhz": 900}, "idle": {"sm_clock_mhz": 345}}
        r.group_presets = {
            "prefill": {"attention": {"sm_clock_mhz": 1500, "duration_ms": 0.7}, "lm_head": {"sm_clock_mhz": 900, "duration_ms": 0.53741}},
            "decode": {"lm_head": {"sm_clock_mhz": 900, "duration_ms": 0.5}},
        }
        return r

    s = load_settings({"config_file": str(write_preset(result("cuda"), tmp_path / "gpu.yaml"))}, env={})
    g = s.clocks.presets["prefill"].groups
    assert set(g) == {"lm_head"} and g["lm_head"].sm_clock_mhz == 900 and g["lm_head"].duration_ms == pytest.approx(0.5374)
    assert not s.clocks.presets["decode"].groups  # same clock as the phase: nothing to switch
    assert s.tuned_for.gpu_name == "NVIDIA H200" and s.tuned_for.model == "m"
    # On a CPU the durations would be the simulator's: no kernel-group presets are written.
    s = load_settings({"config_file": str(write_preset(result("cpu"), tmp_path / "cpu.yaml"))}, env={})
    assert not s.clocks.presets["prefill"].groups
