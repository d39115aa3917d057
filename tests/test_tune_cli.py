"""`vllm-powersave tune` end to end on the CPU, clock-mode decisions, the sweep driver with a fake NVML,
and the two record scripts (LM-head record converter, solver vs public data)."""

import csv
import importlib
import json

import pytest
import yaml
from fakes import FakeNvml

from vllm_powersave.cli import main
from vllm_powersave.clocks.backends import NvmlClockBackend
from vllm_powersave.device import NvmlGpu
from vllm_powersave.settings import load_settings
from vllm_powersave.sim.gpu import H200
from vllm_powersave.tune.energy import Window
from vllm_powersave.tune.run import ENV_FORCE_DRY_RUN, GpuClockMeasurer, clock_mode, clock_permission
from vllm_powersave.tune.solver import DEFAULT


def _script(name):
    return importlib.import_module(f"benchmarks.{name}")


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


@pytest.mark.bench
def test_lmhead_record_converter(tmp_path):
    rec = _script("lmhead_chunking_record")
    pts = []
    for rows in (64, 4096):
        for rep in range(2):
            for c, (ms, j) in {1: (1.0, 1.0), 2: (0.8 if rows == 4096 else 2.0, 0.9 if rows == 4096 else 2.0)}.items():
                pts.append(
                    {
                        "hidden": 896,
                        "vocab": 151936,
                        "mode": "mm",
                        "kind": "decode",
                        "rows": rows,
                        "chunks": c,
                        "repeat": rep,
                        "ms": ms * (1 + 0.01 * rep),
                        "j_per_call": j * (1 + 0.01 * rep),
                        "window_s": 1.1,
                        "peak_mib": 10.0,
                        "energy_source": "measured",
                    }
                )
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"device": "NVIDIA H200", "torch": "2.11", "date": "2026-12-01", "method": "aligned", "results": pts}))
    out = tmp_path / "rec"
    assert rec.main([str(raw), "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    shape = doc["shapes"][0]
    assert shape["table"] == [{"min_rows": 4096, "chunks": 2}]
    r = {x["rows"]: x for x in shape["rows"]}
    assert r[64]["chosen_chunks"] == 1 and r[4096]["chosen_chunks"] == 2
    assert r[4096]["candidates"]["2"]["ms_min"] == pytest.approx(0.8) and r[4096]["candidates"]["2"]["ms_max"] == pytest.approx(0.808)
    md = out.with_suffix(".md").read_text()
    assert "4096x128256" in md and "Not in it" in md  # the 8B-class shape is missing from this raw file, and said so
    assert doc["windows_s"]["below_1s"] == 0 and doc["window_edges_aligned_to_counter_updates"] is True
    (tmp_path / "empty.json").write_text(json.dumps({"results": []}))
    assert rec.main([str(tmp_path / "empty.json"), "--out", str(out)]) == 2


@pytest.mark.bench
def test_solver_vs_public_on_a_known_curve(tmp_path):
    svp = _script("solver_vs_public")
    rows = []
    # A synthetic workload following the model exactly: the solver must pick the measured best.
    from vllm_powersave.tune.solver import TwoPointModel

    m = TwoPointModel(3000, 1 / 40.0, 0.3, 100.0, 250.0, 3000, 3000 * 345 / 1980, H200.v_min)  # the fit's default f_lo and v_min
    for f in (1500, 1800, 2100, 2400, 3000):
        for metric, v in (("throughput", 1 / m.t(f)), ("tokens_per_kJ", 1000 / m.e(f))):
            rows.append(
                {
                    "source": "Synthetic (test)",
                    "gpu": "GPU X",
                    "power_limit_w": "",
                    "workload": "w",
                    "phase": "decode",
                    "sm_clock_mhz": str(f),
                    "mem_clock_mhz": "",
                    "metric": metric,
                    "value": f"{v:.9f}",
                    "unit": "",
                    "exactness": "exact",
                    "notes": "",
                }
            )
    rows.append({**rows[0], "exactness": "verbal", "metric": "x", "value": "about 3"})
    p = tmp_path / "points.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    doc, md = svp.build(p)
    (wl,) = doc["workloads"]
    for b in wl["budgets"]:
        assert b["chosen_mhz"] == b["measured_best_mhz"]
        assert b["predicted_saving"] == pytest.approx(b["measured_best_saving"], abs=1e-6)
    assert wl["budgets"][0]["chosen_mhz"] == 3000  # strict: any lower clock is slower
    assert doc["not_checkable"][0]["reasons"] == ["verbal or relayed figure"]
    assert "No number here was measured by this project" in md


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
