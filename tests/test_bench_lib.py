"""benchmarks/lib: intervals and the dry-run guard; no benchmark imports pynvml."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.lib.device import require_dry_run
from benchmarks.lib.stats import mean_ci95, t975

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


def test_benchmarks_never_import_pynvml():
    offenders = [str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py") if "pynvml" in p.read_text()]
    assert offenders == []


def test_release_figures_time_the_fall_from_the_release_not_from_the_last_step():
    from benchmarks.h200_defaults import release_figures

    lines = [
        {"t": 10.0, "t_end": 11.0},
        {"boost": {"t_s": 9.8, "held": True, "ms": 170.0}},  # holds are not releases
        {"boost": {"t_s": 11.6, "held": False, "ms": 70.0}},
        {"t": 14.0, "t_end": 14.2},
        {"boost": {"t_s": 14.5, "held": False, "ms": None}},  # lost at shutdown: no dwell release
    ]
    # 10 Hz: boosted idle (126 W, 1980 MHz) until 12.8 s, then unboosted idle (80 W, 345 MHz).
    rows = [(10 + 0.1 * i, None, 126.0 if i < 28 else 80.0, 1980 if i < 29 else 345, 0) for i in range(50)]
    (r,) = release_figures(lines, rows, 15.0, 80.0, 95.0, 400, lambda t: 1000.0 + 100.0 * (t - 10.0))
    assert r["release_after_last_step_s"] == pytest.approx(0.6) and r["release_ms"] == 70.0
    assert r["power_fall_s"] == pytest.approx(1.2) and r["clock_fall_s"] == pytest.approx(1.3)
    assert r["gap_s"] == pytest.approx(3.0) and r["gap_excess_j"] == pytest.approx(300.0 - 240.0)


def test_a_records_load_summary_keeps_the_harness_client_check_and_window_edge(server_factory):
    """Records keep loadtests' own client check (so its threshold can be judged against GPU runs)
    and the window's stated edge error: the names must be the harness's."""
    from benchmarks.lib.load import summary
    from loadtests import BenchConfig, run

    srv = server_factory(first_delay=0.0, itl_delay=0.001)
    s = summary(run(BenchConfig(base_url=srv.url, num_prompts=8, output_len=4, input_len=2, max_concurrency=2, energy="none")))
    assert isinstance(s["client_loop_lag_p99_ms"], float) and isinstance(s["client_bottleneck_threshold_ms"], float)
    assert isinstance(s["client_bottleneck"], bool) and s["energy_window_edge_s"] == 0.0
