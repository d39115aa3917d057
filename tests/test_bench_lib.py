"""benchmarks/lib: intervals, ABBA order, energy windows through the plugin's meters, the dry-run guard."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from fakes import FakeNvmlDevices

from benchmarks.lib import energy
from benchmarks.lib.ab import abba, paired, ratio_summary, run_abba
from benchmarks.lib.device import require_dry_run
from benchmarks.lib.stats import mean_ci95, ratio_ci95, t975

pytestmark = pytest.mark.bench

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_mean_ci95_uses_students_t_with_n_minus_1_degrees_of_freedom():
    m, lo, hi = mean_ci95([1.0, 2.0, 3.0])  # sd 1, n 3: half width 4.303 / sqrt(3)
    assert m == 2.0
    assert (lo, hi) == pytest.approx((2.0 - 4.303 / math.sqrt(3), 2.0 + 4.303 / math.sqrt(3)))
    assert mean_ci95([5.0, 5.0]) == (5.0, 5.0, 5.0)
    assert t975(30) == 2.042 and t975(31) == 1.960


def test_a_single_value_has_no_interval():
    with pytest.raises(ValueError, match="at least 2 values"):
        mean_ci95([1.0])
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(0)


def test_ratio_ci95_is_the_interval_of_the_per_pair_ratios():
    ratio, lo, hi = ratio_ci95([100.0, 200.0, 50.0], [110.0, 220.0, 50.0])
    assert (ratio, lo, hi) == pytest.approx(mean_ci95([1.1, 1.1, 1.0]))
    assert lo < 1.0 < hi  # two pairs at +10 %, one at 0: no effect shown with 3 pairs
    with pytest.raises(ValueError, match="differ in length"):
        ratio_ci95([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="is 0"):
        ratio_ci95([0.0, 1.0], [1.0, 1.0])


def test_abba_alternates_which_arm_goes_first():
    assert list(abba("AB", 3)) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]
    seen = run_abba(("off", "on"), 2, lambda pair, arm: {"x": pair * 10 + (arm == "on")})
    assert [(w["pair"], w["arm"], w["x"]) for w in seen] == [(0, "off", 0), (0, "on", 1), (1, "on", 11), (1, "off", 10)]


def test_ratio_summary_leaves_out_a_pair_cut_short():
    windows = [
        {"pair": 0, "arm": "A", "tps": 100.0},
        {"pair": 0, "arm": "B", "tps": 90.0},
        {"pair": 1, "arm": "B", "tps": 120.0},
        {"pair": 1, "arm": "A", "tps": 100.0},
        {"pair": 2, "arm": "A", "tps": 100.0},
    ]  # the budget stopped pair 2 before B
    assert paired(windows, "tps") == ([100.0, 100.0], [90.0, 120.0])
    s = ratio_summary(windows, "tps")
    assert s["pairs"] == 2 and s["per_pair"] == pytest.approx([0.9, 1.2]) and s["mean"] == pytest.approx(1.05)
    assert "mean" not in ratio_summary(windows[:2], "tps")  # one pair: no interval


def test_require_dry_run_refuses_with_one_line_and_exit_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        require_dry_run(env={})
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: refusing to run: POWERSAVE_FORCE_DRY_RUN=1 must be set on a shared GPU"
    require_dry_run(env={"POWERSAVE_FORCE_DRY_RUN": "1"})


@pytest.mark.parametrize("script", ["h200_defaults"])
def test_device_scripts_refuse_to_start_without_forced_dry_run(script, monkeypatch, tmp_path):
    import importlib

    monkeypatch.delenv("POWERSAVE_FORCE_DRY_RUN", raising=False)
    mod = importlib.import_module(f"benchmarks.{script}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--shape", "qwen2.5-0.5b", "--out", str(tmp_path / "o" / "r.json")])
    assert e.value.code == 2 and not (tmp_path / "o").exists()


def test_energy_windows_come_from_the_plugins_meter():
    # 1 W instant power: the meter's interpolation past the last counter step adds < 0.1 J here.
    nvml = FakeNvmlDevices(uuids=("GPU-aaaa-0000", "GPU-bbbb-1111"), power_w=1.0)
    meters = energy.nvml_meters([0, 1], nvml=nvml)
    assert [m.gpu_id for m in meters] == ["GPU-aaaa-0000", "GPU-bbbb-1111"]
    s = energy.EnergySampler(meters)
    s.sample()
    time.sleep(0.05)
    nvml.energy_mj = [e + 10_000 for e in nvml.energy_mj]  # 10 J more on each GPU (200 W: a plausible step)
    s.sample()
    w = s.window(0.0, math.inf)
    assert w["avg_power_w"] == pytest.approx(2.0)  # summed over the TP group
    assert w["energy_j_counter"] == pytest.approx(20.0, abs=0.2)
    assert len(s.per_gpu_w) == 2 and s.per_gpu_w[0] == pytest.approx((1.0, 1.0))
    assert energy.EnergySampler(meters).window(0.0, 1.0) == {}  # no samples, no window


def test_benchmarks_never_import_pynvml():
    offenders = [str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py") if "pynvml" in p.read_text()]
    assert offenders == []
